//! API errors: a status and a message, sent as forkd's `{"error": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

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
    pub fn not_found(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, m)
    }
    pub fn conflict(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, m)
    }
    pub fn unavailable(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m)
    }
    pub fn internal(e: impl std::fmt::Display) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
    /// An internal error with its whole context chain.
    pub fn from_anyhow(e: anyhow::Error) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"))
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

/// The tag rule's error as a 400, in forkd's words.
pub fn check_tag(tag: &str) -> ApiResult<()> {
    forkd_layers::validate_tag(tag).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// Maps an agent error to the closest HTTP status.
pub fn agent_error(e: crate::vm::agent::CallError) -> ApiError {
    use crate::vm::agent::CallError;
    use rootfs_init::protocol::ErrorKind;
    match &e {
        CallError::Agent(a) => {
            let status = match a.kind {
                ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
                ErrorKind::NotFound => StatusCode::NOT_FOUND,
                ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
                ErrorKind::AlreadyExists
                | ErrorKind::NotADirectory
                | ErrorKind::IsADirectory
                | ErrorKind::DirectoryNotEmpty => StatusCode::CONFLICT,
                ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
                ErrorKind::NotReady | ErrorKind::Unsupported => StatusCode::CONFLICT,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            ApiError::new(status, a.to_string())
        }
        CallError::Timeout(_) => ApiError::new(StatusCode::GATEWAY_TIMEOUT, e.to_string()),
        CallError::Channel(_) => ApiError::internal(format!("sandbox agent unreachable: {e}")),
    }
}

/// Runs a handler's work on a task of its own. axum drops a handler when
/// its client disconnects; work that starts VMs, pauses a sandbox or
/// deletes must not stop halfway, so it always runs to the end and leaves
/// the daemon's state consistent (the answer is then simply not read).
pub async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = ApiResult<T>> + Send + 'static,
) -> ApiResult<T> {
    tokio::spawn(work)
        .await
        .map_err(|e| ApiError::internal(format!("request task failed: {e}")))?
}
