//! forkd's snapshots: warm parents and copy-on-write children
//! (docs/design.md, "The VMM and its QMP sequences"), the guest images they
//! boot from, and the data dir and layer store they live in.
//!
//! This crate turns `forkd-vmm`'s mechanisms into create, restore, branch
//! and delete, and checks compatibility before anything starts. It must not
//! know pools, sandboxes or HTTP: `poold` decides when; this crate does.
//!
//! - [`boot`]: cold-boot a VM from an image;
//! - [`create`]: boot a parent, warm it up, pause, save, ingest into the
//!   layer store as one snapshot;
//! - [`restore`]: start one child paused from a snapshot served by forkd-fs,
//!   then hand it out (resume + identity);
//! - [`ca`]: extra CA certificates guests trust, checked at the boundary;
//! - [`fork`]: N children at once, with per-phase timings;
//! - [`config`]: what a snapshot records about its VM, and the check that
//!   refuses a restore this host cannot do;
//! - [`staging`]: scratch directories that never outlive their owner;
//! - [`SnapshotError`]: why a snapshot cannot be read, restored or made.

#![warn(missing_docs)]

pub mod boot;
pub mod branch;
pub mod ca;
mod config;
pub mod create;
pub mod delete;
mod error;
pub mod fork;
pub mod images;
pub mod info;
mod paths;
mod progress;
pub mod restore;
pub mod staging;
pub mod store;
mod util;

pub use config::{host_memory_mib, VmConfig};
pub use error::SnapshotError;
pub use paths::{Paths, DEFAULT_HOME};
pub use progress::{mib, Progress};
pub use util::{format_unix, random_hex, unix_now};

use anyhow::{Context, Result};

/// The forkd-fs mount of this data dir, started (or recovered) if needed.
/// Blocking: call from a blocking context.
pub fn ensure_mount(paths: &Paths) -> Result<forkd_fs::MountConfig> {
    let cfg = mount_config(paths)?;
    if !paths.store_dir().join("db").is_dir() {
        // forkd-fs reads a secondary view, which needs an existing store.
        drop(crate::store::open_rw(paths)?);
    }
    forkd_fs::ensure_mounted(&cfg).with_context(|| {
        format!(
            "mounting the layer store at {} (forkd-fs)",
            paths.mount_dir().display()
        )
    })?;
    Ok(cfg)
}

/// How this data dir's store is mounted: readable by root and, when VMs
/// are jailed, by the jail group (files 0440, directories 0550; nobody
/// else, docs/security.md).
pub fn mount_config(paths: &Paths) -> Result<forkd_fs::MountConfig> {
    let jail = forkd_vmm::JailConfig::get()?;
    let mut cfg = forkd_fs::MountConfig::new(paths.mount_dir(), paths.store_dir());
    cfg.gid = jail.enabled.then_some(jail.gid);
    Ok(cfg)
}

/// [`ensure_mount`] from async code.
pub async fn ensure_mount_async(paths: &Paths) -> Result<forkd_fs::MountConfig> {
    let p = paths.clone();
    tokio::task::spawn_blocking(move || ensure_mount(&p))
        .await
        .context("mount task panicked")?
}
