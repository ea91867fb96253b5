//! `forkd hub migrate URL`: turns a layout-1 hub (one object per chunk) into
//! layout 2 (packs and indexes) in place (docs/hub.md, "Migrating a hub").
//!
//! Order, so that the hub is valid for every reader at every moment:
//! 1. every snapshot's chunks are read from their chunk objects, verified,
//!    and written into packs (working set first, parents before children),
//!    then one index object for them: layout-1 readers ignore all of this;
//! 2. a locator per snapshot;
//! 3. `layout.json` = 2, last: from then on readers use the packs.
//!
//! A killed migration leaves a valid layout-1 hub; a re-run reads the
//! index objects already written and packs only what they lack (it
//! resumes). Snapshots pushed (as layout 1) while it runs are picked up by
//! a last listing before step 3; stop pushes during a migration anyway.
//! The chunk objects stay until `--prune` (after step 3) deletes them:
//! until then a forkd from before layouts can still pull every snapshot
//! that existed before the migration.

use crate::transfer::{load_index, Refused, TransferReport};
use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use forkd_layers::{decode_manifest, decode_record, ChunkId, ObjectId, SnapshotId, SnapshotRecord};
use forkd_remote::layout::{decode_chunk, Key, LayoutObject, Locator, LAYOUT_PACKED};
use forkd_remote::packs::{ChunkMap, Index, PackBuilder, DEFAULT_PACK_BYTES};
use forkd_remote::Hub;
use futures::StreamExt;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;

/// What a migration did.
#[derive(Debug, Clone, Default)]
pub struct MigrateReport {
    /// Snapshots given a locator.
    pub snapshots: u64,
    /// Chunks read from chunk objects and packed.
    pub chunks: u64,
    /// Packs written.
    pub packs: u64,
    /// Chunk objects deleted (`--prune`).
    pub pruned: u64,
    /// Requests sent to the hub (HTTP and S3 hubs).
    pub requests: u64,
    /// The hub was layout 2 already.
    pub already: bool,
}

impl MigrateReport {
    /// One line for the CLI.
    pub fn summary(&self) -> String {
        format!(
            "{}{} snapshots located, {} chunks packed into {} packs, {} chunk objects pruned, {} requests",
            if self.already {
                "(already layout 2) "
            } else {
                "now layout 2: "
            },
            self.snapshots,
            self.chunks,
            self.packs,
            self.pruned,
            self.requests
        )
    }
}

/// Migrates `hub` to layout 2; `cache` is where index objects are cached
/// (a store root). With `prune`, deletes the layout-1 chunk objects after.
pub async fn migrate(
    hub: &Hub,
    cache: &Path,
    prune: bool,
    jobs: Option<usize>,
) -> Result<MigrateReport> {
    let traffic0 = hub.traffic();
    let mut report = MigrateReport::default();
    let mut scratch = TransferReport::default();
    let already = hub.layout().await? == LAYOUT_PACKED;
    report.already = already;
    let mut map: ChunkMap = load_index(hub, cache, None, &mut scratch).await?;
    let mut done: HashSet<SnapshotId> = HashSet::new();
    let mut all_chunks: BTreeSet<ChunkId> = BTreeSet::new();
    loop {
        let recs = snapshots(hub, &done).await?;
        if recs.is_empty() {
            break;
        }
        let mut index = Index::default();
        let mut builder = PackBuilder::new(DEFAULT_PACK_BYTES);
        // Packed in this round, not yet in an index object.
        let mut packed: HashSet<ChunkId> = HashSet::new();
        for rec in &recs {
            let chunks = chunks_of(hub, rec).await?;
            all_chunks.extend(chunks.iter().copied());
            let todo: Vec<ChunkId> = chunks
                .into_iter()
                .filter(|c| map.get(c).is_none() && !packed.contains(c))
                .collect();
            if already && !todo.is_empty() {
                return Err(anyhow!(
                    "{} is layout 2 but snapshot {} has {} chunks no index object locates; push it again",
                    hub.describe(),
                    rec.id,
                    todo.len()
                ));
            }
            let jobs = jobs.unwrap_or_else(|| hub.default_jobs()).max(1);
            let mut fetched = futures::stream::iter(todo)
                .map(|id| async move {
                    let b = hub
                        .get(&Key::Chunk(id))
                        .await?
                        .ok_or_else(|| Refused(format!("{} lacks chunk {id}", hub.describe())))?;
                    let c = decode_chunk(id, &b)
                        .and_then(|c| c.verify())
                        .map_err(|why| {
                            Refused(format!(
                                "chunk {id} on {} failed verification ({why}); it was not migrated",
                                hub.describe()
                            ))
                        })?;
                    anyhow::Ok(c)
                })
                .buffered(jobs);
            while let Some(c) = fetched.next().await {
                let c = c?;
                if !packed.insert(c.id) {
                    continue;
                }
                report.chunks += 1;
                if let Some(p) = builder.add(&c) {
                    put_pack(hub, &p).await?;
                    report.packs += 1;
                    index.packs.push(p.info);
                }
            }
        }
        if let Some(p) = builder.finish() {
            put_pack(hub, &p).await?;
            report.packs += 1;
            index.packs.push(p.info);
        }
        hub.flush().await?;
        if !index.packs.is_empty() {
            let bytes = index.encode();
            let id = ObjectId::of(&bytes);
            hub.put(&Key::Index(id), bytes).await?;
            hub.flush().await?;
            map.add(id, &index);
        }
        for rec in &recs {
            let chunks = chunks_of(hub, rec).await?;
            let mut indexes = BTreeSet::new();
            for c in &chunks {
                let loc = map
                    .get(c)
                    .ok_or_else(|| anyhow!("chunk {c} of snapshot {} was not packed", rec.id))?;
                indexes.insert(loc.index);
            }
            let loc = Locator {
                layout: LAYOUT_PACKED,
                indexes: indexes.into_iter().collect(),
            };
            hub.put(&Key::Locator(rec.id), loc.encode()).await?;
            report.snapshots += 1;
            done.insert(rec.id);
        }
        hub.flush().await?;
    }
    if !already {
        hub.put(
            &Key::Layout,
            LayoutObject {
                layout: LAYOUT_PACKED,
            }
            .encode(),
        )
        .await?;
        hub.flush().await?;
    }
    if prune {
        let present = hub
            .has(
                &all_chunks
                    .iter()
                    .map(|c| Key::Chunk(*c))
                    .collect::<Vec<_>>(),
            )
            .await?;
        for (c, have) in all_chunks.iter().zip(present) {
            if have {
                hub.delete(&Key::Chunk(*c)).await?;
                report.pruned += 1;
            }
        }
        hub.flush().await?;
    }
    report.requests = hub.traffic().since(&traffic0).requests;
    Ok(report)
}

async fn put_pack(hub: &Hub, p: &forkd_remote::packs::BuiltPack) -> Result<()> {
    hub.put(&Key::Pack(p.info.id), p.bytes.clone())
        .await
        .with_context(|| format!("uploading pack {} to {}", p.info.id, hub.describe()))
}

/// The hub's snapshot records not in `done`, parents first.
async fn snapshots(hub: &Hub, done: &HashSet<SnapshotId>) -> Result<Vec<SnapshotRecord>> {
    let mut recs: HashMap<SnapshotId, SnapshotRecord> = HashMap::new();
    for k in hub.list("snapshots").await? {
        let Key::Snapshot(id) = k else { continue };
        if done.contains(&id) {
            continue;
        }
        let b = hub
            .get(&k)
            .await?
            .ok_or_else(|| anyhow!("{} vanished while migrating", k))?;
        recs.insert(id, decode_record(&id, &b)?);
    }
    // Parents before children (a record's parent is pushed first).
    let mut out = Vec::with_capacity(recs.len());
    let mut placed: HashSet<SnapshotId> = HashSet::new();
    while !recs.is_empty() {
        let ready: Vec<SnapshotId> = recs
            .values()
            .filter(|r| {
                r.parent
                    .is_none_or(|p| !recs.contains_key(&p) || placed.contains(&p))
            })
            .map(|r| r.id)
            .collect();
        if ready.is_empty() {
            return Err(anyhow!(
                "the snapshot records on {} form a loop",
                hub.describe()
            ));
        }
        for id in ready {
            placed.insert(id);
            out.push(recs.remove(&id).expect("listed"));
        }
    }
    Ok(out)
}

/// The distinct chunks a hub record names: its working set first (when the
/// hub has one), then its files in slot order.
async fn chunks_of(hub: &Hub, rec: &SnapshotRecord) -> Result<Vec<ChunkId>> {
    let mut manifests = HashMap::new();
    for f in rec.files.values() {
        if manifests.contains_key(&f.manifest) {
            continue;
        }
        let b: Bytes = hub
            .get(&Key::Manifest(f.manifest))
            .await?
            .ok_or_else(|| anyhow!("{} lacks manifest {}", hub.describe(), f.manifest))?;
        manifests.insert(f.manifest, decode_manifest(&f.manifest, &b)?);
    }
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    if let Some(b) = hub.get(&Key::WorkingSet(rec.id)).await? {
        if let Ok(ws) = forkd_layers::WorkingSet::decode(&rec.id, &b) {
            for &(fi, slot) in &ws.reads {
                let Some(m) = ws
                    .files
                    .get(fi as usize)
                    .and_then(|f| rec.files.get(f))
                    .and_then(|r| manifests.get(&r.manifest))
                else {
                    continue;
                };
                if let Some(forkd_layers::ChunkRef::Chunk(c)) =
                    ((slot as usize) < m.len()).then(|| m.entry(slot as usize))
                {
                    if seen.insert(c) {
                        out.push(c);
                    }
                }
            }
        }
    }
    for f in rec.files.values() {
        for c in manifests[&f.manifest].distinct_chunks() {
            if seen.insert(*c) {
                out.push(*c);
            }
        }
    }
    Ok(out)
}
