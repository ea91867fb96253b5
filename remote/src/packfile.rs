//! Reading pack files (`forkd pack` writes them, `forkd unpack` reads them
//! like a hub): the format is in forkd-hub's `pack` module and docs/hub.md,
//! "Pack files".
//!
//! Opening a pack checks all of the index before any object is read: the
//! footer, the index hash, every object name (through [`Key::parse`], so no
//! `..`, no absolute path, ids and tags by the rules), every range inside the
//! object area and within its kind's size limit, no duplicates.

use super::layout::Key;
use anyhow::{anyhow, bail, ensure, Context, Result};
use forkd_layers::{validate_tag, SnapshotId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
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

    /// `len` bytes at `start` of an object, `None` if the pack lacks it.
    pub fn get_range(&self, key: &Key, start: u64, len: u64) -> Result<Option<Vec<u8>>> {
        let Some(&(off, olen)) = self.objects.get(key) else {
            return Ok(None);
        };
        if start.checked_add(len).is_none_or(|e| e > olen) {
            bail!("a read of {len} bytes at {start} does not fit {key} ({olen} bytes)");
        }
        let mut buf = vec![0u8; len as usize];
        self.file
            .read_exact_at(&mut buf, off + start)
            .with_context(|| format!("reading {key} from pack {}", self.path.display()))?;
        Ok(Some(buf))
    }

    /// Paths of the objects directly in `dir`.
    pub fn list(&self, dir: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .objects
            .keys()
            .map(Key::path)
            .filter(|p| p.rsplit_once('/').is_some_and(|(d, _)| d == dir))
            .collect();
        out.sort();
        out
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
