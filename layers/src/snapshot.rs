//! Snapshot records: immutable once committed (only tags move).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::{ManifestId, SnapshotId};

/// One file of a snapshot: which manifest holds it, and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRef {
    /// The file's content.
    pub manifest: ManifestId,
    /// File size in bytes (equals the manifest's size; kept here so listings
    /// need no manifest load).
    pub size: u64,
}

/// A committed snapshot. Stored as JSON in the `snapshots` column family.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// Immutable id (random, see [`SnapshotId`]).
    pub id: SnapshotId,
    /// The snapshot this one was taken from, if any. A parent cannot be
    /// deleted while it has children.
    pub parent: Option<SnapshotId>,
    /// Files by name (`memory.bin`, `vmstate`, `rootfs.img`, ...).
    pub files: BTreeMap<String, FileRef>,
    /// The VM configuration the caller recorded (QEMU version, machine
    /// arguments, memory, vcpus, kernel/initrd hashes, ...). Opaque here.
    pub config: serde_json::Value,
    /// Free-form lineage fields (`branched_from`, `pause_ms`, ...).
    pub lineage: BTreeMap<String, serde_json::Value>,
    /// Commit time, seconds since the Unix epoch.
    pub created_at_unix: u64,
}

impl SnapshotRecord {
    /// Sum of file sizes.
    pub fn logical_bytes(&self) -> u64 {
        self.files.values().map(|f| f.size).sum()
    }
}

/// What [`crate::Store::commit_snapshot`] needs to create a snapshot.
#[derive(Debug, Clone, Default)]
pub struct NewSnapshot {
    /// Parent snapshot (must exist).
    pub parent: Option<SnapshotId>,
    /// Files; every manifest must be in the store (from an ingest).
    pub files: BTreeMap<String, FileRef>,
    /// VM configuration to record.
    pub config: serde_json::Value,
    /// Lineage fields to record.
    pub lineage: BTreeMap<String, serde_json::Value>,
    /// Tag to point at the new snapshot in the same atomic commit.
    pub tag: Option<String>,
    /// Move `tag` if it already points elsewhere (otherwise the commit fails).
    pub replace_tag: bool,
}
