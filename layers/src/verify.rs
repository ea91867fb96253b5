//! `verify`: re-hash every stored chunk and cross-check all metadata.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::chunk::{decode_verified, ChunkLocation};
use crate::db::{
    decode_count, decode_snapshot, CF_CHILDREN, CF_CHUNKS, CF_REFS, CF_SNAPSHOTS, CF_TAGS,
};
use crate::error::Result;
use crate::ids::{ChunkId, ManifestId, SnapshotId};
use crate::pack::ReadError;
use crate::store::Store;

/// A snapshot file that uses a given chunk.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ChunkUser {
    /// Snapshot id.
    pub snapshot: SnapshotId,
    /// File name in that snapshot.
    pub file: String,
    /// The file's manifest.
    pub manifest: ManifestId,
}

/// A chunk that failed verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadChunk {
    /// The chunk's id.
    pub id: ChunkId,
    /// Its pack file (`None` when the chunk is missing from the index).
    pub pack: Option<PathBuf>,
    /// Offset of its record in the pack.
    pub offset: u64,
    /// What is wrong.
    pub reason: String,
    /// Every committed snapshot file that references it.
    pub users: Vec<ChunkUser>,
}

/// What [`Store::verify`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Indexed chunks re-read and re-hashed.
    pub chunks_checked: u64,
    /// Uncompressed bytes re-hashed.
    pub bytes_checked: u64,
    /// Snapshots checked.
    pub snapshots_checked: u64,
    /// Corrupt chunks, and referenced chunks missing from the index.
    pub bad_chunks: Vec<BadChunk>,
    /// Metadata inconsistencies (refcounts, missing manifests, dangling
    /// tags or parent links).
    pub problems: Vec<String>,
    /// Referenced chunks not in the index but located on a hub (lazy
    /// snapshots still filling): not damage.
    pub remote_chunks: u64,
}

impl VerifyReport {
    /// True when nothing is wrong.
    pub fn is_ok(&self) -> bool {
        self.bad_chunks.is_empty() && self.problems.is_empty()
    }
}

impl Store {
    /// Re-hashes every stored chunk and cross-checks snapshots, manifests,
    /// refcounts, tags and parent links. Reports each bad chunk with its pack,
    /// offset and every snapshot file that references it.
    pub fn verify(&self) -> Result<VerifyReport> {
        let _g = self.gc_lock.read().unwrap();
        let mut report = VerifyReport::default();
        let index = self.index_entries()?;
        let mut bad = self.rehash(&index, &mut report);
        let _c = self.commit_lock.lock().unwrap();
        let manifests = self.check_metadata(&index, &mut report, &mut bad)?;
        // Attach users to every bad chunk.
        for b in &mut bad {
            for (mid, (chunks, users)) in &manifests {
                if chunks.contains(&b.id) {
                    b.users.extend(users.iter().map(|(s, f)| ChunkUser {
                        snapshot: *s,
                        file: f.clone(),
                        manifest: *mid,
                    }));
                }
            }
            b.users.sort();
        }
        report.bad_chunks = bad;
        Ok(report)
    }

    fn index_entries(&self) -> Result<Vec<(ChunkId, ChunkLocation)>> {
        let mut out = Vec::new();
        for kv in self.view.db().scan(CF_CHUNKS) {
            let (k, v) = kv?;
            if let Some(cid) = ChunkId::from_slice(&k) {
                out.push((cid, ChunkLocation::decode(&cid, &v)?));
            }
        }
        Ok(out)
    }

    /// Reads and re-hashes every indexed chunk on `ingest_threads` threads.
    fn rehash(
        &self,
        index: &[(ChunkId, ChunkLocation)],
        report: &mut VerifyReport,
    ) -> Vec<BadChunk> {
        let next = AtomicUsize::new(0);
        let bytes = AtomicU64::new(0);
        let bad = Mutex::new(Vec::new());
        let packs = self.view.packs();
        std::thread::scope(|s| {
            for _ in 0..self.opts.ingest_threads.max(1) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((cid, loc)) = index.get(i) else {
                        return;
                    };
                    let res = match packs.read_payload(cid, loc) {
                        Ok(p) => decode_verified(cid, loc, &p),
                        Err(ReadError::Corrupt(r)) => Err(r),
                        Err(ReadError::Io(e)) => Err(format!("cannot read pack: {e}")),
                    };
                    match res {
                        Ok(raw) => {
                            bytes.fetch_add(raw.len() as u64, Ordering::Relaxed);
                        }
                        Err(reason) => bad.lock().unwrap().push(BadChunk {
                            id: *cid,
                            pack: Some(packs.path(loc.pack)),
                            offset: loc.offset,
                            reason,
                            users: Vec::new(),
                        }),
                    }
                });
            }
        });
        report.chunks_checked = index.len() as u64;
        report.bytes_checked = bytes.into_inner();
        let mut bad = bad.into_inner().unwrap();
        bad.sort_by_key(|b| b.id);
        bad
    }

    /// Checks snapshots, manifests, refcounts, tags and links. Returns, per
    /// referenced manifest, its chunk set and its (snapshot, file) users.
    #[allow(clippy::type_complexity)]
    fn check_metadata(
        &self,
        index: &[(ChunkId, ChunkLocation)],
        report: &mut VerifyReport,
        bad: &mut Vec<BadChunk>,
    ) -> Result<BTreeMap<ManifestId, (HashSet<ChunkId>, Vec<(SnapshotId, String)>)>> {
        let db = self.view.db();
        let mut users: BTreeMap<ManifestId, Vec<(SnapshotId, String)>> = BTreeMap::new();
        let mut snapshot_ids = HashSet::new();
        let mut parents = Vec::new();
        for kv in db.scan(CF_SNAPSHOTS) {
            let (k, v) = kv?;
            let rec = match decode_snapshot(&k, &v) {
                Ok(r) => r,
                Err(e) => {
                    report.problems.push(e.to_string());
                    continue;
                }
            };
            snapshot_ids.insert(rec.id);
            if let Some(p) = rec.parent {
                parents.push((p, rec.id));
            }
            for (name, f) in &rec.files {
                users
                    .entry(f.manifest)
                    .or_default()
                    .push((rec.id, name.clone()));
            }
            report.snapshots_checked += 1;
        }
        let indexed: HashSet<ChunkId> = index.iter().map(|(c, _)| *c).collect();
        let remote = crate::remote::remote_set(&self.view)?;
        let mut expected: HashMap<Vec<u8>, u64> = HashMap::new();
        let mut out = BTreeMap::new();
        for (mid, u) in users {
            expected.insert(crate::db::manifest_ref_key(&mid).to_vec(), u.len() as u64);
            let m = match self.view.manifest(&mid) {
                Ok(m) => m,
                Err(e) => {
                    report.problems.push(format!("{e} (used by {u:?})"));
                    continue;
                }
            };
            for c in m.distinct_chunks() {
                *expected
                    .entry(crate::db::chunk_ref_key(c).to_vec())
                    .or_default() += 1;
                if !indexed.contains(c) && remote.contains_key(c) {
                    continue;
                }
                if !indexed.contains(c)
                    && db.chunk_location(c)?.is_none()
                    && !bad.iter().any(|b| b.id == *c)
                {
                    bad.push(BadChunk {
                        id: *c,
                        pack: None,
                        offset: 0,
                        reason: "referenced but missing from the chunk index".into(),
                        users: Vec::new(),
                    });
                }
            }
            out.insert(
                mid,
                (
                    m.distinct_chunks().iter().copied().collect::<HashSet<_>>(),
                    u,
                ),
            );
        }
        report.remote_chunks = out
            .values()
            .flat_map(|(chunks, _)| chunks.iter())
            .filter(|c| !indexed.contains(*c) && remote.contains_key(*c))
            .collect::<HashSet<_>>()
            .len() as u64;
        for kv in db.scan(CF_REFS) {
            let (k, v) = kv?;
            let got = decode_count(&v);
            let want = expected.remove(&k[..]).unwrap_or(0);
            if got != want {
                report.problems.push(format!(
                    "refcount of {} is {got}, expected {want}",
                    ref_name(&k)
                ));
            }
        }
        for (k, want) in expected {
            report.problems.push(format!(
                "refcount of {} is missing, expected {want}",
                ref_name(&k)
            ));
        }
        for (p, c) in parents {
            if !snapshot_ids.contains(&p) {
                report
                    .problems
                    .push(format!("snapshot {c} names missing parent {p}"));
            }
            if db
                .get(CF_CHILDREN, &crate::db::child_key(&p, &c))?
                .is_none()
            {
                report
                    .problems
                    .push(format!("parent link {p} -> {c} is missing"));
            }
        }
        for kv in db.scan(CF_TAGS) {
            let (k, v) = kv?;
            let ok = SnapshotId::from_slice(&v).is_some_and(|id| snapshot_ids.contains(&id));
            if !ok {
                report.problems.push(format!(
                    "tag '{}' points at a missing snapshot",
                    String::from_utf8_lossy(&k)
                ));
            }
        }
        Ok(out)
    }
}

fn ref_name(k: &[u8]) -> String {
    let kind = match k.first() {
        Some(b'c') => "chunk",
        Some(b'm') => "manifest",
        _ => "?",
    };
    format!("{kind} {}", hex::encode(k.get(1..).unwrap_or_default()))
}
