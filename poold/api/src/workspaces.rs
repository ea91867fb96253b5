//! `/v1/workspaces`: long-lived named sandboxes that suspend to a
//! snapshot and resume from it (forkd's shapes, docs/workspaces.md).

use crate::types::{EgressSchema, PortSchema};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /v1/workspaces`: forkd's fields, then the spawn settings of ours
/// that a workspace keeps across every resume.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWorkspaceBody {
    /// The workspace's name: a tag's rules (letters, digits, `.`, `_`, `-`).
    pub name: String,
    /// Tag of the snapshot its first sandbox is restored from.
    pub snapshot_tag: String,
    /// forkd: a network namespace for the workspace's sandbox.
    #[serde(default)]
    pub per_child_netns: bool,
    /// Memory limit of its sandbox, MiB; unset takes the config default.
    #[serde(default)]
    pub memory_limit_mib: Option<u64>,
    /// Ours: CPU quota in CPUs.
    #[serde(default)]
    pub cpus: Option<f64>,
    /// Ours: most tasks its VM process may hold.
    #[serde(default)]
    pub pids_max: Option<u64>,
    /// Ours: false for no way out, true to require a networked snapshot.
    #[serde(default)]
    pub net: Option<bool>,
    /// Ours: the egress policy (docs/network.md).
    #[serde(default)]
    #[schema(value_type = Option<EgressSchema>)]
    pub network: Option<forkd_net::EgressPolicy>,
    /// Ours: guest ports to publish on the host.
    #[serde(default)]
    #[schema(value_type = Vec<PortSchema>)]
    pub ports: Vec<forkd_net::proxy::PortSpec>,
    /// Ours: rebind the snapshot's volumes (docs/volumes.md), on every
    /// sandbox of the workspace.
    #[serde(default)]
    pub volumes: Vec<crate::VolumeSpec>,
}

/// `POST /v1/workspaces/:name/suspend`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SuspendWorkspaceBody {
    /// forkd: a diff snapshot. Accepted; every suspend here stores only the
    /// chunks the previous state lacks, whatever this says.
    #[serde(default)]
    pub diff: bool,
}

/// forkd's `WorkspaceInfo`, plus ours.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WorkspaceInfo {
    /// `ws-` + 16 hex digits; stable for the workspace's life.
    pub id: String,
    /// The name it is addressed by (`/v1/workspaces/:name`).
    pub name: String,
    /// Tag of the snapshot it was created from.
    pub source_snapshot_tag: String,
    /// Tag of the snapshot its last suspend stored; absent before the first.
    pub current_state_tag: Option<String>,
    /// `running`, `suspended` or `stale` (forkd's), or, ours, while an
    /// operation is under way: `creating`, `suspending`, `resuming`, `deleting`.
    pub status: String,
    /// Id of its sandbox while running.
    pub live_sandbox_id: Option<String>,
    /// When it was created, seconds since the Unix epoch.
    pub created_at_unix: u64,
    /// Its last create, suspend or resume, seconds since the Unix epoch.
    pub last_active_unix: u64,
    /// forkd's path of the last branch's memory file; always null (states live in the layer store).
    pub last_branch_memory_path: Option<String>,
    // Ours.
    /// How many times it was suspended.
    pub suspend_count: u32,
    /// Bytes the last suspend added to the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_suspend_stored_bytes: Option<u64>,
    /// Memory limit every sandbox of it gets, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit_mib: Option<u64>,
    /// CPU quota every sandbox of it gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Task limit every sandbox of it gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
    /// Whether its sandboxes get a network namespace.
    pub per_child_netns: bool,
}
