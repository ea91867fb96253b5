//! What goes wrong with a volume, as a status and a message that says
//! what to do. The content API answers it in E2B's error shape
//! (`{"code", "message"}`), the one place this crate speaks the wire; the
//! E2B control plane maps it into its own error (forkd-e2b).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// A refused or failed volume operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// The HTTP status E2B's API answers it with.
    pub status: StatusCode,
    /// What was wrong and what to do.
    pub message: String,
}

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    /// 400: the request is malformed; the message says what to send.
    pub fn bad_request(message: impl Into<String>) -> Error {
        Error::new(StatusCode::BAD_REQUEST, message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Error {
        Error::new(StatusCode::NOT_FOUND, message)
    }

    /// 401: a missing or wrong volume token.
    pub fn unauthorized(message: impl Into<String>) -> Error {
        Error::new(StatusCode::UNAUTHORIZED, message)
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for Error {}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let body = json!({"code": self.status.as_u16(), "message": self.message});
        (self.status, Json(body)).into_response()
    }
}
