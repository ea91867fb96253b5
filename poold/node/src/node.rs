//! The node: what every operation and background task of one data dir
//! shares. Fields are crate-private: front-ends reach the node only
//! through its operations (`api`), never its tables.
//!
//! Invariants:
//! - one node per data dir: [`InstanceLock`] holds `poold/poold.lock` for
//!   the node's lifetime;
//! - live sandboxes plus spawns in flight never exceed `max_sandboxes`
//!   ([`Node::reserve`]);
//! - a tag is written (created, branched into, compacted into) by one
//!   operation at a time ([`Node::claim_tag`]);
//! - new work that makes the host hold more is refused under the memory
//!   and disk floors ([`Node::check_headroom`], `admission`).

use crate::admission;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::pool::Pools;
use crate::sandbox::{Sandbox, Sandboxes};
use crate::state::{Persisted, State, StateFile};
use anyhow::Context;
use forkd_snapshot::Paths;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, Semaphore};

/// Everything the node shares across operations and background tasks.
pub struct Node {
    pub(crate) paths: Paths,
    pub(crate) cfg: Config,
    /// The forkd-fs mount point.
    pub(crate) mount: PathBuf,
    pub(crate) state: Arc<Persisted>,
    pub(crate) sandboxes: Sandboxes,
    pub(crate) pools: Pools,
    pub(crate) metrics: Metrics,
    /// A read view of the store (catch up before reads).
    reader: Mutex<forkd_layers::StoreReader>,
    /// Wakes the refill loop.
    pub(crate) refill_wake: Notify,
    /// Wakes the store GC loop (after a snapshot delete).
    pub(crate) gc_wake: Notify,
    /// Wakes `reaper::reclaim_loop` when a snapshot is marked.
    pub(crate) reclaim_wake: Notify,
    /// Wakes `mount_watch::watch_loop` (an operation met ENOTCONN).
    pub(crate) mount_wake: Notify,
    /// What `mount_watch` last found.
    pub(crate) mount_health: Mutex<crate::mount_watch::MountHealth>,
    /// The forkd-fs holder's connection and arena, kept so a new holder
    /// can adopt them when it dies (`mount_watch`).
    pub(crate) keeper: Mutex<Option<forkd_fs::keeper::Kept>>,
    pub(crate) refill_slots: Arc<Semaphore>,
    pub(crate) branch_slots: Arc<Semaphore>,
    /// One permit per snapshot creation in flight (`snapshot_concurrency`).
    pub(crate) snapshot_slots: Arc<Semaphore>,
    /// Tags being written (snapshot creates, branches, compactions).
    writing: Mutex<HashSet<String>>,
    /// The cgroup controllers, when the host has any.
    pub(crate) cgroups: Option<forkd_vmm::Hierarchy>,
    /// What sandboxes run under, resolved once at start (`FORKD_ACCEL`);
    /// snapshots created through the node use it.
    pub(crate) accel: forkd_vmm::Accel,
    /// Sandboxes being spawned (counted against `max_sandboxes`).
    reserved: AtomicUsize,
    /// `node_name`'s token, minted into every id ([`Node::new_id`]).
    id_token: Option<String>,
    /// The hub snapshots come from and go to, once poold attaches one
    /// (`hub`).
    hub: std::sync::OnceLock<Arc<dyn crate::hub::SnapshotHub>>,
    /// Held by the one hub fetch in flight (`hub::ensure_local`).
    pub(crate) hub_fetch: tokio::sync::Mutex<()>,
    _lock: InstanceLock,
}

impl Node {
    /// The node's hub, if poold attached one.
    pub(crate) fn hub(&self) -> Option<Arc<dyn crate::hub::SnapshotHub>> {
        self.hub.get().cloned()
    }

    /// Attaches the hub (once; a second is refused).
    pub(crate) fn set_hub(&self, hub: Arc<dyn crate::hub::SnapshotHub>) -> Result<()> {
        self.hub
            .set(hub)
            .map_err(|_| Error::internal("the node already has a hub"))
    }

    /// A new sandbox or VM id: `sb-` + 24 hex digits, unguessable, with
    /// this node's token in front when it has a name
    /// ([`forkd_api::ids::mint_id`]).
    pub(crate) fn new_id(&self) -> String {
        forkd_api::ids::mint_id(
            self.id_token.as_deref(),
            &forkd_snapshot::random_hex(forkd_api::ids::ID_HEX_DIGITS / 2),
        )
    }

    /// The configured default limits this host can enforce (a default the
    /// host lacks a controller for is dropped, with a warning at start).
    pub(crate) fn default_limits(&self) -> forkd_vmm::Limits {
        let mut l = self.cfg.default_limits();
        let has = |c| self.cgroups.as_ref().is_some_and(|h| h.supports(c));
        if !has(forkd_vmm::Controller::Memory) {
            l.memory_mib = None;
        }
        if !has(forkd_vmm::Controller::Cpu) {
            l.cpus = None;
        }
        if !has(forkd_vmm::Controller::Pids) {
            l.pids_max = None;
        }
        l
    }

    /// Runs `f` on the store's read view after catching up with writers.
    pub(crate) fn with_reader<T>(
        &self,
        f: impl FnOnce(&forkd_layers::StoreView) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let r = self.reader.lock().unwrap();
        r.catch_up().context("catching up with the layer store")?;
        f(&r)
    }

    /// [`Node::with_reader`] on a blocking thread: for reads that walk
    /// many records (listings, chain diffs), so they never stall the async
    /// workers.
    pub(crate) async fn read<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&forkd_layers::StoreView) -> anyhow::Result<T> + Send + 'static,
    ) -> Result<T> {
        let n = self.clone();
        Ok(tokio::task::spawn_blocking(move || n.with_reader(f))
            .await
            .context("store read task")??)
    }

    /// The live sandbox `id`, or [`Error::NotFound`].
    pub(crate) fn sandbox(&self, id: &str) -> Result<Arc<Sandbox>> {
        self.sandboxes.find(id)
    }

    /// Reserves room for `n` more sandboxes (live ones and spawns in flight
    /// count against `max_sandboxes`), or [`Error::AtCapacity`].
    pub(crate) fn reserve(self: &Arc<Self>, n: usize) -> Result<Reservation> {
        let mut cur = self.reserved.load(Ordering::SeqCst);
        loop {
            let live = self.sandboxes.len();
            if live + cur + n > self.cfg.max_sandboxes {
                return Err(Error::AtCapacity(format!(
                    "at capacity: {live} sandboxes live and {cur} being spawned, max_sandboxes is {}; delete sandboxes or raise max_sandboxes",
                    self.cfg.max_sandboxes
                )));
            }
            match self
                .reserved
                .compare_exchange(cur, cur + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    return Ok(Reservation {
                        n: self.clone(),
                        count: n,
                    })
                }
                Err(now) => cur = now,
            }
        }
    }

    /// [`Error::Unavailable`] when the host is under its memory or disk
    /// floor (`admission`): called before `what` starts anything new.
    pub(crate) fn check_headroom(&self, what: &str) -> Result<()> {
        let h = admission::Headroom::now(&self.paths.home);
        match h.refusal(
            what,
            self.cfg.min_free_memory_mib,
            self.cfg.min_free_disk_mib,
        ) {
            Some(why) => Err(Error::Unavailable(why)),
            None => Ok(()),
        }
    }

    /// Claims `tag` for a write (create, branch, compaction); `None` if it
    /// is taken.
    pub(crate) fn claim_tag(self: &Arc<Self>, tag: &str) -> Option<TagClaim> {
        let mut w = self.writing.lock().unwrap();
        if !w.insert(tag.to_string()) {
            return None;
        }
        Some(TagClaim {
            n: self.clone(),
            tag: tag.to_string(),
        })
    }

    /// Sets the pool gauges from the pools' status.
    pub(crate) fn update_pool_gauges(&self) {
        for p in self.pools.status() {
            self.metrics
                .pool_ready
                .with_label_values(&[&p.tag])
                .set(p.ready as i64);
            self.metrics
                .pool_in_flight
                .with_label_values(&[&p.tag])
                .set(p.in_flight as i64);
        }
    }

    /// The tags being written now.
    pub(crate) fn writing(&self) -> Vec<String> {
        self.writing.lock().unwrap().iter().cloned().collect()
    }
}

/// Room for sandboxes being spawned; released on drop.
pub(crate) struct Reservation {
    n: Arc<Node>,
    count: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.n.reserved.fetch_sub(self.count, Ordering::SeqCst);
    }
}

/// A tag being written; released on drop.
pub(crate) struct TagClaim {
    n: Arc<Node>,
    tag: String,
}

impl Drop for TagClaim {
    fn drop(&mut self) {
        self.n.writing.lock().unwrap().remove(&self.tag);
    }
}

/// Holds the node's lock file for its lifetime: one node per data dir.
pub struct InstanceLock {
    _flock: nix::fcntl::Flock<std::fs::File>,
}

impl InstanceLock {
    /// Takes `poold/poold.lock` of `paths`, or says which poold holds it.
    pub fn acquire(paths: &Paths) -> anyhow::Result<InstanceLock> {
        let dir = paths.poold_dir();
        forkd_vmm::private::create_dir_all(&dir)?;
        let p = dir.join("poold.lock");
        let f = forkd_vmm::private::open_append(&p)
            .with_context(|| format!("opening {}", p.display()))?;
        let flock = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| {
                anyhow::anyhow!(
                    "another poold already runs on {} ({}: {e}); stop it first",
                    paths.home.display(),
                    p.display()
                )
            })?;
        Ok(InstanceLock { _flock: flock })
    }
}

/// Builds the node of `paths`: takes the data dir's lock, checks the host,
/// mounts the store, opens its read view and loads the saved state (which
/// it returns, for adoption). Nothing is adopted and no background task
/// runs yet.
pub(crate) async fn build(paths: Paths, cfg: Config) -> anyhow::Result<(Node, State)> {
    let lock = InstanceLock::acquire(&paths)?;
    cfg.validate()?;
    forkd_vmm::check_qemu()?;
    // Only root may enter the data dir: snapshots' memory, children's
    // disks and the daemon's state are nobody else's (docs/security.md).
    // Jailed VMs reach their files through binds, not through this path.
    std::fs::create_dir_all(&paths.home)
        .and_then(|()| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&paths.home, std::fs::Permissions::from_mode(0o700))
        })
        .with_context(|| format!("making the data dir {} private", paths.home.display()))?;
    let accel = forkd_vmm::AccelChoice::from_env()
        .and_then(|a| a.resolve())
        .context("choosing the accelerator (FORKD_ACCEL)")?;
    if accel == forkd_vmm::Accel::Tcg {
        tracing::warn!(
            "sandboxes run under TCG (software emulation, no hardware virtualization): \
             guest code is translated and run inside the QEMU process, a large attack surface, \
             and the VM jail is the only boundary left; use a host with KVM for untrusted code \
             (see docs/security.md, \"KVM and TCG\")"
        );
    }
    let mount = forkd_snapshot::ensure_mount_async(&paths).await?.mountpoint;
    assemble(paths, cfg, mount, accel, lock).await
}

/// The node's tables and caps over a data dir whose store is mounted at
/// `mount`, with its saved state loaded (and returned).
async fn assemble(
    paths: Paths,
    cfg: Config,
    mount: PathBuf,
    accel: forkd_vmm::Accel,
    lock: InstanceLock,
) -> anyhow::Result<(Node, State)> {
    let reader = {
        let p = paths.clone();
        tokio::task::spawn_blocking(move || {
            forkd_snapshot::store::open_reader(&p, p.poold_dir().join("store.secondary"))
        })
        .await??
    };
    let file = StateFile::new(&paths.poold_dir());
    let saved = file.load()?;
    let node = Node {
        metrics: Metrics::new(cfg.branch_concurrency),
        refill_slots: Arc::new(Semaphore::new(cfg.refill_concurrency)),
        branch_slots: Arc::new(Semaphore::new(cfg.branch_concurrency)),
        snapshot_slots: Arc::new(Semaphore::new(cfg.snapshot_concurrency)),
        cgroups: forkd_vmm::Hierarchy::detect().ok(),
        state: Persisted::start(file, saved.clone()),
        paths,
        mount,
        sandboxes: Default::default(),
        pools: Default::default(),
        reader: Mutex::new(reader),
        refill_wake: Notify::new(),
        gc_wake: Notify::new(),
        reclaim_wake: Notify::new(),
        mount_wake: Notify::new(),
        mount_health: Mutex::new(crate::mount_watch::MountHealth {
            ok: true,
            ..Default::default()
        }),
        keeper: Mutex::new(None),
        writing: Mutex::new(HashSet::new()),
        reserved: Default::default(),
        id_token: cfg.node_name.as_deref().map(forkd_api::ids::node_token),
        hub: std::sync::OnceLock::new(),
        hub_fetch: tokio::sync::Mutex::new(()),
        accel,
        cfg,
        _lock: lock,
    };
    Ok((node, saved))
}

/// A node over a fresh data dir in `dir` without QEMU, a mount or any VM:
/// for unit tests of the operations' rules (validation, lookups, state).
#[cfg(test)]
pub(crate) async fn for_tests(dir: &std::path::Path) -> Arc<Node> {
    let paths = Paths::new(dir);
    let lock = InstanceLock::acquire(&paths).unwrap();
    let mount = dir.join("mnt");
    std::fs::create_dir_all(&mount).unwrap();
    let cfg = Config {
        // Admission reads the real host: no floor, so tests never depend on it.
        min_free_memory_mib: 0,
        min_free_disk_mib: 0,
        ..Config::default()
    };
    let (node, _) = assemble(paths, cfg, mount, forkd_vmm::Accel::Tcg, lock)
        .await
        .unwrap();
    Arc::new(node)
}
