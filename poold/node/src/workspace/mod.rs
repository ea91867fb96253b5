//! Workspaces: long-lived named sandboxes that suspend to a snapshot and
//! resume from it, across poold restarts (docs/workspaces.md).
//!
//! A workspace is a record in the durable state (`State::workspaces`) and,
//! while it runs, one sandbox spawned for it (its `SandboxRecord::workspace`
//! names the workspace). Suspending branches that sandbox into the
//! workspace's next state snapshot, `ws-<name>-s<N>`, a child of the
//! snapshot the sandbox was restored from, so the store keeps only the
//! chunks that changed; the sandbox is then destroyed and the previous
//! state deleted (its chunks that the new state shares stay referenced).
//! Resuming spawns from the latest state with the settings the workspace
//! was created with (network, limits, ports).
//!
//! ```text
//!  Creating ──▶ Running ──▶ Suspending ──▶ Stopping ──▶ Suspended
//!                ▲  │ ▲          │                          │
//!                │  │ └──────────┘ (capture failed)         │
//!                │  ▼                                       ▼
//!                │ Stale ───────────────────────────────▶ Resuming
//!                └──────────────────────────────────────────┘
//!  Running, Suspended, Stale ──▶ Deleting ──▶ (record removed)
//! ```
//!
//! ([`Status::transition`] holds the table.) The transient statuses
//! (`Creating`, `Suspending`, `Stopping`, `Resuming`, `Deleting`) are the
//! in-flight lock: a second operation on a busy workspace is a 409. Each
//! move is committed to the state file before the step it announces, so a
//! poold killed at any instant leaves a record [`reconcile`] can finish:
//!
//! - `Suspending`: the new state may or may not be stored; the sandbox
//!   still runs (→ `Running`; a stored state not yet recorded is a
//!   leftover, swept) or died with the host (→ `Stale`);
//! - `Stopping`: the new state is recorded; the sandbox is destroyed
//!   (→ `Suspended`);
//! - `Creating`, `Resuming`: a sandbox that names the workspace is adopted
//!   (→ `Running`); none: a create is undone, a resume goes back;
//! - `Deleting`: the delete is finished.
//!
//! A workspace is never lost: its latest recorded state snapshot is
//! deleted only after a newer one is recorded.

pub mod paused;
pub mod record;

use crate::error::{check_tag, Error, Result};
use crate::node::Node;
use crate::spawn::{spawn, SpawnRequest};
use crate::state::SandboxRecord;
use crate::teardown::destroy;
use forkd_api::{BranchBody, CreateWorkspaceBody, WorkspaceInfo};
use forkd_snapshot::unix_now;
use record::{
    check_name, is_state_tag, state_tag, Settings, Status, WorkspaceError, WorkspaceRecord,
};
use std::sync::Arc;

fn not_found(name: &str) -> Error {
    WorkspaceError::NotFound(name.to_string()).into()
}

/// Changes workspace `name`'s record with `f` and waits until the change
/// is on disk.
async fn change<T: Send + 'static>(
    n: &Node,
    name: &str,
    f: impl FnOnce(&mut WorkspaceRecord) -> Result<T> + Send,
) -> Result<T> {
    n.state
        .commit(|s| match s.workspaces.get_mut(name) {
            Some(w) => f(w),
            None => Err(not_found(name)),
        })
        .await?
}

/// Like [`change`] for a step that must not fail (the move back after a
/// failed operation): logged, not returned.
async fn change_logged(n: &Node, name: &str, f: impl FnOnce(&mut WorkspaceRecord) + Send) {
    if let Err(e) = change(n, name, |w| {
        f(w);
        Ok(())
    })
    .await
    {
        tracing::error!("workspace {name}: {e}");
    }
}

/// Whether sandbox `id` is alive.
fn alive(n: &Node, id: Option<&str>) -> bool {
    id.is_some_and(|id| n.sandboxes.get(id).is_some())
}

/// Starts an operation: moves the workspace to the transient `to`.
/// A running workspace whose sandbox is gone is `Stale` first. Answers
/// 409 while another operation is under way and 400 when the move is not
/// allowed (`why` says what the caller must do instead). Returns the
/// record before the move.
async fn begin(n: &Node, name: &str, to: Status, why: &'static str) -> Result<WorkspaceRecord> {
    change(n, name, |w| {
        if w.status == Status::Running && !alive(n, w.sandbox_id.as_deref()) {
            w.status = Status::Stale;
            w.sandbox_id = None;
        }
        let before = w.clone();
        if w.status.is_busy() {
            return Err(WorkspaceError::Busy {
                name: name.to_string(),
                status: w.status.as_str(),
            }
            .into());
        }
        w.advance(to).map_err(|_| WorkspaceError::WrongStatus {
            name: name.to_string(),
            status: w.status.as_str(),
            why,
        })?;
        Ok(before)
    })
    .await
}

/// Spawns the workspace's sandbox from `tag` with its settings, recorded
/// as the workspace's (`SandboxRecord::workspace`), never expiring.
async fn spawn_for(n: &Arc<Node>, w: &WorkspaceRecord, tag: &str) -> Result<SandboxRecord> {
    let s = &w.settings;
    let req = SpawnRequest {
        tag: tag.to_string(),
        n: 1,
        memory_limit_mib: s.memory_limit_mib,
        cpus: s.cpus,
        pids_max: s.pids_max,
        ttl_secs: Some(0),
        per_child_netns: s.per_child_netns,
        net: s.net,
        network: s.network.clone(),
        ports: s.ports.clone(),
        volumes: s.volumes.clone(),
        metadata: s.metadata.clone(),
        envs: s.envs.clone(),
        alias: s.alias.clone(),
        port_access: s.port_access.clone(),
        // A workspace's snapshots keep what its first sandbox installed.
        ca_certs: None,
        auto_pause: w.kept.as_ref().is_some_and(|k| k.auto_pause),
        ..Default::default()
    };
    let mut recs = spawn(n, req, Some(w.id.clone()), w.kept.as_ref()).await?;
    recs.pop()
        .ok_or_else(|| Error::internal("a spawn of one sandbox returned none"))
}

/// `POST /v1/workspaces`: records the workspace, spawns its sandbox.
pub(crate) async fn create(n: &Arc<Node>, b: CreateWorkspaceBody) -> Result<WorkspaceRecord> {
    check_name(&b.name)?;
    check_tag(&b.snapshot_tag)?;
    let now = unix_now();
    let w = WorkspaceRecord {
        id: format!("ws-{}", forkd_snapshot::random_hex(8)),
        name: b.name.clone(),
        source_snapshot_tag: b.snapshot_tag.clone(),
        status: Status::Creating,
        sandbox_id: None,
        state_tag: None,
        suspend_count: 0,
        created_at_unix: now,
        last_active_unix: now,
        last_suspend_stored_bytes: None,
        settings: Settings {
            memory_limit_mib: b.memory_limit_mib,
            cpus: b.cpus,
            pids_max: b.pids_max,
            per_child_netns: b.per_child_netns,
            net: b.net,
            network: b.network,
            ports: b.ports,
            volumes: b.volumes,
            ..Default::default()
        },
        kept: None,
    };
    let w2 = w.clone();
    n.state
        .commit(move |s| {
            if s.workspaces.contains_key(&w2.name) {
                return Err(Error::from(WorkspaceError::Exists(w2.name.clone())));
            }
            s.workspaces.insert(w2.name.clone(), w2);
            Ok(())
        })
        .await
        .map_err(Error::from)??;
    let sb = match spawn_for(n, &w, &w.source_snapshot_tag).await {
        Ok(sb) => sb,
        Err(e) => {
            let name = w.name.clone();
            if let Err(e) = n
                .state
                .commit(move |s| {
                    s.workspaces.remove(&name);
                })
                .await
            {
                tracing::error!("workspace {}: {e:#}", w.name);
            }
            return Err(e);
        }
    };
    change(n, &w.name, |w| {
        w.advance(Status::Running).map_err(Error::internal)?;
        // What the sandbox got, config defaults included, is what every
        // later resume gets.
        w.settings.memory_limit_mib = sb.memory_limit_mib;
        w.settings.cpus = sb.cpus;
        w.settings.pids_max = sb.pids_max;
        w.sandbox_id = Some(sb.id.clone());
        Ok(w.clone())
    })
    .await
}

/// `POST /v1/workspaces/:name/suspend`: stores the sandbox's state as the
/// workspace's next state snapshot, then destroys the sandbox and the
/// previous state.
pub(crate) async fn suspend(n: &Arc<Node>, name: &str) -> Result<WorkspaceRecord> {
    let w = begin(
        n,
        name,
        Status::Suspending,
        "only a running workspace can be suspended",
    )
    .await?;
    let sb = w
        .sandbox_id
        .clone()
        .ok_or_else(|| Error::internal("a running workspace without a sandbox"))?;
    // A suspend killed before it was recorded may have left this tag.
    sweep_states(n, &w, true).await;
    let tag = state_tag(name, w.suspend_count + 1);
    // Stop-and-copy: the sandbox is destroyed next, so nothing gains from
    // it running meanwhile, and nothing it does after the capture is lost.
    let b = BranchBody {
        tag: Some(tag.clone()),
        mode: Some("full".into()),
        ..Default::default()
    };
    let info = match crate::branch::branch(n, &sb, &b, Some(&w.id), false).await {
        Ok(b) => b.info,
        Err(e) => {
            change_logged(n, name, |w| {
                let _ = w.advance(Status::Running);
            })
            .await;
            return Err(e);
        }
    };
    change(n, name, |w| {
        w.advance(Status::Stopping).map_err(Error::internal)?;
        w.state_tag = Some(tag);
        w.suspend_count += 1;
        w.last_active_unix = unix_now();
        w.last_suspend_stored_bytes = info.diff_physical_bytes;
        Ok(())
    })
    .await?;
    finish_stopping(n, name).await
}

/// `Stopping` → `Suspended`: destroys the sandbox, then the states the
/// record no longer names.
async fn finish_stopping(n: &Arc<Node>, name: &str) -> Result<WorkspaceRecord> {
    let sb = n
        .state
        .read(|s| s.workspaces.get(name).and_then(|w| w.sandbox_id.clone()));
    if let Some(sb) = sb {
        destroy(n, &sb).await;
    }
    let w = change(n, name, |w| {
        w.advance(Status::Suspended).map_err(Error::internal)?;
        w.sandbox_id = None;
        Ok(w.clone())
    })
    .await?;
    sweep_states(n, &w, false).await;
    Ok(w)
}

/// `POST /v1/workspaces/:name/resume`: spawns from the latest state (or
/// the source, before any suspend) with the workspace's settings.
pub(crate) async fn resume(n: &Arc<Node>, name: &str) -> Result<WorkspaceRecord> {
    let before = begin(
        n,
        name,
        Status::Resuming,
        "only a suspended or stale workspace can be resumed",
    )
    .await?;
    let sb = match spawn_for(n, &before, before.resume_tag()).await {
        Ok(sb) => sb,
        Err(e) => {
            change_logged(n, name, |w| {
                let _ = w.advance(before.status);
            })
            .await;
            return Err(e);
        }
    };
    change(n, name, |w| {
        w.advance(Status::Running).map_err(Error::internal)?;
        w.sandbox_id = Some(sb.id.clone());
        w.last_active_unix = unix_now();
        Ok(w.clone())
    })
    .await
}

/// `DELETE /v1/workspaces/:name`: destroys its sandbox and its states (the
/// source snapshot stays), then the record.
pub(crate) async fn delete(n: &Arc<Node>, name: &str) -> Result<()> {
    begin(n, name, Status::Deleting, "wait for it to finish").await?;
    finish_delete(n, name).await
}

async fn finish_delete(n: &Arc<Node>, name: &str) -> Result<()> {
    let Some(w) = n.state.read(|s| s.workspaces.get(name).cloned()) else {
        return Err(not_found(name));
    };
    for sb in owned_sandboxes(n, &w.id) {
        destroy(n, &sb).await;
    }
    let gone = WorkspaceRecord {
        state_tag: None,
        ..w.clone()
    };
    sweep_states(n, &gone, false).await;
    let name = name.to_string();
    n.state
        .commit(move |s| {
            s.workspaces.remove(&name);
        })
        .await?;
    Ok(())
}

/// Live sandboxes spawned for workspace `id`.
fn owned_sandboxes(n: &Node, id: &str) -> Vec<String> {
    n.sandboxes
        .all()
        .into_iter()
        .filter(|s| s.record().workspace.as_deref() == Some(id))
        .map(|s| s.id().to_string())
        .collect()
}

/// Deletes the state snapshots of `w` its record does not name: the
/// previous state after a suspend, one left by an interrupted suspend,
/// all of them on a delete. Only snapshots whose lineage names the
/// workspace's id are touched (a user's snapshot that happens to match
/// the tag pattern is not). A delete that fails (a sandbox someone spawned
/// from that state still runs) is logged and retried by the next sweep.
///
/// Only a suspend creates states, so only the suspend itself (`owner`)
/// sweeps while the workspace is `Suspending`: any other sweep re-reads
/// the record before each delete and leaves a state that is, or may be
/// about to become, the recorded one.
async fn sweep_states(n: &Arc<Node>, w: &WorkspaceRecord, owner: bool) {
    let (name, id, keep) = (w.name.clone(), w.id.clone(), w.state_tag.clone());
    let found = n
        .read(move |v| {
            let mut out = Vec::new();
            for (tag, _) in v.tags()? {
                if !is_state_tag(&name, &tag) || Some(&tag) == keep.as_ref() {
                    continue;
                }
                if let Some(rec) = v.resolve(&tag)? {
                    if rec.lineage.get("workspace").and_then(|x| x.as_str()) == Some(id.as_str()) {
                        out.push((tag, rec));
                    }
                }
            }
            Ok(out)
        })
        .await;
    let found = match found {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("workspace {}: listing its states: {e:#}", w.name);
            return;
        }
    };
    for (tag, rec) in found {
        use forkd_snapshot::delete::Dependents;
        let now = n.state.read(|s| s.workspaces.get(&w.name).cloned());
        if !may_sweep(now.as_ref(), &w.id, &tag, owner) {
            continue;
        }
        match crate::snapshots::delete_record(n, rec, &tag, Dependents::Orphan).await {
            Ok(()) => tracing::info!("workspace {}: deleted state {tag}", w.name),
            Err(e) => tracing::warn!("workspace {}: state {tag} not deleted yet: {}", w.name, e),
        }
    }
}

/// Whether a sweep may delete state `tag` of workspace `id`, given the
/// workspace's record now (see [`sweep_states`]).
fn may_sweep(now: Option<&WorkspaceRecord>, id: &str, tag: &str, owner: bool) -> bool {
    match now {
        // Removed, or replaced by another workspace of the same name.
        None => true,
        Some(w) if w.id != id => true,
        Some(w) if w.status == Status::Deleting => true,
        Some(w) => w.state_tag.as_deref() != Some(tag) && (owner || w.status != Status::Suspending),
    }
}

/// After a restart (sandboxes adopted): finishes or undoes what a dead
/// poold left half-done (see the module doc), destroys sandboxes of a
/// workspace that it does not run, and sweeps leftover states in the
/// background.
pub(crate) async fn reconcile(n: &Arc<Node>) -> anyhow::Result<()> {
    let all: Vec<WorkspaceRecord> = n.state.read(|s| s.workspaces.values().cloned().collect());
    let mut stopping = Vec::new();
    let mut deleting = Vec::new();
    let mut doomed = Vec::new();
    let mut fixed = Vec::new();
    for w0 in all {
        let mut w = w0.clone();
        let owned = owned_sandboxes(n, &w.id);
        let mut drop_record = false;
        match w.status {
            Status::Creating | Status::Resuming => {
                if let Some(sb) = owned.first() {
                    w.status = Status::Running;
                    w.sandbox_id = Some(sb.clone());
                } else if w.status == Status::Creating {
                    drop_record = true;
                } else {
                    w.status = if w.state_tag.is_some() {
                        Status::Suspended
                    } else {
                        Status::Stale
                    };
                }
            }
            Status::Running | Status::Suspending => {
                if alive(n, w.sandbox_id.as_deref()) {
                    w.status = Status::Running;
                } else {
                    w.status = Status::Stale;
                    w.sandbox_id = None;
                }
            }
            Status::Stopping => stopping.push(w.name.clone()),
            Status::Deleting => deleting.push(w.name.clone()),
            Status::Suspended | Status::Stale => w.sandbox_id = None,
        }
        let keep = match w.status {
            Status::Running | Status::Stopping => w.sandbox_id.clone(),
            _ => None,
        };
        doomed.extend(owned.into_iter().filter(|s| Some(s) != keep.as_ref()));
        if drop_record || w != w0 {
            tracing::info!(
                "workspace {}: {:?} after the restart → {}",
                w.name,
                w0.status,
                if drop_record {
                    "removed (its create never finished)"
                } else {
                    w.status.as_str()
                }
            );
            fixed.push((w, drop_record));
        }
    }
    for sb in doomed {
        tracing::warn!("sandbox {sb}: spawned for a workspace that does not run it; destroying it");
        destroy(n, &sb).await;
    }
    n.state
        .commit(move |s| {
            for (w, drop_record) in fixed {
                if drop_record {
                    s.workspaces.remove(&w.name);
                } else {
                    s.workspaces.insert(w.name.clone(), w);
                }
            }
        })
        .await?;
    let n = n.clone();
    tokio::spawn(async move {
        for name in stopping {
            if let Err(e) = finish_stopping(&n, &name).await {
                tracing::error!("workspace {name}: finishing its suspend: {e}");
            }
        }
        for name in deleting {
            if let Err(e) = finish_delete(&n, &name).await {
                tracing::error!("workspace {name}: finishing its delete: {e}");
            }
        }
        let all: Vec<WorkspaceRecord> = n.state.read(|s| s.workspaces.values().cloned().collect());
        for w in all.iter().filter(|w| !w.status.is_busy()) {
            sweep_states(&n, w, false).await;
        }
    });
    Ok(())
}

/// A workspace record as the API shows it. A running workspace whose
/// sandbox is gone shows `stale` (its record moves there at its next
/// operation).
pub(crate) fn info(n: &Node, w: WorkspaceRecord) -> WorkspaceInfo {
    let status = if w.status == Status::Running && !alive(n, w.sandbox_id.as_deref()) {
        Status::Stale
    } else {
        w.status
    };
    WorkspaceInfo {
        id: w.id,
        name: w.name,
        source_snapshot_tag: w.source_snapshot_tag,
        current_state_tag: w.state_tag,
        status: status.as_str().into(),
        live_sandbox_id: if status == Status::Stale {
            None
        } else {
            w.sandbox_id
        },
        created_at_unix: w.created_at_unix,
        last_active_unix: w.last_active_unix,
        last_branch_memory_path: None,
        suspend_count: w.suspend_count,
        last_suspend_stored_bytes: w.last_suspend_stored_bytes,
        memory_limit_mib: w.settings.memory_limit_mib,
        cpus: w.settings.cpus,
        pids_max: w.settings.pids_max,
        per_child_netns: w.settings.per_child_netns,
    }
}

/// Workspace `name`'s record, or 404.
pub(crate) fn get(n: &Node, name: &str) -> Result<WorkspaceRecord> {
    n.state
        .read(|s| s.workspaces.get(name).cloned())
        .ok_or_else(|| not_found(name))
}

/// Every workspace, by name.
pub(crate) fn list(n: &Node) -> Vec<WorkspaceRecord> {
    n.state.read(|s| s.workspaces.values().cloned().collect())
}

#[cfg(test)]
mod tests {
    use super::Status::*;
    use super::*;

    #[test]
    fn sweeps_leave_the_recorded_state_and_a_suspend_in_flight_alone() {
        let mut w = record();
        w.status = Running;
        // The recorded state stays; an older one goes.
        assert!(!may_sweep(Some(&w), &w.id, "ws-dev-s2", false));
        assert!(may_sweep(Some(&w), &w.id, "ws-dev-s1", false));
        // While it suspends, a state not yet recorded may be the new one:
        // only the suspend's own sweep (before its capture) touches it.
        w.status = Suspending;
        assert!(!may_sweep(Some(&w), &w.id, "ws-dev-s3", false));
        assert!(may_sweep(Some(&w), &w.id, "ws-dev-s3", true));
        // Deleting, removed, or another workspace under the name: all go.
        w.status = Deleting;
        assert!(may_sweep(Some(&w), &w.id, "ws-dev-s2", false));
        assert!(may_sweep(None, &w.id, "ws-dev-s2", false));
        w.status = Running;
        assert!(may_sweep(Some(&w), "ws-other", "ws-dev-s2", false));
    }

    fn record() -> WorkspaceRecord {
        WorkspaceRecord::example()
    }
}
