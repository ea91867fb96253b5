//! Content-addressed layer store. See docs/layers.md for the data
//! model and the on-disk format, and docs/design.md, "Crates", for its place.
//!
//! Files (guest memory, device state, disk images) are cut into fixed-size
//! chunks named by blake3, stored zstd-compressed in append-only pack files
//! and indexed in RocksDB. A snapshot names one flattened manifest per file,
//! so a read at any offset is O(1) whatever the snapshot chain depth, and a
//! child snapshot shares every unchanged chunk with its parent.
//!
//! - [`Store`]: the one read-write handle (ingest, commit, tags, delete, GC,
//!   verify).
//! - [`StoreReader`]: a read-only secondary view for other processes.
//! - Both dereference to [`StoreView`], the shared read API
//!   (`snapshot`, `resolve`, `list_snapshots`, `open_file`, ...).
//!
//! Invariants:
//! - a chunk is indexed only after its pack bytes are fdatasync'd;
//! - a manifest is stored only in the batch that indexes its new chunks, so
//!   every chunk it names is durable;
//! - a snapshot commits record, tag and refcounts in one synced batch;
//! - a live pack record is never overwritten in place; GC removes whole packs
//!   and cuts only garbage off the end of the active pack;
//! - a lazy snapshot (committed before its chunks arrived, see `remote`)
//!   names only chunks that are indexed or have a remote location; a read of
//!   a remote chunk goes through the view's [`Fetcher`], never returns
//!   unverified bytes, and the snapshot stays marked lazy until every chunk
//!   is indexed.

#![warn(missing_docs)]

mod annotation;
mod cache;
mod chunk;
mod db;
mod error;
mod gc;
mod ids;
mod ingest;
mod manifest;
mod pack;
mod reader;
mod remote;
mod secondary;
mod snapshot;
mod stats;
mod store;
pub mod synth;
mod tag;
mod transfer;
mod verify;
mod view;
pub mod workingset;

pub use annotation::MAX_ANNOTATION_BYTES;
pub use cache::{CacheStats, ChunkData};
pub use chunk::{
    validate_chunk_size, ChunkLocation, Compression, DEFAULT_CHUNK_SIZE, DEFAULT_ZSTD_LEVEL,
    MAX_CHUNK_SIZE, MIN_CHUNK_SIZE,
};
pub use db::FORMAT_VERSION;
pub use error::{Error, Result};
pub use gc::GcReport;
pub use ids::{ChunkId, ManifestId, ObjectId, SnapshotId};
pub use ingest::{FileSource, IngestOptions, IngestSource, IngestedFile, ProgressFn};
pub use manifest::{ChunkRef, FileManifest};
pub use reader::FileReader;
pub use remote::{Fetcher, RemoteChunk, RemoteSource, Residency};
pub use secondary::{StoreReader, DEFAULT_READER_CACHE_BYTES};
pub use snapshot::{FileRef, NewSnapshot, SnapshotRecord};
pub use stats::{DiffReport, FileDiff, FileStatus, Stats};
pub use store::{db_dir, packs_dir, DeleteReport, Store, StoreOptions};
// The RocksDB that the `rocksdb` crate links is built by this crate
// (layers/rocksdb-unity); naming it keeps it in every link.
use forkd_rocksdb_unity as _;

pub use tag::{is_valid_file_name, validate_tag, TagError, MAX_TAG_LEN};
pub use transfer::{
    decode_manifest, decode_record, ChunkImport, StoredChunk, VerifiedChunk, MAX_MANIFEST_BYTES,
    MAX_MANIFEST_SLOTS, MAX_RECORD_BYTES, MAX_RECORD_FILES,
};
pub use verify::{BadChunk, ChunkUser, VerifyReport};
pub use view::StoreView;
pub use workingset::WorkingSet;

#[cfg(test)]
mod tests {
    fn send_sync<T: Send + Sync>() {}

    /// The FUSE filesystem shares these across threads.
    #[test]
    fn handles_are_send_and_sync() {
        send_sync::<crate::Store>();
        send_sync::<crate::StoreReader>();
        send_sync::<crate::StoreView>();
        send_sync::<crate::FileReader>();
        send_sync::<crate::Error>();
    }
}
