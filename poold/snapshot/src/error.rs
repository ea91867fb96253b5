//! Why a snapshot cannot be read, restored or made: the errors the daemon
//! answers with a 4xx (see `daemon::error`, the one place they become HTTP).
//! Their messages are the CLI's too, so each says what to do next.
//!
//! Code that returns `anyhow::Result` keeps these typed inside the chain
//! (`Err(SnapshotError::..)?`, `.context(..)` on top is fine); callers find
//! them with `downcast_ref`, never by matching on the text.

use forkd_layers::SnapshotId;
use std::path::PathBuf;

/// A snapshot that cannot be used, or a request to make one that cannot be
/// honoured.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// No snapshot has this tag or id.
    #[error("no snapshot {tag:?} (see `forkd snapshot ls`)")]
    NotFound {
        /// The tag or id asked for.
        tag: String,
    },
    /// The snapshot's record exists but cannot be read.
    #[error("reading {}", path.display())]
    Unreadable {
        /// The record (`snapshot.json`) on the mount.
        path: PathBuf,
        /// What reading it said.
        source: std::io::Error,
    },
    /// The snapshot's record is not valid JSON of a snapshot.
    #[error("parsing {}", path.display())]
    Corrupt {
        /// The record (`snapshot.json`) on the mount.
        path: PathBuf,
        /// What parsing it said.
        source: serde_json::Error,
    },
    /// This host cannot restore the snapshot (another QEMU, machine, CPU or
    /// accelerator; or no VM config at all). `reason` names both sides.
    #[error("{reason}")]
    Incompatible {
        /// The whole explanation, with what to do.
        reason: String,
    },
    /// The snapshot lacks a file a restore needs.
    #[error("snapshot {id} has no {file}; it cannot be restored")]
    MissingFile {
        /// The snapshot.
        id: SnapshotId,
        /// `memory.bin`, `vmstate` or `rootfs.img`.
        file: &'static str,
    },
    /// A file of the snapshot is not readable on the mount.
    #[error("snapshot {id} file {file} is not readable at {}", path.display())]
    FileUnreadable {
        /// The snapshot.
        id: SnapshotId,
        /// `memory.bin`, `vmstate` or `rootfs.img`.
        file: &'static str,
        /// Where it should be.
        path: PathBuf,
        /// What `stat` said.
        source: std::io::Error,
    },
    /// A create request asks for something no VM can be (memory, vCPUs).
    #[error("{0}")]
    BadSpec(String),
    /// The snapshot is lazy (pulled with `--lazy`, not all local yet) and
    /// its hub does not answer: a child could not fault its memory in.
    /// Temporary: it works again once the hub answers.
    #[error("{reason}")]
    RemoteUnavailable {
        /// The snapshot.
        id: SnapshotId,
        /// What forkd-fs said, naming the hub.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `{:#}` of an anyhow error holding these reads as the old
    /// `with_context` chains did: the CLI and the API print the same text.
    #[test]
    fn messages_keep_their_chain() {
        let e = anyhow::Error::from(SnapshotError::Unreadable {
            path: "/m/t/snapshot.json".into(),
            source: std::io::Error::from_raw_os_error(13),
        });
        assert_eq!(
            format!("{e:#}"),
            format!(
                "reading /m/t/snapshot.json: {}",
                std::io::Error::from_raw_os_error(13)
            )
        );
        let e = anyhow::Error::from(SnapshotError::NotFound { tag: "x".into() });
        assert_eq!(
            format!("{e:#}"),
            "no snapshot \"x\" (see `forkd snapshot ls`)"
        );
    }
}
