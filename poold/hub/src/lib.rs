//! The snapshot hub: move snapshots between hosts, sending only the chunks
//! the other side lacks. See docs/hub.md.
//!
//! - the objects and backends (`file://`, `http(s)://`, `s3://`, pack files)
//!   are forkd-remote's ([`Hub`], [`layout`], [`packs`]): forkd-fs reads
//!   them too, for lazy snapshots;
//! - [`transfer`]: push and pull (batched have/want, packs, bounded
//!   parallelism, verification, resume), full or lazy; [`compat`]: the QEMU
//!   check before a pull; [`lazy`]: what a lazy pull leaves behind and how a
//!   caller (the CLI, poold) asks about it; [`migrate`]: a layout-1 hub to
//!   layout 2; [`server`]: `forkd hub serve`; [`pack`]: pack files;
//!   [`bench`]: `forkd hub bench`; [`lazybench`]: `forkd hub bench --lazy`
//!   and (`lazybench::propagate`) `--propagate`, in network namespaces.

#![warn(missing_docs)]

pub mod auth;
pub mod bench;
mod compat;
pub mod lazy;
pub mod lazybench;
pub mod migrate;
pub mod pack;
pub mod server;
mod transfer;

pub use forkd_remote::{
    blocking, layout, packs, read_token, Credentials, Hub, Key, Timeouts, TrafficCounts,
};
pub use transfer::{
    pull, push, PublishCallback, Published, PullOptions, PushOptions, Refused, TransferReport,
};
