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

use super::api::branch::branch_for_workspace;
use super::error::{check_tag, ApiError, ApiResult};
use super::lifecycle::{self, SpawnRequest};
use super::state::SandboxRecord;
use super::Daemon;
use forkd_api::{CreateWorkspaceBody, WorkspaceInfo};
use forkd_snapshot::unix_now;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Where a workspace is in its life (see the module doc's diagram).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Its first sandbox is being spawned.
    Creating,
    /// Its sandbox runs.
    Running,
    /// Its sandbox is being captured into a new state snapshot.
    Suspending,
    /// The new state is recorded; its sandbox is being destroyed.
    Stopping,
    /// No sandbox; resumes from its latest state (or its source).
    Suspended,
    /// Its sandbox is gone without a suspend (killed, deleted, its QEMU
    /// died); resumes from its latest state, losing what came after.
    Stale,
    /// A sandbox is being spawned from its latest state.
    Resuming,
    /// Its sandbox and states are being removed.
    Deleting,
}

/// A move the workspace lifecycle does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a workspace cannot go from {from:?} to {to:?}")]
pub struct InvalidTransition {
    /// The status it was in.
    pub from: Status,
    /// The status asked for.
    pub to: Status,
}

/// Why a workspace operation was refused (HTTP statuses: `daemon::error`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkspaceError {
    /// A name that breaks the rules (what is allowed is in the message).
    #[error("{0}")]
    BadName(String),
    /// No workspace of that name.
    #[error("workspace {0:?} not found")]
    NotFound(String),
    /// The name is taken.
    #[error("workspace {0:?} already exists; pick another name or delete it first")]
    Exists(String),
    /// Another operation on it is under way.
    #[error("workspace {name:?} is {status}; wait for that to finish")]
    Busy {
        /// The workspace.
        name: String,
        /// What it is doing (`Status::as_str`).
        status: &'static str,
    },
    /// The operation does not apply in its status.
    #[error("workspace {name:?} is {status}: {why}")]
    WrongStatus {
        /// The workspace.
        name: String,
        /// Its status (`Status::as_str`).
        status: &'static str,
        /// What the caller can do instead.
        why: &'static str,
    },
    /// A snapshot about to be deleted is a workspace's recorded state.
    #[error("snapshot {tag} is the saved state of workspace {name:?}; delete the workspace instead (DELETE /v1/workspaces/{name})")]
    StateInUse {
        /// The snapshot.
        tag: String,
        /// The workspace.
        name: String,
    },
}

impl Status {
    /// `to` if the lifecycle allows moving there from `self`.
    pub fn transition(self, to: Status) -> Result<Status, InvalidTransition> {
        use Status::*;
        let ok = matches!(
            (self, to),
            (Creating, Running)
                | (Running, Suspending | Stale | Deleting)
                | (Suspending, Stopping | Running | Stale)
                | (Stopping, Suspended)
                | (Suspended | Stale, Resuming | Deleting)
                | (Resuming, Running | Suspended | Stale)
        );
        if ok {
            Ok(to)
        } else {
            Err(InvalidTransition { from: self, to })
        }
    }

    /// Whether an operation is under way (another one is a 409).
    pub fn is_busy(self) -> bool {
        use Status::*;
        matches!(self, Creating | Suspending | Stopping | Resuming | Deleting)
    }

    /// The name the API shows: forkd's `running`, `suspended`, `stale`,
    /// and ours for the operations under way.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Creating => "creating",
            Status::Running => "running",
            Status::Suspending | Status::Stopping => "suspending",
            Status::Suspended => "suspended",
            Status::Stale => "stale",
            Status::Resuming => "resuming",
            Status::Deleting => "deleting",
        }
    }
}

/// What every sandbox of a workspace is spawned with (forkd bug #287:
/// a resume dropped the network and the memory limit).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    #[serde(default)]
    pub memory_limit_mib: Option<u64>,
    #[serde(default)]
    pub cpus: Option<f64>,
    #[serde(default)]
    pub pids_max: Option<u64>,
    #[serde(default)]
    pub per_child_netns: bool,
    #[serde(default)]
    pub net: Option<bool>,
    #[serde(default)]
    pub network: Option<forkd_net::EgressPolicy>,
    #[serde(default)]
    pub ports: Vec<forkd_net::proxy::PortSpec>,
    #[serde(default)]
    pub volumes: Vec<forkd_api::VolumeSpec>,
}

/// A workspace as recorded in the durable state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkspaceRecord {
    /// `ws-` + 16 random hex digits; kept in its states' lineage.
    pub id: String,
    pub name: String,
    pub source_snapshot_tag: String,
    pub status: Status,
    /// Its sandbox: set while `Running`, `Suspending`, `Stopping`.
    pub sandbox_id: Option<String>,
    /// Its latest state snapshot; None before the first suspend.
    pub state_tag: Option<String>,
    pub suspend_count: u32,
    pub created_at_unix: u64,
    pub last_active_unix: u64,
    /// Bytes the last suspend added to the store.
    #[serde(default)]
    pub last_suspend_stored_bytes: Option<u64>,
    pub settings: Settings,
}

impl WorkspaceRecord {
    /// Moves to `to` if [`Status::transition`] allows it.
    pub fn advance(&mut self, to: Status) -> Result<(), InvalidTransition> {
        self.status = self.status.transition(to)?;
        Ok(())
    }

    /// The tag its resume spawns from.
    pub fn resume_tag(&self) -> &str {
        self.state_tag
            .as_deref()
            .unwrap_or(&self.source_snapshot_tag)
    }
}

/// The tag of a workspace's `n`th state.
pub fn state_tag(name: &str, n: u32) -> String {
    format!("ws-{name}-s{n}")
}

/// Whether `tag` is one of workspace `name`'s state tags.
fn is_state_tag(name: &str, tag: &str) -> bool {
    tag.strip_prefix("ws-")
        .and_then(|t| t.strip_prefix(name))
        .and_then(|t| t.strip_prefix("-s"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A workspace name: a tag's rules, short enough for its state tags.
pub fn check_name(name: &str) -> ApiResult<()> {
    check_tag(name)
        .map_err(|e| WorkspaceError::BadName(format!("workspace name: {}", e.message)))?;
    check_tag(&state_tag(name, u32::MAX)).map_err(|_| {
        WorkspaceError::BadName(format!(
            "workspace name {name:?} is too long for its state tags (ws-<name>-s<N>); use a shorter one"
        ))
    })?;
    Ok(())
}

fn not_found(name: &str) -> ApiError {
    WorkspaceError::NotFound(name.to_string()).into()
}

/// Changes workspace `name`'s record with `f` and waits until the change
/// is on disk.
async fn change<T: Send + 'static>(
    d: &Daemon,
    name: &str,
    f: impl FnOnce(&mut WorkspaceRecord) -> ApiResult<T> + Send,
) -> ApiResult<T> {
    d.state
        .commit(|s| match s.workspaces.get_mut(name) {
            Some(w) => f(w),
            None => Err(not_found(name)),
        })
        .await
        .map_err(ApiError::from_anyhow)?
}

/// Like [`change`] for a step that must not fail (the move back after a
/// failed operation): logged, not returned.
async fn change_logged(d: &Daemon, name: &str, f: impl FnOnce(&mut WorkspaceRecord) + Send) {
    if let Err(e) = change(d, name, |w| {
        f(w);
        Ok(())
    })
    .await
    {
        tracing::error!("workspace {name}: {}", e.message);
    }
}

/// Whether sandbox `id` is alive.
fn alive(d: &Daemon, id: Option<&str>) -> bool {
    id.is_some_and(|id| d.sandboxes.get(id).is_some())
}

/// Starts an operation: moves the workspace to the transient `to`.
/// A running workspace whose sandbox is gone is `Stale` first. Answers
/// 409 while another operation is under way and 400 when the move is not
/// allowed (`why` says what the caller must do instead). Returns the
/// record before the move.
async fn begin(
    d: &Daemon,
    name: &str,
    to: Status,
    why: &'static str,
) -> ApiResult<WorkspaceRecord> {
    change(d, name, |w| {
        if w.status == Status::Running && !alive(d, w.sandbox_id.as_deref()) {
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
async fn spawn_for(d: &Arc<Daemon>, w: &WorkspaceRecord, tag: &str) -> ApiResult<SandboxRecord> {
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
        workspace: Some(w.id.clone()),
        // A workspace's snapshots keep what its first sandbox installed.
        ca_certs: None,
    };
    let mut recs = lifecycle::spawn(d, req).await?;
    recs.pop()
        .ok_or_else(|| ApiError::internal("a spawn of one sandbox returned none"))
}

/// `POST /v1/workspaces`: records the workspace, spawns its sandbox.
pub async fn create(d: &Arc<Daemon>, b: CreateWorkspaceBody) -> ApiResult<WorkspaceRecord> {
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
        },
    };
    let w2 = w.clone();
    d.state
        .commit(move |s| {
            if s.workspaces.contains_key(&w2.name) {
                return Err(ApiError::from(WorkspaceError::Exists(w2.name.clone())));
            }
            s.workspaces.insert(w2.name.clone(), w2);
            Ok(())
        })
        .await
        .map_err(ApiError::from_anyhow)??;
    let sb = match spawn_for(d, &w, &w.source_snapshot_tag).await {
        Ok(sb) => sb,
        Err(e) => {
            let name = w.name.clone();
            if let Err(e) = d
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
    change(d, &w.name, |w| {
        w.advance(Status::Running).map_err(ApiError::internal)?;
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
pub async fn suspend(d: &Arc<Daemon>, name: &str) -> ApiResult<WorkspaceRecord> {
    let w = begin(
        d,
        name,
        Status::Suspending,
        "only a running workspace can be suspended",
    )
    .await?;
    let sb = w
        .sandbox_id
        .clone()
        .ok_or_else(|| ApiError::internal("a running workspace without a sandbox"))?;
    // A suspend killed before it was recorded may have left this tag.
    sweep_states(d, &w, true).await;
    let tag = state_tag(name, w.suspend_count + 1);
    let info = match branch_for_workspace(d.clone(), sb.clone(), tag.clone(), w.id.clone()).await {
        Ok(info) => info,
        Err(e) => {
            change_logged(d, name, |w| {
                let _ = w.advance(Status::Running);
            })
            .await;
            return Err(e);
        }
    };
    change(d, name, |w| {
        w.advance(Status::Stopping).map_err(ApiError::internal)?;
        w.state_tag = Some(tag);
        w.suspend_count += 1;
        w.last_active_unix = unix_now();
        w.last_suspend_stored_bytes = info.diff_physical_bytes;
        Ok(())
    })
    .await?;
    finish_stopping(d, name).await
}

/// `Stopping` → `Suspended`: destroys the sandbox, then the states the
/// record no longer names.
async fn finish_stopping(d: &Arc<Daemon>, name: &str) -> ApiResult<WorkspaceRecord> {
    let sb = d
        .state
        .read(|s| s.workspaces.get(name).and_then(|w| w.sandbox_id.clone()));
    if let Some(sb) = sb {
        lifecycle::destroy(d, &sb).await;
    }
    let w = change(d, name, |w| {
        w.advance(Status::Suspended).map_err(ApiError::internal)?;
        w.sandbox_id = None;
        Ok(w.clone())
    })
    .await?;
    sweep_states(d, &w, false).await;
    Ok(w)
}

/// `POST /v1/workspaces/:name/resume`: spawns from the latest state (or
/// the source, before any suspend) with the workspace's settings.
pub async fn resume(d: &Arc<Daemon>, name: &str) -> ApiResult<WorkspaceRecord> {
    let before = begin(
        d,
        name,
        Status::Resuming,
        "only a suspended or stale workspace can be resumed",
    )
    .await?;
    let sb = match spawn_for(d, &before, before.resume_tag()).await {
        Ok(sb) => sb,
        Err(e) => {
            change_logged(d, name, |w| {
                let _ = w.advance(before.status);
            })
            .await;
            return Err(e);
        }
    };
    change(d, name, |w| {
        w.advance(Status::Running).map_err(ApiError::internal)?;
        w.sandbox_id = Some(sb.id.clone());
        w.last_active_unix = unix_now();
        Ok(w.clone())
    })
    .await
}

/// `DELETE /v1/workspaces/:name`: destroys its sandbox and its states (the
/// source snapshot stays), then the record.
pub async fn delete(d: &Arc<Daemon>, name: &str) -> ApiResult<()> {
    begin(d, name, Status::Deleting, "wait for it to finish").await?;
    finish_delete(d, name).await
}

async fn finish_delete(d: &Arc<Daemon>, name: &str) -> ApiResult<()> {
    let Some(w) = d.state.read(|s| s.workspaces.get(name).cloned()) else {
        return Err(not_found(name));
    };
    for sb in owned_sandboxes(d, &w.id) {
        lifecycle::destroy(d, &sb).await;
    }
    let gone = WorkspaceRecord {
        state_tag: None,
        ..w.clone()
    };
    sweep_states(d, &gone, false).await;
    let n = name.to_string();
    d.state
        .commit(move |s| {
            s.workspaces.remove(&n);
        })
        .await
        .map_err(ApiError::from_anyhow)
}

/// Live sandboxes spawned for workspace `id`.
fn owned_sandboxes(d: &Daemon, id: &str) -> Vec<String> {
    d.sandboxes
        .all()
        .into_iter()
        .filter(|s| s.record().workspace.as_deref() == Some(id))
        .map(|s| s.id.clone())
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
async fn sweep_states(d: &Arc<Daemon>, w: &WorkspaceRecord, owner: bool) {
    let (name, id, keep) = (w.name.clone(), w.id.clone(), w.state_tag.clone());
    let found = d
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
        let now = d.state.read(|s| s.workspaces.get(&w.name).cloned());
        if !may_sweep(now.as_ref(), &w.id, &tag, owner) {
            continue;
        }
        match lifecycle::delete_snapshot(d, rec, &tag, Dependents::Orphan).await {
            Ok(()) => tracing::info!("workspace {}: deleted state {tag}", w.name),
            Err(e) => tracing::warn!(
                "workspace {}: state {tag} not deleted yet: {}",
                w.name,
                e.message
            ),
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

/// Refuses (409) to delete snapshots `tags` when one is the recorded state
/// of a workspace not being deleted: deleting it would lose the workspace.
pub fn refuse_deleting_states(d: &Daemon, tags: &[String]) -> ApiResult<()> {
    let owner = d.state.read(|s| {
        s.workspaces
            .values()
            .filter(|w| w.status != Status::Deleting)
            .find_map(|w| {
                let t = w.state_tag.as_ref()?;
                tags.contains(t).then(|| (t.clone(), w.name.clone()))
            })
    });
    match owner {
        Some((tag, name)) => Err(WorkspaceError::StateInUse { tag, name }.into()),
        None => Ok(()),
    }
}

/// After a restart (sandboxes adopted): finishes or undoes what a dead
/// poold left half-done (see the module doc), destroys sandboxes of a
/// workspace that it does not run, and sweeps leftover states in the
/// background.
pub async fn reconcile(d: &Arc<Daemon>) -> anyhow::Result<()> {
    let all: Vec<WorkspaceRecord> = d.state.read(|s| s.workspaces.values().cloned().collect());
    let mut stopping = Vec::new();
    let mut deleting = Vec::new();
    let mut doomed = Vec::new();
    let mut fixed = Vec::new();
    for w0 in all {
        let mut w = w0.clone();
        let owned = owned_sandboxes(d, &w.id);
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
                if alive(d, w.sandbox_id.as_deref()) {
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
        lifecycle::destroy(d, &sb).await;
    }
    d.state
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
    let d = d.clone();
    tokio::spawn(async move {
        for name in stopping {
            if let Err(e) = finish_stopping(&d, &name).await {
                tracing::error!("workspace {name}: finishing its suspend: {}", e.message);
            }
        }
        for name in deleting {
            if let Err(e) = finish_delete(&d, &name).await {
                tracing::error!("workspace {name}: finishing its delete: {}", e.message);
            }
        }
        let all: Vec<WorkspaceRecord> = d.state.read(|s| s.workspaces.values().cloned().collect());
        for w in all.iter().filter(|w| !w.status.is_busy()) {
            sweep_states(&d, w, false).await;
        }
    });
    Ok(())
}

/// A workspace record as the API shows it. A running workspace whose
/// sandbox is gone shows `stale` (its record moves there at its next
/// operation).
pub fn info(d: &Daemon, w: WorkspaceRecord) -> WorkspaceInfo {
    let status = if w.status == Status::Running && !alive(d, w.sandbox_id.as_deref()) {
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
pub fn get(d: &Daemon, name: &str) -> ApiResult<WorkspaceRecord> {
    d.state
        .read(|s| s.workspaces.get(name).cloned())
        .ok_or_else(|| not_found(name))
}

/// Every workspace, by name.
pub fn list(d: &Daemon) -> Vec<WorkspaceRecord> {
    d.state.read(|s| s.workspaces.values().cloned().collect())
}

#[cfg(test)]
mod tests {
    use super::Status::{self, *};
    use super::*;

    const ALL: [Status; 8] = [
        Creating, Running, Suspending, Stopping, Suspended, Stale, Resuming, Deleting,
    ];

    /// The whole table: exactly these moves are allowed.
    #[test]
    fn transition_table() {
        let allowed = [
            (Creating, Running),
            (Running, Suspending),
            (Running, Stale),
            (Running, Deleting),
            (Suspending, Stopping),
            (Suspending, Running),
            (Suspending, Stale),
            (Stopping, Suspended),
            (Suspended, Resuming),
            (Suspended, Deleting),
            (Stale, Resuming),
            (Stale, Deleting),
            (Resuming, Running),
            (Resuming, Suspended),
            (Resuming, Stale),
        ];
        for from in ALL {
            for to in ALL {
                let r = from.transition(to);
                if allowed.contains(&(from, to)) {
                    assert_eq!(r, Ok(to), "{from:?} -> {to:?}");
                } else {
                    assert!(r.is_err(), "{from:?} -> {to:?} must be refused");
                }
            }
        }
    }

    #[test]
    fn busy_statuses_are_the_transient_ones() {
        let busy: Vec<_> = ALL.into_iter().filter(|s| s.is_busy()).collect();
        assert_eq!(busy, [Creating, Suspending, Stopping, Resuming, Deleting]);
        // Nothing starts from a busy status but its own ending.
        assert!(Suspending.transition(Resuming).is_err());
        assert!(Resuming.transition(Suspending).is_err());
        assert!(Deleting.transition(Running).is_err());
    }

    #[test]
    fn state_tags_belong_to_one_name() {
        assert_eq!(state_tag("a", 3), "ws-a-s3");
        assert!(is_state_tag("a", "ws-a-s3"));
        assert!(is_state_tag("a", "ws-a-s12"));
        // Another workspace's ("a-s1") tags are not "a"'s.
        assert!(!is_state_tag("a", "ws-a-s1-s2"));
        assert!(is_state_tag("a-s1", "ws-a-s1-s2"));
        assert!(!is_state_tag("a", "ws-a-s"));
        assert!(!is_state_tag("a", "ws-ab-s1"));
        assert!(!is_state_tag("a", "a-s1"));
    }

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

    #[test]
    fn names_follow_tag_rules_with_room_for_state_tags() {
        assert!(check_name("dev-1").is_ok());
        for bad in ["", "../x", "a b", "a/b", &"x".repeat(200)] {
            let e = check_name(bad).expect_err(bad);
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    fn record() -> WorkspaceRecord {
        WorkspaceRecord {
            id: "ws-0123456789abcdef".into(),
            name: "dev".into(),
            source_snapshot_tag: "py".into(),
            status: Suspended,
            sandbox_id: None,
            state_tag: Some("ws-dev-s2".into()),
            suspend_count: 2,
            created_at_unix: 1,
            last_active_unix: 2,
            last_suspend_stored_bytes: Some(4096),
            settings: Settings {
                memory_limit_mib: Some(256),
                per_child_netns: true,
                ..Default::default()
            },
        }
    }

    #[test]
    fn records_round_trip() {
        let w = record();
        let j = serde_json::to_string(&w).unwrap();
        assert!(j.contains("\"status\":\"suspended\""), "{j}");
        assert_eq!(serde_json::from_str::<WorkspaceRecord>(&j).unwrap(), w);
        assert_eq!(w.resume_tag(), "ws-dev-s2");
    }
}
