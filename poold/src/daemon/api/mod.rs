//! The HTTP routes. forkd's `/v1` API (same paths, JSON fields, status
//! codes and `{"error": "..."}` bodies) plus our own pools, files,
//! streaming exec, logs and TTLs. Reference: docs/api.md.

pub mod branch;
pub mod files;
pub mod pools;
pub mod sandboxes;
pub mod snapshots;

use super::Daemon;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use std::sync::Arc;

/// Every route but `/healthz` (which needs no auth; see `server`).
pub fn routes(d: Arc<Daemon>) -> Router {
    Router::new()
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route(
            "/v1/snapshots",
            get(snapshots::list).post(snapshots::create_snapshot),
        )
        .route(
            "/v1/snapshots/{tag}",
            axum::routing::delete(snapshots::delete_snapshot),
        )
        .route("/v1/snapshots/{tag}/info", get(snapshots::info))
        .route("/v1/snapshots/{tag}/compact", post(snapshots::compact))
        .route("/v1/sandboxes", get(sandboxes::list).post(sandboxes::spawn))
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get).delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/ping", post(sandboxes::ping))
        .route("/v1/sandboxes/{id}/exec", post(sandboxes::exec))
        .route(
            "/v1/sandboxes/{id}/exec/stream",
            post(sandboxes::exec_stream),
        )
        .route("/v1/sandboxes/{id}/eval", post(sandboxes::eval))
        .route("/v1/sandboxes/{id}/branch", post(branch::branch))
        .route("/v1/sandboxes/{id}/logs", get(sandboxes::logs))
        .route("/v1/sandboxes/{id}/ttl", post(sandboxes::set_ttl))
        .route(
            "/v1/sandboxes/{id}/files",
            get(files::read).put(files::write).delete(files::remove),
        )
        .route("/v1/sandboxes/{id}/files/list", get(files::list))
        .route("/v1/sandboxes/{id}/files/stat", get(files::stat))
        .route("/v1/sandboxes/{id}/files/mkdir", post(files::mkdir))
        .route("/v1/pools", get(pools::list))
        .route(
            "/v1/pools/{tag}",
            get(pools::get).put(pools::put).delete(pools::delete),
        )
        .layer(DefaultBodyLimit::max(files::MAX_FILE_BYTES + 4096))
        .layer(axum::middleware::from_fn_with_state(
            d.clone(),
            super::transfers::turn,
        ))
        .with_state(d)
}

/// The version, plus what isolates sandboxes on this host: the
/// accelerator poold resolved at start and whether QEMUs are jailed, so a
/// client can tell a KVM host from a weaker TCG one (docs/security.md).
async fn version(State(d): State<Arc<Daemon>>) -> Json<serde_json::Value> {
    use forkd_vmm::Accel;
    let jailed = forkd_vmm::JailConfig::get().is_ok_and(|j| j.enabled);
    let isolation = match (d.accel, jailed) {
        (Accel::Kvm, true) => "hardware virtualization (KVM) and a jailed QEMU per sandbox",
        (Accel::Kvm, false) => "hardware virtualization (KVM); the QEMU jail is off",
        (Accel::Tcg, true) => "software emulation (TCG): no hardware boundary, the jailed QEMU process is the only one; weaker than KVM, see docs/security.md",
        (Accel::Tcg, false) => "software emulation (TCG) with the QEMU jail off: a QEMU bug is host root; for debugging only",
    };
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "api": "v1",
        "compat": "forkd 0.5.3",
        "accelerator": d.accel.as_str(),
        "jail": jailed,
        "isolation": isolation,
    }))
}

async fn metrics(State(d): State<Arc<Daemon>>) -> impl IntoResponse {
    d.metrics.snapshots.set(
        d.read(|v| Ok(v.tags()?.len() as i64))
            .await
            .unwrap_or_default(),
    );
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        d.metrics.render(),
    )
}
