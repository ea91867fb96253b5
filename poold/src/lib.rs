//! poold: the forkd daemon, the `forkd` CLI, and the QEMU VM runner they share.

pub mod cli;
pub mod hub;
pub mod images;
pub mod paths;
pub mod util;
pub mod vm;
