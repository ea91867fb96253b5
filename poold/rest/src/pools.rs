//! `/v1/pools` (ours): see and size the warm pools.
//!
//! - `GET /v1/pools` → every pool's status
//! - `GET /v1/pools/:tag` → one pool's status (zeros if it has none)
//! - `PUT /v1/pools/:tag {min_ready, max_ready?, warm?, warm_eval?, page_out?, keep_resident?}` → status; persisted
//! - `DELETE /v1/pools/:tag` → the pool's children are destroyed (persisted)

use super::error::ApiResult;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_api::{PoolSpec, PoolStatus};
use forkd_node::Node;
use std::sync::Arc;

type D = State<Arc<Node>>;

#[utoipa::path(get, path = "/v1/pools", tag = "pools",
    responses((status = 200, description = "Every pool", body = Vec<PoolStatus>)))]
pub async fn list(State(d): D) -> Json<Vec<PoolStatus>> {
    Json(d.pools())
}

#[utoipa::path(get, path = "/v1/pools/{tag}", tag = "pools", params(("tag" = String, Path, description = "Snapshot tag")),
    responses(
        (status = 200, description = "The pool (zeros if it has none)", body = PoolStatus),
        (status = 400, description = "A bad tag", body = forkd_api::ErrorBody),
    ))]
pub async fn get(State(d): D, Path(tag): Path<String>) -> ApiResult<Json<PoolStatus>> {
    Ok(Json(d.pool(&tag)?))
}

#[utoipa::path(put, path = "/v1/pools/{tag}", tag = "pools", params(("tag" = String, Path, description = "Snapshot tag")),
    request_body = forkd_api::PoolSpec,
    responses(
        (status = 200, description = "The pool; persisted", body = PoolStatus),
        (status = 400, description = "max_ready below min_ready or over 1000, pools over max_sandboxes, or page_out on a host without swap", body = forkd_api::ErrorBody),
        (status = 404, description = "No such snapshot", body = forkd_api::ErrorBody),
    ))]
pub async fn put(
    State(d): D,
    Path(tag): Path<String>,
    Json(spec): Json<PoolSpec>,
) -> ApiResult<Json<PoolStatus>> {
    Ok(Json(d.set_pool(&tag, spec).await?))
}

#[utoipa::path(delete, path = "/v1/pools/{tag}", tag = "pools", params(("tag" = String, Path, description = "Snapshot tag")),
    responses(
        (status = 204, description = "Its ready children are destroyed; persisted"),
        (status = 400, description = "A bad tag", body = forkd_api::ErrorBody),
    ))]
pub async fn delete(State(d): D, Path(tag): Path<String>) -> ApiResult<StatusCode> {
    d.delete_pool(&tag).await?;
    Ok(StatusCode::NO_CONTENT)
}
