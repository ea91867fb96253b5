//! The node's one error type: what went wrong in domain terms, never as a
//! wire status (docs/design.md, "Errors").
//!
//! Every operation of [`crate::Node`] fails with an [`Error`]; each
//! front-end has one function that turns it into its wire error
//! (`forkd_rest::error::answer`, `forkd_e2b::error::from_node`), tested as
//! a table there. The messages are the ones poold has always sent, so a
//! front-end passes `to_string()` on unless its protocol words it
//! otherwise.
//!
//! Errors from the crates below are typed where they arise
//! (`forkd_snapshot::SnapshotError`, `images::ImageError`,
//! `delete::DeleteError`, the agent's `CallError`) and classified here by
//! type, found anywhere in an `anyhow` chain ([`Error::from_anyhow`]),
//! never by their text: an error that is none of them is
//! [`Error::Internal`] with its whole context chain.

use forkd_snapshot::delete::DeleteError;
use forkd_snapshot::images::ImageError;
use forkd_snapshot::SnapshotError;
pub use rootfs_init::protocol::{AgentError, ErrorKind as GuestErrorKind};

/// The result of a node operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a [`Error::NotFound`] did not find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A live sandbox, by id.
    Sandbox,
    /// A snapshot, by tag (or id).
    Snapshot,
    /// A workspace, by name.
    Workspace,
}

impl Kind {
    /// The word messages use.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Sandbox => "sandbox",
            Kind::Snapshot => "snapshot",
            Kind::Workspace => "workspace",
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a node operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No such sandbox, snapshot or workspace.
    #[error("{kind} {id:?} not found")]
    NotFound {
        /// What was looked for.
        kind: Kind,
        /// Its id, tag or name as asked for.
        id: String,
    },
    /// A field of the request is invalid; `reason` says what to send instead.
    #[error("{reason}")]
    Invalid {
        /// The request field at fault (`n`, `ttl_secs`, `path`, ...).
        field: &'static str,
        /// What is wrong and what to do (the whole message).
        reason: String,
    },
    /// The request collides with what exists: a tag taken or being
    /// written, a workspace busy, dependents in the way.
    #[error("{0}")]
    Conflict(String),
    /// The operation does not apply in the current state of what it names
    /// (a workspace that is not running); the message says what to do.
    #[error("{0}")]
    WrongState(String),
    /// A limit of this node is reached (`max_sandboxes`, a concurrency
    /// cap); nothing started. Retry later, or on another node.
    #[error("{0}")]
    AtCapacity(String),
    /// The host is under a memory or disk floor (`min_free_*`, the
    /// admission module), or a lazy snapshot's hub does not answer;
    /// nothing started.
    #[error("{0}")]
    Unavailable(String),
    /// A snapshot exists but cannot be restored or used on this host
    /// (another QEMU, an unreadable record, a missing file).
    #[error("{0}")]
    Incompatible(String),
    /// An answer would exceed the bound of one request.
    #[error("{what} is {size} bytes, over the {limit}-byte limit of one request")]
    TooLarge {
        /// What is too large (a guest path).
        what: String,
        /// Its size.
        size: u64,
        /// The bound.
        limit: u64,
    },
    /// The guest agent refused or failed the request; `kind` tells a
    /// missing file from a permission problem. The message is the
    /// agent's (`kind: message`).
    #[error("{0}")]
    Guest(AgentError),
    /// The guest agent did not answer in time.
    #[error("{0}")]
    GuestTimeout(String),
    /// The guest agent cannot be reached: its channel closed (the VM died
    /// or is being destroyed).
    #[error("{0}")]
    GuestUnreachable(String),
    /// Anything else: a host failure or a bug, with its whole context chain.
    #[error("{0:#}")]
    Internal(anyhow::Error),
}

impl Error {
    /// [`Error::NotFound`].
    pub fn not_found(kind: Kind, id: impl Into<String>) -> Error {
        Error::NotFound {
            kind,
            id: id.into(),
        }
    }

    /// [`Error::Invalid`].
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
        Error::Invalid {
            field,
            reason: reason.into(),
        }
    }

    /// [`Error::Internal`] from a message.
    pub fn internal(message: impl std::fmt::Display) -> Error {
        Error::Internal(anyhow::anyhow!("{message}"))
    }

    /// Classifies a failed operation by the outermost domain error in its
    /// chain (by type); anything else is [`Error::Internal`]. The message
    /// is the whole context chain, except where poold has its own words (a
    /// missing snapshot, a refused delete).
    pub fn from_anyhow(e: anyhow::Error) -> Error {
        for c in e.chain() {
            if let Some(s) = c.downcast_ref::<SnapshotError>() {
                return match s {
                    SnapshotError::NotFound { tag } => Error::not_found(Kind::Snapshot, tag),
                    SnapshotError::BadSpec(_) => Error::invalid("spec", format!("{e:#}")),
                    // Exists, but cannot be restored here: its record
                    // unreadable, another QEMU, a file missing.
                    SnapshotError::Unreadable { .. }
                    | SnapshotError::Corrupt { .. }
                    | SnapshotError::Incompatible { .. }
                    | SnapshotError::MissingFile { .. }
                    | SnapshotError::FileUnreadable { .. } => Error::Incompatible(format!("{e:#}")),
                    // A lazy snapshot whose hub does not answer: retry
                    // when it does (its children would stall on faults).
                    SnapshotError::RemoteUnavailable { .. } => Error::Unavailable(format!("{e:#}")),
                };
            }
            if let Some(ImageError::NotBuilt { .. }) = c.downcast_ref::<ImageError>() {
                return Error::invalid("image", format!("{e:#}"));
            }
            if let Some(d) = c.downcast_ref::<DeleteError>() {
                return match d {
                    DeleteError::NotFound(tag) => Error::not_found(Kind::Snapshot, tag),
                    DeleteError::HasDependents { .. } | DeleteError::InUse { .. } => {
                        Error::Conflict(d.to_string())
                    }
                };
            }
        }
        Error::Internal(e)
    }
}

impl From<anyhow::Error> for Error {
    fn from(e: anyhow::Error) -> Error {
        Error::from_anyhow(e)
    }
}

impl From<forkd_vmm::CallError> for Error {
    fn from(e: forkd_vmm::CallError) -> Error {
        use forkd_vmm::CallError;
        match e {
            CallError::Agent(a) => Error::Guest(a),
            CallError::Timeout(_) => Error::GuestTimeout(e.to_string()),
            CallError::Channel(_) => Error::GuestUnreachable(e.to_string()),
        }
    }
}

/// The tag rule, as an [`Error::Invalid`] of `tag` in forkd's words.
pub fn check_tag(tag: &str) -> Result<()> {
    forkd_layers::validate_tag(tag).map_err(|e| Error::invalid("tag", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    fn classify(e: impl Into<anyhow::Error>) -> Error {
        Error::from_anyhow(e.into())
    }

    fn io() -> std::io::Error {
        std::io::Error::from_raw_os_error(2)
    }

    #[test]
    fn snapshot_errors_by_type() {
        let e = classify(SnapshotError::NotFound { tag: "t".into() });
        assert!(matches!(&e, Error::NotFound { kind: Kind::Snapshot, id } if id == "t"));
        assert_eq!(e.to_string(), "snapshot \"t\" not found");
        // Found under context too, whatever the text says.
        let e = anyhow::Error::from(SnapshotError::Incompatible {
            reason: "snapshot was taken with QEMU 8".into(),
        })
        .context("restoring");
        let e = Error::from_anyhow(e);
        assert!(matches!(e, Error::Incompatible(_)), "{e:?}");
        assert_eq!(e.to_string(), "restoring: snapshot was taken with QEMU 8");
        let e = classify(SnapshotError::Unreadable {
            path: "/m/t/snapshot.json".into(),
            source: io(),
        });
        assert!(matches!(e, Error::Incompatible(_)));
        assert!(
            e.to_string().starts_with("reading /m/t/snapshot.json: "),
            "{e}"
        );
        let id: forkd_layers::SnapshotId = "0".repeat(32).parse().unwrap();
        for e in [
            SnapshotError::MissingFile {
                id,
                file: "vmstate",
            },
            SnapshotError::FileUnreadable {
                id,
                file: "memory.bin",
                path: "/m/x".into(),
                source: io(),
            },
            SnapshotError::Corrupt {
                path: "/x".into(),
                source: serde_json::from_str::<u8>("x").unwrap_err(),
            },
        ] {
            assert!(matches!(classify(e), Error::Incompatible(_)));
        }
        let e = classify(SnapshotError::BadSpec(
            "memory must be at least 64 MiB".into(),
        ));
        assert!(matches!(e, Error::Invalid { field: "spec", .. }));
        assert_eq!(e.to_string(), "memory must be at least 64 MiB");
    }

    #[test]
    fn image_and_delete_errors_by_type() {
        let e = classify(ImageError::NotBuilt {
            name: "py".into(),
            meta: "/i/py/image.json".into(),
            error: io(),
        });
        assert!(matches!(e, Error::Invalid { field: "image", .. }));
        let msg = e.to_string();
        assert!(
            msg.starts_with("image \"py\" is not built (/i/py/image.json: "),
            "{msg}"
        );
        assert!(msg.ends_with("`forkd image build --recipe py`"), "{msg}");
        assert!(matches!(
            classify(DeleteError::NotFound("t".into())),
            Error::NotFound {
                kind: Kind::Snapshot,
                ..
            }
        ));
        let e = classify(DeleteError::InUse {
            what: "t".into(),
            open_handles: 2,
        });
        assert!(matches!(e, Error::Conflict(_)));
        assert!(
            e.to_string()
                .starts_with("snapshot t is in use: 2 of its files"),
            "{e}"
        );
        let e = classify(DeleteError::HasDependents {
            what: "t".into(),
            dependents: vec!["a".into()],
        });
        assert!(matches!(e, Error::Conflict(_)));
    }

    /// Text alone never makes a domain error: an untyped error that reads
    /// like one is still internal, with its whole chain.
    #[test]
    fn untyped_errors_are_internal() {
        let e: anyhow::Result<()> = Err(anyhow::anyhow!("no snapshot \"x\" is not built"));
        let e = Error::from_anyhow(e.context("spawning").unwrap_err());
        assert!(matches!(e, Error::Internal(_)));
        assert_eq!(e.to_string(), "spawning: no snapshot \"x\" is not built");
    }

    #[test]
    fn agent_errors_keep_their_kind_and_text() {
        use forkd_vmm::CallError;
        let e = Error::from(CallError::Agent(AgentError::new(
            GuestErrorKind::NotFound,
            "/x: gone",
        )));
        assert!(matches!(&e, Error::Guest(a) if a.kind == GuestErrorKind::NotFound));
        assert_eq!(e.to_string(), "not_found: /x: gone");
        let e = Error::from(CallError::Channel("connection closed".into()));
        assert!(matches!(e, Error::GuestUnreachable(_)));
        assert_eq!(e.to_string(), "agent channel: connection closed");
        let e = Error::from(CallError::Timeout(std::time::Duration::from_secs(5)));
        assert!(matches!(e, Error::GuestTimeout(_)));
    }

    #[test]
    fn tags_are_checked_as_a_field() {
        assert!(check_tag("py").is_ok());
        let e = check_tag("../x").unwrap_err();
        assert!(matches!(e, Error::Invalid { field: "tag", .. }), "{e:?}");
        assert!(e.to_string().contains("1-64"), "{e}");
    }
}
