//! E2B volumes on one host (docs/e2b.md, "Volumes"): named folders a
//! sandbox mounts at create, kept under poold's `volume_roots`
//! ([`store`]), and the content API that serves a volume's files with no
//! sandbox, behind the volume's own token ([`files`]). Every path is
//! resolved from a descriptor, never through a symlink a guest could
//! plant ([`fs`]).
//!
//! forkd-e2b's control plane creates, lists and deletes volumes through
//! [`Volumes`] and mounts them at sandbox create; the content API is a
//! router of its own ([`files::routes`]), merged beside the control plane
//! and guarded by a volume's token instead of the API key.

#![warn(missing_docs)]

pub mod error;
pub mod files;
pub mod fs;
pub mod store;

pub use error::{Error, Result};
pub use store::{Mount, Volumes};
