//! Push: what the hub lacks of a snapshot's chain, in packs (or an object
//! per chunk on a layout-1 hub), then the objects that name them, the tag
//! last (see the parent module).

use super::{cache_index, load_index, Hub, PushOptions, TransferReport, PACK_UPLOADS};
use crate::blocking;
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use forkd_layers::{
    validate_tag, ChunkId, ManifestId, ObjectId, SnapshotId, SnapshotRecord, StoreView,
};
use forkd_remote::layout::{
    encode_chunk, Key, LayoutObject, Locator, TagObject, LAYOUT_CHUNKS, LAYOUT_PACKED,
};
use forkd_remote::packs::{ChunkMap, Index, PackBuilder, DEFAULT_PACK_BYTES};
use forkd_snapshot::Progress;
use futures::{StreamExt, TryStreamExt};
use std::collections::{BTreeSet, HashSet};
use std::time::Instant;

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
