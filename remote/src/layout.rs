//! The hub's object names and small object formats, shared by every backend
//! (`file://`, HTTP, S3) and by pack files. See docs/hub.md, "Hub layout".
//!
//! ```text
//! layout.json                          {"layout": 2}; absent: layout 1 (a hub written before layouts had versions)
//! snapshots/<snapshot id>.json         snapshot record (JSON), immutable
//! snapshots/<snapshot id>.idx          layout 2: which index objects locate every chunk of the snapshot
//! snapshots/<snapshot id>.ws           the snapshot's recorded working set (JSON), if it has one
//! manifests/<id[0..2]>/<manifest id>   canonical manifest encoding (what its id hashes)
//! tags/<tag>                           {"snapshot": "<snapshot id>"}
//! deleted/<tag>                        {"snapshot": "<snapshot id>"}: the last snapshot tag <tag> named when it was deleted (a tombstone)
//! packs/<id[0..2]>/<pack id>           layout 2: chunk objects back to back, named by the blake3 of the whole object
//! index/<index id>                     layout 2: where each chunk of some packs lies (see `packs`), named by its blake3
//! pending/<pack id>                    layout 2: {"since": <unix s>, "index": <id>}: a push published the pack's index before the pack (see below)
//! wanted/<pack id>                     layout 2: {}: a reader waits for this pending pack; its pusher sends it next
//! chunks/<id[0..2]>/<chunk id>         layout 1: one chunk object per chunk
//! ```
//!
//! Every name that comes from outside (a hub listing, an HTTP path, a pack
//! index) goes through [`Key::parse`], which accepts exactly these shapes:
//! ids are fixed-length lowercase hex, tags follow the project's tag rule, so
//! no name can hold `..`, a `/` of its own, or an absolute path. Objects are
//! immutable except tags, tombstones, pending markers and `layout.json`.
//!
//! **Pending packs.** A record on the hub means its chunks are there, with
//! one exception a reader must allow for: a push to a plain object store
//! (file, S3) publishes a snapshot once its working set's packs are up and
//! uploads the other packs after. Before publishing, it writes
//! `pending/<pack id>` for each pack still to come, and removes it once the
//! pack is up. So a reader that finds a pack missing looks for its marker:
//! present and younger than [`PENDING_MAX_AGE_SECS`], the pack is on its
//! way (wait and retry); absent or stale, the hub is incomplete (refuse).
//! A lazy reader whose fault waits for a pending pack also writes
//! `wanted/<pack id>`: the pusher looks at `wanted/` before each pack it
//! starts and sends the wanted ones first, so a child that faults outside
//! the working set waits for one pack, not for the push's order.
//! A pusher killed mid-way leaves markers behind; the next push of a
//! snapshot that needs those packs uploads them again (they are
//! content-addressed, so rebuilt from the index byte for byte).

use anyhow::{anyhow, bail, Result};
use bytes::{BufMut, Bytes, BytesMut};
use forkd_layers::{
    validate_tag, ChunkId, Compression, ManifestId, ObjectId, SnapshotId, StoredChunk,
    MAX_ANNOTATION_BYTES, MAX_CHUNK_SIZE, MAX_MANIFEST_BYTES, MAX_RECORD_BYTES,
};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Magic of a chunk object.
pub const CHUNK_MAGIC: &[u8; 4] = b"FKHC";
/// Length of a chunk object's header.
pub const CHUNK_HEADER_LEN: usize = 12;
/// Largest chunk object.
pub const MAX_CHUNK_OBJECT: u64 = CHUNK_HEADER_LEN as u64 + MAX_CHUNK_SIZE as u64;
/// Largest tag object accepted.
pub const MAX_TAG_OBJECT_BYTES: u64 = 4096;
/// Largest pack object accepted (a push makes them about 8 MiB).
pub const MAX_PACK_BYTES: u64 = 64 << 20;
/// Largest index object accepted (about 700,000 chunks).
pub const MAX_INDEX_BYTES: u64 = 32 << 20;
/// Largest snapshot locator (`snapshots/<id>.idx`).
pub const MAX_LOCATOR_BYTES: u64 = 1 << 20;
/// Largest `layout.json`.
pub const MAX_LAYOUT_BYTES: u64 = 4096;

/// The hub layout this build writes on a new hub.
pub const LAYOUT_PACKED: u32 = 2;
/// The layout of a hub without `layout.json`: one object per chunk.
pub const LAYOUT_CHUNKS: u32 = 1;

/// One object of a hub, named by what it holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// A chunk, `chunks/<fan-out>/<hex>` (layout 1).
    Chunk(ChunkId),
    /// A file manifest, `manifests/<fan-out>/<hex>`.
    Manifest(ManifestId),
    /// A snapshot record, `snapshots/<id>.json`.
    Snapshot(SnapshotId),
    /// A tag naming a snapshot, `tags/<name>`.
    Tag(String),
    /// A deleted tag's tombstone, `deleted/<name>`: which snapshot it named
    /// when it was deleted, so a node that missed the delete drops its copy
    /// of exactly that snapshot (a [`TagObject`]).
    Deleted(String),
    /// A pack of chunk objects, `packs/<fan-out>/<hex>` (layout 2).
    Pack(ObjectId),
    /// An index of packs, `index/<hex>` (layout 2).
    Index(ObjectId),
    /// The index objects that locate a snapshot's chunks,
    /// `snapshots/<id>.idx` (layout 2).
    Locator(SnapshotId),
    /// A snapshot's recorded working set, `snapshots/<id>.ws`.
    WorkingSet(SnapshotId),
    /// A pack a push promised but has not uploaded yet, `pending/<hex>`
    /// (a [`PendingObject`]).
    Pending(ObjectId),
    /// A pending pack a reader is waiting for, `wanted/<hex>` (`{}`).
    Wanted(ObjectId),
    /// The hub's layout version, `layout.json`.
    Layout,
}

impl Key {
    /// A tag key, checked against the tag rule.
    pub fn tag(name: &str) -> Result<Key> {
        validate_tag(name)?;
        Ok(Key::Tag(name.to_string()))
    }

    /// A tombstone key, checked against the tag rule.
    pub fn deleted(name: &str) -> Result<Key> {
        validate_tag(name)?;
        Ok(Key::Deleted(name.to_string()))
    }

    /// The object's path relative to the hub root.
    pub fn path(&self) -> String {
        match self {
            Key::Chunk(id) => fanned("chunks", &id.to_hex()),
            Key::Manifest(id) => fanned("manifests", &id.to_hex()),
            Key::Snapshot(id) => format!("snapshots/{id}.json"),
            Key::Tag(t) => format!("tags/{t}"),
            Key::Deleted(t) => format!("deleted/{t}"),
            Key::Pack(id) => fanned("packs", &id.to_hex()),
            Key::Index(id) => format!("index/{id}"),
            Key::Locator(id) => format!("snapshots/{id}.idx"),
            Key::WorkingSet(id) => format!("snapshots/{id}.ws"),
            Key::Pending(id) => format!("pending/{id}"),
            Key::Wanted(id) => format!("wanted/{id}"),
            Key::Layout => "layout.json".into(),
        }
    }

    /// Parses a relative object path, accepting only the exact shapes
    /// [`Key::path`] produces.
    pub fn parse(path: &str) -> Result<Key> {
        let bad = || anyhow!("invalid hub object name {path:?}");
        let parts: Vec<&str> = path.split('/').collect();
        let hex = |s: &str| -> Result<[u8; 32]> {
            let id: ChunkId = s.parse().map_err(|e| anyhow!("{e}"))?;
            Ok(id.0)
        };
        let key = match parts.as_slice() {
            ["chunks", _, id] => Key::Chunk(ChunkId(hex(id)?)),
            ["manifests", _, id] => Key::Manifest(ManifestId(hex(id)?)),
            ["packs", _, id] => Key::Pack(ObjectId(hex(id)?)),
            ["index", id] => Key::Index(ObjectId(hex(id)?)),
            ["pending", id] => Key::Pending(ObjectId(hex(id)?)),
            ["wanted", id] => Key::Wanted(ObjectId(hex(id)?)),
            ["snapshots", file] => {
                let (id, ext) = file.split_once('.').ok_or_else(bad)?;
                let id: SnapshotId = id.parse().map_err(|e| anyhow!("{e}"))?;
                match ext {
                    "json" => Key::Snapshot(id),
                    "idx" => Key::Locator(id),
                    "ws" => Key::WorkingSet(id),
                    _ => return Err(bad()),
                }
            }
            ["tags", tag] => Key::tag(tag)?,
            ["deleted", tag] => Key::deleted(tag)?,
            ["layout.json"] => Key::Layout,
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
            Key::Chunk(_) => MAX_CHUNK_OBJECT,
            Key::Manifest(_) => MAX_MANIFEST_BYTES as u64,
            Key::Snapshot(_) => MAX_RECORD_BYTES as u64,
            Key::Tag(_) | Key::Deleted(_) | Key::Pending(_) | Key::Wanted(_) => {
                MAX_TAG_OBJECT_BYTES
            }
            Key::Pack(_) => MAX_PACK_BYTES,
            Key::Index(_) => MAX_INDEX_BYTES,
            Key::Locator(_) => MAX_LOCATOR_BYTES,
            Key::WorkingSet(_) => MAX_ANNOTATION_BYTES as u64,
            Key::Layout => MAX_LAYOUT_BYTES,
        }
    }

    /// True for the kinds that may be overwritten (tags, tombstones,
    /// pending and wanted markers, the layout).
    pub fn is_mutable(&self) -> bool {
        matches!(
            self,
            Key::Tag(_) | Key::Deleted(_) | Key::Pending(_) | Key::Wanted(_) | Key::Layout
        )
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Chunk(id) => write!(f, "chunk {id}"),
            Key::Manifest(id) => write!(f, "manifest {id}"),
            Key::Snapshot(id) => write!(f, "snapshot record {id}"),
            Key::Tag(t) => write!(f, "tag '{t}'"),
            Key::Deleted(t) => write!(f, "tombstone of tag '{t}'"),
            Key::Pack(id) => write!(f, "pack {id}"),
            Key::Index(id) => write!(f, "index {id}"),
            Key::Locator(id) => write!(f, "chunk locator of snapshot {id}"),
            Key::WorkingSet(id) => write!(f, "working set of snapshot {id}"),
            Key::Pending(id) => write!(f, "pending marker of pack {id}"),
            Key::Wanted(id) => write!(f, "wanted marker of pack {id}"),
            Key::Layout => write!(f, "layout.json"),
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
    put_chunk(&mut b, c);
    b.freeze()
}

/// Appends a chunk object to `b` (how packs are built).
pub fn put_chunk(b: &mut BytesMut, c: &StoredChunk) {
    b.put_slice(CHUNK_MAGIC);
    b.put_u8(c.compression as u8);
    b.put_slice(&[0, 0, 0]);
    b.put_u32_le(c.raw_len);
    b.put_slice(&c.payload);
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
    /// The snapshot the tag names.
    pub snapshot: SnapshotId,
}

impl TagObject {
    /// The object's bytes.
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("tag object serializes"))
    }

    /// Parses a tag object, bounded.
    pub fn decode(tag: &str, b: &[u8]) -> Result<TagObject> {
        if b.len() as u64 > MAX_TAG_OBJECT_BYTES {
            bail!("tag '{tag}' object is {} bytes, over the limit", b.len());
        }
        serde_json::from_slice(b).map_err(|e| anyhow!("tag '{tag}' object is malformed: {e}"))
    }
}

/// How long a pending marker keeps readers waiting for its pack: a push
/// that has not uploaded it within this long is taken for dead (push the
/// snapshot again to complete it).
pub const PENDING_MAX_AGE_SECS: u64 = 3600;

/// `pending/<pack id>`: the pack is promised by a push still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PendingObject {
    /// When the push wrote the marker, Unix seconds (the pusher's clock).
    pub since: u64,
    /// The index naming the pack (what a later push rebuilds it from).
    pub index: ObjectId,
}

impl PendingObject {
    /// A marker written now for a pack of `index`.
    pub fn now(index: ObjectId) -> PendingObject {
        PendingObject {
            since: unix_now(),
            index,
        }
    }

    /// The object's bytes.
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("pending marker serializes"))
    }

    /// Parses a marker, bounded.
    pub fn decode(pack: &ObjectId, b: &[u8]) -> Result<PendingObject> {
        if b.len() as u64 > MAX_TAG_OBJECT_BYTES {
            bail!("the pending marker of pack {pack} is over the size limit");
        }
        serde_json::from_slice(b)
            .map_err(|e| anyhow!("the pending marker of pack {pack} is malformed: {e}"))
    }

    /// Whether readers should still wait for the pack: the marker is
    /// younger than [`PENDING_MAX_AGE_SECS`] (a pusher rewrites its markers
    /// well within that). One dated further ahead than that is no pusher's
    /// clock skew: stale too.
    pub fn is_fresh(&self) -> bool {
        let now = unix_now();
        now.saturating_sub(self.since) < PENDING_MAX_AGE_SECS
            && self.since.saturating_sub(now) < PENDING_MAX_AGE_SECS
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `layout.json`: which layout the hub's objects follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutObject {
    /// 1: one object per chunk; 2: packs and indexes.
    pub layout: u32,
}

impl LayoutObject {
    /// The object's bytes.
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("layout object serializes"))
    }

    /// Parses `layout.json`, refusing layouts this build does not know.
    pub fn decode(b: &[u8]) -> Result<LayoutObject> {
        if b.len() as u64 > MAX_LAYOUT_BYTES {
            bail!("layout.json is {} bytes, over the limit", b.len());
        }
        let l: LayoutObject =
            serde_json::from_slice(b).map_err(|e| anyhow!("layout.json is malformed: {e}"))?;
        if l.layout != LAYOUT_CHUNKS && l.layout != LAYOUT_PACKED {
            bail!(
                "the hub has layout {}, this forkd understands layouts 1 and 2; upgrade forkd",
                l.layout
            );
        }
        Ok(l)
    }
}

/// `snapshots/<id>.idx`: the index objects whose entries locate every chunk
/// of the snapshot (its whole chain's chunks that it names).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Locator {
    /// Always 2.
    pub layout: u32,
    /// Index object ids.
    pub indexes: Vec<ObjectId>,
}

/// Most index objects one locator may name.
pub const MAX_LOCATOR_INDEXES: usize = 10_000;

impl Locator {
    /// The object's bytes.
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("locator serializes"))
    }

    /// Parses a locator, bounded.
    pub fn decode(id: &SnapshotId, b: &[u8]) -> Result<Locator> {
        if b.len() as u64 > MAX_LOCATOR_BYTES {
            bail!("the chunk locator of snapshot {id} is over the size limit");
        }
        let l: Locator = serde_json::from_slice(b)
            .map_err(|e| anyhow!("the chunk locator of snapshot {id} is malformed: {e}"))?;
        if l.layout != LAYOUT_PACKED || l.indexes.len() > MAX_LOCATOR_INDEXES {
            bail!(
                "the chunk locator of snapshot {id} names layout {} and {} indexes",
                l.layout,
                l.indexes.len()
            );
        }
        Ok(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_refuse_traversal() {
        let c = ChunkId::of(b"x");
        let s = SnapshotId::random();
        for k in [
            Key::Chunk(c),
            Key::Manifest(ManifestId(c.0)),
            Key::Snapshot(s),
            Key::tag("py-numpy_1").unwrap(),
            Key::deleted("py-numpy_1").unwrap(),
            Key::Pack(ObjectId(c.0)),
            Key::Index(ObjectId(c.0)),
            Key::Pending(ObjectId(c.0)),
            Key::Wanted(ObjectId(c.0)),
            Key::Locator(s),
            Key::WorkingSet(s),
            Key::Layout,
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
            "deleted/..".into(),
            "deleted/a/b".into(),
            format!("chunks/00/{hex}"),
            format!("chunks/{}/{}", &hex[..2], hex.to_uppercase()),
            format!("chunks/{}/../{hex}", &hex[..2]),
            format!("manifests/{}/{}", &hex[..2], &hex[..62]),
            format!("packs/00/{hex}"),
            format!("index/{}/{hex}", &hex[..2]),
            format!("pending/{}/{hex}", &hex[..2]),
            "pending/..".into(),
            "snapshots/0123.json".into(),
            format!("snapshots/{}", &hex[..32]),
            format!("snapshots/{}.exe", &hex[..32]),
            format!("snapshots/{}.json.idx", &hex[..32]),
            format!("./chunks/{}/{hex}", &hex[..2]),
            "layout.json/x".into(),
        ] {
            assert!(Key::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pending_markers_round_trip_and_go_stale() {
        let p = ObjectId::of(b"pack");
        let m = PendingObject::now(ObjectId::of(b"index"));
        assert_eq!(PendingObject::decode(&p, &m.encode()).unwrap(), m);
        assert!(m.is_fresh());
        let old = PendingObject {
            since: m.since - PENDING_MAX_AGE_SECS,
            ..m
        };
        assert!(!old.is_fresh());
        let skewed = PendingObject {
            since: m.since + 600,
            ..m
        };
        assert!(skewed.is_fresh());
        let future = PendingObject {
            since: m.since + PENDING_MAX_AGE_SECS,
            ..m
        };
        assert!(!future.is_fresh());
        assert!(PendingObject::decode(&p, b"{\"since\": 1, \"x\": 2}").is_err());
        assert!(PendingObject::decode(&p, &vec![b' '; 5000]).is_err());
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

    #[test]
    fn small_objects_are_checked() {
        assert_eq!(LayoutObject::decode(br#"{"layout":2}"#).unwrap().layout, 2);
        let e = LayoutObject::decode(br#"{"layout":3}"#).unwrap_err();
        assert!(e.to_string().contains("upgrade forkd"), "{e}");
        assert!(LayoutObject::decode(br#"{"layout":2,"x":1}"#).is_err());
        let s = SnapshotId::random();
        let l = Locator {
            layout: 2,
            indexes: vec![ObjectId([1; 32])],
        };
        assert_eq!(Locator::decode(&s, &l.encode()).unwrap(), l);
        assert!(Locator::decode(&s, br#"{"layout":1,"indexes":[]}"#).is_err());
    }
}
