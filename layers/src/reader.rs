//! Random-access reads of one snapshot file.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ids::SnapshotId;
use crate::manifest::{ChunkRef, FileManifest};
use crate::view::StoreView;

/// A read-only handle on one file of a snapshot.
///
/// `Send + Sync`: `read_at` may be called from many threads at once (the FUSE
/// filesystem does). Reads go through the store's shared, byte-bounded cache
/// of verified, decompressed chunks; O(1) in snapshot-chain depth because the
/// manifest is flattened.
#[derive(Clone)]
pub struct FileReader {
    view: StoreView,
    snapshot: SnapshotId,
    name: String,
    manifest: Arc<FileManifest>,
}

impl FileReader {
    pub(crate) fn new(
        view: StoreView,
        snapshot: SnapshotId,
        name: &str,
        manifest: Arc<FileManifest>,
    ) -> FileReader {
        FileReader {
            view,
            snapshot,
            name: name.to_string(),
            manifest,
        }
    }

    /// File size in bytes.
    pub fn size(&self) -> u64 {
        self.manifest.size()
    }

    /// The file's name in its snapshot.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The snapshot this file belongs to.
    pub fn snapshot(&self) -> &SnapshotId {
        &self.snapshot
    }

    /// The file's manifest.
    pub fn manifest(&self) -> &Arc<FileManifest> {
        &self.manifest
    }

    /// What covers byte `offset`: `Zero` for an all-zero region (and past the
    /// end), so callers can report holes (SEEK_HOLE) without reading.
    pub fn chunk_at(&self, offset: u64) -> ChunkRef {
        self.manifest.chunk_at(offset).unwrap_or(ChunkRef::Zero)
    }

    /// Reads up to `buf.len()` bytes at `offset`. Short only at end of file;
    /// returns 0 at or past the end. Never returns unverified bytes: a corrupt
    /// or missing chunk is an [`Error::FileRead`] naming this file, the file
    /// offset, the chunk id, pack and pack offset.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let size = self.size();
        if offset >= size {
            return Ok(0);
        }
        let want = buf.len().min((size - offset) as usize);
        let cs = u64::from(self.manifest.chunk_size());
        let mut done = 0usize;
        while done < want {
            let pos = offset + done as u64;
            let slot = (pos / cs) as usize;
            let in_chunk = (pos % cs) as usize;
            let n = (want - done).min(cs as usize - in_chunk);
            let dst = &mut buf[done..done + n];
            match self.manifest.entry(slot) {
                ChunkRef::Zero => dst.fill(0),
                ChunkRef::Chunk(id) => {
                    let data = self.view.chunk(&id).map_err(|e| Error::FileRead {
                        snapshot: self.snapshot,
                        file: self.name.clone(),
                        file_offset: pos,
                        source: Box::new(e),
                    })?;
                    dst.copy_from_slice(&data[in_chunk..in_chunk + n]);
                }
            }
            done += n;
        }
        Ok(want)
    }

    /// Reads exactly `buf.len()` bytes at `offset` (fails past end of file).
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = self.read_at(buf, offset)?;
        if n != buf.len() {
            return Err(Error::InvalidArgument(format!(
                "read of {} bytes at {offset} runs past the end of {} ({} bytes)",
                buf.len(),
                self.name,
                self.size()
            )));
        }
        Ok(())
    }
}
