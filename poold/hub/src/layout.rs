//! The hub's object layout, shared by every backend (`file://`, HTTP, S3)
//! and by pack files. See docs/hub.md.
//!
//! ```text
//! chunks/<id[0..2]>/<chunk id>        chunk object: 12-byte header + stored payload
//! manifests/<id[0..2]>/<manifest id>  canonical manifest encoding (what its id hashes)
//! snapshots/<snapshot id>.json        snapshot record (JSON), immutable
//! tags/<tag>                          {"snapshot": "<snapshot id>"}, the only mutable objects
//! ```
//!
//! Every name that comes from outside (a hub listing, an HTTP path, a pack
//! index) goes through [`Key::parse`], which accepts exactly these shapes:
//! ids are fixed-length lowercase hex, tags follow the project's tag rule, so
//! no name can hold `..`, a `/` of its own, or an absolute path.

use anyhow::{anyhow, bail, Result};
use bytes::{BufMut, Bytes, BytesMut};
use forkd_layers::{
    validate_tag, ChunkId, Compression, ManifestId, SnapshotId, StoredChunk, MAX_CHUNK_SIZE,
    MAX_MANIFEST_BYTES, MAX_RECORD_BYTES,
};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Magic of a chunk object.
pub const CHUNK_MAGIC: &[u8; 4] = b"FKHC";
/// Length of a chunk object's header.
pub const CHUNK_HEADER_LEN: usize = 12;
/// Largest tag object accepted.
pub const MAX_TAG_OBJECT_BYTES: u64 = 4096;

/// One object of a hub, named by what it holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// A chunk, `chunks/<fan-out>/<hex>`.
    Chunk(ChunkId),
    /// A file manifest, `manifests/<fan-out>/<hex>`.
    Manifest(ManifestId),
    /// A snapshot record, `snapshots/<id>.json`.
    Snapshot(SnapshotId),
    /// A tag naming a snapshot, `tags/<name>`.
    Tag(String),
}

impl Key {
    /// A tag key, checked against the tag rule.
    pub fn tag(name: &str) -> Result<Key> {
        validate_tag(name)?;
        Ok(Key::Tag(name.to_string()))
    }

    /// The object's path relative to the hub root.
    pub fn path(&self) -> String {
        match self {
            Key::Chunk(id) => fanned("chunks", &id.to_hex()),
            Key::Manifest(id) => fanned("manifests", &id.to_hex()),
            Key::Snapshot(id) => format!("snapshots/{id}.json"),
            Key::Tag(t) => format!("tags/{t}"),
        }
    }

    /// Parses a relative object path, accepting only the exact shapes
    /// [`Key::path`] produces.
    pub fn parse(path: &str) -> Result<Key> {
        let bad = || anyhow!("invalid hub object name {path:?}");
        let parts: Vec<&str> = path.split('/').collect();
        let key = match parts.as_slice() {
            ["chunks", _, id] => Key::Chunk(id.parse().map_err(|e| anyhow!("{e}"))?),
            ["manifests", _, id] => Key::Manifest(id.parse().map_err(|e| anyhow!("{e}"))?),
            ["snapshots", file] => {
                let id = file.strip_suffix(".json").ok_or_else(bad)?;
                Key::Snapshot(id.parse().map_err(|e| anyhow!("{e}"))?)
            }
            ["tags", tag] => Key::tag(tag)?,
            _ => return Err(bad()),
        };
        if key.path() != path {
            return Err(bad());
        }
        Ok(key)
    }

    /// Largest object of this kind accepted; checked before allocating.
    pub fn max_len(&self) -> u64 {
        match self {
            Key::Chunk(_) => (CHUNK_HEADER_LEN as u64) + u64::from(MAX_CHUNK_SIZE),
            Key::Manifest(_) => MAX_MANIFEST_BYTES as u64,
            Key::Snapshot(_) => MAX_RECORD_BYTES as u64,
            Key::Tag(_) => MAX_TAG_OBJECT_BYTES,
        }
    }

    /// True for the one mutable kind.
    pub fn is_mutable(&self) -> bool {
        matches!(self, Key::Tag(_))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Chunk(id) => write!(f, "chunk {id}"),
            Key::Manifest(id) => write!(f, "manifest {id}"),
            Key::Snapshot(id) => write!(f, "snapshot record {id}"),
            Key::Tag(t) => write!(f, "tag '{t}'"),
        }
    }
}

fn fanned(dir: &str, hex: &str) -> String {
    format!("{dir}/{}/{hex}", &hex[..2])
}

/// Encodes a chunk object: `"FKHC" | compression u8 | 3 zero bytes |
/// raw_len u32 LE | payload`.
pub fn encode_chunk(c: &StoredChunk) -> Bytes {
    let mut b = BytesMut::with_capacity(CHUNK_HEADER_LEN + c.payload.len());
    b.put_slice(CHUNK_MAGIC);
    b.put_u8(c.compression as u8);
    b.put_slice(&[0, 0, 0]);
    b.put_u32_le(c.raw_len);
    b.put_slice(&c.payload);
    b.freeze()
}

/// Decodes a chunk object's header (the caller then verifies the bytes
/// against `id` with [`StoredChunk::verify`]).
pub fn decode_chunk(id: ChunkId, b: &[u8]) -> Result<StoredChunk, String> {
    if b.len() < CHUNK_HEADER_LEN || &b[..4] != CHUNK_MAGIC || b[5..8] != [0, 0, 0] {
        return Err("bad chunk object header".into());
    }
    let compression = Compression::try_from(b[4])?;
    let raw_len = u32::from_le_bytes(b[8..12].try_into().unwrap());
    if raw_len > MAX_CHUNK_SIZE || b.len() - CHUNK_HEADER_LEN > MAX_CHUNK_SIZE as usize {
        return Err(format!(
            "lengths over the {MAX_CHUNK_SIZE}-byte chunk limit"
        ));
    }
    Ok(StoredChunk {
        id,
        compression,
        raw_len,
        payload: b[CHUNK_HEADER_LEN..].to_vec(),
    })
}

/// A tag object: which snapshot the tag names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TagObject {
    pub snapshot: SnapshotId,
}

impl TagObject {
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("tag object serializes"))
    }

    pub fn decode(tag: &str, b: &[u8]) -> Result<TagObject> {
        if b.len() as u64 > MAX_TAG_OBJECT_BYTES {
            bail!("tag '{tag}' object is {} bytes, over the limit", b.len());
        }
        serde_json::from_slice(b).map_err(|e| anyhow!("tag '{tag}' object is malformed: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_refuse_traversal() {
        let c = ChunkId::of(b"x");
        for k in [
            Key::Chunk(c),
            Key::Manifest(ManifestId(c.0)),
            Key::Snapshot(SnapshotId::random()),
            Key::tag("py-numpy_1").unwrap(),
        ] {
            assert_eq!(Key::parse(&k.path()).unwrap(), k);
        }
        let hex = c.to_hex();
        for bad in [
            "../x".to_string(),
            "/etc/passwd".into(),
            "tags/..".into(),
            "tags/a/b".into(),
            "tags/".into(),
            format!("chunks/00/{hex}"),
            format!("chunks/{}/{}", &hex[..2], hex.to_uppercase()),
            format!("chunks/{}/../{hex}", &hex[..2]),
            format!("manifests/{}/{}", &hex[..2], &hex[..62]),
            "snapshots/0123.json".into(),
            format!("snapshots/{}", &hex[..32]),
            format!("./chunks/{}/{hex}", &hex[..2]),
        ] {
            assert!(Key::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn chunk_objects_round_trip() {
        let data = vec![7u8; 5000];
        let c = StoredChunk {
            id: ChunkId::of(&data),
            compression: Compression::Raw,
            raw_len: 5000,
            payload: data,
        };
        let b = encode_chunk(&c);
        assert_eq!(b.len(), CHUNK_HEADER_LEN + 5000);
        let d = decode_chunk(c.id, &b).unwrap();
        assert_eq!(d, c);
        d.verify().unwrap();
        let mut bad = b.to_vec();
        bad[4] = 9;
        assert!(decode_chunk(c.id, &bad).is_err());
        assert!(decode_chunk(c.id, &b[..5]).is_err());
    }
}
