//! The read API shared by the read-write [`crate::Store`] and the read-only
//! secondary [`crate::StoreReader`]: both dereference to a [`StoreView`].

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::cache::{CacheStats, ChunkCache, ChunkData, ManifestCache};
use crate::chunk::{decode_verified, ChunkLocation};
use crate::db::{self, Db, CF_CHILDREN, CF_MANIFESTS, CF_SNAPSHOTS, CF_TAGS};
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ManifestId, SnapshotId};
use crate::manifest::FileManifest;
use crate::pack::{Packs, ReadError};
use crate::reader::FileReader;
use crate::snapshot::SnapshotRecord;

/// Bytes of decoded manifests kept in memory.
const MANIFEST_CACHE_BYTES: usize = 64 << 20;

/// A cheap, clonable handle on a store's read side. Send + Sync; clones
/// share the RocksDB handle, pack fds and the decompressed-chunk cache.
#[derive(Clone)]
pub struct StoreView {
    pub(crate) inner: Arc<ViewInner>,
}

pub(crate) struct ViewInner {
    pub root: PathBuf,
    pub db: Db,
    pub packs: Packs,
    pub cache: ChunkCache,
    manifests: ManifestCache,
    /// Reads chunks the store lacks (lazy snapshots), when installed.
    pub fetcher: OnceLock<Arc<dyn crate::remote::Fetcher>>,
}

impl StoreView {
    pub(crate) fn new(root: &Path, db: Db, packs: Packs, cache_bytes: usize) -> StoreView {
        StoreView {
            inner: Arc::new(ViewInner {
                root: root.to_path_buf(),
                db,
                packs,
                cache: ChunkCache::new(cache_bytes),
                manifests: ManifestCache::new(MANIFEST_CACHE_BYTES),
                fetcher: OnceLock::new(),
            }),
        }
    }

    pub(crate) fn db(&self) -> &Db {
        &self.inner.db
    }

    pub(crate) fn packs(&self) -> &Packs {
        &self.inner.packs
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// True for a read-only secondary view.
    pub fn is_secondary(&self) -> bool {
        self.inner.db.is_secondary()
    }

    /// Secondary: replays what the primary committed since the last catch-up
    /// (new snapshots, tags, moved chunks). A no-op on the primary.
    pub fn catch_up(&self) -> Result<()> {
        self.inner.db.catch_up()
    }

    /// A snapshot by id.
    pub fn snapshot(&self, id: &SnapshotId) -> Result<Option<SnapshotRecord>> {
        self.inner.db.snapshot(id)
    }

    /// A snapshot by tag or by exact id (32 hex digits). A tag wins over an
    /// id spelled the same: a tag that looks like an id must still name its
    /// own snapshot.
    pub fn resolve(&self, tag_or_id: &str) -> Result<Option<SnapshotRecord>> {
        // A tag wins: a tag may look like an id (32 hex digits), never the
        // other way round.
        if let Some(id) = self.tag(tag_or_id)? {
            return self.snapshot(&id);
        }
        match tag_or_id.parse::<SnapshotId>() {
            Ok(id) => self.snapshot(&id),
            Err(_) => Ok(None),
        }
    }

    /// The snapshot a tag points at.
    pub fn tag(&self, tag: &str) -> Result<Option<SnapshotId>> {
        Ok(self
            .inner
            .db
            .get(CF_TAGS, tag.as_bytes())?
            .and_then(|v| SnapshotId::from_slice(&v)))
    }

    /// Every snapshot, oldest first (by `created_at_unix` in seconds, then id).
    pub fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>> {
        let mut out = Vec::new();
        for kv in self.inner.db.scan(CF_SNAPSHOTS) {
            let (k, v) = kv?;
            out.push(db::decode_snapshot(&k, &v)?);
        }
        out.sort_by_key(|r| (r.created_at_unix, r.id));
        Ok(out)
    }

    /// Every tag with the snapshot it points at, sorted by tag.
    pub fn tags(&self) -> Result<Vec<(String, SnapshotId)>> {
        let mut out = Vec::new();
        for kv in self.inner.db.scan(CF_TAGS) {
            let (k, v) = kv?;
            if let (Ok(tag), Some(id)) = (std::str::from_utf8(&k), SnapshotId::from_slice(&v)) {
                out.push((tag.to_string(), id));
            }
        }
        Ok(out)
    }

    /// Tags pointing at `id`.
    pub fn tags_of(&self, id: &SnapshotId) -> Result<Vec<String>> {
        Ok(self
            .tags()?
            .into_iter()
            .filter(|(_, t)| t == id)
            .map(|(n, _)| n)
            .collect())
    }

    /// Snapshots whose parent is `id`.
    pub fn dependents(&self, id: &SnapshotId) -> Result<Vec<SnapshotId>> {
        let mut out = Vec::new();
        for kv in self.inner.db.scan_prefix(CF_CHILDREN, id.as_bytes()) {
            let (k, _) = kv?;
            out.extend(SnapshotId::from_slice(&k[16..]));
        }
        Ok(out)
    }

    /// The parent chain of `id`, root first, ending with its parent (empty for
    /// a root snapshot). Fails if `id` does not exist.
    pub fn ancestors(&self, id: &SnapshotId) -> Result<Vec<SnapshotId>> {
        let rec = self.snapshot(id)?.ok_or(Error::NoSuchSnapshot(*id))?;
        let mut chain = Vec::new();
        let mut next = rec.parent;
        while let Some(p) = next {
            if chain.contains(&p) || chain.len() > 1_000_000 {
                return Err(Error::CorruptRecord {
                    what: "snapshot",
                    key: p.to_string(),
                    reason: "parent chain loops".into(),
                });
            }
            chain.push(p);
            next = self.snapshot(&p)?.ok_or(Error::NoSuchSnapshot(p))?.parent;
        }
        chain.reverse();
        Ok(chain)
    }

    /// A manifest by id (decoded once, then cached).
    pub fn manifest(&self, id: &ManifestId) -> Result<Arc<FileManifest>> {
        if let Some(m) = self.inner.manifests.get(id) {
            return Ok(m);
        }
        let bytes = self
            .inner
            .db
            .get(CF_MANIFESTS, id.as_bytes())?
            .ok_or(Error::MissingManifest(*id))?;
        let m = FileManifest::decode(&bytes).map_err(|reason| Error::CorruptRecord {
            what: "manifest",
            key: id.to_string(),
            reason,
        })?;
        if &m.id() != id {
            return Err(Error::CorruptRecord {
                what: "manifest",
                key: id.to_string(),
                reason: "content does not hash to its id".into(),
            });
        }
        let m = Arc::new(m);
        self.inner.manifests.insert(*id, m.clone());
        Ok(m)
    }

    pub(crate) fn forget_manifest(&self, id: &ManifestId) {
        self.inner.manifests.remove(id);
    }

    /// True if the store has this manifest.
    pub fn has_manifest(&self, id: &ManifestId) -> Result<bool> {
        Ok(self.inner.db.get(CF_MANIFESTS, id.as_bytes())?.is_some())
    }

    /// Opens one file of a snapshot for random-access reads.
    pub fn open_file(&self, snapshot: &SnapshotId, name: &str) -> Result<FileReader> {
        let rec = self
            .snapshot(snapshot)?
            .ok_or(Error::NoSuchSnapshot(*snapshot))?;
        let fref = rec.files.get(name).ok_or_else(|| Error::NoSuchFile {
            snapshot: *snapshot,
            name: name.to_string(),
            available: rec.files.keys().cloned().collect::<Vec<_>>().join(", "),
        })?;
        let manifest = self.manifest(&fref.manifest)?;
        Ok(FileReader::new(self.clone(), *snapshot, name, manifest))
    }

    /// Where a chunk is stored, if it is in the index.
    pub fn chunk_location(&self, id: &ChunkId) -> Result<Option<ChunkLocation>> {
        self.inner.db.chunk_location(id)
    }

    /// A chunk's uncompressed bytes, verified against its id before they are
    /// returned (and before they enter the cache).
    ///
    /// If the chunk or its pack is missing or does not check out (GC may have
    /// moved it), a secondary catches up with the primary and retries once;
    /// the primary just retries once. A chunk the index lacks that has a
    /// remote location (a lazy snapshot) is fetched through the installed
    /// [`crate::Fetcher`] instead, without a catch-up.
    pub fn chunk(&self, id: &ChunkId) -> Result<ChunkData> {
        if let Some(d) = self.inner.cache.get(id) {
            return Ok(d);
        }
        let data: ChunkData = match self.load_chunk(id) {
            Ok(d) => d,
            Err(Error::MissingChunk { .. }) if self.inner.fetcher.get().is_some() => {
                match self.fetch_remote(id)? {
                    Some(d) => {
                        self.inner.cache.insert(*id, d.clone());
                        return Ok(d);
                    }
                    None => {
                        self.catch_up()?;
                        self.load_chunk(id)?
                    }
                }
            }
            // GC may have moved the chunk: a secondary's index or pack fd can
            // be stale. Learn the new location and retry once; real damage
            // fails again and is reported.
            Err(Error::MissingChunk { .. } | Error::CorruptChunk { .. }) => {
                self.catch_up()?;
                self.load_chunk(id)?
            }
            Err(e) => return Err(e),
        }
        .into();
        self.inner.cache.insert(*id, data.clone());
        Ok(data)
    }

    fn load_chunk(&self, id: &ChunkId) -> Result<Vec<u8>> {
        let loc = self
            .chunk_location(id)?
            .ok_or_else(|| Error::MissingChunk {
                id: *id,
                reason: "not in the chunk index".into(),
            })?;
        let path = self.inner.packs.path(loc.pack);
        let corrupt = |reason: String| {
            // Drop a possibly stale fd so a retry reopens the pack by name.
            self.inner.packs.forget(loc.pack);
            Error::CorruptChunk {
                id: *id,
                pack: path.clone(),
                offset: loc.offset,
                reason,
            }
        };
        let payload = match self.inner.packs.read_payload(id, &loc) {
            Ok(p) => p,
            Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
                self.inner.packs.forget(loc.pack);
                return Err(Error::MissingChunk {
                    id: *id,
                    reason: format!("pack {} is gone", path.display()),
                });
            }
            Err(ReadError::Io(e)) => return Err(Error::io(&path, e)),
            Err(ReadError::Corrupt(reason)) => return Err(corrupt(reason)),
        };
        decode_verified(id, &loc, &payload).map_err(corrupt)
    }

    /// Decompressed-chunk cache counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.inner.cache.stats()
    }

    /// Empties the decompressed-chunk cache (benchmarks; memory pressure).
    pub fn drop_cache(&self) {
        self.inner.cache.clear();
    }
}
