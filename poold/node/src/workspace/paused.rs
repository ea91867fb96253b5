//! Paused sandboxes (E2B's pause and resume): pausing a sandbox makes it
//! a workspace named by the sandbox's id, whose record keeps the sandbox's
//! id and access token ([`Kept`]), and suspends that workspace like any
//! other (the parent module). A resume spawns the sandbox again as itself:
//! same id, token, metadata, envs and template, from the state the pause
//! stored, so a client holding the id and token goes on as before, across
//! poold restarts too.
//!
//! Invariants:
//! - a kept workspace is named by its sandbox's id and spawns only that
//!   sandbox, never a second one beside it;
//! - a paused sandbox is listed here ([`list`]), never among the node's
//!   live sandboxes, and a running one only there;
//! - killing a kept sandbox, paused or running ([`kill`]), deletes its
//!   workspace and states with it; only a QEMU that dies on its own leaves
//!   the workspace stale, resumable from its last pause.

use super::record::{Kept, Settings, Status, WorkspaceError, WorkspaceRecord};
use crate::error::{Error, Kind, Result};
use crate::node::Node;
use crate::sandbox::Sandbox;
use crate::state::SandboxRecord;
use crate::token::AccessToken;
use forkd_snapshot::unix_now;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A paused sandbox as front-ends list it.
#[derive(Debug, Clone, PartialEq)]
pub struct PausedSandbox {
    /// Its id, the same as while it ran.
    pub id: String,
    /// The snapshot it was first spawned from.
    pub snapshot_tag: String,
    /// The name it was asked for by (`SandboxRecord::alias`).
    pub alias: Option<String>,
    /// Its labels (`SandboxRecord::metadata`).
    pub metadata: BTreeMap<String, String>,
    /// When it was first spawned.
    pub created_at_unix: u64,
    /// When it was last paused.
    pub paused_at_unix: u64,
    /// Its limits, as its resume gets them.
    pub memory_limit_mib: Option<u64>,
    /// CPU quota, as its resume gets it.
    pub cpus: Option<f64>,
    /// Its access token, unchanged by the pause.
    pub access_token: AccessToken,
}

/// What its resumes are spawned with: everything the sandbox was.
fn settings_of(r: &SandboxRecord) -> Settings {
    let networked = r.net.is_some();
    Settings {
        memory_limit_mib: r.memory_limit_mib,
        cpus: r.cpus,
        pids_max: r.pids_max,
        per_child_netns: networked,
        net: networked.then_some(true),
        network: r.egress.clone(),
        ports: r.ports.clone(),
        // The state snapshot records the folders the sandbox had.
        volumes: Vec::new(),
        metadata: r.metadata.clone(),
        envs: r.envs.clone(),
        alias: r.alias.clone(),
        port_access: r.port_access.clone(),
    }
}

/// Sandbox `id`'s kept workspace, if it has one.
fn kept_workspace(n: &Node, id: &str) -> Option<WorkspaceRecord> {
    n.state
        .read(|s| s.workspaces.get(id).filter(|w| w.keeps(id)).cloned())
}

/// Makes running sandbox `sb` the sandbox of a new kept workspace named
/// by its id, in one durable write with the sandbox's record.
async fn adopt(n: &Arc<Node>, sb: &Sandbox) -> Result<()> {
    let rec = sb.record();
    super::record::check_name(&rec.id)?;
    let now = unix_now();
    let w = WorkspaceRecord {
        id: format!("ws-{}", forkd_snapshot::random_hex(8)),
        name: rec.id.clone(),
        source_snapshot_tag: rec.snapshot_tag.clone(),
        status: Status::Running,
        sandbox_id: Some(rec.id.clone()),
        state_tag: None,
        suspend_count: 0,
        created_at_unix: now,
        last_active_unix: now,
        last_suspend_stored_bytes: None,
        settings: settings_of(&rec),
        kept: Some(Kept {
            sandbox_id: rec.id.clone(),
            access_token: rec.access_token.clone(),
            created_at_unix: rec.created_at_unix,
            auto_pause: rec.auto_pause,
        }),
    };
    let ws = w.id.clone();
    // The live record first, so a second pause finds it claimed.
    if !sb.claim_for_workspace(&ws) {
        return Err(WorkspaceError::Busy {
            name: rec.id.clone(),
            status: "being paused",
        }
        .into());
    }
    let id = rec.id.clone();
    let committed = n
        .state
        .commit(move |s| {
            if s.workspaces.contains_key(&w.name) {
                return Err(Error::from(WorkspaceError::Exists(w.name.clone())));
            }
            let Some(r) = s.sandboxes.get_mut(&id) else {
                return Err(Error::not_found(Kind::Sandbox, id.clone()));
            };
            r.workspace = Some(w.id.clone());
            // From the durable record, in this write: an egress update
            // committed since `rec` was read is kept.
            let mut w = w;
            w.settings.network = r.egress.clone();
            s.workspaces.insert(w.name.clone(), w);
            Ok(())
        })
        .await
        .map_err(Error::from)
        .and_then(|r| r);
    if committed.is_err() {
        sb.unclaim(&ws);
    }
    committed
}

/// Pauses running sandbox `id`: its memory and disk go to the store as
/// its kept workspace's next state, its VM goes away.
pub(crate) async fn pause(n: &Arc<Node>, id: &str) -> Result<()> {
    let sb = n.sandbox(id)?;
    match sb.record().workspace {
        None => adopt(n, &sb).await?,
        Some(_) if kept_workspace(n, id).is_some() => {}
        Some(ws) => {
            let name = n
                .state
                .read(|s| {
                    s.workspaces
                        .values()
                        .find(|w| w.id == ws)
                        .map(|w| w.name.clone())
                })
                .unwrap_or(ws);
            return Err(Error::WrongState(format!(
                "sandbox {id} is workspace {name:?}'s: suspend the workspace instead (POST /v1/workspaces/{name}/suspend)"
            )));
        }
    }
    super::suspend(n, id).await.map(|_| ())
}

/// Resumes paused sandbox `id` as itself, killed `ttl_secs` from now (0:
/// never), or paused then when `auto_pause` says so (None: as before).
/// Answers the running sandbox's record.
pub(crate) async fn resume(
    n: &Arc<Node>,
    id: &str,
    ttl_secs: u64,
    auto_pause: Option<bool>,
) -> Result<SandboxRecord> {
    if kept_workspace(n, id).is_none() {
        return Err(Error::not_found(Kind::Sandbox, id));
    }
    if let Some(on) = auto_pause {
        super::change(n, id, |w| {
            if let Some(k) = w.kept.as_mut() {
                k.auto_pause = on;
            }
            Ok(())
        })
        .await?;
    }
    super::resume(n, id).await?;
    crate::reaper::set_ttl(n, id, ttl_secs).await
}

/// Kills sandbox `id`, running or paused, with its kept workspace and
/// states. false: there is no such sandbox.
pub(crate) async fn kill(n: &Arc<Node>, id: &str) -> Result<bool> {
    if kept_workspace(n, id).is_some() {
        super::delete(n, id).await?;
        return Ok(true);
    }
    Ok(crate::teardown::destroy(n, id).await)
}

/// Ends `r`, whose TTL passed and which a workspace keeps
/// (`reaper::kept`; the reaper calls this): paused when it pauses at its
/// TTL (killed if the pause fails: the TTL bounds what it uses), else
/// killed with its kept workspace.
pub(crate) async fn end(n: &Arc<Node>, r: &SandboxRecord) {
    if r.auto_pause {
        match pause(n, &r.id).await {
            Ok(()) => {
                tracing::info!("sandbox {}: TTL passed; paused", r.id);
                return;
            }
            Err(e) => tracing::error!(
                "sandbox {}: TTL passed, pause failed ({e}); killing it",
                r.id
            ),
        }
    } else {
        tracing::info!("sandbox {}: TTL expired", r.id);
    }
    if let Err(e) = kill(n, &r.id).await {
        tracing::error!("sandbox {}: killing it at its TTL: {e}", r.id);
    }
}

/// Whether a kept workspace's status shows its sandbox paused: stored
/// (or being stored, or coming back) and not running.
fn is_paused(w: &WorkspaceRecord) -> bool {
    match w.status {
        Status::Suspended | Status::Stopping | Status::Resuming => true,
        Status::Stale => w.state_tag.is_some(),
        Status::Creating | Status::Running | Status::Suspending | Status::Deleting => false,
    }
}

fn paused_of(w: &WorkspaceRecord) -> Option<PausedSandbox> {
    let k = w
        .kept
        .as_ref()
        .filter(|_| w.keeps(&w.name) && is_paused(w))?;
    Some(PausedSandbox {
        id: k.sandbox_id.clone(),
        snapshot_tag: w.source_snapshot_tag.clone(),
        alias: w.settings.alias.clone(),
        metadata: w.settings.metadata.clone(),
        created_at_unix: k.created_at_unix,
        paused_at_unix: w.last_active_unix,
        memory_limit_mib: w.settings.memory_limit_mib,
        cpus: w.settings.cpus,
        access_token: k.access_token.clone(),
    })
}

/// Paused sandbox `id`, if it is one.
pub(crate) fn get(n: &Node, id: &str) -> Option<PausedSandbox> {
    kept_workspace(n, id).as_ref().and_then(paused_of)
}

/// Every paused sandbox, oldest first.
pub(crate) fn list(n: &Node) -> Vec<PausedSandbox> {
    let mut out: Vec<PausedSandbox> = n
        .state
        .read(|s| s.workspaces.values().filter_map(paused_of).collect());
    out.sort_by(|a, b| (a.created_at_unix, &a.id).cmp(&(b.created_at_unix, &b.id)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(status: Status, state: Option<&str>) -> WorkspaceRecord {
        WorkspaceRecord {
            id: "ws-0123456789abcdef".into(),
            name: "sb-1".into(),
            source_snapshot_tag: "py".into(),
            status,
            sandbox_id: None,
            state_tag: state.map(str::to_string),
            suspend_count: 1,
            created_at_unix: 5,
            last_active_unix: 9,
            last_suspend_stored_bytes: None,
            settings: Settings {
                alias: Some("base".into()),
                ..Default::default()
            },
            kept: Some(Kept {
                sandbox_id: "sb-1".into(),
                access_token: AccessToken::mint(),
                created_at_unix: 3,
                auto_pause: false,
            }),
        }
    }

    #[test]
    fn only_a_stored_sandbox_that_does_not_run_is_paused() {
        let p = paused_of(&kept(Status::Suspended, Some("ws-sb-1-s1"))).unwrap();
        assert_eq!(
            (p.id.as_str(), p.created_at_unix, p.paused_at_unix),
            ("sb-1", 3, 9)
        );
        assert_eq!(p.alias.as_deref(), Some("base"));
        for s in [Status::Stopping, Status::Resuming] {
            assert!(paused_of(&kept(s, Some("ws-sb-1-s1"))).is_some(), "{s:?}");
        }
        for s in [Status::Running, Status::Suspending, Status::Deleting] {
            assert!(paused_of(&kept(s, Some("ws-sb-1-s1"))).is_none(), "{s:?}");
        }
        // Stale shows paused only with a state to resume from.
        assert!(paused_of(&kept(Status::Stale, Some("ws-sb-1-s1"))).is_some());
        assert!(paused_of(&kept(Status::Stale, None)).is_none());
    }

    #[test]
    fn a_workspace_that_keeps_another_sandbox_or_none_is_not_a_paused_sandbox() {
        let mut w = kept(Status::Suspended, Some("ws-sb-1-s1"));
        w.name = "dev".into();
        assert!(paused_of(&w).is_none(), "named otherwise");
        let mut w = kept(Status::Suspended, Some("ws-sb-1-s1"));
        w.kept = None;
        assert!(paused_of(&w).is_none(), "an ordinary workspace");
    }

    #[test]
    fn a_resume_gets_everything_the_sandbox_was() {
        let r: SandboxRecord = serde_json::from_value(serde_json::json!({
            "id": "sb-1", "snapshot_tag": "py", "snapshot_id": "x", "created_at_unix": 1,
            "pid": 1, "memory_limit_mib": 256, "cpus": 1.5, "hostname": "sb-1",
            "metadata": {"run": "r"}, "envs": {"A": "b"}, "alias": "base",
        }))
        .unwrap();
        let s = settings_of(&r);
        assert_eq!((s.memory_limit_mib, s.cpus), (Some(256), Some(1.5)));
        assert_eq!(s.metadata, r.metadata);
        assert_eq!(s.envs, r.envs);
        assert_eq!(s.alias.as_deref(), Some("base"));
        // No network: none asked for on resume.
        assert_eq!((s.net, s.per_child_netns), (None, false));
    }
}
