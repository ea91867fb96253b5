//! Space accounting (`stats`) and snapshot comparison (`diff`).

use std::collections::{BTreeMap, HashSet};

use crate::chunk::ChunkLocation;
use crate::db::{chunk_ref_key, CF_CHUNKS, CF_MANIFESTS, CF_REFS, CF_TAGS};
use crate::error::{Error, Result};
use crate::ids::{ChunkId, SnapshotId};
use crate::store::db_dir;
use crate::view::StoreView;

/// Space and object counts of a store.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Snapshots.
    pub snapshots: u64,
    /// Tags.
    pub tags: u64,
    /// Stored manifests (including unreferenced ones awaiting GC).
    pub manifests: u64,
    /// Indexed chunks (including unreferenced ones awaiting GC).
    pub chunks: u64,
    /// Chunks referenced by at least one snapshot.
    pub referenced_chunks: u64,
    /// Pack files.
    pub packs: u64,
    /// Sum of file sizes over all snapshots.
    pub logical_bytes: u64,
    /// Part of `logical_bytes` that is all-zero chunks (costs nothing).
    pub zero_bytes: u64,
    /// Uncompressed bytes of distinct referenced chunks.
    pub unique_bytes: u64,
    /// Bytes of pack files on disk (what the chunk data really occupies,
    /// garbage included).
    pub stored_bytes: u64,
    /// Pack bytes of referenced chunks (record headers included).
    pub live_stored_bytes: u64,
    /// Pack bytes GC could reclaim (`stored_bytes - live_stored_bytes`).
    pub garbage_bytes: u64,
    /// Bytes of the RocksDB directory (index, manifests, records).
    pub index_bytes: u64,
    /// `logical_bytes / unique_bytes`: zero regions and repeated chunks both
    /// count as deduplicated.
    pub dedup_ratio: f64,
    /// `unique_bytes / live_stored_bytes`.
    pub compression_ratio: f64,
    /// Chunks of lazy snapshots still only on a hub.
    pub remote_chunks: u64,
    /// What they will occupy once fetched (their stored size on the hub).
    pub remote_stored_bytes: u64,
}

/// How a file changed between two snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileStatus {
    /// Only in `b`.
    Added,
    /// In both, different manifests.
    Changed,
    /// In both, same manifest.
    Unchanged,
}

/// One file of `b` compared with snapshot `a`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDiff {
    /// Added, changed or unchanged.
    pub status: FileStatus,
    /// File size in `b`.
    pub size: u64,
    /// Distinct chunks of this file that no file of `a` has.
    pub new_chunks: u64,
    /// Their uncompressed bytes.
    pub new_raw_bytes: u64,
    /// Their pack bytes (headers included).
    pub new_stored_bytes: u64,
}

/// Chunks in snapshot `b` that snapshot `a` does not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiffReport {
    /// Base snapshot.
    pub a: SnapshotId,
    /// Compared snapshot.
    pub b: SnapshotId,
    /// Per file of `b`.
    pub files: BTreeMap<String, FileDiff>,
    /// Files of `a` that `b` does not have.
    pub removed_files: Vec<String>,
    /// Distinct new chunks over all files of `b`.
    pub new_chunks: u64,
    /// Their uncompressed bytes.
    pub new_raw_bytes: u64,
    /// Their pack bytes: what copying `b` to a store that has `a` costs.
    pub new_stored_bytes: u64,
}

impl StoreView {
    /// Counts and space usage. Walks the index, so O(chunks).
    pub fn stats(&self) -> Result<Stats> {
        let db = self.db();
        let mut s = Stats::default();
        for rec in self.list_snapshots()? {
            s.snapshots += 1;
            for f in rec.files.values() {
                s.logical_bytes += f.size;
                s.zero_bytes += self.manifest(&f.manifest)?.zero_bytes();
            }
        }
        s.tags = db.scan(CF_TAGS).count() as u64;
        s.manifests = db.scan(CF_MANIFESTS).count() as u64;
        for kv in db.scan(CF_CHUNKS) {
            let (k, v) = kv?;
            let Some(cid) = ChunkId::from_slice(&k) else {
                continue;
            };
            let loc = ChunkLocation::decode(&cid, &v)?;
            s.chunks += 1;
            if db.get(CF_REFS, &chunk_ref_key(&cid))?.is_some() {
                s.referenced_chunks += 1;
                s.unique_bytes += u64::from(loc.raw_len);
                s.live_stored_bytes += loc.record_len();
            }
        }
        for (_, len) in self.packs().list()? {
            s.packs += 1;
            s.stored_bytes += len;
        }
        s.garbage_bytes = s.stored_bytes.saturating_sub(s.live_stored_bytes);
        (s.remote_chunks, s.remote_stored_bytes) = crate::remote::remote_totals(self)?;
        s.index_bytes = dir_bytes(&db_dir(self.root()));
        s.dedup_ratio = ratio(s.logical_bytes, s.unique_bytes);
        s.compression_ratio = ratio(s.unique_bytes, s.live_stored_bytes);
        Ok(s)
    }

    /// Chunks of snapshot `b` that snapshot `a` does not have, with their
    /// raw and stored sizes, per file and in total (a chunk new in two files
    /// counts once in the total).
    pub fn diff(&self, a: &SnapshotId, b: &SnapshotId) -> Result<DiffReport> {
        let ra = self.snapshot(a)?.ok_or(Error::NoSuchSnapshot(*a))?;
        let rb = self.snapshot(b)?.ok_or(Error::NoSuchSnapshot(*b))?;
        let mut in_a: HashSet<ChunkId> = HashSet::new();
        for f in ra.files.values() {
            in_a.extend(self.manifest(&f.manifest)?.distinct_chunks());
        }
        let mut report = DiffReport {
            a: *a,
            b: *b,
            files: BTreeMap::new(),
            removed_files: ra
                .files
                .keys()
                .filter(|n| !rb.files.contains_key(*n))
                .cloned()
                .collect(),
            new_chunks: 0,
            new_raw_bytes: 0,
            new_stored_bytes: 0,
        };
        let mut counted: HashSet<ChunkId> = HashSet::new();
        for (name, f) in &rb.files {
            let status = match ra.files.get(name) {
                None => FileStatus::Added,
                Some(fa) if fa.manifest == f.manifest => FileStatus::Unchanged,
                Some(_) => FileStatus::Changed,
            };
            let mut fd = FileDiff {
                status,
                size: f.size,
                new_chunks: 0,
                new_raw_bytes: 0,
                new_stored_bytes: 0,
            };
            let m = self.manifest(&f.manifest)?;
            for c in m.distinct_chunks().iter().filter(|c| !in_a.contains(*c)) {
                // A chunk of a lazy snapshot counts what it will take here.
                let (raw, stored) = match self.chunk_location(c)? {
                    Some(loc) => (u64::from(loc.raw_len), loc.record_len()),
                    None => match self.remote_chunk(c)? {
                        Some(r) => (u64::from(r.raw_len), r.record_len()),
                        None => {
                            return Err(Error::MissingChunk {
                                id: *c,
                                reason: format!("named by {name} of snapshot {b} but not indexed"),
                            })
                        }
                    },
                };
                fd.new_chunks += 1;
                fd.new_raw_bytes += raw;
                fd.new_stored_bytes += stored;
                if counted.insert(*c) {
                    report.new_chunks += 1;
                    report.new_raw_bytes += raw;
                    report.new_stored_bytes += stored;
                }
            }
            report.files.insert(name.clone(), fd);
        }
        Ok(report)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
