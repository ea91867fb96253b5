//! `POST /v1/sandboxes/:id/branch`: forkd's request, validation order and
//! answers (201 `SnapshotInfo` with `branched_from` and `pause_ms`; 202 with
//! `status: "writing"` for a live `wait: false`), on our mechanism: a live
//! migration to a collector (snapshot::branch).

use super::sandboxes::get_sandbox;
use crate::daemon::error::{check_tag, detached, ApiError, ApiResult};
use crate::daemon::sandbox::{Phase, Sandbox};
use crate::daemon::Daemon;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_api::SnapshotInfo;
use forkd_snapshot::branch::{self, Mode};
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// `POST /v1/sandboxes/:id/branch` (forkd's fields).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BranchBody {
    /// Tag of the new snapshot (default `branch-<id>-<unix>-<4 hex>`).
    #[serde(default)]
    tag: Option<String>,
    /// forkd: record the branch's uncompressed diff size.
    #[serde(default)]
    measure_diff: bool,
    /// forkd's legacy flag for `mode: diff`.
    #[serde(default)]
    diff: bool,
    /// forkd's legacy flag for `mode: live`.
    #[serde(default)]
    live: bool,
    /// `full` (default), `diff` or `live`.
    #[serde(default)]
    mode: Option<String>,
    /// false (live only): answer 202 once the sandbox runs again.
    #[serde(default)]
    wait: Option<bool>,
    /// The sandbox's snapshot, in diff mode (forkd's check).
    #[serde(default)]
    parent_tag: Option<String>,
    /// Set by a workspace suspend (never by a request): the workspace id,
    /// kept in the snapshot's lineage so leftovers can be told apart.
    #[serde(skip)]
    workspace: Option<String>,
}

/// forkd's default tag: `branch-<id>-<unix>-<suffix 04x>`.
fn default_tag(id: &str) -> String {
    let suffix: u16 = rand::random();
    format!("branch-{id}-{}-{suffix:04x}", forkd_snapshot::unix_now())
}

/// The mode the body asks for, checked in forkd's order.
fn mode_of(b: &BranchBody) -> ApiResult<Mode> {
    if b.mode.is_some() && (b.diff || b.live) {
        return Err(ApiError::bad_request(
            "mode cannot be combined with the legacy diff/live flags",
        ));
    }
    if [b.measure_diff, b.diff, b.live]
        .iter()
        .filter(|x| **x)
        .count()
        > 1
    {
        return Err(ApiError::bad_request(
            "measure_diff, diff and live are mutually exclusive",
        ));
    }
    let mode = match b.mode.as_deref() {
        Some("full") => Mode::Full,
        Some("diff") => Mode::Diff,
        Some("live") => Mode::Live,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unknown mode {other:?}: use full, diff or live"
            )))
        }
        None if b.diff => Mode::Diff,
        None if b.live => Mode::Live,
        None => Mode::Full,
    };
    if b.wait == Some(false) && mode != Mode::Live {
        return Err(ApiError::bad_request("wait: false needs live mode"));
    }
    Ok(mode)
}

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
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    body: Option<Json<BranchBody>>,
) -> ApiResult<(StatusCode, Json<SnapshotInfo>)> {
    let b = body.map(|Json(b)| b).unwrap_or_default();
    detached(branch_work(d, id, b)).await
}

/// Branches sandbox `id` into a new snapshot `tag` (full mode) and waits
/// for it to be stored: what the E2B API's fork does before spawning.
pub async fn branch_to(d: Arc<Daemon>, id: String, tag: String) -> ApiResult<SnapshotInfo> {
    let b = BranchBody {
        tag: Some(tag),
        ..Default::default()
    };
    let (_, Json(info)) = branch_work(d, id, b).await?;
    Ok(info)
}

/// Branches workspace `workspace`'s sandbox `id` into its next state
/// snapshot `tag`, stop-and-copy (the sandbox is destroyed next, so
/// nothing gains from it running meanwhile, and nothing it does after the
/// capture is lost); the workspace's id goes in the snapshot's lineage.
pub(crate) async fn branch_for_workspace(
    d: Arc<Daemon>,
    id: String,
    tag: String,
    workspace: String,
) -> ApiResult<SnapshotInfo> {
    let b = BranchBody {
        tag: Some(tag),
        mode: Some("full".into()),
        workspace: Some(workspace),
        ..Default::default()
    };
    let (_, Json(info)) = branch_work(d, id, b).await?;
    Ok(info)
}

async fn branch_work(
    d: Arc<Daemon>,
    id: String,
    b: BranchBody,
) -> ApiResult<(StatusCode, Json<SnapshotInfo>)> {
    // 1. The tag rule.
    let tag = match &b.tag {
        Some(t) => {
            check_tag(t)?;
            t.clone()
        }
        None => default_tag(&id),
    };
    check_tag(&tag)?;
    // 2. A slot (503 at the cap), the tag (409 while in flight).
    let slot = d.branch_slots.clone().try_acquire_owned().map_err(|_| {
        ApiError::unavailable(format!(
            "{} branches are in flight, the concurrency cap; retry later",
            d.cfg.branch_concurrency
        ))
    })?;
    d.check_headroom("branch")?;
    let claim = d
        .claim_tag(&tag)
        .ok_or_else(|| ApiError::conflict(format!("a branch to {tag:?} is already in flight")))?;
    // 3-5. Mode flags.
    let mode = mode_of(&b)?;
    // 6. The tag must be free.
    if super::snapshots::tag_exists(&d, &tag).await? {
        return Err(ApiError::conflict(format!(
            "snapshot {tag:?} already exists"
        )));
    }
    // 7. The sandbox.
    let sb = get_sandbox(&d, &id)?;
    let rec = sb.record();
    // 8. parent_tag names the source's snapshot, in diff mode.
    if let Some(pt) = &b.parent_tag {
        check_tag(pt)?;
        if *pt != rec.snapshot_tag || mode != Mode::Diff {
            return Err(ApiError::bad_request(format!(
                "parent_tag must be the sandbox's snapshot ({}) and needs mode diff",
                rec.snapshot_tag
            )));
        }
    }
    let parent = forkd_snapshot::restore::read_record(&d.mount, &rec.snapshot_id)
        .map_err(|e| ApiError::conflict(format!("the sandbox's snapshot is gone: {e:#}")))?;

    d.metrics.branches_in_flight.inc();
    let guard = InFlight(d.clone());
    let captured = {
        // Running → Branching → Running, under the VM lock (a delete waits).
        let vm = sb.vm.lock().await;
        let vm = vm
            .as_ref()
            .ok_or_else(|| ApiError::not_found(format!("sandbox {id:?} not found")))?;
        sb.advance(Phase::Branching).map_err(ApiError::internal)?;
        let captured = branch::capture(&d.paths, &d.mount, vm, &parent, mode).await;
        // capture leaves the child running, on success and on failure.
        sb.advance(Phase::Running).map_err(ApiError::internal)?;
        let captured =
            captured.map_err(|e| ApiError::from_anyhow(e.context("capturing the branch")))?;
        sb.commits_in_flight.fetch_add(1, Ordering::SeqCst);
        captured
    };
    let pause_ms = captured.pause_ms;
    {
        let mut r = sb.record.lock().unwrap();
        r.branch_count += 1;
    }
    let r2 = sb.record();
    d.state
        .commit(move |s| {
            if let Some(r) = s.sandboxes.get_mut(&r2.id) {
                *r = r2;
            }
        })
        .await
        .map_err(ApiError::from_anyhow)?;
    let mut lineage = BTreeMap::new();
    lineage.insert("branched_from".into(), json!(id));
    lineage.insert("source_snapshot".into(), json!(rec.snapshot_id));
    if let Some(w) = &b.workspace {
        lineage.insert("workspace".into(), json!(w));
    }

    let commit = {
        let d = d.clone();
        let tag = tag.clone();
        async move {
            let t0 = std::time::Instant::now();
            let rootfs =
                forkd_snapshot::restore::Source::new(&d.mount, &parent).map(|s| s.rootfs());
            let r = branch::commit(&d.paths, captured, &parent, &tag, lineage).await;
            bound_disk_chain(&sb, rootfs).await;
            // The slot first: once the tag reads "ready" a new branch fits.
            drop((slot, guard, claim));
            r.map(|b| (b, t0.elapsed().as_secs_f64() * 1e3))
        }
    };
    if b.wait == Some(false) {
        let t = tag.clone();
        tokio::spawn(async move {
            if let Err(e) = commit.await {
                tracing::error!("branch {t}: {e:#}");
            }
        });
        let info = SnapshotInfo {
            branched_from: Some(id),
            pause_ms: Some(pause_ms),
            status: "writing".into(),
            bootable: false,
            ..super::snapshots::empty_info(&tag)
        };
        return Ok((StatusCode::ACCEPTED, Json(info)));
    }
    let (made, diff_ms) = commit
        .await
        .map_err(|e| ApiError::from_anyhow(e.context("storing the branch")))?;
    let mut info = super::snapshots::info_of_async(&d, &tag, &made.record).await?;
    info.diff_ms = Some(diff_ms);
    info.diff_physical_bytes = Some(made.new_stored_bytes);
    Ok((StatusCode::CREATED, Json(info)))
}

/// After a branch's commit: flattens the sandbox's disk chain if it grew
/// past `MAX_DISK_LAYERS` and no other branch of it still reads a frozen
/// layer. A failure leaves the chain as it was (still correct, only long).
async fn bound_disk_chain(sb: &Sandbox, rootfs: anyhow::Result<std::path::PathBuf>) {
    let vm = sb.vm.lock().await;
    if sb.commits_in_flight.fetch_sub(1, Ordering::SeqCst) != 1 {
        return;
    }
    let (Some(vm), Ok(rootfs)) = (vm.as_ref(), rootfs) else {
        return;
    };
    match branch::bound_disk_chain(vm, &rootfs).await {
        Ok(n) => tracing::debug!("sandbox {}: {n} disk layers", sb.id),
        Err(e) => tracing::warn!("sandbox {}: {e:#}", sb.id),
    }
}

/// Keeps `forkd_branches_in_flight` true while a branch runs.
struct InFlight(Arc<Daemon>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.metrics.branches_in_flight.dec();
    }
}
