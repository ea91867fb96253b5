//! Open file handles per snapshot, and the ids hidden for deletion.
//!
//! Invariant: one mutex covers both the handle counts and the hidden set,
//! so "no handle is open" (checked by `begin_delete`) and "the id is not
//! hidden" (checked by `open`) can never both pass for a racing pair: either
//! the open wins and the delete is refused, or the delete wins and the open
//! fails with ENOENT. A kernel file handle stays open for as long as any
//! process holds the fd *or a mapping of it*, so a QEMU child that mmapped
//! `memory.bin` counts as a user until it exits.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use forkd_layers::SnapshotId;

use crate::journal::{Entry, Journal};

/// Why an id cannot be opened or deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Hidden by `begin_delete` (or deleted): new opens fail with ENOENT.
    Hidden,
    /// `begin_delete` while handles are open.
    InUse(u64),
}

#[derive(Default)]
struct Inner {
    next_fh: u64,
    /// fh → snapshot.
    handles: HashMap<u64, SnapshotId>,
    counts: HashMap<SnapshotId, u64>,
    /// Between `begin_delete` and `end_delete`.
    hidden: HashSet<SnapshotId>,
    /// Deleted through the protocol, and when: hidden even before this
    /// process's secondary view has caught up, until a catch-up that
    /// started after the delete finds the id committed again (a pull
    /// brings a snapshot back under its id; see `Shared::visibility`).
    gone: HashMap<SnapshotId, Instant>,
}

impl Inner {
    fn add(&mut self, fh: u64, snap: SnapshotId) {
        if self.handles.insert(fh, snap).is_none() {
            *self.counts.entry(snap).or_default() += 1;
        }
    }

    fn remove(&mut self, fh: u64) {
        if let Some(snap) = self.handles.remove(&fh) {
            if let Some(n) = self.counts.get_mut(&snap) {
                *n -= 1;
                if *n == 0 {
                    self.counts.remove(&snap);
                }
            }
        }
    }
}

/// Whether a snapshot id may be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visibility {
    /// Servable.
    Visible,
    /// Hidden by `begin_delete` until its `end_delete`.
    Hidden,
    /// Deleted at this instant; served again only once a catch-up of the
    /// store view that started after it finds the id committed again.
    Gone(Instant),
}

/// Handle counts and hidden ids (see the module invariant). Behind a
/// holder, every change is journaled under the same lock, so the journal's
/// order is the order of the changes.
#[derive(Default)]
pub struct Handles {
    inner: Mutex<Inner>,
    journal: OnceLock<Arc<Journal>>,
}

impl Handles {
    /// Registers an open of a file of `snap`; returns the new file handle.
    pub fn open(&self, snap: SnapshotId) -> Result<u64, Refusal> {
        let mut g = self.inner.lock().unwrap();
        if g.hidden.contains(&snap) || g.gone.contains_key(&snap) {
            return Err(Refusal::Hidden);
        }
        g.next_fh += 1;
        let fh = g.next_fh;
        self.log(&Entry::Open { fh, id: snap });
        g.add(fh, snap);
        Ok(fh)
    }

    fn log(&self, e: &Entry) {
        if let Some(j) = self.journal.get() {
            j.append(e);
        }
    }

    /// From now on, journal every change.
    pub fn set_journal(&self, j: Arc<Journal>) {
        let _ = self.journal.set(j);
    }

    /// Applies one journaled change (a worker's start, before serving).
    pub fn replay(&self, e: &Entry) {
        let mut g = self.inner.lock().unwrap();
        match *e {
            Entry::Open { fh, id } => {
                g.next_fh = g.next_fh.max(fh);
                g.add(fh, id);
            }
            Entry::Close { fh } => g.remove(fh),
            Entry::Hide { id } => {
                g.hidden.insert(id);
            }
            Entry::Unhide { id } => {
                g.hidden.remove(&id);
                g.gone.remove(&id);
            }
            Entry::Gone { id } => {
                g.hidden.remove(&id);
                // When it went is not journaled: "now" is later, so a
                // catch-up since then still reflects the delete.
                g.gone.insert(id, Instant::now());
            }
            Entry::Snapshot { .. } | Entry::Tag { .. } => {}
        }
    }

    /// The state as journal entries (for compaction).
    pub fn journal_entries(&self) -> Vec<Entry> {
        let g = self.inner.lock().unwrap();
        let mut v: Vec<Entry> = g
            .handles
            .iter()
            .map(|(&fh, &id)| Entry::Open { fh, id })
            .collect();
        v.sort_by_key(|e| match e {
            Entry::Open { fh, .. } => *fh,
            _ => 0,
        });
        v.extend(g.hidden.iter().map(|&id| Entry::Hide { id }));
        v.extend(g.gone.keys().map(|&id| Entry::Gone { id }));
        v
    }

    /// Forgets a file handle (FUSE release).
    pub fn close(&self, fh: u64) {
        let mut g = self.inner.lock().unwrap();
        if g.handles.contains_key(&fh) {
            self.log(&Entry::Close { fh });
        }
        g.remove(fh);
    }

    /// Whether `snap` may be looked up and opened.
    pub fn visibility(&self, snap: &SnapshotId) -> Visibility {
        let g = self.inner.lock().unwrap();
        if g.hidden.contains(snap) {
            Visibility::Hidden
        } else if let Some(&at) = g.gone.get(snap) {
            Visibility::Gone(at)
        } else {
            Visibility::Visible
        }
    }

    /// Makes a deleted `snap` visible again: it was committed again after
    /// its delete (the caller checked, see [`Visibility::Gone`]).
    pub fn revive(&self, snap: &SnapshotId) {
        let mut g = self.inner.lock().unwrap();
        if g.gone.remove(snap).is_some() {
            self.log(&Entry::Unhide { id: *snap });
        }
    }

    /// True if new lookups and opens of `snap` must fail (for now: a
    /// [`Visibility::Gone`] id may still be revived).
    pub fn is_hidden(&self, snap: &SnapshotId) -> bool {
        let g = self.inner.lock().unwrap();
        g.hidden.contains(snap) || g.gone.contains_key(snap)
    }

    /// Open handles of `snap`.
    pub fn count(&self, snap: &SnapshotId) -> u64 {
        self.inner
            .lock()
            .unwrap()
            .counts
            .get(snap)
            .copied()
            .unwrap_or(0)
    }

    /// Open handles per snapshot (only snapshots with any).
    pub fn counts(&self) -> BTreeMap<SnapshotId, u64> {
        let g = self.inner.lock().unwrap();
        g.counts.iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// Ids currently hidden for deletion.
    pub fn hidden(&self) -> Vec<SnapshotId> {
        let g = self.inner.lock().unwrap();
        let mut v: Vec<_> = g.hidden.iter().copied().collect();
        v.sort();
        v
    }

    /// Refuses if any handle of `snap` is open, otherwise hides it.
    pub fn begin_delete(&self, snap: SnapshotId) -> Result<(), Refusal> {
        let mut g = self.inner.lock().unwrap();
        match g.counts.get(&snap) {
            Some(&n) if n > 0 => Err(Refusal::InUse(n)),
            _ => {
                self.log(&Entry::Hide { id: snap });
                g.hidden.insert(snap);
                Ok(())
            }
        }
    }

    /// Ends a delete: un-hides `snap` if it was not deleted, or hides it for
    /// good if it was.
    pub fn end_delete(&self, snap: SnapshotId, deleted: bool) {
        let mut g = self.inner.lock().unwrap();
        self.log(&if deleted {
            Entry::Gone { id: snap }
        } else {
            Entry::Unhide { id: snap }
        });
        g.hidden.remove(&snap);
        if deleted {
            g.gone.insert(snap, Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delete_protocol() {
        let h = Handles::default();
        let a = SnapshotId([1; 16]);
        let fh = h.open(a).unwrap();
        assert_eq!(h.begin_delete(a), Err(Refusal::InUse(1)));
        h.close(fh);
        assert_eq!(h.count(&a), 0);
        h.begin_delete(a).unwrap();
        assert_eq!(h.open(a), Err(Refusal::Hidden));
        h.end_delete(a, false);
        let fh = h.open(a).unwrap();
        h.close(fh);
        h.begin_delete(a).unwrap();
        h.end_delete(a, true);
        assert!(h.is_hidden(&a));
        assert_eq!(h.open(a), Err(Refusal::Hidden));
    }

    #[test]
    fn replaying_the_entries_rebuilds_the_state() {
        let h = Handles::default();
        let (a, b, c) = (
            SnapshotId([1; 16]),
            SnapshotId([2; 16]),
            SnapshotId([3; 16]),
        );
        let f1 = h.open(a).unwrap();
        let _f2 = h.open(a).unwrap();
        let f3 = h.open(b).unwrap();
        h.close(f1);
        h.begin_delete(c).unwrap();
        let r = Handles::default();
        for e in h.journal_entries() {
            r.replay(&e);
        }
        assert_eq!(r.counts(), h.counts());
        assert_eq!(r.begin_delete(a), Err(Refusal::InUse(1)));
        assert_eq!(r.open(c), Err(Refusal::Hidden));
        r.close(f3);
        assert_eq!(r.count(&b), 0);
        assert!(
            r.open(b).unwrap() > f3,
            "new handles come after the replayed ones"
        );
    }
}
