//! Per-snapshot annotations: small named blobs the writer attaches to a
//! snapshot after it was committed (e.g. forkd-fs's list of the memory
//! ranges a freshly resumed child touches, used to prefetch later spawns).
//!
//! The snapshot record itself is immutable; annotations are the one mutable
//! per-snapshot place. They live in the `meta` column family under
//! `"a" ‖ snapshot id (16) ‖ name`, are written in one synced batch, and are
//! seen by secondaries after `catch_up`. Deleting a snapshot does not remove
//! its annotations: call [`Store::remove_annotations`] after
//! [`Store::delete_snapshot`] (leftovers are harmless, just unreferenced).

use rocksdb::WriteBatch;

use crate::db::CF_META;
use crate::error::{Error, Result};
use crate::ids::SnapshotId;
use crate::store::Store;
use crate::tag::is_valid_file_name;
use crate::view::StoreView;

/// Largest annotation value accepted.
pub const MAX_ANNOTATION_BYTES: usize = 16 << 20;

fn prefix(id: &SnapshotId) -> Vec<u8> {
    let mut k = Vec::with_capacity(17 + 64);
    k.push(b'a');
    k.extend_from_slice(id.as_bytes());
    k
}

fn key(id: &SnapshotId, name: &str) -> Vec<u8> {
    let mut k = prefix(id);
    k.extend_from_slice(name.as_bytes());
    k
}

impl Store {
    /// Sets (or replaces) annotation `name` of snapshot `id`. `name` follows
    /// the snapshot file-name rule; the snapshot must exist.
    pub fn set_annotation(&self, id: &SnapshotId, name: &str, value: &[u8]) -> Result<()> {
        if !is_valid_file_name(name) {
            return Err(Error::InvalidFileName(name.to_string()));
        }
        if value.len() > MAX_ANNOTATION_BYTES {
            return Err(Error::InvalidArgument(format!(
                "annotation '{name}' is {} bytes, over the {MAX_ANNOTATION_BYTES}-byte limit",
                value.len()
            )));
        }
        let _c = self.commit_lock.lock().unwrap();
        let db = self.view.db();
        if db.snapshot(id)?.is_none() {
            return Err(Error::NoSuchSnapshot(*id));
        }
        let mut batch = WriteBatch::default();
        batch.put_cf(db.cf(CF_META), key(id, name), value);
        db.write(batch, "setting a snapshot annotation")
    }

    /// Removes every annotation of `id` (whether or not the snapshot still
    /// exists); returns how many there were.
    pub fn remove_annotations(&self, id: &SnapshotId) -> Result<usize> {
        let _c = self.commit_lock.lock().unwrap();
        let db = self.view.db();
        let p = prefix(id);
        let mut batch = WriteBatch::default();
        let mut n = 0;
        for kv in db.scan_prefix(CF_META, &p) {
            let (k, _) = kv?;
            batch.delete_cf(db.cf(CF_META), k);
            n += 1;
        }
        db.write_small(batch, "removing snapshot annotations")?;
        Ok(n)
    }
}

impl StoreView {
    /// Annotation `name` of snapshot `id`, if set.
    pub fn annotation(&self, id: &SnapshotId, name: &str) -> Result<Option<Vec<u8>>> {
        self.db().get(CF_META, &key(id, name))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::{NewSnapshot, Store, StoreOptions};

    #[test]
    fn set_get_remove() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), StoreOptions::default()).unwrap();
        let rec = store
            .commit_snapshot(NewSnapshot {
                files: BTreeMap::new(),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(store.annotation(&rec.id, "prefetch").unwrap(), None);
        store.set_annotation(&rec.id, "prefetch", b"[1]").unwrap();
        store.set_annotation(&rec.id, "prefetch", b"[2]").unwrap();
        store.set_annotation(&rec.id, "other", b"x").unwrap();
        assert_eq!(
            store.annotation(&rec.id, "prefetch").unwrap().as_deref(),
            Some(&b"[2]"[..])
        );
        assert!(store.set_annotation(&rec.id, "../x", b"").is_err());
        assert_eq!(store.remove_annotations(&rec.id).unwrap(), 2);
        assert_eq!(store.annotation(&rec.id, "prefetch").unwrap(), None);
        // Format metadata is untouched.
        drop(store);
        Store::open(dir.path(), StoreOptions::default()).unwrap();
    }
}
