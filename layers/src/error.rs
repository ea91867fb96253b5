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
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The disk is full. Nothing that references partial data was committed.
    #[error("no space left on device while writing {path}; nothing was committed — free some space (or run `forkd store gc`) and retry")]
    NoSpace { path: PathBuf },

    /// RocksDB reported an error.
    #[error("RocksDB error in {context}: {message}")]
    Db { context: String, message: String },

    /// Another process holds the store's RocksDB lock.
    #[error("the store is locked: another forkd process holds {lock_path} (waited {waited_ms} ms); stop that process or use a read-only secondary view")]
    Locked { lock_path: PathBuf, waited_ms: u64 },

    /// The store on disk was written by an incompatible version.
    #[error("store at {root} has format version {found}, this build understands version {expected}; use a matching forkd version")]
    FormatVersion {
        root: PathBuf,
        found: u32,
        expected: u32,
    },

    /// No store exists at the given root (for read-only opens).
    #[error("no layer store at {root}: {reason}")]
    NotAStore { root: PathBuf, reason: String },

    /// A chunk's bytes do not hash to its id, or its pack record is malformed.
    #[error("chunk {id} in {pack} at offset {offset} is corrupt ({reason}); it was not served — run `forkd store verify` to list the snapshots that use it")]
    CorruptChunk {
        id: ChunkId,
        pack: PathBuf,
        offset: u64,
        reason: String,
    },

    /// A chunk a manifest names is not in the index or its pack is gone.
    #[error("chunk {id} is missing from the store ({reason}); run `forkd store verify` to list the snapshots that use it")]
    MissingChunk { id: ChunkId, reason: String },

    /// A read through a [`crate::FileReader`] failed; wraps the chunk error with
    /// the file name and file offset the caller asked for.
    #[error("reading {file} of snapshot {snapshot} at offset {file_offset}: {source}")]
    FileRead {
        snapshot: SnapshotId,
        file: String,
        file_offset: u64,
        #[source]
        source: Box<Error>,
    },

    /// A manifest id is not in the store.
    #[error("manifest {0} is not in the store; ingest the file again")]
    MissingManifest(ManifestId),

    /// Stored bytes could not be decoded (manifest, snapshot record, index entry).
    #[error("corrupt {what} record {key}: {reason}")]
    CorruptRecord {
        what: &'static str,
        key: String,
        reason: String,
    },

    /// No snapshot with this id.
    #[error("snapshot {0} does not exist")]
    NoSuchSnapshot(SnapshotId),

    /// The snapshot has no file with that name.
    #[error("snapshot {snapshot} has no file '{name}' (it has: {available})")]
    NoSuchFile {
        snapshot: SnapshotId,
        name: String,
        available: String,
    },

    /// A tag already points at a snapshot.
    #[error("tag '{tag}' already points at snapshot {existing}; untag it first or use the force variant")]
    TagExists { tag: String, existing: SnapshotId },

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
        id: SnapshotId,
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
