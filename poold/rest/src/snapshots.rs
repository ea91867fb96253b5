//! `/v1/snapshots`: list, create (a warm snapshot of an image), delete
//! (forkd's 409 / cascade / force rules), info and compact, over the
//! node's snapshot operations.

use super::error::ApiResult;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_api::{CreateSnapshotBody, SnapshotInfo};
use forkd_node::{Node, SnapshotDetails};
use serde::Deserialize;
use std::sync::Arc;

type D = State<Arc<Node>>;

/// `GET /v1/snapshots`.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    responses((status = 200, description = "Tagged snapshots, plus `status: writing` entries for creates and branches in flight", body = Vec<SnapshotInfo>)))]
pub async fn list(State(d): D) -> ApiResult<Json<Vec<SnapshotInfo>>> {
    Ok(Json(d.snapshots().await?))
}

/// `POST /v1/snapshots`: boots a parent, warms it up, snapshots it.
#[utoipa::path(post, path = "/v1/snapshots", tag = "snapshots",
    request_body = CreateSnapshotBody,
    responses(
        (status = 201, description = "The warm snapshot is in the store", body = SnapshotInfo),
        (status = 400, description = "A bad or existing tag, no image/rootfs or both, a path outside the data dir, an unknown image", body = forkd_api::ErrorBody),
        (status = 409, description = "The tag is being written", body = forkd_api::ErrorBody),
        (status = 503, description = "snapshot_concurrency creations in flight, or under the memory/disk floor", body = forkd_api::ErrorBody),
        (status = 500, description = "The boot or warm-up failed (the message has the console tail)", body = forkd_api::ErrorBody),
    ))]
pub async fn create_snapshot(
    State(d): D,
    Json(b): Json<CreateSnapshotBody>,
) -> ApiResult<(StatusCode, Json<SnapshotInfo>)> {
    Ok((StatusCode::CREATED, Json(d.create_snapshot(b).await?)))
}

/// `DELETE /v1/snapshots/:tag`'s query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeleteQuery {
    /// Delete the snapshot's dependents too, leaves first.
    #[serde(default)]
    cascade: Option<String>,
    /// Delete only this one; its children become roots.
    #[serde(default)]
    force: Option<String>,
}

/// A query flag: present and not `false`/`0`.
fn flag(v: &Option<String>) -> bool {
    v.as_deref().is_some_and(|s| !matches!(s, "false" | "0"))
}

/// `DELETE /v1/snapshots/:tag?cascade=&force=`.
#[utoipa::path(delete, path = "/v1/snapshots/{tag}", tag = "snapshots",
    params(("tag" = String, Path, description = "Snapshot tag"), DeleteQuery),
    responses(
        (status = 204, description = "Deleted (its pool drained first)"),
        (status = 400, description = "A bad tag, or both flags", body = forkd_api::ErrorBody),
        (status = 404, description = "No such snapshot", body = forkd_api::ErrorBody),
        (status = 409, description = "It has dependents and no flag, or running sandboxes map it", body = forkd_api::ErrorBody),
    ))]
pub async fn delete_snapshot(
    State(d): D,
    Path(tag): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> ApiResult<StatusCode> {
    d.delete_snapshot(&tag, flag(&q.cascade), flag(&q.force))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/snapshots/:tag/info`: forkd's fields, plus the chain with the
/// bytes each link really stores.
#[utoipa::path(get, path = "/v1/snapshots/{tag}/info", tag = "snapshots", params(("tag" = String, Path, description = "Snapshot tag")),
    responses(
        (status = 200, description = "forkd's fields (sizes, parent, chain depth, dependents, ancestors) and ours (chain with each link's unique bytes, files, config, lineage)", body = Object),
        (status = 400, description = "A bad tag", body = forkd_api::ErrorBody),
        (status = 404, description = "No such snapshot", body = forkd_api::ErrorBody),
    ))]
pub async fn info(State(d): D, Path(tag): Path<String>) -> ApiResult<Json<SnapshotDetails>> {
    Ok(Json(d.snapshot_details(&tag).await?))
}

/// `POST /v1/snapshots/:tag/compact`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactBody {
    /// Tag of the standalone copy.
    to: String,
}

/// `POST /v1/snapshots/:tag/compact {to}`: a standalone copy of a chain
/// head. Here it moves no data: every manifest is already flattened, so the
/// copy is a new record naming the same manifests, without a parent.
#[utoipa::path(post, path = "/v1/snapshots/{tag}/compact", tag = "snapshots", params(("tag" = String, Path, description = "Snapshot tag")),
    request_body = CompactBody,
    responses(
        (status = 200, description = "The parentless copy (`branched_from: compact:<tag>`)", body = SnapshotInfo),
        (status = 400, description = "Bad tags, or `to` equal to the tag", body = forkd_api::ErrorBody),
        (status = 404, description = "No such snapshot", body = forkd_api::ErrorBody),
        (status = 409, description = "`to` exists", body = forkd_api::ErrorBody),
    ))]
pub async fn compact(
    State(d): D,
    Path(tag): Path<String>,
    Json(b): Json<CompactBody>,
) -> ApiResult<Json<SnapshotInfo>> {
    Ok(Json(d.compact_snapshot(&tag, &b.to).await?))
}
