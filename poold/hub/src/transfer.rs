//! Push and pull: move a snapshot and whatever of its parent chain the other
//! side lacks, sending only missing chunks.
//!
//! Push: one batched query for which chain records the hub has (a record
//! on the hub means all its chunks and manifests are there, since records
//! are written last), one batched have/want query for the remaining chunks,
//! then chunks (bounded parallelism) → flush → manifests → flush → records
//! root first → tag.
//!
//! Pull: fetch the chain's records back to the first snapshot this store
//! has, check QEMU compatibility (before any bulk transfer), fetch and
//! verify the missing manifests, ask the local index which of their chunks
//! are missing, download those in parallel, verify each against its id and
//! import them in durable batches, then store the manifests and commit the
//! records root first with their original ids, the tag last. A kill at any
//! point leaves a consistent store and a re-run skips every chunk already
//! imported. A hub that serves a corrupt or missing object makes the pull
//! fail naming it, and the chunks this run imported are dropped again, so
//! the store is as before.

use super::compat;
use super::layout::{decode_chunk, encode_chunk, Key, TagObject};
use super::{blocking, Hub};
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use forkd_layers::{
    decode_manifest, decode_record, validate_tag, ChunkId, ChunkImport, ChunkRef, ManifestId,
    SnapshotId, SnapshotRecord, Store, VerifiedChunk,
};
use forkd_snapshot::Progress;
use futures::{StreamExt, TryStreamExt};
use std::collections::HashSet;
use std::fmt;
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
/// Chunks per durable import batch (or [`IMPORT_BATCH_BYTES`], whichever first).
const IMPORT_BATCH_CHUNKS: usize = 256;
const IMPORT_BATCH_BYTES: usize = 16 << 20;

/// Called with the number of chunks imported so far after each durable
/// import batch.
pub type ChunksCallback = Arc<dyn Fn(u64) + Send + Sync>;

/// What a push or pull moved.
#[derive(Debug, Clone, Default)]
pub struct TransferReport {
    /// The snapshot pushed or pulled.
    pub snapshot: SnapshotId,
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
    /// Object bytes that crossed the wire (chunks, manifests, records, tag).
    pub wire_bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Compatibility warnings shown before a pull.
    pub warnings: Vec<String>,
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

/// Pushes snapshot `what` (tag or id) with the part of its parent chain the
/// hub lacks.
pub async fn push(
    store: Arc<Store>,
    what: &str,
    hub: &Hub,
    opts: &PushOptions,
) -> Result<TransferReport> {
    let start = Instant::now();
    let view = store.view();
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
        blocking(move || {
            let missing_ids: HashSet<SnapshotId> = missing.iter().map(|r| r.id).collect();
            let mut known = HashSet::new();
            for r in chain.iter().filter(|r| !missing_ids.contains(&r.id)) {
                known.extend(view.snapshot_chunks(r)?);
            }
            let mut cands = Vec::new();
            let mut manifests: Vec<ManifestId> = Vec::new();
            for r in &missing {
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
            Ok((cands, manifests))
        })
        .await?
    };
    let keys: Vec<Key> = candidates.iter().map(|c| Key::Chunk(*c)).collect();
    let have = hub.has(&keys).await?;
    let missing: Vec<ChunkId> = candidates
        .iter()
        .zip(have)
        .filter(|(_, h)| !h)
        .map(|(c, _)| *c)
        .collect();

    let mut report = TransferReport {
        snapshot: head.id,
        chunks_total: candidates.len() as u64,
        ..Default::default()
    };
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
    hub.flush().await?;
    for rec in &missing_recs {
        let json = Bytes::from(serde_json::to_vec(rec)?);
        report.wire_bytes += json.len() as u64;
        report.snapshots += 1;
        hub.put(&Key::Snapshot(rec.id), json).await?;
    }
    hub.flush().await?;
    if let Some(t) = &hub_tag {
        let obj = TagObject { snapshot: head.id }.encode();
        report.wire_bytes += obj.len() as u64;
        hub.put(&Key::tag(t)?, obj).await?;
        hub.flush().await?;
    }
    report.elapsed = start.elapsed();
    Ok(report)
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
/// chain this store lacks.
pub async fn pull(
    store: Arc<Store>,
    hub: &Hub,
    name: &str,
    opts: &PullOptions,
) -> Result<TransferReport> {
    let start = Instant::now();
    let view = store.view();
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
    let mut report = TransferReport {
        snapshot: head_id,
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
    report.chunks_total = needed.len() as u64;
    let ids: Vec<ChunkId> = needed.iter().map(|(c, _)| *c).collect();
    let have = view.has_chunks(&ids)?;
    let missing: Vec<(ChunkId, u64)> = needed
        .into_iter()
        .zip(have)
        .filter(|(_, h)| !h)
        .map(|(c, _)| c)
        .collect();
    let total_raw = missing.iter().map(|(_, n)| n).sum();
    let missing: Vec<ChunkId> = missing.into_iter().map(|(c, _)| c).collect();

    if let Err(e) = fetch_chunks(&store, hub, &missing, total_raw, opts, &mut report).await {
        if e.is::<Refused>() {
            let (store, missing) = (store.clone(), missing.clone());
            blocking(move || Ok(store.discard_chunks(&missing)?))
                .await
                .context("dropping the chunks of the refused pull")?;
        }
        return Err(e);
    }

    let (store2, to_import2) = (store.clone(), to_import.clone());
    let tag = local_tag.clone();
    let force = opts.force;
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
        Ok(())
    })
    .await?;
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Fetches the records of `head` and its ancestors back to the first one
/// this store has; returns the missing ones root first.
async fn fetch_chain(
    view: &forkd_layers::StoreView,
    hub: &Hub,
    head: SnapshotId,
) -> Result<Vec<SnapshotRecord>> {
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
    view: &forkd_layers::StoreView,
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

/// Downloads `missing` chunks with bounded parallelism, verifies each and
/// imports them in durable batches on a blocking thread.
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
    let (tx, rx) = tokio::sync::mpsc::channel::<VerifiedChunk>(jobs * 4);
    let importer = {
        let (store, cb) = (store.clone(), opts.on_chunks.clone());
        tokio::task::spawn_blocking(move || import_loop(&store, rx, cb))
    };
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
