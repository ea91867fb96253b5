//! forkd's `/v1` errors: a status and a message, sent as forkd's
//! `{"error": "..."}`.
//!
//! [`answer`] is the one place a node error ([`forkd_node::Error`]) becomes
//! an HTTP answer; its table is the unit test below. The node classifies
//! the errors of the crates below it by type (never by text), so nothing
//! here or in the handlers reads an error's message to pick a status.
//! Handlers make an [`ApiError`] of their own only for what is wrong with
//! the HTTP request itself (a query flag, an octal mode).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_node::error::GuestErrorKind;
use forkd_node::Error;

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, m)
    }
    pub fn internal(e: impl std::fmt::Display) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
}

/// The HTTP answer to a node error: the one table of `/v1`'s statuses.
/// Messages are the node's, but for an unreachable agent and a file too
/// large for one request, which `/v1` words its own way.
pub fn answer(e: Error) -> ApiError {
    let status = match &e {
        Error::NotFound { .. } => StatusCode::NOT_FOUND,
        Error::Invalid { .. } | Error::WrongState(_) => StatusCode::BAD_REQUEST,
        // As forkd: a snapshot that exists but cannot be restored here is a 409.
        Error::Conflict(_) | Error::Incompatible(_) => StatusCode::CONFLICT,
        Error::AtCapacity(_) | Error::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        Error::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        Error::Guest(a) => match a.kind {
            GuestErrorKind::BadRequest => StatusCode::BAD_REQUEST,
            GuestErrorKind::NotFound => StatusCode::NOT_FOUND,
            GuestErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
            GuestErrorKind::AlreadyExists
            | GuestErrorKind::NotADirectory
            | GuestErrorKind::IsADirectory
            | GuestErrorKind::DirectoryNotEmpty => StatusCode::CONFLICT,
            GuestErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            GuestErrorKind::NotReady | GuestErrorKind::Unsupported => StatusCode::CONFLICT,
            GuestErrorKind::Io | GuestErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        },
        Error::GuestTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        Error::GuestUnreachable(_) | Error::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let message = match e {
        Error::GuestUnreachable(m) => format!("sandbox agent unreachable: {m}"),
        Error::TooLarge { what, size, limit } => format!(
            "{what} is {size} bytes, over the {limit}-byte limit of one request; read it in parts with offset and len"
        ),
        e => e.to_string(),
    };
    ApiError::new(status, message)
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        answer(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(serde_json::json!({ "error": self.message })),
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkd_node::error::{AgentError, Kind};

    fn guest(kind: GuestErrorKind) -> Error {
        Error::Guest(AgentError::new(kind, "/x: gone"))
    }

    /// The whole table: every kind of node error, its status and message.
    #[test]
    fn every_node_error_has_its_status() {
        let table: Vec<(Error, u16, &str)> = vec![
            (
                Error::not_found(Kind::Sandbox, "sb-1"),
                404,
                "sandbox \"sb-1\" not found",
            ),
            (
                Error::not_found(Kind::Snapshot, "t"),
                404,
                "snapshot \"t\" not found",
            ),
            (Error::invalid("n", "n must be ≥ 1"), 400, "n must be ≥ 1"),
            (Error::WrongState("not running".into()), 400, "not running"),
            (Error::Conflict("taken".into()), 409, "taken"),
            (Error::Incompatible("QEMU 8".into()), 409, "QEMU 8"),
            (Error::AtCapacity("at capacity".into()), 503, "at capacity"),
            (Error::Unavailable("floor".into()), 503, "floor"),
            (
                Error::TooLarge {
                    what: "/big".into(),
                    size: 10,
                    limit: 5,
                },
                413,
                "/big is 10 bytes, over the 5-byte limit of one request; read it in parts with offset and len",
            ),
            (guest(GuestErrorKind::BadRequest), 400, "bad_request: /x: gone"),
            (guest(GuestErrorKind::NotFound), 404, "not_found: /x: gone"),
            (guest(GuestErrorKind::PermissionDenied), 403, "permission_denied: /x: gone"),
            (guest(GuestErrorKind::AlreadyExists), 409, "already_exists: /x: gone"),
            (guest(GuestErrorKind::NotADirectory), 409, "not_a_directory: /x: gone"),
            (guest(GuestErrorKind::IsADirectory), 409, "is_a_directory: /x: gone"),
            (guest(GuestErrorKind::DirectoryNotEmpty), 409, "directory_not_empty: /x: gone"),
            (guest(GuestErrorKind::Timeout), 504, "timeout: /x: gone"),
            (guest(GuestErrorKind::NotReady), 409, "not_ready: /x: gone"),
            (guest(GuestErrorKind::Unsupported), 409, "unsupported: /x: gone"),
            (guest(GuestErrorKind::Io), 500, "io: /x: gone"),
            (guest(GuestErrorKind::Internal), 500, "internal: /x: gone"),
            (
                Error::GuestTimeout("no reply from the agent within 5s".into()),
                504,
                "no reply from the agent within 5s",
            ),
            (
                Error::GuestUnreachable("agent channel: connection closed".into()),
                500,
                "sandbox agent unreachable: agent channel: connection closed",
            ),
            (
                Error::Internal(anyhow::anyhow!("disk").context("saving")),
                500,
                "saving: disk",
            ),
        ];
        for (e, status, message) in table {
            let what = format!("{e:?}");
            let a = answer(e);
            assert_eq!(
                (a.status.as_u16(), a.message.as_str()),
                (status, message),
                "{what}"
            );
        }
    }
}
