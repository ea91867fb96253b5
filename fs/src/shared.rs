//! State shared by the FUSE request threads and the control socket.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use forkd_layers::{validate_tag, SnapshotId, StoreView};
use tracing::warn;

use crate::catchup::CatchUp;
use crate::control::ReadCounters;
use crate::handles::{Handles, Visibility};
use crate::inode::{self, FileNode, Inodes, SnapInfo};
use crate::record::Recorder;

/// Read counters (for `status`).
#[derive(Default)]
pub struct ReadStats {
    pub requests: AtomicU64,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
}

impl ReadStats {
    pub fn snapshot(&self) -> ReadCounters {
        ReadCounters {
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

/// Everything a mount serves from.
pub struct Shared {
    pub view: StoreView,
    pub store_dir: PathBuf,
    pub mountpoint: PathBuf,
    pub inodes: Inodes,
    pub handles: Handles,
    pub recorder: Recorder,
    pub catchup: CatchUp,
    pub stats: ReadStats,
    /// Set once the session exists; used to drop kernel caches of hidden
    /// or deleted snapshots.
    pub notifier: Mutex<Option<fuser::Notifier>>,
    pub started: Instant,
    /// The group that may read the mount (the VM jail's), or None: root
    /// only. Files are served `0440 root:<group>`, directories `0550`.
    pub group: Option<u32>,
    /// Behind a holder: who holds the connection, and which worker this is.
    pub worker: Option<WorkerOf>,
    /// Lazy snapshots: faults from hubs, working sets, the fill.
    pub lazy: std::sync::OnceLock<Arc<crate::lazy::Lazy>>,
}

/// A worker's place behind its holder (`holder`).
#[derive(Debug, Clone)]
pub struct WorkerOf {
    /// The holder's pid.
    pub holder_pid: u32,
    /// This worker's generation (1 = the first).
    pub generation: u64,
    /// The mount's device (`major:minor`, as in mountinfo), which tells
    /// this connection's mount apart from a later one at the same path
    /// after a lazy unmount.
    pub dev: Option<String>,
}

impl Shared {
    pub fn new(
        view: StoreView,
        store_dir: PathBuf,
        mountpoint: PathBuf,
        group: Option<u32>,
        worker: Option<WorkerOf>,
    ) -> Arc<Shared> {
        Arc::new(Shared {
            catchup: CatchUp::new(view.clone()),
            view,
            store_dir,
            mountpoint,
            inodes: Inodes::default(),
            handles: Handles::default(),
            recorder: Recorder::default(),
            stats: ReadStats::default(),
            notifier: Mutex::new(None),
            started: Instant::now(),
            group,
            worker,
            lazy: std::sync::OnceLock::new(),
        })
    }

    /// A visible snapshot by id. A miss catches up with the writer (a
    /// catch-up started after `t0`) before giving up, so a snapshot
    /// committed by another process is found at once.
    pub fn find_snapshot(
        &self,
        id: &SnapshotId,
        t0: Instant,
    ) -> forkd_layers::Result<Option<Arc<SnapInfo>>> {
        if !self.visible(id)? {
            return Ok(None);
        }
        if let Some(s) = self.inodes.snapshot(id) {
            return Ok(Some(s));
        }
        let rec = match self.view.snapshot(id)? {
            Some(r) => Some(r),
            None => {
                self.catchup.since(t0)?;
                self.view.snapshot(id)?
            }
        };
        Ok(rec.map(|r| self.inodes.add_snapshot(&r)))
    }

    /// The visible snapshot a tag points at (catching up on a miss).
    pub fn resolve_tag(&self, tag: &str, t0: Instant) -> forkd_layers::Result<Option<SnapshotId>> {
        if validate_tag(tag).is_err() || tag == inode::BY_ID_NAME {
            return Ok(None);
        }
        let id = match self.view.tag(tag)? {
            Some(id) => Some(id),
            None => {
                self.catchup.since(t0)?;
                self.view.tag(tag)?
            }
        };
        match id {
            Some(id) if self.visible(&id)? => Ok(Some(id)),
            _ => Ok(None),
        }
    }

    /// Whether snapshot `id` may be served: not hidden for a delete in
    /// progress, and not deleted, unless it was committed again since (a
    /// pull brings a snapshot back under its original id): a catch-up that
    /// started after the delete then finds it in the store.
    pub fn visible(&self, id: &SnapshotId) -> forkd_layers::Result<bool> {
        match self.handles.visibility(id) {
            Visibility::Visible => Ok(true),
            Visibility::Hidden => Ok(false),
            Visibility::Gone(at) => {
                self.catchup.since(at)?;
                if self.view.snapshot(id)?.is_some() {
                    self.handles.revive(id);
                    Ok(true)
                } else {
                    Ok(false)
                }
            }
        }
    }

    /// A file of a visible snapshot, by id and name.
    pub fn file(&self, id: &SnapshotId, name: &str) -> forkd_layers::Result<Option<Arc<FileNode>>> {
        Ok(self
            .find_snapshot(id, Instant::now())?
            .and_then(|s| s.files.get(name).cloned()))
    }

    /// Drops the kernel's cached names of a snapshot (so new path walks
    /// reach us and fail), and with `data`, its cached pages too.
    pub fn invalidate(&self, id: &SnapshotId, data: bool) {
        let Some(info) = self.inodes.snapshot(id) else {
            return;
        };
        let guard = self.notifier.lock().unwrap();
        let Some(n) = guard.as_ref() else {
            return;
        };
        let name = id.to_string();
        // ENOENT just means the kernel had nothing cached.
        let quiet = |r: std::io::Result<()>, what: &str| {
            if let Err(e) = r {
                if e.raw_os_error() != Some(libc::ENOENT) {
                    warn!(snapshot = %id, "invalidating {what}: {e}");
                }
            }
        };
        for f in info.files.values() {
            quiet(
                n.inval_entry(fuser::INodeNo(info.dir_ino), f.name.as_ref()),
                "a file entry",
            );
            if data {
                quiet(n.inval_inode(fuser::INodeNo(f.ino), 0, 0), "file data");
            }
        }
        quiet(
            n.inval_entry(fuser::INodeNo(inode::BY_ID), name.as_ref()),
            "the snapshot entry",
        );
    }
}
