//! poold, the daemon: forkd's `/v1` REST API over snapshots and sandboxes,
//! warm pools of paused children, auth/audit/metrics, and state that
//! survives a restart (docs/poold.md).
//!
//! - [`config`]: the TOML config and its defaults;
//! - [`state`]: the durable record of sandboxes, pooled children and pools;
//! - [`sandbox`], [`pool`]: live handles;
//! - [`lifecycle`]: spawn, destroy, refill, adopt after a restart, TTLs;
//! - [`api`]: the HTTP routes; [`server`]: listeners, auth and audit;
//!   [`tls`]: HTTPS on the TCP listener;
//!   [`hosts`]: DNS-rebinding protection (the `Host` check);
//! - [`cgroup`]: memory limits; [`metrics`]: Prometheus;
//! - [`e2b`]: the E2B API on listeners of its own (docs/e2b.md);
//! - [`workspace`]: named sandboxes that suspend and resume.

pub mod admission;
pub mod api;
pub mod audit;
pub mod cli;
pub mod config;
pub mod e2b;
pub mod error;
pub mod hosts;
pub mod lifecycle;
pub mod metrics;
pub mod pool;
pub mod sandbox;
pub mod server;
pub mod state;
pub mod tls;
pub mod transfers;
pub mod volumes;
pub mod workspace;

use anyhow::{Context, Result};
use config::Config;
use forkd_snapshot::Paths;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, Semaphore};

/// Everything the daemon shares across requests and background tasks.
pub struct Daemon {
    pub paths: Paths,
    pub cfg: Config,
    /// The forkd-fs mount point.
    pub mount: PathBuf,
    pub state: Arc<state::Persisted>,
    pub sandboxes: sandbox::Sandboxes,
    pub pools: pool::Pools,
    pub metrics: metrics::Metrics,
    /// A read view of the store (catch up before reads).
    reader: Mutex<forkd_layers::StoreReader>,
    /// Wakes the refill loop.
    pub refill_wake: Notify,
    /// Wakes the store GC loop (after a snapshot delete).
    pub gc_wake: Notify,
    pub refill_slots: Arc<Semaphore>,
    pub branch_slots: Arc<Semaphore>,
    /// One permit per snapshot creation in flight (`snapshot_concurrency`).
    pub snapshot_slots: Arc<Semaphore>,
    /// One permit per large request in flight (`daemon::transfers`).
    pub transfer_slots: Arc<Semaphore>,
    /// Tags being written (snapshot creates and branches), for 409s.
    pub writing: Mutex<HashSet<String>>,
    /// The cgroup controllers, when the host has any.
    pub cgroups: Option<forkd_vmm::Hierarchy>,
    pub audit: audit::AuditLog,
    /// Bearer token, when auth is on.
    pub token: Option<String>,
    /// What sandboxes run under, resolved once at start (`FORKD_ACCEL`);
    /// snapshots created through the API use it, `GET /version` reports it.
    pub accel: forkd_vmm::Accel,
    /// Sandboxes being spawned (counted against `max_sandboxes`).
    reserved: std::sync::atomic::AtomicUsize,
}

impl Daemon {
    /// The configured default limits this host can enforce (a default the
    /// host lacks a controller for is dropped, with a warning at start).
    pub fn default_limits(&self) -> forkd_vmm::Limits {
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
    pub fn with_reader<T>(
        &self,
        f: impl FnOnce(&forkd_layers::StoreView) -> Result<T>,
    ) -> Result<T> {
        let r = self.reader.lock().unwrap();
        r.catch_up().context("catching up with the layer store")?;
        f(&r)
    }

    /// Reserves room for `n` more sandboxes (live ones and spawns in flight
    /// count against `max_sandboxes`), or answers 503.
    pub fn reserve(self: &Arc<Self>, n: usize) -> error::ApiResult<Reservation> {
        use std::sync::atomic::Ordering;
        let mut cur = self.reserved.load(Ordering::SeqCst);
        loop {
            let live = self.sandboxes.len();
            if live + cur + n > self.cfg.max_sandboxes {
                return Err(error::ApiError::unavailable(format!(
                    "at capacity: {live} sandboxes live and {cur} being spawned, max_sandboxes is {}; delete sandboxes or raise max_sandboxes",
                    self.cfg.max_sandboxes
                )));
            }
            match self
                .reserved
                .compare_exchange(cur, cur + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok(Reservation { d: self.clone(), n }),
                Err(now) => cur = now,
            }
        }
    }

    /// 503 when the host is under its memory or disk floor
    /// (`daemon::admission`): called before `what` starts anything new.
    pub fn check_headroom(&self, what: &str) -> error::ApiResult<()> {
        let h = admission::Headroom::now(&self.paths.home);
        match h.refusal(
            what,
            self.cfg.min_free_memory_mib,
            self.cfg.min_free_disk_mib,
        ) {
            Some(why) => Err(error::ApiError::unavailable(why)),
            None => Ok(()),
        }
    }

    /// [`Daemon::with_reader`] on a blocking thread: for reads that walk
    /// many records (listings, chain diffs), so they never stall the async
    /// workers.
    pub async fn read<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&forkd_layers::StoreView) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let d = self.clone();
        tokio::task::spawn_blocking(move || d.with_reader(f))
            .await
            .context("store read task")?
    }

    /// Claims `tag` for a write (create or branch); `None` if it is taken.
    pub fn claim_tag(self: &Arc<Self>, tag: &str) -> Option<TagClaim> {
        let mut w = self.writing.lock().unwrap();
        if !w.insert(tag.to_string()) {
            return None;
        }
        Some(TagClaim {
            d: self.clone(),
            tag: tag.to_string(),
        })
    }
}

/// Room for sandboxes being spawned; released on drop.
pub struct Reservation {
    d: Arc<Daemon>,
    n: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.d
            .reserved
            .fetch_sub(self.n, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A tag being written; released on drop.
pub struct TagClaim {
    d: Arc<Daemon>,
    tag: String,
}

impl Drop for TagClaim {
    fn drop(&mut self) {
        self.d.writing.lock().unwrap().remove(&self.tag);
    }
}

/// Holds the daemon's lock file for its lifetime: one poold per data dir.
pub struct InstanceLock {
    _flock: nix::fcntl::Flock<std::fs::File>,
}

impl InstanceLock {
    pub fn acquire(paths: &Paths) -> Result<InstanceLock> {
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

/// Builds the daemon: checks the host, mounts the store, loads and adopts
/// the saved state. Background tasks are not started yet.
pub async fn open(paths: Paths, cfg: Config) -> Result<Arc<Daemon>> {
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
    let token = match &cfg.token_file {
        Some(f) => {
            let t = forkd_hub::auth::read_token_file(f)?;
            forkd_hub::auth::check_token(&t)?;
            Some(t)
        }
        None => None,
    };
    cfg.e2b.validate(token.is_some())?;
    if token.is_none() && cfg.unix.is_none() && !cfg.bind_addr()?.ip().is_loopback() {
        anyhow::bail!(
            "refusing to listen on non-loopback address {} without a token: set token_file (--token-file) or bind 127.0.0.1",
            cfg.bind
        );
    }
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
    let reader = {
        let p = paths.clone();
        tokio::task::spawn_blocking(move || {
            forkd_snapshot::store::open_reader(&p, p.poold_dir().join("store.secondary"))
        })
        .await??
    };
    let file = state::StateFile::new(&paths.poold_dir());
    let saved = file.load()?;
    let audit_path = cfg
        .audit_log
        .clone()
        .unwrap_or_else(|| paths.poold_dir().join("audit.jsonl"));
    let d = Arc::new(Daemon {
        metrics: metrics::Metrics::new(cfg.branch_concurrency),
        refill_slots: Arc::new(Semaphore::new(cfg.refill_concurrency)),
        branch_slots: Arc::new(Semaphore::new(cfg.branch_concurrency)),
        snapshot_slots: Arc::new(Semaphore::new(cfg.snapshot_concurrency)),
        transfer_slots: Arc::new(Semaphore::new(cfg.transfer_concurrency)),
        cgroups: forkd_vmm::Hierarchy::detect().ok(),
        audit: audit::AuditLog::open(&audit_path)?,
        state: state::Persisted::start(file, saved.clone()),
        paths,
        mount,
        sandboxes: Default::default(),
        pools: Default::default(),
        reader: Mutex::new(reader),
        refill_wake: Notify::new(),
        gc_wake: Notify::new(),
        writing: Mutex::new(HashSet::new()),
        reserved: Default::default(),
        token,
        accel,
        cfg,
    });
    // Pools set through the API override the config file's.
    for (tag, spec) in d.cfg.pools.iter().chain(saved.pools.iter()) {
        d.pools.set(tag, (spec.max() > 0).then_some(spec.clone()));
    }
    forkd_vmm::net::configure(d.cfg.net.range, d.cfg.net.egress.clone());
    forkd_vmm::net::configure_internal(d.cfg.internal_ranges()?);
    forkd_snapshot::ca::configure(d.cfg.guest_ca()?);
    if let Err(e) = forkd_vmm::net::ensure_host().await {
        // Snapshots without a NIC still work; networked spawns will fail
        // with the same cause.
        tracing::warn!("child networking is unavailable: {e:#}");
    }
    lifecycle::adopt_all(&d, saved).await?;
    workspace::reconcile(&d).await?;
    Ok(d)
}

/// Runs poold until SIGINT/SIGTERM. Sandboxes keep running after it exits;
/// the next start re-adopts them.
pub async fn run(paths: Paths, cfg: Config) -> Result<()> {
    let _lock = InstanceLock::acquire(&paths)?;
    let d = open(paths, cfg).await?;
    let e2b = e2b::bind(&d).await?;
    lifecycle::start_background(&d);
    let banner = e2b.as_ref().map(e2b::Bound::banner);
    match e2b {
        Some(b) => tokio::try_join!(server::serve(d, banner), b.serve()).map(|_| ()),
        None => server::serve(d, None).await,
    }
}
