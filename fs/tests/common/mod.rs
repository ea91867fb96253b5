//! Test helpers: a real store in a tempdir and real FUSE mounts of it,
//! always unmounted and cleaned up (Drop), even when a test fails.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use forkd_fs::mount;
use forkd_fs::MountConfig;
use forkd_layers::{IngestOptions, NewSnapshot, SnapshotId, SnapshotRecord, Store, StoreOptions};

pub const BIN: &str = env!("CARGO_BIN_EXE_forkd-fs");

/// Skips (returns true) when FUSE mounts are impossible here.
pub fn no_fuse() -> bool {
    let ok = Path::new("/dev/fuse").exists() && nix::unistd::geteuid().is_root();
    if !ok {
        eprintln!("skipping: needs /dev/fuse and root");
    }
    !ok
}

/// A store plus the source files its snapshots were made from.
pub struct TestStore {
    pub store: Store,
    pub dir: tempfile::TempDir,
}

impl TestStore {
    pub fn new() -> TestStore {
        let dir = tempfile::Builder::new()
            .prefix("forkd-fs-test")
            .tempdir()
            .unwrap();
        let store = Store::open(&dir.path().join("store"), StoreOptions::default()).unwrap();
        TestStore { store, dir }
    }

    pub fn root(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// Writes `data` to a source file and returns its path.
    pub fn source(&self, name: &str, data: &[u8]) -> PathBuf {
        let p = self.dir.path().join("src").join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, data).unwrap();
        p
    }

    /// A sparse source file of `size` bytes with `data` written at each offset.
    pub fn sparse_source(&self, name: &str, size: u64, pieces: &[(u64, Vec<u8>)]) -> PathBuf {
        let p = self.dir.path().join("src").join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(size).unwrap();
        for (off, d) in pieces {
            f.write_all_at(d, *off).unwrap();
        }
        p
    }

    /// Ingests the named source files and commits them as one snapshot.
    pub fn commit(&self, files: &[(&str, &Path)], tag: Option<&str>) -> SnapshotRecord {
        let mut refs = BTreeMap::new();
        for (name, path) in files {
            let f = self
                .store
                .ingest_file(path, &IngestOptions::default())
                .unwrap();
            refs.insert(name.to_string(), f.file_ref());
        }
        self.store
            .commit_snapshot(NewSnapshot {
                files: refs,
                config: serde_json::json!({"test": true}),
                tag: tag.map(str::to_string),
                replace_tag: true,
                ..Default::default()
            })
            .unwrap()
    }

    pub fn mountpoint(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }

    pub fn config(&self) -> MountConfig {
        MountConfig {
            mountpoint: self.mountpoint(),
            store_dir: self.root(),
            secondary_dir: None,
            control_socket: None,
            binary: Some(PathBuf::from(BIN)),
            gid: None,
            no_fill: false,
            remote_deadline_secs: None,
        }
    }

    /// Mounts with `ensure_mounted` and returns the guard.
    pub fn mount(&self) -> Mounted {
        self.mount_gid(None)
    }

    /// Mounts readable by group `gid` too (`forkd-fs mount --gid`).
    pub fn mount_gid(&self, gid: Option<u32>) -> Mounted {
        let mut cfg = self.config();
        cfg.gid = gid;
        let guard = Mounted {
            mountpoint: cfg.mountpoint.clone(),
            control: cfg.control(),
            pids: Vec::new(),
        };
        forkd_fs::ensure_mounted(&cfg).unwrap();
        let mut guard = guard;
        guard.note_pid();
        guard
    }
}

impl Default for TestStore {
    fn default() -> Self {
        Self::new()
    }
}

/// A live mount; Drop unmounts it and kills every daemon it saw.
pub struct Mounted {
    pub mountpoint: PathBuf,
    pub control: PathBuf,
    pub pids: Vec<i32>,
}

impl Mounted {
    pub fn client(&self) -> forkd_fs::Client {
        forkd_fs::Client::connect(&self.control).unwrap()
    }

    /// Remembers the current daemon's pids (for cleanup) and returns the
    /// one that keeps the mount: its holder (as root), else the server.
    pub fn note_pid(&mut self) -> i32 {
        let st = self.client().status().unwrap();
        for pid in [Some(st.pid), st.holder_pid].into_iter().flatten() {
            if !self.pids.contains(&(pid as i32)) {
                self.pids.push(pid as i32);
            }
        }
        st.holder_pid.unwrap_or(st.pid) as i32
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.mountpoint.join(rel)
    }

    pub fn file(&self, id: &SnapshotId, name: &str) -> PathBuf {
        self.mountpoint
            .join("by-id")
            .join(id.to_string())
            .join(name)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(mount::log_path(&self.control)).unwrap_or_default()
    }
}

pub fn alive(pid: i32) -> bool {
    // A zombie counts as gone.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// SIGSTOPs `pid` and waits until every one of its threads shows as
/// stopped: `kill` only queues the stop, and a thread that is running (or
/// just woke in `read(/dev/fuse)`) may still answer a request issued in
/// the meantime.
pub fn stop(pid: i32) {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(pid), Signal::SIGSTOP).unwrap();
    let all_stopped = || {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return false;
        };
        tasks.flatten().all(|t| {
            std::fs::read_to_string(t.path().join("stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with(['T', 't']))
            })
        })
    };
    assert!(
        wait_for(Duration::from_secs(10), all_stopped),
        "{pid} did not stop"
    );
}

/// Waits until `f` holds or `timeout` passes; returns whether it held.
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

impl Drop for Mounted {
    fn drop(&mut self) {
        // Peel every forkd-fs mount stacked here (lazily: never hang).
        for _ in 0..8 {
            match mount::mount_at(&self.mountpoint) {
                Ok(Some(e)) if e.is_forkd_fs() => {
                    let _ = mount::sys_unmount(&self.mountpoint, true);
                }
                _ => break,
            }
        }
        for &pid in &self.pids {
            if !wait_for(Duration::from_secs(3), || !alive(pid)) {
                let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            }
        }
    }
}
