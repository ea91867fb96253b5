//! poold's state: every sandbox and pooled child it owns, and the pool
//! sizes set through the API. One JSON file, `$FORKD_HOME/poold/state.json`,
//! replaced atomically (write a temp file, rename) after every change, so a
//! crash of poold at any point leaves either the old or the new state, never
//! a torn one.
//!
//! Two kinds of record, two kinds of write:
//! - *Boot-scoped*: sandboxes and pooled children. They describe QEMU
//!   processes, which die with the host, so fsync buys them nothing: a poold
//!   crash leaves the renamed file in the page cache, and after a power loss
//!   the processes are gone whatever the disk says (startup drops records
//!   whose process is dead). Changes to them alone are renamed into place
//!   without fsync; that keeps an fsync (~5 ms) off every spawn and refill.
//! - *Durable*: everything else (pool sizes, and any field added later
//!   unless `State::durable_bytes` clears it). A save that changes
//!   them is fsynced, and also written to `state.durable.json`: a power loss
//!   after later unsynced saves can leave `state.json` torn on filesystems
//!   without rename ordering, and [`StateFile::load`] then falls back to that
//!   copy (its VM records are stale after a reboot and dropped as dead).
//!
//! The QEMU processes are not tied to poold's lifetime. After a restart,
//! poold reads this file and re-adopts every VM whose QEMU still runs; VMs it
//! owned but that are not in the file (a crash between starting one and
//! recording it) are killed, since nobody could reach them.

use crate::config::PoolSpec;
use crate::token::AccessToken;
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
    /// The egress policy written into its network (docs/network.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<forkd_net::EgressPolicy>,
    /// `egress` was being written into its network when this was
    /// recorded (`crate::network::set_egress`): a poold that died then
    /// writes it again at adoption, or kills the sandbox.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub egress_pending: bool,
    /// The host folders it has mounted (its snapshot's volumes, with a
    /// spawn's rebinds applied; docs/volumes.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<forkd_vmm::Volume>,
    /// Published ports (with the host ports actually bound).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<forkd_net::proxy::PortSpec>,
    /// Id of the workspace it belongs to, if any (docs/workspaces.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    /// What front-ends keep with the sandbox (docs/design.md, "Front-end
    /// state"): key/value labels (E2B's metadata), listed back and
    /// filtered on, never interpreted.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Environment every command in it gets, under each call's own (E2B's
    /// create-time envs).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
    /// The name it was asked for by (E2B's template alias); None: its
    /// snapshot tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// The secret a front-end hands its clients to reach this sandbox
    /// (E2B's `envdAccessToken`), minted at spawn (at adoption for a
    /// record from before there were tokens).
    #[serde(default, skip_serializing_if = "AccessToken::is_empty")]
    pub access_token: AccessToken,
    /// Paused (`crate::workspace::paused`), not killed, when its TTL passes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_pause: bool,
    /// How clients may reach its guest ports by URL (E2B's `get_host`).
    #[serde(default, skip_serializing_if = "PortAccess::is_default")]
    pub port_access: PortAccess,
}

/// How a front-end lets clients reach a sandbox's guest ports by URL
/// (E2B's `get_host(port)` hosts, docs/e2b.md "Ports"): kept with the
/// sandbox like its metadata, never interpreted by the node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortAccess {
    /// The URL alone is enough (E2B's default, `allowPublicTraffic`);
    /// false: each request must carry the sandbox's access token. False
    /// unless a front-end asked: a sandbox spawned through `/v1` is
    /// never opened by its id alone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub public: bool,
    /// The `Host` the guest's server sees instead of the client's, with
    /// `${PORT}` replaced by the port (E2B's `maskRequestHost`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_host: Option<String>,
    /// Guest ports whose servers speak TLS: the front-end reaches them over
    /// TLS, accepting any certificate (E2B's `httpsPorts`), and clients
    /// see plain HTTP from it as for any other port. Sorted, distinct.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub https_ports: Vec<u16>,
}

impl PortAccess {
    /// Token required, no mask: what a sandbox has unless asked.
    pub fn is_default(&self) -> bool {
        *self == PortAccess::default()
    }
}

impl SandboxRecord {
    /// What the sandbox may reach (docs/network.md, "The effective
    /// policy"): its policy on top of this host's internal ranges and
    /// resolvers; None without a network.
    pub fn effective_egress(&self) -> Option<forkd_net::EffectivePolicy> {
        self.net.as_ref()?;
        self.egress.as_ref().map(forkd_vmm::net::effective)
    }
}

#[cfg(test)]
impl SandboxRecord {
    /// A sandbox `id` of snapshot `py`, no network, for tests.
    pub(crate) fn example(id: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            snapshot_tag: "py".into(),
            snapshot_id: "0".repeat(32),
            created_at_unix: 1,
            pid: 0,
            memory_limit_mib: None,
            cpus: None,
            pids_max: None,
            expires_at_unix: 0,
            hostname: id.into(),
            branch_count: 0,
            pool_hit: false,
            spawn_ms: 0,
            net: None,
            egress: None,
            egress_pending: false,
            volumes: Vec::new(),
            ports: Vec::new(),
            workspace: None,
            metadata: [("run".to_string(), "r1".to_string())].into(),
            envs: [("A".to_string(), "b".to_string())].into(),
            alias: Some("code-interpreter-v1".into()),
            access_token: crate::token::AccessToken::mint(),
            auto_pause: false,
            port_access: Default::default(),
        }
    }
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
    /// Workspaces by name (`workspace`).
    #[serde(default)]
    pub workspaces: BTreeMap<String, crate::workspace::record::WorkspaceRecord>,
    /// Snapshot tags deleted once no sandbox of theirs lives (the E2B
    /// fork's branch snapshots; `reaper::reclaim_unused`), with when each
    /// was marked (unix seconds). Durable: a restart keeps reclaiming.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reclaim: BTreeMap<String, u64>,
}

impl State {
    /// The durable part, serialized: what a save compares to decide
    /// whether it must fsync. Clears the records that describe processes
    /// and so die with the host boot (see the module docs); a new field is
    /// durable unless it is cleared here too.
    fn durable_bytes(&self) -> Result<Vec<u8>> {
        let mut d = self.clone();
        d.sandboxes.clear();
        d.pooled.clear();
        Ok(serde_json::to_vec(&d)?)
    }
}

/// How a save reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// Renamed into place: survives a poold crash, not a power loss.
    Rename,
    /// Also fsynced, and copied to `state.durable.json`.
    Durable,
}

/// The state file.
pub struct StateFile {
    path: PathBuf,
    durable: PathBuf,
}

impl StateFile {
    pub fn new(dir: &Path) -> StateFile {
        StateFile {
            path: dir.join("state.json"),
            durable: dir.join("state.durable.json"),
        }
    }

    #[cfg(test)]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the state; no file is an empty state. A `state.json` that
    /// does not parse (torn by a power loss) falls back to the last
    /// durable copy, with a warning.
    pub fn load(&self) -> Result<State> {
        match read_state(&self.path)? {
            Read::Found(s) => Ok(s),
            Read::Missing => match read_state(&self.durable)? {
                Read::Found(s) => Ok(s),
                Read::Missing => Ok(empty()),
                Read::Torn(e) => Err(e),
            },
            Read::Torn(e) => match read_state(&self.durable)? {
                Read::Found(s) => {
                    tracing::warn!(
                        "{e:#}; using the last durable copy, {}",
                        self.durable.display()
                    );
                    Ok(s)
                }
                _ => Err(e),
            },
        }
    }

    /// Replaces the file with `state`, atomically; with [`Sync::Durable`]
    /// also fsynced, and the durable copy with it.
    pub fn save(&self, state: &State, sync: Sync) -> Result<()> {
        let dir = self.path.parent().context("state file has no directory")?;
        forkd_vmm::private::create_dir_all(dir)?;
        let bytes = serde_json::to_vec_pretty(state)?;
        let durable = sync == Sync::Durable;
        if durable {
            replace(&self.durable, &bytes, true)?;
        }
        replace(&self.path, &bytes, durable)?;
        if durable {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    }
}

fn empty() -> State {
    State {
        version: STATE_VERSION,
        ..Default::default()
    }
}

/// What a state file held.
enum Read {
    Missing,
    /// Not JSON of the state's shape: torn by a power loss after an
    /// unsynced save.
    Torn(anyhow::Error),
    Found(State),
}

/// Reads the state in `path`. A file of another format version is an
/// error, never [`Read::Torn`]: no fallback may paper over it.
fn read_state(path: &Path) -> Result<Read> {
    let b = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Read::Missing),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    // The version first: a newer poold's file may not parse as ours.
    #[derive(Deserialize)]
    struct Version {
        version: u32,
    }
    let parsing = || format!("parsing {}", path.display());
    let v: Version = match serde_json::from_slice(&b) {
        Ok(v) => v,
        Err(e) => return Ok(Read::Torn(anyhow::Error::new(e).context(parsing()))),
    };
    if v.version != STATE_VERSION {
        anyhow::bail!(
            "{} has format version {}, this poold understands {STATE_VERSION}",
            path.display(),
            v.version
        );
    }
    Ok(match serde_json::from_slice(&b) {
        Ok(s) => Read::Found(s),
        Err(e) => Read::Torn(anyhow::Error::new(e).context(parsing())),
    })
}

/// Writes `bytes` to a temp file beside `path` and renames it over `path`.
fn replace(path: &Path, bytes: &[u8], sync: bool) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    let mut f =
        forkd_vmm::private::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(bytes)?;
    if sync {
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
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
                egress: Some(forkd_net::EgressPolicy::deny_all()),
                egress_pending: true,
                volumes: vec![forkd_vmm::Volume {
                    host_path: "/srv/vol".into(),
                    guest_path: "/data".into(),
                    read_only: true,
                }],
                ports: vec![forkd_net::proxy::PortSpec::parse("9000:80").unwrap()],
                workspace: Some("ws-0123456789abcdef".into()),
                metadata: [("run".to_string(), "r1".to_string())].into(),
                envs: [("SBX_ENV".to_string(), "from-create".to_string())].into(),
                alias: Some("code-interpreter-v1".into()),
                access_token: AccessToken::mint(),
                auto_pause: true,
                port_access: PortAccess {
                    public: true,
                    mask_host: Some("app:${PORT}".into()),
                    https_ports: vec![443, 8443],
                },
            },
        );
        f.save(&s, Sync::Durable).unwrap();
        assert_eq!(f.load().unwrap(), s);
        // Front-end state is kept; the token never shows in Debug.
        let r = &f.load().unwrap().sandboxes["sb-1"];
        assert_eq!(r.metadata["run"], "r1");
        assert_eq!(r.envs["SBX_ENV"], "from-create");
        assert!(r
            .access_token
            .matches(s.sandboxes["sb-1"].access_token.as_str().as_bytes()));
        assert!(!r.access_token.matches(b"guess"));
        assert!(!format!("{r:?}").contains(r.access_token.as_str()));
        std::fs::write(f.path(), b"{\"version\": 99}").unwrap();
        assert!(f.load().is_err());
    }

    /// A record written before front-end state existed loads with none.
    #[test]
    fn records_from_before_front_end_state_load() {
        let j = r#"{"id":"sb-1","snapshot_tag":"py","snapshot_id":"00","created_at_unix":1,"pid":2,"memory_limit_mib":null,"hostname":"h"}"#;
        let r: SandboxRecord = serde_json::from_str(j).unwrap();
        assert!(r.metadata.is_empty() && r.envs.is_empty() && r.alias.is_none());
        assert!(r.access_token.is_empty() && !r.access_token.matches(b""));
        // And writes none back.
        let back = serde_json::to_string(&r).unwrap();
        assert!(
            !back.contains("access_token") && !back.contains("metadata"),
            "{back}"
        );
    }
}

/// The in-memory state and its file, with coalesced writes: any number of
/// concurrent changes are saved by one write, and [`Persisted::commit`]
/// returns only once a write that includes the caller's change is in place
/// (fsynced when it changed a durable record; see the module docs).
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

    /// Waits until change `n` is saved.
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

    /// Changes the state and waits until the change is saved.
    pub async fn commit<T>(&self, f: impl FnOnce(&mut State) -> T) -> Result<T> {
        let (out, n) = self.update(f);
        self.durable(n).await?;
        Ok(out)
    }
}

async fn writer(p: std::sync::Arc<Persisted>, mut rx: tokio::sync::watch::Receiver<u64>) {
    // The durable part as last fsynced; None until the first save, which
    // is durable so that the fallback copy exists.
    let mut synced: Option<Vec<u8>> = None;
    loop {
        if rx.changed().await.is_err() {
            return;
        }
        let n = *rx.borrow_and_update();
        let snapshot = p.state.lock().unwrap().clone();
        let p2 = p.clone();
        let last = synced.clone();
        let res = tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
            let durable = snapshot.durable_bytes()?;
            let sync = if last.as_ref() == Some(&durable) {
                Sync::Rename
            } else {
                Sync::Durable
            };
            p2.file.save(&snapshot, sync)?;
            Ok(durable)
        })
        .await;
        let err = match res {
            Ok(Ok(durable)) => {
                synced = Some(durable);
                None
            }
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
                                warm_eval: None,
                                page_out: false,
                                keep_resident: None,
                                network: None,
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

#[cfg(test)]
mod sync_tests {
    use super::*;

    fn pool(min_ready: usize) -> PoolSpec {
        PoolSpec {
            min_ready,
            max_ready: None,
            warm: true,
            warm_eval: None,
            page_out: false,
            keep_resident: None,
            network: None,
        }
    }

    fn pooled(id: &str) -> PooledRecord {
        PooledRecord {
            vm_id: id.into(),
            tag: "py".into(),
            snapshot_id: "00".into(),
            created_at_unix: 1,
            identified: true,
        }
    }

    fn durable_copy(dir: &Path) -> State {
        match read_state(&dir.join("state.durable.json")).unwrap() {
            Read::Found(s) => s,
            _ => panic!("no durable copy"),
        }
    }

    #[tokio::test]
    async fn only_durable_changes_reach_the_durable_copy() {
        let d = tempfile::tempdir().unwrap();
        let p = Persisted::start(StateFile::new(d.path()), empty());
        p.commit(|s| s.pools.insert("py".into(), pool(2)))
            .await
            .unwrap();
        p.commit(|s| s.pooled.insert("vm-1".into(), pooled("vm-1")))
            .await
            .unwrap();
        // The pooled child is saved (a restarted poold finds it) but did
        // not cost an fsync of the durable copy.
        let f = StateFile::new(d.path());
        assert!(f.load().unwrap().pooled.contains_key("vm-1"));
        let copy = durable_copy(d.path());
        assert!(copy.pooled.is_empty());
        assert_eq!(copy.pools["py"].min_ready, 2);
        p.commit(|s| s.pools.insert("py".into(), pool(3)))
            .await
            .unwrap();
        let copy = durable_copy(d.path());
        assert_eq!(copy.pools["py"].min_ready, 3);
        assert!(copy.pooled.contains_key("vm-1"));
    }

    #[tokio::test]
    async fn a_torn_state_file_falls_back_to_the_durable_copy() {
        let d = tempfile::tempdir().unwrap();
        let p = Persisted::start(StateFile::new(d.path()), empty());
        p.commit(|s| s.pools.insert("py".into(), pool(4)))
            .await
            .unwrap();
        p.commit(|s| s.pooled.insert("vm-1".into(), pooled("vm-1")))
            .await
            .unwrap();
        let f = StateFile::new(d.path());
        // What a power loss can leave of an unsynced rename.
        std::fs::write(f.path(), b"").unwrap();
        let s = f.load().unwrap();
        assert_eq!(s.pools["py"].min_ready, 4);
        // A state from a newer poold is refused, never papered over.
        std::fs::write(f.path(), b"{\"version\": 99}").unwrap();
        let e = f.load().unwrap_err();
        assert!(format!("{e:#}").contains("format version 99"), "{e:#}");
    }
}
