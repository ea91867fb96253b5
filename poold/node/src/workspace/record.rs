//! Workspace records: what the durable state keeps of a workspace, its
//! [`Status`] with the table of allowed moves, and the refusals of a
//! workspace operation. The lifecycle they drive (and its diagram) is in
//! the parent module's doc.

use crate::error::{check_tag, Error, Kind, Result};
use crate::token::AccessToken;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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

/// Why a workspace operation was refused (as an [`Error`]: `From` below).
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
    /// Front-end labels (`SandboxRecord::metadata`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Create-time environment (`SandboxRecord::envs`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
    /// The name its sandboxes were asked for by (`SandboxRecord::alias`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// How clients reach its sandboxes' ports (`SandboxRecord::port_access`).
    #[serde(default, skip_serializing_if = "crate::state::PortAccess::is_default")]
    pub port_access: crate::state::PortAccess,
}

/// What a paused sandbox keeps so that its resume is the same sandbox to
/// its clients (`crate::workspace::paused`): its id and access token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Kept {
    /// The sandbox's id, which is also the workspace's name.
    pub sandbox_id: String,
    /// Its access token (E2B's `envdAccessToken`).
    pub access_token: AccessToken,
    /// When the sandbox was first spawned.
    pub created_at_unix: u64,
    /// Paused again, not killed, when its TTL passes.
    #[serde(default)]
    pub auto_pause: bool,
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
    /// Set for a paused sandbox's workspace: every sandbox it spawns is
    /// that sandbox again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<Kept>,
}

impl WorkspaceRecord {
    /// Whether this is sandbox `id`'s own workspace: a paused sandbox's,
    /// named by its id and keeping it.
    pub fn keeps(&self, id: &str) -> bool {
        self.kept.as_ref().is_some_and(|k| k.sandbox_id == id) && self.name == id
    }

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
pub fn is_state_tag(name: &str, tag: &str) -> bool {
    tag.strip_prefix("ws-")
        .and_then(|t| t.strip_prefix(name))
        .and_then(|t| t.strip_prefix("-s"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A workspace name: a tag's rules, short enough for its state tags.
pub fn check_name(name: &str) -> Result<()> {
    check_tag(name).map_err(|e| WorkspaceError::BadName(format!("workspace name: {e}")))?;
    check_tag(&state_tag(name, u32::MAX)).map_err(|_| {
        WorkspaceError::BadName(format!(
            "workspace name {name:?} is too long for its state tags (ws-<name>-s<N>); use a shorter one"
        ))
    })?;
    Ok(())
}

impl From<WorkspaceError> for Error {
    fn from(e: WorkspaceError) -> Error {
        use WorkspaceError as W;
        match &e {
            W::BadName(_) => Error::invalid("name", e.to_string()),
            W::NotFound(name) => Error::not_found(Kind::Workspace, name.clone()),
            W::WrongStatus { .. } => Error::WrongState(e.to_string()),
            W::Exists(_) | W::Busy { .. } | W::StateInUse { .. } => Error::Conflict(e.to_string()),
        }
    }
}

/// Refuses deleting snapshots `tags` when one is the recorded state of a
/// workspace not being deleted: deleting it would lose the workspace.
pub fn refuse_deleting_states<'a>(
    workspaces: impl IntoIterator<Item = &'a WorkspaceRecord>,
    tags: &[String],
) -> Result<()> {
    let owner = workspaces
        .into_iter()
        .filter(|w| w.status != Status::Deleting)
        .find_map(|w| {
            let t = w.state_tag.as_ref()?;
            tags.contains(t).then(|| (t.clone(), w.name.clone()))
        });
    match owner {
        Some((tag, name)) => Err(WorkspaceError::StateInUse { tag, name }.into()),
        None => Ok(()),
    }
}

#[cfg(test)]
impl WorkspaceRecord {
    /// A suspended workspace `dev`, id `ws-0123456789abcdef`, for tests.
    pub(crate) fn example() -> WorkspaceRecord {
        WorkspaceRecord {
            id: "ws-0123456789abcdef".into(),
            name: "dev".into(),
            source_snapshot_tag: "py".into(),
            status: Status::Suspended,
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
            kept: None,
        }
    }
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
    fn names_follow_tag_rules_with_room_for_state_tags() {
        assert!(check_name("dev-1").is_ok());
        for bad in ["", "../x", "a b", "a/b", &"x".repeat(200)] {
            let e = check_name(bad).expect_err(bad);
            assert!(
                matches!(e, Error::Invalid { field: "name", .. }),
                "{bad}: {e:?}"
            );
        }
    }

    #[test]
    fn records_round_trip() {
        let w = WorkspaceRecord::example();
        let j = serde_json::to_string(&w).unwrap();
        assert!(j.contains("\"status\":\"suspended\""), "{j}");
        assert_eq!(serde_json::from_str::<WorkspaceRecord>(&j).unwrap(), w);
        assert_eq!(w.resume_tag(), "ws-dev-s2");
    }

    #[test]
    fn a_recorded_state_is_not_deleted_under_its_workspace() {
        let w = WorkspaceRecord::example();
        let e = refuse_deleting_states([&w], &["ws-dev-s2".into()]).unwrap_err();
        assert!(matches!(e, Error::Conflict(_)), "{e:?}");
        assert!(e.to_string().contains("DELETE /v1/workspaces/dev"), "{e}");
        assert!(refuse_deleting_states([&w], &["ws-dev-s1".into()]).is_ok());
        let deleting = WorkspaceRecord {
            status: Deleting,
            ..WorkspaceRecord::example()
        };
        assert!(refuse_deleting_states([&deleting], &["ws-dev-s2".into()]).is_ok());
    }
}
