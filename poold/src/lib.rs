//! poold: the forkd daemon, the `forkd` CLI, and the QEMU VM runner they share.

pub mod auth;
pub mod bench;
pub mod cli;
pub mod client;
pub mod daemon;
pub mod hub;
pub mod images;
pub mod paths;
pub mod progress;
pub mod snapshot;
pub mod store;
pub mod util;
pub mod vm;
