//! Append-only pack files holding chunk payloads (`<root>/packs/pack-<n>.dat`).
//!
//! Each chunk is one self-describing record:
//!
//! ```text
//! magic "FKC1" | chunk id (32) | stored_len u32 LE | raw_len u32 LE | compression u8 | payload
//! ```
//!
//! Invariants:
//! - records are only ever appended; a live record is never changed in place
//!   (readers in other processes may be reading it); only garbage at the end
//!   of the active pack is ever cut (failed ingests, GC tail trim);
//! - packs are removed only whole, by GC, after the index no longer names them;
//! - a record is named by the index only after the pack was fdatasync'd (the
//!   ingest syncs its packs before committing the RocksDB batch).

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use lru::LruCache;

use crate::chunk::{ChunkLocation, Compression};
use crate::error::{Error, Result};
use crate::ids::ChunkId;

/// Length of a record header.
pub const RECORD_HEADER_LEN: usize = 45;
const MAGIC: &[u8; 4] = b"FKC1";
/// How many pack fds a process keeps open at once.
const FD_CACHE: usize = 128;

/// The pack directory: an optional writer (primary only) and a cache of
/// read fds.
pub(crate) struct Packs {
    dir: PathBuf,
    max_pack_bytes: u64,
    writer: Option<Mutex<Writer>>,
    fds: Mutex<LruCache<u32, Arc<File>>>,
}

/// The pack currently appended to.
struct Writer {
    next_num: u32,
    active: Option<Active>,
    /// Successful appends since open (to tell whether an ingest was the
    /// only writer since its [`Mark`]).
    appends: u64,
}

/// The writer's position before an ingest starts appending; lets a failed
/// ingest give its garbage back (see [`Packs::rollback`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark {
    num: u32,
    len: u64,
    appends: u64,
}

struct Active {
    num: u32,
    file: Arc<File>,
    len: u64,
}

impl Packs {
    /// Opens the pack directory for reading and, if `writable`, appending.
    ///
    /// `min_next` is the lowest number a new pack may take (persisted by GC
    /// before it deletes packs), so a number is never reused: a secondary
    /// may still hold an fd for a deleted pack under its old number.
    pub fn open(dir: &Path, max_pack_bytes: u64, writable: bool, min_next: u32) -> Result<Packs> {
        if writable {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        let writer = if writable {
            let existing = list_pack_files(dir)?;
            let active = match existing.last() {
                Some(&(num, _)) => {
                    let path = pack_path(dir, num);
                    let file = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(&path)
                        .map_err(|e| Error::io(&path, e))?;
                    let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
                    Some(Active {
                        num,
                        file: Arc::new(file),
                        len,
                    })
                }
                None => None,
            };
            let next_num = existing.last().map_or(0, |&(n, _)| n + 1).max(min_next);
            Some(Mutex::new(Writer {
                next_num,
                active,
                appends: 0,
            }))
        } else {
            None
        };
        Ok(Packs {
            dir: dir.to_path_buf(),
            max_pack_bytes,
            writer,
            fds: Mutex::new(LruCache::new(NonZeroUsize::new(FD_CACHE).unwrap())),
        })
    }

    /// Path of pack `num`.
    pub fn path(&self, num: u32) -> PathBuf {
        pack_path(&self.dir, num)
    }

    /// Appends one chunk record; returns its location. The bytes are not
    /// durable until [`Packs::sync`] covers this pack.
    ///
    /// On a write error (e.g. ENOSPC) the pack is truncated back so the next
    /// append starts on a clean boundary.
    pub fn append(
        &self,
        id: &ChunkId,
        raw_len: u32,
        compression: Compression,
        payload: &[u8],
    ) -> Result<ChunkLocation> {
        let mut record = Vec::with_capacity(RECORD_HEADER_LEN + payload.len());
        record.extend_from_slice(MAGIC);
        record.extend_from_slice(id.as_bytes());
        record.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        record.extend_from_slice(&raw_len.to_le_bytes());
        record.push(compression as u8);
        record.extend_from_slice(payload);

        let mut w = self.writer()?.lock().unwrap();
        let need_roll = match &w.active {
            None => true,
            Some(a) => a.len > 0 && a.len + record.len() as u64 > self.max_pack_bytes,
        };
        if need_roll {
            self.roll_locked(&mut w)?;
        }
        let a = w.active.as_mut().expect("rolled");
        let offset = a.len;
        if let Err(e) = a.file.write_all_at(&record, offset) {
            // Best effort: drop the torn tail so the file stays a clean
            // sequence of records. Harmless if it fails (torn tails are never
            // indexed and GC reclaims them).
            let _ = a.file.set_len(offset);
            return Err(Error::io(self.path(a.num), e));
        }
        a.len += record.len() as u64;
        let pack = a.num;
        w.appends += 1;
        Ok(ChunkLocation {
            pack,
            offset,
            stored_len: payload.len() as u32,
            raw_len,
            compression,
        })
    }

    /// Seals the active pack (fdatasync) and starts a new one on next append.
    pub fn roll(&self) -> Result<()> {
        let mut w = self.writer()?.lock().unwrap();
        if let Some(a) = w.active.take() {
            a.file
                .sync_data()
                .map_err(|e| Error::io(self.path(a.num), e))?;
        }
        Ok(())
    }

    /// Where the writer stands now.
    pub fn mark(&self) -> Option<Mark> {
        let w = self.writer.as_ref()?.lock().unwrap();
        Some(match &w.active {
            Some(a) => Mark {
                num: a.num,
                len: a.len,
                appends: w.appends,
            },
            None => Mark {
                num: w.next_num,
                len: 0,
                appends: w.appends,
            },
        })
    }

    /// Undoes the appends of a failed ingest. If exactly `own_appends`
    /// records were appended since `mark` (all of them the failed ingest's,
    /// none indexed), packs created since are removed and the mark's pack is
    /// truncated back and made active again. Otherwise (another ingest
    /// appended meanwhile) the garbage is left to GC. Returns the bytes
    /// given back.
    pub fn rollback(&self, mark: Mark, own_appends: u64) -> u64 {
        let Some(w) = self.writer.as_ref() else {
            return 0;
        };
        let mut w = w.lock().unwrap();
        if w.appends != mark.appends + own_appends || own_appends == 0 {
            return 0;
        }
        let Some(active) = w.active.take() else {
            return 0;
        };
        let mut freed = 0;
        // Packs created after the mark hold only this ingest's records.
        for num in (mark.num + 1)..=active.num {
            let path = self.path(num);
            if let Ok(m) = std::fs::metadata(&path) {
                if std::fs::remove_file(&path).is_ok() {
                    freed += m.len();
                }
            }
        }
        let path = self.path(mark.num);
        let file = if active.num == mark.num {
            Ok(active.file)
        } else {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map(Arc::new)
        };
        if let Ok(file) = file {
            let len = file.metadata().map(|m| m.len()).unwrap_or(mark.len);
            if len >= mark.len && file.set_len(mark.len).is_ok() {
                freed += len - mark.len;
                w.active = Some(Active {
                    num: mark.num,
                    file,
                    len: mark.len,
                });
            }
        }
        freed
    }

    /// Truncates the active pack to `keep_end` if it is longer: the caller
    /// (GC, with no ingest running) knows no live record lies beyond it.
    /// Only garbage is cut; a stale reader that still points there gets a
    /// verification error and retries, never wrong bytes.
    pub fn trim_active(&self, keep_end: u64) -> Result<u64> {
        let Some(w) = self.writer.as_ref() else {
            return Ok(0);
        };
        let mut w = w.lock().unwrap();
        let Some(a) = w.active.as_mut() else {
            return Ok(0);
        };
        if a.len <= keep_end {
            return Ok(0);
        }
        let freed = a.len - keep_end;
        let path = self.path(a.num);
        a.file
            .set_len(keep_end)
            .and_then(|()| a.file.sync_all())
            .map_err(|e| Error::io(&path, e))?;
        a.len = keep_end;
        Ok(freed)
    }

    /// The number the next new pack will get.
    pub fn next_num(&self) -> u32 {
        self.writer
            .as_ref()
            .map_or(0, |w| w.lock().unwrap().next_num)
    }

    /// The pack currently appended to, if any.
    pub fn active(&self) -> Option<u32> {
        let w = self.writer.as_ref()?.lock().unwrap();
        w.active.as_ref().map(|a| a.num)
    }

    fn roll_locked(&self, w: &mut Writer) -> Result<()> {
        if let Some(a) = w.active.take() {
            a.file
                .sync_data()
                .map_err(|e| Error::io(self.path(a.num), e))?;
        }
        let num = w.next_num;
        let path = self.path(num);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        // The new name must be durable before any index entry names it.
        sync_dir(&self.dir)?;
        w.next_num = num + 1;
        w.active = Some(Active {
            num,
            file: Arc::new(file),
            len: 0,
        });
        Ok(())
    }

    fn writer(&self) -> Result<&Mutex<Writer>> {
        self.writer
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("the store is open read-only".into()))
    }

    /// fdatasyncs every pack in `nums` (the packs an ingest appended to).
    pub fn sync(&self, nums: &BTreeSet<u32>) -> Result<()> {
        for &num in nums {
            let file = match self.active_file(num) {
                Some(f) => f,
                None => match self.fd(num) {
                    Ok(f) => f,
                    // Rolled and already synced, then removed by GC: nothing to do.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(Error::io(self.path(num), e)),
                },
            };
            file.sync_data().map_err(|e| Error::io(self.path(num), e))?;
        }
        Ok(())
    }

    fn active_file(&self, num: u32) -> Option<Arc<File>> {
        let w = self.writer.as_ref()?.lock().unwrap();
        w.active
            .as_ref()
            .filter(|a| a.num == num)
            .map(|a| a.file.clone())
    }

    /// An open read fd for pack `num` (cached).
    fn fd(&self, num: u32) -> io::Result<Arc<File>> {
        if let Some(f) = self.fds.lock().unwrap().get(&num) {
            return Ok(f.clone());
        }
        let f = Arc::new(File::open(self.path(num))?);
        self.fds.lock().unwrap().put(num, f.clone());
        Ok(f)
    }

    /// Reads and checks the record header of the chunk at `loc`; returns the
    /// payload. `Err(io NotFound)` means the pack is gone (a secondary
    /// should catch up and retry).
    pub fn read_payload(
        &self,
        id: &ChunkId,
        loc: &ChunkLocation,
    ) -> std::result::Result<Vec<u8>, ReadError> {
        let fd = self.fd(loc.pack).map_err(ReadError::Io)?;
        let mut buf = vec![0u8; RECORD_HEADER_LEN + loc.stored_len as usize];
        match fd.read_exact_at(&mut buf, loc.offset) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(ReadError::Corrupt("record extends past end of pack".into()))
            }
            Err(e) => return Err(ReadError::Io(e)),
        }
        check_header(id, loc, &buf).map_err(ReadError::Corrupt)?;
        buf.drain(..RECORD_HEADER_LEN);
        Ok(buf)
    }

    /// Every pack file on disk with its length, by number.
    pub fn list(&self) -> Result<Vec<(u32, u64)>> {
        list_pack_files(&self.dir)
    }

    /// Removes a whole pack file. Readers holding an fd keep reading it.
    pub fn delete(&self, num: u32) -> Result<()> {
        self.fds.lock().unwrap().pop(&num);
        let path = self.path(num);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&path, e)),
        }
        sync_dir(&self.dir)
    }

    /// Forgets cached fds (after a secondary notices a pack was removed).
    pub fn forget(&self, num: u32) {
        self.fds.lock().unwrap().pop(&num);
    }
}

/// Why a record could not be read.
pub(crate) enum ReadError {
    Io(io::Error),
    Corrupt(String),
}

fn check_header(id: &ChunkId, loc: &ChunkLocation, buf: &[u8]) -> std::result::Result<(), String> {
    if &buf[0..4] != MAGIC {
        return Err("bad record magic".into());
    }
    if &buf[4..36] != id.as_bytes() {
        return Err(format!(
            "record header names chunk {}",
            hex::encode(&buf[4..36])
        ));
    }
    let stored = u32::from_le_bytes(buf[36..40].try_into().unwrap());
    let raw = u32::from_le_bytes(buf[40..44].try_into().unwrap());
    if stored != loc.stored_len || raw != loc.raw_len || buf[44] != loc.compression as u8 {
        return Err("record header disagrees with the index".into());
    }
    Ok(())
}

fn pack_path(dir: &Path, num: u32) -> PathBuf {
    dir.join(format!("pack-{num:08}.dat"))
}

fn list_pack_files(dir: &Path) -> Result<Vec<(u32, u64)>> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io(dir, e)),
    };
    for ent in rd {
        let ent = ent.map_err(|e| Error::io(dir, e))?;
        let name = ent.file_name();
        let Some(num) = name
            .to_str()
            .and_then(|n| n.strip_prefix("pack-"))
            .and_then(|n| n.strip_suffix(".dat"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let len = ent.metadata().map_err(|e| Error::io(ent.path(), e))?.len();
        out.push((num, len));
    }
    out.sort_unstable();
    Ok(out)
}

/// fsyncs a directory so that created or removed names are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}
