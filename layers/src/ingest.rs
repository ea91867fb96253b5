//! Ingest: cut a file into chunks, hash and compress them on worker threads,
//! append new chunks to packs, and record a manifest.
//!
//! Invariant: the RocksDB batch that indexes new chunks and stores the
//! manifest is committed only after every pack those chunks were appended to
//! was fdatasync'd. A crash before that leaves unindexed bytes in a pack
//! (reclaimed by GC), never an index entry naming missing bytes.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};

use rocksdb::WriteBatch;

use crate::chunk::{compress, is_zero, validate_chunk_size, ChunkLocation, Compression};
use crate::db::{CF_CHUNKS, CF_MANIFESTS, RESERVE_GROW};
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ManifestId};
use crate::manifest::{ChunkRef, FileManifest};
use crate::snapshot::FileRef;
use crate::store::Store;

/// Progress callback: `(bytes done, bytes total)`; total is 0 when unknown
/// (a reader of unknown length).
pub type ProgressFn = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// How to ingest one file.
#[derive(Clone, Default)]
pub struct IngestOptions {
    /// Chunk size; `None` = the base manifest's, else the store default.
    pub chunk_size: Option<u32>,
    /// zstd level; `None` = the store default.
    pub zstd_level: Option<i32>,
    /// A manifest this file is a modified copy of (e.g. the parent
    /// snapshot's `memory.bin`).
    pub base: Option<ManifestId>,
    /// With `base`: the only byte ranges that may differ from it. Only chunks
    /// overlapping them (and any beyond the base's end) are read and hashed;
    /// all others are taken from the base unread. This is how a dirty-page
    /// log or a disk overlay becomes a new snapshot cheaply.
    pub dirty: Option<Vec<Range<u64>>>,
    /// Called as chunks are dispatched.
    pub progress: Option<ProgressFn>,
    /// Worker threads for hashing and compression; `None` = store default.
    pub threads: Option<usize>,
}

impl fmt::Debug for IngestOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IngestOptions")
            .field("chunk_size", &self.chunk_size)
            .field("zstd_level", &self.zstd_level)
            .field("base", &self.base)
            .field("dirty", &self.dirty.as_ref().map(|d| d.len()))
            .field("progress", &self.progress.is_some())
            .field("threads", &self.threads)
            .finish()
    }
}

/// The result of an ingest. Its chunks are durable and its manifest stored,
/// but nothing references them until a snapshot naming the manifest commits;
/// until then this process pins them against GC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestedFile {
    /// The file's manifest.
    pub manifest: ManifestId,
    /// File size in bytes.
    pub size: u64,
    /// Chunk size used.
    pub chunk_size: u32,
    /// Number of chunk slots.
    pub chunks: u64,
    /// Slots that are all zero (stored as nothing).
    pub zero_chunks: u64,
    /// Slots taken from the base manifest without reading.
    pub base_chunks: u64,
    /// Slots whose chunk was already stored (or repeated within this file).
    pub reused_chunks: u64,
    /// Chunks appended to packs by this ingest.
    pub new_chunks: u64,
    /// Bytes read from the source (holes and base slots are not read).
    pub bytes_read: u64,
    /// Uncompressed bytes of the new chunks.
    pub new_raw_bytes: u64,
    /// Pack bytes this ingest added (record headers included).
    pub new_stored_bytes: u64,
}

impl IngestedFile {
    /// The reference to put in [`crate::NewSnapshot::files`].
    pub fn file_ref(&self) -> FileRef {
        FileRef {
            manifest: self.manifest,
            size: self.size,
        }
    }
}

/// A random-access byte source to ingest ([`Store::ingest_source`]).
pub trait IngestSource: Sync {
    /// Total size in bytes.
    fn size(&self) -> u64;
    /// Sorted, non-overlapping ranges that may hold non-zero bytes; all
    /// other bytes are zero and are never read.
    fn data_extents(&self) -> std::io::Result<Vec<Range<u64>>>;
    /// Fills `buf` from `offset`.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
    /// What this source is, for error messages (a path).
    fn describe(&self) -> String;
}

/// A plain file as an [`IngestSource`]: holes (SEEK_DATA/SEEK_HOLE) are
/// never read.
pub struct FileSource {
    file: File,
    size: u64,
    path: std::path::PathBuf,
}

impl FileSource {
    /// Opens `path` for ingest.
    pub fn open(path: &Path) -> Result<FileSource> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let size = file.metadata().map_err(|e| Error::io(path, e))?.len();
        Ok(FileSource {
            file,
            size,
            path: path.to_path_buf(),
        })
    }
}

impl IngestSource for FileSource {
    fn size(&self) -> u64 {
        self.size
    }
    fn data_extents(&self) -> std::io::Result<Vec<Range<u64>>> {
        data_extents(&self.file, self.size)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// One slot as the producer sees it.
enum Slot {
    Known(ChunkRef),
    Data(Vec<u8>),
}

/// Counters and results shared by an ingest's workers.
#[derive(Default)]
struct Sink {
    claimed: Mutex<HashSet<ChunkId>>,
    new_locs: Mutex<Vec<(ChunkId, ChunkLocation)>>,
    touched: Mutex<BTreeSet<u32>>,
    results: Mutex<Vec<(usize, ChunkRef)>>,
    zero: AtomicU64,
    reused: AtomicU64,
    new_chunks: AtomicU64,
    new_raw: AtomicU64,
    new_stored: AtomicU64,
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
    /// Set just before the RocksDB batch is issued: from then on the
    /// appended records may be indexed and must not be rolled back.
    committing: AtomicBool,
}

impl Sink {
    fn fail(&self, e: Error) {
        self.failed.store(true, Ordering::SeqCst);
        self.error.lock().unwrap().get_or_insert(e);
    }
}

impl Store {
    /// Ingests a file from disk. Sparse-aware: regions that are holes
    /// (SEEK_DATA/SEEK_HOLE) are never read. With `opts.base` and
    /// `opts.dirty`, only dirty chunks are read.
    pub fn ingest_file(&self, path: &Path, opts: &IngestOptions) -> Result<IngestedFile> {
        self.ingest_source(&FileSource::open(path)?, opts)
    }

    /// Ingests a random-access source (a file, or a view composed of several
    /// files such as a disk overlay over its base). Only the source's data
    /// extents are read; with `opts.base` and `opts.dirty`, only dirty chunks.
    pub fn ingest_source(
        &self,
        src: &dyn IngestSource,
        opts: &IngestOptions,
    ) -> Result<IngestedFile> {
        let size = src.size();
        let what = src.describe();
        let _gc = self.gc_lock.read().unwrap();
        let (chunk_size, base) = self.ingest_params(opts)?;
        let n_slots = size.div_ceil(u64::from(chunk_size)) as usize;
        let clean = match (&base, &opts.dirty) {
            (Some(b), Some(d)) => Some(clean_slots(b, d, size, chunk_size)),
            (None, Some(_)) => {
                return Err(Error::InvalidArgument(
                    "dirty ranges need a base manifest (IngestOptions::base)".into(),
                ))
            }
            _ => None,
        };
        let extents = src.data_extents().map_err(|e| Error::io(&what, e))?;
        let cs = u64::from(chunk_size);
        let produce = |emit: &mut dyn FnMut(usize, Slot) -> bool| -> Result<u64> {
            let mut ext = extents.iter().peekable();
            let mut bytes_read = 0;
            for slot in 0..n_slots {
                let start = slot as u64 * cs;
                let len = (size - start).min(cs);
                let s = if let Some(r) = clean.as_ref().and_then(|c| c[slot]) {
                    Slot::Known(r)
                } else {
                    while ext.peek().is_some_and(|e| e.end <= start) {
                        ext.next();
                    }
                    if ext.peek().is_none_or(|e| e.start >= start + len) {
                        Slot::Known(ChunkRef::Zero)
                    } else {
                        let mut buf = vec![0u8; len as usize];
                        src.read_exact_at(&mut buf, start)
                            .map_err(|e| Error::io(&what, e))?;
                        bytes_read += len;
                        Slot::Data(buf)
                    }
                };
                if !emit(slot, s) {
                    break;
                }
                if let Some(p) = &opts.progress {
                    p(start + len, size);
                }
            }
            Ok(bytes_read)
        };
        self.run_ingest(chunk_size, opts, Some(size), produce)
    }

    /// Ingests a byte stream. Dirty-range ingest is not possible here (a
    /// stream cannot skip); use [`Store::ingest_file`] for that.
    pub fn ingest_reader(&self, mut r: impl Read, opts: &IngestOptions) -> Result<IngestedFile> {
        if opts.dirty.is_some() {
            return Err(Error::InvalidArgument(
                "dirty-range ingest needs a seekable file: use ingest_file".into(),
            ));
        }
        let _gc = self.gc_lock.read().unwrap();
        let (chunk_size, _) = self.ingest_params(opts)?;
        let produce = |emit: &mut dyn FnMut(usize, Slot) -> bool| -> Result<u64> {
            let mut total = 0u64;
            for slot in 0.. {
                let mut buf = vec![0u8; chunk_size as usize];
                let n = read_full(&mut r, &mut buf).map_err(|e| Error::io("<ingest reader>", e))?;
                if n == 0 {
                    break;
                }
                buf.truncate(n);
                total += n as u64;
                if !emit(slot, Slot::Data(buf)) {
                    break;
                }
                if let Some(p) = &opts.progress {
                    p(total, 0);
                }
                if n < chunk_size as usize {
                    break;
                }
            }
            Ok(total)
        };
        self.run_ingest(chunk_size, opts, None, produce)
    }

    /// Resolves chunk size and base manifest from the options.
    fn ingest_params(&self, opts: &IngestOptions) -> Result<(u32, Option<Arc<FileManifest>>)> {
        let base = opts.base.map(|b| self.manifest(&b)).transpose()?;
        let chunk_size = match (opts.chunk_size, &base) {
            (Some(cs), Some(b)) if cs != b.chunk_size() => {
                return Err(Error::InvalidArgument(format!(
                    "chunk size {cs} differs from the base manifest's {}",
                    b.chunk_size()
                )))
            }
            (Some(cs), _) => cs,
            (None, Some(b)) => b.chunk_size(),
            (None, None) => self.opts.chunk_size,
        };
        validate_chunk_size(chunk_size)?;
        Ok((chunk_size, base))
    }

    /// Runs the producer on this thread and hashing/compression on workers,
    /// then makes the result durable.
    fn run_ingest<P>(
        &self,
        chunk_size: u32,
        opts: &IngestOptions,
        known_size: Option<u64>,
        produce: P,
    ) -> Result<IngestedFile>
    where
        P: FnOnce(&mut dyn FnMut(usize, Slot) -> bool) -> Result<u64>,
    {
        let level = opts.zstd_level.unwrap_or(self.opts.zstd_level);
        if !(-7..=22).contains(&level) {
            return Err(Error::InvalidArgument(format!(
                "zstd level {level} is outside -7..=22"
            )));
        }
        let threads = opts.threads.unwrap_or(self.opts.ingest_threads).max(1);
        let sink = Sink::default();
        let mark = self.view.packs().mark();
        let result = self.ingest_with(&sink, chunk_size, level, threads, known_size, produce);
        if result.is_err() && !sink.committing.load(Ordering::SeqCst) {
            // Nothing was indexed: give the pack space back if no other
            // ingest appended meanwhile (else GC reclaims it). On a full disk
            // this is what lets the next ingest succeed once space is freed.
            if let Some(m) = mark {
                self.view
                    .packs()
                    .rollback(m, sink.new_chunks.load(Ordering::SeqCst));
            }
        }
        result
    }

    /// The body of [`Store::run_ingest`].
    fn ingest_with<P>(
        &self,
        sink: &Sink,
        chunk_size: u32,
        level: i32,
        threads: usize,
        known_size: Option<u64>,
        produce: P,
    ) -> Result<IngestedFile>
    where
        P: FnOnce(&mut dyn FnMut(usize, Slot) -> bool) -> Result<u64>,
    {
        let mut entries: Vec<Option<ChunkRef>> = Vec::new();
        let mut base_chunks = 0u64;
        let (tx, rx) = sync_channel::<(usize, Vec<u8>)>(threads * 2);
        let rx = Mutex::new(rx);
        let produced = std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| self.worker(&rx, level, sink));
            }
            let mut emit = |slot: usize, s: Slot| -> bool {
                if entries.len() <= slot {
                    entries.resize(slot + 1, None);
                }
                match s {
                    Slot::Known(r) => {
                        if matches!(r, ChunkRef::Zero) {
                            sink.zero.fetch_add(1, Ordering::Relaxed);
                        } else {
                            base_chunks += 1;
                        }
                        entries[slot] = Some(r);
                    }
                    Slot::Data(d) => {
                        if sink.failed.load(Ordering::SeqCst) || tx.send((slot, d)).is_err() {
                            return false;
                        }
                    }
                }
                !sink.failed.load(Ordering::SeqCst)
            };
            let r = produce(&mut emit);
            drop(tx);
            r
        });
        if let Some(e) = sink.error.lock().unwrap().take() {
            return Err(e);
        }
        let bytes_read = produced?;
        for (slot, r) in sink.results.lock().unwrap().drain(..) {
            entries[slot] = Some(r);
        }
        let entries: Vec<ChunkRef> = entries
            .into_iter()
            .map(|e| e.expect("every slot produced"))
            .collect();
        let size = match known_size {
            Some(s) => s,
            None => bytes_read,
        };
        let manifest = FileManifest::new(size, chunk_size, &entries)?;
        let id = self.persist(&manifest, sink)?;
        Ok(IngestedFile {
            manifest: id,
            size,
            chunk_size,
            chunks: entries.len() as u64,
            zero_chunks: sink.zero.load(Ordering::Relaxed),
            base_chunks,
            reused_chunks: sink.reused.load(Ordering::Relaxed),
            new_chunks: sink.new_chunks.load(Ordering::Relaxed),
            bytes_read,
            new_raw_bytes: sink.new_raw.load(Ordering::Relaxed),
            new_stored_bytes: sink.new_stored.load(Ordering::Relaxed),
        })
    }

    /// Worker loop: zero test, hash, dedup, compress, append.
    fn worker(&self, rx: &Mutex<Receiver<(usize, Vec<u8>)>>, level: i32, sink: &Sink) {
        loop {
            let job = rx.lock().unwrap().recv();
            let Ok((slot, data)) = job else { return };
            if sink.failed.load(Ordering::SeqCst) {
                continue; // drain so the producer never blocks
            }
            match self.process_chunk(&data, level, sink) {
                Ok(r) => sink.results.lock().unwrap().push((slot, r)),
                Err(e) => sink.fail(e),
            }
        }
    }

    fn process_chunk(&self, data: &[u8], level: i32, sink: &Sink) -> Result<ChunkRef> {
        if is_zero(data) {
            sink.zero.fetch_add(1, Ordering::Relaxed);
            return Ok(ChunkRef::Zero);
        }
        let id = ChunkId::of(data);
        let first_here = sink.claimed.lock().unwrap().insert(id);
        if !first_here || self.view.chunk_location(&id)?.is_some() {
            sink.reused.fetch_add(1, Ordering::Relaxed);
            return Ok(ChunkRef::Chunk(id));
        }
        let (payload, compression) = match compress(data, level)? {
            Some(c) => (c, Compression::Zstd),
            None => (data.to_vec(), Compression::Raw),
        };
        let loc = self
            .view
            .packs()
            .append(&id, data.len() as u32, compression, &payload)?;
        sink.touched.lock().unwrap().insert(loc.pack);
        sink.new_locs.lock().unwrap().push((id, loc));
        sink.new_chunks.fetch_add(1, Ordering::Relaxed);
        sink.new_raw.fetch_add(data.len() as u64, Ordering::Relaxed);
        sink.new_stored
            .fetch_add(loc.record_len(), Ordering::Relaxed);
        Ok(ChunkRef::Chunk(id))
    }

    /// Syncs packs, then indexes the new chunks and stores the manifest in
    /// one durable batch, then pins the manifest against GC.
    fn persist(&self, manifest: &FileManifest, sink: &Sink) -> Result<ManifestId> {
        self.view.packs().sync(&sink.touched.lock().unwrap())?;
        let id = manifest.id();
        let db = self.view.db();
        let mut batch = WriteBatch::default();
        for (cid, loc) in sink.new_locs.lock().unwrap().iter() {
            batch.put_cf(db.cf(CF_CHUNKS), cid.as_bytes(), loc.encode());
        }
        batch.put_cf(db.cf(CF_MANIFESTS), id.as_bytes(), manifest.encode());
        db.check_space(&batch, RESERVE_GROW)?;
        sink.committing.store(true, Ordering::SeqCst);
        db.write_unchecked(batch, "indexing ingested chunks")?;
        self.pin(id);
        Ok(id)
    }
}

/// For a dirty-range ingest: slot `i` is `Some(base entry)` when it can be
/// taken from the base unread.
fn clean_slots(
    base: &FileManifest,
    dirty: &[Range<u64>],
    size: u64,
    chunk_size: u32,
) -> Vec<Option<ChunkRef>> {
    let cs = u64::from(chunk_size);
    let n = size.div_ceil(cs) as usize;
    let mut clean: Vec<Option<ChunkRef>> = (0..n)
        .map(|i| {
            let same_len =
                i < base.len() && u64::from(base.slot_len(i)) == (size - i as u64 * cs).min(cs);
            same_len.then(|| base.entry(i))
        })
        .collect();
    for r in dirty.iter().filter(|r| r.start < r.end && r.start < size) {
        let first = (r.start / cs) as usize;
        let last = ((r.end.min(size) - 1) / cs) as usize;
        for c in &mut clean[first..=last] {
            *c = None;
        }
    }
    clean
}

/// Byte ranges of `file` that hold data (not holes), via SEEK_DATA/SEEK_HOLE.
/// Falls back to "all data" where the filesystem cannot tell.
fn data_extents(file: &File, size: u64) -> std::io::Result<Vec<Range<u64>>> {
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut off: u64 = 0;
    while off < size {
        // SAFETY: lseek on a valid fd owned by `file`.
        let data = unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENXIO) => Ok(out),
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
                    Ok(std::iter::once(0..size).collect())
                }
                _ => Err(e),
            };
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (data, hole) = (data as u64, (hole as u64).min(size));
        if data >= size {
            break;
        }
        out.push(data..hole);
        off = hole;
    }
    Ok(out)
}

/// Reads until `buf` is full or EOF; returns bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_slot_mapping() {
        let a = ChunkRef::Chunk(ChunkId::of(b"a"));
        let base = FileManifest::new(4096 * 3 + 10, 4096, &[a, a, a, a]).unwrap();
        // Same size: slots 1 dirty; last slot same length so clean.
        let c = clean_slots(&base, &[4096..4097, 4100..4101], 4096 * 3 + 10, 4096);
        assert_eq!(c, vec![Some(a), None, Some(a), Some(a)]);
        // Grown: the old short last slot and the new slots must be read.
        let c = clean_slots(&base, &[], 4096 * 5, 4096);
        assert_eq!(c, vec![Some(a), Some(a), Some(a), None, None]);
        // Empty ranges and ranges past the end are ignored.
        let c = clean_slots(&base, &[5..5, 1 << 40..(1 << 40) + 1], 4096 * 3 + 10, 4096);
        assert!(c.iter().all(|x| x.is_some()));
    }
}
