//! Every error the E2B endpoints answer with, and how it goes on the wire:
//! the one place E2B errors become statuses.
//!
//! Two shapes, as the SDK expects them:
//! - [`E2bError`]: the REST shape `{"code": <status>, "message"}` of the
//!   control plane, envd's `/files` and the code interpreter's `/execute`;
//! - [`RpcError`]: a Connect error (`{"code": "not_found", "message"}`),
//!   answered with its code's status on unary calls and inside the
//!   end-of-stream message on streaming ones.
//!
//! A node error becomes either through one function, [`from_node`], whose
//! table is the unit test below: a missing guest file is a 404 /
//! `not_found` whichever way the SDK asked, and the REST shape keeps the
//! statuses forkd's `/v1` gives the same errors.

use crate::connect;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use forkd_node::error::GuestErrorKind as K;
use forkd_node::Error;
use serde_json::{json, Value};

/// A REST error answer: `{"code": <status>, "message"}`.
#[derive(Debug)]
pub struct E2bError {
    /// The HTTP status (also the body's `code`).
    pub status: StatusCode,
    /// What went wrong and what to do.
    pub message: String,
}

/// Result of a REST handler.
pub type E2bResult<T> = Result<T, E2bError>;

/// A node error on E2B's two wires (see [`from_node`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wire {
    /// The REST shape's status.
    pub status: StatusCode,
    /// The REST shape's message.
    pub message: String,
    /// The Connect code.
    pub code: Code,
    /// The Connect message (envd's words: an agent's message without its kind).
    pub rpc_message: String,
}

/// How a node error goes on E2B's wires: the one table.
pub fn from_node(e: Error) -> Wire {
    let (status, code) = match &e {
        Error::NotFound { .. } => (StatusCode::NOT_FOUND, Code::NotFound),
        Error::Invalid { .. } => (StatusCode::BAD_REQUEST, Code::InvalidArgument),
        Error::WrongState(_) => (StatusCode::BAD_REQUEST, Code::FailedPrecondition),
        Error::Conflict(_) => (StatusCode::CONFLICT, Code::AlreadyExists),
        Error::Incompatible(_) => (StatusCode::CONFLICT, Code::FailedPrecondition),
        Error::AtCapacity(_) => (StatusCode::SERVICE_UNAVAILABLE, Code::ResourceExhausted),
        Error::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable),
        Error::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, Code::ResourceExhausted),
        Error::Guest(a) => match a.kind {
            K::BadRequest => (StatusCode::BAD_REQUEST, Code::InvalidArgument),
            K::NotFound => (StatusCode::NOT_FOUND, Code::NotFound),
            K::PermissionDenied => (StatusCode::FORBIDDEN, Code::PermissionDenied),
            K::AlreadyExists => (StatusCode::CONFLICT, Code::AlreadyExists),
            K::NotADirectory | K::IsADirectory | K::DirectoryNotEmpty => {
                (StatusCode::CONFLICT, Code::InvalidArgument)
            }
            K::Timeout => (StatusCode::GATEWAY_TIMEOUT, Code::DeadlineExceeded),
            K::NotReady => (StatusCode::CONFLICT, Code::Unavailable),
            K::Unsupported => (StatusCode::CONFLICT, Code::Unimplemented),
            K::Io | K::Internal => (StatusCode::INTERNAL_SERVER_ERROR, Code::Internal),
        },
        Error::GuestTimeout(_) => (StatusCode::GATEWAY_TIMEOUT, Code::DeadlineExceeded),
        Error::GuestUnreachable(_) => (StatusCode::INTERNAL_SERVER_ERROR, Code::Unavailable),
        Error::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, Code::Internal),
    };
    let (message, rpc_message) = match e {
        Error::Guest(a) => (a.to_string(), a.message),
        Error::GuestUnreachable(m) => (
            format!("sandbox agent unreachable: {m}"),
            format!("the sandbox's agent cannot be reached: {m}"),
        ),
        Error::TooLarge { what, size, limit } => {
            let m = format!("{what} is {size} bytes; one download is at most {limit}");
            (m.clone(), m)
        }
        e => {
            let m = e.to_string();
            (m.clone(), m)
        }
    };
    Wire {
        status,
        message,
        code,
        rpc_message,
    }
}

impl From<Error> for E2bError {
    fn from(e: Error) -> E2bError {
        let w = from_node(e);
        E2bError::new(w.status, w.message)
    }
}

impl From<forkd_e2b_volumes::Error> for E2bError {
    fn from(e: forkd_e2b_volumes::Error) -> E2bError {
        E2bError::new(e.status, e.message)
    }
}

impl From<Error> for RpcError {
    fn from(e: Error) -> RpcError {
        let w = from_node(e);
        RpcError::new(w.code, w.rpc_message)
    }
}

impl E2bError {
    /// An error with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError {
            status,
            message: message.into(),
        }
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
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            Json(json!({"code": self.status.as_u16(), "message": self.message})),
        )
            .into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
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
    /// The operation does not apply in the current state.
    FailedPrecondition,
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
            Code::FailedPrecondition => "failed_precondition",
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
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
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

    fn guest(kind: K) -> Error {
        Error::Guest(forkd_node::error::AgentError::new(kind, "/x: gone"))
    }

    /// The whole table: each kind of node error on both wires.
    #[test]
    fn node_errors_on_both_wires() {
        use forkd_node::Kind;
        let table: Vec<(Error, u16, &str, Code, &str)> = vec![
            (
                Error::not_found(Kind::Sandbox, "sb-1"),
                404,
                "sandbox \"sb-1\" not found",
                Code::NotFound,
                "sandbox \"sb-1\" not found",
            ),
            (
                Error::invalid("n", "n must be ≥ 1"),
                400,
                "n must be ≥ 1",
                Code::InvalidArgument,
                "n must be ≥ 1",
            ),
            (
                Error::WrongState("w".into()),
                400,
                "w",
                Code::FailedPrecondition,
                "w",
            ),
            (
                Error::Conflict("c".into()),
                409,
                "c",
                Code::AlreadyExists,
                "c",
            ),
            (
                Error::Incompatible("q".into()),
                409,
                "q",
                Code::FailedPrecondition,
                "q",
            ),
            (
                Error::AtCapacity("full".into()),
                503,
                "full",
                Code::ResourceExhausted,
                "full",
            ),
            (
                Error::Unavailable("floor".into()),
                503,
                "floor",
                Code::Unavailable,
                "floor",
            ),
            (
                Error::TooLarge {
                    what: "/big".into(),
                    size: 10,
                    limit: 5,
                },
                413,
                "/big is 10 bytes; one download is at most 5",
                Code::ResourceExhausted,
                "/big is 10 bytes; one download is at most 5",
            ),
            (
                guest(K::BadRequest),
                400,
                "bad_request: /x: gone",
                Code::InvalidArgument,
                "/x: gone",
            ),
            (
                guest(K::NotFound),
                404,
                "not_found: /x: gone",
                Code::NotFound,
                "/x: gone",
            ),
            (
                guest(K::PermissionDenied),
                403,
                "permission_denied: /x: gone",
                Code::PermissionDenied,
                "/x: gone",
            ),
            (
                guest(K::AlreadyExists),
                409,
                "already_exists: /x: gone",
                Code::AlreadyExists,
                "/x: gone",
            ),
            (
                guest(K::NotADirectory),
                409,
                "not_a_directory: /x: gone",
                Code::InvalidArgument,
                "/x: gone",
            ),
            (
                guest(K::IsADirectory),
                409,
                "is_a_directory: /x: gone",
                Code::InvalidArgument,
                "/x: gone",
            ),
            (
                guest(K::DirectoryNotEmpty),
                409,
                "directory_not_empty: /x: gone",
                Code::InvalidArgument,
                "/x: gone",
            ),
            (
                guest(K::Timeout),
                504,
                "timeout: /x: gone",
                Code::DeadlineExceeded,
                "/x: gone",
            ),
            (
                guest(K::NotReady),
                409,
                "not_ready: /x: gone",
                Code::Unavailable,
                "/x: gone",
            ),
            (
                guest(K::Unsupported),
                409,
                "unsupported: /x: gone",
                Code::Unimplemented,
                "/x: gone",
            ),
            (
                guest(K::Io),
                500,
                "io: /x: gone",
                Code::Internal,
                "/x: gone",
            ),
            (
                guest(K::Internal),
                500,
                "internal: /x: gone",
                Code::Internal,
                "/x: gone",
            ),
            (
                Error::GuestTimeout("no reply".into()),
                504,
                "no reply",
                Code::DeadlineExceeded,
                "no reply",
            ),
            (
                Error::GuestUnreachable("agent channel: closed".into()),
                500,
                "sandbox agent unreachable: agent channel: closed",
                Code::Unavailable,
                "the sandbox's agent cannot be reached: agent channel: closed",
            ),
            (Error::internal("boom"), 500, "boom", Code::Internal, "boom"),
        ];
        for (e, status, message, code, rpc_message) in table {
            let what = format!("{e:?}");
            let w = from_node(e);
            assert_eq!(
                (
                    w.status.as_u16(),
                    w.message.as_str(),
                    w.code,
                    w.rpc_message.as_str()
                ),
                (status, message, code, rpc_message),
                "{what}"
            );
        }
    }
}
