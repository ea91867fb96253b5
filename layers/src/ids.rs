//! Identifiers: chunk and manifest ids (blake3, 32 bytes) and snapshot ids
//! (random 128-bit).
//!
//! All render as lowercase hex and serialize as hex strings in JSON.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

macro_rules! hex_id {
    ($(#[$doc:meta])* $name:ident, $len:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; $len]);

        impl $name {
            /// Length of the id in bytes.
            pub const LEN: usize = $len;

            /// The raw bytes (used as RocksDB keys).
            pub fn as_bytes(&self) -> &[u8; $len] {
                &self.0
            }

            /// Parses raw key bytes; `None` if the length is wrong.
            pub fn from_slice(b: &[u8]) -> Option<Self> {
                <[u8; $len]>::try_from(b).ok().map($name)
            }

            /// Lowercase hex.
            pub fn to_hex(&self) -> String {
                hex::encode(self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.to_hex())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.to_hex())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                if s.len() != 2 * $len || s.bytes().any(|b| b.is_ascii_uppercase()) {
                    return Err(format!(
                        "'{s}' is not a {}: expected {} lowercase hex digits",
                        stringify!($name),
                        2 * $len
                    ));
                }
                let mut out = [0u8; $len];
                hex::decode_to_slice(s, &mut out)
                    .map_err(|e| format!("'{s}' is not a {}: {e}", stringify!($name)))?;
                Ok($name(out))
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.to_hex())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

hex_id!(
    /// blake3 of a chunk's uncompressed bytes.
    ChunkId,
    32
);
hex_id!(
    /// blake3 of a [`crate::FileManifest`]'s canonical encoding, so identical
    /// files across snapshots share one manifest.
    ManifestId,
    32
);
hex_id!(
    /// A snapshot's immutable id: 128 random bits, rendered as 32 lowercase hex.
    ///
    /// Random rather than content-derived on purpose: two snapshots with
    /// identical bytes taken at different times (or with different lineage)
    /// are different events and must keep separate records, tags and
    /// parent/child links. Content identity is already captured one level
    /// down by [`ManifestId`].
    SnapshotId,
    16
);

hex_id!(
    /// blake3 of a hub object's bytes: the name of a content-addressed object
    /// on a snapshot hub (a pack of chunks, an index of packs; docs/hub.md).
    /// The store keeps it in [`crate::RemoteChunk`] to know where a chunk it
    /// does not hold can be fetched from.
    ObjectId,
    32
);

impl ObjectId {
    /// Hashes an object's bytes.
    pub fn of(data: &[u8]) -> ObjectId {
        ObjectId(*blake3::hash(data).as_bytes())
    }
}

impl ChunkId {
    /// Hashes uncompressed chunk bytes.
    pub fn of(data: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(data).as_bytes())
    }
}

impl SnapshotId {
    /// A fresh random id.
    pub fn random() -> SnapshotId {
        SnapshotId(rand::random())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let id = SnapshotId::random();
        let s = id.to_string();
        assert_eq!(s.len(), 32);
        assert_eq!(s.parse::<SnapshotId>().unwrap(), id);
        assert!(s.to_uppercase().parse::<SnapshotId>().is_err() || s == s.to_uppercase());
        assert!("xyz".parse::<SnapshotId>().is_err());
        let j = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<SnapshotId>(&j).unwrap(), id);
    }
}
