//! The Connect protocol (v1, JSON codec) as the E2B SDK speaks it to envd:
//! unary calls are a JSON body in and out; server-streaming calls are one
//! enveloped request message in and a sequence of enveloped messages out,
//! closed by an end-of-stream envelope. Pure framing, no I/O.
//!
//! Envelope: `flags: u8 | length: u32 big-endian | payload`. Flag `0x02`
//! marks the end-of-stream message; `0x01` (compressed) is refused, since
//! the SDK never compresses and poold advertises identity only.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde_json::{json, Value};

/// Flag of a data message.
pub const FLAG_DATA: u8 = 0x00;
/// Flag of a compressed message (refused).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Flag of the end-of-stream message.
pub const FLAG_END: u8 = 0x02;
/// Largest request message accepted (a process config or a path).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

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
        envelope(FLAG_END, &json_bytes(&json!({"error": self.to_json()})))
    }
}

impl IntoResponse for RpcError {
    /// The unary error answer: the code's status and a JSON body.
    fn into_response(self) -> Response {
        (
            self.code.http_status(),
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            json_bytes(&self.to_json()),
        )
            .into_response()
    }
}

fn json_bytes(v: &impl Serialize) -> Vec<u8> {
    // Serializing a `Value` or a derived struct of strings cannot fail.
    serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec())
}

/// One envelope.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// A data envelope holding `msg` as JSON.
pub fn message(msg: &impl Serialize) -> Bytes {
    envelope(FLAG_DATA, &json_bytes(msg))
}

/// The successful end-of-stream envelope (`{}`).
pub fn end_ok() -> Bytes {
    envelope(FLAG_END, b"{}")
}

/// The single request message of a server-streaming call: exactly one
/// uncompressed data envelope filling the body.
pub fn single_message(body: &[u8]) -> RpcResult<&[u8]> {
    if body.len() < 5 {
        return Err(RpcError::invalid(format!(
            "a streaming request must be one Connect envelope (5-byte header, then the message); got {} bytes",
            body.len()
        )));
    }
    let flags = body[0];
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if flags & FLAG_COMPRESSED != 0 {
        return Err(RpcError::invalid(
            "compressed messages are not accepted; send Connect-Content-Encoding: identity",
        ));
    }
    if flags != FLAG_DATA {
        return Err(RpcError::invalid(format!(
            "the request envelope has flags {flags:#04x}; want a data message (0x00)"
        )));
    }
    if len > MAX_REQUEST_BYTES {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("request message of {len} bytes; at most {MAX_REQUEST_BYTES}"),
        ));
    }
    if body.len() != 5 + len {
        return Err(RpcError::invalid(format!(
            "the envelope says {len} bytes but the body holds {} after the header; send exactly one message",
            body.len() - 5
        )));
    }
    Ok(&body[5..])
}

/// Parses a request message as JSON into `T`.
pub fn parse<T: serde::de::DeserializeOwned>(msg: &[u8]) -> RpcResult<T> {
    let msg = if msg.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        msg
    };
    serde_json::from_slice(msg).map_err(|e| RpcError::invalid(format!("bad request message: {e}")))
}

/// A unary success answer: 200 with `msg` as JSON.
pub fn unary_ok(msg: &impl Serialize) -> Response {
    (
        StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        json_bytes(msg),
    )
        .into_response()
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
    fn envelope_round_trip() {
        let m = message(&json!({"process": {"cmd": "/bin/bash"}}));
        assert_eq!(m[0], FLAG_DATA);
        let inner = single_message(&m).unwrap();
        let v: Value = parse(inner).unwrap();
        assert_eq!(v["process"]["cmd"], "/bin/bash");
        assert_eq!(&end_ok()[..], &[2, 0, 0, 0, 2, b'{', b'}']);
    }

    #[test]
    fn refuses_malformed_envelopes() {
        let good = message(&json!({}));
        assert!(single_message(&good[..4]).is_err());
        let mut compressed = good.to_vec();
        compressed[0] = FLAG_COMPRESSED;
        assert!(single_message(&compressed).unwrap_err().message.contains("identity"));
        let mut trailing = good.to_vec();
        trailing.push(b' ');
        assert!(single_message(&trailing).is_err());
        let mut short = good.to_vec();
        short.pop();
        assert!(single_message(&short).is_err());
        let huge = [0u8, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            single_message(&huge).unwrap_err().code,
            Code::ResourceExhausted
        );
        assert!(single_message(&end_ok()).is_err());
    }

    #[test]
    fn errors_carry_code_and_status() {
        let e = RpcError::new(Code::NotFound, "process 7 not found");
        assert_eq!(e.code.http_status(), StatusCode::NOT_FOUND);
        let eos = e.end_of_stream();
        assert_eq!(eos[0], FLAG_END);
        let v: Value = serde_json::from_slice(&eos[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["message"], "process 7 not found");
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
    }

    #[test]
    fn empty_unary_body_is_an_empty_message() {
        let v: Value = parse(b"").unwrap();
        assert_eq!(v, json!({}));
        assert!(parse::<Value>(b"{nope").is_err());
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
