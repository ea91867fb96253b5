//! Prefetch: pulling a snapshot file's ranges into the kernel page cache
//! through the mount, ahead of the children that will fault them in, and
//! storing the list of ranges worth prefetching with the snapshot.
//!
//! The list is a store annotation named `prefetch.<file>` (JSON
//! `[[offset, len], ...]`). The mount opens the store read-only, so the
//! writer (poold, the CLI) saves it with [`save_ranges`], typically with the
//! ranges `record_stop` returned for the first child resumed from a cold
//! cache.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use forkd_layers::{SnapshotId, Store, StoreView};
use serde::{Deserialize, Serialize};

use crate::ranges::{merge, total_bytes, RangeList};

/// Largest piece one worker reads at a time.
const PIECE: u64 = 1 << 20;

/// Name of the store annotation holding a file's prefetch ranges.
pub fn annotation_name(file: &str) -> String {
    format!("prefetch.{file}")
}

/// Stores the prefetch ranges of `file` of snapshot `id` (writer side).
pub fn save_ranges(
    store: &Store,
    id: &SnapshotId,
    file: &str,
    ranges: &[(u64, u64)],
) -> Result<()> {
    let json = serde_json::to_vec(&merge(ranges.to_vec()))?;
    store
        .set_annotation(id, &annotation_name(file), &json)
        .with_context(|| format!("saving prefetch ranges of {file} for snapshot {id}"))
}

/// The stored prefetch ranges of `file` of snapshot `id`, if any.
pub fn load_ranges(view: &StoreView, id: &SnapshotId, file: &str) -> Result<Option<RangeList>> {
    let Some(bytes) = view.annotation(id, &annotation_name(file))? else {
        return Ok(None);
    };
    let list: RangeList = serde_json::from_slice(&bytes).with_context(|| {
        format!("stored prefetch ranges of {file} for snapshot {id} are not a JSON range list")
    })?;
    Ok(Some(merge(list)))
}

/// The data (non-hole) extents of an open file, via SEEK_DATA/SEEK_HOLE
/// (forkd-fs reports zero chunks as holes).
pub fn data_extents(file: &File) -> std::io::Result<RangeList> {
    let fd = file.as_raw_fd();
    let size = file.metadata()?.len();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        // SAFETY: plain lseek on an fd we own.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        out.push((data as u64, (hole - data) as u64));
        pos = hole;
    }
    Ok(out)
}

/// What a prefetch did.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PrefetchReport {
    /// Bytes read through the mount.
    pub bytes: u64,
    /// Wall time, milliseconds.
    pub ms: u64,
}

/// Reads `ranges` of `path` with `threads` parallel readers, 1 MiB at a
/// time, so the pages land in the kernel page cache (the bytes are
/// discarded). Fails on the first read error (e.g. EIO from a bad chunk).
pub fn read_ranges(path: &Path, ranges: &[(u64, u64)], threads: usize) -> Result<PrefetchReport> {
    let t0 = Instant::now();
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let size = file.metadata()?.len();
    let mut pieces = Vec::new();
    for &(off, len) in &merge(ranges.to_vec()) {
        let end = off.saturating_add(len).min(size);
        let mut p = off;
        while p < end {
            let n = (end - p).min(PIECE);
            pieces.push((p, n));
            p += n;
        }
    }
    let next = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let threads = threads.clamp(1, 64).min(pieces.len().max(1));
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    let mut buf = vec![0u8; PIECE as usize];
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, n)) = pieces.get(i) else {
                            return Ok(());
                        };
                        let b = &mut buf[..n as usize];
                        file.read_exact_at(b, off).with_context(|| {
                            format!("reading {} bytes at {off} of {}", n, path.display())
                        })?;
                        bytes.fetch_add(n, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("prefetch worker panicked")?;
        }
        Ok(())
    })?;
    Ok(PrefetchReport {
        bytes: bytes.into_inner(),
        ms: t0.elapsed().as_millis() as u64,
    })
}

/// Where a snapshot file lives on a mount.
pub fn file_path(mount: &Path, id: &SnapshotId, file: &str) -> PathBuf {
    mount.join("by-id").join(id.to_string()).join(file)
}

/// What `forkd-fs prefetch` reads when no list is given or stored: every
/// data extent of the file (zero chunks skipped).
pub fn default_ranges(path: &Path) -> Result<RangeList> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    data_extents(&f).with_context(|| format!("finding the data extents of {}", path.display()))
}

/// Bytes covered by `ranges` (merged).
pub fn ranges_bytes(ranges: &[(u64, u64)]) -> u64 {
    total_bytes(&merge(ranges.to_vec()))
}
