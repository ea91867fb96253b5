//! The one error type of the layer store.
//!
//! Every variant says what was wrong and, where there is one, what to do about
//! it: these messages reach users of the CLI and the REST API verbatim.

use std::path::PathBuf;

use crate::ids::{ChunkId, ManifestId, SnapshotId};
use crate::tag::TagError;

/// Result alias for the layer store.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the layer store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A filesystem call failed; `path` names the file involved.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory the call was on.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },

    /// The disk is full. Nothing that references partial data was committed.
    #[error("no space left on device while writing {path}; nothing was committed — free some space (or run `forkd store gc`) and retry")]
    NoSpace {
        /// The file being written when the disk filled.
        path: PathBuf,
    },

    /// RocksDB reported an error.
    #[error("RocksDB error in {context}: {message}")]
    Db {
        /// What the store was doing (e.g. `opening <path>`).
        context: String,
        /// RocksDB's own message.
        message: String,
    },

    /// Another process holds the store's RocksDB lock.
    #[error("the store is locked: another forkd process holds {lock_path} (waited {waited_ms} ms); stop that process or use a read-only secondary view")]
    Locked {
        /// The RocksDB `LOCK` file held by the other process.
        lock_path: PathBuf,
        /// How long the open waited for the lock before giving up, ms.
        waited_ms: u64,
    },

    /// Writers kept changing the store's files while a read-only view
    /// opened, so no whole view could be had (see `db.rs`).
    #[error("the store at {root} kept changing while a read-only view of it was opened (tried for {waited_ms} ms); retry when its writers are quieter")]
    Busy {
        /// The store's RocksDB directory.
        root: PathBuf,
        /// How long the open kept trying, ms.
        waited_ms: u64,
    },

    /// The store on disk was written by an incompatible version.
    #[error("store at {root} has format version {found}, this build understands version {expected}; use a matching forkd version")]
    FormatVersion {
        /// The store's root directory.
        root: PathBuf,
        /// Format version recorded in the store.
        found: u32,
        /// Format version this build reads and writes.
        expected: u32,
    },

    /// No store exists at the given root (for read-only opens).
    #[error("no layer store at {root}: {reason}")]
    NotAStore {
        /// Where a store was looked for.
        root: PathBuf,
        /// Why it is not one (e.g. no database there).
        reason: String,
    },

    /// A chunk's bytes do not hash to its id, or its pack record is malformed.
    #[error("chunk {id} in {pack} at offset {offset} is corrupt ({reason}); it was not served — run `forkd store verify` to list the snapshots that use it")]
    CorruptChunk {
        /// The chunk's id (blake3 of its uncompressed bytes).
        id: ChunkId,
        /// The pack file holding its record.
        pack: PathBuf,
        /// Byte offset of the record in that pack.
        offset: u64,
        /// What check failed.
        reason: String,
    },

    /// A chunk a manifest names is not in the index or its pack is gone.
    #[error("chunk {id} is missing from the store ({reason}); run `forkd store verify` to list the snapshots that use it")]
    MissingChunk {
        /// The chunk's id.
        id: ChunkId,
        /// Whether the index lacks it or its pack file is gone.
        reason: String,
    },

    /// A read through a [`crate::FileReader`] failed; wraps the chunk error with
    /// the file name and file offset the caller asked for.
    #[error("reading {file} of snapshot {snapshot} at offset {file_offset}: {source}")]
    FileRead {
        /// The snapshot the file belongs to.
        snapshot: SnapshotId,
        /// The file's name in the snapshot (e.g. `memory.bin`).
        file: String,
        /// Offset in the file the failed read started at.
        file_offset: u64,
        /// The chunk error underneath.
        #[source]
        source: Box<Error>,
    },

    /// A chunk of a lazy snapshot could not be fetched from its hub (after
    /// retries, or because what the hub sent failed verification).
    #[error(
        "chunk {id} is not in the local store and fetching it from {source_url} failed: {reason}"
    )]
    RemoteFetch {
        /// The chunk.
        id: ChunkId,
        /// The hub it is located on.
        source_url: String,
        /// What went wrong, and for how long it was tried.
        reason: String,
    },

    /// A manifest id is not in the store.
    #[error("manifest {0} is not in the store; ingest the file again")]
    MissingManifest(ManifestId),

    /// Stored bytes could not be decoded (manifest, snapshot record, index entry).
    #[error("corrupt {what} record {key}: {reason}")]
    CorruptRecord {
        /// Kind of record: manifest, snapshot record, index entry, ...
        what: &'static str,
        /// Its key, printable.
        key: String,
        /// Why it could not be decoded.
        reason: String,
    },

    /// No snapshot with this id.
    #[error("snapshot {0} does not exist")]
    NoSuchSnapshot(SnapshotId),

    /// The snapshot has no file with that name.
    #[error("snapshot {snapshot} has no file '{name}' (it has: {available})")]
    NoSuchFile {
        /// The snapshot asked.
        snapshot: SnapshotId,
        /// The file name asked for.
        name: String,
        /// The names it does have, comma-separated.
        available: String,
    },

    /// A tag already points at a snapshot.
    #[error("tag '{tag}' already points at snapshot {existing}; untag it first or use the force variant")]
    TagExists {
        /// The tag asked for.
        tag: String,
        /// The snapshot it already names.
        existing: SnapshotId,
    },

    /// No such tag.
    #[error("tag '{0}' does not exist")]
    NoSuchTag(String),

    /// Invalid tag (see [`crate::validate_tag`]).
    #[error(transparent)]
    InvalidTag(#[from] TagError),

    /// Invalid file name in a snapshot.
    #[error("invalid file name '{0}': 1-64 chars, ASCII alnum or '.', '_', '-', not starting with '.' or '-'")]
    InvalidFileName(String),

    /// A snapshot cannot be deleted while other snapshots name it as parent.
    #[error("snapshot {id} has dependent snapshots ({}); delete them first", .children.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", "))]
    HasDependents {
        /// The snapshot asked to delete.
        id: SnapshotId,
        /// Snapshots naming it as parent.
        children: Vec<SnapshotId>,
    },

    /// A caller-supplied argument is out of range or inconsistent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// Wraps an I/O error with the path it happened on; ENOSPC becomes
    /// [`Error::NoSpace`] so callers can tell a full disk apart.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        let path = path.into();
        if source.raw_os_error() == Some(libc::ENOSPC) {
            Error::NoSpace { path }
        } else {
            Error::Io { path, source }
        }
    }

    /// Wraps a RocksDB error with what the store was doing.
    pub(crate) fn db(context: impl Into<String>, e: rocksdb::Error) -> Error {
        let message = e.into_string();
        let context = context.into();
        if message.contains("No space left on device") {
            return Error::NoSpace {
                path: PathBuf::from(format!("RocksDB ({context})")),
            };
        }
        Error::Db { context, message }
    }

    /// True if this error (or the error it wraps) is a full disk.
    pub fn is_no_space(&self) -> bool {
        match self {
            Error::NoSpace { .. } => true,
            Error::FileRead { source, .. } => source.is_no_space(),
            _ => false,
        }
    }
}
