//! poold, the forkd daemon: its settings ([`config`]: the TOML file and
//! the flags, [`cli`]) and the composition of the node core with its
//! front-ends ([`run`]), and its `[hub]` (`hub`). Everything else is in the crates beside this one:
//! `forkd-node` (the node core: sandboxes, pools, state), `forkd-rest`
//! (forkd's `/v1` API), `forkd-e2b` (the E2B API) and `forkd-edge` (what
//! the HTTP front-ends share); `forkd-vmm`, `forkd-snapshot` and
//! `forkd-hub` below them. docs/design.md, "Crates", has the map.

pub mod cli;
pub mod config;
mod hub;
mod run;

pub use run::run;
