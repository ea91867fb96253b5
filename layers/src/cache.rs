//! A bounded-in-bytes LRU cache of decompressed, verified chunks, shared by
//! every [`crate::FileReader`] of a store handle.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lru::LruCache;

use crate::ids::{ChunkId, ManifestId};
use crate::manifest::FileManifest;

/// Decompressed chunk bytes, shared between the cache and readers.
pub type ChunkData = Arc<[u8]>;

pub(crate) struct ChunkCache {
    inner: Mutex<Inner>,
    capacity: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

struct Inner {
    lru: LruCache<ChunkId, ChunkData>,
    bytes: usize,
}

/// Cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Configured capacity in bytes.
    pub capacity_bytes: u64,
    /// Bytes currently held.
    pub bytes: u64,
    /// Chunks currently held.
    pub entries: u64,
    /// Lookups served from the cache.
    pub hits: u64,
    /// Lookups that had to read a pack.
    pub misses: u64,
}

impl ChunkCache {
    pub fn new(capacity: usize) -> ChunkCache {
        ChunkCache {
            inner: Mutex::new(Inner {
                lru: LruCache::unbounded(),
                bytes: 0,
            }),
            capacity,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub fn get(&self, id: &ChunkId) -> Option<ChunkData> {
        let got = self.inner.lock().unwrap().lru.get(id).cloned();
        let counter = if got.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        got
    }

    /// Inserts, evicting least-recently-used chunks to stay within capacity.
    /// A chunk larger than the whole cache is not kept.
    pub fn insert(&self, id: ChunkId, data: ChunkData) {
        if data.len() > self.capacity {
            return;
        }
        let mut g = self.inner.lock().unwrap();
        let len = data.len();
        if let Some(old) = g.lru.put(id, data) {
            g.bytes -= old.len();
        }
        g.bytes += len;
        while g.bytes > self.capacity {
            match g.lru.pop_lru() {
                Some((_, old)) => g.bytes -= old.len(),
                None => break,
            }
        }
    }

    pub fn clear(&self) {
        let mut g = self.inner.lock().unwrap();
        g.lru.clear();
        g.bytes = 0;
    }

    pub fn stats(&self) -> CacheStats {
        let g = self.inner.lock().unwrap();
        CacheStats {
            capacity_bytes: self.capacity as u64,
            bytes: g.bytes as u64,
            entries: g.lru.len() as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }
}

/// Decoded manifests, bounded in bytes (a 10 GiB disk image at 64 KiB
/// chunks decodes to ~5.8 MB). Manifests are immutable, so never stale.
pub(crate) struct ManifestCache {
    inner: Mutex<(LruCache<ManifestId, Arc<FileManifest>>, usize)>,
    capacity: usize,
}

impl ManifestCache {
    pub fn new(capacity: usize) -> ManifestCache {
        ManifestCache {
            inner: Mutex::new((LruCache::unbounded(), 0)),
            capacity,
        }
    }

    pub fn get(&self, id: &ManifestId) -> Option<Arc<FileManifest>> {
        self.inner.lock().unwrap().0.get(id).cloned()
    }

    /// Inserts, evicting least-recently-used manifests beyond capacity (the
    /// newest one is always kept).
    pub fn insert(&self, id: ManifestId, m: Arc<FileManifest>) {
        let mut g = self.inner.lock().unwrap();
        let (lru, bytes) = &mut *g;
        *bytes += m.memory_bytes();
        if let Some(old) = lru.put(id, m) {
            *bytes -= old.memory_bytes();
        }
        while *bytes > self.capacity && lru.len() > 1 {
            match lru.pop_lru() {
                Some((_, old)) => *bytes -= old.memory_bytes(),
                None => break,
            }
        }
    }

    pub fn remove(&self, id: &ManifestId) {
        let mut g = self.inner.lock().unwrap();
        if let Some(old) = g.0.pop(id) {
            g.1 -= old.memory_bytes();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_by_bytes() {
        let c = ChunkCache::new(10);
        for i in 0..5u8 {
            c.insert(ChunkId([i; 32]), Arc::from(vec![i; 4]));
        }
        let s = c.stats();
        assert!(s.bytes <= 10 && s.entries == 2, "{s:?}");
        assert!(c.get(&ChunkId([4; 32])).is_some());
        assert!(c.get(&ChunkId([0; 32])).is_none());
        c.insert(ChunkId([9; 32]), Arc::from(vec![0u8; 11]));
        assert!(c.get(&ChunkId([9; 32])).is_none());
    }
}
