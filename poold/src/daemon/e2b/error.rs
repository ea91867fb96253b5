//! Every error the E2B endpoints answer with, and how it goes on the wire:
//! the one place E2B errors become statuses.
//!
//! Two shapes, as the SDK expects them:
//! - [`E2bError`]: the REST shape `{"code": <status>, "message"}` of the
//!   control plane, envd's `/files` and the code interpreter's `/execute`;
//!   poold's own [`ApiError`]s (spawn, TTL, agent failures) convert into it
//!   keeping their status;
//! - [`RpcError`]: a Connect error (`{"code": "not_found", "message"}`),
//!   answered with its code's status on unary calls and inside the
//!   end-of-stream message on streaming ones.
//!
//! Agent failures map to both here ([`E2bError::from_agent`],
//! [`from_agent`]), so a missing guest file is a 404 / `not_found` whichever
//! way the SDK asked.

use super::connect;
use crate::daemon::error::{agent_error, ApiError};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::{json, Value};

/// A REST error answer: `{"code": <status>, "message"}`.
#[derive(Debug)]
pub struct E2bError(pub ApiError);

/// Result of a REST handler.
pub type E2bResult<T> = Result<T, E2bError>;

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> E2bError {
        E2bError(e)
    }
}

impl E2bError {
    /// An error with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError(ApiError::new(status, message))
    }

    /// 400: the request is malformed; the message says what to send.
    pub fn bad_request(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::BAD_REQUEST, message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::NOT_FOUND, message)
    }

    /// 401: missing or wrong key or access token.
    pub fn unauthorized(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::UNAUTHORIZED, message)
    }

    /// 502: the sandbox a request names is not there (the SDK reads a 502
    /// from the sandbox plane as "sandbox not running").
    pub fn sandbox_gone(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::BAD_GATEWAY, message)
    }

    /// An agent call's failure, with the status poold's `/v1` gives it.
    pub fn from_agent(e: forkd_vmm::CallError) -> E2bError {
        E2bError(agent_error(e))
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let mut r = (
            self.0.status,
            Json(json!({"code": self.0.status.as_u16(), "message": self.0.message})),
        )
            .into_response();
        if self.0.status == StatusCode::SERVICE_UNAVAILABLE {
            // At capacity or short of memory: the SDK would retry at once.
            r.headers_mut()
                .insert("retry-after", HeaderValue::from_static("5"));
        }
        r
    }
}

/// Connect error codes (the subset envd and poold answer with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// The client went away.
    Canceled,
    /// The request is malformed or names something impossible.
    InvalidArgument,
    /// The deadline passed.
    DeadlineExceeded,
    /// No such process, file or sandbox.
    NotFound,
    /// The path exists already.
    AlreadyExists,
    /// Refused (a user poold cannot run as, a guest EACCES).
    PermissionDenied,
    /// A per-sandbox bound was reached.
    ResourceExhausted,
    /// Not served by poold (see docs/e2b.md).
    Unimplemented,
    /// A bug or broken state.
    Internal,
    /// The sandbox's agent cannot be reached.
    Unavailable,
    /// Missing or wrong access token.
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code.
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A Connect error: a code a program branches on, a message a person acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcError {
    /// The code.
    pub code: Code,
    /// What went wrong and what to do.
    pub message: String,
}

/// Result of an RPC handler.
pub type RpcResult<T> = Result<T, RpcError>;

impl RpcError {
    /// An error with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    /// `invalid_argument`.
    pub fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::InvalidArgument, message)
    }

    /// `unimplemented`, naming what is not served.
    pub fn unimplemented(what: &str) -> RpcError {
        RpcError::new(
            Code::Unimplemented,
            format!("{what} is not served by poold's E2B endpoints (docs/e2b.md lists what is)"),
        )
    }

    /// The error's JSON: `{"code","message"}`.
    pub fn to_json(&self) -> Value {
        json!({"code": self.code.as_str(), "message": self.message})
    }

    /// The end-of-stream envelope that carries this error.
    pub fn end_of_stream(&self) -> Bytes {
        connect::envelope(
            connect::FLAG_END,
            &connect::json_bytes(&json!({"error": self.to_json()})),
        )
    }
}

impl IntoResponse for RpcError {
    /// The unary error answer: the code's status and a JSON body.
    fn into_response(self) -> Response {
        (
            self.code.http_status(),
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            connect::json_bytes(&self.to_json()),
        )
            .into_response()
    }
}

/// Maps an agent call's failure to the Connect code envd would give.
pub fn from_agent(e: forkd_vmm::CallError) -> RpcError {
    use forkd_vmm::CallError;
    use rootfs_init::protocol::ErrorKind as K;
    match e {
        CallError::Agent(a) => {
            let code = match a.kind {
                K::BadRequest | K::NotADirectory | K::IsADirectory | K::DirectoryNotEmpty => {
                    Code::InvalidArgument
                }
                K::NotFound => Code::NotFound,
                K::PermissionDenied => Code::PermissionDenied,
                K::AlreadyExists => Code::AlreadyExists,
                K::Timeout => Code::DeadlineExceeded,
                K::NotReady => Code::Unavailable,
                K::Unsupported => Code::Unimplemented,
                K::Io | K::Internal => Code::Internal,
            };
            RpcError::new(code, a.message)
        }
        CallError::Timeout(_) => RpcError::new(Code::DeadlineExceeded, e.to_string()),
        CallError::Channel(_) => RpcError::new(
            Code::Unavailable,
            format!("the sandbox's agent cannot be reached: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rest_errors_have_the_sdk_shape() {
        let r = E2bError::not_found("gone").into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let r = E2bError::new(StatusCode::SERVICE_UNAVAILABLE, "full").into_response();
        assert_eq!(r.headers()["retry-after"], "5");
    }

    #[test]
    fn rpc_errors_carry_code_and_status() {
        let e = RpcError::new(Code::NotFound, "process 7 not found");
        assert_eq!(e.code.http_status(), StatusCode::NOT_FOUND);
        let eos = e.end_of_stream();
        assert_eq!(eos[0], connect::FLAG_END);
        let v: Value = serde_json::from_slice(&eos[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["message"], "process 7 not found");
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
    }

    #[test]
    fn agent_errors_map_to_envd_codes() {
        use rootfs_init::protocol::{AgentError, ErrorKind};
        let e = from_agent(forkd_vmm::CallError::Agent(AgentError::new(
            ErrorKind::NotFound,
            "/x: gone",
        )));
        assert_eq!((e.code, e.message.as_str()), (Code::NotFound, "/x: gone"));
        let e = from_agent(forkd_vmm::CallError::Channel("closed".into()));
        assert_eq!(e.code, Code::Unavailable);
    }
}
