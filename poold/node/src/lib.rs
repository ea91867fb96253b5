//! forkd-node: poold's node core. One node owns the sandboxes of one data
//! dir: warm pools, spawn and destroy, refills, TTLs, adoption after a
//! restart, durable state, admission, workspaces, volume confinement,
//! branches and snapshots. It knows no HTTP and no wire format: front-ends
//! (`forkd-rest` for forkd's `/v1`, `forkd-e2b` for the E2B API, a cluster
//! gateway) adapt its typed operations ([`Node`], listed in `api`'s module
//! doc), each mapping [`Error`] to its own wire error in one function
//! (docs/design.md, "Crates" and "Errors").
//!
//! The modules layer bottom-up; a module imports only modules below it
//! (`scripts/module-graph.py poold/node/src` prints these layers):
//!
//! ```text
//!  api                               the operations: Node's public methods
//!  adopt                             after a restart
//!  network                           a running sandbox's egress replaced
//!  workspace::paused                 paused sandboxes (E2B's pause) as workspaces
//!  refill  workspace                 pool refills; named sandboxes
//!  branch  reaper  spawn             branches; TTLs and GC; spawns
//!  hub                               a tag fetched, a snapshot pushed (the node's hub)
//!  mount_watch  snapshots            the mount healed; snapshots as the node does them
//!  guest  parking  teardown          what runs in a sandbox; parked memory; how VMs end
//!  node                              the Node: tables, caps, admission
//!  pool  sandbox                     pool bookkeeping; live sandboxes, their phases
//!  state                             the durable record (state.json)
//!  volumes  workspace::record        volume confinement; workspace records
//!  admission  config  error  limits  metrics  token (access tokens)
//! ```

mod admission;
mod adopt;
mod api;
mod branch;
pub mod config;
pub mod error;
mod guest;
pub mod hub;
pub mod limits;
mod metrics;
mod mount_watch;
mod network;
mod node;
mod parking;
mod pool;
mod reaper;
mod refill;
mod sandbox;
mod snapshots;
mod spawn;
mod state;
mod teardown;
mod token;
mod volumes;
mod workspace;

pub use api::Health;
pub use branch::Branched;
pub use config::{Config, NetConfig, PoolSpec};
pub use error::{Error, Kind, Result};
pub use forkd_vmm::{Machine, Tunnel, Volume, Watch, WatchUpdate};
pub use guest::{
    check_path, EntryInfo, EvalResult, ExecEvent, ExecOutput, ExecResult, ExecSpec, FileRead,
    FileStat, ListResult, Metadata, PendingPty, PingResult, Process, ProcessControl, PtyRequest,
    PtySize, WriteAs, WriteHow,
};
pub use hub::{HubFuture, SnapshotHub};
pub use mount_watch::{Cause as MountCause, MountHealth, Recovery as MountRecovery};
pub use node::Node;
pub use pool::PoolStatus;
pub use sandbox::Phase;
pub use snapshots::SnapshotDetails;
pub use spawn::SpawnRequest;
pub use state::{PortAccess, SandboxRecord};
pub use token::AccessToken;
pub use workspace::paused::PausedSandbox;
