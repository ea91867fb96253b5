//! poold's durable state: every sandbox and pooled child it owns, and the
//! pool sizes set through the API. One JSON file,
//! `$FORKD_HOME/poold/state.json`, replaced atomically (write a temp file,
//! fsync, rename, fsync the directory) after every change, so a crash at any
//! point leaves either the old or the new state, never a torn one.
//!
//! The QEMU processes are not tied to poold's lifetime. After a restart,
//! poold reads this file and re-adopts every VM whose QEMU still runs; VMs it
//! owned but that are not in the file (a crash between starting one and
//! recording it) are killed, since nobody could reach them.

use super::config::PoolSpec;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Current file format.
pub const STATE_VERSION: u32 = 1;

/// A sandbox as recorded. Field names follow forkd's `SandboxInfo` where
/// they overlap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// `sb-` + 24 random hex digits; also the VM directory's name.
    pub id: String,
    pub snapshot_tag: String,
    pub snapshot_id: String,
    pub created_at_unix: u64,
    pub pid: u32,
    pub memory_limit_mib: Option<u64>,
    /// CPU quota in CPUs (cgroup cpu controller).
    #[serde(default)]
    pub cpus: Option<f64>,
    /// Most tasks its QEMU may hold (cgroup pids controller).
    #[serde(default)]
    pub pids_max: Option<u64>,
    /// Killed automatically at this time (0: never).
    #[serde(default)]
    pub expires_at_unix: u64,
    pub hostname: String,
    #[serde(default)]
    pub branch_count: u32,
    /// Whether it came from a pool (a hit) or was restored on demand.
    #[serde(default)]
    pub pool_hit: bool,
    /// Spawn request received → this child's agent answered, ms.
    #[serde(default)]
    pub spawn_ms: u64,
    /// Its network namespace and addresses, when networked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<forkd_net::ChildNet>,
    /// Published ports (with the host ports actually bound).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<forkd_net::proxy::PortSpec>,
}

/// A paused child waiting in a pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PooledRecord {
    /// VM id (directory name).
    pub vm_id: String,
    pub tag: String,
    pub snapshot_id: String,
    pub created_at_unix: u64,
    /// Its identity was given when it was parked (a warm pool): the
    /// hand-out only sets its clock. False in state files from before.
    #[serde(default)]
    pub identified: bool,
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    pub sandboxes: BTreeMap<String, SandboxRecord>,
    pub pooled: BTreeMap<String, PooledRecord>,
    /// Pool sizes set through the API (override the config file's).
    pub pools: BTreeMap<String, PoolSpec>,
}

/// The state file.
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    pub fn new(dir: &Path) -> StateFile {
        StateFile {
            path: dir.join("state.json"),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the state; a missing file is an empty state.
    pub fn load(&self) -> Result<State> {
        match std::fs::read(&self.path) {
            Ok(b) => {
                let s: State = serde_json::from_slice(&b)
                    .with_context(|| format!("parsing {}", self.path.display()))?;
                if s.version != STATE_VERSION {
                    anyhow::bail!(
                        "{} has format version {}, this poold understands {STATE_VERSION}",
                        self.path.display(),
                        s.version
                    );
                }
                Ok(s)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(State {
                version: STATE_VERSION,
                ..Default::default()
            }),
            Err(e) => Err(e).with_context(|| format!("reading {}", self.path.display())),
        }
    }

    /// Replaces the file with `state`, durably.
    pub fn save(&self, state: &State) -> Result<()> {
        let dir = self.path.parent().context("state file has no directory")?;
        forkd_vmm::private::create_dir_all(dir)?;
        let tmp = self.path.with_extension("json.tmp");
        let mut f = forkd_vmm::private::create(&tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        f.write_all(&serde_json::to_vec_pretty(state)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)
            .with_context(|| format!("replacing {}", self.path.display()))?;
        std::fs::File::open(dir)?.sync_all()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_missing_file() {
        let d = tempfile::tempdir().unwrap();
        let f = StateFile::new(d.path());
        let mut s = f.load().unwrap();
        assert_eq!(s.version, STATE_VERSION);
        s.sandboxes.insert(
            "sb-1".into(),
            SandboxRecord {
                id: "sb-1".into(),
                snapshot_tag: "py".into(),
                snapshot_id: "00".into(),
                created_at_unix: 1,
                pid: 2,
                memory_limit_mib: Some(256),
                cpus: None,
                pids_max: None,
                expires_at_unix: 0,
                hostname: "h".into(),
                branch_count: 0,
                pool_hit: true,
                spawn_ms: 5,
                net: Some(forkd_net::ChildNet {
                    netns: "forkd-sb-1".into(),
                    slot: 7,
                    host_addr: "10.201.0.29".parse().unwrap(),
                    guest_addr: "10.201.0.30".parse().unwrap(),
                }),
                ports: vec![forkd_net::proxy::PortSpec::parse("9000:80").unwrap()],
            },
        );
        f.save(&s).unwrap();
        assert_eq!(f.load().unwrap(), s);
        std::fs::write(f.path(), b"{\"version\": 99}").unwrap();
        assert!(f.load().is_err());
    }
}

/// The in-memory state and its file, with coalesced durable writes: any
/// number of concurrent changes are saved by one write, and
/// [`Persisted::commit`] returns only once a write that includes the
/// caller's change is on disk.
pub struct Persisted {
    state: std::sync::Mutex<State>,
    file: StateFile,
    /// Bumped by every change.
    changed: tokio::sync::watch::Sender<u64>,
    /// The highest change number on disk, and the last failed save (the
    /// highest change number it held, and why).
    saved: tokio::sync::watch::Sender<(u64, Option<(u64, String)>)>,
}

impl Persisted {
    /// Wraps a loaded state and starts the writer task.
    pub fn start(file: StateFile, state: State) -> std::sync::Arc<Persisted> {
        // The writer's receiver exists before any change can be sent, so
        // none is missed.
        let (changed, rx) = tokio::sync::watch::channel(0);
        let (saved, _) = tokio::sync::watch::channel((0, None));
        let p = std::sync::Arc::new(Persisted {
            state: std::sync::Mutex::new(state),
            file,
            changed,
            saved,
        });
        tokio::spawn(writer(p.clone(), rx));
        p
    }

    /// Reads the state.
    pub fn read<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self.state.lock().unwrap())
    }

    /// Changes the state in memory; returns the change number to pass to
    /// [`Persisted::durable`].
    pub fn update<T>(&self, f: impl FnOnce(&mut State) -> T) -> (T, u64) {
        let mut st = self.state.lock().unwrap();
        let out = f(&mut st);
        let mut n = 0;
        self.changed.send_modify(|c| {
            *c += 1;
            n = *c;
        });
        (out, n)
    }

    /// Waits until change `n` is on disk.
    pub async fn durable(&self, n: u64) -> Result<()> {
        let mut rx = self.saved.subscribe();
        loop {
            {
                let (done, err) = &*rx.borrow_and_update();
                if *done >= n {
                    return Ok(());
                }
                // Only a failed save that included this change fails it.
                if let Some((failed, e)) = err {
                    if *failed >= n {
                        anyhow::bail!("saving daemon state: {e}");
                    }
                }
            }
            rx.changed().await.context("state writer stopped")?;
        }
    }

    /// Changes the state and waits until the change is on disk.
    pub async fn commit<T>(&self, f: impl FnOnce(&mut State) -> T) -> Result<T> {
        let (out, n) = self.update(f);
        self.durable(n).await?;
        Ok(out)
    }
}

async fn writer(p: std::sync::Arc<Persisted>, mut rx: tokio::sync::watch::Receiver<u64>) {
    loop {
        if rx.changed().await.is_err() {
            return;
        }
        let n = *rx.borrow_and_update();
        let snapshot = p.state.lock().unwrap().clone();
        let p2 = p.clone();
        let res = tokio::task::spawn_blocking(move || p2.file.save(&snapshot)).await;
        let err = match res {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(e) => Some(e.to_string()),
        };
        if let Some(e) = &err {
            tracing::error!("saving daemon state: {e}");
        }
        p.saved.send_modify(|s| match err {
            None => s.0 = s.0.max(n),
            Some(e) => s.1 = Some((n, e)),
        });
    }
}

#[cfg(test)]
mod persisted_tests {
    use super::*;

    #[tokio::test]
    async fn commits_are_durable_when_they_return() {
        let d = tempfile::tempdir().unwrap();
        let p = Persisted::start(StateFile::new(d.path()), State::default());
        // A change made before the writer task ever ran must still be saved.
        p.commit(|s| s.version = STATE_VERSION).await.unwrap();
        let f = StateFile::new(d.path());
        assert_eq!(f.load().unwrap().version, STATE_VERSION);
        let futs: Vec<_> = (0..20)
            .map(|i| {
                let p = p.clone();
                tokio::spawn(async move {
                    p.commit(move |s| {
                        s.pools.insert(
                            format!("t{i}"),
                            PoolSpec {
                                min_ready: i,
                                max_ready: None,
                                warm: true,
                            },
                        );
                    })
                    .await
                    .unwrap()
                })
            })
            .collect();
        for f in futs {
            f.await.unwrap();
        }
        assert_eq!(StateFile::new(d.path()).load().unwrap().pools.len(), 20);
    }
}

impl From<SandboxRecord> for forkd_api::SandboxInfo {
    fn from(r: SandboxRecord) -> forkd_api::SandboxInfo {
        forkd_api::SandboxInfo {
            id: r.id,
            snapshot_tag: r.snapshot_tag,
            netns: r.net.as_ref().map(|n| n.netns.clone()),
            guest_addr: r.net.as_ref().map(|n| n.guest_addr.to_string()),
            created_at_unix: r.created_at_unix,
            pid: Some(r.pid),
            memory_limit_mib: r.memory_limit_mib,
            has_branched: r.branch_count > 0,
            last_branch_memory_path: None,
            branch_count: r.branch_count,
            snapshot_id: r.snapshot_id,
            hostname: r.hostname,
            expires_at_unix: r.expires_at_unix,
            pool_hit: r.pool_hit,
            spawn_ms: r.spawn_ms,
            cpus: r.cpus,
            pids_max: r.pids_max,
            ports: r.ports,
        }
    }
}
