//! What `forkd snapshot info` and `GET /v1/snapshots/:tag/info` report about
//! one snapshot: its chain, its files, and what each link of the chain
//! really stores.

use anyhow::Result;
pub use forkd_layers::Residency;
use forkd_layers::{SnapshotId, SnapshotRecord, StoreView};
use serde::Serialize;
use std::collections::BTreeMap;

/// One link of a snapshot's chain.
#[derive(Debug, Clone, Serialize)]
pub struct Link {
    /// The snapshot's id in the layer store (hex).
    pub id: String,
    /// Tags naming this snapshot.
    pub tags: Vec<String>,
    /// Pack bytes of chunks this link has and its parent does not: what the
    /// link costs on disk (and on the wire to a host that has the parent).
    pub unique_stored_bytes: u64,
    /// The same, uncompressed.
    pub unique_raw_bytes: u64,
}

/// Detail of one snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotDetail {
    /// The snapshot's id in the layer store (hex).
    pub id: String,
    /// Tags naming it.
    pub tags: Vec<String>,
    /// Its parent's id; None for a root.
    pub parent: Option<String>,
    /// When it was committed, seconds since the Unix epoch.
    pub created_at_unix: u64,
    /// Number of ancestors (0 for a root).
    pub chain_depth: usize,
    /// Root first, parent last.
    pub ancestors: Vec<Link>,
    /// This snapshot as a link.
    pub this: Link,
    /// Direct children (tags where they have one, else ids).
    pub dependents: Vec<String>,
    /// File sizes (logical) and zero bytes (cost nothing).
    pub files: BTreeMap<String, FileDetail>,
    /// Its recorded VM configuration (`VmConfig`).
    pub config: serde_json::Value,
    /// Where it came from (`branched_from`, `pause_ms`, ...).
    pub lineage: BTreeMap<String, serde_json::Value>,
    /// How much of it is in the local store and how much still on a hub
    /// (a lazy pull filling), and whether its working set is local.
    pub residency: Residency,
}

/// Size of one snapshot file.
#[derive(Debug, Clone, Serialize)]
pub struct FileDetail {
    /// Logical size, bytes.
    pub size: u64,
    /// Bytes in all-zero chunks, which cost nothing to store.
    pub zero_bytes: u64,
}

/// Builds the detail of `rec`.
pub fn detail(view: &StoreView, rec: &SnapshotRecord) -> Result<SnapshotDetail> {
    let ancestors: Vec<Link> = view
        .ancestors(&rec.id)?
        .iter()
        .map(|id| link(view, id))
        .collect::<Result<_>>()?;
    let mut files = BTreeMap::new();
    for (name, f) in &rec.files {
        files.insert(
            name.clone(),
            FileDetail {
                size: f.size,
                zero_bytes: view.manifest(&f.manifest)?.zero_bytes(),
            },
        );
    }
    Ok(SnapshotDetail {
        id: rec.id.to_string(),
        tags: view.tags_of(&rec.id)?,
        parent: rec.parent.map(|p| p.to_string()),
        created_at_unix: rec.created_at_unix,
        chain_depth: ancestors.len(),
        ancestors,
        this: link(view, &rec.id)?,
        dependents: view
            .dependents(&rec.id)?
            .iter()
            .map(|d| label(view, d))
            .collect(),
        files,
        config: rec.config.clone(),
        lineage: rec.lineage.clone(),
        residency: view.residency(rec)?,
    })
}

/// How much of `rec` is local (see [`Residency`]); what `/v1/snapshots`
/// and `forkd snapshot ls` show per snapshot. O(chunks) index lookups.
pub fn residency(view: &StoreView, rec: &SnapshotRecord) -> Result<Residency> {
    Ok(view.residency(rec)?)
}

fn link(view: &StoreView, id: &SnapshotId) -> Result<Link> {
    let rec = view
        .snapshot(id)?
        .ok_or_else(|| anyhow::anyhow!("snapshot {id} vanished while reading its chain"))?;
    let (stored, raw) = match rec.parent {
        Some(p) => {
            let d = view.diff(&p, id)?;
            (d.new_stored_bytes, d.new_raw_bytes)
        }
        None => unique_of_root(view, &rec)?,
    };
    Ok(Link {
        id: id.to_string(),
        tags: view.tags_of(id)?,
        unique_stored_bytes: stored,
        unique_raw_bytes: raw,
    })
}

/// A root's "unique" bytes: every distinct chunk it names.
fn unique_of_root(view: &StoreView, rec: &SnapshotRecord) -> Result<(u64, u64)> {
    let mut seen = std::collections::HashSet::new();
    let (mut stored, mut raw) = (0, 0);
    for f in rec.files.values() {
        for c in view.manifest(&f.manifest)?.distinct_chunks() {
            if seen.insert(*c) {
                if let Some(loc) = view.chunk_location(c)? {
                    stored += loc.record_len();
                    raw += u64::from(loc.raw_len);
                } else if let Some(r) = view.remote_chunk(c)? {
                    // A lazy snapshot's chunk: what it will take here.
                    stored += r.record_len();
                    raw += u64::from(r.raw_len);
                }
            }
        }
    }
    Ok((stored, raw))
}

/// A snapshot's first tag, else its id.
pub fn label(view: &StoreView, id: &SnapshotId) -> String {
    view.tags_of(id)
        .ok()
        .and_then(|t| t.into_iter().next())
        .unwrap_or_else(|| id.to_string())
}
