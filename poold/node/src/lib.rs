//! forkd-node: poold's node core. One node owns the sandboxes of one data
//! dir: warm pools, spawn and destroy, refills, TTLs, adoption after a
//! restart, durable state, admission, workspaces, volume confinement,
//! branches and snapshots. It knows no HTTP and no wire format: front-ends
//! (`forkd-rest` for forkd's `/v1`, `forkd-e2b` for the E2B API, a cluster
//! gateway) adapt its typed operations, each mapping [`Error`] to its own
//! wire error in one function (docs/design.md, "Crates" and "Errors").

pub mod admission;
pub mod config;
pub mod error;
pub mod limits;
pub mod metrics;
pub mod pool;
pub mod sandbox;
pub mod state;
pub mod volumes;
pub mod workspace;

pub use config::{Config, NetConfig, PoolSpec};
pub use error::{Error, Kind, Result};
