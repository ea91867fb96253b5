//! `/v1/pools` (ours): see and size the warm pools.
//!
//! - `GET /v1/pools` → every pool's status
//! - `GET /v1/pools/:tag` → one pool's status (zeros if it has none)
//! - `PUT /v1/pools/:tag {min_ready, max_ready?, warm?, warm_eval?, page_out?, keep_resident?}` → status; persisted
//! - `DELETE /v1/pools/:tag` → the pool's children are destroyed (persisted)

use crate::daemon::config::PoolSpec;
use crate::daemon::error::{check_tag, ApiError, ApiResult};
use crate::daemon::lifecycle::discard_pooled;
use crate::daemon::Daemon;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_api::PoolStatus;
use std::sync::Arc;

type D = State<Arc<Daemon>>;

#[utoipa::path(get, path = "/v1/pools", tag = "pools",
    responses((status = 200, description = "Every pool", body = Vec<PoolStatus>)))]
pub async fn list(State(d): D) -> Json<Vec<PoolStatus>> {
    Json(d.pools.status())
}

#[utoipa::path(get, path = "/v1/pools/{tag}", tag = "pools", params(("tag" = String, Path, description = "Snapshot tag")),
    responses(
        (status = 200, description = "The pool (zeros if it has none)", body = PoolStatus),
        (status = 400, description = "A bad tag", body = forkd_api::ErrorBody),
    ))]
pub async fn get(State(d): D, Path(tag): Path<String>) -> ApiResult<Json<PoolStatus>> {
    check_tag(&tag)?;
    Ok(Json(d.pools.status_of(&tag)))
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
    check_tag(&tag)?;
    spec.validate()
        .map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    if spec.page_out && forkd_vmm::swap_total_kib() == 0 {
        return Err(ApiError::bad_request(
            "page_out needs swap on this host and it has none (SwapTotal is 0): add a swap device (zram keeps it in compressed RAM; docs/poold.md, \"Parking children in swap\") or leave page_out off",
        ));
    }
    // A pool for a snapshot that does not exist would only log refill errors.
    super::snapshots::resolve(&d, &tag).await?;
    // Paused children cost memory too: all pools together stay within
    // max_sandboxes.
    let others: usize = d
        .pools
        .status()
        .iter()
        .filter(|p| p.tag != tag)
        .map(|p| p.max_ready)
        .sum();
    if others + spec.max() > d.cfg.max_sandboxes {
        return Err(ApiError::bad_request(format!(
            "pools would keep up to {} children ready, over max_sandboxes ({}); shrink another pool or raise max_sandboxes",
            others + spec.max(),
            d.cfg.max_sandboxes
        )));
    }
    let (t, saved) = (tag.clone(), spec.clone());
    d.state
        .commit(move |s| {
            s.pools.insert(t, saved);
        })
        .await
        .map_err(ApiError::from_anyhow)?;
    let extra = d.pools.set(&tag, Some(spec));
    discard_pooled(&d, extra);
    d.refill_wake.notify_one();
    Ok(Json(d.pools.status_of(&tag)))
}

#[utoipa::path(delete, path = "/v1/pools/{tag}", tag = "pools", params(("tag" = String, Path, description = "Snapshot tag")),
    responses(
        (status = 204, description = "Its ready children are destroyed; persisted"),
        (status = 400, description = "A bad tag", body = forkd_api::ErrorBody),
    ))]
pub async fn delete(State(d): D, Path(tag): Path<String>) -> ApiResult<StatusCode> {
    check_tag(&tag)?;
    // Recorded as an empty pool, so a pool from the config file stays
    // deleted across restarts too.
    let off = PoolSpec {
        min_ready: 0,
        max_ready: Some(0),
        warm: false,
        warm_eval: None,
        page_out: false,
        keep_resident: None,
        network: None,
    };
    let t = tag.clone();
    d.state
        .commit(move |s| {
            s.pools.insert(t, off);
        })
        .await
        .map_err(ApiError::from_anyhow)?;
    let extra = d.pools.set(&tag, None);
    discard_pooled(&d, extra);
    Ok(StatusCode::NO_CONTENT)
}
