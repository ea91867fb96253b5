//! Moving snapshots between stores: what the snapshot hub and pack files
//! (poold's `hub` module) need from the store's internals.
//!
//! Export (any view): a snapshot's parent chain, its distinct chunk ids,
//! batched "do you have these chunks" lookups, and chunks in their stored
//! (compressed) form, verified before they leave.
//!
//! Import (the writer), for data that arrives from an untrusted source:
//! - a chunk is verified against its id (bounded decompress, blake3) before
//!   it may be appended: [`VerifiedChunk`] can only be made by
//!   [`StoredChunk::verify`] or read from a store;
//! - [`Store::import_chunks`] follows ingest's rule: pack bytes are
//!   fdatasync'd before the one synced batch that indexes them;
//! - [`Store::import_manifest`] stores a manifest only once every chunk it
//!   names is indexed, and only if its bytes hash to its id;
//! - [`Store::commit_imported`] commits a snapshot record **keeping its
//!   original id** (ids are immutable across hosts), only if its parent and
//!   manifests are here, atomically with its refcounts and tag.
//!
//! So a kill at any point leaves a consistent store: at worst imported chunks
//! or manifests nothing references yet, which a re-run reuses (it resumes)
//! and GC otherwise reclaims.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use rocksdb::WriteBatch;

use crate::chunk::{decode_verified, ChunkLocation, Compression, MAX_CHUNK_SIZE};
use crate::db::{
    child_key, chunk_ref_key, CF_CHILDREN, CF_CHUNKS, CF_MANIFESTS, CF_META, CF_REFS, CF_SNAPSHOTS,
    CF_TAGS,
};
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ManifestId, SnapshotId};
use crate::manifest::FileManifest;
use crate::pack::ReadError;
use crate::snapshot::SnapshotRecord;
use crate::store::Store;
use crate::tag::{is_valid_file_name, validate_tag};
use crate::view::StoreView;

/// Most chunk slots an imported manifest may have (128 GiB at the default
/// 64 KiB chunk size). Checked from the header before anything is
/// allocated: a 5-byte zero run can otherwise claim billions of slots.
pub const MAX_MANIFEST_SLOTS: u64 = 1 << 21;
/// Largest canonical manifest encoding accepted from outside: every slot a
/// distinct chunk at [`MAX_MANIFEST_SLOTS`].
pub const MAX_MANIFEST_BYTES: usize = 16 + 33 * MAX_MANIFEST_SLOTS as usize;
/// Largest snapshot record (JSON) accepted from outside.
pub const MAX_RECORD_BYTES: usize = 4 << 20;
/// Most files one imported snapshot may have.
pub const MAX_RECORD_FILES: usize = 256;
/// Ids per RocksDB multi-get.
const LOOKUP_BATCH: usize = 4096;

impl TryFrom<u8> for Compression {
    type Error = String;
    fn try_from(b: u8) -> std::result::Result<Compression, String> {
        match b {
            0 => Ok(Compression::Raw),
            1 => Ok(Compression::Zstd),
            _ => Err(format!("unknown compression code {b}")),
        }
    }
}

/// A chunk in its stored form: the payload exactly as a pack holds it.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredChunk {
    /// blake3 of the uncompressed bytes.
    pub id: ChunkId,
    /// How `payload` is encoded.
    pub compression: Compression,
    /// Uncompressed length.
    pub raw_len: u32,
    /// The stored bytes.
    pub payload: Vec<u8>,
}

impl std::fmt::Debug for StoredChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredChunk")
            .field("id", &self.id)
            .field("compression", &self.compression)
            .field("raw_len", &self.raw_len)
            .field("stored_len", &self.payload.len())
            .finish()
    }
}

impl StoredChunk {
    /// Checks the lengths, decodes the payload (never past `raw_len`) and
    /// requires the bytes to hash to `id`. On failure, the reason.
    pub fn verify(self) -> std::result::Result<VerifiedChunk, String> {
        self.verify_decoded().map(|(v, _)| v)
    }

    /// [`StoredChunk::verify`], also returning the uncompressed bytes it
    /// checked (a lazy read answers with them).
    pub fn verify_decoded(self) -> std::result::Result<(VerifiedChunk, Vec<u8>), String> {
        if self.raw_len == 0 || self.raw_len > MAX_CHUNK_SIZE {
            return Err(format!(
                "raw length {} is outside 1..={MAX_CHUNK_SIZE}",
                self.raw_len
            ));
        }
        let stored = self.payload.len();
        let ok_len = match self.compression {
            Compression::Raw => stored == self.raw_len as usize,
            Compression::Zstd => stored > 0 && stored <= self.raw_len as usize,
        };
        if !ok_len {
            return Err(format!(
                "stored length {stored} does not fit raw length {} ({:?})",
                self.raw_len, self.compression
            ));
        }
        let raw = decode_verified(&self.id, &self.location(), &self.payload)?;
        Ok((VerifiedChunk(self), raw))
    }

    fn location(&self) -> ChunkLocation {
        ChunkLocation {
            pack: 0,
            offset: 0,
            stored_len: self.payload.len() as u32,
            raw_len: self.raw_len,
            compression: self.compression,
        }
    }

    /// Bytes this chunk occupies in a store's pack (record header included),
    /// the unit of [`crate::DiffReport::new_stored_bytes`].
    pub fn record_len(&self) -> u64 {
        self.location().record_len()
    }
}

/// A [`StoredChunk`] whose bytes were checked against its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedChunk(StoredChunk);

impl VerifiedChunk {
    /// The chunk.
    pub fn chunk(&self) -> &StoredChunk {
        &self.0
    }

    /// The chunk, giving up the proof.
    pub fn into_inner(self) -> StoredChunk {
        self.0
    }
}

impl std::ops::Deref for VerifiedChunk {
    type Target = StoredChunk;
    fn deref(&self) -> &StoredChunk {
        &self.0
    }
}

/// What [`Store::import_chunks`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkImport {
    /// Chunks appended and indexed.
    pub new_chunks: u64,
    /// Chunks skipped because the store already had them.
    pub present_chunks: u64,
    /// Uncompressed bytes of the new chunks.
    pub new_raw_bytes: u64,
    /// Pack bytes of the new chunks (record headers included).
    pub new_stored_bytes: u64,
}

/// Decodes a manifest from outside the store: bounded size and slot count
/// (checked before allocating), canonical encoding, and bytes that hash to
/// `id`.
pub fn decode_manifest(id: &ManifestId, bytes: &[u8]) -> Result<FileManifest> {
    let bad = |reason: String| Error::CorruptRecord {
        what: "manifest",
        key: id.to_string(),
        reason,
    };
    if bytes.len() > MAX_MANIFEST_BYTES {
        return Err(bad(format!(
            "{} bytes, over the {MAX_MANIFEST_BYTES}-byte limit",
            bytes.len()
        )));
    }
    if bytes.len() >= 16 {
        let size = u64::from_le_bytes(bytes[4..12].try_into().unwrap());
        let chunk_size = u32::from_le_bytes(bytes[12..16].try_into().unwrap());
        if chunk_size == 0 {
            return Err(bad("chunk size 0".into()));
        }
        let slots = size.div_ceil(u64::from(chunk_size));
        if slots > MAX_MANIFEST_SLOTS {
            return Err(bad(format!(
                "{slots} chunk slots, over the {MAX_MANIFEST_SLOTS}-slot limit"
            )));
        }
    }
    let m = FileManifest::decode(bytes).map_err(bad)?;
    let got = m.id();
    if &got != id {
        return Err(bad(format!("content hashes to {got}, not to its id")));
    }
    Ok(m)
}

/// Decodes a snapshot record from outside the store: bounded size, valid
/// JSON of the right shape, the id it is filed under, valid file names.
pub fn decode_record(id: &SnapshotId, bytes: &[u8]) -> Result<SnapshotRecord> {
    let bad = |reason: String| Error::CorruptRecord {
        what: "snapshot",
        key: id.to_string(),
        reason,
    };
    if bytes.len() > MAX_RECORD_BYTES {
        return Err(bad(format!(
            "{} bytes, over the {MAX_RECORD_BYTES}-byte limit",
            bytes.len()
        )));
    }
    let rec: SnapshotRecord = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    if &rec.id != id {
        return Err(bad(format!("the record inside is snapshot {}", rec.id)));
    }
    if rec.parent == Some(rec.id) {
        return Err(bad("names itself as parent".into()));
    }
    if rec.files.len() > MAX_RECORD_FILES {
        return Err(bad(format!(
            "{} files, over the {MAX_RECORD_FILES}-file limit",
            rec.files.len()
        )));
    }
    if let Some(name) = rec.files.keys().find(|n| !is_valid_file_name(n)) {
        return Err(bad(format!("invalid file name {name:?}")));
    }
    Ok(rec)
}

impl StoreView {
    /// The snapshot and its parent chain as records, root first, ending with
    /// `id` itself.
    pub fn chain(&self, id: &SnapshotId) -> Result<Vec<SnapshotRecord>> {
        let mut out = Vec::new();
        for a in self.ancestors(id)?.iter().chain(std::iter::once(id)) {
            out.push(self.snapshot(a)?.ok_or(Error::NoSuchSnapshot(*a))?);
        }
        Ok(out)
    }

    /// The distinct chunks a snapshot's files name, in first-use order.
    pub fn snapshot_chunks(&self, rec: &SnapshotRecord) -> Result<Vec<ChunkId>> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for f in rec.files.values() {
            for c in self.manifest(&f.manifest)?.distinct_chunks() {
                if seen.insert(*c) {
                    out.push(*c);
                }
            }
        }
        Ok(out)
    }

    /// For each id, whether the chunk index has it (batched lookups).
    pub fn has_chunks(&self, ids: &[ChunkId]) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(ids.len());
        for part in ids.chunks(LOOKUP_BATCH) {
            let keys: Vec<&[u8]> = part.iter().map(|c| &c.as_bytes()[..]).collect();
            out.extend(
                self.db()
                    .multi_get(CF_CHUNKS, &keys)?
                    .iter()
                    .map(Option::is_some),
            );
        }
        Ok(out)
    }

    /// A chunk in its stored (compressed) form, verified against its id
    /// before it is returned: nothing unverified leaves the store.
    pub fn stored_chunk(&self, id: &ChunkId) -> Result<VerifiedChunk> {
        let loc = self
            .chunk_location(id)?
            .ok_or_else(|| Error::MissingChunk {
                id: *id,
                reason: "not in the chunk index".into(),
            })?;
        let path = self.packs().path(loc.pack);
        let corrupt = |reason: String| Error::CorruptChunk {
            id: *id,
            pack: path.clone(),
            offset: loc.offset,
            reason,
        };
        let payload = match self.packs().read_payload(id, &loc) {
            Ok(p) => p,
            Err(ReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::MissingChunk {
                    id: *id,
                    reason: format!("pack {} is gone", path.display()),
                })
            }
            Err(ReadError::Io(e)) => return Err(Error::io(&path, e)),
            Err(ReadError::Corrupt(reason)) => return Err(corrupt(reason)),
        };
        StoredChunk {
            id: *id,
            compression: loc.compression,
            raw_len: loc.raw_len,
            payload,
        }
        .verify()
        .map_err(corrupt)
    }

    /// A manifest's canonical encoding (what its id hashes).
    pub fn manifest_bytes(&self, id: &ManifestId) -> Result<Vec<u8>> {
        Ok(self.manifest(id)?.encode())
    }
}

impl Store {
    /// Appends verified chunks the store lacks, fdatasyncs their packs, then
    /// indexes them in one synced batch. Chunks already indexed (or repeated
    /// in `chunks`) are skipped. On failure before the batch, the appended
    /// bytes are given back where possible (as a failed ingest does).
    pub fn import_chunks(&self, chunks: &[VerifiedChunk]) -> Result<ChunkImport> {
        let _gc = self.gc_lock.read().unwrap();
        let ids: Vec<ChunkId> = chunks.iter().map(|c| c.id).collect();
        let have = self.view.has_chunks(&ids)?;
        let packs = self.view.packs();
        let db = self.view.db();
        let mark = packs.mark();
        let mut report = ChunkImport::default();
        let mut appended = 0u64;
        let mut committing = false;
        let result = (|| -> Result<()> {
            let mut seen = HashSet::new();
            let mut touched = BTreeSet::new();
            let mut batch = WriteBatch::default();
            for (c, have) in chunks.iter().zip(have) {
                if have || !seen.insert(c.id) {
                    report.present_chunks += 1;
                    continue;
                }
                let loc = packs.append(&c.id, c.raw_len, c.compression, &c.payload)?;
                appended += 1;
                touched.insert(loc.pack);
                batch.put_cf(db.cf(CF_CHUNKS), c.id.as_bytes(), loc.encode());
                report.new_chunks += 1;
                report.new_raw_bytes += u64::from(c.raw_len);
                report.new_stored_bytes += loc.record_len();
            }
            packs.sync(&touched)?;
            let new: Vec<ChunkId> = seen.iter().copied().collect();
            self.forget_remote(&mut batch, &new)?;
            db.check_space(&batch, crate::db::RESERVE_GROW)?;
            committing = true;
            db.write_unchecked(batch, "indexing imported chunks")
        })();
        if let Err(e) = result {
            if !committing {
                if let Some(m) = mark {
                    packs.rollback(m, appended);
                }
            }
            return Err(e);
        }
        Ok(report)
    }

    /// Stores a manifest that arrived from outside, after checking it (see
    /// [`decode_manifest`]) and that every chunk it names is indexed. Pins it
    /// against GC until [`Store::commit_imported`] (or [`Store::release`]).
    pub fn import_manifest(&self, id: &ManifestId, bytes: &[u8]) -> Result<Arc<FileManifest>> {
        let m = decode_manifest(id, bytes)?;
        let _gc = self.gc_lock.read().unwrap();
        let chunks = m.distinct_chunks();
        if let Some(i) = self.view.has_chunks(chunks)?.iter().position(|h| !h) {
            return Err(Error::MissingChunk {
                id: chunks[i],
                reason: format!("manifest {id} names it but it was not imported first"),
            });
        }
        if !self.view.has_manifest(id)? {
            let db = self.view.db();
            let mut batch = WriteBatch::default();
            batch.put_cf(db.cf(CF_MANIFESTS), id.as_bytes(), bytes);
            db.write(batch, "storing an imported manifest")?;
        }
        self.pin(*id);
        Ok(Arc::new(m))
    }

    /// Commits a snapshot record from another store under its original id,
    /// with its refcounts, parent link and (optionally) `tag`, in one synced
    /// batch. Returns `false` when the identical record was already here
    /// (only the tag is set then).
    ///
    /// Refuses a record whose id exists here with different content (ids are
    /// immutable), a missing parent, and manifests that are not stored.
    pub fn commit_imported(
        &self,
        rec: &SnapshotRecord,
        tag: Option<&str>,
        replace_tag: bool,
    ) -> Result<bool> {
        self.commit_imported_with(rec, tag, replace_tag, None)
    }

    /// [`Store::commit_imported`], marking a new record lazy from `lazy`
    /// (a remote source) in the same batch.
    pub(crate) fn commit_imported_with(
        &self,
        rec: &SnapshotRecord,
        tag: Option<&str>,
        replace_tag: bool,
        lazy: Option<u32>,
    ) -> Result<bool> {
        if let Some(name) = rec.files.keys().find(|n| !is_valid_file_name(n)) {
            return Err(Error::InvalidFileName(name.clone()));
        }
        if let Some(t) = tag {
            validate_tag(t)?;
        }
        let _c = self.commit_lock.lock().unwrap();
        let db = self.view.db();
        let mut batch = WriteBatch::default();
        let new = match db.snapshot(&rec.id)? {
            Some(existing) if existing == *rec => false,
            Some(_) => {
                return Err(Error::InvalidArgument(format!(
                    "snapshot {} already exists in this store with different content; \
                     snapshot ids never change, so the incoming record is not a copy of it — refusing to overwrite",
                    rec.id
                )))
            }
            None => {
                batch = self.imported_record_batch(rec)?;
                if let Some(src) = lazy {
                    batch.put_cf(
                        db.cf(CF_META),
                        crate::remote::marker_key(&rec.id),
                        src.to_le_bytes(),
                    );
                }
                true
            }
        };
        if let Some(tag) = tag {
            match self.view.tag(tag)? {
                Some(existing) if existing != rec.id && !replace_tag => {
                    return Err(Error::TagExists {
                        tag: tag.to_string(),
                        existing,
                    })
                }
                _ => batch.put_cf(db.cf(CF_TAGS), tag.as_bytes(), rec.id.as_bytes()),
            }
        }
        db.write(batch, "committing an imported snapshot")?;
        for f in rec.files.values() {
            self.release(&f.manifest);
        }
        Ok(new)
    }

    /// The record, parent link and refcount changes of a new imported
    /// snapshot (caller holds the commit lock).
    fn imported_record_batch(&self, rec: &SnapshotRecord) -> Result<WriteBatch> {
        let db = self.view.db();
        if let Some(p) = &rec.parent {
            if db.snapshot(p)?.is_none() {
                return Err(Error::InvalidArgument(format!(
                    "parent {p} of snapshot {} is not in this store; import the parent first",
                    rec.id
                )));
            }
        }
        let mut uses: BTreeMap<ManifestId, i64> = BTreeMap::new();
        for (name, f) in &rec.files {
            if !self.view.has_manifest(&f.manifest)? {
                return Err(Error::MissingManifest(f.manifest));
            }
            let size = self.view.manifest(&f.manifest)?.size();
            if size != f.size {
                return Err(Error::CorruptRecord {
                    what: "snapshot",
                    key: rec.id.to_string(),
                    reason: format!(
                        "file {name}: size {} but manifest {} has {size} bytes",
                        f.size, f.manifest
                    ),
                });
            }
            *uses.entry(f.manifest).or_default() += 1;
        }
        let (mut batch, _) = self.refcount_batch(&uses, true)?;
        let json = serde_json::to_vec(rec).expect("snapshot record serializes");
        batch.put_cf(db.cf(CF_SNAPSHOTS), rec.id.as_bytes(), json);
        if let Some(p) = &rec.parent {
            batch.put_cf(db.cf(CF_CHILDREN), child_key(p, &rec.id), b"");
        }
        Ok(batch)
    }

    /// Drops the index entries of `ids` that nothing references (refcount
    /// 0, named by no pinned manifest): undoes the chunk imports of a
    /// transfer that was refused, so the store's index is as before. Their
    /// pack bytes become garbage for GC. Returns how many were dropped.
    pub fn discard_chunks(&self, ids: &[ChunkId]) -> Result<u64> {
        let _g = self.gc_lock.write().unwrap();
        let _c = self.commit_lock.lock().unwrap();
        let mut pinned: HashSet<ChunkId> = HashSet::new();
        for m in self.pinned() {
            if let Ok(m) = self.view.manifest(&m) {
                pinned.extend(m.distinct_chunks());
            }
        }
        let db = self.view.db();
        let mut batch = WriteBatch::default();
        let mut dropped = 0;
        for part in ids.chunks(LOOKUP_BATCH) {
            let keys: Vec<[u8; 33]> = part.iter().map(chunk_ref_key).collect();
            let key_refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
            let refs = db.multi_get(CF_REFS, &key_refs)?;
            let indexed = self.view.has_chunks(part)?;
            for ((id, r), ix) in part.iter().zip(refs).zip(indexed) {
                if ix && r.is_none() && !pinned.contains(id) {
                    batch.delete_cf(db.cf(CF_CHUNKS), id.as_bytes());
                    dropped += 1;
                }
            }
        }
        db.write_small(batch, "discarding refused imported chunks")?;
        Ok(dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IngestOptions, NewSnapshot, StoreOptions};

    fn store(dir: &std::path::Path) -> Store {
        Store::open(dir, StoreOptions::default()).unwrap()
    }

    /// Ingests `data` as file "f" and commits it (child of `parent`).
    fn snap(s: &Store, data: &[u8], parent: Option<SnapshotId>) -> SnapshotRecord {
        let f = s.ingest_reader(data, &IngestOptions::default()).unwrap();
        s.commit_snapshot(NewSnapshot {
            parent,
            files: [("f".to_string(), f.file_ref())].into(),
            ..Default::default()
        })
        .unwrap()
    }

    /// Copies `rec` from `a` to `b` chunk by chunk, as a hub transfer does.
    fn copy(a: &Store, b: &Store, rec: &SnapshotRecord, tag: Option<&str>) -> ChunkImport {
        let ids = a.snapshot_chunks(rec).unwrap();
        let chunks: Vec<VerifiedChunk> = ids.iter().map(|c| a.stored_chunk(c).unwrap()).collect();
        let report = b.import_chunks(&chunks).unwrap();
        for f in rec.files.values() {
            b.import_manifest(&f.manifest, &a.manifest_bytes(&f.manifest).unwrap())
                .unwrap();
        }
        b.commit_imported(rec, tag, false).unwrap();
        report
    }

    #[test]
    fn chain_copies_byte_exact_keeping_ids() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b) = (store(da.path()), store(db.path()));
        let base_data = crate::synth::mixed_file(1, 1 << 20, 65536);
        let mut head_data = base_data.clone();
        head_data[100_000..100_010].fill(7);
        let base = snap(&a, &base_data, None);
        let head = snap(&a, &head_data, Some(base.id));
        assert_eq!(a.chain(&head.id).unwrap(), vec![base.clone(), head.clone()]);

        let r1 = copy(&a, &b, &base, Some("base"));
        assert!(r1.new_chunks > 0);
        let r2 = copy(&a, &b, &head, Some("head"));
        let diff = a.diff(&base.id, &head.id).unwrap();
        assert_eq!(r2.new_chunks, diff.new_chunks);
        assert_eq!(r2.new_stored_bytes, diff.new_stored_bytes);
        assert_eq!(b.snapshot(&head.id).unwrap().unwrap(), head);
        let mut out = vec![0u8; head_data.len()];
        b.open_file(&head.id, "f")
            .unwrap()
            .read_exact_at(&mut out, 0)
            .unwrap();
        assert_eq!(out, head_data);
        assert!(b.verify().unwrap().is_ok());
        // Idempotent: the same record again only (re)sets the tag.
        assert!(!b.commit_imported(&head, Some("head"), false).unwrap());
    }

    #[test]
    fn refuses_bad_input() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b) = (store(da.path()), store(db.path()));
        let rec = snap(&a, &crate::synth::mixed_file(2, 300_000, 65536), None);
        let id = a.snapshot_chunks(&rec).unwrap()[0];
        let mut c = a.stored_chunk(&id).unwrap().into_inner();
        let n = c.payload.len();
        c.payload[n / 2] ^= 1;
        assert!(c.clone().verify().is_err());
        c.raw_len = MAX_CHUNK_SIZE + 1;
        assert!(c.verify().unwrap_err().contains("raw length"));

        let mid = rec.files["f"].manifest;
        let mut bytes = a.manifest_bytes(&mid).unwrap();
        // Not imported chunks first: refused.
        assert!(matches!(
            b.import_manifest(&mid, &bytes),
            Err(Error::MissingChunk { .. })
        ));
        bytes[20] ^= 1;
        assert!(decode_manifest(&mid, &bytes).is_err());
        // A header claiming a huge file is refused before allocation.
        let mut huge = b"FKM1".to_vec();
        huge.extend_from_slice(&(1u64 << 50).to_le_bytes());
        huge.extend_from_slice(&4096u32.to_le_bytes());
        huge.extend_from_slice(&[0, 0xff, 0xff, 0xff, 0xff]);
        let e = decode_manifest(&mid, &huge).unwrap_err().to_string();
        assert!(e.contains("slot limit"), "{e}");

        // A record under the wrong id, and a parent that is not here.
        let json = serde_json::to_vec(&rec).unwrap();
        assert!(decode_record(&SnapshotId::random(), &json).is_err());
        let mut orphan = rec.clone();
        orphan.parent = Some(SnapshotId::random());
        orphan.id = SnapshotId::random();
        orphan.files.clear();
        let e = b.commit_imported(&orphan, None, false).unwrap_err();
        assert!(e.to_string().contains("import the parent first"), "{e}");
        // Same id, different content.
        let mut copy_rec = rec.clone();
        copy_rec.files.clear();
        b.commit_imported(&copy_rec, None, false).unwrap();
        copy_rec.created_at_unix += 1;
        assert!(b.commit_imported(&copy_rec, None, false).is_err());
    }

    #[test]
    fn discard_undoes_unreferenced_imports() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b) = (store(da.path()), store(db.path()));
        let rec = snap(&a, &crate::synth::mixed_file(3, 500_000, 65536), None);
        let ids = a.snapshot_chunks(&rec).unwrap();
        let chunks: Vec<_> = ids.iter().map(|c| a.stored_chunk(c).unwrap()).collect();
        let before = b.stats().unwrap().chunks;
        b.import_chunks(&chunks).unwrap();
        assert_eq!(b.stats().unwrap().chunks, before + ids.len() as u64);
        assert_eq!(b.discard_chunks(&ids).unwrap(), ids.len() as u64);
        assert_eq!(b.stats().unwrap().chunks, before);
        assert!(b.verify().unwrap().is_ok());
    }
}
