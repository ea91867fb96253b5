//! Branching a running sandbox into a new snapshot (docs/design.md,
//! "Branch: live migration to a collector"): forkd's request, validation
//! order and answers (the snapshot with `branched_from` and `pause_ms`; for
//! a live `wait: false`, `status: writing` as soon as the sandbox runs
//! again), on our mechanism, `forkd_snapshot::branch`.
//!
//! The sandbox is `Branching` only while the capture holds its VM lock
//! (`Sandbox::begin_branch`), so a destroy waits for the capture; the
//! commit to the store runs after, and the disk chain is flattened only
//! once no commit of the sandbox is in flight.

use crate::error::{check_tag, Error, Result};
use crate::node::Node;
use crate::sandbox::Sandbox;
use crate::snapshots::{empty_info, info_of_async, tag_exists};
use forkd_api::{BranchBody, SnapshotInfo};
use forkd_snapshot::branch::{self, Mode};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A branch taken: the new snapshot, and whether it is still being
/// written (a live `wait: false`; it reads `ready` once stored).
#[derive(Debug, Clone)]
pub struct Branched {
    /// The snapshot (`status: writing` while it is).
    pub info: SnapshotInfo,
    /// The answer came before the snapshot was stored.
    pub writing: bool,
}

/// forkd's default tag: `branch-<id>-<unix>-<suffix 04x>`.
fn default_tag(id: &str) -> String {
    let suffix: u16 = rand::random();
    format!("branch-{id}-{}-{suffix:04x}", forkd_snapshot::unix_now())
}

/// The mode the request asks for, checked in forkd's order.
fn mode_of(b: &BranchBody) -> Result<Mode> {
    if b.mode.is_some() && (b.diff || b.live) {
        return Err(Error::invalid(
            "mode",
            "mode cannot be combined with the legacy diff/live flags",
        ));
    }
    if [b.measure_diff, b.diff, b.live]
        .iter()
        .filter(|x| **x)
        .count()
        > 1
    {
        return Err(Error::invalid(
            "mode",
            "measure_diff, diff and live are mutually exclusive",
        ));
    }
    let mode = match b.mode.as_deref() {
        Some("full") => Mode::Full,
        Some("diff") => Mode::Diff,
        Some("live") => Mode::Live,
        Some(other) => {
            return Err(Error::invalid(
                "mode",
                format!("unknown mode {other:?}: use full, diff or live"),
            ))
        }
        None if b.diff => Mode::Diff,
        None if b.live => Mode::Live,
        None => Mode::Full,
    };
    if b.wait == Some(false) && mode != Mode::Live {
        return Err(Error::invalid("wait", "wait: false needs live mode"));
    }
    Ok(mode)
}

/// Branches sandbox `id` as `b` asks; `workspace` (set by a workspace
/// suspend, never by a caller) goes in the snapshot's lineage so
/// leftovers can be told apart. With `publish`, the stored branch is
/// pushed to the node's hub (`hub::publish`): not for a workspace's
/// memory or a branch made only to spawn from here.
pub(crate) async fn branch(
    n: &Arc<Node>,
    id: &str,
    b: &BranchBody,
    workspace: Option<&str>,
    publish: bool,
) -> Result<Branched> {
    // 1. The tag rule.
    let tag = match &b.tag {
        Some(t) => {
            check_tag(t)?;
            t.clone()
        }
        None => default_tag(id),
    };
    check_tag(&tag)?;
    // 2. A slot (at the cap: refused), the tag (taken while in flight).
    let slot = n.branch_slots.clone().try_acquire_owned().map_err(|_| {
        Error::AtCapacity(format!(
            "{} branches are in flight, the concurrency cap; retry later",
            n.cfg.branch_concurrency
        ))
    })?;
    n.check_headroom("branch")?;
    let claim = n
        .claim_tag(&tag)
        .ok_or_else(|| Error::Conflict(format!("a branch to {tag:?} is already in flight")))?;
    // 3-5. Mode flags.
    let mode = mode_of(b)?;
    // 6. The tag must be free.
    if tag_exists(n, &tag).await? {
        return Err(Error::Conflict(format!("snapshot {tag:?} already exists")));
    }
    // 7. The sandbox.
    let sb = n.sandbox(id)?;
    let rec = sb.record();
    // 8. parent_tag names the source's snapshot, in diff mode.
    if let Some(pt) = &b.parent_tag {
        check_tag(pt)?;
        if *pt != rec.snapshot_tag {
            return Err(Error::invalid(
                "parent_tag",
                format!(
                    "parent_tag {pt:?} is not the snapshot sandbox {id} was spawned from ({:?}); pass parent_tag {:?} or leave it out",
                    rec.snapshot_tag, rec.snapshot_tag
                ),
            ));
        }
        if mode != Mode::Diff {
            return Err(Error::invalid(
                "parent_tag",
                format!("parent_tag {pt:?} needs mode diff (a diff branch records its parent); add \"mode\": \"diff\""),
            ));
        }
    }
    let parent = forkd_snapshot::restore::read_record(&n.mount, &rec.snapshot_id)
        .map_err(|e| Error::Conflict(format!("the sandbox's snapshot is gone: {e:#}")))?;

    n.metrics.branches_in_flight.inc();
    let guard = InFlight(n.clone());
    let captured = {
        // Running → Branching → Running, under the VM lock (a destroy waits).
        let branching = sb.begin_branch().await?;
        let captured = branch::capture(&n.paths, &n.mount, branching.vm(), &parent, mode)
            .await
            .map_err(|e| Error::from(e.context("capturing the branch")))?;
        branching.captured();
        captured
    };
    let pause_ms = captured.pause_ms;
    let r2 = sb.record();
    n.state
        .commit(move |s| {
            // Its branch count alone: other fields have writers of their own.
            if let Some(r) = s.sandboxes.get_mut(&r2.id) {
                r.branch_count = r2.branch_count;
            }
        })
        .await?;
    let mut lineage = BTreeMap::new();
    lineage.insert("branched_from".into(), json!(id));
    lineage.insert("source_snapshot".into(), json!(rec.snapshot_id));
    if let Some(w) = workspace {
        lineage.insert("workspace".into(), json!(w));
    }

    let commit = {
        let n = n.clone();
        let tag = tag.clone();
        async move {
            let t0 = std::time::Instant::now();
            let rootfs =
                forkd_snapshot::restore::Source::new(&n.mount, &parent).map(|s| s.rootfs());
            let r = branch::commit(&n.paths, captured, &parent, &tag, lineage).await;
            bound_disk_chain(&sb, rootfs).await;
            // The slot first: once the tag reads "ready" a new branch fits.
            drop((slot, guard, claim));
            if r.is_ok() && publish {
                crate::hub::publish(&n, &tag);
            }
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
            branched_from: Some(id.to_string()),
            pause_ms: Some(crate::snapshots::whole_ms(pause_ms)),
            status: "writing".into(),
            bootable: false,
            ..empty_info(&tag)
        };
        return Ok(Branched {
            info,
            writing: true,
        });
    }
    let (made, diff_ms) = commit
        .await
        .map_err(|e| Error::from(e.context("storing the branch")))?;
    let mut info = info_of_async(n, &tag, &made.record).await?;
    info.diff_ms = Some(crate::snapshots::whole_ms(diff_ms));
    info.diff_physical_bytes = Some(made.new_stored_bytes);
    Ok(Branched {
        info,
        writing: false,
    })
}

/// After a branch's commit: flattens the sandbox's disk chain if it grew
/// past `MAX_DISK_LAYERS` and no other branch of it still reads a frozen
/// layer. A failure leaves the chain as it was (still correct, only long).
async fn bound_disk_chain(sb: &Sandbox, rootfs: anyhow::Result<std::path::PathBuf>) {
    let Some(vm) = sb.end_commit().await else {
        return;
    };
    let Ok(rootfs) = rootfs else {
        return;
    };
    match branch::bound_disk_chain(&vm, &rootfs).await {
        Ok(n) => tracing::debug!("sandbox {}: {n} disk layers", sb.id()),
        Err(e) => tracing::warn!("sandbox {}: {e:#}", sb.id()),
    }
}

/// Keeps `forkd_branches_in_flight` true while a branch runs.
struct InFlight(Arc<Node>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.metrics.branches_in_flight.dec();
    }
}
