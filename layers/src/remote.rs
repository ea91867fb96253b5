//! Lazy snapshots: committed before their chunks are here.
//!
//! A lazy pull (`forkd pull --lazy`, docs/hub.md) stores a snapshot's
//! records and manifests and, for each chunk the store lacks, *where it can
//! be fetched*: a [`RemoteChunk`] naming a [`RemoteSource`] (a hub URL, never
//! a secret) and a byte range of an object there. forkd-fs serves such a
//! snapshot by fetching a missing chunk when a read needs it (through the
//! [`Fetcher`] it installs on its view) and importing it; a background fill
//! fetches the rest, and once every chunk is indexed the snapshot is
//! [finished](Store::finish_remote) and is like any other.
//!
//! Everything lives in the `meta` column family (no new column family, so
//! the format version stays 1 and older stores open as they are):
//!
//! | key | value |
//! |---|---|
//! | `r` ‖ chunk id (32) | [`RemoteChunk`], 52 bytes |
//! | `o` ‖ source id (u32 BE) | [`RemoteSource`] as JSON |
//! | `s` ‖ snapshot id (16) | source id (u32 LE): the snapshot is lazy, not yet all local |
//!
//! Invariants (extending docs/layers.md's):
//! - every chunk a stored manifest names is indexed **or has a remote
//!   location**; a commit may reference a chunk only under the same rule;
//! - a remote location is meaningful only while its chunk is not indexed:
//!   importing a chunk deletes its location in the same batch, and GC drops
//!   locations of indexed or unreferenced chunks;
//! - a lazy marker is removed only once every chunk of the snapshot is
//!   indexed (or with the snapshot); a snapshot committed on top of a lazy
//!   parent is lazy too, so nothing that names remote chunks goes unfilled.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use rocksdb::WriteBatch;
use serde::{Deserialize, Serialize};

use crate::cache::ChunkData;
use crate::db::{chunk_ref_key, CF_CHUNKS, CF_MANIFESTS, CF_META, CF_REFS};
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ManifestId, ObjectId, SnapshotId};
use crate::snapshot::SnapshotRecord;
use crate::store::Store;
use crate::transfer::decode_manifest;
use crate::view::StoreView;
use crate::workingset::WorkingSet;

/// Where a chunk the store lacks can be fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteChunk {
    /// The [`RemoteSource`] (hub) holding it.
    pub source: u32,
    /// The hub object holding it: a pack, or (layout 1) the chunk's own
    /// object, named by the chunk id.
    pub object: ObjectId,
    /// Where its chunk object (hub header and stored payload) starts.
    pub offset: u64,
    /// The chunk object's length; 0 when unknown (a whole layout-1 object).
    pub len: u32,
    /// The chunk's uncompressed length.
    pub raw_len: u32,
}

const REMOTE_CHUNK_LEN: usize = 52;
/// Length of the hub's chunk object header (forkd-remote's layout).
const HUB_CHUNK_HEADER: u64 = 12;

impl RemoteChunk {
    fn encode(&self) -> [u8; REMOTE_CHUNK_LEN] {
        let mut b = [0u8; REMOTE_CHUNK_LEN];
        b[0..4].copy_from_slice(&self.source.to_le_bytes());
        b[4..36].copy_from_slice(self.object.as_bytes());
        b[36..44].copy_from_slice(&self.offset.to_le_bytes());
        b[44..48].copy_from_slice(&self.len.to_le_bytes());
        b[48..52].copy_from_slice(&self.raw_len.to_le_bytes());
        b
    }

    fn decode(id: &ChunkId, b: &[u8]) -> Result<RemoteChunk> {
        if b.len() != REMOTE_CHUNK_LEN {
            return Err(Error::CorruptRecord {
                what: "remote chunk location",
                key: id.to_string(),
                reason: format!("{} bytes instead of {REMOTE_CHUNK_LEN}", b.len()),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        Ok(RemoteChunk {
            source: u32_at(0),
            object: ObjectId(b[4..36].try_into().unwrap()),
            offset: u64::from_le_bytes(b[36..44].try_into().unwrap()),
            len: u32_at(44),
            raw_len: u32_at(48),
        })
    }

    /// What the chunk will occupy in a pack once imported (the unit of
    /// [`crate::Stats::live_stored_bytes`]); its raw length when the hub
    /// object's size is unknown.
    pub fn record_len(&self) -> u64 {
        if self.len == 0 {
            return u64::from(self.raw_len);
        }
        (u64::from(self.len) - HUB_CHUNK_HEADER.min(u64::from(self.len)))
            + crate::pack::RECORD_HEADER_LEN as u64
    }
}

/// A hub a lazy snapshot's chunks come from. Holds no secret: credentials
/// are the caller's business (forkd-remote keeps them root-only beside the
/// store).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteSource {
    /// Its number in this store.
    pub id: u32,
    /// The hub URL (`s3://...`, `http(s)://...`, `file://...`).
    pub url: String,
    /// The hub's layout (1: one object per chunk, 2: packs).
    pub layout: u32,
}

/// Reads a chunk the store lacks from where a [`RemoteChunk`] says.
/// forkd-fs installs one on its view ([`StoreView::set_fetcher`]), so every
/// read through the view, whatever file and snapshot, can fault a missing
/// chunk in.
pub trait Fetcher: Send + Sync {
    /// The chunk's verified, uncompressed bytes. Blocking; may wait for the
    /// network and retry, up to its own deadline. A failure is an
    /// [`Error::RemoteFetch`] saying what and where.
    fn fetch(&self, id: &ChunkId, loc: &RemoteChunk) -> Result<ChunkData>;
}

/// How much of a snapshot is here (`forkd snapshot info`, `/v1/snapshots`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Residency {
    /// Distinct chunks the snapshot's files name.
    pub chunks: u64,
    /// Of those, in the local store.
    pub local_chunks: u64,
    /// Their pack bytes.
    pub local_bytes: u64,
    /// Chunks still only on the hub.
    pub remote_chunks: u64,
    /// What they will take once here (compressed, as the hub holds them).
    pub remote_bytes: u64,
    /// The hub they come from, when the snapshot is lazy.
    pub source: Option<String>,
    /// Chunks of the recorded working set, and how many are local; `None`
    /// when the snapshot has no working set.
    pub working_set_chunks: Option<u64>,
    /// Working-set chunks that are local.
    pub working_set_local: Option<u64>,
    /// What the working set's chunks occupy stored (local or remote).
    pub working_set_bytes: Option<u64>,
}

impl Residency {
    /// Every chunk is local.
    pub fn is_local(&self) -> bool {
        self.remote_chunks == 0
    }
}

fn remote_key(id: &ChunkId) -> [u8; 33] {
    let mut k = [0u8; 33];
    k[0] = b'r';
    k[1..].copy_from_slice(id.as_bytes());
    k
}

fn source_key(id: u32) -> [u8; 5] {
    let mut k = [0u8; 5];
    k[0] = b'o';
    k[1..].copy_from_slice(&id.to_be_bytes());
    k
}

pub(crate) fn marker_key(id: &SnapshotId) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = b's';
    k[1..].copy_from_slice(id.as_bytes());
    k
}

/// Ids per RocksDB multi-get.
const BATCH: usize = 4096;

impl StoreView {
    /// Where a chunk the store lacks can be fetched, if it is remote.
    pub fn remote_chunk(&self, id: &ChunkId) -> Result<Option<RemoteChunk>> {
        self.db()
            .get(CF_META, &remote_key(id))?
            .map(|v| RemoteChunk::decode(id, &v))
            .transpose()
    }

    /// Remote locations of `ids` (batched).
    pub fn remote_chunks(&self, ids: &[ChunkId]) -> Result<Vec<Option<RemoteChunk>>> {
        let mut out = Vec::with_capacity(ids.len());
        for part in ids.chunks(BATCH) {
            let keys: Vec<[u8; 33]> = part.iter().map(remote_key).collect();
            let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
            for (id, v) in part.iter().zip(self.db().multi_get(CF_META, &refs)?) {
                out.push(v.map(|v| RemoteChunk::decode(id, &v)).transpose()?);
            }
        }
        Ok(out)
    }

    /// A remote source by number.
    pub fn remote_source(&self, id: u32) -> Result<Option<RemoteSource>> {
        self.db()
            .get(CF_META, &source_key(id))?
            .map(|v| {
                serde_json::from_slice(&v).map_err(|e| Error::CorruptRecord {
                    what: "remote source",
                    key: id.to_string(),
                    reason: e.to_string(),
                })
            })
            .transpose()
    }

    /// Every remote source.
    pub fn remote_sources(&self) -> Result<Vec<RemoteSource>> {
        let mut out = Vec::new();
        for kv in self.db().scan_prefix(CF_META, b"o") {
            let (k, v) = kv?;
            if k.len() == 5 {
                out.push(
                    serde_json::from_slice(&v).map_err(|e| Error::CorruptRecord {
                        what: "remote source",
                        key: hex::encode(&k[1..]),
                        reason: e.to_string(),
                    })?,
                );
            }
        }
        Ok(out)
    }

    /// Lazy snapshots (not yet all local) and their sources.
    pub fn lazy_snapshots(&self) -> Result<Vec<(SnapshotId, u32)>> {
        let mut out = Vec::new();
        for kv in self.db().scan_prefix(CF_META, b"s") {
            let (k, v) = kv?;
            if let (Some(id), Ok(src)) =
                (SnapshotId::from_slice(&k[1..]), <[u8; 4]>::try_from(&v[..]))
            {
                out.push((id, u32::from_le_bytes(src)));
            }
        }
        Ok(out)
    }

    /// The source of a lazy snapshot; `None` once it is all local (or was
    /// never lazy).
    pub fn lazy_source(&self, id: &SnapshotId) -> Result<Option<u32>> {
        Ok(self
            .db()
            .get(CF_META, &marker_key(id))?
            .and_then(|v| <[u8; 4]>::try_from(&v[..]).ok())
            .map(u32::from_le_bytes))
    }

    /// How much of `rec` is local. O(chunks) index lookups.
    pub fn residency(&self, rec: &SnapshotRecord) -> Result<Residency> {
        let chunks = self.snapshot_chunks(rec)?;
        let mut r = Residency {
            chunks: chunks.len() as u64,
            ..Default::default()
        };
        let mut local = HashSet::new();
        let mut sizes: std::collections::HashMap<ChunkId, u64> = std::collections::HashMap::new();
        for part in chunks.chunks(BATCH) {
            let keys: Vec<&[u8]> = part.iter().map(|c| &c.as_bytes()[..]).collect();
            let locs = self.db().multi_get(CF_CHUNKS, &keys)?;
            let mut missing = Vec::new();
            for (c, l) in part.iter().zip(locs) {
                match l {
                    Some(v) => {
                        let loc = crate::chunk::ChunkLocation::decode(c, &v)?;
                        r.local_chunks += 1;
                        r.local_bytes += loc.record_len();
                        local.insert(*c);
                        sizes.insert(*c, loc.record_len());
                    }
                    None => missing.push(*c),
                }
            }
            for (c, rc) in missing.iter().zip(self.remote_chunks(&missing)?) {
                let n = rc.map_or(0, |l| l.record_len());
                r.remote_chunks += 1;
                r.remote_bytes += n;
                sizes.insert(*c, n);
            }
        }
        if let Some(src) = self.lazy_source(&rec.id)? {
            r.source = self.remote_source(src)?.map(|s| s.url);
        }
        if let Some(ws) = self.working_set(&rec.id)? {
            let ws_chunks = ws.chunks(self, rec)?;
            r.working_set_chunks = Some(ws_chunks.len() as u64);
            r.working_set_local =
                Some(ws_chunks.iter().filter(|c| local.contains(*c)).count() as u64);
            r.working_set_bytes = Some(ws_chunks.iter().filter_map(|c| sizes.get(c)).sum());
        }
        Ok(r)
    }

    /// Whether a snapshot's working set is all local: what a pool should
    /// wait for before it restores children of a lazy snapshot. Cheap for a
    /// snapshot that is not lazy (one lookup). A lazy snapshot without a
    /// recorded working set counts as local only once it is all local.
    pub fn working_set_local(&self, id: &SnapshotId) -> Result<bool> {
        if self.lazy_source(id)?.is_none() {
            return Ok(true);
        }
        let rec = self.snapshot(id)?.ok_or(Error::NoSuchSnapshot(*id))?;
        let wanted = match self.working_set(id)? {
            Some(ws) => ws.chunks(self, &rec)?,
            None => self.snapshot_chunks(&rec)?,
        };
        Ok(self.has_chunks(&wanted)?.into_iter().all(|h| h))
    }

    /// Installs the fetcher that reads chunks this store lacks (see
    /// [`Fetcher`]). Once per view; later calls are ignored.
    pub fn set_fetcher(&self, f: Arc<dyn Fetcher>) {
        let _ = self.inner.fetcher.set(f);
    }

    /// Fetches a chunk the index lacks through the installed [`Fetcher`],
    /// when it has a remote location. `None`: not remote (or no fetcher).
    pub(crate) fn fetch_remote(&self, id: &ChunkId) -> Result<Option<ChunkData>> {
        let Some(f) = self.inner.fetcher.get() else {
            return Ok(None);
        };
        match self.remote_chunk(id)? {
            Some(loc) => f.fetch(id, &loc).map(Some),
            None => Ok(None),
        }
    }
}

impl Store {
    /// The source for hub `url`, made if new (its layout updated if it
    /// changed). One small synced batch.
    pub fn add_remote_source(&self, url: &str, layout: u32) -> Result<RemoteSource> {
        let _c = self.commit_lock.lock().unwrap();
        let known = self.view.remote_sources()?;
        let src = match known.iter().find(|s| s.url == url) {
            Some(s) if s.layout == layout => return Ok(s.clone()),
            Some(s) => RemoteSource {
                layout,
                ..s.clone()
            },
            None => RemoteSource {
                id: known.iter().map(|s| s.id + 1).max().unwrap_or(1),
                url: url.to_string(),
                layout,
            },
        };
        let db = self.view.db();
        let mut b = WriteBatch::default();
        b.put_cf(
            db.cf(CF_META),
            source_key(src.id),
            serde_json::to_vec(&src).expect("source serializes"),
        );
        db.write_small(b, "recording a remote source")?;
        Ok(src)
    }

    /// Stores manifests that arrived from a hub without their chunks, with
    /// where each chunk the store lacks can be fetched, in one synced batch.
    /// Every chunk a manifest names must be indexed, located here, or
    /// already located. Pins the manifests against GC until
    /// [`Store::commit_imported_lazy`] (or [`Store::release`]).
    pub fn import_remote(
        &self,
        manifests: &[(ManifestId, &[u8])],
        chunks: &[(ChunkId, RemoteChunk)],
    ) -> Result<()> {
        let mut decoded = Vec::with_capacity(manifests.len());
        for (id, bytes) in manifests {
            decoded.push((*id, *bytes, decode_manifest(id, bytes)?));
        }
        let _gc = self.gc_lock.read().unwrap();
        let db = self.view.db();
        let ids: Vec<ChunkId> = chunks.iter().map(|(c, _)| *c).collect();
        let indexed = self.view.has_chunks(&ids)?;
        let mut batch = WriteBatch::default();
        let mut located: HashSet<ChunkId> = HashSet::new();
        for ((id, loc), have) in chunks.iter().zip(indexed) {
            if !have {
                batch.put_cf(db.cf(CF_META), remote_key(id), loc.encode());
                located.insert(*id);
            }
        }
        for (id, bytes, m) in &decoded {
            let named = m.distinct_chunks();
            let unknown: Vec<ChunkId> = named
                .iter()
                .filter(|c| !located.contains(*c))
                .copied()
                .collect();
            let have = self.view.has_chunks(&unknown)?;
            let remote = self.view.remote_chunks(&unknown)?;
            if let Some(i) = (0..unknown.len()).find(|&i| !have[i] && remote[i].is_none()) {
                return Err(Error::MissingChunk {
                    id: unknown[i],
                    reason: format!(
                        "manifest {id} names it, but it is neither in the store nor located on the hub"
                    ),
                });
            }
            if !self.view.has_manifest(id)? {
                batch.put_cf(db.cf(CF_MANIFESTS), id.as_bytes(), bytes);
            }
        }
        db.write(batch, "storing manifests of a lazy pull")?;
        for (id, _, _) in &decoded {
            self.pin(*id);
        }
        Ok(())
    }

    /// [`Store::commit_imported`] for a lazy pull: also marks the snapshot
    /// lazy (from `source`) in the same batch.
    pub fn commit_imported_lazy(
        &self,
        rec: &SnapshotRecord,
        tag: Option<&str>,
        replace_tag: bool,
        source: u32,
    ) -> Result<bool> {
        self.commit_imported_with(rec, tag, replace_tag, Some(source))
    }

    /// Drops the lazy marker of `id` once every chunk it names is indexed.
    /// Returns whether it is (now) all local.
    pub fn finish_remote(&self, id: &SnapshotId) -> Result<bool> {
        let _c = self.commit_lock.lock().unwrap();
        if self.view.lazy_source(id)?.is_none() {
            return Ok(true);
        }
        let Some(rec) = self.view.snapshot(id)? else {
            return Ok(true);
        };
        let chunks = self.view.snapshot_chunks(&rec)?;
        if !self.view.has_chunks(&chunks)?.into_iter().all(|h| h) {
            return Ok(false);
        }
        let db = self.view.db();
        let mut b = WriteBatch::default();
        b.delete_cf(db.cf(CF_META), marker_key(id));
        db.write_small(b, "finishing a lazy snapshot")?;
        Ok(true)
    }

    /// Records `ws` as the working set of snapshot `id` (an annotation).
    pub fn set_working_set(&self, id: &SnapshotId, ws: &WorkingSet) -> Result<()> {
        self.set_annotation(id, crate::workingset::ANNOTATION, &ws.encode())
    }

    /// Locations of chunks that are indexed (stale) or no longer referenced
    /// (GC's business; the caller holds the GC and commit locks).
    pub(crate) fn stale_remote_locations(&self) -> Result<Vec<Vec<u8>>> {
        let db = self.view.db();
        let pinned: HashSet<ChunkId> = self
            .pinned()
            .iter()
            .filter_map(|m| self.view.manifest(m).ok())
            .flat_map(|m| m.distinct_chunks().to_vec())
            .collect();
        let mut keys: Vec<(Vec<u8>, ChunkId)> = Vec::new();
        for kv in db.scan_prefix(CF_META, b"r") {
            let (k, _) = kv?;
            if let Some(c) = ChunkId::from_slice(&k[1..]) {
                keys.push((k.to_vec(), c));
            }
        }
        let mut stale = Vec::new();
        for part in keys.chunks(BATCH) {
            let ids: Vec<ChunkId> = part.iter().map(|(_, c)| *c).collect();
            let indexed = self.view.has_chunks(&ids)?;
            let rks: Vec<[u8; 33]> = ids.iter().map(chunk_ref_key).collect();
            let rrefs: Vec<&[u8]> = rks.iter().map(|k| &k[..]).collect();
            let refs = db.multi_get(CF_REFS, &rrefs)?;
            for (((k, c), ix), r) in part.iter().zip(indexed).zip(refs) {
                if ix || (r.is_none() && !pinned.contains(c)) {
                    stale.push(k.clone());
                }
            }
        }
        Ok(stale)
    }

    /// Deletes the remote locations of `ids` that have one (after they were
    /// indexed), into `batch`.
    pub(crate) fn forget_remote(&self, batch: &mut WriteBatch, ids: &[ChunkId]) -> Result<()> {
        let db = self.view.db();
        for (id, r) in ids.iter().zip(self.view.remote_chunks(ids)?) {
            if r.is_some() {
                batch.delete_cf(db.cf(CF_META), remote_key(id));
            }
        }
        Ok(())
    }

    /// Whether a chunk becoming referenced may be: indexed, or located.
    pub(crate) fn located(&self, ids: &[&ChunkId]) -> Result<Vec<bool>> {
        let keys: Vec<[u8; 33]> = ids.iter().map(|c| remote_key(c)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        Ok(self
            .view
            .db()
            .multi_get(CF_META, &refs)?
            .into_iter()
            .map(|v| v.is_some())
            .collect())
    }

    /// Sets the lazy marker of `child` when `parent` is lazy (a snapshot
    /// taken from a child of a lazy snapshot names its remote chunks).
    pub(crate) fn inherit_marker(
        &self,
        batch: &mut WriteBatch,
        parent: Option<&SnapshotId>,
        child: &SnapshotId,
    ) -> Result<()> {
        if let Some(p) = parent {
            if let Some(src) = self.view.lazy_source(p)? {
                let db = self.view.db();
                batch.put_cf(db.cf(CF_META), marker_key(child), src.to_le_bytes());
            }
        }
        Ok(())
    }
}

/// Counts of remote locations, for `stats`.
pub(crate) fn remote_totals(view: &StoreView) -> Result<(u64, u64)> {
    let (mut n, mut bytes) = (0, 0);
    for kv in view.db().scan_prefix(CF_META, b"r") {
        let (k, v) = kv?;
        if let Some(c) = ChunkId::from_slice(&k[1..]) {
            n += 1;
            bytes += RemoteChunk::decode(&c, &v)?.record_len();
        }
    }
    Ok((n, bytes))
}

/// Remote locations by chunk, for `verify`.
pub(crate) fn remote_set(view: &StoreView) -> Result<BTreeMap<ChunkId, RemoteChunk>> {
    let mut out = BTreeMap::new();
    for kv in view.db().scan_prefix(CF_META, b"r") {
        let (k, v) = kv?;
        if let Some(c) = ChunkId::from_slice(&k[1..]) {
            out.insert(c, RemoteChunk::decode(&c, &v)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IngestOptions, NewSnapshot, StoreOptions, VerifiedChunk};

    fn store(dir: &std::path::Path) -> Store {
        Store::open(dir, StoreOptions::default()).unwrap()
    }

    /// A fake hub: the source store's chunks by id, counting fetches.
    struct FromStore(StoreView, std::sync::atomic::AtomicUsize);

    impl Fetcher for FromStore {
        fn fetch(&self, id: &ChunkId, loc: &RemoteChunk) -> Result<ChunkData> {
            assert_eq!(loc.object, ObjectId(id.0));
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.0.chunk(id)
        }
    }

    fn loc(id: &ChunkId, raw_len: u32) -> RemoteChunk {
        RemoteChunk {
            source: 1,
            object: ObjectId(id.0),
            offset: 0,
            len: 0,
            raw_len,
        }
    }

    #[test]
    fn a_lazy_snapshot_reads_through_its_fetcher_and_finishes_once_filled() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b) = (store(da.path()), store(db.path()));
        let data = crate::synth::mixed_file(5, 1 << 20, 65536);
        let f = a
            .ingest_reader(&data[..], &IngestOptions::default())
            .unwrap();
        let rec = a
            .commit_snapshot(NewSnapshot {
                files: [("memory.bin".to_string(), f.file_ref())].into(),
                ..Default::default()
            })
            .unwrap();
        let ids = a.snapshot_chunks(&rec).unwrap();
        let mid = rec.files["memory.bin"].manifest;
        let mbytes = a.manifest_bytes(&mid).unwrap();

        // Lazy: manifests and locations, no chunks.
        let src = b.add_remote_source("file:///hub", 1).unwrap();
        assert_eq!(b.add_remote_source("file:///hub", 1).unwrap(), src);
        let m = a.manifest(&mid).unwrap();
        let locs: Vec<(ChunkId, RemoteChunk)> = ids
            .iter()
            .map(|c| {
                let raw = (0..m.len())
                    .find(|&i| m.entry(i) == crate::ChunkRef::Chunk(*c))
                    .map(|i| m.slot_len(i))
                    .unwrap();
                (*c, loc(c, raw))
            })
            .collect();
        // Without the locations, the manifest is refused.
        assert!(matches!(
            b.import_remote(&[(mid, &mbytes)], &[]),
            Err(Error::MissingChunk { .. })
        ));
        b.import_remote(&[(mid, &mbytes)], &locs).unwrap();
        assert!(b
            .commit_imported_lazy(&rec, Some("lazy"), false, src.id)
            .unwrap());
        assert_eq!(b.lazy_snapshots().unwrap(), vec![(rec.id, src.id)]);
        let r = b.residency(&rec).unwrap();
        assert_eq!((r.local_chunks, r.remote_chunks), (0, ids.len() as u64));
        assert_eq!(r.source.as_deref(), Some("file:///hub"));
        assert!(!b.working_set_local(&rec.id).unwrap());
        // verify: remote chunks are not damage.
        let v = b.verify().unwrap();
        assert!(v.is_ok(), "{v:?}");
        assert_eq!(v.remote_chunks, ids.len() as u64);

        // No fetcher: a read fails naming the chunk.
        let mut out = vec![0u8; data.len()];
        let e = b
            .open_file(&rec.id, "memory.bin")
            .unwrap()
            .read_exact_at(&mut out, 0)
            .unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        // With one, the bytes come from the "hub", verified.
        let fetcher = Arc::new(FromStore(a.view(), Default::default()));
        b.set_fetcher(fetcher.clone());
        b.open_file(&rec.id, "memory.bin")
            .unwrap()
            .read_exact_at(&mut out, 0)
            .unwrap();
        assert_eq!(out, data);
        assert!(fetcher.1.load(std::sync::atomic::Ordering::Relaxed) > 0);

        // GC keeps the manifest and the locations; nothing is lost.
        b.gc().unwrap();
        assert_eq!(
            b.remote_chunks(&ids).unwrap().iter().flatten().count(),
            ids.len()
        );
        assert!(!b.finish_remote(&rec.id).unwrap());

        // The fill imports the chunks: locations go, the marker goes.
        let chunks: Vec<VerifiedChunk> = ids.iter().map(|c| a.stored_chunk(c).unwrap()).collect();
        b.import_chunks(&chunks).unwrap();
        assert!(b.remote_chunks(&ids).unwrap().iter().all(|r| r.is_none()));
        assert!(b.finish_remote(&rec.id).unwrap());
        assert!(b.lazy_snapshots().unwrap().is_empty());
        assert!(b.residency(&rec).unwrap().is_local());
        assert!(b.working_set_local(&rec.id).unwrap());
        let v = b.verify().unwrap();
        assert!(v.is_ok() && v.remote_chunks == 0, "{v:?}");
    }

    #[test]
    fn children_of_lazy_snapshots_are_lazy_and_deletes_clean_up() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b) = (store(da.path()), store(db.path()));
        let data = crate::synth::mixed_file(6, 300_000, 65536);
        let f = a
            .ingest_reader(&data[..], &IngestOptions::default())
            .unwrap();
        let rec = a
            .commit_snapshot(NewSnapshot {
                files: [("f".to_string(), f.file_ref())].into(),
                ..Default::default()
            })
            .unwrap();
        let ids = a.snapshot_chunks(&rec).unwrap();
        let mid = rec.files["f"].manifest;
        let src = b.add_remote_source("s3://b/p", 2).unwrap();
        let locs: Vec<_> = ids.iter().map(|c| (*c, loc(c, 65536))).collect();
        b.import_remote(&[(mid, &a.manifest_bytes(&mid).unwrap())], &locs)
            .unwrap();
        b.commit_imported_lazy(&rec, None, false, src.id).unwrap();
        // A child naming the same (remote) manifest commits, and is lazy.
        let child = b
            .commit_snapshot(NewSnapshot {
                parent: Some(rec.id),
                files: rec.files.clone(),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(b.lazy_source(&child.id).unwrap(), Some(src.id));
        // Deleting both drops the markers; GC drops the locations.
        b.delete_snapshot(&child.id).unwrap();
        b.delete_snapshot(&rec.id).unwrap();
        assert!(b.lazy_snapshots().unwrap().is_empty());
        b.gc().unwrap();
        assert!(b.remote_chunks(&ids).unwrap().iter().all(|r| r.is_none()));
        assert!(b.verify().unwrap().is_ok());
    }
}
