//! Push: what the hub lacks of a snapshot's chain, in packs (or an object
//! per chunk on a layout-1 hub), then the objects that name them, the tag
//! last (see the parent module).
//!
//! **Publishing early.** On a plain object store (file, S3) a push whose
//! snapshot has a recorded working set publishes once the working set's
//! packs are up: it plans the other packs (ids and entries, built once and
//! dropped), writes a pending marker for each (`forkd_remote::layout`,
//! "Pending packs"), the index naming all of them, then manifests, locators,
//! working sets, records and tag, and only then uploads the other packs,
//! built again byte for byte, removing each marker as its pack lands. Other
//! hosts start their lazy pulls after the working set instead of after the
//! whole snapshot. Invariant: every pack an index on the hub names is on
//! the hub, or has a marker. A push also first uploads any pack an
//! unfinished earlier push promised whose chunks this store holds, so
//! running a failed push again completes it.

use super::{
    cache_index, index_object, load_index, Hub, Published, PushOptions, TransferReport,
    PACK_UPLOADS,
};
use crate::blocking;
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use forkd_layers::{
    validate_tag, ChunkId, ManifestId, ObjectId, SnapshotId, SnapshotRecord, StoreView,
};
use forkd_remote::layout::{
    encode_chunk, Key, LayoutObject, Locator, PendingObject, TagObject, LAYOUT_CHUNKS,
    LAYOUT_PACKED,
};
use forkd_remote::packs::{ChunkMap, Index, PackBuilder, PackInfo, DEFAULT_PACK_BYTES};
use forkd_snapshot::Progress;
use futures::{StreamExt, TryStreamExt};
use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

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
    let mut late = None;
    if layout == LAYOUT_PACKED {
        (chunk_map, late) =
            send_packs(&view, hub, &candidates, &missing_recs, opts, &mut report).await?;
    } else {
        push_chunk_objects(&view, hub, &candidates, opts, &mut report).await?;
    }
    hub.flush().await?;
    let names = Names {
        head: head.id,
        records: &missing_recs,
        manifests: &manifests,
        layout,
        chunk_map: &chunk_map,
    };
    put_names(&view, hub, &names, &mut report).await?;
    // A tag refused here still lets the packs already promised go up.
    let tagged = match &hub_tag {
        Some(t) => publish_tag(&view, hub, t, head.id, opts, &mut report).await,
        None => Ok(()),
    };
    let published = Published {
        after: start.elapsed(),
        late_packs: late.as_ref().map_or(0, |l| l.planned.len() as u64),
        late_bytes: late
            .as_ref()
            .map_or(0, |l| l.planned.iter().map(|p| p.len).sum()),
    };
    report.published_after = Some(published.after);
    if let (Some(cb), true) = (&opts.on_publish, tagged.is_ok()) {
        cb(&published);
    }
    if let Some(late) = late {
        let sent = upload_late(
            &view,
            hub,
            late.planned,
            late.index,
            &late.progress,
            &mut report,
        )
        .await;
        late.progress.finish();
        if let Err(e) = sent {
            let tag = match &tagged {
                Ok(()) => String::new(),
                Err(t) => format!(" (and the tag was not published: {t:#})"),
            };
            return Err(e.context(format!(
                "the records of snapshot {} are on {}, but not all of its packs{tag}: run the push again to complete it",
                head.id,
                hub.describe(),
            )));
        }
    }
    tagged?;
    report.requests = hub.traffic().since(&traffic0).requests;
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Packs a push uploads after publishing, and its progress bar.
struct Late {
    planned: Vec<PackInfo>,
    /// The index naming them (what their markers say).
    index: ObjectId,
    progress: Progress,
}

/// Layout 2: completes what earlier pushes promised, then sends the chunks
/// the hub lacks in packs, working set first, and the index naming them.
/// On a plain object store with a working set, only the working set's
/// packs are sent here; the rest are planned, marked pending and named by
/// the index, and returned to be sent after publishing. Returns where the
/// hub's chunks are.
async fn send_packs(
    view: &StoreView,
    hub: &Hub,
    candidates: &[ChunkId],
    missing_recs: &[SnapshotRecord],
    opts: &PushOptions,
    report: &mut TransferReport,
) -> Result<(ChunkMap, Option<Late>)> {
    let mut chunk_map = load_index(hub, view.root(), None, report).await?;
    if hub.is_object_store() {
        complete_pending(view, hub, report).await?;
    }
    let missing: Vec<ChunkId> = candidates
        .iter()
        .filter(|c| chunk_map.get(c).is_none())
        .copied()
        .collect();
    let (mut ordered, ws_len) = {
        let (view, recs) = (view.clone(), missing_recs.to_vec());
        blocking(move || working_set_first(&view, &recs, missing)).await?
    };
    let progress = Progress::new("push", opts.quiet);
    progress.set_total(stored_total(view, &ordered)?);
    let early = hub.is_object_store() && ws_len > 0 && ws_len < ordered.len();
    let mut late = None;
    let mut packs = Vec::new();
    if early {
        let rest = ordered.split_off(ws_len);
        let plan = {
            let view = view.clone();
            let target = opts
                .pack_bytes
                .unwrap_or(DEFAULT_PACK_BYTES)
                .min(LATE_PACK_BYTES);
            tokio::task::spawn_blocking(move || plan_packs(&view, rest, target))
        };
        packs = upload_packs(view, hub, ordered, opts, &progress, report).await?;
        let planned = plan.await.context("planning the packs panicked")??;
        packs.extend(planned.iter().cloned());
        let index_id = ObjectId::of(
            &Index {
                packs: packs.clone(),
            }
            .encode(),
        );
        mark_pending(hub, &planned, index_id).await?;
        late = Some(Late {
            planned,
            index: index_id,
            progress,
        });
    } else {
        if !ordered.is_empty() {
            packs = upload_packs(view, hub, ordered, opts, &progress, report).await?;
        }
        progress.finish();
    }
    if !packs.is_empty() {
        let index = Index { packs };
        let id = put_index(view, hub, &index, report).await?;
        chunk_map.add(id, &index);
    }
    Ok((chunk_map, late))
}

/// What names a push's chunks: the objects [`put_names`] writes.
struct Names<'a> {
    head: SnapshotId,
    records: &'a [SnapshotRecord],
    manifests: &'a [ManifestId],
    layout: u32,
    chunk_map: &'a ChunkMap,
}

/// Manifests → locators → working sets → records root first, flushing
/// before the records (each step names only what is already up).
async fn put_names(
    view: &StoreView,
    hub: &Hub,
    n: &Names<'_>,
    report: &mut TransferReport,
) -> Result<()> {
    let mkeys: Vec<Key> = n.manifests.iter().map(|m| Key::Manifest(*m)).collect();
    for (m, have) in n.manifests.iter().zip(hub.has(&mkeys).await?) {
        if !have {
            let bytes = Bytes::from(view.manifest_bytes(m)?);
            report.wire_bytes += bytes.len() as u64;
            report.manifests += 1;
            hub.put(&Key::Manifest(*m), bytes).await?;
        }
    }
    if n.layout == LAYOUT_PACKED {
        for rec in n.records {
            let locator = locator_of(view, rec, n.chunk_map)?;
            let b = locator.encode();
            report.wire_bytes += b.len() as u64;
            hub.put(&Key::Locator(rec.id), b).await?;
        }
    }
    // Working sets: of the records sent, and the head's if it was
    // recorded after an earlier push.
    let mut ws_recs: Vec<SnapshotId> = n.records.iter().map(|r| r.id).collect();
    if !ws_recs.contains(&n.head)
        && view.working_set(&n.head)?.is_some()
        && !hub.has(&[Key::WorkingSet(n.head)]).await?[0]
    {
        ws_recs.push(n.head);
    }
    for id in &ws_recs {
        if let Some(b) = view.annotation(id, forkd_layers::workingset::ANNOTATION)? {
            report.wire_bytes += b.len() as u64;
            report.working_set |= *id == n.head;
            hub.put(&Key::WorkingSet(*id), Bytes::from(b)).await?;
        }
    }
    hub.flush().await?;
    for rec in n.records {
        let json = Bytes::from(serde_json::to_vec(rec)?);
        report.wire_bytes += json.len() as u64;
        report.snapshots += 1;
        hub.put(&Key::Snapshot(rec.id), json).await?;
    }
    hub.flush().await
}

/// Publishes tag `t` for `head` (in turn with deletes). Refuses when the
/// local tag pushed was deleted or moved meanwhile.
async fn publish_tag(
    view: &StoreView,
    hub: &Hub,
    t: &str,
    head: SnapshotId,
    opts: &PushOptions,
    report: &mut TransferReport,
) -> Result<()> {
    // In turn with deletes (`lazy::unpublish_tag`): a tag deleted or
    // moved here while its chunks crossed is not published after it.
    let _turn = PUBLISH_TURN.lock().await;
    if opts.hub_tag.is_none() {
        view.catch_up()?;
        if view.tag(t)? != Some(head) {
            bail!(
                "tag '{t}' was deleted or moved here while snapshot {} was pushed: its chunks and record are on the hub, the tag is not (push the tag again if it should be)",
                head
            );
        }
    }
    let obj = TagObject { snapshot: head }.encode();
    report.wire_bytes += obj.len() as u64;
    hub.put(&Key::tag(t)?, obj).await?;
    hub.flush().await?;
    Ok(())
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
/// lazy host's prefetch then reads a few contiguous ranges. Also how many
/// come first.
fn working_set_first(
    view: &StoreView,
    recs: &[SnapshotRecord],
    missing: Vec<ChunkId>,
) -> Result<(Vec<ChunkId>, usize)> {
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
    let first = out.len();
    out.extend(missing.into_iter().filter(|c| !placed.contains(c)));
    Ok((out, first))
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

/// The stored bytes of `chunks` (what the progress bar counts).
fn stored_total(view: &StoreView, chunks: &[ChunkId]) -> Result<u64> {
    let mut total = 0;
    for c in chunks {
        total += view
            .chunk_location(c)?
            .map_or(0, |l| u64::from(l.stored_len));
    }
    Ok(total)
}

/// Packs `chunks` in order and uploads the packs as they close (a few at a
/// time). Returns the packs.
async fn upload_packs(
    view: &StoreView,
    hub: &Hub,
    chunks: Vec<ChunkId>,
    opts: &PushOptions,
    progress: &Progress,
    report: &mut TransferReport,
) -> Result<Vec<PackInfo>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let target = opts.pack_bytes.unwrap_or(DEFAULT_PACK_BYTES);
    let packer = {
        let view = view.clone();
        tokio::task::spawn_blocking(move || -> Result<(u64, u64, u64)> {
            let mut b = PackBuilder::new(target);
            let (mut n, mut stored, mut raw) = (0, 0, 0);
            for id in chunks {
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
    let uploaded: Result<Vec<PackInfo>> = tokio_stream_of(rx)
        .map(|p| async move {
            let len = p.bytes.len() as u64;
            hub.put(&Key::Pack(p.info.id), p.bytes)
                .await
                .with_context(|| format!("uploading pack {} to {}", p.info.id, hub.describe()))?;
            progress.inc(len);
            anyhow::Ok(p.info)
        })
        .buffered(jobs)
        .try_collect()
        .await;
    let counted = packer.await.context("the packer panicked")?;
    let packs = uploaded?;
    let (n, stored, raw) = counted?;
    report.chunks += n;
    report.stored_bytes += stored;
    report.raw_bytes += raw;
    report.packs += packs.len() as u64;
    report.wire_bytes += packs.iter().map(|p| p.len).sum::<u64>();
    Ok(packs)
}

/// The packs `chunks` make, in order, without keeping their bytes: the ids
/// an index can name before the packs are uploaded ([`upload_packs`] builds
/// the same packs from the same chunks).
fn plan_packs(view: &StoreView, chunks: Vec<ChunkId>, target: usize) -> Result<Vec<PackInfo>> {
    let mut b = PackBuilder::new(target);
    let mut out = Vec::new();
    for id in chunks {
        let c = view.stored_chunk(&id)?;
        if let Some(p) = b.add(&c) {
            out.push(p.info);
        }
    }
    out.extend(b.finish().map(|p| p.info));
    Ok(out)
}

/// Writes a pending marker for each planned pack of index `index` (a few
/// at a time), made durable before anything names the packs.
async fn mark_pending(hub: &Hub, planned: &[PackInfo], index: ObjectId) -> Result<()> {
    let marker = PendingObject::now(index).encode();
    futures::stream::iter(planned)
        .map(|p| {
            let key = Key::Pending(p.id);
            let marker = marker.clone();
            async move { hub.put(&key, marker).await }
        })
        .buffer_unordered(super::METADATA_GETS)
        .try_collect::<()>()
        .await?;
    hub.flush().await
}

/// Uploads `index` (after flushing the packs it names); returns its id.
async fn put_index(
    view: &StoreView,
    hub: &Hub,
    index: &Index,
    report: &mut TransferReport,
) -> Result<ObjectId> {
    hub.flush().await?;
    let bytes = index.encode();
    let id = ObjectId::of(&bytes);
    report.wire_bytes += bytes.len() as u64;
    hub.put(&Key::Index(id), bytes.clone()).await?;
    cache_index(view.root(), &id, &bytes);
    Ok(id)
}

/// The packs named by the markers in `dir` (`pending` or `wanted`).
async fn markers(hub: &Hub, dir: &str) -> Result<Vec<ObjectId>> {
    Ok(hub
        .list(dir)
        .await?
        .into_iter()
        .filter_map(|k| match k {
            Key::Pending(p) | Key::Wanted(p) => Some(p),
            _ => None,
        })
        .collect())
}

/// Uploads the packs that earlier pushes promised (pending markers) and
/// did not deliver, where this store holds their chunks: each is rebuilt
/// from its index entries and must hash to its id. Markers whose pack is
/// up, and stale ones nothing names, are removed; so are wanted markers of
/// packs that are up. A pack this store cannot rebuild stays promised:
/// this push counts on it as on any pack an index names (its readers wait
/// for it), and pushing the snapshot that promised it again completes it.
async fn complete_pending(view: &StoreView, hub: &Hub, report: &mut TransferReport) -> Result<()> {
    let (pending, wanted) = tokio::try_join!(markers(hub, "pending"), markers(hub, "wanted"))?;
    let mut still = HashSet::new();
    let keys: Vec<Key> = pending.iter().map(|p| Key::Pack(*p)).collect();
    let up = if keys.is_empty() {
        Vec::new()
    } else {
        hub.has(&keys).await?
    };
    for (pack, up) in pending.iter().zip(up) {
        if !up && !complete_one(view, hub, pack, report).await? {
            still.insert(*pack);
            continue;
        }
        hub.delete(&Key::Pending(*pack)).await?;
    }
    let wanted: Vec<ObjectId> = wanted.into_iter().filter(|p| !still.contains(p)).collect();
    let keys: Vec<Key> = wanted.iter().map(|p| Key::Pack(*p)).collect();
    let up = if keys.is_empty() {
        Vec::new()
    } else {
        hub.has(&keys).await?
    };
    for (pack, up) in wanted.iter().zip(up) {
        if up {
            hub.delete(&Key::Wanted(*pack)).await?;
        }
    }
    Ok(())
}

/// One promised pack that is not up: uploads it if this store can rebuild
/// it. True when its marker can go (the pack is up now, or the marker is
/// stale and nothing names the pack); false when it stays promised.
async fn complete_one(
    view: &StoreView,
    hub: &Hub,
    pack: &ObjectId,
    report: &mut TransferReport,
) -> Result<bool> {
    let Some(marker) = hub.get(&Key::Pending(*pack)).await? else {
        return Ok(true); // delivered and removed meanwhile
    };
    let marker = match PendingObject::decode(pack, &marker) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!("{e:#}; left alone");
            return Ok(false);
        }
    };
    if !hub.has(&[Key::Index(marker.index)]).await?[0] {
        // A push stopped before its index (nothing names the pack), or one
        // about to write it.
        return Ok(!marker.is_fresh());
    }
    let index = match index_object(hub, view.root(), &marker.index, report).await {
        Ok(i) => i,
        Err(e) => {
            tracing::warn!("pending pack {pack}: {e:#}; left promised");
            return Ok(false);
        }
    };
    let Some(info) = index.packs.iter().find(|p| p.id == *pack).cloned() else {
        return Ok(false); // a marker that does not match its index
    };
    let rebuilt = {
        let view = view.clone();
        blocking(move || rebuild_pack(&view, &info)).await
    };
    let rebuilt = match rebuilt {
        Ok(Some(r)) => r,
        Ok(None) => return Ok(false), // chunks this store does not hold
        Err(e) => {
            // E.g. the same chunks stored with other compression here.
            tracing::warn!("pending pack {pack}: {e:#}; left promised");
            return Ok(false);
        }
    };
    report.wire_bytes += rebuilt.bytes.len() as u64;
    hub.put(&Key::Pack(*pack), rebuilt.bytes).await?;
    hub.flush().await?;
    report.completed_packs += 1;
    Ok(true)
}

/// Pack `info` built again from this store's chunks, or `None` when the
/// store lacks one of them. Refuses bytes that do not hash to the pack's id.
fn rebuild_pack(view: &StoreView, info: &PackInfo) -> Result<Option<Rebuilt>> {
    let ids: Vec<ChunkId> = info.entries.iter().map(|e| e.chunk).collect();
    if view.has_chunks(&ids)?.iter().any(|h| !h) {
        return Ok(None);
    }
    let mut b = PackBuilder::new(usize::MAX);
    let mut built = None;
    let (mut stored, mut raw) = (0, 0);
    for (i, id) in ids.iter().enumerate() {
        let c = view.stored_chunk(id)?;
        stored += c.record_len();
        raw += u64::from(c.raw_len);
        if let Some(p) = b.add(&c) {
            if i + 1 < ids.len() {
                bail!("pack {} is larger than a pack may be", info.id);
            }
            built = Some(p);
        }
    }
    let built = built
        .or_else(|| b.finish())
        .ok_or_else(|| anyhow!("pack {} has no chunks", info.id))?;
    if built.info != *info {
        bail!(
            "pack {} built again from this store came out as {}; not uploaded",
            info.id,
            built.info.id
        );
    }
    Ok(Some(Rebuilt {
        bytes: built.bytes,
        stored,
        raw,
    }))
}

/// A pack built again ([`rebuild_pack`]) and what its chunks count for.
struct Rebuilt {
    bytes: Bytes,
    stored: u64,
    raw: u64,
}

/// The fill of a pack sent after publishing. A reader that faults on a
/// chunk outside the working set waits for that chunk's whole pack (asked
/// for, it is sent next); a smaller pack shortens the wait, at the cost of
/// more requests for the push (docs/BENCHMARKS.md, "Propagation").
const LATE_PACK_BYTES: usize = 2 << 20;

/// Packs uploaded at once after publishing: fewer than before it, so a
/// pack a reader waits for gets a larger share of the link.
const LATE_UPLOADS: usize = 2;

/// How often a push rewrites the markers of packs it has still to send,
/// well within `PENDING_MAX_AGE_SECS`, so readers keep waiting for a push
/// that is still running however long it takes.
const MARK_REFRESH: Duration = Duration::from_secs(600);

/// Uploads the planned packs after publishing, each built again from its
/// entries: packs readers asked for (`wanted/`) first, else in plan order.
/// Each pack's pending marker goes once it is up; the markers of the rest
/// are rewritten every [`MARK_REFRESH`]; wanted markers go at the end.
async fn upload_late(
    view: &StoreView,
    hub: &Hub,
    planned: Vec<PackInfo>,
    index: ObjectId,
    progress: &Progress,
    report: &mut TransferReport,
) -> Result<()> {
    let ours: HashSet<ObjectId> = planned.iter().map(|p| p.id).collect();
    let mut left: std::collections::VecDeque<PackInfo> = planned.into();
    let mut running = futures::stream::FuturesUnordered::new();
    let mut marked = Instant::now();
    let mut asked_for = HashSet::new();
    loop {
        while running.len() < LATE_UPLOADS && !left.is_empty() {
            if marked.elapsed() >= MARK_REFRESH {
                // The packs in flight keep their markers' age: each is
                // one upload from done.
                if let Err(e) = mark_pending(hub, left.make_contiguous(), index).await {
                    tracing::warn!("refreshing the pending markers: {e:#}");
                }
                marked = Instant::now();
            }
            let wanted = markers(hub, "wanted").await.unwrap_or_default();
            asked_for.extend(wanted.iter().copied());
            let next = left
                .iter()
                .position(|p| wanted.contains(&p.id))
                .and_then(|i| left.remove(i))
                .or_else(|| left.pop_front())
                .expect("a pack is left");
            running.push(send_late(view, hub, next, progress));
        }
        let Some(sent) = running.next().await else {
            break;
        };
        let (info, rebuilt) = sent?;
        report.chunks += info.entries.len() as u64;
        report.stored_bytes += rebuilt.stored;
        report.raw_bytes += rebuilt.raw;
        report.packs += 1;
        report.late_packs += 1;
        report.wire_bytes += info.len;
    }
    // Readers may have asked after the last look: one more.
    asked_for.extend(markers(hub, "wanted").await.unwrap_or_default());
    for p in asked_for.intersection(&ours) {
        if let Err(e) = hub.delete(&Key::Wanted(*p)).await {
            tracing::warn!("removing the wanted marker of pack {p}: {e:#}");
        }
    }
    Ok(())
}

/// One late pack: built again, uploaded, its pending marker removed.
async fn send_late(
    view: &StoreView,
    hub: &Hub,
    info: PackInfo,
    progress: &Progress,
) -> Result<(PackInfo, Rebuilt)> {
    let rebuilt = {
        let (view, info) = (view.clone(), info.clone());
        blocking(move || rebuild_pack(&view, &info)).await?
    }
    .ok_or_else(|| anyhow!("pack {}: a chunk left the local store mid-push", info.id))?;
    hub.put(&Key::Pack(info.id), rebuilt.bytes.clone())
        .await
        .with_context(|| format!("uploading pack {} to {}", info.id, hub.describe()))?;
    hub.flush().await?;
    hub.delete(&Key::Pending(info.id)).await?;
    progress.inc(info.len);
    Ok((info, rebuilt))
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
