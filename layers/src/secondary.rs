//! Read-only secondary views for other processes (the FUSE filesystem).
//!
//! RocksDB allows one read-write opener; a secondary instance reads the same
//! files, keeps its own info log in `secondary_dir`, and sees new writes only
//! after [`StoreView::catch_up`]. Chunk reads that find a chunk or pack gone
//! (GC moved it) catch up and retry once on their own.

use std::ops::Deref;
use std::path::Path;

use crate::db::Db;
use crate::error::{Error, Result};
use crate::pack::Packs;
use crate::store::{db_dir, packs_dir};
use crate::view::StoreView;

/// Default decompressed-chunk cache of a secondary view.
pub const DEFAULT_READER_CACHE_BYTES: usize = 256 << 20;

/// A read-only view of a store another process writes. Dereferences to
/// [`StoreView`] for the read API.
pub struct StoreReader {
    view: StoreView,
}

impl Deref for StoreReader {
    type Target = StoreView;
    fn deref(&self) -> &StoreView {
        &self.view
    }
}

impl StoreReader {
    /// Opens a secondary view of the store at `root`. `secondary_dir` must
    /// be private to this process (e.g. `/run/forkd-fs/secondary`).
    pub fn open_secondary(root: &Path, secondary_dir: &Path) -> Result<StoreReader> {
        Self::open_secondary_with_cache(root, secondary_dir, DEFAULT_READER_CACHE_BYTES)
    }

    /// Like [`StoreReader::open_secondary`] with a cache size in bytes.
    pub fn open_secondary_with_cache(
        root: &Path,
        secondary_dir: &Path,
        cache_bytes: usize,
    ) -> Result<StoreReader> {
        if !root.is_dir() {
            return Err(Error::NotAStore {
                root: root.to_path_buf(),
                reason: "directory does not exist".into(),
            });
        }
        let db = Db::open_secondary(&db_dir(root), secondary_dir)?;
        let packs = Packs::open(&packs_dir(root), u64::MAX, false, 0)?;
        Ok(StoreReader {
            view: StoreView::new(root, db, packs, cache_bytes),
        })
    }

    /// A clonable read handle.
    pub fn view(&self) -> StoreView {
        self.view.clone()
    }
}
