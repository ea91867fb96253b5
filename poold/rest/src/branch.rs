//! `POST /v1/sandboxes/:id/branch`: forkd's request and answers (201 with
//! the snapshot, `branched_from` and `pause_ms`; 202 with `status:
//! "writing"` for a live `wait: false`) over the node's branch, which
//! holds forkd's validation order.

use super::error::ApiResult;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_api::{BranchBody, SnapshotInfo};
use forkd_node::Node;
use std::sync::Arc;

/// `POST /v1/sandboxes/:id/branch`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/branch", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    request_body(content = Option<BranchBody>, description = "Optional; every field has a default"),
    responses(
        (status = 201, description = "The branch is stored", body = SnapshotInfo),
        (status = 202, description = "Live `wait: false`: the sandbox runs again, the snapshot is being written (`status: writing`)", body = SnapshotInfo),
        (status = 400, description = "A bad tag, conflicting mode flags, wait:false without live, a wrong parent_tag", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
        (status = 409, description = "The tag exists or is in flight", body = forkd_api::ErrorBody),
        (status = 503, description = "At the branch concurrency cap, or under the memory/disk floor", body = forkd_api::ErrorBody),
        (status = 500, description = "The branch failed", body = forkd_api::ErrorBody),
    ))]
pub async fn branch(
    State(d): State<Arc<Node>>,
    Path(id): Path<String>,
    body: Option<Json<BranchBody>>,
) -> ApiResult<(StatusCode, Json<SnapshotInfo>)> {
    let b = body.map(|Json(b)| b).unwrap_or_default();
    let made = d.branch(&id, b).await?;
    let status = if made.writing {
        StatusCode::ACCEPTED
    } else {
        StatusCode::CREATED
    };
    Ok((status, Json(made.info)))
}
