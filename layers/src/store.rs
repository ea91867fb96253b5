//! The read-write store: open, commit, tags, delete. Ingest, GC and verify
//! live in their own modules as further `impl Store` blocks.
//!
//! Concurrency (one writer process, enforced by RocksDB's LOCK file):
//! - `commit_lock` serializes every metadata mutation (commit, delete, tags,
//!   GC's index changes), so refcount read-modify-writes never race;
//! - `gc_lock`: ingests hold it shared for their whole run, GC holds it
//!   exclusively, so GC never runs while an ingest may be deduplicating
//!   against a chunk it would drop;
//! - `pins`: manifests ingested by this process but not yet committed. GC
//!   treats their chunks as live, so the window between `ingest_*` returning
//!   and `commit_snapshot` is safe too.

use std::collections::{BTreeMap, HashMap};
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rocksdb::WriteBatch;

use crate::chunk::{validate_chunk_size, DEFAULT_CHUNK_SIZE, DEFAULT_ZSTD_LEVEL};
use crate::db::{
    child_key, chunk_ref_key, decode_count, manifest_ref_key, Db, CF_CHILDREN, CF_CHUNKS, CF_META,
    CF_REFS, CF_SNAPSHOTS, CF_TAGS,
};
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ManifestId, SnapshotId};
use crate::pack::Packs;
use crate::snapshot::{NewSnapshot, SnapshotRecord};
use crate::tag::{is_valid_file_name, validate_tag};
use crate::view::StoreView;

/// Tunables for [`Store::open`].
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// How long to wait for another process to release the store lock.
    pub lock_timeout: Duration,
    /// Bytes of decompressed chunks kept in memory for reads.
    pub cache_bytes: usize,
    /// A pack file is sealed once it would grow past this.
    pub max_pack_bytes: u64,
    /// Default chunk size for ingests.
    pub chunk_size: u32,
    /// Default zstd level for ingests.
    pub zstd_level: i32,
    /// Default hashing/compression threads per ingest.
    pub ingest_threads: usize,
    /// GC rewrites a pack when at least this fraction of it is garbage.
    pub gc_rewrite_threshold: f64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            lock_timeout: Duration::from_secs(10),
            cache_bytes: 256 << 20,
            max_pack_bytes: 512 << 20,
            chunk_size: DEFAULT_CHUNK_SIZE,
            zstd_level: DEFAULT_ZSTD_LEVEL,
            ingest_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            gc_rewrite_threshold: 0.5,
        }
    }
}

/// What [`Store::delete_snapshot`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteReport {
    /// The deleted snapshot.
    pub id: SnapshotId,
    /// Tags that pointed at it and were removed.
    pub tags_removed: Vec<String>,
    /// Manifests no snapshot references any more.
    pub manifests_released: u64,
    /// Chunks no snapshot references any more (GC reclaims them).
    pub chunks_released: u64,
    /// Pack bytes of those chunks.
    pub stored_bytes_released: u64,
}

/// The read-write store. One per store directory across all processes
/// (RocksDB's lock); other processes use [`crate::StoreReader`].
///
/// Dereferences to [`StoreView`] for the read API.
pub struct Store {
    pub(crate) view: StoreView,
    pub(crate) opts: StoreOptions,
    pub(crate) gc_lock: RwLock<()>,
    pub(crate) commit_lock: Mutex<()>,
    pins: Mutex<HashMap<ManifestId, usize>>,
}

impl Deref for Store {
    type Target = StoreView;
    fn deref(&self) -> &StoreView {
        &self.view
    }
}

/// `<root>/db`: the RocksDB directory.
pub fn db_dir(root: &Path) -> PathBuf {
    root.join("db")
}

/// `<root>/packs`: the pack files.
pub fn packs_dir(root: &Path) -> PathBuf {
    root.join("packs")
}

impl Store {
    /// Opens (creating if needed) the store at `root` read-write.
    ///
    /// If another process holds it, waits up to `opts.lock_timeout`, then
    /// fails with [`Error::Locked`] naming the lock file.
    pub fn open(root: &Path, opts: StoreOptions) -> Result<Store> {
        validate_chunk_size(opts.chunk_size)?;
        std::fs::create_dir_all(root).map_err(|e| Error::io(root, e))?;
        let db = Db::open_primary(&db_dir(root), opts.lock_timeout)?;
        let packs = Packs::open(&packs_dir(root), opts.max_pack_bytes, true, db.next_pack()?)?;
        Ok(Store {
            view: StoreView::new(root, db, packs, opts.cache_bytes),
            opts,
            gc_lock: RwLock::new(()),
            commit_lock: Mutex::new(()),
            pins: Mutex::new(HashMap::new()),
        })
    }

    /// A clonable read handle (e.g. to hand to reader threads).
    pub fn view(&self) -> StoreView {
        self.view.clone()
    }

    /// The options this store was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.opts
    }

    pub(crate) fn pin(&self, id: ManifestId) {
        *self.pins.lock().unwrap().entry(id).or_default() += 1;
    }

    /// Releases the GC pin an ingest placed on `manifest` without committing
    /// it (e.g. the caller gave up). Its chunks become collectable.
    pub fn release(&self, manifest: &ManifestId) {
        let mut pins = self.pins.lock().unwrap();
        if let Some(n) = pins.get_mut(manifest) {
            *n -= 1;
            if *n == 0 {
                pins.remove(manifest);
            }
        }
    }

    pub(crate) fn pinned(&self) -> Vec<ManifestId> {
        self.pins.lock().unwrap().keys().copied().collect()
    }

    /// Commits a snapshot atomically: the record, the parent link, the tag
    /// and every refcount change in one durable batch.
    ///
    /// Refuses manifests that are not in the store or whose chunks are gone,
    /// so a committed snapshot always names durable data.
    pub fn commit_snapshot(&self, spec: NewSnapshot) -> Result<SnapshotRecord> {
        for name in spec.files.keys() {
            if !is_valid_file_name(name) {
                return Err(Error::InvalidFileName(name.clone()));
            }
        }
        if let Some(t) = &spec.tag {
            validate_tag(t)?;
        }
        let _c = self.commit_lock.lock().unwrap();
        let db = self.view.db();
        if let Some(p) = &spec.parent {
            if db.snapshot(p)?.is_none() {
                return Err(Error::NoSuchSnapshot(*p));
            }
        }
        if let Some(tag) = &spec.tag {
            if let Some(existing) = self.view.tag(tag)? {
                if !spec.replace_tag {
                    return Err(Error::TagExists {
                        tag: tag.clone(),
                        existing,
                    });
                }
            }
        }
        let mut uses: BTreeMap<ManifestId, i64> = BTreeMap::new();
        for (name, f) in &spec.files {
            if !self.view.has_manifest(&f.manifest)? {
                return Err(Error::MissingManifest(f.manifest));
            }
            let m = self.view.manifest(&f.manifest)?;
            if m.size() != f.size {
                return Err(Error::InvalidArgument(format!(
                    "file {name}: size {} does not match manifest {} ({} bytes)",
                    f.size,
                    f.manifest,
                    m.size()
                )));
            }
            *uses.entry(f.manifest).or_default() += 1;
        }
        let (mut batch, _) = self.refcount_batch(&uses, true)?;
        let rec = SnapshotRecord {
            id: SnapshotId::random(),
            parent: spec.parent,
            files: spec.files,
            config: spec.config,
            lineage: spec.lineage,
            created_at_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let json = serde_json::to_vec(&rec).expect("snapshot record serializes");
        batch.put_cf(db.cf(CF_SNAPSHOTS), rec.id.as_bytes(), json);
        if let Some(p) = &rec.parent {
            batch.put_cf(db.cf(CF_CHILDREN), child_key(p, &rec.id), b"");
        }
        if let Some(tag) = &spec.tag {
            batch.put_cf(db.cf(CF_TAGS), tag.as_bytes(), rec.id.as_bytes());
        }
        self.inherit_marker(&mut batch, rec.parent.as_ref(), &rec.id)?;
        db.write(batch, "committing snapshot")?;
        // One pin per ingest: release one per file that named it.
        for f in rec.files.values() {
            self.release(&f.manifest);
        }
        Ok(rec)
    }

    /// Builds the refcount changes for `uses` (manifest → number of file
    /// references added (`add`) or removed). A manifest's chunks gain a
    /// reference when the manifest goes 0→n and lose it when it goes n→0.
    pub(crate) fn refcount_batch(
        &self,
        uses: &BTreeMap<ManifestId, i64>,
        add: bool,
    ) -> Result<(WriteBatch, Released)> {
        let db = self.view.db();
        let refs = db.cf(CF_REFS);
        let mut batch = WriteBatch::default();
        let mut chunk_delta: BTreeMap<ChunkId, i64> = BTreeMap::new();
        let mut released = Released::default();
        for (mid, &n) in uses {
            let key = manifest_ref_key(mid);
            let old = db.refcount(&key)? as i64;
            let new = if add { old + n } else { old - n };
            if new < 0 {
                return Err(Error::CorruptRecord {
                    what: "refcount",
                    key: mid.to_string(),
                    reason: format!("would drop below zero ({old} - {n})"),
                });
            }
            put_count(&mut batch, refs, &key, new as u64);
            if new == 0 {
                released.manifests += 1;
            }
            if (old == 0) != (new == 0) {
                let d = if new > 0 { 1 } else { -1 };
                for c in self.view.manifest(mid)?.distinct_chunks() {
                    *chunk_delta.entry(*c).or_default() += d;
                }
            }
        }
        let keys: Vec<[u8; 33]> = chunk_delta.keys().map(chunk_ref_key).collect();
        let key_refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let olds = db.multi_get(CF_REFS, &key_refs)?;
        let mut revived: Vec<&ChunkId> = Vec::new();
        for ((cid, d), (key, old)) in chunk_delta.iter().zip(keys.iter().zip(olds)) {
            let old = old.map_or(0, |v| decode_count(&v)) as i64;
            let new = old + d;
            if new < 0 {
                return Err(Error::CorruptRecord {
                    what: "refcount",
                    key: cid.to_string(),
                    reason: format!("would drop below zero ({old} {d:+})"),
                });
            }
            if old == 0 && new > 0 {
                revived.push(cid);
            }
            if new == 0 {
                released.chunks.push(*cid);
            }
            put_count(&mut batch, refs, key, new as u64);
        }
        // Chunks becoming referenced must exist: never commit a reference to
        // data that is not durable (e.g. a manifest whose pin was released and
        // whose chunks GC already dropped) or located on a hub (a lazy pull).
        let idx_keys: Vec<&[u8]> = revived.iter().map(|c| &c.as_bytes()[..]).collect();
        let located = self.located(&revived)?;
        for ((cid, loc), remote) in revived
            .iter()
            .zip(db.multi_get(CF_CHUNKS, &idx_keys)?)
            .zip(located)
        {
            if loc.is_none() && !remote {
                return Err(Error::MissingChunk {
                    id: **cid,
                    reason:
                        "not in the chunk index (collected before commit?); ingest the file again"
                            .into(),
                });
            }
        }
        Ok((batch, released))
    }

    /// Points `tag` at `id`. Fails with [`Error::TagExists`] if the tag
    /// points at a different snapshot (see [`Store::set_tag_force`]).
    pub fn set_tag(&self, tag: &str, id: &SnapshotId) -> Result<()> {
        self.put_tag(tag, id, false)
    }

    /// Points `tag` at `id`, moving it if it exists.
    pub fn set_tag_force(&self, tag: &str, id: &SnapshotId) -> Result<()> {
        self.put_tag(tag, id, true)
    }

    fn put_tag(&self, tag: &str, id: &SnapshotId, force: bool) -> Result<()> {
        validate_tag(tag)?;
        let _c = self.commit_lock.lock().unwrap();
        if self.view.snapshot(id)?.is_none() {
            return Err(Error::NoSuchSnapshot(*id));
        }
        match self.view.tag(tag)? {
            Some(existing) if existing == *id => return Ok(()),
            Some(existing) if !force => {
                return Err(Error::TagExists {
                    tag: tag.to_string(),
                    existing,
                })
            }
            _ => {}
        }
        let db = self.view.db();
        let mut b = WriteBatch::default();
        b.put_cf(db.cf(CF_TAGS), tag.as_bytes(), id.as_bytes());
        db.write_small(b, "setting tag")
    }

    /// Removes a tag (the snapshot stays).
    pub fn untag(&self, tag: &str) -> Result<()> {
        validate_tag(tag)?;
        let _c = self.commit_lock.lock().unwrap();
        if self.view.tag(tag)?.is_none() {
            return Err(Error::NoSuchTag(tag.to_string()));
        }
        let db = self.view.db();
        let mut b = WriteBatch::default();
        b.delete_cf(db.cf(CF_TAGS), tag.as_bytes());
        db.write_small(b, "removing tag")
    }

    /// Deletes a snapshot, its tags, and its references, atomically.
    /// Refuses while other snapshots name it as parent (the error lists
    /// them). Space is reclaimed by the next [`Store::gc`].
    pub fn delete_snapshot(&self, id: &SnapshotId) -> Result<DeleteReport> {
        self.delete_inner(id, false)
    }

    /// Deletes a snapshot even if others name it as parent: those become
    /// roots (their `parent` is cleared and `lineage.orphaned_from` records
    /// the deleted id) in the same atomic batch. They stay fully readable:
    /// manifests are flattened and hold their own chunk references.
    pub fn delete_snapshot_orphaning(&self, id: &SnapshotId) -> Result<DeleteReport> {
        self.delete_inner(id, true)
    }

    fn delete_inner(&self, id: &SnapshotId, orphan: bool) -> Result<DeleteReport> {
        let _c = self.commit_lock.lock().unwrap();
        let db = self.view.db();
        let rec = db.snapshot(id)?.ok_or(Error::NoSuchSnapshot(*id))?;
        let children = self.view.dependents(id)?;
        if !children.is_empty() && !orphan {
            return Err(Error::HasDependents { id: *id, children });
        }
        let mut uses: BTreeMap<ManifestId, i64> = BTreeMap::new();
        for f in rec.files.values() {
            *uses.entry(f.manifest).or_default() += 1;
        }
        let (mut batch, released) = self.refcount_batch(&uses, false)?;
        let mut report = DeleteReport {
            id: *id,
            manifests_released: released.manifests,
            chunks_released: released.chunks.len() as u64,
            ..Default::default()
        };
        for c in &released.chunks {
            if let Some(loc) = db.chunk_location(c)? {
                report.stored_bytes_released += loc.record_len();
            }
        }
        for tag in self.view.tags_of(id)? {
            batch.delete_cf(db.cf(CF_TAGS), tag.as_bytes());
            report.tags_removed.push(tag);
        }
        batch.delete_cf(db.cf(CF_SNAPSHOTS), id.as_bytes());
        batch.delete_cf(db.cf(CF_META), crate::remote::marker_key(id));
        if let Some(p) = &rec.parent {
            batch.delete_cf(db.cf(CF_CHILDREN), child_key(p, id));
        }
        for c in &children {
            // An orphaned child of a lazy snapshot still names its remote
            // chunks: it stays lazy from the same source.
            self.inherit_marker(&mut batch, Some(id), c)?;
            let mut child = db.snapshot(c)?.ok_or(Error::NoSuchSnapshot(*c))?;
            child.parent = None;
            child
                .lineage
                .insert("orphaned_from".into(), serde_json::json!(id.to_string()));
            let json = serde_json::to_vec(&child).expect("snapshot record serializes");
            batch.put_cf(db.cf(CF_SNAPSHOTS), c.as_bytes(), json);
            batch.delete_cf(db.cf(CF_CHILDREN), child_key(id, c));
        }
        db.write_small(batch, "deleting snapshot")?;
        Ok(report)
    }
}

/// Manifests and chunks whose refcount reached zero in a batch.
#[derive(Default)]
pub(crate) struct Released {
    pub(crate) manifests: u64,
    pub(crate) chunks: Vec<ChunkId>,
}

/// Writes a refcount, deleting the key at zero (absent means zero).
fn put_count(batch: &mut WriteBatch, cf: &rocksdb::ColumnFamily, key: &[u8], n: u64) {
    if n == 0 {
        batch.delete_cf(cf, key);
    } else {
        batch.put_cf(cf, key, n.to_le_bytes());
    }
}
