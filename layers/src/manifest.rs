//! File manifests: a file's size, chunk size, and its **flattened** chunk list.
//!
//! Flattened means a manifest never points at a parent manifest: entry `i`
//! covers bytes `[i*chunk_size, min((i+1)*chunk_size, size))` directly, so a
//! read at any offset is one index computation whatever the snapshot chain
//! depth. Manifests are content-addressed ([`ManifestId`] = blake3 of the
//! canonical encoding), so identical files in different snapshots share one.

use std::collections::HashMap;

use crate::chunk::validate_chunk_size;
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ManifestId};

/// What covers one chunk-sized slot of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkRef {
    /// All zero bytes; nothing is stored.
    Zero,
    /// A stored chunk.
    Chunk(ChunkId),
}

const MAGIC: &[u8; 4] = b"FKM1";
const ZERO_SLOT: u32 = u32::MAX;
const TAG_ZERO_RUN: u8 = 0;
const TAG_CHUNK: u8 = 1;

/// A file as a flat list of chunk slots.
///
/// Held compactly: one `u32` per slot indexing a table of distinct chunk ids,
/// so a 100 GiB disk image at 64 KiB chunks costs ~6.5 MB in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileManifest {
    size: u64,
    chunk_size: u32,
    slots: Vec<u32>,
    chunks: Vec<ChunkId>,
}

impl FileManifest {
    /// Builds a manifest; `entries.len()` must be `ceil(size / chunk_size)`.
    pub fn new(size: u64, chunk_size: u32, entries: &[ChunkRef]) -> Result<FileManifest> {
        validate_chunk_size(chunk_size)?;
        let want = slot_count(size, chunk_size)?;
        if entries.len() != want {
            return Err(Error::InvalidArgument(format!(
                "manifest for {size} bytes at chunk size {chunk_size} needs {want} entries, got {}",
                entries.len()
            )));
        }
        let mut index: HashMap<ChunkId, u32> = HashMap::new();
        let mut chunks = Vec::new();
        let slots = entries
            .iter()
            .map(|e| match e {
                ChunkRef::Zero => ZERO_SLOT,
                ChunkRef::Chunk(id) => *index.entry(*id).or_insert_with(|| {
                    chunks.push(*id);
                    (chunks.len() - 1) as u32
                }),
            })
            .collect();
        Ok(FileManifest {
            size,
            chunk_size,
            slots,
            chunks,
        })
    }

    /// File size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }

    /// Number of chunk slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Slot `i` (panics if out of range).
    pub fn entry(&self, i: usize) -> ChunkRef {
        match self.slots[i] {
            ZERO_SLOT => ChunkRef::Zero,
            n => ChunkRef::Chunk(self.chunks[n as usize]),
        }
    }

    /// The slot covering byte `offset`, or `None` at or past the end.
    pub fn chunk_at(&self, offset: u64) -> Option<ChunkRef> {
        (offset < self.size).then(|| self.entry((offset / u64::from(self.chunk_size)) as usize))
    }

    /// Byte length of slot `i` (the last one may be short).
    pub fn slot_len(&self, i: usize) -> u32 {
        let start = i as u64 * u64::from(self.chunk_size);
        (self.size - start).min(u64::from(self.chunk_size)) as u32
    }

    /// All slots in order.
    pub fn entries(&self) -> impl Iterator<Item = ChunkRef> + '_ {
        (0..self.slots.len()).map(|i| self.entry(i))
    }

    /// The distinct chunk ids this manifest names (what refcounts count).
    pub fn distinct_chunks(&self) -> &[ChunkId] {
        &self.chunks
    }

    /// Number of all-zero slots.
    pub fn zero_slots(&self) -> usize {
        self.slots.iter().filter(|&&s| s == ZERO_SLOT).count()
    }

    /// Approximate heap bytes of this manifest in memory.
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.slots.len() * 4 + self.chunks.len() * ChunkId::LEN
    }

    /// Bytes covered by all-zero slots.
    pub fn zero_bytes(&self) -> u64 {
        (0..self.slots.len())
            .filter(|&i| self.slots[i] == ZERO_SLOT)
            .map(|i| u64::from(self.slot_len(i)))
            .sum()
    }

    /// Canonical encoding (what the id hashes):
    ///
    /// `"FKM1" | size u64 LE | chunk_size u32 LE | records`, where a record is
    /// `0x00 run u32 LE` for a maximal run of zero slots or `0x01 id[32]` for
    /// one chunk slot.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.slots.len() * 33);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.chunk_size.to_le_bytes());
        let mut i = 0;
        while i < self.slots.len() {
            if self.slots[i] == ZERO_SLOT {
                let run = self.slots[i..]
                    .iter()
                    .take_while(|&&s| s == ZERO_SLOT)
                    .count();
                out.push(TAG_ZERO_RUN);
                out.extend_from_slice(&(run as u32).to_le_bytes());
                i += run;
            } else {
                out.push(TAG_CHUNK);
                out.extend_from_slice(self.chunks[self.slots[i] as usize].as_bytes());
                i += 1;
            }
        }
        out
    }

    /// The content address of this manifest.
    pub fn id(&self) -> ManifestId {
        ManifestId(*blake3::hash(&self.encode()).as_bytes())
    }

    /// Decodes [`FileManifest::encode`] output, rejecting anything
    /// non-canonical (so a decoded manifest re-encodes to the same id).
    pub fn decode(b: &[u8]) -> std::result::Result<FileManifest, String> {
        if b.len() < 16 || &b[0..4] != MAGIC {
            return Err("bad manifest header".into());
        }
        let size = u64::from_le_bytes(b[4..12].try_into().unwrap());
        let chunk_size = u32::from_le_bytes(b[12..16].try_into().unwrap());
        validate_chunk_size(chunk_size).map_err(|e| e.to_string())?;
        let want = slot_count(size, chunk_size).map_err(|e| e.to_string())?;
        let mut entries = Vec::with_capacity(want);
        let mut p = 16;
        let mut last_zero = false;
        while p < b.len() {
            match b[p] {
                TAG_ZERO_RUN if p + 5 <= b.len() => {
                    let run = u32::from_le_bytes(b[p + 1..p + 5].try_into().unwrap()) as usize;
                    if run == 0 || last_zero || entries.len() + run > want {
                        return Err("non-canonical zero run".into());
                    }
                    entries.extend(std::iter::repeat_n(ChunkRef::Zero, run));
                    last_zero = true;
                    p += 5;
                }
                TAG_CHUNK if p + 33 <= b.len() => {
                    entries.push(ChunkRef::Chunk(
                        ChunkId::from_slice(&b[p + 1..p + 33]).unwrap(),
                    ));
                    last_zero = false;
                    p += 33;
                }
                _ => return Err(format!("bad manifest record at byte {p}")),
            }
        }
        if entries.len() != want {
            return Err(format!("{} slots instead of {want}", entries.len()));
        }
        FileManifest::new(size, chunk_size, &entries).map_err(|e| e.to_string())
    }
}

/// `ceil(size / chunk_size)`, refusing files with more than 2^32-2 slots.
fn slot_count(size: u64, chunk_size: u32) -> Result<usize> {
    let n = size.div_ceil(u64::from(chunk_size));
    if n >= u64::from(ZERO_SLOT) {
        return Err(Error::InvalidArgument(format!(
            "file of {size} bytes has too many chunks at chunk size {chunk_size}; use a larger chunk size"
        )));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_canonical() {
        let a = ChunkRef::Chunk(ChunkId::of(b"a"));
        let b = ChunkRef::Chunk(ChunkId::of(b"b"));
        let z = ChunkRef::Zero;
        let m = FileManifest::new(4096 * 6 + 1, 4096, &[a, z, z, b, a, z, z]).unwrap();
        assert_eq!(m.distinct_chunks().len(), 2);
        assert_eq!(m.zero_slots(), 4);
        assert_eq!(m.slot_len(6), 1);
        assert_eq!(m.chunk_at(4096 * 3), Some(b));
        assert_eq!(m.chunk_at(4096 * 6 + 1), None);
        let enc = m.encode();
        let d = FileManifest::decode(&enc).unwrap();
        assert_eq!(d, m);
        assert_eq!(d.id(), m.id());
        // Two adjacent zero runs are not canonical.
        let mut bad = enc[..16].to_vec();
        bad.extend_from_slice(&[0, 1, 0, 0, 0, 0, 1, 0, 0, 0]);
        assert!(FileManifest::decode(&bad).is_err());
        assert!(FileManifest::new(10, 4096, &[]).is_err());
        let empty = FileManifest::new(0, 4096, &[]).unwrap();
        assert_eq!(FileManifest::decode(&empty.encode()).unwrap(), empty);
    }
}
