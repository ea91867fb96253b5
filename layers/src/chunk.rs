//! Chunks: size rules, the zero test, compression, and the index entry
//! (`ChunkLocation`) that says where a chunk's bytes live.

use crate::error::{Error, Result};
use crate::ids::ChunkId;

/// Smallest allowed chunk size (one page).
pub const MIN_CHUNK_SIZE: u32 = 4096;
/// Largest allowed chunk size.
pub const MAX_CHUNK_SIZE: u32 = 4 << 20;

/// Default chunk size: 64 KiB.
///
/// Chosen by `layers-bench` (docs/BENCHMARKS.md, "Layer store") among
/// 64 KiB / 256 KiB / 1 MiB on a 512 MiB guest-memory-like file:
/// - a cold random 4 KiB read (what a restored child's page fault through
///   the FUSE mount costs) is ~3.4x faster than at 256 KiB and ~11x faster
///   than at 1 MiB, because only 64 KiB is read, decompressed and hashed;
/// - a snapshot that differs by 64 scattered dirty pages adds ~1.2 MiB,
///   against ~4.3 MiB (256 KiB) and ~13.5 MiB (1 MiB): diff snapshots and
///   live branches are the common case in forkd;
/// - ingest speed is the same within measurement noise;
/// - it matches qcow2's default 64 KiB cluster, the granularity of a
///   child's disk overlay.
///
/// The cost is ~2% more stored bytes than 256 KiB (12% more than 1 MiB:
/// zstd sees a smaller window) and 4x the index and manifest entries
/// (~5k per 512 MiB of non-zero memory), both small.
pub const DEFAULT_CHUNK_SIZE: u32 = 64 * 1024;

/// Default zstd level. In docs/BENCHMARKS.md level 1 stores ~2% more and
/// level 6 ingests ~2.5x slower for no gain in size at 64 KiB chunks, so 3.
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;

/// Checks the chunk-size rule: a power of two, a multiple of 4096, 4 KiB..=4 MiB.
pub fn validate_chunk_size(size: u32) -> Result<()> {
    if size.is_power_of_two() && (MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&size) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "chunk size {size} must be a power of two between 4096 and 4194304"
        )))
    }
}

/// How a chunk's bytes are stored in its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Stored as-is (compressing did not make it smaller).
    Raw = 0,
    /// zstd frame.
    Zstd = 1,
}

impl Compression {
    fn from_u8(b: u8) -> Option<Compression> {
        match b {
            0 => Some(Compression::Raw),
            1 => Some(Compression::Zstd),
            _ => None,
        }
    }
}

/// True if every byte is zero. Such chunks are never stored.
pub fn is_zero(data: &[u8]) -> bool {
    // Word-at-a-time on the aligned middle; the compiler vectorises this.
    // SAFETY: every bit pattern is a valid u128, and align_to only puts
    // correctly aligned, in-bounds words in `mid`.
    let (pre, mid, post) = unsafe { data.align_to::<u128>() };
    pre.iter().all(|&b| b == 0) && mid.iter().all(|&w| w == 0) && post.iter().all(|&b| b == 0)
}

/// Compresses `data` with zstd at `level`; returns `None` when the result is
/// not smaller (the chunk is then stored raw).
pub fn compress(data: &[u8], level: i32) -> Result<Option<Vec<u8>>> {
    let out = zstd::bulk::compress(data, level)
        .map_err(|e| Error::InvalidArgument(format!("zstd level {level}: {e}")))?;
    Ok((out.len() < data.len()).then_some(out))
}

/// Where a chunk lives: the value of the `chunks` column family.
///
/// Encoding (21 bytes, little endian): pack u32, offset u64 (of the pack
/// record header), stored_len u32, raw_len u32, compression u8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLocation {
    /// Pack file number (`packs/pack-<n>.dat`).
    pub pack: u32,
    /// Byte offset of the record header in the pack.
    pub offset: u64,
    /// Length of the stored payload (after the header).
    pub stored_len: u32,
    /// Length of the uncompressed chunk.
    pub raw_len: u32,
    /// How the payload is encoded.
    pub compression: Compression,
}

impl ChunkLocation {
    /// Encoded length.
    pub const ENCODED_LEN: usize = 21;

    /// Encodes for the index.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..4].copy_from_slice(&self.pack.to_le_bytes());
        b[4..12].copy_from_slice(&self.offset.to_le_bytes());
        b[12..16].copy_from_slice(&self.stored_len.to_le_bytes());
        b[16..20].copy_from_slice(&self.raw_len.to_le_bytes());
        b[20] = self.compression as u8;
        b
    }

    /// Decodes an index value.
    pub fn decode(id: &ChunkId, b: &[u8]) -> Result<ChunkLocation> {
        let bad = |reason: &str| Error::CorruptRecord {
            what: "chunk index",
            key: id.to_string(),
            reason: reason.to_string(),
        };
        if b.len() != Self::ENCODED_LEN {
            return Err(bad("wrong length"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        Ok(ChunkLocation {
            pack: u32_at(0),
            offset: u64::from_le_bytes(b[4..12].try_into().unwrap()),
            stored_len: u32_at(12),
            raw_len: u32_at(16),
            compression: Compression::from_u8(b[20]).ok_or_else(|| bad("unknown compression"))?,
        })
    }

    /// Bytes this chunk occupies in its pack, header included.
    pub fn record_len(&self) -> u64 {
        crate::pack::RECORD_HEADER_LEN as u64 + u64::from(self.stored_len)
    }
}

/// Decodes a stored payload and checks it hashes to `id`.
///
/// The only way chunk bytes leave the store: nothing unverified is served.
/// On failure returns the reason (the caller adds pack and offset).
pub fn decode_verified(
    id: &ChunkId,
    loc: &ChunkLocation,
    payload: &[u8],
) -> std::result::Result<Vec<u8>, String> {
    let raw = match loc.compression {
        Compression::Raw => payload.to_vec(),
        Compression::Zstd => zstd::bulk::decompress(payload, loc.raw_len as usize)
            .map_err(|e| format!("zstd: {e}"))?,
    };
    if raw.len() != loc.raw_len as usize {
        return Err(format!("length {} instead of {}", raw.len(), loc.raw_len));
    }
    let got = ChunkId::of(&raw);
    if &got != id {
        return Err(format!("blake3 mismatch: bytes hash to {got}"));
    }
    Ok(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_rule() {
        for ok in [4096, 65536, 262144, 1 << 20, 4 << 20] {
            validate_chunk_size(ok).unwrap();
        }
        for bad in [0, 512, 4095, 12288, 8 << 20] {
            assert!(validate_chunk_size(bad).is_err());
        }
    }

    #[test]
    fn zero_test() {
        let mut v = vec![0u8; 70000];
        assert!(is_zero(&v));
        assert!(is_zero(&v[3..]));
        v[69999] = 1;
        assert!(!is_zero(&v));
        assert!(!is_zero(&v[1..]));
        assert!(is_zero(&[]));
    }

    #[test]
    fn location_round_trip() {
        let id = ChunkId::of(b"x");
        let loc = ChunkLocation {
            pack: 7,
            offset: 1 << 40,
            stored_len: 123,
            raw_len: 65536,
            compression: Compression::Zstd,
        };
        assert_eq!(ChunkLocation::decode(&id, &loc.encode()).unwrap(), loc);
    }
}
