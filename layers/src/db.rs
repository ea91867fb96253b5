//! RocksDB layout and access.
//!
//! Column families (all keys binary, values little endian unless noted):
//!
//! | CF          | key                          | value                                  |
//! |-------------|------------------------------|----------------------------------------|
//! | `chunks`    | chunk id (32)                | [`ChunkLocation`] (21 bytes)           |
//! | `manifests` | manifest id (32)             | canonical manifest encoding            |
//! | `snapshots` | snapshot id (16)             | [`SnapshotRecord`] as JSON             |
//! | `children`  | parent id (16) ‖ child id (16) | empty                                |
//! | `tags`      | tag (UTF-8)                  | snapshot id (16)                       |
//! | `refs`      | `c` ‖ chunk id, `m` ‖ manifest id | u64 refcount (absent = 0)         |
//! | `meta`      | `format_version`, `next_pack` | u32                                   |
//!
//! Every mutation is one `WriteBatch` written with `sync = true`.
//!
//! A secondary follows the primary by tailing its WAL
//! (`try_catch_up_with_primary`) only while the primary's files show that
//! nothing was flushed since the last catch-up. Once the primary has
//! flushed (every reopen does, and writers here open the store for each
//! write), RocksDB's catch-up can keep serving entries it replayed earlier
//! from its memtable over newer ones that exist only in table files
//! (facebook/rocksdb#14444, #15051): a chunk deleted by GC and indexed again
//! stays "missing". So a catch-up after a flush opens a fresh secondary
//! instead, and reads that began on the old one finish on it.
//!
//! A secondary that opens while a writer opens (and so flushes and deletes
//! the WAL it recovered) can miss that WAL's commits, even all of them. An
//! open counts only if the primary's files did not change across it; else
//! it is retried (`open_whole_secondary`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rocksdb::{ColumnFamily, ColumnFamilyDescriptor, Options, WriteBatch, WriteOptions, DB};

use crate::chunk::ChunkLocation;
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ManifestId, SnapshotId};
use crate::snapshot::SnapshotRecord;

pub(crate) const CF_CHUNKS: &str = "chunks";
pub(crate) const CF_MANIFESTS: &str = "manifests";
pub(crate) const CF_SNAPSHOTS: &str = "snapshots";
pub(crate) const CF_CHILDREN: &str = "children";
pub(crate) const CF_TAGS: &str = "tags";
pub(crate) const CF_REFS: &str = "refs";
pub(crate) const CF_META: &str = "meta";
const ALL_CFS: [&str; 7] = [
    CF_CHUNKS,
    CF_MANIFESTS,
    CF_SNAPSHOTS,
    CF_CHILDREN,
    CF_TAGS,
    CF_REFS,
    CF_META,
];

/// On-disk format version written to `meta`.
pub const FORMAT_VERSION: u32 = 1;
const KEY_FORMAT_VERSION: &[u8] = b"format_version";
/// `meta` key: lowest number a new pack may take (u32), see [`Db::next_pack`].
pub(crate) const KEY_NEXT_PACK: &[u8] = b"next_pack";

/// Refcount key of a chunk.
pub(crate) fn chunk_ref_key(id: &ChunkId) -> [u8; 33] {
    let mut k = [0u8; 33];
    k[0] = b'c';
    k[1..].copy_from_slice(id.as_bytes());
    k
}

/// Refcount key of a manifest.
pub(crate) fn manifest_ref_key(id: &ManifestId) -> [u8; 33] {
    let mut k = [0u8; 33];
    k[0] = b'm';
    k[1..].copy_from_slice(id.as_bytes());
    k
}

/// Key of a parent→child link.
pub(crate) fn child_key(parent: &SnapshotId, child: &SnapshotId) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..16].copy_from_slice(parent.as_bytes());
    k[16..].copy_from_slice(child.as_bytes());
    k
}

/// Decodes a refcount value.
pub(crate) fn decode_count(v: &[u8]) -> u64 {
    v.try_into().map(u64::from_le_bytes).unwrap_or(0)
}

/// One raw (key, value) pair from a scan.
pub(crate) type KeyValue = (Box<[u8]>, Box<[u8]>);

/// The pairs of a scan, in key order.
pub(crate) type Entries<'a> = Box<dyn Iterator<Item = Result<KeyValue>> + 'a>;

/// A column family's handle (every store opens all of them).
fn handle<'a>(db: &'a DB, cf: &str) -> &'a ColumnFamily {
    db.cf_handle(cf).expect("column family opened")
}

/// The pairs of `cf` from `prefix` on, while keys start with it.
fn entries<'a>(
    db: &'a DB,
    cf: &'a str,
    prefix: &'a [u8],
) -> impl Iterator<Item = Result<KeyValue>> + 'a {
    db.iterator_cf(
        handle(db, cf),
        rocksdb::IteratorMode::From(prefix, rocksdb::Direction::Forward),
    )
    .map(move |r| r.map_err(|e| Error::db(format!("scanning {cf}"), e)))
    .take_while(move |r| r.as_ref().map_or(true, |(k, _)| k.starts_with(prefix)))
}

/// Opens RocksDB as a secondary of the store at `path`.
fn open_secondary_db(path: &Path, secondary_dir: &Path) -> Result<DB> {
    let mut opts = base_options();
    // Secondaries must keep every table file open: the primary may delete
    // files after compaction.
    opts.set_max_open_files(-1);
    let cfs = ALL_CFS
        .iter()
        .map(|n| ColumnFamilyDescriptor::new(*n, base_options()));
    DB::open_cf_descriptors_as_secondary(&opts, path, secondary_dir, cfs)
        .map_err(|e| Error::db(format!("opening secondary of {}", path.display()), e))
}

/// How long opening a secondary keeps retrying while writers keep
/// changing the primary's files under it.
const SECONDARY_OPEN_PATIENCE: Duration = Duration::from_secs(10);

/// Opens a secondary whose view is whole, and the primary's files it saw.
///
/// A writer's open flushes the WAL it recovers into a table file, writes a
/// new MANIFEST, points `CURRENT` at it and deletes that WAL. A secondary
/// opening meanwhile can read the old MANIFEST and then find the WAL gone:
/// it opens fine but shows an empty store ("no format version recorded")
/// or one without the newest commits. So the open counts only if the
/// primary's files did not change across it (the same test
/// [`Db::catch_up`] uses); otherwise, or if it failed because the old
/// MANIFEST went away under it, it is retried.
fn open_whole_secondary(path: &Path, secondary_dir: &Path) -> Result<(DB, PrimaryFiles)> {
    let start = Instant::now();
    let mut tries = 0u64;
    loop {
        let before = PrimaryFiles::read(path);
        let res = open_secondary_db(path, secondary_dir);
        let after = PrimaryFiles::read(path);
        let patient = start.elapsed() < SECONDARY_OPEN_PATIENCE;
        match res {
            Ok(db) if !before.flushed_since(&after) => return Ok((db, after)),
            Ok(_) if !patient => {
                return Err(Error::Busy {
                    root: path.to_path_buf(),
                    waited_ms: start.elapsed().as_millis() as u64,
                })
            }
            Err(e) if !patient => return Err(e),
            _ => {
                tries += 1;
                std::thread::sleep(Duration::from_millis((5 * tries).min(100)));
            }
        }
    }
}

/// The RocksDB handle plus how it was opened.
pub(crate) struct Db {
    handle: Handle,
    path: PathBuf,
}

enum Handle {
    Primary(DB),
    Secondary(Follower),
}

/// A secondary and what the primary's files looked like when it last
/// caught up (see the module docs).
struct Follower {
    /// Its own info-log directory.
    dir: PathBuf,
    db: RwLock<Arc<DB>>,
    seen: Mutex<PrimaryFiles>,
}

/// The files that tell whether the primary flushed: `CURRENT` (a new
/// MANIFEST at every open), the MANIFEST's length (a flush or compaction
/// appends to it) and the WAL files (a flushed one is deleted).
#[derive(Debug, Default, PartialEq)]
struct PrimaryFiles {
    current: Vec<u8>,
    manifest_len: u64,
    wals: Vec<String>,
}

impl PrimaryFiles {
    fn read(path: &Path) -> PrimaryFiles {
        let current = std::fs::read(path.join("CURRENT")).unwrap_or_default();
        let manifest = String::from_utf8_lossy(&current).trim().to_string();
        let manifest_len = std::fs::metadata(path.join(manifest)).map_or(0, |m| m.len());
        let mut wals: Vec<String> = std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".log"))
            .collect();
        wals.sort();
        PrimaryFiles {
            current,
            manifest_len,
            wals,
        }
    }

    /// True unless the primary only appended to its WAL since `self`.
    fn flushed_since(&self, now: &PrimaryFiles) -> bool {
        self.current != now.current
            || self.manifest_len != now.manifest_len
            || self.wals.iter().any(|w| !now.wals.contains(w))
    }
}

fn base_options() -> Options {
    let mut o = Options::default();
    o.set_compression_type(rocksdb::DBCompressionType::None);
    o.set_keep_log_file_num(4);
    o.set_max_log_file_size(8 << 20);
    // Small memtables keep each flush (and so the free space RocksDB needs
    // on a nearly full disk) well under RESERVE_GROW.
    o.set_write_buffer_size(8 << 20);
    o
}

/// Errors that mean "another process is opening or holds the store": the
/// lock itself, and the info-log rotation RocksDB does *before* taking the
/// lock (two processes opening at once race on renaming `LOG` and deleting
/// `LOG.old.*`). Both are worth a retry.
fn is_lock_error(msg: &str) -> bool {
    let lock =
        msg.contains("LOCK") && (msg.contains("lock") || msg.contains("Resource temporarily"));
    let log_race = msg.contains("/LOG") && msg.contains("No such file or directory");
    lock || log_race
}

impl Db {
    /// Opens (creating if needed) read-write. If another process holds the
    /// lock, retries until `timeout` and then fails with [`Error::Locked`].
    pub fn open_primary(path: &Path, timeout: Duration) -> Result<Db> {
        let mut opts = base_options();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        let start = Instant::now();
        let db = loop {
            let cfs = ALL_CFS
                .iter()
                .map(|n| ColumnFamilyDescriptor::new(*n, base_options()));
            match DB::open_cf_descriptors(&opts, path, cfs) {
                Ok(db) => break db,
                Err(e) if is_lock_error(e.as_ref()) => {
                    if start.elapsed() >= timeout {
                        return Err(Error::Locked {
                            lock_path: path.join("LOCK"),
                            waited_ms: start.elapsed().as_millis() as u64,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(Error::db(format!("opening {}", path.display()), e)),
            }
        };
        let db = Db {
            handle: Handle::Primary(db),
            path: path.to_path_buf(),
        };
        db.check_format(true)?;
        Ok(db)
    }

    /// Opens a read-only secondary view that follows the primary through
    /// [`Db::catch_up`]. `secondary_dir` holds this process's own info log.
    pub fn open_secondary(path: &Path, secondary_dir: &Path) -> Result<Db> {
        if !path.join("CURRENT").exists() {
            return Err(Error::NotAStore {
                root: path.to_path_buf(),
                reason: "no RocksDB CURRENT file (has a primary ever opened it?)".into(),
            });
        }
        std::fs::create_dir_all(secondary_dir).map_err(|e| Error::io(secondary_dir, e))?;
        let (db, seen) = open_whole_secondary(path, secondary_dir)?;
        let db = Db {
            handle: Handle::Secondary(Follower {
                dir: secondary_dir.to_path_buf(),
                db: RwLock::new(Arc::new(db)),
                seen: Mutex::new(seen),
            }),
            path: path.to_path_buf(),
        };
        db.check_format(false)?;
        Ok(db)
    }

    fn check_format(&self, create: bool) -> Result<()> {
        match self.get(CF_META, KEY_FORMAT_VERSION)? {
            Some(v) => {
                let found = v.as_slice().try_into().map(u32::from_le_bytes).unwrap_or(0);
                if found != FORMAT_VERSION {
                    return Err(Error::FormatVersion {
                        root: self.path.clone(),
                        found,
                        expected: FORMAT_VERSION,
                    });
                }
            }
            None if create => {
                let mut b = WriteBatch::default();
                b.put_cf(
                    self.cf(CF_META),
                    KEY_FORMAT_VERSION,
                    FORMAT_VERSION.to_le_bytes(),
                );
                self.write_raw(b, "writing format version")?;
            }
            None => {
                return Err(Error::NotAStore {
                    root: self.path.clone(),
                    reason: "no format version recorded".into(),
                })
            }
        }
        Ok(())
    }

    pub fn is_secondary(&self) -> bool {
        matches!(self.handle, Handle::Secondary(_))
    }

    /// The primary's handle; writes and batches are the primary's only.
    fn primary(&self) -> &DB {
        match &self.handle {
            Handle::Primary(db) => db,
            Handle::Secondary(_) => panic!("a write on a read-only secondary store"),
        }
    }

    /// Runs `f` on the RocksDB handle (a secondary's current one).
    fn with<R>(&self, f: impl FnOnce(&DB) -> R) -> R {
        match &self.handle {
            Handle::Primary(db) => f(db),
            Handle::Secondary(s) => {
                let db = s.db.read().unwrap_or_else(|p| p.into_inner()).clone();
                f(&db)
            }
        }
    }

    /// A column family of the primary, for write batches.
    pub fn cf(&self, name: &str) -> &ColumnFamily {
        self.primary()
            .cf_handle(name)
            .expect("column family opened")
    }

    pub fn get(&self, cf: &str, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.with(|db| {
            db.get_cf(handle(db, cf), key)
                .map_err(|e| Error::db(format!("reading {cf}"), e))
        })
    }

    /// Point lookups in one call.
    pub fn multi_get(&self, cf: &str, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>> {
        self.with(|db| {
            let h = handle(db, cf);
            db.multi_get_cf(keys.iter().map(|k| (h, *k)))
                .into_iter()
                .map(|r| r.map_err(|e| Error::db(format!("reading {cf}"), e)))
                .collect()
        })
    }

    /// Commits a batch durably (`sync = true`).
    ///
    /// First checks that the disk keeps `reserve` bytes free beyond the
    /// batch: RocksDB turns a failed WAL write into a sticky read-only state
    /// that only a reopen clears, so a nearly full disk is refused here, with
    /// [`Error::NoSpace`], before RocksDB sees the write. Writes that free
    /// space (delete, GC) pass a small reserve so they still work.
    pub fn write_reserving(&self, batch: WriteBatch, what: &str, reserve: u64) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        self.check_space(&batch, reserve)?;
        self.write_raw(batch, what)
    }

    /// Fails with [`Error::NoSpace`] unless `reserve` bytes plus twice the
    /// batch stay free on the store's filesystem.
    pub fn check_space(&self, batch: &WriteBatch, reserve: u64) -> Result<()> {
        let need = reserve + 2 * batch.size_in_bytes() as u64;
        if free_bytes(&self.path).is_some_and(|free| free < need) {
            return Err(Error::NoSpace {
                path: self.path.clone(),
            });
        }
        Ok(())
    }

    /// Writes a batch whose space [`Db::check_space`] already checked.
    pub fn write_unchecked(&self, batch: WriteBatch, what: &str) -> Result<()> {
        self.write_raw(batch, what)
    }

    /// Commits a batch that adds data (ingest, commit), keeping
    /// [`RESERVE_GROW`] free.
    pub fn write(&self, batch: WriteBatch, what: &str) -> Result<()> {
        self.write_reserving(batch, what, RESERVE_GROW)
    }

    /// Commits a small batch that releases data or moves a name (delete, GC,
    /// tags), keeping only [`RESERVE_SHRINK`] free so space can be freed on a
    /// full disk.
    pub fn write_small(&self, batch: WriteBatch, what: &str) -> Result<()> {
        self.write_reserving(batch, what, RESERVE_SHRINK)
    }

    fn write_raw(&self, batch: WriteBatch, what: &str) -> Result<()> {
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        self.primary()
            .write_opt(batch, &wo)
            .map_err(|e| Error::db(what.to_string(), e))
    }

    /// Secondary only: makes the primary's newest commits visible. Tails
    /// the WAL while the primary only appended to it; after a flush, opens a
    /// fresh secondary (see the module docs).
    pub fn catch_up(&self) -> Result<()> {
        let Handle::Secondary(s) = &self.handle else {
            return Ok(());
        };
        let mut seen = s.seen.lock().unwrap_or_else(|p| p.into_inner());
        let before = PrimaryFiles::read(&self.path);
        if !seen.flushed_since(&before) {
            let db = s.db.read().unwrap_or_else(|p| p.into_inner()).clone();
            db.try_catch_up_with_primary()
                .map_err(|e| Error::db("catching up with the primary", e))?;
            let after = PrimaryFiles::read(&self.path);
            if !before.flushed_since(&after) {
                *seen = after;
                return Ok(());
            }
        }
        let (fresh, files) = open_whole_secondary(&self.path, &s.dir)?;
        *s.db.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh);
        *seen = files;
        Ok(())
    }

    /// Every (key, value) of a column family in key order.
    pub fn scan(&self, cf: &'static str) -> Entries<'_> {
        self.scan_prefix(cf, b"")
    }

    /// Every (key, value) whose key starts with `prefix`. The primary's
    /// scan is lazy; a secondary's is read whole, since a catch-up may
    /// replace the instance it would borrow.
    pub fn scan_prefix<'a>(&'a self, cf: &'a str, prefix: &'a [u8]) -> Entries<'a> {
        match &self.handle {
            Handle::Primary(db) => Box::new(entries(db, cf, prefix)),
            Handle::Secondary(_) => {
                let all: Vec<_> = self.with(|db| entries(db, cf, prefix).collect());
                Box::new(all.into_iter())
            }
        }
    }

    // ---- typed accessors -------------------------------------------------

    pub fn chunk_location(&self, id: &ChunkId) -> Result<Option<ChunkLocation>> {
        self.get(CF_CHUNKS, id.as_bytes())?
            .map(|v| ChunkLocation::decode(id, &v))
            .transpose()
    }

    pub fn snapshot(&self, id: &SnapshotId) -> Result<Option<SnapshotRecord>> {
        self.get(CF_SNAPSHOTS, id.as_bytes())?
            .map(|v| decode_snapshot(id.as_bytes(), &v))
            .transpose()
    }

    /// The persisted floor for new pack numbers (0 if never written).
    pub fn next_pack(&self) -> Result<u32> {
        Ok(self
            .get(CF_META, KEY_NEXT_PACK)?
            .and_then(|v| v.as_slice().try_into().ok().map(u32::from_le_bytes))
            .unwrap_or(0))
    }

    pub fn refcount(&self, key: &[u8]) -> Result<u64> {
        Ok(self.get(CF_REFS, key)?.map_or(0, |v| decode_count(&v)))
    }
}

/// Free space reserved for writes that add data (ingest, commit): room for
/// RocksDB to flush a memtable (8 MiB) and write its WAL.
pub(crate) const RESERVE_GROW: u64 = 16 << 20;
/// Free space reserved for writes that release data (delete, GC).
pub(crate) const RESERVE_SHRINK: u64 = 256 << 10;

/// Bytes available to unprivileged writers on the filesystem of `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain old data; all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and an out-pointer to a statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// Decodes a `snapshots` value.
pub(crate) fn decode_snapshot(key: &[u8], v: &[u8]) -> Result<SnapshotRecord> {
    serde_json::from_slice(v).map_err(|e| Error::CorruptRecord {
        what: "snapshot",
        key: hex::encode(key),
        reason: e.to_string(),
    })
}
