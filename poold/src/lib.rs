//! poold: the forkd daemon (the `/v1` REST API, warm pools, sandbox
//! lifecycle, durable state) and the `forkd` CLI with its benchmarks.
//!
//! The machinery lives in the crates beside this one: `forkd-vmm` runs and
//! talks to QEMU, `forkd-snapshot` makes and restores snapshots and images,
//! `forkd-hub` moves snapshots between hosts. This crate decides *when*:
//! it owns no QEMU command line and no store format.

pub mod daemon;
