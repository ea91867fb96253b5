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

use super::layout::{encode_chunk, Key, TagObject};
use anyhow::{anyhow, bail, ensure, Context, Result};
use forkd_layers::{validate_tag, SnapshotId, StoreView};
use forkd_snapshot::Progress;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// First bytes of a pack.
pub const PACK_MAGIC: &[u8; 8] = b"FKPACK01";
/// Last bytes of a pack.
pub const FOOTER_MAGIC: &[u8; 8] = b"FKPKEND1";
/// Footer length.
pub const FOOTER_LEN: u64 = 56;
/// Largest index accepted (about 2.5 million objects).
pub const MAX_INDEX_BYTES: u64 = 256 << 20;

/// The pack index.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackIndex {
    /// Index format version; 1.
    pub format: u32,
    /// The tag the pack was made from, if any.
    pub tag: Option<String>,
    /// The packed snapshot (the chain head).
    pub snapshot: SnapshotId,
    /// `[object path, offset, length]`.
    pub objects: Vec<(String, u64, u64)>,
}

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

/// An opened, index-checked pack, readable like a hub.
#[derive(Clone)]
pub struct PackReader {
    file: Arc<File>,
    path: PathBuf,
    objects: Arc<HashMap<Key, (u64, u64)>>,
    /// The tag the pack was made from.
    pub tag: Option<String>,
    /// The packed snapshot.
    pub snapshot: SnapshotId,
}

impl PackReader {
    /// Opens `path` and checks its whole index (see the module doc).
    pub fn open(path: &Path) -> Result<PackReader> {
        let file = File::open(path).with_context(|| format!("opening pack {}", path.display()))?;
        let len = file.metadata()?.len();
        let refuse = |why: String| anyhow!("pack {} is refused: {why}", path.display());
        if len < PACK_MAGIC.len() as u64 + FOOTER_LEN {
            return Err(refuse("too short to be a forkd pack".into()));
        }
        let mut magic = [0u8; 8];
        file.read_exact_at(&mut magic, 0)?;
        let mut footer = [0u8; FOOTER_LEN as usize];
        file.read_exact_at(&mut footer, len - FOOTER_LEN)?;
        if &magic != PACK_MAGIC || &footer[48..] != FOOTER_MAGIC {
            return Err(refuse("not a forkd pack (bad magic)".into()));
        }
        let index_offset = u64::from_le_bytes(footer[0..8].try_into().unwrap());
        let index_len = u64::from_le_bytes(footer[8..16].try_into().unwrap());
        let data_end = len - FOOTER_LEN;
        if index_len > MAX_INDEX_BYTES
            || index_offset < PACK_MAGIC.len() as u64
            || index_offset.checked_add(index_len) != Some(data_end)
        {
            return Err(refuse(format!(
                "index at {index_offset}+{index_len} does not fit the file"
            )));
        }
        let mut json = vec![0u8; index_len as usize];
        file.read_exact_at(&mut json, index_offset)?;
        if blake3::hash(&json).as_bytes() != &footer[16..48] {
            return Err(refuse(
                "the index does not match its checksum (corrupt)".into(),
            ));
        }
        let index: PackIndex =
            serde_json::from_slice(&json).map_err(|e| refuse(format!("bad index: {e}")))?;
        let objects = check_index(&index, index_offset).map_err(|e| refuse(format!("{e:#}")))?;
        Ok(PackReader {
            file: Arc::new(file),
            path: path.to_path_buf(),
            objects: Arc::new(objects),
            tag: index.tag,
            snapshot: index.snapshot,
        })
    }

    /// The pack's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An object's bytes, `None` if the pack does not hold it.
    pub fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        let Some(&(off, len)) = self.objects.get(key) else {
            return Ok(None);
        };
        let mut buf = vec![0u8; len as usize];
        self.file
            .read_exact_at(&mut buf, off)
            .with_context(|| format!("reading {key} from pack {}", self.path.display()))?;
        Ok(Some(buf))
    }

    /// Which keys the pack holds.
    pub fn has(&self, keys: &[Key]) -> Vec<bool> {
        keys.iter().map(|k| self.objects.contains_key(k)).collect()
    }
}

/// Validates every index entry; returns the object table.
fn check_index(index: &PackIndex, data_end: u64) -> Result<HashMap<Key, (u64, u64)>> {
    ensure!(index.format == 1, "unknown pack format {}", index.format);
    if let Some(t) = &index.tag {
        validate_tag(t)?;
    }
    let mut objects = HashMap::with_capacity(index.objects.len());
    for (name, off, len) in &index.objects {
        let key = Key::parse(name)?;
        let end = off.checked_add(*len);
        if *off < PACK_MAGIC.len() as u64 || end.is_none_or(|e| e > data_end) {
            bail!("{key} at {off}+{len} lies outside the object area");
        }
        if *len > key.max_len() {
            bail!(
                "{key} is {len} bytes, over the {}-byte limit",
                key.max_len()
            );
        }
        if objects.insert(key.clone(), (*off, *len)).is_some() {
            bail!("{key} appears twice in the index");
        }
    }
    ensure!(
        objects.contains_key(&Key::Snapshot(index.snapshot)),
        "the index names snapshot {} but holds no record for it",
        index.snapshot
    );
    Ok(objects)
}
