//! forkd-fs: a read-only FUSE filesystem that serves the layer store's
//! snapshots as plain files, assembled lazily from verified chunks, so QEMU
//! children can map `memory.bin` MAP_PRIVATE and share one page cache.
//! See docs/fs.md.
//!
//! ```text
//! MOUNT/by-id/<snapshot-id>/{memory.bin,vmstate,rootfs.img,snapshot.json}
//! MOUNT/<tag> -> by-id/<snapshot-id>
//! ```
//!
//! For poold:
//! - [`ensure_mounted`] / [`unmount`]: start, find or recover the mount
//!   (a separate `forkd-fs mount` process);
//! - [`control::Client`]: status, open-handle counts, the delete protocol
//!   (`begin_delete` / `end_delete`), refresh, prefetch, range recording;
//! - [`prefetch::save_ranges`]: store a recorded range list with a snapshot;
//! - [`lazy`]: lazy snapshots, whose chunks the mount fetches from their hub
//!   when reads need them (`remote_ready` on the control socket says
//!   whether a restore may start).

#![warn(missing_docs)]

mod arena;
mod catchup;
pub mod control;
pub mod daemon;
mod handles;
pub mod holder;
mod inode;
mod journal;
pub mod keeper;
pub mod lazy;
pub mod mount;
mod ops;
pub mod prefetch;
pub mod ranges;
mod record;
mod shared;

pub use control::{Client, ControlError, Status};
pub use mount::{
    default_control_socket, default_secondary_dir, ensure_mounted, readahead_lock_path, unmount,
    unmount_lazy, MountConfig,
};
pub use ranges::RangeList;
