//! Pull: a snapshot's chain from a hub, whole or lazily (see the parent
//! module).

use super::{
    load_index, resolve_remote, ChunksCallback, Hub, PullOptions, Refused, TransferReport,
    METADATA_GETS, PACK_UPLOADS,
};
use crate::{blocking, compat};
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use forkd_layers::{
    decode_manifest, decode_record, validate_tag, ChunkId, ChunkImport, ChunkRef, ManifestId,
    ObjectId, RemoteChunk, SnapshotId, SnapshotRecord, Store, StoreView, VerifiedChunk, WorkingSet,
};
use forkd_remote::layout::{decode_chunk, Key, Locator, LAYOUT_PACKED};
use forkd_remote::packs::{plan_reads, split_read, ChunkMap, Coalesce, Location, RangeRead};
use forkd_remote::Credentials;
use forkd_snapshot::Progress;
use futures::StreamExt;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;
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
/// Most working-set bytes one pull holds.
const MAX_PULL_WORKING_SET_BYTES: usize = 256 << 20;
/// Chunks per durable import batch (or [`IMPORT_BATCH_BYTES`], whichever first).
const IMPORT_BATCH_CHUNKS: usize = 256;
const IMPORT_BATCH_BYTES: usize = 16 << 20;

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
    let ((head_id, is_tag), layout) = futures::try_join!(resolve_remote(hub, name), hub.layout())?;
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

    // A full pull also completes the lazy snapshots of the chain it finds
    // here (their chunks are located, not indexed).
    let local_lazy: Vec<SnapshotId> = view
        .chain(&head_id)
        .unwrap_or_default()
        .iter()
        .map(|r| r.id)
        .filter(|id| view.lazy_source(id).ok().flatten().is_some())
        .collect();
    // The manifests, where the chunks lie and the working sets do not
    // depend on each other: their requests go out together, so this part
    // costs a lazy pull two round trips, not one per object.
    let locate: Vec<SnapshotId> = match layout {
        LAYOUT_PACKED => to_import
            .iter()
            .map(|r| r.id)
            .chain(local_lazy.iter().copied())
            .collect(),
        _ => Vec::new(),
    };
    let mut side = [
        TransferReport::default(),
        TransferReport::default(),
        TransferReport::default(),
    ];
    let [r_manifests, r_located, r_ws] = &mut side;
    // A refused manifest or working set ends the others at once; where the
    // chunks lie is needed (and its failure an error) only if some are
    // missing, known after the manifests.
    let (manifests, located, working_sets) = tokio::try_join!(
        fetch_manifests(&view, hub, &to_import, r_manifests),
        async { Ok(locate_chunks(hub, view.root(), &locate, r_located).await) },
        fetch_working_sets(hub, &to_import, r_ws),
    )?;
    for r in &side {
        report.wire_bytes += r.wire_bytes;
        report.manifests += r.manifests;
    }
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

    // Where the missing chunks are (layout 2). A hub that cannot say is an
    // error only when something is missing.
    let mut map = ChunkMap::default();
    if layout == LAYOUT_PACKED && !missing.is_empty() {
        map = located?;
        if let Some((c, _)) = missing.iter().find(|(c, _)| map.get(c).is_none()) {
            return Err(Refused(format!(
                "the index objects of {} do not locate chunk {c}; push the snapshot again",
                hub.describe()
            ))
            .into());
        }
    }
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

/// The working sets the hub holds for `recs` (absent ones are fine), their
/// GETs at once.
async fn fetch_working_sets(
    hub: &Hub,
    recs: &[SnapshotRecord],
    report: &mut TransferReport,
) -> Result<Vec<(SnapshotId, WorkingSet)>> {
    let mut got = futures::stream::iter(recs)
        .map(|rec| async move { (rec.id, hub.get(&Key::WorkingSet(rec.id)).await) })
        .buffered(METADATA_GETS);
    let mut out = Vec::new();
    let mut held = 0usize;
    while let Some((id, b)) = got.next().await {
        let Some(b) = b? else { continue };
        held += b.len();
        if held > MAX_PULL_WORKING_SET_BYTES {
            return Err(Refused(format!(
                "the working sets of the snapshots to pull from {} pass {} MiB in total (a real one is KiBs to a few MiB); the hub copy is altered or hostile",
                hub.describe(),
                MAX_PULL_WORKING_SET_BYTES >> 20
            ))
            .into());
        }
        report.wire_bytes += b.len() as u64;
        let ws = WorkingSet::decode(&id, &b).map_err(|e| {
            Refused(format!(
                "the working set of snapshot {id} from {} is invalid: {e}",
                hub.describe()
            ))
        })?;
        out.push((id, ws));
    }
    Ok(out)
}

/// Where the chunks of `snaps` lie on a layout-2 hub: their locators, then
/// the index objects those name, each set of GETs at once.
async fn locate_chunks(
    hub: &Hub,
    store_root: &Path,
    snaps: &[SnapshotId],
    report: &mut TransferReport,
) -> Result<ChunkMap> {
    if snaps.is_empty() {
        return Ok(ChunkMap::default());
    }
    let mut got = futures::stream::iter(snaps)
        .map(|id| async move { (*id, hub.get(&Key::Locator(*id)).await) })
        .buffered(METADATA_GETS);
    let mut indexes: BTreeSet<ObjectId> = BTreeSet::new();
    while let Some((id, b)) = got.next().await {
        let b = b?.ok_or_else(|| {
            Refused(format!(
                "{} lacks the chunk locator of snapshot {id}; push it again",
                hub.describe()
            ))
        })?;
        report.wire_bytes += b.len() as u64;
        indexes.extend(Locator::decode(&id, &b)?.indexes);
    }
    let ids: Vec<ObjectId> = indexes.into_iter().collect();
    load_index(hub, store_root, Some(&ids), report).await
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

/// Fetches and verifies the manifests of `recs` this store lacks, a few
/// GETs at once.
async fn fetch_manifests(
    view: &StoreView,
    hub: &Hub,
    recs: &[SnapshotRecord],
    report: &mut TransferReport,
) -> Result<Vec<(ManifestId, Bytes)>> {
    let mut ids: Vec<ManifestId> = Vec::new();
    for f in recs.iter().flat_map(|r| r.files.values()) {
        if !ids.contains(&f.manifest) && !view.has_manifest(&f.manifest)? {
            ids.push(f.manifest);
        }
    }
    let mut got = futures::stream::iter(ids)
        .map(|id| async move { (id, hub.get(&Key::Manifest(id)).await) })
        .buffered(METADATA_GETS);
    let mut out: Vec<(ManifestId, Bytes)> = Vec::new();
    let mut held = 0usize;
    while let Some((id, bytes)) = got.next().await {
        let bytes = bytes?.ok_or_else(|| {
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
            let b = read_pack(hub, &r).await?;
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

/// One planned read of a pack. A pack that is missing but promised by a
/// push still running (its fresh pending marker, on a plain object store;
/// a running push keeps its markers fresh) is waited for, polling with
/// backoff; a missing pack without one is refused, after one more look in
/// case it landed between the two requests.
async fn read_pack(hub: &Hub, r: &RangeRead) -> Result<Bytes> {
    let key = Key::Pack(r.object);
    let mut delay = Duration::from_millis(100);
    let mut looked_again = false;
    loop {
        let b = if r.object_len == Some(r.len) && r.start == 0 {
            hub.get(&key).await?
        } else {
            hub.get_range(&key, r.start, r.len).await?
        };
        if let Some(b) = b {
            return Ok(b);
        }
        if hub.is_object_store() && hub.pack_pending(&r.object).await? {
            looked_again = false;
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        } else if looked_again {
            return Err(Refused(format!(
                "{} lacks pack {}; the hub is incomplete, push the snapshot again",
                hub.describe(),
                r.object
            ))
            .into());
        } else {
            looked_again = true;
        }
    }
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
