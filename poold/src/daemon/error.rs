//! API errors: a status and a message, sent as forkd's `{"error": "..."}`.
//!
//! Domain errors (a snapshot that is missing or cannot be restored here, an
//! image not built, a bad create spec, a refused delete) are typed where
//! they arise (`snapshot::SnapshotError`, `images::ImageError`,
//! `snapshot::delete::DeleteError`) and become HTTP answers in one place,
//! [`ApiError::from_anyhow`] via [`Domain::status`]. Nothing here or in the
//! handlers classifies an error by its text: an error that is none of these
//! is a 500 carrying its whole context chain. Workspace refusals
//! (`workspace::WorkspaceError`) become answers in `From` below.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_snapshot::delete::DeleteError;
use forkd_snapshot::images::ImageError;
use forkd_snapshot::SnapshotError;

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
    /// The answer to a failed operation: the status of the first domain
    /// error in `e`'s chain (see [`Domain::status`]), else 500; the message
    /// is the whole context chain, except where forkd's API has its own
    /// words (a missing snapshot, a refused delete).
    pub fn from_anyhow(e: anyhow::Error) -> ApiError {
        let Some(dom) = Domain::find(&e) else {
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"));
        };
        let message = match dom {
            Domain::Snapshot(SnapshotError::NotFound { tag }) => {
                format!("snapshot {tag:?} not found")
            }
            Domain::Delete(d) => d.to_string(),
            _ => format!("{e:#}"),
        };
        ApiError::new(dom.status(), message)
    }
}

/// A domain error found in an `anyhow` chain.
#[derive(Debug, Clone, Copy)]
pub enum Domain<'a> {
    /// A snapshot that is missing, unreadable or not restorable here, or a
    /// create spec no VM can be.
    Snapshot(&'a SnapshotError),
    /// An image that is not built.
    Image(&'a ImageError),
    /// A snapshot delete that was refused.
    Delete(&'a DeleteError),
}

impl<'a> Domain<'a> {
    /// The outermost domain error in `e`'s chain, found by type.
    pub fn find(e: &'a anyhow::Error) -> Option<Domain<'a>> {
        e.chain().find_map(|c| {
            c.downcast_ref::<SnapshotError>()
                .map(Domain::Snapshot)
                .or_else(|| c.downcast_ref::<ImageError>().map(Domain::Image))
                .or_else(|| c.downcast_ref::<DeleteError>().map(Domain::Delete))
        })
    }

    /// The HTTP status of each domain error: the one table.
    pub fn status(self) -> StatusCode {
        match self {
            Domain::Snapshot(SnapshotError::NotFound { .. }) => StatusCode::NOT_FOUND,
            // As forkd: a snapshot that exists but cannot be restored here
            // (its record unreadable, another QEMU, a file missing) is a 409.
            Domain::Snapshot(
                SnapshotError::Unreadable { .. }
                | SnapshotError::Corrupt { .. }
                | SnapshotError::Incompatible { .. }
                | SnapshotError::MissingFile { .. }
                | SnapshotError::FileUnreadable { .. },
            ) => StatusCode::CONFLICT,
            Domain::Snapshot(SnapshotError::BadSpec(_)) => StatusCode::BAD_REQUEST,
            Domain::Snapshot(SnapshotError::RemoteUnavailable { .. }) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Domain::Image(ImageError::NotBuilt { .. }) => StatusCode::BAD_REQUEST,
            Domain::Delete(DeleteError::NotFound(_)) => StatusCode::NOT_FOUND,
            Domain::Delete(DeleteError::HasDependents { .. } | DeleteError::InUse { .. }) => {
                StatusCode::CONFLICT
            }
        }
    }
}

impl From<super::workspace::WorkspaceError> for ApiError {
    fn from(e: super::workspace::WorkspaceError) -> ApiError {
        use super::workspace::WorkspaceError as W;
        let status = match &e {
            W::BadName(_) | W::WrongStatus { .. } => StatusCode::BAD_REQUEST,
            W::NotFound(_) => StatusCode::NOT_FOUND,
            W::Exists(_) | W::Busy { .. } | W::StateInUse { .. } => StatusCode::CONFLICT,
        };
        ApiError::new(status, e.to_string())
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
pub fn agent_error(e: forkd_vmm::CallError) -> ApiError {
    use forkd_vmm::CallError;
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

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    fn answer(e: impl Into<anyhow::Error>) -> (StatusCode, String) {
        let a = ApiError::from_anyhow(e.into());
        (a.status, a.message)
    }

    fn io() -> std::io::Error {
        std::io::Error::from_raw_os_error(2)
    }

    #[test]
    fn snapshot_errors() {
        assert_eq!(
            answer(SnapshotError::NotFound { tag: "t".into() }),
            (StatusCode::NOT_FOUND, "snapshot \"t\" not found".into())
        );
        // Found under context too, and by type, whatever the text says.
        let e = anyhow::Error::from(SnapshotError::Incompatible {
            reason: "snapshot was taken with QEMU 8".into(),
        })
        .context("restoring");
        assert_eq!(
            answer(e),
            (
                StatusCode::CONFLICT,
                "restoring: snapshot was taken with QEMU 8".into()
            )
        );
        let (st, msg) = answer(SnapshotError::Unreadable {
            path: "/m/t/snapshot.json".into(),
            source: io(),
        });
        assert_eq!(st, StatusCode::CONFLICT);
        assert!(msg.starts_with("reading /m/t/snapshot.json: "), "{msg}");
        let id: forkd_layers::SnapshotId = "0".repeat(32).parse().unwrap();
        for e in [
            SnapshotError::MissingFile {
                id,
                file: "vmstate",
            },
            SnapshotError::FileUnreadable {
                id,
                file: "memory.bin",
                path: "/m/x".into(),
                source: io(),
            },
            SnapshotError::Corrupt {
                path: "/x".into(),
                source: serde_json::from_str::<u8>("x").unwrap_err(),
            },
        ] {
            assert_eq!(answer(e).0, StatusCode::CONFLICT);
        }
        assert_eq!(
            answer(SnapshotError::BadSpec(
                "memory must be at least 64 MiB".into()
            )),
            (
                StatusCode::BAD_REQUEST,
                "memory must be at least 64 MiB".into()
            )
        );
    }

    #[test]
    fn image_and_delete_errors() {
        let (st, msg) = answer(ImageError::NotBuilt {
            name: "py".into(),
            meta: "/i/py/image.json".into(),
            error: io(),
        });
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert!(
            msg.starts_with("image \"py\" is not built (/i/py/image.json: "),
            "{msg}"
        );
        assert!(msg.ends_with("`forkd image build --recipe py`"), "{msg}");
        assert_eq!(
            answer(DeleteError::NotFound("t".into())),
            (StatusCode::NOT_FOUND, "no snapshot \"t\"".into())
        );
        let e = anyhow::Error::from(DeleteError::InUse {
            what: "t".into(),
            open_handles: 2,
        });
        let (st, msg) = answer(e);
        assert_eq!(st, StatusCode::CONFLICT);
        assert!(
            msg.starts_with("snapshot t is in use: 2 of its files"),
            "{msg}"
        );
        let (st, _) = answer(DeleteError::HasDependents {
            what: "t".into(),
            dependents: vec!["a".into()],
        });
        assert_eq!(st, StatusCode::CONFLICT);
    }

    /// Text alone never makes a 4xx: an untyped error that reads like a
    /// domain error is still a 500 with its whole chain.
    #[test]
    fn untyped_errors_are_internal() {
        let e: anyhow::Result<()> = Err(anyhow::anyhow!("no snapshot \"x\" is not built"));
        let e = e.context("spawning").unwrap_err();
        assert_eq!(
            answer(e),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "spawning: no snapshot \"x\" is not built".into()
            )
        );
    }
}
