//! The control socket: a unix socket speaking JSON lines (one request per
//! line, one reply per line), and [`Client`], the Rust client poold uses.
//!
//! | request | reply |
//! |---|---|
//! | `{"op":"status"}` | [`Status`] |
//! | `{"op":"in_use","id":ID}` | `{"open_handles":N}` |
//! | `{"op":"begin_delete","id":ID}` | `{"ok":true}` or `{"error":"in use: N open handles","open_handles":N}` |
//! | `{"op":"end_delete","id":ID,"deleted":bool}` | `{"ok":true}` |
//! | `{"op":"refresh"}` | `{"ok":true}` |
//! | `{"op":"prefetch","id":ID,"file":F,"ranges":[[off,len],...],"wait":bool}` | `{"ok":true,"bytes":N}` (+`"ms"` with `wait`) |
//! | `{"op":"record_start","id":ID,"file":F,"invalidate":bool}` | `{"ok":true}` |
//! | `{"op":"record_stop","id":ID,"file":F}` | `{"ranges":[[off,len],...],"bytes":N}` |
//! | `{"op":"ranges","id":ID,"file":F}` | `{"ranges":[[off,len],...]}` or `{"ranges":null}` |
//! | `{"op":"remote_ready","id":ID,"wait_ms":N}` | [`crate::lazy::RemoteReady`], or an error when the snapshot is lazy and its hub does not answer |
//!
//! Every failure is `{"error":"..."}`. `file` defaults to `memory.bin`.
//! `prefetch` without `ranges` uses the stored list (see
//! [`crate::prefetch`]) or else every data extent of the file; it answers
//! once the reads are queued, or with `"wait":true` once they are done.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use forkd_layers::SnapshotId;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::{info, warn};

use crate::prefetch;
use crate::ranges::{total_bytes, RangeList};
use crate::shared::Shared;

/// The file most requests are about.
pub const DEFAULT_FILE: &str = "memory.bin";

fn default_file() -> String {
    DEFAULT_FILE.to_string()
}

/// One control request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// `status`: the daemon's [`Status`].
    Status,
    /// `in_use`: how many handles are open on the snapshot's files.
    InUse {
        /// Snapshot id (not a tag), as in every request that takes one.
        id: String,
    },
    /// `begin_delete`: hide the snapshot, refused while any of its files is open.
    BeginDelete {
        /// Snapshot id (hex; control requests take ids, not tags).
        id: String,
    },
    /// `end_delete`: finish the delete protocol.
    EndDelete {
        /// Snapshot id (hex; control requests take ids, not tags).
        id: String,
        /// True: the store delete happened, keep it hidden and drop its pages; false: show it again.
        deleted: bool,
    },
    /// `refresh`: catch up with the store's writer now.
    Refresh,
    /// `prefetch`: read ranges of a file through the mount so they land in the page cache.
    Prefetch {
        /// Snapshot id (hex; control requests take ids, not tags).
        id: String,
        /// File of the snapshot (default `memory.bin`).
        #[serde(default = "default_file")]
        file: String,
        /// `[offset, len]` ranges; absent: the list stored with the snapshot, else all data extents.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ranges: Option<RangeList>,
        /// Answer once read (with `ms`) rather than once queued.
        #[serde(default)]
        wait: bool,
    },
    /// `record_start`: start recording which ranges of a file the kernel reads.
    RecordStart {
        /// Snapshot id (hex; control requests take ids, not tags).
        id: String,
        /// File of the snapshot (default `memory.bin`).
        #[serde(default = "default_file")]
        file: String,
        /// Drop the file's cached pages first, so every range the next
        /// reader touches is seen (costs those pages for current users).
        #[serde(default)]
        invalidate: bool,
    },
    /// `record_stop`: stop recording and answer the ranges read, merged and sorted.
    RecordStop {
        /// Snapshot id (hex; control requests take ids, not tags).
        id: String,
        /// File of the snapshot (default `memory.bin`).
        #[serde(default = "default_file")]
        file: String,
    },
    /// `ranges`: the range list stored with the snapshot, or null.
    Ranges {
        /// Snapshot id (hex; control requests take ids, not tags).
        id: String,
        /// File of the snapshot (default `memory.bin`).
        #[serde(default = "default_file")]
        file: String,
    },
    /// `remote_ready`: may a child of this snapshot start now? Not lazy,
    /// or lazy with its hub answering (probed when its last request failed);
    /// starts fetching the working set, and waits up to `wait_ms` for it.
    RemoteReady {
        /// Snapshot id (hex; control requests take ids, not tags).
        id: String,
        /// Wait this long for the working set to be local.
        #[serde(default)]
        wait_ms: u64,
    },
}

/// Decompressed-chunk cache counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CacheInfo {
    /// Most bytes the cache may hold (`--cache-mib`).
    pub capacity_bytes: u64,
    /// Bytes it holds now.
    pub bytes: u64,
    /// Chunks it holds now.
    pub entries: u64,
    /// Lookups served from the cache since start.
    pub hits: u64,
    /// Lookups that had to read and decompress a chunk.
    pub misses: u64,
}

/// FUSE read counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReadCounters {
    /// Read requests answered.
    pub requests: u64,
    /// Bytes returned.
    pub bytes: u64,
    /// Requests answered with EIO.
    pub errors: u64,
}

/// The `status` reply.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Status {
    /// The mount point this process serves (canonical path).
    pub mountpoint: PathBuf,
    /// The store it serves from.
    pub store: PathBuf,
    /// Pid of the process serving the mount (the worker, behind a holder).
    pub pid: u32,
    /// Pid of the holder keeping the mount's connection, if any.
    #[serde(default)]
    pub holder_pid: Option<u32>,
    /// Which worker this is: 1 for the first, +1 per restart or upgrade
    /// (0 without a holder).
    #[serde(default)]
    pub generation: u64,
    /// The mount's device (`major:minor`) behind a holder: a control
    /// socket whose device is no longer mounted at `mountpoint` belongs to
    /// a detached mount that still serves its open files.
    #[serde(default)]
    pub dev: Option<String>,
    /// Time since it started, ms.
    pub uptime_ms: u64,
    /// Open file handles per snapshot id (only ids with any).
    pub open_handles: BTreeMap<String, u64>,
    /// Ids hidden between `begin_delete` and `end_delete`.
    pub hidden: Vec<String>,
    /// Decompressed-chunk cache counters.
    pub cache: CacheInfo,
    /// FUSE read counters.
    pub reads: ReadCounters,
    /// Inode numbers handed out so far.
    pub inodes: u64,
    /// The group that may read the mount (`--gid`), if any.
    #[serde(default)]
    pub gid: Option<u32>,
    /// Lazy snapshots: fetches, the fill, hubs' health, failures.
    #[serde(default)]
    pub lazy: crate::lazy::LazyStatus,
}

/// Errors the daemon answers that a caller may want to tell apart.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// `begin_delete` refused: files of the snapshot are open (mapped by VMs).
    #[error("snapshot {id} is in use: {open_handles} open handles on the forkd-fs mount; stop the VMs using it, then retry")]
    InUse {
        /// The snapshot id asked about.
        id: String,
        /// Handles open on its files now.
        open_handles: u64,
    },
    /// Any other `{"error": ...}` reply.
    #[error("forkd-fs: {0}")]
    Refused(String),
}

fn parse_id(id: &str) -> Result<SnapshotId> {
    id.parse::<SnapshotId>()
        .map_err(|e| anyhow!("{e} (control requests take snapshot ids, not tags)"))
}

/// Accepts control connections until the listener fails; one thread per
/// connection (there are only a few clients: poold and the CLI).
pub fn serve(listener: UnixListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let sh = shared.clone();
                let _ = std::thread::Builder::new()
                    .name("forkd-fs-ctl".into())
                    .spawn(move || handle_conn(stream, sh));
            }
            Err(e) => {
                warn!("control socket accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn handle_conn(stream: UnixStream, shared: Arc<Shared>) {
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { return };
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(req) => handle(&shared, req).unwrap_or_else(|e| json!({"error": format!("{e:#}")})),
            Err(e) => json!({"error": format!("bad request {line:?}: {e}")}),
        };
        let mut text = reply.to_string();
        text.push('\n');
        if out.write_all(text.as_bytes()).is_err() {
            return;
        }
    }
}

/// Answers one request.
pub fn handle(sh: &Arc<Shared>, req: Request) -> Result<Value> {
    Ok(match req {
        Request::Status => serde_json::to_value(status(sh))?,
        Request::InUse { id } => json!({"open_handles": sh.handles.count(&parse_id(&id)?)}),
        Request::BeginDelete { id } => {
            let sid = parse_id(&id)?;
            match sh.handles.begin_delete(sid) {
                Ok(()) => {
                    sh.invalidate(&sid, false);
                    info!(snapshot = %sid, "hidden for deletion");
                    json!({"ok": true})
                }
                Err(crate::handles::Refusal::InUse(n)) => {
                    info!(snapshot = %sid, open_handles = n, "delete refused: in use");
                    json!({"error": format!("in use: {n} open handles"), "open_handles": n})
                }
                Err(crate::handles::Refusal::Hidden) => json!({"ok": true}),
            }
        }
        Request::EndDelete { id, deleted } => {
            let sid = parse_id(&id)?;
            sh.handles.end_delete(sid, deleted);
            if deleted {
                sh.invalidate(&sid, true);
                let _ = sh.catchup.now();
            }
            info!(snapshot = %sid, deleted, "delete ended");
            json!({"ok": true})
        }
        Request::Refresh => {
            sh.catchup.now()?;
            json!({"ok": true})
        }
        Request::Prefetch {
            id,
            file,
            ranges,
            wait,
        } => prefetch_op(sh, &id, &file, ranges, wait)?,
        Request::RecordStart {
            id,
            file,
            invalidate,
        } => {
            let node = file_node(sh, &id, &file)?;
            if invalidate {
                if let Some(n) = sh.notifier.lock().unwrap().as_ref() {
                    n.inval_inode(fuser::INodeNo(node.ino), 0, 0)
                        .or_else(|e| match e.raw_os_error() {
                            Some(libc::ENOENT) => Ok(()),
                            _ => Err(e),
                        })
                        .context("dropping the file's cached pages")?;
                }
            }
            sh.recorder.start(node.ino);
            json!({"ok": true})
        }
        Request::RecordStop { id, file } => {
            let node = file_node(sh, &id, &file)?;
            let ranges = sh
                .recorder
                .stop(node.ino)
                .ok_or_else(|| anyhow!("{file} of {id} is not being recorded"))?;
            json!({"bytes": total_bytes(&ranges), "ranges": ranges})
        }
        Request::Ranges { id, file } => {
            let sid = parse_id(&id)?;
            let _ = sh.catchup.now();
            json!({"ranges": prefetch::load_ranges(&sh.view, &sid, &file)?})
        }
        Request::RemoteReady { id, wait_ms } => {
            let sid = parse_id(&id)?;
            let _ = sh.catchup.now();
            let lazy = sh
                .lazy
                .get()
                .ok_or_else(|| anyhow!("this mount serves no lazy snapshots"))?;
            serde_json::to_value(lazy.remote_ready(sid, Duration::from_millis(wait_ms))?)?
        }
    })
}

fn file_node(sh: &Shared, id: &str, file: &str) -> Result<Arc<crate::inode::FileNode>> {
    let sid = parse_id(id)?;
    sh.file(&sid, file)?.ok_or_else(|| {
        anyhow!("snapshot {id} has no file {file} on this mount (unknown, hidden or deleted)")
    })
}

fn prefetch_op(
    sh: &Arc<Shared>,
    id: &str,
    file: &str,
    ranges: Option<RangeList>,
    wait: bool,
) -> Result<Value> {
    let sid = parse_id(id)?;
    file_node(sh, id, file)?;
    let path = prefetch::file_path(&sh.mountpoint, &sid, file);
    let ranges = match ranges {
        Some(r) => r,
        None => match prefetch::load_ranges(&sh.view, &sid, file)? {
            Some(r) => r,
            None => prefetch::default_ranges(&path)?,
        },
    };
    let bytes = prefetch::ranges_bytes(&ranges);
    if wait {
        let rep = prefetch::read_ranges(&path, &ranges, 4)?;
        return Ok(json!({"ok": true, "bytes": rep.bytes, "ms": rep.ms}));
    }
    std::thread::Builder::new()
        .name("forkd-fs-prefetch".into())
        .spawn(move || match prefetch::read_ranges(&path, &ranges, 4) {
            Ok(r) => info!(path = %path.display(), bytes = r.bytes, ms = r.ms, "prefetched"),
            Err(e) => warn!(path = %path.display(), "prefetch failed: {e:#}"),
        })?;
    Ok(json!({"ok": true, "bytes": bytes}))
}

fn status(sh: &Shared) -> Status {
    let c = sh.view.cache_stats();
    Status {
        mountpoint: sh.mountpoint.clone(),
        store: sh.store_dir.clone(),
        pid: std::process::id(),
        holder_pid: sh.worker.as_ref().map(|w| w.holder_pid),
        generation: sh.worker.as_ref().map_or(0, |w| w.generation),
        dev: sh.worker.as_ref().and_then(|w| w.dev.clone()),
        uptime_ms: sh.started.elapsed().as_millis() as u64,
        open_handles: sh
            .handles
            .counts()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        hidden: sh.handles.hidden().iter().map(|i| i.to_string()).collect(),
        cache: CacheInfo {
            capacity_bytes: c.capacity_bytes,
            bytes: c.bytes,
            entries: c.entries,
            hits: c.hits,
            misses: c.misses,
        },
        reads: sh.stats.snapshot(),
        gid: sh.group,
        inodes: sh.inodes.len() as u64,
        lazy: sh.lazy.get().map(|l| l.status()).unwrap_or_default(),
    }
}

/// A blocking control-socket client (from async code, call it inside
/// `spawn_blocking`). One connection serves any number of requests.
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    path: PathBuf,
}

/// Default time a reply may take (`prefetch` with `wait` may need longer:
/// use [`Client::connect_timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

impl Client {
    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> Result<Client> {
        Self::connect_timeout(path, DEFAULT_TIMEOUT)
    }

    /// Connects with a read/write timeout per request.
    pub fn connect_timeout(path: &Path, timeout: Duration) -> Result<Client> {
        let s = UnixStream::connect(path).with_context(|| {
            format!(
                "connecting to the forkd-fs control socket {} (is `forkd-fs mount` running?)",
                path.display()
            )
        })?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        Ok(Client {
            writer: s.try_clone()?,
            reader: BufReader::new(s),
            path: path.to_path_buf(),
        })
    }

    /// Sends one request and returns the raw JSON reply; an `{"error":..}`
    /// reply is an `Err` ([`ControlError`]).
    pub fn call(&mut self, req: &Request) -> Result<Value> {
        let mut line = serde_json::to_string(req)?;
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .with_context(|| format!("writing to {}", self.path.display()))?;
        let mut reply = String::new();
        let n = self
            .reader
            .read_line(&mut reply)
            .with_context(|| format!("reading a reply from {}", self.path.display()))?;
        if n == 0 {
            bail!(
                "forkd-fs closed the control connection {}",
                self.path.display()
            );
        }
        let v: Value = serde_json::from_str(&reply)
            .with_context(|| format!("bad reply from forkd-fs: {reply:?}"))?;
        if let Some(err) = v.get("error").and_then(Value::as_str) {
            if let Some(n) = v.get("open_handles").and_then(Value::as_u64) {
                let id = match req {
                    Request::BeginDelete { id } => id.clone(),
                    _ => String::new(),
                };
                return Err(ControlError::InUse {
                    id,
                    open_handles: n,
                }
                .into());
            }
            return Err(ControlError::Refused(err.to_string()).into());
        }
        Ok(v)
    }

    /// Mount point, pid, open handles per snapshot, cache and read counters.
    pub fn status(&mut self) -> Result<Status> {
        Ok(serde_json::from_value(self.call(&Request::Status)?)?)
    }

    /// Open handles of one snapshot.
    pub fn in_use(&mut self, id: &SnapshotId) -> Result<u64> {
        let v = self.call(&Request::InUse { id: id.to_string() })?;
        Ok(v["open_handles"].as_u64().unwrap_or(0))
    }

    /// Hides `id` for deletion; fails with [`ControlError::InUse`] if any of
    /// its files is open. Always pair with [`Client::end_delete`].
    pub fn begin_delete(&mut self, id: &SnapshotId) -> Result<()> {
        self.call(&Request::BeginDelete { id: id.to_string() })
            .map(drop)
    }

    /// Ends a delete: `deleted = false` makes the id visible again.
    pub fn end_delete(&mut self, id: &SnapshotId, deleted: bool) -> Result<()> {
        self.call(&Request::EndDelete {
            id: id.to_string(),
            deleted,
        })
        .map(drop)
    }

    /// Makes the mount see the store's latest commits now.
    pub fn refresh(&mut self) -> Result<()> {
        self.call(&Request::Refresh).map(drop)
    }

    /// Pulls ranges of a file into the page cache (stored or data extents
    /// when `ranges` is `None`); returns the bytes queued or, with `wait`,
    /// read.
    pub fn prefetch(
        &mut self,
        id: &SnapshotId,
        file: &str,
        ranges: Option<RangeList>,
        wait: bool,
    ) -> Result<u64> {
        let v = self.call(&Request::Prefetch {
            id: id.to_string(),
            file: file.to_string(),
            ranges,
            wait,
        })?;
        Ok(v["bytes"].as_u64().unwrap_or(0))
    }

    /// Starts recording the ranges the kernel reads from a file.
    pub fn record_start(&mut self, id: &SnapshotId, file: &str, invalidate: bool) -> Result<()> {
        self.call(&Request::RecordStart {
            id: id.to_string(),
            file: file.to_string(),
            invalidate,
        })
        .map(drop)
    }

    /// Stops recording; the merged, sorted ranges read since the start.
    pub fn record_stop(&mut self, id: &SnapshotId, file: &str) -> Result<RangeList> {
        let v = self.call(&Request::RecordStop {
            id: id.to_string(),
            file: file.to_string(),
        })?;
        Ok(serde_json::from_value(v["ranges"].clone())?)
    }

    /// Whether a child of `id` may start now (see [`Request::RemoteReady`]);
    /// an `Err` says why not (a lazy snapshot whose hub does not answer).
    pub fn remote_ready(
        &mut self,
        id: &SnapshotId,
        wait: Duration,
    ) -> Result<crate::lazy::RemoteReady> {
        let v = self.call(&Request::RemoteReady {
            id: id.to_string(),
            wait_ms: wait.as_millis() as u64,
        })?;
        Ok(serde_json::from_value(v)?)
    }

    /// The prefetch ranges stored with the snapshot, if any.
    pub fn stored_ranges(&mut self, id: &SnapshotId, file: &str) -> Result<Option<RangeList>> {
        let v = self.call(&Request::Ranges {
            id: id.to_string(),
            file: file.to_string(),
        })?;
        Ok(serde_json::from_value(v["ranges"].clone())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        let r: Request = serde_json::from_str(r#"{"op":"begin_delete","id":"ab"}"#).unwrap();
        assert_eq!(r, Request::BeginDelete { id: "ab".into() });
        let r: Request =
            serde_json::from_str(r#"{"op":"prefetch","id":"x","ranges":[[0,4096]]}"#).unwrap();
        assert_eq!(
            r,
            Request::Prefetch {
                id: "x".into(),
                file: "memory.bin".into(),
                ranges: Some(vec![(0, 4096)]),
                wait: false
            }
        );
        assert_eq!(
            serde_json::to_string(&Request::Status).unwrap(),
            r#"{"op":"status"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::EndDelete {
                id: "i".into(),
                deleted: true
            })
            .unwrap(),
            r#"{"op":"end_delete","id":"i","deleted":true}"#
        );
    }
}
