//! A snapshot's working set: the chunks its first restore and first answers
//! read, in the order they were first read.
//!
//! forkd-fs records it (it sees every read of the mount) and saves it as the
//! annotation [`ANNOTATION`]; push sends it with the snapshot and lays the
//! hub's packs out in its order; a lazy host fetches it first, with many
//! requests in flight, as soon as a restore starts (docs/fs.md, "Lazy
//! snapshots"). It names slots of the snapshot's files, not chunk ids, so it
//! is small and means the same on every host.
//!
//! JSON: `{"version": 1, "files": ["memory.bin", ...], "reads": [[file, slot], ...]}`
//! where `file` indexes `files` and `slot` is a chunk slot of that file's
//! manifest.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::{ChunkId, SnapshotId};
use crate::manifest::ChunkRef;
use crate::snapshot::SnapshotRecord;
use crate::tag::is_valid_file_name;
use crate::view::StoreView;

/// Name of the annotation that holds it.
pub const ANNOTATION: &str = "workingset";
/// Most reads one working set may list (a 64 GiB file at 64 KiB chunks).
pub const MAX_READS: usize = 1 << 20;

/// A recorded working set (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkingSet {
    /// Always 1.
    pub version: u32,
    /// The files `reads` refer to, by index.
    pub files: Vec<String>,
    /// `(file index, chunk slot)` in first-read order, each once.
    pub reads: Vec<(u16, u32)>,
}

impl WorkingSet {
    /// An empty working set over no files.
    pub fn new() -> WorkingSet {
        WorkingSet {
            version: 1,
            ..Default::default()
        }
    }

    /// Appends a first read of `slot` of `file`.
    pub fn push(&mut self, file: &str, slot: u32) {
        let i = match self.files.iter().position(|f| f == file) {
            Some(i) => i,
            None => {
                self.files.push(file.to_string());
                self.files.len() - 1
            }
        };
        self.reads.push((i as u16, slot));
    }

    /// The JSON bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("working set serializes")
    }

    /// Parses and checks a working set (from the store or a hub).
    pub fn decode(id: &SnapshotId, b: &[u8]) -> Result<WorkingSet> {
        let bad = |reason: String| Error::CorruptRecord {
            what: "working set",
            key: id.to_string(),
            reason,
        };
        if b.len() > crate::MAX_ANNOTATION_BYTES {
            return Err(bad(format!("{} bytes, over the limit", b.len())));
        }
        let ws: WorkingSet = serde_json::from_slice(b).map_err(|e| bad(e.to_string()))?;
        if ws.version != 1 {
            return Err(bad(format!("version {}", ws.version)));
        }
        if ws.reads.len() > MAX_READS || ws.files.len() > crate::MAX_RECORD_FILES {
            return Err(bad("too many reads or files".into()));
        }
        if let Some(f) = ws.files.iter().find(|f| !is_valid_file_name(f)) {
            return Err(bad(format!("invalid file name {f:?}")));
        }
        if ws.reads.iter().any(|(f, _)| *f as usize >= ws.files.len()) {
            return Err(bad("a read names a file that is not listed".into()));
        }
        Ok(ws)
    }

    /// The distinct chunks it names in `rec`, first read first; zero slots
    /// and slots past a file's end are skipped.
    pub fn chunks(&self, view: &StoreView, rec: &SnapshotRecord) -> Result<Vec<ChunkId>> {
        let mut manifests = Vec::with_capacity(self.files.len());
        for f in &self.files {
            manifests.push(match rec.files.get(f) {
                Some(r) => Some(view.manifest(&r.manifest)?),
                None => None,
            });
        }
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for &(f, slot) in &self.reads {
            let Some(Some(m)) = manifests.get(f as usize) else {
                continue;
            };
            if (slot as usize) < m.len() {
                if let ChunkRef::Chunk(c) = m.entry(slot as usize) {
                    if seen.insert(c) {
                        out.push(c);
                    }
                }
            }
        }
        Ok(out)
    }
}

impl StoreView {
    /// The recorded working set of snapshot `id`, if any.
    pub fn working_set(&self, id: &SnapshotId) -> Result<Option<WorkingSet>> {
        match self.annotation(id, ANNOTATION)? {
            Some(b) => WorkingSet::decode(id, &b).map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let id = SnapshotId::random();
        let mut ws = WorkingSet::new();
        ws.push("vmstate", 0);
        ws.push("memory.bin", 7);
        ws.push("vmstate", 1);
        assert_eq!(ws.files, ["vmstate", "memory.bin"]);
        assert_eq!(ws.reads, [(0, 0), (1, 7), (0, 1)]);
        assert_eq!(WorkingSet::decode(&id, &ws.encode()).unwrap(), ws);
        for bad in [
            r#"{"version":2,"files":[],"reads":[]}"#,
            r#"{"version":1,"files":["a"],"reads":[[1,0]]}"#,
            r#"{"version":1,"files":["../x"],"reads":[]}"#,
            r#"{"version":1,"files":[],"reads":[],"extra":1}"#,
        ] {
            assert!(WorkingSet::decode(&id, bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
