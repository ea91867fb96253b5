//! Deleting snapshots without pulling files out from under running VMs.
//!
//! Each snapshot goes through forkd-fs's delete protocol (docs/fs.md): the
//! mount refuses while any file of it is open or mapped (a child's RAM,
//! disk backing or state), hides it otherwise, and the store delete follows.
//! A snapshot with dependents is refused unless `cascade` (delete the whole
//! subtree, leaves first) or `force` (delete it alone; the dependents stay
//! restorable because every manifest is flattened and they own their
//! chunks' references).

use crate::paths::Paths;
use anyhow::{anyhow, Result};
use forkd_layers::{DeleteReport, SnapshotId, Store};

/// What to do about dependents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dependents {
    /// Refuse, listing them.
    #[default]
    Refuse,
    /// Delete them too, leaves first.
    Cascade,
    /// Delete only this one; its children lose their parent link.
    Orphan,
}

impl Dependents {
    /// From forkd's `cascade` / `force` flags (the caller refuses both).
    pub fn from_flags(cascade: bool, force: bool) -> Dependents {
        if cascade {
            Dependents::Cascade
        } else if force {
            Dependents::Orphan
        } else {
            Dependents::Refuse
        }
    }
}

/// Why a delete was refused.
#[derive(Debug, thiserror::Error)]
pub enum DeleteError {
    /// No snapshot has this tag or id.
    #[error("no snapshot {0:?}")]
    NotFound(String),
    /// Other snapshots are links on top of it (neither cascade nor force was asked).
    #[error("snapshot {what} has dependent snapshots: {}; delete them first, or use cascade (delete them too) or force (keep them, orphaned)", .dependents.join(", "))]
    HasDependents {
        /// The snapshot asked for, as given.
        what: String,
        /// Tags (or ids) of its direct children.
        dependents: Vec<String>,
    },
    /// Running VMs still have its files open.
    #[error("snapshot {what} is in use: {open_handles} of its files are open by running VMs (its sandboxes, pooled children, or a branch in progress); delete its sandboxes and its pool (DELETE /v1/pools/<tag>, `forkd pool rm`) first")]
    InUse {
        /// The snapshot asked for, as given.
        what: String,
        /// Its files open through forkd-fs now.
        open_handles: u64,
    },
}

/// Deletes the snapshot `tag_or_id` names (and, with `Cascade`, its
/// subtree). Returns what each delete released.
pub fn delete(
    paths: &Paths,
    store: &Store,
    tag_or_id: &str,
    deps: Dependents,
) -> Result<Vec<DeleteReport>> {
    let rec = store
        .resolve(tag_or_id)?
        .ok_or_else(|| DeleteError::NotFound(tag_or_id.to_string()))?;
    let order = match deps {
        Dependents::Cascade => subtree_leaves_first(store, &rec.id)?,
        Dependents::Refuse => {
            let d = store.dependents(&rec.id)?;
            if !d.is_empty() {
                return Err(DeleteError::HasDependents {
                    what: tag_or_id.to_string(),
                    dependents: names(store, &d),
                }
                .into());
            }
            vec![rec.id]
        }
        Dependents::Orphan => vec![rec.id],
    };
    let mut mount = MountGuard::connect(paths);
    // Refuse up front if any of them is in use, so a cascade deletes all or
    // nothing of what it can check.
    for id in &order {
        let n = mount.in_use(id)?;
        if n > 0 {
            return Err(DeleteError::InUse {
                what: label(store, id),
                open_handles: n,
            }
            .into());
        }
    }
    let mut reports = Vec::new();
    for id in order {
        mount
            .begin(&id)
            .map_err(|e| match e.downcast::<forkd_fs::ControlError>() {
                Ok(forkd_fs::ControlError::InUse { open_handles, .. }) => DeleteError::InUse {
                    what: label(store, &id),
                    open_handles,
                }
                .into(),
                Ok(other) => anyhow!(other),
                Err(e) => e,
            })?;
        let r = if deps == Dependents::Orphan {
            store.delete_snapshot_orphaning(&id)
        } else {
            store.delete_snapshot(&id)
        };
        mount.end(&id, r.is_ok());
        let r = r?;
        let _ = store.remove_annotations(&id);
        reports.push(r);
    }
    Ok(reports)
}

/// The subtree under `root`, every snapshot after all of its dependents.
fn subtree_leaves_first(store: &Store, root: &SnapshotId) -> Result<Vec<SnapshotId>> {
    let mut out = Vec::new();
    let mut stack = vec![(*root, false)];
    while let Some((id, expanded)) = stack.pop() {
        if expanded {
            out.push(id);
            continue;
        }
        stack.push((id, true));
        for c in store.dependents(&id)? {
            stack.push((c, false));
        }
    }
    Ok(out)
}

fn label(store: &Store, id: &SnapshotId) -> String {
    match store.tags_of(id).ok().and_then(|t| t.into_iter().next()) {
        Some(tag) => tag,
        None => id.to_string(),
    }
}

fn names(store: &Store, ids: &[SnapshotId]) -> Vec<String> {
    ids.iter().map(|id| label(store, id)).collect()
}

/// The forkd-fs control connection, if a mount is live. Without one nothing
/// maps any snapshot through it, so deletes go ahead unchecked.
struct MountGuard {
    client: Option<forkd_fs::Client>,
}

impl MountGuard {
    fn connect(paths: &Paths) -> MountGuard {
        let cfg = forkd_fs::MountConfig::new(paths.mount_dir(), paths.store_dir());
        let client =
            forkd_fs::Client::connect_timeout(&cfg.control(), std::time::Duration::from_secs(2))
                .ok();
        MountGuard { client }
    }

    fn in_use(&mut self, id: &SnapshotId) -> Result<u64> {
        match &mut self.client {
            Some(c) => c.in_use(id),
            None => Ok(0),
        }
    }

    fn begin(&mut self, id: &SnapshotId) -> Result<()> {
        match &mut self.client {
            Some(c) => c.begin_delete(id),
            None => Ok(()),
        }
    }

    fn end(&mut self, id: &SnapshotId, deleted: bool) {
        if let Some(c) = &mut self.client {
            if let Err(e) = c.end_delete(id, deleted) {
                tracing::warn!("forkd-fs end_delete {id}: {e:#}");
            }
        }
    }
}
