//! `/v1/workspaces`: forkd's workspace API (create, list, get, suspend,
//! resume, delete) over the node's workspace operations, which hold the
//! lifecycle.

use super::error::ApiResult;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_api::{CreateWorkspaceBody, SuspendWorkspaceBody, WorkspaceInfo};
use forkd_node::Node;
use std::sync::Arc;

type D = State<Arc<Node>>;

/// `GET /v1/workspaces`.
#[utoipa::path(get, path = "/v1/workspaces", tag = "workspaces",
    responses((status = 200, description = "Every workspace", body = Vec<WorkspaceInfo>)))]
pub async fn list(State(d): D) -> Json<Vec<WorkspaceInfo>> {
    Json(d.workspaces())
}

/// `POST /v1/workspaces`: 201 once its sandbox runs.
#[utoipa::path(post, path = "/v1/workspaces", tag = "workspaces",
    request_body = CreateWorkspaceBody,
    responses(
        (status = 201, description = "Created; its sandbox runs", body = WorkspaceInfo),
        (status = 400, description = "A bad name, tag or setting", body = forkd_api::ErrorBody),
        (status = 404, description = "No such snapshot", body = forkd_api::ErrorBody),
        (status = 409, description = "A workspace of that name exists", body = forkd_api::ErrorBody),
    ))]
pub async fn create(
    State(d): D,
    Json(b): Json<CreateWorkspaceBody>,
) -> ApiResult<(StatusCode, Json<WorkspaceInfo>)> {
    Ok((StatusCode::CREATED, Json(d.create_workspace(b).await?)))
}

/// `GET /v1/workspaces/:name`.
#[utoipa::path(get, path = "/v1/workspaces/{name}", tag = "workspaces", params(("name" = String, Path, description = "Workspace name")),
    responses(
        (status = 200, description = "The workspace", body = WorkspaceInfo),
        (status = 404, description = "No such workspace", body = forkd_api::ErrorBody),
    ))]
pub async fn get(State(d): D, Path(name): Path<String>) -> ApiResult<Json<WorkspaceInfo>> {
    Ok(Json(d.workspace(&name)?))
}

/// `DELETE /v1/workspaces/:name`: 204.
#[utoipa::path(delete, path = "/v1/workspaces/{name}", tag = "workspaces", params(("name" = String, Path, description = "Workspace name")),
    responses(
        (status = 204, description = "Its sandbox and state snapshots are gone (the source snapshot stays)"),
        (status = 404, description = "No such workspace", body = forkd_api::ErrorBody),
        (status = 409, description = "Another operation on it is under way", body = forkd_api::ErrorBody),
    ))]
pub async fn delete(State(d): D, Path(name): Path<String>) -> ApiResult<StatusCode> {
    d.delete_workspace(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/workspaces/:name/suspend` (`{diff}` accepted, see its doc).
#[utoipa::path(post, path = "/v1/workspaces/{name}/suspend", tag = "workspaces", params(("name" = String, Path, description = "Workspace name")),
    request_body(content = Option<SuspendWorkspaceBody>, description = "Optional; `diff` is accepted and ignored (every suspend stores only new chunks)"),
    responses(
        (status = 200, description = "Suspended: its state is stored as `current_state_tag`, its sandbox destroyed", body = WorkspaceInfo),
        (status = 400, description = "It is not running", body = forkd_api::ErrorBody),
        (status = 404, description = "No such workspace", body = forkd_api::ErrorBody),
        (status = 409, description = "Another operation on it is under way", body = forkd_api::ErrorBody),
    ))]
pub async fn suspend(
    State(d): D,
    Path(name): Path<String>,
    body: Option<Json<SuspendWorkspaceBody>>,
) -> ApiResult<Json<WorkspaceInfo>> {
    let _ = body;
    Ok(Json(d.suspend_workspace(&name).await?))
}

/// `POST /v1/workspaces/:name/resume`.
#[utoipa::path(post, path = "/v1/workspaces/{name}/resume", tag = "workspaces", params(("name" = String, Path, description = "Workspace name")),
    responses(
        (status = 200, description = "Running again, from its latest state, with the settings it was created with", body = WorkspaceInfo),
        (status = 400, description = "It is not suspended or stale", body = forkd_api::ErrorBody),
        (status = 404, description = "No such workspace", body = forkd_api::ErrorBody),
        (status = 409, description = "Another operation on it is under way", body = forkd_api::ErrorBody),
    ))]
pub async fn resume(State(d): D, Path(name): Path<String>) -> ApiResult<Json<WorkspaceInfo>> {
    Ok(Json(d.resume_workspace(&name).await?))
}
