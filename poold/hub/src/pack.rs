//! Pack files: one self-contained file holding a snapshot, its whole parent
//! chain and everything they name, for offline transfer (`forkd pack` /
//! `forkd unpack`).
//!
//! ```text
//! offset 0    "FKPACK01"
//!        8    objects back to back, in the hub's object formats (chunk
//!             objects, manifest encodings, snapshot records, tag object)
//!        X    index: JSON {"format":1, "tag":..., "snapshot":..., "objects":[[path, offset, len], ...]}
//!  end - 56   footer: index offset u64 LE | index length u64 LE |
//!             blake3(index) [32] | "FKPKEND1"
//! ```
//!
//! Opening a pack checks all of the index before any object is read: the
//! footer, the index hash, every object name (through [`Key::parse`], so no
//! `..`, no absolute path, ids and tags by the rules), every range inside the
//! object area and within its kind's size limit, no duplicates. Unpack then
//! pulls from the pack like from a hub, so every chunk and manifest is
//! verified against its id before the snapshot is committed.

use anyhow::{anyhow, Context, Result};
use forkd_layers::{validate_tag, SnapshotId, StoreView};
use forkd_remote::layout::{encode_chunk, Key, TagObject};
use forkd_snapshot::Progress;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

pub use forkd_remote::packfile::{
    PackIndex, PackReader, FOOTER_LEN, FOOTER_MAGIC, MAX_INDEX_BYTES, PACK_MAGIC,
};

/// What [`write_pack`] wrote.
#[derive(Debug, Clone, Default)]
pub struct PackSummary {
    /// Snapshot records written (the head and its parent chain).
    pub snapshots: u64,
    /// Distinct file manifests written.
    pub manifests: u64,
    /// Distinct chunks written, as stored (compressed).
    pub chunks: u64,
    /// Size of the pack file, bytes.
    pub bytes: u64,
}

/// Writes snapshot `id` (with its whole parent chain) to `out`, atomically
/// (a temporary file in the same directory, fsync'd, renamed).
pub fn write_pack(
    store: &StoreView,
    id: &SnapshotId,
    tag: Option<&str>,
    out: &Path,
    progress: &Progress,
) -> Result<PackSummary> {
    if let Some(t) = tag {
        validate_tag(t)?;
    }
    let chain = store.chain(id)?;
    let mut chunks = Vec::new();
    let mut seen = HashSet::new();
    let mut manifests = Vec::new();
    for rec in &chain {
        for c in store.snapshot_chunks(rec)? {
            if seen.insert(c) {
                chunks.push(c);
            }
        }
        for f in rec.files.values() {
            if !manifests.contains(&f.manifest) {
                manifests.push(f.manifest);
            }
        }
    }
    let mut total = 0;
    for c in &chunks {
        total += store
            .chunk_location(c)?
            .map_or(0, |l| u64::from(l.stored_len));
    }
    progress.set_total(total);
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = out
        .file_name()
        .ok_or_else(|| anyhow!("{} is not a file name", out.display()))?;
    let tmp = dir.join(format!(
        ".{}.partial-{}",
        name.to_string_lossy(),
        forkd_snapshot::random_hex(4)
    ));
    let result = (|| -> Result<PackSummary> {
        let file = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = PackWriter {
            out: BufWriter::with_capacity(1 << 20, file),
            offset: 0,
            objects: Vec::new(),
        };
        w.raw(PACK_MAGIC)?;
        for c in &chunks {
            let sc = store.stored_chunk(c)?;
            w.object(&Key::Chunk(*c), &encode_chunk(&sc))?;
            progress.inc(sc.payload.len() as u64);
        }
        for m in &manifests {
            w.object(&Key::Manifest(*m), &store.manifest_bytes(m)?)?;
        }
        for rec in &chain {
            if let Some(ws) = store.annotation(&rec.id, forkd_layers::workingset::ANNOTATION)? {
                w.object(&Key::WorkingSet(rec.id), &ws)?;
            }
        }
        for rec in &chain {
            w.object(&Key::Snapshot(rec.id), &serde_json::to_vec(rec)?)?;
        }
        if let Some(t) = tag {
            w.object(&Key::tag(t)?, &TagObject { snapshot: *id }.encode())?;
        }
        let index = PackIndex {
            format: 1,
            tag: tag.map(str::to_string),
            snapshot: *id,
            objects: std::mem::take(&mut w.objects),
        };
        let bytes = w.finish(&index)?;
        Ok(PackSummary {
            snapshots: chain.len() as u64,
            manifests: manifests.len() as u64,
            chunks: chunks.len() as u64,
            bytes,
        })
    })();
    match result {
        Ok(s) => {
            std::fs::rename(&tmp, out)
                .with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))?;
            File::open(dir).and_then(|d| d.sync_all()).ok();
            Ok(s)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

struct PackWriter {
    out: BufWriter<File>,
    offset: u64,
    objects: Vec<(String, u64, u64)>,
}

impl PackWriter {
    fn raw(&mut self, b: &[u8]) -> Result<()> {
        self.out.write_all(b)?;
        self.offset += b.len() as u64;
        Ok(())
    }

    fn object(&mut self, key: &Key, b: &[u8]) -> Result<()> {
        self.objects.push((key.path(), self.offset, b.len() as u64));
        self.raw(b)
    }

    /// Writes index and footer, syncs; returns the pack's length.
    fn finish(mut self, index: &PackIndex) -> Result<u64> {
        let json = serde_json::to_vec(index)?;
        let index_offset = self.offset;
        self.raw(&json)?;
        let mut footer = Vec::with_capacity(FOOTER_LEN as usize);
        footer.extend_from_slice(&index_offset.to_le_bytes());
        footer.extend_from_slice(&(json.len() as u64).to_le_bytes());
        footer.extend_from_slice(blake3::hash(&json).as_bytes());
        footer.extend_from_slice(FOOTER_MAGIC);
        self.raw(&footer)?;
        let file = self.out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(self.offset)
    }
}
