//! Garbage collection of unreferenced manifests, chunks and pack space.
//!
//! Policy:
//! 1. Under the exclusive GC lock (no ingest running) and the commit lock,
//!    drop index entries of chunks with refcount 0 that no pinned
//!    (ingested, not yet committed) manifest names, and manifests with
//!    refcount 0 that are not pinned, in one durable batch. Around it the
//!    active pack's garbage tail is cut: first the unindexed bytes (killed
//!    or failed ingests), after the batch the dead records.
//! 2. A pack with no live chunk left is deleted whole (after recording
//!    `meta/next_pack`, so its number is never reused).
//! 3. A pack whose garbage fraction is at least
//!    [`crate::StoreOptions::gc_rewrite_threshold`] (default 50%) is
//!    rewritten: its live chunks are appended to the active pack, that pack
//!    is fdatasync'd, the index is repointed in one durable batch, and only
//!    then is the old pack deleted.
//!
//! Live records are never overwritten in place, only whole files removed,
//! so a secondary reader holding an fd keeps reading; one that finds a pack
//! gone, or a record that does not check out, catches up (learning the new
//! locations) and retries. A crash at any step leaves either the old state
//! or garbage the next GC removes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Instant;

use rocksdb::WriteBatch;

use crate::chunk::{decode_verified, ChunkLocation};
use crate::db::{
    chunk_ref_key, manifest_ref_key, CF_CHUNKS, CF_MANIFESTS, CF_META, CF_REFS, KEY_NEXT_PACK,
};
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ManifestId};
use crate::pack::ReadError;
use crate::store::Store;

/// What [`Store::gc`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GcReport {
    /// Unreferenced manifests removed.
    pub manifests_removed: u64,
    /// Unreferenced chunks removed from the index.
    pub chunks_removed: u64,
    /// Pack files deleted (emptied or rewritten).
    pub packs_deleted: u64,
    /// Packs whose live chunks were copied out before deletion.
    pub packs_rewritten: u64,
    /// Live chunk bytes copied by rewrites.
    pub bytes_moved: u64,
    /// Net disk bytes freed (deleted pack bytes minus bytes moved).
    pub bytes_reclaimed: u64,
    /// Live chunks that could not be read and so kept their pack alive
    /// (run verify).
    pub problems: Vec<String>,
    /// Wall time in milliseconds.
    pub elapsed_ms: u64,
}

const BATCH: usize = 1024;

impl Store {
    /// Reclaims the space of chunks no snapshot references. Safe against
    /// concurrent ingests in this process (they wait, and what they ingested
    /// but did not yet commit is pinned).
    pub fn gc(&self) -> Result<GcReport> {
        let start = Instant::now();
        let _g = self.gc_lock.write().unwrap();
        let _c = self.commit_lock.lock().unwrap();
        let mut report = GcReport::default();
        let live_per_pack = self.drop_dead(&mut report)?;
        let rewrite = self.delete_empty_packs(&live_per_pack, &mut report)?;
        if !rewrite.is_empty() {
            self.rewrite_packs(&rewrite, &mut report)?;
        }
        report.elapsed_ms = start.elapsed().as_millis() as u64;
        Ok(report)
    }

    /// Records the next pack number before any pack is deleted, so numbers
    /// are never reused after a restart (secondaries may hold fds of deleted
    /// packs under their old numbers).
    fn persist_next_pack(&self) -> Result<()> {
        let db = self.view.db();
        // Every pack this GC deletes exists now, so its number is below this.
        let next = self.view.packs().next_num();
        if db.next_pack()? >= next {
            return Ok(());
        }
        let mut batch = WriteBatch::default();
        batch.put_cf(db.cf(CF_META), KEY_NEXT_PACK, next.to_le_bytes());
        db.write_small(batch, "recording the next pack number")
    }

    /// Step 1: removes dead manifests and index entries; returns live record
    /// bytes per pack. Also cuts the active pack's garbage tail (records of
    /// failed or killed ingests, then dead chunks), which frees space first
    /// on a full disk.
    fn drop_dead(&self, report: &mut GcReport) -> Result<HashMap<u32, u64>> {
        let db = self.view.db();
        let pinned_manifests: HashSet<ManifestId> = self.pinned().into_iter().collect();
        let mut pinned_chunks: HashSet<ChunkId> = HashSet::new();
        for m in &pinned_manifests {
            pinned_chunks.extend(self.view.manifest(m)?.distinct_chunks());
        }
        let mut batch = WriteBatch::default();
        for kv in db.scan(CF_MANIFESTS) {
            let (k, _) = kv?;
            let Some(mid) = ManifestId::from_slice(&k) else {
                continue;
            };
            if !pinned_manifests.contains(&mid)
                && db.get(CF_REFS, &manifest_ref_key(&mid))?.is_none()
            {
                batch.delete_cf(db.cf(CF_MANIFESTS), mid.as_bytes());
                self.view.forget_manifest(&mid);
                report.manifests_removed += 1;
            }
        }
        let mut live: HashMap<u32, u64> = HashMap::new();
        let active = self.view.packs().active();
        let (mut indexed_end, mut live_end) = (0u64, 0u64);
        let mut page: Vec<(ChunkId, ChunkLocation)> = Vec::with_capacity(BATCH);
        let mut flush =
            |page: &mut Vec<(ChunkId, ChunkLocation)>, batch: &mut WriteBatch| -> Result<()> {
                let keys: Vec<[u8; 33]> = page.iter().map(|(c, _)| chunk_ref_key(c)).collect();
                let key_refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                for ((cid, loc), r) in page.iter().zip(db.multi_get(CF_REFS, &key_refs)?) {
                    let end = loc.offset + loc.record_len();
                    let in_active = active == Some(loc.pack);
                    if in_active {
                        indexed_end = indexed_end.max(end);
                    }
                    if r.is_some() || pinned_chunks.contains(cid) {
                        if in_active {
                            live_end = live_end.max(end);
                        }
                        *live.entry(loc.pack).or_default() += loc.record_len();
                    } else {
                        batch.delete_cf(db.cf(CF_CHUNKS), cid.as_bytes());
                        report.chunks_removed += 1;
                    }
                }
                page.clear();
                Ok(())
            };
        for kv in db.scan(CF_CHUNKS) {
            let (k, v) = kv?;
            let Some(cid) = ChunkId::from_slice(&k) else {
                continue;
            };
            page.push((cid, ChunkLocation::decode(&cid, &v)?));
            if page.len() == BATCH {
                flush(&mut page, &mut batch)?;
            }
        }
        flush(&mut page, &mut batch)?;
        // Remote locations of chunks now indexed or no longer referenced.
        for k in self.stale_remote_locations()? {
            batch.delete_cf(db.cf(CF_META), k);
        }
        let packs = self.view.packs();
        // Unindexed tail first: safe before the batch, and frees space for it.
        report.bytes_reclaimed += packs.trim_active(indexed_end)?;
        db.write_small(batch, "dropping unreferenced chunks")?;
        // Dead records at the tail: only once the index no longer names them.
        report.bytes_reclaimed += packs.trim_active(live_end)?;
        Ok(live)
    }

    /// Step 2: deletes packs with no live data; returns packs to rewrite.
    fn delete_empty_packs(
        &self,
        live: &HashMap<u32, u64>,
        report: &mut GcReport,
    ) -> Result<BTreeSet<u32>> {
        let packs = self.view.packs();
        let active = packs.active();
        let mut rewrite = BTreeSet::new();
        for (num, len) in packs.list()? {
            let live_bytes = live.get(&num).copied().unwrap_or(0);
            if live_bytes == 0 {
                if active == Some(num) {
                    packs.roll()?;
                }
                self.persist_next_pack()?;
                packs.delete(num)?;
                report.packs_deleted += 1;
                report.bytes_reclaimed += len;
            } else if len > 0
                && (len.saturating_sub(live_bytes)) as f64 / len as f64
                    >= self.opts.gc_rewrite_threshold
            {
                rewrite.insert(num);
            }
        }
        Ok(rewrite)
    }

    /// Step 3: copies live chunks out of mostly-garbage packs, then deletes
    /// those packs.
    fn rewrite_packs(&self, rewrite: &BTreeSet<u32>, report: &mut GcReport) -> Result<()> {
        let db = self.view.db();
        let packs = self.view.packs();
        if packs.active().is_some_and(|a| rewrite.contains(&a)) {
            packs.roll()?;
        }
        let mut moved: Vec<(ChunkId, ChunkLocation)> = Vec::new();
        let mut touched = BTreeSet::new();
        let mut keep: BTreeSet<u32> = BTreeSet::new();
        for kv in db.scan(CF_CHUNKS) {
            let (k, v) = kv?;
            let Some(cid) = ChunkId::from_slice(&k) else {
                continue;
            };
            let loc = ChunkLocation::decode(&cid, &v)?;
            if !rewrite.contains(&loc.pack) || keep.contains(&loc.pack) {
                continue;
            }
            let payload = match packs.read_payload(&cid, &loc) {
                Ok(p) if decode_verified(&cid, &loc, &p).is_ok() => p,
                Ok(_) | Err(ReadError::Corrupt(_)) => {
                    report.problems.push(format!(
                        "chunk {cid} in {} at offset {} is corrupt; pack kept",
                        packs.path(loc.pack).display(),
                        loc.offset
                    ));
                    keep.insert(loc.pack);
                    continue;
                }
                Err(ReadError::Io(e)) => return Err(Error::io(packs.path(loc.pack), e)),
            };
            let new = packs.append(&cid, loc.raw_len, loc.compression, &payload)?;
            touched.insert(new.pack);
            report.bytes_moved += new.record_len();
            moved.push((cid, new));
        }
        packs.sync(&touched)?;
        let mut batch = WriteBatch::default();
        for (cid, loc) in &moved {
            batch.put_cf(db.cf(CF_CHUNKS), cid.as_bytes(), loc.encode());
        }
        db.write_small(batch, "repointing moved chunks")?;
        let mut freed = 0u64;
        for (num, len) in packs.list()? {
            if rewrite.contains(&num) && !keep.contains(&num) {
                self.persist_next_pack()?;
                packs.delete(num)?;
                report.packs_deleted += 1;
                report.packs_rewritten += 1;
                freed += len;
            }
        }
        report.bytes_reclaimed += freed.saturating_sub(report.bytes_moved);
        Ok(())
    }
}
