//! The FUSE operations: a read-only tree of snapshots.
//!
//! ```text
//! /                      0555  root
//! /by-id/                0555  every visible snapshot
//! /by-id/<id>/           0555  one snapshot
//! /by-id/<id>/<file>     0444  every file the record names + snapshot.json
//! /<tag>                 0777  symlink -> by-id/<id> (resolved on every readlink)
//! ```
//!
//! Reads are served from the store chunk by chunk (zero chunks are filled,
//! never read); a chunk that fails verification or is missing makes the whole
//! request fail with EIO and logs the snapshot, file, offset and chunk id.
//! A read of a lazy snapshot first has its missing chunks fetched from the
//! hub (`crate::lazy`, in the request's own thread: no global lock is held
//! meanwhile); every read of a snapshot whose working set is being recorded
//! is noted.
//! Files are opened with FOPEN_KEEP_CACHE (the content of an inode never
//! changes), so the kernel page cache survives across opens and is shared by
//! every process mapping the file, and with FOPEN_NOFLUSH: a read-only file
//! has nothing to flush, and a close must never wait for the daemon (a
//! QEMU exiting, or a process exec'ing with a file of the mount open, while
//! the worker restarts or a holder is adopted would hang in `close`).

use std::cell::RefCell;
use std::ffi::OsStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use forkd_layers::{ChunkRef, Error as StoreError, FileManifest, SnapshotId};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs, Request,
};
use tracing::{debug, error};

use crate::handles::Refusal;
use crate::inode::{self, Content, FileNode, Node};
use crate::shared::Shared;

/// Entries and attributes of immutable objects (snapshot dirs and files).
/// Hiding or deleting a snapshot invalidates them explicitly.
const IMMUTABLE_TTL: Duration = Duration::from_secs(60);
/// Root and `by-id` listings change as snapshots come and go.
const DIR_TTL: Duration = Duration::from_secs(1);
/// Tags move: always ask again.
const TAG_TTL: Duration = Duration::ZERO;

/// Kernel-side tuning negotiated at mount time.
#[derive(Debug, Clone, Copy)]
pub struct KernelTuning {
    /// Largest read request, bytes (FUSE max_pages; the kernel caps at 1 MiB
    /// unless `fs.fuse.max_pages_limit` is raised).
    pub max_read: u32,
    /// Requests the kernel may have in flight in the background (readahead).
    pub max_background: u16,
}

impl Default for KernelTuning {
    fn default() -> Self {
        KernelTuning {
            max_read: 1 << 20,
            max_background: 64,
        }
    }
}

/// The filesystem behind a mount.
pub struct ForkdFs {
    shared: Arc<Shared>,
    tuning: KernelTuning,
}

impl ForkdFs {
    pub fn new(shared: Arc<Shared>, tuning: KernelTuning) -> ForkdFs {
        ForkdFs { shared, tuning }
    }
}

/// Mode of served directories and files: root and the reading group only
/// (the mount has `default_permissions`, so the kernel enforces it).
const DIR_MODE: u16 = 0o550;
const FILE_MODE: u16 = 0o440;

fn attr(ino: u64, kind: FileType, perm: u16, size: u64, mtime: SystemTime, gid: u32) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: mtime,
        mtime,
        ctime: mtime,
        crtime: mtime,
        kind,
        perm,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid: 0,
        gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

/// Target of a tag symlink.
fn tag_target(id: &SnapshotId) -> String {
    format!("{}/{id}", inode::BY_ID_NAME)
}

/// `by-id/` + 32 hex digits.
const TAG_TARGET_LEN: u64 = 6 + 32;

impl Shared {
    fn node_attr(&self, node: &Node, ino: u64) -> (FileAttr, Duration) {
        let epoch = SystemTime::UNIX_EPOCH;
        let gid = self.group.unwrap_or(0);
        let dir = |mtime| attr(ino, FileType::Directory, DIR_MODE, 0, mtime, gid);
        match node {
            Node::Root => (dir(epoch), DIR_TTL),
            Node::ById => (dir(epoch), DIR_TTL),
            Node::Dir(s) => (dir(s.mtime), IMMUTABLE_TTL),
            Node::File(f) => (
                attr(ino, FileType::RegularFile, FILE_MODE, f.size, f.mtime, gid),
                IMMUTABLE_TTL,
            ),
            // A symlink's mode is never checked; what it names is.
            Node::Tag(_) => (
                attr(ino, FileType::Symlink, 0o777, TAG_TARGET_LEN, epoch, gid),
                TAG_TTL,
            ),
        }
    }
}

/// A store error answered as EIO, logged once with what failed.
fn store_eio(what: &str, e: &StoreError) -> Errno {
    error!("{what}: {e}; answering EIO");
    Errno::EIO
}

/// The chunk a failed read names, for the log line.
fn failed_chunk(e: &StoreError) -> Option<String> {
    match e {
        StoreError::FileRead { source, .. } => failed_chunk(source),
        StoreError::CorruptChunk { id, .. }
        | StoreError::MissingChunk { id, .. }
        | StoreError::RemoteFetch { id, .. } => Some(id.to_string()),
        _ => None,
    }
}

thread_local! {
    /// Per request thread: the reply buffer, reused (a 1 MiB allocation per
    /// read would cost page faults every time).
    static READ_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// SEEK_DATA / SEEK_HOLE over a manifest: zero chunks are holes.
pub fn seek_data_hole(m: &FileManifest, offset: u64, want_data: bool) -> Option<u64> {
    let size = m.size();
    if offset >= size {
        return None;
    }
    let cs = u64::from(m.chunk_size());
    for i in (offset / cs) as usize..m.len() {
        let is_data = matches!(m.entry(i), ChunkRef::Chunk(_));
        if is_data == want_data {
            return Some(offset.max(i as u64 * cs));
        }
    }
    if want_data {
        None
    } else {
        Some(size)
    }
}

impl ForkdFs {
    fn file_node(&self, ino: INodeNo) -> Result<Arc<FileNode>, Errno> {
        match self.shared.inodes.get(ino.0) {
            Some(Node::File(f)) => Ok(f),
            Some(_) => Err(Errno::EISDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn lookup_node(&self, parent: u64, name: &str, t0: Instant) -> Result<u64, Errno> {
        let sh = &self.shared;
        match sh.inodes.get(parent) {
            Some(Node::Root) if name == inode::BY_ID_NAME => Ok(inode::BY_ID),
            Some(Node::Root) => match sh.resolve_tag(name, t0) {
                Ok(Some(_)) => Ok(sh.inodes.tag(name)),
                Ok(None) => Err(Errno::ENOENT),
                Err(e) => Err(store_eio(&format!("looking up tag {name}"), &e)),
            },
            Some(Node::ById) => {
                let Ok(id) = name.parse::<SnapshotId>() else {
                    return Err(Errno::ENOENT);
                };
                match sh.find_snapshot(&id, t0) {
                    Ok(Some(s)) => Ok(s.dir_ino),
                    Ok(None) => Err(Errno::ENOENT),
                    Err(e) => Err(store_eio(&format!("looking up snapshot {id}"), &e)),
                }
            }
            Some(Node::Dir(s)) => {
                match sh.visible(&s.id) {
                    Ok(true) => {}
                    Ok(false) => return Err(Errno::ENOENT),
                    Err(e) => return Err(store_eio(&format!("looking up snapshot {}", s.id), &e)),
                }
                s.files.get(name).map(|f| f.ino).ok_or(Errno::ENOENT)
            }
            Some(_) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    /// Directory entries of `ino`, in a stable order: (inode, kind, name).
    fn entries(&self, ino: u64) -> Result<Vec<(u64, FileType, String)>, Errno> {
        let sh = &self.shared;
        let t0 = Instant::now();
        let mut out = vec![
            (ino, FileType::Directory, ".".to_string()),
            (inode::ROOT, FileType::Directory, "..".to_string()),
        ];
        match sh.inodes.get(ino) {
            Some(Node::Root) => {
                out.push((inode::BY_ID, FileType::Directory, inode::BY_ID_NAME.into()));
                let _ = sh.catchup.since(t0);
                let tags = sh.view.tags().map_err(|e| store_eio("listing tags", &e))?;
                for (tag, id) in tags {
                    if tag != inode::BY_ID_NAME && sh.visible(&id).unwrap_or(false) {
                        out.push((sh.inodes.tag(&tag), FileType::Symlink, tag));
                    }
                }
            }
            Some(Node::ById) => {
                out[1].0 = inode::ROOT;
                let _ = sh.catchup.since(t0);
                let snaps = sh
                    .view
                    .list_snapshots()
                    .map_err(|e| store_eio("listing snapshots", &e))?;
                for rec in snaps {
                    if sh.visible(&rec.id).unwrap_or(false) {
                        let s = sh.inodes.add_snapshot(&rec);
                        out.push((s.dir_ino, FileType::Directory, rec.id.to_string()));
                    }
                }
            }
            Some(Node::Dir(s)) => {
                out[1].0 = inode::BY_ID;
                for f in s.files.values() {
                    out.push((f.ino, FileType::RegularFile, f.name.clone()));
                }
            }
            Some(_) => return Err(Errno::ENOTDIR),
            None => return Err(Errno::ENOENT),
        }
        Ok(out)
    }

    /// Reads `size` bytes at `offset` into the thread's buffer and hands
    /// them to `send`.
    fn read_with(
        &self,
        f: &FileNode,
        offset: u64,
        size: u32,
        send: impl FnOnce(&[u8]),
    ) -> Result<(), Errno> {
        let sh = &self.shared;
        sh.stats.requests.fetch_add(1, Ordering::Relaxed);
        let reader = match f.reader(&sh.view) {
            None => None,
            Some(Ok(r)) => Some(r),
            Some(Err(e)) => {
                sh.stats.errors.fetch_add(1, Ordering::Relaxed);
                return Err(store_eio(
                    &format!("opening {} of snapshot {}", f.name, f.snap),
                    &e,
                ));
            }
        };
        let want = (size as u64).min(f.size.saturating_sub(offset)) as usize;
        sh.recorder.note(f.ino, offset, want as u64);
        if let (Some(lazy), Some(r)) = (sh.lazy.get(), reader.as_ref()) {
            let cs = u64::from(r.manifest().chunk_size());
            lazy.note_read(&f.snap, &f.name, offset, want as u64, cs);
            if lazy.is_lazy(&f.snap) {
                if let Err(e) = lazy.ensure(r, offset, want as u64) {
                    sh.stats.errors.fetch_add(1, Ordering::Relaxed);
                    error!(
                        snapshot = %f.snap,
                        file = %f.name,
                        offset,
                        chunk = %failed_chunk(&e).unwrap_or_default(),
                        request_len = size,
                        "read of a lazy snapshot failed, answering EIO: {e}"
                    );
                    return Err(Errno::EIO);
                }
            }
        }
        READ_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < want {
                buf.resize(want, 0);
            }
            let dst = &mut buf[..want];
            match (&f.content, reader) {
                (Content::Generated(bytes), _) => {
                    let start = (offset as usize).min(bytes.len());
                    dst.copy_from_slice(&bytes[start..start + want]);
                }
                (Content::Stored(_), Some(r)) => {
                    if let Err(e) = r.read_at(dst, offset) {
                        sh.stats.errors.fetch_add(1, Ordering::Relaxed);
                        let (at, chunk) = match &e {
                            StoreError::FileRead { file_offset, .. } => {
                                (*file_offset, failed_chunk(&e))
                            }
                            _ => (offset, None),
                        };
                        let chunk = chunk.unwrap_or_else(|| match r.chunk_at(at) {
                            ChunkRef::Chunk(id) => id.to_string(),
                            ChunkRef::Zero => "zero".into(),
                        });
                        error!(
                            snapshot = %f.snap,
                            file = %f.name,
                            offset = at,
                            chunk = %chunk,
                            request_offset = offset,
                            request_len = size,
                            "read failed, answering EIO: {e}"
                        );
                        return Err(Errno::EIO);
                    }
                }
                (Content::Stored(_), None) => return Err(Errno::EIO),
            }
            sh.stats.bytes.fetch_add(want as u64, Ordering::Relaxed);
            send(dst);
            Ok(())
        })
    }
}

impl Filesystem for ForkdFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // max_pages follows max(max_write, max_readahead): ask for large
        // read requests through max_write (nothing is ever written).
        let _ = config.set_max_write(self.tuning.max_read);
        let _ = config.set_max_readahead(self.tuning.max_read);
        let _ = config.set_max_background(self.tuning.max_background);
        let _ = config.set_congestion_threshold(self.tuning.max_background * 3 / 4);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let t0 = Instant::now();
        let Some(name) = name.to_str() else {
            return reply.error(Errno::ENOENT);
        };
        match self.lookup_node(parent.0, name, t0) {
            Ok(ino) => match self.shared.inodes.get(ino) {
                Some(node) => {
                    let (a, ttl) = self.shared.node_attr(&node, ino);
                    reply.entry(&ttl, &a, Generation(0));
                }
                None => reply.error(Errno::ENOENT),
            },
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.shared.inodes.get(ino.0) {
            Some(node) => {
                let (a, ttl) = self.shared.node_attr(&node, ino.0);
                reply.attr(&ttl, &a);
            }
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let Some(Node::Tag(tag)) = self.shared.inodes.get(ino.0) else {
            return reply.error(Errno::EINVAL);
        };
        match self.shared.resolve_tag(&tag, Instant::now()) {
            Ok(Some(id)) => reply.data(tag_target(&id).as_bytes()),
            Ok(None) => reply.error(Errno::ENOENT),
            Err(e) => reply.error(store_eio(&format!("resolving tag {tag}"), &e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let f = match self.file_node(ino) {
            Ok(f) => f,
            Err(e) => return reply.error(e),
        };
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        if let Some(Err(e)) = f.reader(&self.shared.view) {
            return reply.error(match e {
                StoreError::NoSuchSnapshot(_) | StoreError::NoSuchFile { .. } => Errno::ENOENT,
                e => store_eio(&format!("opening {} of snapshot {}", f.name, f.snap), &e),
            });
        }
        // A deleted snapshot that was committed again is revived here too:
        // the kernel may open a file it still knows without a lookup.
        if let Err(e) = self.shared.visible(&f.snap) {
            return reply.error(store_eio(&format!("opening snapshot {}", f.snap), &e));
        }
        let first = self.shared.handles.count(&f.snap) == 0;
        match self.shared.handles.open(f.snap) {
            Ok(fh) => {
                debug!(snapshot = %f.snap, file = %f.name, fh, "open");
                if let (Some(lazy), Content::Stored(_)) = (self.shared.lazy.get(), &f.content) {
                    lazy.on_open(f.snap, first);
                }
                reply.opened(
                    FileHandle(fh),
                    FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_NOFLUSH,
                );
            }
            Err(Refusal::Hidden) | Err(Refusal::InUse(_)) => reply.error(Errno::ENOENT),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let f = match self.file_node(ino) {
            Ok(f) => f,
            Err(e) => return reply.error(e),
        };
        let mut reply = Some(reply);
        let res = self.read_with(&f, offset, size, |data| {
            if let Some(r) = reply.take() {
                r.data(data)
            }
        });
        if let (Err(e), Some(r)) = (res, reply.take()) {
            r.error(e);
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.shared.handles.close(fh.0);
        reply.ok();
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = match self.entries(ino.0) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let files = self.shared.inodes.len() as u64;
        reply.statfs(0, 0, 0, files, 0, 4096, 255, 4096);
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let f = match self.file_node(ino) {
            Ok(f) => f,
            Err(e) => return reply.error(e),
        };
        let want_data = match whence {
            libc::SEEK_DATA => true,
            libc::SEEK_HOLE => false,
            _ => return reply.error(Errno::EINVAL),
        };
        let Ok(offset) = u64::try_from(offset) else {
            return reply.error(Errno::ENXIO);
        };
        let found = match f.reader(&self.shared.view) {
            Some(Ok(r)) => seek_data_hole(r.manifest(), offset, want_data),
            Some(Err(e)) => return reply.error(store_eio("seeking", &e)),
            // Generated files are all data.
            None if offset < f.size => Some(if want_data { offset } else { f.size }),
            None => None,
        };
        match found {
            Some(o) => reply.offset(o as i64),
            None => reply.error(Errno::ENXIO),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkd_layers::ChunkId;

    #[test]
    fn seek_over_holes() {
        let c = ChunkRef::Chunk(ChunkId([1; 32]));
        let z = ChunkRef::Zero;
        let m = FileManifest::new(4 * 4096 + 100, 4096, &[z, c, c, z, c]).unwrap();
        assert_eq!(seek_data_hole(&m, 0, true), Some(4096));
        assert_eq!(seek_data_hole(&m, 5000, true), Some(5000));
        assert_eq!(seek_data_hole(&m, 5000, false), Some(3 * 4096));
        assert_eq!(seek_data_hole(&m, 3 * 4096 + 1, true), Some(4 * 4096));
        assert_eq!(
            seek_data_hole(&m, 4 * 4096 + 1, false),
            Some(4 * 4096 + 100)
        );
        assert_eq!(seek_data_hole(&m, 4 * 4096 + 100, true), None);
    }
}
