//! Push and pull: move a snapshot and whatever of its parent chain the other
//! side lacks, sending only missing chunks (docs/hub.md, "What a transfer
//! does").
//!
//! Push: one batched query for which chain records the hub has (a record
//! on the hub means its chunks and manifests are there, or, on a plain
//! object store, promised by a pending marker: see `pushing`); then, on a
//! layout-2 hub, the hub's index objects (LIST `index/`, each GET once and
//! cached by id) say which chunks it has and where; the missing ones go
//! into ~8 MiB packs in working-set order, then one index object; on a
//! layout-1 hub one have/want query and one object per chunk. Then
//! manifests → locators → working sets → records root first → tag,
//! flushing before each step that names earlier objects. On a file or S3
//! hub the packs outside the working set go after the tag.
//!
//! Pull: fetch the chain's records back to the first snapshot this store
//! has, check QEMU compatibility (before any bulk transfer), then fetch
//! the missing manifests (verified), the chain's locators and the index
//! objects they name, and the working sets, all together
//! ([`METADATA_GETS`] in flight), and ask the local index which chunks are
//! missing. A full pull downloads those (whole packs when dense, ranged
//! reads otherwise; one object each on layout 1), verifies each chunk
//! against its id and imports them in durable batches, then stores the
//! manifests and commits the records root first with their original ids,
//! the tag last. A **lazy** pull stores the manifests with where each
//! missing chunk lies on the hub and commits the records marked lazy
//! (`forkd_layers::RemoteChunk`); forkd-fs fetches chunks when reads need
//! them and fills the rest in the background.
//!
//! A kill at any point leaves a consistent store and a re-run skips every
//! chunk already imported. A hub that serves a corrupt or missing object
//! makes the pull fail naming it, and the chunks this run imported are
//! dropped again, so the store is as before; a missing pack that a push
//! still running has promised is waited for instead.
//!
//! `push` and `pull` live in their own modules; what both use (the
//! report, the options, index objects and their cache) is here.

mod pulling;
mod pushing;

pub use pulling::pull;
pub use pushing::push;
pub(crate) use pushing::PUBLISH_TURN;

use super::Hub;
use anyhow::{anyhow, Result};
use bytes::Bytes;
use forkd_layers::{ObjectId, SnapshotId};
use forkd_remote::layout::{Key, TagObject};
use forkd_remote::packs::{ChunkMap, Index};
use futures::StreamExt;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Most index-object bytes one transfer holds.
const MAX_INDEX_TOTAL_BYTES: usize = 1 << 30;
/// Small objects (manifests, locators, indexes, working sets) a transfer
/// asks for at once: each GET is a round trip, so one at a time would cost
/// a pull over a slow link a round trip per object.
pub(crate) const METADATA_GETS: usize = 8;
/// Packs uploaded at once (each is held in memory while it goes).
const PACK_UPLOADS: usize = 4;

/// Called with the number of chunks imported so far after each durable
/// import batch.
pub type ChunksCallback = Arc<dyn Fn(u64) + Send + Sync>;

/// What a push or pull moved.
#[derive(Debug, Clone, Default)]
pub struct TransferReport {
    /// The snapshot pushed or pulled.
    pub snapshot: SnapshotId,
    /// The hub's layout (1: an object per chunk, 2: packs).
    pub layout: u32,
    /// Snapshot records transferred (the head and missing ancestors).
    pub snapshots: u64,
    /// Manifests transferred.
    pub manifests: u64,
    /// Distinct chunks of the transferred snapshots.
    pub chunks_total: u64,
    /// Chunks transferred (those the other side lacked).
    pub chunks: u64,
    /// Their uncompressed bytes.
    pub raw_bytes: u64,
    /// Their size in a store's packs (record headers included): the unit of
    /// `Store::diff`'s `new_stored_bytes`.
    pub stored_bytes: u64,
    /// Object bytes that crossed the wire (chunks or packs, manifests,
    /// indexes, records, tag).
    pub wire_bytes: u64,
    /// Packs written (push to a layout-2 hub).
    pub packs: u64,
    /// Of those, packs uploaded after the snapshot was published.
    pub late_packs: u64,
    /// Packs an earlier, unfinished push promised that this one uploaded.
    pub completed_packs: u64,
    /// When the records and tag were up, since the start (a push).
    pub published_after: Option<Duration>,
    /// Requests sent to the hub (HTTP and S3 hubs; 0 for file hubs).
    pub requests: u64,
    /// A lazy pull: chunks left on the hub for forkd-fs to fetch.
    pub remote_chunks: u64,
    /// Their size once fetched (stored bytes).
    pub remote_bytes: u64,
    /// The head has a recorded working set (sent, or received).
    pub working_set: bool,
    /// Wall time.
    pub elapsed: Duration,
    /// Compatibility warnings shown before a pull.
    pub warnings: Vec<String>,
}

impl TransferReport {
    /// One line for the CLI: what moved, in how many requests, how long.
    pub fn summary(&self) -> String {
        let mib = forkd_snapshot::mib;
        let mut s = format!(
            "{} of {} chunks moved ({} stored, {} on the wire{}), {} manifests, {} snapshot records",
            self.chunks,
            self.chunks_total,
            mib(self.stored_bytes),
            mib(self.wire_bytes),
            if self.packs > 0 {
                format!(", {} packs", self.packs)
            } else {
                String::new()
            },
            self.manifests,
            self.snapshots,
        );
        if self.remote_chunks > 0 {
            s.push_str(&format!(
                "; lazy: {} chunks ({}) left on the hub for forkd-fs to fetch",
                self.remote_chunks,
                mib(self.remote_bytes)
            ));
        }
        if self.working_set {
            s.push_str("; with its working set");
        }
        if self.completed_packs > 0 {
            s.push_str(&format!(
                "; {} packs of an unfinished push completed",
                self.completed_packs
            ));
        }
        if let (Some(t), true) = (self.published_after, self.late_packs > 0) {
            s.push_str(&format!(
                "; published after {:.2}s, {} packs after it",
                t.as_secs_f64(),
                self.late_packs
            ));
        }
        if self.requests > 0 {
            s.push_str(&format!("; {} requests", self.requests));
        }
        s.push_str(&format!(
            "; hub layout {} in {:.1}s",
            self.layout,
            self.elapsed.as_secs_f64()
        ));
        s
    }
}

/// A push's publication: its records and tag are on the hub.
#[derive(Debug, Clone, Copy, Default)]
pub struct Published {
    /// Since the push started.
    pub after: Duration,
    /// Packs still to upload (promised by pending markers).
    pub late_packs: u64,
    /// Their bytes.
    pub late_bytes: u64,
}

/// Called once when a push has published its snapshot (see [`Published`]).
pub type PublishCallback = Arc<dyn Fn(&Published) + Send + Sync>;

/// Options of [`push`].
#[derive(Clone, Default)]
pub struct PushOptions {
    /// Tag to set on the hub (default: the local tag pushed, if a tag).
    pub hub_tag: Option<String>,
    /// Concurrent object transfers (default: per hub kind).
    pub jobs: Option<usize>,
    /// No progress output.
    pub quiet: bool,
    /// The layout of a hub that is still empty (default 2). A hub that has
    /// objects keeps its own.
    pub layout: Option<u32>,
    /// Bytes a pack is filled to (default 8 MiB; a pack sent after
    /// publishing holds at most 2 MiB, see `pushing::LATE_PACK_BYTES`).
    pub pack_bytes: Option<usize>,
    /// Told when the snapshot is published, which on a file or S3 hub is
    /// before the packs outside its working set are up.
    pub on_publish: Option<PublishCallback>,
}

/// Options of [`pull`].
#[derive(Clone, Default)]
pub struct PullOptions {
    /// Local tag to set (default: the hub tag pulled).
    pub as_tag: Option<String>,
    /// Move the local tag if it points at another snapshot.
    pub force: bool,
    /// Refuse (before transferring) a snapshot this host may not restore.
    pub strict: bool,
    /// Concurrent object transfers (default: per hub kind).
    pub jobs: Option<usize>,
    /// No progress output or warnings on stderr (they are still reported).
    pub quiet: bool,
    /// Observer of durable import batches (tests, progress).
    pub on_chunks: Option<ChunksCallback>,
    /// Fetch only records, manifests and where the chunks are; forkd-fs
    /// fetches chunks as reads need them and fills the rest.
    pub lazy: bool,
}

/// The hub served an object that fails verification, or lacks one it
/// should have: the transfer is refused, not retried.
#[derive(Debug)]
pub struct Refused(pub String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// Where the local cache of a hub's index objects lives (they are
/// immutable and named by their hash, so a cached copy is always right).
fn index_cache(store_root: &Path) -> PathBuf {
    store_root.join("remote").join("index-cache")
}

fn cache_index(store_root: &Path, id: &ObjectId, bytes: &[u8]) {
    let dir = index_cache(store_root);
    let tmp = dir.join(format!(".tmp-{}", forkd_remote::random_hex(6)));
    let ok = std::fs::create_dir_all(&dir).is_ok()
        && std::fs::write(&tmp, bytes).is_ok()
        && std::fs::rename(&tmp, dir.join(id.to_string())).is_ok();
    if !ok {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Reads index objects: `only` (a snapshot's locator), else every index the
/// hub lists. Each comes from the local cache when it is there, else from
/// the hub (then cached); each is checked against its name.
pub(crate) async fn load_index(
    hub: &Hub,
    store_root: &Path,
    only: Option<&[ObjectId]>,
    report: &mut TransferReport,
) -> Result<ChunkMap> {
    let ids: Vec<ObjectId> = match only {
        Some(ids) => ids.to_vec(),
        None => hub
            .list("index")
            .await?
            .into_iter()
            .filter_map(|k| match k {
                Key::Index(id) => Some(id),
                _ => None,
            })
            .collect(),
    };
    // The cached ones first; the rest from the hub, a few at once, taken
    // in order so the byte bound holds.
    let cached = |id: &ObjectId| cached_index(store_root, id);
    let mut got = futures::stream::iter(ids)
        .map(|id| async move {
            match cached(&id) {
                Some(b) => (id, Ok(Some(b)), true),
                None => (id, hub.get(&Key::Index(id)).await, false),
            }
        })
        .buffered(METADATA_GETS);
    let mut map = ChunkMap::default();
    let mut held = 0usize;
    while let Some((id, bytes, from_cache)) = got.next().await {
        let bytes = bytes?.ok_or_else(|| {
            Refused(format!(
                "{} lacks index {id}; push the snapshot again",
                hub.describe()
            ))
        })?;
        if !from_cache {
            report.wire_bytes += bytes.len() as u64;
        }
        held += bytes.len();
        if held > MAX_INDEX_TOTAL_BYTES {
            return Err(Refused(format!(
                "the index objects of {} pass {} MiB in total",
                hub.describe(),
                MAX_INDEX_TOTAL_BYTES >> 20
            ))
            .into());
        }
        let index = Index::decode(&id, &bytes)
            .map_err(|e| Refused(format!("{e:#} (from {})", hub.describe())))?;
        if !from_cache {
            cache_index(store_root, &id, &bytes);
        }
        map.add(id, &index);
    }
    Ok(map)
}

/// Index object `id` from the local cache, if it is there and intact.
fn cached_index(store_root: &Path, id: &ObjectId) -> Option<Bytes> {
    std::fs::read(index_cache(store_root).join(id.to_string()))
        .ok()
        .filter(|b| ObjectId::of(b) == *id)
        .map(Bytes::from)
}

/// One index object, from the local cache or the hub (then cached),
/// checked against its name.
pub(crate) async fn index_object(
    hub: &Hub,
    store_root: &Path,
    id: &ObjectId,
    report: &mut TransferReport,
) -> Result<Index> {
    if let Some(b) = cached_index(store_root, id) {
        return Index::decode(id, &b);
    }
    let b = hub
        .get(&Key::Index(*id))
        .await?
        .ok_or_else(|| Refused(format!("{} lacks index {id}", hub.describe())))?;
    report.wire_bytes += b.len() as u64;
    let index =
        Index::decode(id, &b).map_err(|e| Refused(format!("{e:#} (from {})", hub.describe())))?;
    cache_index(store_root, id, &b);
    Ok(index)
}

/// Resolves `name` on the hub: a snapshot id the hub has, else a tag.
/// Returns the id and whether `name` was a tag.
pub async fn resolve_remote(hub: &Hub, name: &str) -> Result<(SnapshotId, bool)> {
    if let Ok(id) = name.parse::<SnapshotId>() {
        if hub.has(&[Key::Snapshot(id)]).await?[0] {
            return Ok((id, false));
        }
    }
    let key = Key::tag(name)?;
    let bytes = hub
        .get(&key)
        .await?
        .ok_or_else(|| anyhow!("{} has no tag '{name}'", hub.describe()))?;
    Ok((TagObject::decode(name, &bytes)?.snapshot, true))
}
