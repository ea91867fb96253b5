//! Layout 2: chunks packed into large objects, so an object store sees a
//! request per few MiB instead of one per 64 KiB chunk (docs/hub.md,
//! "Layout 2: packs"). casync and restic do the same for the same reason.
//!
//! - A **pack** (`packs/<aa>/<id>`) is chunk objects (the 12-byte `FKHC`
//!   header and the stored payload, exactly as in layout 1) back to back,
//!   named by the blake3 of the whole pack. A ranged read of one entry is a
//!   layout-1 chunk object, so a lazy read is one ranged GET and is
//!   verified against the chunk id like any chunk.
//! - An **index** (`index/<id>`, named by its blake3) lists packs and where
//!   each of their chunks lies:
//!
//! ```text
//! "FKHI" | version u8 = 2 | 3 zero bytes | pack count u32 LE
//! per pack:  pack id [32] | pack length u64 LE | entry count u32 LE
//!   per entry: chunk id [32] | offset u64 LE | length u32 LE | raw length u32 LE   (48 bytes)
//! ```
//!
//! [`Index::decode`] trusts nothing: the bytes must hash to the name, every
//! count must fit the bytes that follow, every entry must lie inside its
//! pack and be the size a chunk object can be. The chunk bytes themselves
//! are checked against their ids when they are read.

use crate::layout::{decode_chunk, put_chunk, CHUNK_HEADER_LEN, MAX_CHUNK_OBJECT, MAX_PACK_BYTES};
use anyhow::{bail, Result};
use bytes::{BufMut, Bytes, BytesMut};
use forkd_layers::{ChunkId, ObjectId, StoredChunk, VerifiedChunk, MAX_CHUNK_SIZE};
use std::collections::HashMap;

/// Magic of an index object.
pub const INDEX_MAGIC: &[u8; 4] = b"FKHI";
const INDEX_VERSION: u8 = 2;
const INDEX_HEADER_LEN: usize = 12;
const PACK_HEADER_LEN: usize = 44;
const ENTRY_LEN: usize = 48;

/// Default size a push fills a pack to before starting the next.
pub const DEFAULT_PACK_BYTES: usize = 8 << 20;

/// Where one chunk lies in a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackEntry {
    /// The chunk.
    pub chunk: ChunkId,
    /// Offset of its chunk object in the pack.
    pub offset: u64,
    /// Length of its chunk object (header and payload).
    pub len: u32,
    /// Its uncompressed length.
    pub raw_len: u32,
}

/// One pack and its entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackInfo {
    /// The pack's id (blake3 of its bytes).
    pub id: ObjectId,
    /// Its length in bytes.
    pub len: u64,
    /// Its chunks, in pack order.
    pub entries: Vec<PackEntry>,
}

/// An index object: packs and their entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Index {
    /// The packs it describes.
    pub packs: Vec<PackInfo>,
}

impl Index {
    /// The canonical bytes (what the index id hashes).
    pub fn encode(&self) -> Bytes {
        let n: usize = self.packs.iter().map(|p| p.entries.len()).sum();
        let mut b = BytesMut::with_capacity(
            INDEX_HEADER_LEN + PACK_HEADER_LEN * self.packs.len() + ENTRY_LEN * n,
        );
        b.put_slice(INDEX_MAGIC);
        b.put_u8(INDEX_VERSION);
        b.put_slice(&[0, 0, 0]);
        b.put_u32_le(self.packs.len() as u32);
        for p in &self.packs {
            b.put_slice(p.id.as_bytes());
            b.put_u64_le(p.len);
            b.put_u32_le(p.entries.len() as u32);
            for e in &p.entries {
                b.put_slice(e.chunk.as_bytes());
                b.put_u64_le(e.offset);
                b.put_u32_le(e.len);
                b.put_u32_le(e.raw_len);
            }
        }
        b.freeze()
    }

    /// Parses an index object fetched under `id` (see the module doc for
    /// what is checked).
    pub fn decode(id: &ObjectId, b: &[u8]) -> Result<Index> {
        let got = ObjectId::of(b);
        if &got != id {
            bail!("index {id} does not hash to its name (its bytes hash to {got})");
        }
        let bad = |why: String| anyhow::anyhow!("index {id} is malformed: {why}");
        if b.len() < INDEX_HEADER_LEN || &b[..4] != INDEX_MAGIC {
            return Err(bad("no FKHI header".into()));
        }
        if b[4] != INDEX_VERSION || b[5..8] != [0, 0, 0] {
            return Err(bad(format!("version {}", b[4])));
        }
        let mut r = Reader { b, at: 8 };
        let packs = r.u32()? as usize;
        if packs > (b.len() - INDEX_HEADER_LEN) / PACK_HEADER_LEN {
            return Err(bad(format!("{packs} packs do not fit {} bytes", b.len())));
        }
        let mut out = Vec::with_capacity(packs);
        for _ in 0..packs {
            let pid = ObjectId(r.id()?);
            let len = r.u64()?;
            let n = r.u32()? as usize;
            if len > MAX_PACK_BYTES {
                return Err(bad(format!("pack {pid} is {len} bytes, over the limit")));
            }
            if n > (b.len() - r.at) / ENTRY_LEN {
                return Err(bad(format!("pack {pid}: {n} entries do not fit")));
            }
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                let e = PackEntry {
                    chunk: ChunkId(r.id()?),
                    offset: r.u64()?,
                    len: r.u32()?,
                    raw_len: r.u32()?,
                };
                let end = e.offset.checked_add(u64::from(e.len));
                if end.is_none_or(|end| end > len)
                    || u64::from(e.len) <= CHUNK_HEADER_LEN as u64
                    || u64::from(e.len) > MAX_CHUNK_OBJECT
                    || e.raw_len == 0
                    || e.raw_len > MAX_CHUNK_SIZE
                {
                    return Err(bad(format!(
                        "chunk {} at {}+{} does not fit pack {pid} ({len} bytes) or a chunk's limits",
                        e.chunk, e.offset, e.len
                    )));
                }
                entries.push(e);
            }
            out.push(PackInfo {
                id: pid,
                len,
                entries,
            });
        }
        if r.at != b.len() {
            return Err(bad(format!("{} trailing bytes", b.len() - r.at)));
        }
        Ok(Index { packs: out })
    }

    /// Number of chunk entries.
    pub fn entries(&self) -> usize {
        self.packs.iter().map(|p| p.entries.len()).sum()
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            bail!("truncated at byte {}", self.at);
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn id(&mut self) -> Result<[u8; 32]> {
        Ok(self.take(32)?.try_into().unwrap())
    }
}

/// Where a chunk can be read on a layout-2 hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// The pack holding it.
    pub pack: ObjectId,
    /// The pack's length.
    pub pack_len: u64,
    /// Offset of the chunk object in the pack.
    pub offset: u64,
    /// Length of the chunk object.
    pub len: u32,
    /// The chunk's uncompressed length.
    pub raw_len: u32,
    /// The index that told us.
    pub index: ObjectId,
}

/// Chunk locations gathered from index objects.
#[derive(Debug, Clone, Default)]
pub struct ChunkMap {
    map: HashMap<ChunkId, Location>,
}

impl ChunkMap {
    /// Adds every entry of `index` (named `id`); the first location of a
    /// chunk wins.
    pub fn add(&mut self, id: ObjectId, index: &Index) {
        for p in &index.packs {
            for e in &p.entries {
                self.map.entry(e.chunk).or_insert(Location {
                    pack: p.id,
                    pack_len: p.len,
                    offset: e.offset,
                    len: e.len,
                    raw_len: e.raw_len,
                    index: id,
                });
            }
        }
    }

    /// Where `chunk` lies, if an added index has it.
    pub fn get(&self, chunk: &ChunkId) -> Option<&Location> {
        self.map.get(chunk)
    }

    /// Chunks located.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is located.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Packs chunks in the order given, closing a pack once it reaches its
/// target size.
pub struct PackBuilder {
    target: usize,
    buf: BytesMut,
    entries: Vec<PackEntry>,
}

/// A finished pack: its bytes and its index entry.
#[derive(Debug, Clone)]
pub struct BuiltPack {
    /// The pack's bytes.
    pub bytes: Bytes,
    /// Its id and entries.
    pub info: PackInfo,
}

impl PackBuilder {
    /// A builder closing packs at about `target` bytes.
    pub fn new(target: usize) -> PackBuilder {
        let target = target.clamp(1 << 20, (MAX_PACK_BYTES - MAX_CHUNK_OBJECT) as usize);
        PackBuilder {
            target,
            buf: BytesMut::new(),
            entries: Vec::new(),
        }
    }

    /// Adds a chunk; returns the pack it completed, if any.
    pub fn add(&mut self, c: &StoredChunk) -> Option<BuiltPack> {
        let offset = self.buf.len() as u64;
        put_chunk(&mut self.buf, c);
        self.entries.push(PackEntry {
            chunk: c.id,
            offset,
            len: (self.buf.len() as u64 - offset) as u32,
            raw_len: c.raw_len,
        });
        (self.buf.len() >= self.target).then(|| self.take())
    }

    /// The last, partly filled pack.
    pub fn finish(mut self) -> Option<BuiltPack> {
        (!self.entries.is_empty()).then(|| self.take())
    }

    fn take(&mut self) -> BuiltPack {
        let bytes = std::mem::take(&mut self.buf).freeze();
        let info = PackInfo {
            id: ObjectId::of(&bytes),
            len: bytes.len() as u64,
            entries: std::mem::take(&mut self.entries),
        };
        BuiltPack { bytes, info }
    }
}

/// One ranged read of a pack (or of a layout-1 chunk object) and the chunks
/// it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeRead {
    /// The object read.
    pub object: ObjectId,
    /// First byte read.
    pub start: u64,
    /// Bytes read.
    pub len: u64,
    /// The object's whole length, when known (a read of all of it is a
    /// plain GET).
    pub object_len: Option<u64>,
    /// `(chunk, offset in this read, chunk object length)`.
    pub chunks: Vec<(ChunkId, u64, u32)>,
}

/// How [`plan_reads`] groups chunks into requests.
#[derive(Debug, Clone, Copy)]
pub struct Coalesce {
    /// Chunks at most this far apart in a pack share a read (the gap is
    /// read and thrown away: cheaper than a request).
    pub max_gap: u64,
    /// Largest single read.
    pub max_read: u64,
    /// Read the whole pack once at least this fraction of it is wanted.
    pub whole_pack: f64,
}

impl Coalesce {
    /// For faults and working-set prefetches: few requests, little waste.
    pub const LAZY: Coalesce = Coalesce {
        max_gap: 128 << 10,
        max_read: 4 << 20,
        whole_pack: 2.0,
    };
    /// For full pulls and background fills: whole packs when dense.
    pub const BULK: Coalesce = Coalesce {
        max_gap: 1 << 20,
        max_read: 16 << 20,
        whole_pack: 0.6,
    };
}

/// Groups `(chunk, location)` pairs into ranged reads: by pack, in offset
/// order, merging neighbours (see [`Coalesce`]). The result keeps the order
/// in which each pack was first named, so a working set's first chunks are
/// read first.
pub fn plan_reads(wanted: &[(ChunkId, Location)], c: Coalesce) -> Vec<RangeRead> {
    let mut order: Vec<ObjectId> = Vec::new();
    let mut by_pack: HashMap<ObjectId, Vec<(ChunkId, Location)>> = HashMap::new();
    for (id, loc) in wanted {
        by_pack
            .entry(loc.pack)
            .or_insert_with(|| {
                order.push(loc.pack);
                Vec::new()
            })
            .push((*id, *loc));
    }
    let mut out = Vec::new();
    for pack in order {
        let mut list = by_pack.remove(&pack).unwrap_or_default();
        list.sort_by_key(|(_, l)| l.offset);
        list.dedup_by_key(|(_, l)| l.offset);
        let pack_len = list[0].1.pack_len;
        let wanted_bytes: u64 = list.iter().map(|(_, l)| u64::from(l.len)).sum();
        if pack_len > 0 && wanted_bytes as f64 >= c.whole_pack * pack_len as f64 {
            out.push(RangeRead {
                object: pack,
                start: 0,
                len: pack_len,
                object_len: Some(pack_len),
                chunks: list.iter().map(|(id, l)| (*id, l.offset, l.len)).collect(),
            });
            continue;
        }
        let mut cur: Option<RangeRead> = None;
        for (id, l) in list {
            let end = l.offset + u64::from(l.len);
            if let Some(r) = cur.as_mut() {
                let r_end = r.start + r.len;
                if l.offset <= r_end + c.max_gap && end - r.start <= c.max_read {
                    r.len = end.max(r_end) - r.start;
                    r.chunks.push((id, l.offset - r.start, l.len));
                    continue;
                }
                out.push(cur.take().unwrap());
            }
            cur = Some(RangeRead {
                object: pack,
                start: l.offset,
                len: u64::from(l.len),
                object_len: Some(pack_len),
                chunks: vec![(id, 0, l.len)],
            });
        }
        out.extend(cur);
    }
    out
}

/// Cuts the bytes of a [`RangeRead`] into its chunks and verifies each
/// against its id. A chunk that does not check out is an `Err` naming it
/// and why; the others are still returned.
pub fn split_read(
    read: &RangeRead,
    bytes: &[u8],
) -> Vec<std::result::Result<VerifiedChunk, (ChunkId, String)>> {
    read.chunks
        .iter()
        .map(|&(id, off, len)| {
            let end = off as usize + len as usize;
            let Some(b) = bytes.get(off as usize..end) else {
                return Err((
                    id,
                    format!(
                        "the hub answered {} bytes for a read of {}",
                        bytes.len(),
                        read.len
                    ),
                ));
            };
            decode_chunk(id, b)
                .and_then(|c| c.verify())
                .map_err(|why| (id, why))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkd_layers::Compression;

    fn chunk(i: u32, n: usize) -> StoredChunk {
        let data: Vec<u8> = (0..n).map(|j| (j as u32 ^ i) as u8).collect();
        StoredChunk {
            id: ChunkId::of(&data),
            compression: Compression::Raw,
            raw_len: n as u32,
            payload: data,
        }
    }

    #[test]
    fn packs_index_and_reads_round_trip() {
        let mut b = PackBuilder::new(1 << 20);
        let chunks: Vec<StoredChunk> = (0..40).map(|i| chunk(i, 65536)).collect();
        let mut packs = Vec::new();
        for c in &chunks {
            packs.extend(b.add(c));
        }
        packs.extend(b.finish());
        assert_eq!(packs.len(), 3, "1 MiB packs of 64 KiB chunks");
        let index = Index {
            packs: packs.iter().map(|p| p.info.clone()).collect(),
        };
        let bytes = index.encode();
        let id = ObjectId::of(&bytes);
        assert_eq!(Index::decode(&id, &bytes).unwrap(), index);
        assert!(Index::decode(&ObjectId([0; 32]), &bytes).is_err());
        let mut map = ChunkMap::default();
        map.add(id, &index);
        assert_eq!(map.len(), 40);

        // Three scattered chunks of the first pack: coalesced where close.
        let want: Vec<(ChunkId, Location)> = [0usize, 1, 5]
            .iter()
            .map(|&i| (chunks[i].id, *map.get(&chunks[i].id).unwrap()))
            .collect();
        let reads = plan_reads(&want, Coalesce::LAZY);
        assert_eq!(reads.len(), 2, "{reads:?}");
        assert_eq!(reads[0].chunks.len(), 2);
        let pack = &packs[0].bytes;
        for r in &reads {
            let part = &pack[r.start as usize..(r.start + r.len) as usize];
            for v in split_read(r, part) {
                v.unwrap();
            }
        }
        // Dense: the whole pack in one read.
        let all: Vec<(ChunkId, Location)> = chunks[..16]
            .iter()
            .map(|c| (c.id, *map.get(&c.id).unwrap()))
            .collect();
        let reads = plan_reads(&all, Coalesce::BULK);
        assert_eq!(reads.len(), 1);
        assert_eq!(reads[0].len, packs[0].info.len);
        // A flipped byte is refused for that chunk only.
        let mut bad = pack[..].to_vec();
        bad[70_000] ^= 1;
        let res = split_read(&reads[0], &bad);
        assert_eq!(res.iter().filter(|r| r.is_err()).count(), 1);
        // A short answer is refused, not read past.
        assert!(split_read(&reads[0], &pack[..1000])
            .iter()
            .skip(1)
            .all(|r| r.is_err()));
    }

    #[test]
    fn hostile_indexes_are_refused() {
        let mut index = Index {
            packs: vec![PackInfo {
                id: ObjectId([1; 32]),
                len: 100,
                entries: vec![PackEntry {
                    chunk: ChunkId([2; 32]),
                    offset: 90,
                    len: 20,
                    raw_len: 4,
                }],
            }],
        };
        let b = index.encode();
        let e = Index::decode(&ObjectId::of(&b), &b).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        index.packs[0].entries.clear();
        let mut b = index.encode().to_vec();
        // A count claiming more entries than bytes: refused before allocating.
        b[8 + 4 + 32 + 8..8 + 4 + 32 + 8 + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = Index::decode(&ObjectId::of(&b), &b).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
    }
}
