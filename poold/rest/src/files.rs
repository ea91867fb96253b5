//! Files in a sandbox (ours; forkd has none): read, write, list, stat,
//! mkdir, remove. Paths are the guest's; the agent checks them (absolute,
//! no NUL) and reports `not_found` and friends, mapped to HTTP statuses.
//!
//! - `GET    /v1/sandboxes/:id/files?path=P[&offset=&len=]` → the bytes
//! - `PUT    /v1/sandboxes/:id/files?path=P[&mode=0644][&append=true]` ← the bytes → stat
//! - `DELETE /v1/sandboxes/:id/files?path=P[&recursive=true]`
//! - `GET    /v1/sandboxes/:id/files/list?path=P` → entries
//! - `GET    /v1/sandboxes/:id/files/stat?path=P` → stat
//! - `POST   /v1/sandboxes/:id/files/mkdir {path, parents}` → stat

use super::error::{ApiError, ApiResult};
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_node::{check_path, Node};
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

type D = State<Arc<Node>>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileQuery {
    path: String,
    #[serde(default)]
    offset: u64,
    #[serde(default)]
    len: Option<u64>,
    /// Octal, e.g. `0644` or `755`.
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    append: bool,
    #[serde(default)]
    recursive: bool,
}

/// The query of a file read (documentation of [`FileQuery`]'s use there).
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct ReadQuery {
    /// Absolute path in the guest.
    path: String,
    /// Byte offset to start at (default 0).
    offset: Option<u64>,
    /// Most bytes to read (default: all, up to 32 MiB).
    len: Option<u64>,
}

/// The query of a file write.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct WriteQuery {
    /// Absolute path in the guest.
    path: String,
    /// Octal permission bits, e.g. `0644` (the default).
    mode: Option<String>,
    /// Append instead of replacing.
    append: Option<bool>,
}

/// The query of a file removal.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct RemoveQuery {
    /// Absolute path in the guest.
    path: String,
    /// Remove a directory and everything in it.
    recursive: Option<bool>,
}

/// `GET .../files?path=`: the file's bytes (or `len` bytes from `offset`).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), ReadQuery),
    responses(
        (status = 200, description = "The bytes; header `x-file-size` has the file's size", body = String, content_type = "application/octet-stream"),
        (status = 400, description = "A relative path or one with NUL", body = forkd_api::ErrorBody),
        (status = 403, description = "Permission denied in the guest", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox or file", body = forkd_api::ErrorBody),
        (status = 409, description = "A directory where a file is wanted, or the reverse", body = forkd_api::ErrorBody),
        (status = 413, description = "Over 32 MiB without `len`: read it in parts", body = forkd_api::ErrorBody),
    ))]
pub async fn read(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Response> {
    let r = d.read_file(&id, &q.path, q.offset, q.len).await?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (
                header::HeaderName::from_static("x-file-size"),
                r.size.to_string(),
            ),
        ],
        r.bytes,
    )
        .into_response())
}

/// `PUT .../files?path=`: writes the body atomically (or appends).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), WriteQuery),
    request_body(content = String, content_type = "application/octet-stream", description = "The file's bytes (at most 32 MiB)"),
    responses(
        (status = 200, description = "Written atomically (unless appending), parents created; the file's stat", body = Object),
        (status = 400, description = "A relative path or one with NUL", body = forkd_api::ErrorBody),
        (status = 403, description = "Permission denied in the guest", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox or file", body = forkd_api::ErrorBody),
        (status = 409, description = "A directory where a file is wanted, or the reverse", body = forkd_api::ErrorBody),
    ))]
pub async fn write(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    check_path(&q.path)?;
    let mode = q
        .mode
        .as_deref()
        .map(|m| {
            u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .ok()
                .filter(|v| *v <= 0o7777)
                .ok_or_else(|| ApiError::bad_request(format!("mode {m:?} is not an octal mode")))
        })
        .transpose()?;
    let st = d.write_file(&id, &q.path, &body, mode, q.append).await?;
    Ok(Json(serde_json::to_value(st).map_err(ApiError::internal)?))
}

/// `DELETE .../files?path=`.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), RemoveQuery),
    responses(
        (status = 204, description = "Removed"),
        (status = 400, description = "A relative path or one with NUL", body = forkd_api::ErrorBody),
        (status = 403, description = "Permission denied in the guest", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox or file", body = forkd_api::ErrorBody),
        (status = 409, description = "A directory where a file is wanted, or the reverse", body = forkd_api::ErrorBody),
    ))]
pub async fn remove(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<StatusCode> {
    d.remove(&id, &q.path, q.recursive).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A query naming one guest path.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// Absolute path in the guest.
    path: String,
}

/// `GET .../files/list?path=`.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses(
        (status = 200, description = "`{\"entries\": [{name, kind, size, mode, mtime_unix}]}`", body = Object),
        (status = 400, description = "A relative path or one with NUL", body = forkd_api::ErrorBody),
        (status = 403, description = "Permission denied in the guest", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox or file", body = forkd_api::ErrorBody),
        (status = 409, description = "A directory where a file is wanted, or the reverse", body = forkd_api::ErrorBody),
    ))]
pub async fn list(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Json<Value>> {
    let l = d.list_dir(&id, &q.path).await?;
    Ok(Json(serde_json::to_value(l).map_err(ApiError::internal)?))
}

/// `GET .../files/stat?path=`.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses(
        (status = 200, description = "`{path, kind, size, mode, uid, gid, mtime_unix, symlink_target?}`", body = Object),
        (status = 400, description = "A relative path or one with NUL", body = forkd_api::ErrorBody),
        (status = 403, description = "Permission denied in the guest", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox or file", body = forkd_api::ErrorBody),
        (status = 409, description = "A directory where a file is wanted, or the reverse", body = forkd_api::ErrorBody),
    ))]
pub async fn stat(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Json<Value>> {
    let s = d.stat(&id, &q.path).await?;
    Ok(Json(serde_json::to_value(s).map_err(ApiError::internal)?))
}

/// `POST .../files/mkdir`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MkdirBody {
    /// Absolute path in the guest.
    path: String,
    /// Create missing parents too.
    #[serde(default)]
    parents: bool,
}

/// `POST .../files/mkdir {path, parents}`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", tag = "files",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = MkdirBody,
    responses(
        (status = 200, description = "The directory's stat", body = Object),
        (status = 400, description = "A relative path or one with NUL", body = forkd_api::ErrorBody),
        (status = 403, description = "Permission denied in the guest", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox or file", body = forkd_api::ErrorBody),
        (status = 409, description = "A directory where a file is wanted, or the reverse", body = forkd_api::ErrorBody),
    ))]
pub async fn mkdir(
    State(d): D,
    Path(id): Path<String>,
    Json(b): Json<MkdirBody>,
) -> ApiResult<Json<Value>> {
    let s = d.mkdir(&id, &b.path, b.parents).await?;
    Ok(Json(serde_json::to_value(s).map_err(ApiError::internal)?))
}
