//! Push and pull: move a snapshot and whatever of its parent chain the other
//! side lacks, sending only missing chunks (docs/hub.md, "What a transfer
//! does").
//!
//! Push: one batched query for which chain records the hub has (a record
//! on the hub means all its chunks and manifests are there, since records
//! are written last); then, on a layout-2 hub, the hub's index objects
//! (LIST `index/`, each GET once and cached by id) say which chunks it has
//! and where; the missing ones go into ~8 MiB packs in working-set order,
//! then one index object; on a layout-1 hub one have/want query and one
//! object per chunk. Then manifests → locators → working sets → records
//! root first → tag, flushing before each step that names earlier objects.
//!
//! Pull: fetch the chain's records back to the first snapshot this store
//! has, check QEMU compatibility (before any bulk transfer), fetch and
//! verify the missing manifests, ask the local index which of their chunks
//! are missing. A full pull downloads those (whole packs when dense, ranged
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
//! dropped again, so the store is as before.

use super::compat;
use super::{blocking, Hub};
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use forkd_layers::{
    decode_manifest, decode_record, validate_tag, ChunkId, ChunkImport, ChunkRef, ManifestId,
    ObjectId, RemoteChunk, SnapshotId, SnapshotRecord, Store, StoreView, VerifiedChunk, WorkingSet,
};
use forkd_remote::layout::{
    decode_chunk, encode_chunk, Key, LayoutObject, Locator, TagObject, LAYOUT_CHUNKS, LAYOUT_PACKED,
};
use forkd_remote::packs::{
    plan_reads, split_read, ChunkMap, Coalesce, Index, Location, PackBuilder, DEFAULT_PACK_BYTES,
};
use forkd_remote::Credentials;
use forkd_snapshot::Progress;
use futures::{StreamExt, TryStreamExt};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest parent chain a pull follows.
const MAX_CHAIN: usize = 10_000;
/// Most snapshot-record bytes one pull holds (a real record is a few KiB;
/// each may be up to `MAX_RECORD_BYTES`, so a hostile chain could otherwise
/// make a pull hold gigabytes before anything is checked).
const MAX_PULL_RECORD_BYTES: usize = 64 << 20;
/// Most manifest bytes one pull holds before importing them.
const MAX_PULL_MANIFEST_BYTES: usize = 1 << 30;
/// Most index-object bytes one transfer holds.
const MAX_INDEX_TOTAL_BYTES: usize = 1 << 30;
/// Chunks per durable import batch (or [`IMPORT_BATCH_BYTES`], whichever first).
const IMPORT_BATCH_CHUNKS: usize = 256;
const IMPORT_BATCH_BYTES: usize = 16 << 20;
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

/// Options of [`push`].
#[derive(Debug, Clone, Default)]
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
    /// Bytes a pack is filled to (default 8 MiB).
    pub pack_bytes: Option<usize>,
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

/// The layout to push to: the hub's own, or `want` (default 2) for a hub
/// that holds no snapshot yet, whose `layout.json` is then written first.
async fn layout_for_push(hub: &Hub, want: Option<u32>) -> Result<u32> {
    if let Some(b) = hub.get(&Key::Layout).await? {
        let have = LayoutObject::decode(&b)?.layout;
        if let Some(w) = want.filter(|&w| w != have) {
            bail!(
                "{} has layout {have}, not {w}; {}",
                hub.describe(),
                if w > have {
                    "migrate it with `forkd hub migrate URL`"
                } else {
                    "push to another hub for clients that only read layout 1"
                }
            );
        }
        return Ok(have);
    }
    let empty = hub.list("snapshots").await?.is_empty();
    if !empty {
        // A hub written before layouts had versions.
        if want == Some(LAYOUT_PACKED) {
            bail!(
                "{} is a layout-1 hub (one object per chunk); migrate it with `forkd hub migrate URL` first",
                hub.describe()
            );
        }
        return Ok(LAYOUT_CHUNKS);
    }
    let layout = want.unwrap_or(LAYOUT_PACKED);
    if layout != LAYOUT_CHUNKS && layout != LAYOUT_PACKED {
        bail!("unknown hub layout {layout}: use 1 or 2");
    }
    if layout == LAYOUT_PACKED {
        hub.put(&Key::Layout, LayoutObject { layout }.encode())
            .await?;
        hub.flush().await?;
    }
    Ok(layout)
}

/// This process's turn to change tags on a hub: a push publishing its tag
/// and a delete taking one down do not interleave.
pub(crate) static PUBLISH_TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Pushes snapshot `what` (tag or id) with the part of its parent chain the
/// hub lacks, reading through `view` (a push only reads: callers pass a
/// view that holds no write turn, `forkd_snapshot::store::open_view`).
pub async fn push(
    view: StoreView,
    what: &str,
    hub: &Hub,
    opts: &PushOptions,
) -> Result<TransferReport> {
    let start = Instant::now();
    let traffic0 = hub.traffic();
    let (head, chain) = {
        let (view, what) = (view.clone(), what.to_string());
        blocking(move || {
            let head = view
                .resolve(&what)?
                .ok_or_else(|| anyhow!("no snapshot or tag '{what}' in the local store"))?;
            let chain = view.chain(&head.id)?;
            Ok((head, chain))
        })
        .await?
    };
    let hub_tag = match &opts.hub_tag {
        Some(t) => Some(t.clone()),
        None if validate_tag(what).is_ok() && view.tag(what)?.is_some() => Some(what.to_string()),
        None => None,
    };
    if let Some(t) = &hub_tag {
        validate_tag(t)?;
    }
    let layout = layout_for_push(hub, opts.layout).await?;
    let rec_keys: Vec<Key> = chain.iter().map(|r| Key::Snapshot(r.id)).collect();
    let on_hub = hub.has(&rec_keys).await?;
    let missing_recs: Vec<SnapshotRecord> = chain
        .iter()
        .zip(&on_hub)
        .filter(|(_, &h)| !h)
        .map(|(r, _)| r.clone())
        .collect();
    let (candidates, manifests) = {
        let (view, chain, missing) = (view.clone(), chain.clone(), missing_recs.clone());
        blocking(move || push_candidates(&view, &chain, &missing)).await?
    };
    let mut report = TransferReport {
        snapshot: head.id,
        layout,
        chunks_total: candidates.len() as u64,
        ..Default::default()
    };
    let mut chunk_map = ChunkMap::default();
    if layout == LAYOUT_PACKED {
        chunk_map = load_index(hub, view.root(), None, &mut report).await?;
        let missing: Vec<ChunkId> = candidates
            .iter()
            .filter(|c| chunk_map.get(c).is_none())
            .copied()
            .collect();
        let ordered = {
            let (view, recs) = (view.clone(), missing_recs.clone());
            blocking(move || working_set_first(&view, &recs, missing)).await?
        };
        let index = push_packs(&view, hub, ordered, opts, &mut report).await?;
        if let Some((id, index)) = index {
            chunk_map.add(id, &index);
        }
    } else {
        push_chunk_objects(&view, hub, &candidates, opts, &mut report).await?;
    }
    hub.flush().await?;

    let mkeys: Vec<Key> = manifests.iter().map(|m| Key::Manifest(*m)).collect();
    for (m, have) in manifests.iter().zip(hub.has(&mkeys).await?) {
        if !have {
            let bytes = Bytes::from(view.manifest_bytes(m)?);
            report.wire_bytes += bytes.len() as u64;
            report.manifests += 1;
            hub.put(&Key::Manifest(*m), bytes).await?;
        }
    }
    if layout == LAYOUT_PACKED {
        for rec in &missing_recs {
            let locator = locator_of(&view, rec, &chunk_map)?;
            let b = locator.encode();
            report.wire_bytes += b.len() as u64;
            hub.put(&Key::Locator(rec.id), b).await?;
        }
    }
    // Working sets: of the records sent, and the head's if it was
    // recorded after an earlier push.
    let mut ws_recs: Vec<SnapshotId> = missing_recs.iter().map(|r| r.id).collect();
    if !ws_recs.contains(&head.id)
        && view.working_set(&head.id)?.is_some()
        && !hub.has(&[Key::WorkingSet(head.id)]).await?[0]
    {
        ws_recs.push(head.id);
    }
    for id in &ws_recs {
        if let Some(b) = view.annotation(id, forkd_layers::workingset::ANNOTATION)? {
            report.wire_bytes += b.len() as u64;
            report.working_set |= *id == head.id;
            hub.put(&Key::WorkingSet(*id), Bytes::from(b)).await?;
        }
    }
    hub.flush().await?;
    for rec in &missing_recs {
        let json = Bytes::from(serde_json::to_vec(rec)?);
        report.wire_bytes += json.len() as u64;
        report.snapshots += 1;
        hub.put(&Key::Snapshot(rec.id), json).await?;
    }
    hub.flush().await?;
    if let Some(t) = &hub_tag {
        // In turn with deletes (`lazy::unpublish_tag`): a tag deleted or
        // moved here while its chunks crossed is not published after it.
        let _turn = PUBLISH_TURN.lock().await;
        if opts.hub_tag.is_none() {
            view.catch_up()?;
            if view.tag(t)? != Some(head.id) {
                bail!(
                    "tag '{t}' was deleted or moved here while snapshot {} was pushed: its chunks and record are on the hub, the tag is not (push the tag again if it should be)",
                    head.id
                );
            }
        }
        let obj = TagObject { snapshot: head.id }.encode();
        report.wire_bytes += obj.len() as u64;
        hub.put(&Key::tag(t)?, obj).await?;
        hub.flush().await?;
    }
    report.requests = hub.traffic().since(&traffic0).requests;
    report.elapsed = start.elapsed();
    Ok(report)
}

/// The chunks of the records the hub lacks that no record it has names
/// (first-use order), and their manifests. Refuses a record that is not
/// all local (a lazy snapshot still filling).
fn push_candidates(
    view: &StoreView,
    chain: &[SnapshotRecord],
    missing: &[SnapshotRecord],
) -> Result<(Vec<ChunkId>, Vec<ManifestId>)> {
    let missing_ids: HashSet<SnapshotId> = missing.iter().map(|r| r.id).collect();
    let mut known = HashSet::new();
    for r in chain.iter().filter(|r| !missing_ids.contains(&r.id)) {
        known.extend(view.snapshot_chunks(r)?);
    }
    let mut cands = Vec::new();
    let mut manifests: Vec<ManifestId> = Vec::new();
    for r in missing {
        for c in view.snapshot_chunks(r)? {
            if known.insert(c) {
                cands.push(c);
            }
        }
        for f in r.files.values() {
            if !manifests.contains(&f.manifest) {
                manifests.push(f.manifest);
            }
        }
    }
    let have = view.has_chunks(&cands)?;
    let remote = have.iter().filter(|h| !**h).count();
    if remote > 0 {
        bail!(
            "{remote} chunks of the snapshots to push are not in the local store yet (a lazy pull still filling); wait until `forkd snapshot info` shows no remote bytes, or pull it without --lazy"
        );
    }
    Ok((cands, manifests))
}

/// `missing` with the chunks of the records' working sets first, in the
/// order they were recorded (the head's first), then the rest in order: a
/// lazy host's prefetch then reads a few contiguous ranges.
fn working_set_first(
    view: &StoreView,
    recs: &[SnapshotRecord],
    missing: Vec<ChunkId>,
) -> Result<Vec<ChunkId>> {
    let wanted: HashSet<ChunkId> = missing.iter().copied().collect();
    let mut out = Vec::with_capacity(missing.len());
    let mut placed = HashSet::new();
    for rec in recs.iter().rev() {
        if let Some(ws) = view.working_set(&rec.id)? {
            for c in ws.chunks(view, rec)? {
                if wanted.contains(&c) && placed.insert(c) {
                    out.push(c);
                }
            }
        }
    }
    out.extend(missing.into_iter().filter(|c| !placed.contains(c)));
    Ok(out)
}

/// Layout 1: one have/want query, then one object per missing chunk.
async fn push_chunk_objects(
    view: &StoreView,
    hub: &Hub,
    candidates: &[ChunkId],
    opts: &PushOptions,
    report: &mut TransferReport,
) -> Result<()> {
    let keys: Vec<Key> = candidates.iter().map(|c| Key::Chunk(*c)).collect();
    let have = hub.has(&keys).await?;
    let missing: Vec<ChunkId> = candidates
        .iter()
        .zip(have)
        .filter(|(_, h)| !h)
        .map(|(c, _)| *c)
        .collect();
    let progress = Progress::new("push", opts.quiet);
    let mut total = 0;
    for c in &missing {
        total += view
            .chunk_location(c)?
            .map_or(0, |l| u64::from(l.stored_len));
    }
    progress.set_total(total);
    let jobs = opts.jobs.unwrap_or_else(|| hub.default_jobs()).max(1);
    let sent: Vec<(u64, u64, u64)> = futures::stream::iter(missing)
        .map(|id| {
            let (view, hub, progress) = (view.clone(), hub.clone(), &progress);
            async move {
                let c = blocking(move || Ok(view.stored_chunk(&id)?)).await?;
                let obj = encode_chunk(&c);
                let wire = obj.len() as u64;
                hub.put(&Key::Chunk(id), obj)
                    .await
                    .with_context(|| format!("uploading chunk {id} to {}", hub.describe()))?;
                progress.inc(c.payload.len() as u64);
                anyhow::Ok((wire, c.record_len(), u64::from(c.raw_len)))
            }
        })
        .buffer_unordered(jobs)
        .try_collect()
        .await?;
    progress.finish();
    for (wire, stored, raw) in sent {
        report.chunks += 1;
        report.wire_bytes += wire;
        report.stored_bytes += stored;
        report.raw_bytes += raw;
    }
    Ok(())
}

/// Layout 2: packs the missing chunks in order, uploads the packs (a few at
/// a time), then one index object naming them. Returns the index.
async fn push_packs(
    view: &StoreView,
    hub: &Hub,
    missing: Vec<ChunkId>,
    opts: &PushOptions,
    report: &mut TransferReport,
) -> Result<Option<(ObjectId, Index)>> {
    if missing.is_empty() {
        return Ok(None);
    }
    let progress = Progress::new("push", opts.quiet);
    let mut total = 0;
    for c in &missing {
        total += view
            .chunk_location(c)?
            .map_or(0, |l| u64::from(l.stored_len));
    }
    progress.set_total(total);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let target = opts.pack_bytes.unwrap_or(DEFAULT_PACK_BYTES);
    let packer = {
        let view = view.clone();
        tokio::task::spawn_blocking(move || -> Result<(u64, u64, u64)> {
            let mut b = PackBuilder::new(target);
            let (mut n, mut stored, mut raw) = (0, 0, 0);
            for id in missing {
                let c = view.stored_chunk(&id)?;
                n += 1;
                stored += c.record_len();
                raw += u64::from(c.raw_len);
                if let Some(p) = b.add(&c) {
                    if tx.blocking_send(p).is_err() {
                        return Ok((n, stored, raw)); // the uploader failed
                    }
                }
            }
            if let Some(p) = b.finish() {
                let _ = tx.blocking_send(p);
            }
            Ok((n, stored, raw))
        })
    };
    let jobs = opts
        .jobs
        .unwrap_or_else(|| hub.default_jobs())
        .clamp(1, PACK_UPLOADS);
    let uploaded: Result<Vec<forkd_remote::packs::PackInfo>> = tokio_stream_of(rx)
        .map(|p| {
            let (hub, progress) = (hub.clone(), &progress);
            async move {
                let len = p.bytes.len() as u64;
                hub.put(&Key::Pack(p.info.id), p.bytes)
                    .await
                    .with_context(|| {
                        format!("uploading pack {} to {}", p.info.id, hub.describe())
                    })?;
                progress.inc(len);
                anyhow::Ok(p.info)
            }
        })
        .buffered(jobs)
        .try_collect()
        .await;
    let counted = packer.await.context("the packer panicked")?;
    progress.finish();
    let packs = uploaded?;
    let (n, stored, raw) = counted?;
    report.chunks += n;
    report.stored_bytes += stored;
    report.raw_bytes += raw;
    report.packs += packs.len() as u64;
    report.wire_bytes += packs.iter().map(|p| p.len).sum::<u64>();
    hub.flush().await?;
    let index = Index { packs };
    let bytes = index.encode();
    let id = ObjectId::of(&bytes);
    report.wire_bytes += bytes.len() as u64;
    hub.put(&Key::Index(id), bytes.clone()).await?;
    cache_index(view.root(), &id, &bytes);
    Ok(Some((id, index)))
}

/// A receiver as a stream (packs arrive as the packer closes them).
fn tokio_stream_of<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// The locator of `rec`: every index object that locates one of its chunks.
fn locator_of(view: &StoreView, rec: &SnapshotRecord, map: &ChunkMap) -> Result<Locator> {
    let mut indexes = BTreeSet::new();
    for c in view.snapshot_chunks(rec)? {
        let loc = map
            .get(&c)
            .ok_or_else(|| anyhow!("chunk {c} of snapshot {} was not packed", rec.id))?;
        indexes.insert(loc.index);
    }
    Ok(Locator {
        layout: LAYOUT_PACKED,
        indexes: indexes.into_iter().collect(),
    })
}

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
    let mut map = ChunkMap::default();
    let mut held = 0usize;
    for id in ids {
        let cached = std::fs::read(index_cache(store_root).join(id.to_string())).ok();
        let bytes = match cached {
            Some(b) if ObjectId::of(&b) == id => Bytes::from(b),
            _ => {
                let b = hub.get(&Key::Index(id)).await?.ok_or_else(|| {
                    Refused(format!(
                        "{} lacks index {id}; push the snapshot again",
                        hub.describe()
                    ))
                })?;
                report.wire_bytes += b.len() as u64;
                b
            }
        };
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
        cache_index(store_root, &id, &bytes);
        map.add(id, &index);
    }
    Ok(map)
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

/// Pulls `name` (tag or snapshot id on the hub) with whatever of its parent
/// chain this store lacks: all of it, or with `opts.lazy` only records,
/// manifests and where the chunks lie.
pub async fn pull(
    store: Arc<Store>,
    hub: &Hub,
    name: &str,
    opts: &PullOptions,
) -> Result<TransferReport> {
    let start = Instant::now();
    let traffic0 = hub.traffic();
    let view = store.view();
    if opts.lazy && matches!(hub, Hub::Pack(_)) {
        bail!("a pack file cannot be pulled lazily: unpack it");
    }
    let (head_id, is_tag) = resolve_remote(hub, name).await?;
    let local_tag = match &opts.as_tag {
        Some(t) => Some(t.clone()),
        None => is_tag.then(|| name.to_string()),
    };
    if let Some(t) = &local_tag {
        validate_tag(t)?;
        if let Some(existing) = view.tag(t)? {
            if existing != head_id && !opts.force {
                bail!(
                    "local tag '{t}' already points at snapshot {existing}; pass --force to move it, or --as NEWTAG"
                );
            }
        }
    }
    let to_import = fetch_chain(&view, hub, head_id).await?;
    for r in &to_import {
        compat::refuse_forged(r).map_err(|why| {
            Refused(format!(
                "snapshot {} from {} cannot be trusted: {why}",
                r.id,
                hub.describe()
            ))
        })?;
    }
    let head_rec = match to_import.last() {
        Some(r) => r.clone(),
        None => view.snapshot(&head_id)?.expect("present locally"),
    };
    let layout = hub.layout().await?;
    let mut report = TransferReport {
        snapshot: head_id,
        layout,
        snapshots: to_import.len() as u64,
        warnings: compat::check(&head_rec),
        ..Default::default()
    };
    if !opts.quiet {
        for w in &report.warnings {
            eprintln!("warning: {w}");
        }
    }
    if opts.strict && !report.warnings.is_empty() {
        bail!(
            "refusing to pull snapshot {head_id} (--strict): {}",
            report.warnings.join("; ")
        );
    }

    let manifests = fetch_manifests(&view, hub, &to_import, &mut report).await?;
    // Distinct chunks of the new manifests with their raw lengths (known
    // from the slots), so progress has a byte total before any download.
    let mut needed: Vec<(ChunkId, u64)> = Vec::new();
    let mut seen = HashSet::new();
    for (_, m) in &manifests {
        let m = decode_manifest_unchecked(m)?;
        for i in 0..m.len() {
            if let ChunkRef::Chunk(c) = m.entry(i) {
                if seen.insert(c) {
                    needed.push((c, u64::from(m.slot_len(i))));
                }
            }
        }
    }
    // A full pull also completes the lazy snapshots of the chain it finds
    // here (their chunks are located, not indexed).
    let local_lazy: Vec<SnapshotId> = view
        .chain(&head_id)
        .unwrap_or_default()
        .iter()
        .map(|r| r.id)
        .filter(|id| view.lazy_source(id).ok().flatten().is_some())
        .collect();
    if !opts.lazy {
        for id in &local_lazy {
            let rec = view.snapshot(id)?.expect("in the chain");
            for c in view.snapshot_chunks(&rec)? {
                if seen.insert(c) {
                    let raw = view.remote_chunk(&c)?.map_or(0, |r| u64::from(r.raw_len));
                    needed.push((c, raw));
                }
            }
        }
    }
    report.chunks_total = needed.len() as u64;
    let ids: Vec<ChunkId> = needed.iter().map(|(c, _)| *c).collect();
    let have = view.has_chunks(&ids)?;
    let missing: Vec<(ChunkId, u64)> = needed
        .into_iter()
        .zip(have)
        .filter(|(_, h)| !h)
        .map(|(c, _)| c)
        .collect();

    // Where the missing chunks are: from the locators on a layout-2 hub.
    let mut map = ChunkMap::default();
    if layout == LAYOUT_PACKED && !missing.is_empty() {
        let mut indexes: BTreeSet<ObjectId> = BTreeSet::new();
        let mut locate: Vec<SnapshotId> = to_import.iter().map(|r| r.id).collect();
        locate.extend(local_lazy.iter().copied());
        for id in locate {
            let b = hub.get(&Key::Locator(id)).await?.ok_or_else(|| {
                Refused(format!(
                    "{} lacks the chunk locator of snapshot {id}; push it again",
                    hub.describe()
                ))
            })?;
            report.wire_bytes += b.len() as u64;
            indexes.extend(Locator::decode(&id, &b)?.indexes);
        }
        let ids: Vec<ObjectId> = indexes.into_iter().collect();
        map = load_index(hub, view.root(), Some(&ids), &mut report).await?;
        if let Some((c, _)) = missing.iter().find(|(c, _)| map.get(c).is_none()) {
            return Err(Refused(format!(
                "the index objects of {} do not locate chunk {c}; push the snapshot again",
                hub.describe()
            ))
            .into());
        }
    }
    let working_sets = fetch_working_sets(hub, &to_import, &mut report).await?;
    report.working_set = working_sets.iter().any(|(id, _)| *id == head_id)
        || view.working_set(&head_id).ok().flatten().is_some();

    if opts.lazy {
        commit_lazy(
            &store,
            hub,
            layout,
            &manifests,
            &missing,
            &map,
            &to_import,
            local_tag.as_deref(),
            opts.force,
            &mut report,
        )
        .await?;
    } else {
        let total_raw = missing.iter().map(|(_, n)| n).sum();
        let ids: Vec<ChunkId> = missing.iter().map(|(c, _)| *c).collect();
        let fetched = if layout == LAYOUT_PACKED {
            fetch_packed(&store, hub, &ids, &map, total_raw, opts, &mut report).await
        } else {
            fetch_chunks(&store, hub, &ids, total_raw, opts, &mut report).await
        };
        if let Err(e) = fetched {
            if e.is::<Refused>() {
                let (store, ids) = (store.clone(), ids.clone());
                blocking(move || Ok(store.discard_chunks(&ids)?))
                    .await
                    .context("dropping the chunks of the refused pull")?;
            }
            return Err(e);
        }
        let (store2, to_import2) = (store.clone(), to_import.clone());
        let tag = local_tag.clone();
        let force = opts.force;
        let lazy_done = local_lazy.clone();
        blocking(move || {
            for (id, bytes) in &manifests {
                store2.import_manifest(id, bytes)?;
            }
            let n = to_import2.len();
            for (i, rec) in to_import2.iter().enumerate() {
                let t = if i + 1 == n { tag.as_deref() } else { None };
                store2
                    .commit_imported(rec, t, force)
                    .with_context(|| format!("committing snapshot {}", rec.id))?;
            }
            if n == 0 {
                if let Some(t) = &tag {
                    store2.set_tag_force(t, &head_id)?;
                }
            }
            for id in &lazy_done {
                store2.finish_remote(id)?;
            }
            Ok(())
        })
        .await?;
    }
    let store2 = store.clone();
    blocking(move || {
        for (id, ws) in &working_sets {
            store2.set_working_set(id, ws)?;
        }
        Ok(())
    })
    .await?;
    report.requests = hub.traffic().since(&traffic0).requests;
    report.elapsed = start.elapsed();
    Ok(report)
}

/// The working sets the hub holds for `recs` (absent ones are fine).
async fn fetch_working_sets(
    hub: &Hub,
    recs: &[SnapshotRecord],
    report: &mut TransferReport,
) -> Result<Vec<(SnapshotId, WorkingSet)>> {
    let keys: Vec<Key> = recs.iter().map(|r| Key::WorkingSet(r.id)).collect();
    let mut out = Vec::new();
    if keys.is_empty() {
        return Ok(out);
    }
    for (rec, have) in recs.iter().zip(hub.has(&keys).await?) {
        if !have {
            continue;
        }
        if let Some(b) = hub.get(&Key::WorkingSet(rec.id)).await? {
            report.wire_bytes += b.len() as u64;
            let ws = WorkingSet::decode(&rec.id, &b).map_err(|e| {
                Refused(format!(
                    "the working set of snapshot {} from {} is invalid: {e}",
                    rec.id,
                    hub.describe()
                ))
            })?;
            out.push((rec.id, ws));
        }
    }
    Ok(out)
}

/// A lazy pull's commit: the source, its credentials, the manifests with
/// the locations of the missing chunks, the records marked lazy.
#[allow(clippy::too_many_arguments)]
async fn commit_lazy(
    store: &Arc<Store>,
    hub: &Hub,
    layout: u32,
    manifests: &[(ManifestId, Bytes)],
    missing: &[(ChunkId, u64)],
    map: &ChunkMap,
    to_import: &[SnapshotRecord],
    tag: Option<&str>,
    force: bool,
    report: &mut TransferReport,
) -> Result<()> {
    let (url, creds) = (hub.describe(), hub.credentials());
    let locs: Vec<(ChunkId, Location)> = if layout == LAYOUT_PACKED {
        missing
            .iter()
            .map(|(c, _)| (*c, *map.get(c).expect("checked above")))
            .collect()
    } else {
        Vec::new()
    };
    let raw_of: HashMap<ChunkId, u64> = missing.iter().copied().collect();
    let (store2, manifests) = (store.clone(), manifests.to_vec());
    let recs = to_import.to_vec();
    let tag = tag.map(str::to_string);
    let head = report.snapshot;
    let (n, bytes) = blocking(move || {
        let src = store2.add_remote_source(&url, layout)?;
        creds.save(&Credentials::path(store2.root(), src.id))?;
        let chunks: Vec<(ChunkId, RemoteChunk)> = if layout == LAYOUT_PACKED {
            locs.iter()
                .map(|(c, l)| {
                    (
                        *c,
                        RemoteChunk {
                            source: src.id,
                            object: l.pack,
                            offset: l.offset,
                            len: l.len,
                            raw_len: l.raw_len,
                        },
                    )
                })
                .collect()
        } else {
            raw_of
                .iter()
                .map(|(c, raw)| {
                    (
                        *c,
                        RemoteChunk {
                            source: src.id,
                            object: ObjectId(c.0),
                            offset: 0,
                            len: 0,
                            raw_len: *raw as u32,
                        },
                    )
                })
                .collect()
        };
        let bytes: u64 = chunks.iter().map(|(_, r)| r.record_len()).sum();
        let m: Vec<(ManifestId, &[u8])> = manifests.iter().map(|(i, b)| (*i, &b[..])).collect();
        store2.import_remote(&m, &chunks)?;
        let n = recs.len();
        for (i, rec) in recs.iter().enumerate() {
            let t = if i + 1 == n { tag.as_deref() } else { None };
            store2
                .commit_imported_lazy(rec, t, force, src.id)
                .with_context(|| format!("committing snapshot {}", rec.id))?;
        }
        if n == 0 {
            if let Some(t) = &tag {
                store2.set_tag_force(t, &head)?;
            }
        }
        Ok((chunks.len() as u64, bytes))
    })
    .await?;
    report.remote_chunks = n;
    report.remote_bytes = bytes;
    Ok(())
}

/// Fetches the records of `head` and its ancestors back to the first one
/// this store has; returns the missing ones root first.
async fn fetch_chain(view: &StoreView, hub: &Hub, head: SnapshotId) -> Result<Vec<SnapshotRecord>> {
    let mut out: Vec<SnapshotRecord> = Vec::new();
    let mut held = 0usize;
    let mut next = Some(head);
    while let Some(id) = next {
        if view.snapshot(&id)?.is_some() {
            break;
        }
        if out.len() >= MAX_CHAIN || out.iter().any(|r| r.id == id) {
            return Err(Refused(format!(
                "the parent chain of snapshot {head} on {} loops or is over {MAX_CHAIN} long",
                hub.describe()
            ))
            .into());
        }
        let child = out.last().map(|r| r.id);
        let bytes = hub.get(&Key::Snapshot(id)).await?.ok_or_else(|| {
            Refused(match child {
                Some(c) => format!(
                    "{} lacks snapshot record {id}, the parent of {c}; push the chain again",
                    hub.describe()
                ),
                None => format!("{} lacks snapshot record {id}", hub.describe()),
            })
        })?;
        held += bytes.len();
        if held > MAX_PULL_RECORD_BYTES {
            return Err(Refused(format!(
                "the parent chain of snapshot {head} on {}: its records pass {} MiB in total after {} of them (real records are a few KiB each); the hub copy is altered or hostile",
                hub.describe(),
                MAX_PULL_RECORD_BYTES >> 20,
                out.len() + 1
            ))
            .into());
        }
        let rec = decode_record(&id, &bytes).map_err(|e| {
            Refused(format!(
                "snapshot record {id} from {} is invalid: {e}",
                hub.describe()
            ))
        })?;
        next = rec.parent;
        out.push(rec);
    }
    out.reverse();
    Ok(out)
}

/// Fetches and verifies the manifests of `recs` this store lacks.
async fn fetch_manifests(
    view: &StoreView,
    hub: &Hub,
    recs: &[SnapshotRecord],
    report: &mut TransferReport,
) -> Result<Vec<(ManifestId, Bytes)>> {
    let mut out: Vec<(ManifestId, Bytes)> = Vec::new();
    let mut held = 0usize;
    for f in recs.iter().flat_map(|r| r.files.values()) {
        if view.has_manifest(&f.manifest)? || out.iter().any(|(m, _)| *m == f.manifest) {
            continue;
        }
        let id = f.manifest;
        let bytes = hub.get(&Key::Manifest(id)).await?.ok_or_else(|| {
            Refused(format!(
                "{} lacks manifest {id}; push the snapshot again",
                hub.describe()
            ))
        })?;
        held += bytes.len();
        if held > MAX_PULL_MANIFEST_BYTES {
            return Err(Refused(format!(
                "the snapshots to pull from {} name over {} MiB of manifests; pull an older snapshot of the chain first, then this one",
                hub.describe(),
                MAX_PULL_MANIFEST_BYTES >> 20
            ))
            .into());
        }
        let b = bytes.clone();
        blocking(move || Ok(decode_manifest(&id, &b)?))
            .await
            .map_err(|e| {
                Refused(format!(
                    "manifest {id} from {} failed verification ({e:#}); the hub copy is corrupt, re-push it",
                    hub.describe()
                ))
            })?;
        report.manifests += 1;
        report.wire_bytes += bytes.len() as u64;
        out.push((id, bytes));
    }
    Ok(out)
}

/// Decodes a manifest already verified by [`fetch_manifests`].
fn decode_manifest_unchecked(bytes: &[u8]) -> Result<forkd_layers::FileManifest> {
    forkd_layers::FileManifest::decode(bytes).map_err(|e| anyhow!("manifest: {e}"))
}

/// Layout 1: downloads `missing` chunks with bounded parallelism, verifies
/// each and imports them in durable batches on a blocking thread.
async fn fetch_chunks(
    store: &Arc<Store>,
    hub: &Hub,
    missing: &[ChunkId],
    total_raw: u64,
    opts: &PullOptions,
    report: &mut TransferReport,
) -> Result<()> {
    let progress = Progress::new("pull", opts.quiet);
    progress.set_total(total_raw);
    let jobs = opts.jobs.unwrap_or_else(|| hub.default_jobs()).max(1);
    let (tx, importer) = start_importer(store, jobs, opts);
    let mut fetches = futures::stream::iter(missing.iter().copied())
        .map(|id| fetch_chunk(hub, id))
        .buffer_unordered(jobs);
    let mut failed = None;
    while let Some(r) = fetches.next().await {
        match r {
            Ok((c, wire)) => {
                report.wire_bytes += wire;
                progress.inc(u64::from(c.raw_len));
                if tx.send(c).await.is_err() {
                    break; // the importer failed; its error follows
                }
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    drop(fetches);
    finish_import(tx, importer, failed, &progress, report).await
}

/// Layout 2: reads the missing chunks from their packs (whole packs when
/// most of one is wanted, coalesced ranges otherwise), verifies each and
/// imports them in durable batches.
async fn fetch_packed(
    store: &Arc<Store>,
    hub: &Hub,
    missing: &[ChunkId],
    map: &ChunkMap,
    total_raw: u64,
    opts: &PullOptions,
    report: &mut TransferReport,
) -> Result<()> {
    let progress = Progress::new("pull", opts.quiet);
    progress.set_total(total_raw);
    let jobs = opts.jobs.unwrap_or_else(|| hub.default_jobs()).max(1);
    let wanted: Vec<(ChunkId, Location)> = missing
        .iter()
        .map(|c| (*c, *map.get(c).expect("located")))
        .collect();
    let reads = plan_reads(&wanted, Coalesce::BULK);
    // Whole packs are up to 64 MiB: fewer of them at once.
    let jobs = jobs.min(PACK_UPLOADS * 2);
    let (tx, importer) = start_importer(store, jobs, opts);
    let mut fetches = futures::stream::iter(reads)
        .map(|r| async move {
            let key = Key::Pack(r.object);
            let b = if r.object_len == Some(r.len) && r.start == 0 {
                hub.get(&key).await?
            } else {
                hub.get_range(&key, r.start, r.len).await?
            };
            let b = b.ok_or_else(|| {
                Refused(format!(
                    "{} lacks pack {}; the hub is incomplete, push the snapshot again",
                    hub.describe(),
                    r.object
                ))
            })?;
            let wire = b.len() as u64;
            let chunks = blocking(move || {
                split_read(&r, &b)
                    .into_iter()
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|(id, why)| anyhow!("chunk {id}: {why}"))
            })
            .await
            .map_err(|e| {
                Refused(format!(
                    "{e:#} — from {} failed verification; the hub copy is corrupt, re-push it",
                    hub.describe()
                ))
            })?;
            anyhow::Ok((chunks, wire))
        })
        .buffer_unordered(jobs);
    let mut failed = None;
    'outer: while let Some(r) = fetches.next().await {
        match r {
            Ok((chunks, wire)) => {
                report.wire_bytes += wire;
                for c in chunks {
                    progress.inc(u64::from(c.raw_len));
                    if tx.send(c).await.is_err() {
                        break 'outer;
                    }
                }
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    drop(fetches);
    finish_import(tx, importer, failed, &progress, report).await
}

type Importer = tokio::task::JoinHandle<Result<ChunkImport>>;

fn start_importer(
    store: &Arc<Store>,
    jobs: usize,
    opts: &PullOptions,
) -> (tokio::sync::mpsc::Sender<VerifiedChunk>, Importer) {
    let (tx, rx) = tokio::sync::mpsc::channel::<VerifiedChunk>(jobs * 4);
    let (store, cb) = (store.clone(), opts.on_chunks.clone());
    (
        tx,
        tokio::task::spawn_blocking(move || import_loop(&store, rx, cb)),
    )
}

async fn finish_import(
    tx: tokio::sync::mpsc::Sender<VerifiedChunk>,
    importer: Importer,
    failed: Option<anyhow::Error>,
    progress: &Progress,
    report: &mut TransferReport,
) -> Result<()> {
    drop(tx);
    let imported = importer.await.context("the chunk importer panicked")?;
    progress.finish();
    if let Some(e) = failed {
        return Err(e);
    }
    let imported = imported?;
    report.chunks = imported.new_chunks;
    report.raw_bytes = imported.new_raw_bytes;
    report.stored_bytes = imported.new_stored_bytes;
    Ok(())
}

/// Fetches one chunk object and verifies it against its id.
async fn fetch_chunk(hub: &Hub, id: ChunkId) -> Result<(VerifiedChunk, u64)> {
    let b = hub.get(&Key::Chunk(id)).await?.ok_or_else(|| {
        Refused(format!(
            "{} lacks chunk {id}; the hub is incomplete, push the snapshot again",
            hub.describe()
        ))
    })?;
    let wire = b.len() as u64;
    let verified = blocking(move || {
        decode_chunk(id, &b)
            .and_then(|c| c.verify())
            .map_err(|reason| anyhow!(reason))
    })
    .await
    .map_err(|e| {
        Refused(format!(
            "chunk {id} from {} failed verification ({e:#}); the hub copy is corrupt, re-push it",
            hub.describe()
        ))
    })?;
    Ok((verified, wire))
}

/// Receives verified chunks and imports them in batches.
fn import_loop(
    store: &Store,
    mut rx: tokio::sync::mpsc::Receiver<VerifiedChunk>,
    on_chunks: Option<ChunksCallback>,
) -> Result<ChunkImport> {
    let mut total = ChunkImport::default();
    let mut batch: Vec<VerifiedChunk> = Vec::new();
    let mut bytes = 0;
    loop {
        let next = rx.blocking_recv();
        let done = next.is_none();
        if let Some(c) = next {
            bytes += c.payload.len();
            batch.push(c);
        }
        if !batch.is_empty()
            && (done || batch.len() >= IMPORT_BATCH_CHUNKS || bytes >= IMPORT_BATCH_BYTES)
        {
            let r = store.import_chunks(&batch)?;
            total.new_chunks += r.new_chunks;
            total.present_chunks += r.present_chunks;
            total.new_raw_bytes += r.new_raw_bytes;
            total.new_stored_bytes += r.new_stored_bytes;
            batch.clear();
            bytes = 0;
            if let Some(cb) = &on_chunks {
                cb(total.new_chunks + total.present_chunks);
            }
        }
        if done {
            return Ok(total);
        }
    }
}
