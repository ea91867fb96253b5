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

use super::sandboxes::get_sandbox;
use crate::daemon::error::{agent_error, ApiError, ApiResult};
use crate::daemon::Daemon;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

type D = State<Arc<Daemon>>;

/// Largest upload or download in one request: one agent frame's payload
/// (the agent reads and writes a file in one frame).
pub const MAX_FILE_BYTES: usize = rootfs_init::protocol::frame::MAX_PAYLOAD;

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

fn check_path(p: &str) -> ApiResult<()> {
    if !p.starts_with('/') || p.contains('\0') {
        return Err(ApiError::bad_request(format!(
            "path {p:?} must be absolute (start with '/') and contain no NUL"
        )));
    }
    Ok(())
}

/// `GET .../files?path=`: the file's bytes (or `len` bytes from `offset`).
pub async fn read(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Response> {
    check_path(&q.path)?;
    let sb = get_sandbox(&d, &id)?;
    let len = q
        .len
        .unwrap_or(MAX_FILE_BYTES as u64)
        .min(MAX_FILE_BYTES as u64);
    let (r, bytes) = sb
        .agent
        .read_file(&q.path, q.offset, Some(len))
        .await
        .map_err(agent_error)?;
    if q.len.is_none() && r.size > q.offset + r.len {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "{} is {} bytes, over the {MAX_FILE_BYTES}-byte limit of one request; read it in parts with offset and len",
                q.path, r.size
            ),
        ));
    }
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (
                header::HeaderName::from_static("x-file-size"),
                r.size.to_string(),
            ),
        ],
        bytes,
    )
        .into_response())
}

/// `PUT .../files?path=`: writes the body atomically (or appends).
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
    let sb = get_sandbox(&d, &id)?;
    let st = sb
        .agent
        .write_file(&q.path, &body, mode, q.append)
        .await
        .map_err(agent_error)?;
    Ok(Json(serde_json::to_value(st).map_err(ApiError::internal)?))
}

/// `DELETE .../files?path=`.
pub async fn remove(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<StatusCode> {
    check_path(&q.path)?;
    let sb = get_sandbox(&d, &id)?;
    sb.agent
        .remove(&q.path, q.recursive)
        .await
        .map_err(agent_error)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    path: String,
}

/// `GET .../files/list?path=`.
pub async fn list(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Json<Value>> {
    check_path(&q.path)?;
    let sb = get_sandbox(&d, &id)?;
    let l = sb.agent.list(&q.path).await.map_err(agent_error)?;
    Ok(Json(serde_json::to_value(l).map_err(ApiError::internal)?))
}

/// `GET .../files/stat?path=`.
pub async fn stat(
    State(d): D,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Json<Value>> {
    check_path(&q.path)?;
    let sb = get_sandbox(&d, &id)?;
    let s = sb.agent.stat(&q.path).await.map_err(agent_error)?;
    Ok(Json(serde_json::to_value(s).map_err(ApiError::internal)?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirBody {
    path: String,
    #[serde(default)]
    parents: bool,
}

/// `POST .../files/mkdir {path, parents}`.
pub async fn mkdir(
    State(d): D,
    Path(id): Path<String>,
    Json(b): Json<MkdirBody>,
) -> ApiResult<Json<Value>> {
    check_path(&b.path)?;
    let sb = get_sandbox(&d, &id)?;
    let s = sb
        .agent
        .mkdir(&b.path, b.parents)
        .await
        .map_err(agent_error)?;
    Ok(Json(serde_json::to_value(s).map_err(ApiError::internal)?))
}
