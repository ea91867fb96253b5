//! Sandbox lifecycle: spawning (pool hits first, restores for the rest),
//! destroying, background pool refills, TTL expiry, and re-adopting
//! everything after a restart.

use super::error::{ApiError, ApiResult};
use super::pool::{PooledVm, RefillTicket, Residency};
use super::sandbox::Sandbox;
use super::state::{PooledRecord, SandboxRecord, State};
use super::Daemon;
use forkd_snapshot::ca::CaBundle;
use forkd_snapshot::restore::{hand_out, restore_paused_with, ChildTimings, Identity, Source};
use forkd_snapshot::unix_now;
use forkd_vmm::{Hierarchy, Limits};
use forkd_vmm::{Lifetime, Vm, VmDir};
use futures::stream::{self, StreamExt};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest TTL a spawn may ask for (10 years).
pub const MAX_TTL_SECS: u64 = 10 * 365 * 24 * 3600;

/// A new sandbox or VM id: `sb-` + 24 random hex digits (unguessable).
pub fn new_id() -> String {
    format!("sb-{}", forkd_snapshot::random_hex(12))
}

/// What a spawn asks for.
#[derive(Debug, Clone, Default)]
pub struct SpawnRequest {
    pub tag: String,
    pub n: usize,
    pub memory_limit_mib: Option<u64>,
    pub cpus: Option<f64>,
    pub pids_max: Option<u64>,
    pub ttl_secs: Option<u64>,
    /// forkd's per-child network namespace: every child of a networked
    /// snapshot has one; asking for it from a snapshot without a NIC is a 400.
    pub per_child_netns: bool,
    /// false: no way out (deny-all); true: must be a networked snapshot.
    pub net: Option<bool>,
    /// The egress policy (None: the config's default).
    pub network: Option<forkd_net::EgressPolicy>,
    /// Guest ports to publish on the host.
    pub ports: Vec<forkd_net::proxy::PortSpec>,
    /// Host folders rebinding the snapshot's volumes (docs/volumes.md).
    pub volumes: Vec<forkd_api::VolumeSpec>,
    /// The workspace the sandbox is spawned for (recorded in it, so a
    /// restart can tell whose it is).
    pub workspace: Option<String>,
    /// Extra CA certificates (PEM) the children trust, besides the
    /// config's `ca_certs_file` (docs/network.md).
    pub ca_certs: Option<String>,
}

impl SpawnRequest {
    /// Every check of a spawn request that needs nothing but the request
    /// and whether this host can limit memory (`has_cgroups`): the one
    /// place spawn input is validated, in forkd's order. Whether the
    /// snapshot exists and the daemon has room is checked by [`spawn`].
    /// Returns the limits the sandboxes get (the request's, with the
    /// daemon's `defaults` filling the rest).
    pub fn validate(&self, cgroups: Option<&Hierarchy>, defaults: Limits) -> ApiResult<Limits> {
        super::error::check_tag(&self.tag)?;
        if let Some(p) = &self.network {
            p.validate()
                .map_err(|e| ApiError::bad_request(format!("network: {e}")))?;
            if self.net == Some(false) {
                return Err(ApiError::bad_request(
                    "network: an egress policy with net: false; drop one of them",
                ));
            }
        }
        if self.ports.len() > 64 {
            return Err(ApiError::bad_request("ports: at most 64 per sandbox"));
        }
        for p in &self.ports {
            p.validate()
                .map_err(|e| ApiError::bad_request(format!("{e}")))?;
        }
        if self.n > 1 && self.ports.iter().any(|p| p.host_port != 0) {
            return Err(ApiError::bad_request(
                "ports: a fixed host_port with n > 1 would be bound twice; leave host_port out (any free port) or spawn one at a time",
            ));
        }
        if self.n == 0 {
            return Err(ApiError::bad_request("n must be ≥ 1"));
        }
        if self.n > 1000 {
            return Err(ApiError::bad_request("n must be ≤ 1000 (sanity cap)"));
        }
        let limits = self.limits(defaults);
        limits
            .validate()
            .and_then(|()| Hierarchy::check(cgroups, &limits))
            .map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
        if self.ttl_secs.is_some_and(|t| t > MAX_TTL_SECS) {
            return Err(ApiError::bad_request(format!(
                "ttl_secs must be at most {MAX_TTL_SECS} (10 years); leave it out for no TTL"
            )));
        }
        Ok(limits)
    }
}

impl SpawnRequest {
    /// The CA certificates asked for, checked (a 400 says what is wrong).
    pub fn ca(&self) -> ApiResult<Option<forkd_snapshot::ca::CaBundle>> {
        self.ca_certs
            .as_deref()
            .map(|t| forkd_snapshot::ca::CaBundle::parse(t, "ca_certs"))
            .transpose()
            .map_err(|e| ApiError::bad_request(e.to_string()))
    }

    /// Checks the network fields against the snapshot (`has_nic`): a
    /// request for a network from a snapshot without a NIC is a 400.
    /// Returns the egress policy the children get (None: no network): the
    /// request's, else the pool's (`pool_default`), else the config's.
    pub fn egress(
        &self,
        has_nic: bool,
        pool_default: Option<forkd_net::EgressPolicy>,
    ) -> ApiResult<Option<forkd_net::EgressPolicy>> {
        let wants = self.per_child_netns
            || self.net == Some(true)
            || self.network.is_some()
            || !self.ports.is_empty();
        if !has_nic {
            if wants {
                return Err(ApiError::bad_request(
                    "this snapshot's guest has no network device: take it with `forkd snapshot create --net` (or \"net\": true) to give its children a network; without one, reach sandboxes through exec, eval and files",
                ));
            }
            return Ok(None);
        }
        Ok(Some(match (&self.network, self.net) {
            (_, Some(false)) => forkd_net::EgressPolicy::deny_all(),
            (Some(p), _) => p.clone(),
            (None, _) => pool_default.unwrap_or_else(forkd_vmm::net::default_egress),
        }))
    }

    /// The limits asked for, with the daemon's defaults filling the rest.
    pub fn limits(&self, defaults: Limits) -> Limits {
        Limits {
            memory_mib: self.memory_limit_mib,
            cpus: self.cpus,
            pids_max: self.pids_max,
        }
        .or(defaults)
    }
}

/// Resolves a tag to a restorable snapshot: 404 when unknown, 409 when it
/// cannot be restored here (mismatched QEMU, missing files). Reads the
/// forkd-fs mount, so on a blocking thread (a mount whose worker is being
/// replaced answers only once the new one serves).
pub async fn source(d: &Daemon, tag: &str) -> ApiResult<Source> {
    super::error::check_tag(tag)?;
    let (mount, tag) = (d.mount.clone(), tag.to_string());
    // Both fail with a typed `SnapshotError`; `from_anyhow` picks the status.
    tokio::task::spawn_blocking(move || {
        forkd_snapshot::restore::read_record(&mount, &tag).and_then(|rec| Source::new(&mount, &rec))
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(ApiError::from_anyhow)
}

/// Spawns `req.n` sandboxes (after [`SpawnRequest::validate`]): ready pool children are resumed first, the
/// rest restored on demand; returns once every child's agent answered. On
/// any failure every child of this request is destroyed.
pub async fn spawn(d: &Arc<Daemon>, req: SpawnRequest) -> ApiResult<Vec<SandboxRecord>> {
    let t0 = Instant::now();
    let limits = req.validate(d.cgroups.as_ref(), d.default_limits())?;
    let ca = req.ca()?;
    let rebind = super::volumes::accept(&d.cfg.volume_roots, &req.volumes)?;
    let src = source(d, &req.tag).await?;
    let source_ms = t0.elapsed().as_secs_f64() * 1e3;
    let volumes = child_volumes(d, &src, &rebind)?;
    let pool_egress = d.pools.spec(&req.tag).and_then(|s| s.network);
    let egress = req.egress(src.config.machine.net, pool_egress)?;
    if let Some(p) = &egress {
        // Names that do not resolve are the caller's error, before any VM.
        p.resolve()
            .await
            .map_err(|e| ApiError::bad_request(format!("network: {e}")))?;
    }
    let _reserved = d.reserve(req.n)?;
    d.check_headroom("spawn")?;
    let sid = src.id.to_string();
    // Pooled children have the snapshot's folders: a rebind restores anew.
    let (hits, stale) = if rebind.is_empty() {
        d.pools.take(&req.tag, &sid, req.n)
    } else {
        (Vec::new(), Vec::new())
    };
    let n_hits = hits.len();
    d.metrics
        .pool_hits
        .with_label_values(&[&req.tag])
        .inc_by(n_hits as u64);
    d.metrics
        .pool_misses
        .with_label_values(&[&req.tag])
        .inc_by((req.n - n_hits) as u64);
    discard_pooled(d, stale);
    // Before any refill can park: its child then counts the page-in.
    start_page_ins(d);
    d.refill_wake.notify_one();

    // The hits keep their pool records until the one commit below that
    // records the sandboxes: a crash in between leaves them listed as
    // pooled, and the next start parks again only those still paused (never
    // resumed); one that has run is destroyed (`adopt_all`). One durable
    // write per spawn instead of two: each costs an fsync.
    let hit_ids: Vec<String> = hits.iter().map(|h| h.record.vm_id.clone()).collect();
    let result = spawn_hits_and_misses(
        d,
        &req,
        (&src, &volumes),
        hits,
        (egress.as_ref(), ca.as_ref()),
        &limits,
        t0,
    )
    .await;
    let (out, made) = match result {
        Ok(x) => x,
        Err(e) => {
            forget_pooled(d, hit_ids).await;
            return Err(e);
        }
    };
    let handed_ms = t0.elapsed().as_secs_f64() * 1e3;
    let records = out.clone();
    let committed = d
        .state
        .commit(move |s| {
            for id in &hit_ids {
                s.pooled.remove(id);
            }
            for r in records {
                s.sandboxes.insert(r.id.clone(), r);
            }
        })
        .await;
    for sb in &made {
        d.sandboxes.insert(sb.clone());
    }
    d.metrics.sandboxes.set(d.sandboxes.len() as i64);
    tracing::debug!(
        n = req.n,
        hits = n_hits,
        source_ms,
        handed_ms,
        committed_ms = t0.elapsed().as_secs_f64() * 1e3,
        "spawn phases"
    );
    if let Err(e) = committed {
        for sb in made {
            destroy(d, &sb.id).await;
        }
        return Err(ApiError::from_anyhow(e));
    }
    Ok(out)
}

/// Removes the pool records of children taken by a spawn that failed
/// (they were destroyed, or became sandboxes that were).
async fn forget_pooled(d: &Arc<Daemon>, ids: Vec<String>) {
    if ids.is_empty() {
        return;
    }
    if let Err(e) = d
        .state
        .commit(move |s| {
            for id in &ids {
                s.pooled.remove(id);
            }
        })
        .await
    {
        tracing::error!("{e:#}");
    }
}

/// Hands out the pool `hits` and restores the rest of `req.n` on demand;
/// on success, the new sandboxes (not yet recorded or listed), else
/// nothing is left of any of them.
/// `child`: the snapshot and the folders its restored children get.
async fn spawn_hits_and_misses(
    d: &Arc<Daemon>,
    req: &SpawnRequest,
    child: (&Source, &[forkd_vmm::Volume]),
    hits: Vec<PooledVm>,
    (egress, ca): (Option<&forkd_net::EgressPolicy>, Option<&CaBundle>),
    limits: &Limits,
    t0: Instant,
) -> ApiResult<(Vec<SandboxRecord>, Vec<Arc<Sandbox>>)> {
    let (src, volumes) = child;
    let n_hits = hits.len();
    let sid = src.id.to_string();
    let limits = *limits;
    // Hand-outs are bounded too: resuming a hundred children at once makes
    // them all crawl (each first request is CPU-bound, under TCG doubly so);
    // a few at a time finishes every one of them sooner.
    let handout_parallel = std::thread::available_parallelism().map_or(2, |n| n.get()) * 2;
    let handed = stream::iter(hits.into_iter().map(|h| {
        let src = src.clone();
        async move {
            let mut t = ChildTimings::default();
            let mut vm = h.vm;
            let id = vm.id.clone();
            let identity = if h.record.identified {
                Identity::Given
            } else {
                Identity::Bare
            };
            let handed = async {
                confine(d, &vm, &limits)?;
                hand_out(&mut vm, &id, identity, egress, ca, t0, &mut t).await
            };
            match handed.await {
                Ok(()) => {
                    tracing::debug!(
                        id,
                        resumed_ms = t.resumed_ms,
                        ready_ms = t.ready_ms,
                        "pool hit handed out"
                    );
                    Ok((vm, t, true))
                }
                Err(e) => {
                    // A pooled child that died while parked: restore a
                    // replacement rather than fail the spawn.
                    tracing::warn!(
                        "pooled child {id} failed at hand-out ({e:#}); restoring a replacement"
                    );
                    discard(d, vm).await;
                    restore_one(d, &src, volumes, (egress, ca), t0, &limits)
                        .await
                        .map(|(vm, t)| (vm, t, false))
                }
            }
        }
    }))
    .buffer_unordered(handout_parallel)
    .collect::<Vec<_>>();
    let src2 = src.clone();
    let restored = stream::iter(0..req.n - n_hits)
        .map(|_| {
            let src = src2.clone();
            async move {
                restore_one(d, &src, volumes, (egress, ca), t0, &limits)
                    .await
                    .map(|(vm, t)| (vm, t, false))
            }
        })
        .buffer_unordered(d.cfg.spawn_parallel)
        .collect::<Vec<_>>();
    let (handed, restored) = futures::join!(handed, restored);

    let mut vms = Vec::new();
    let mut first_err = None;
    for r in handed.into_iter().chain(restored) {
        match r {
            Ok(x) => vms.push(x),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        futures::future::join_all(vms.into_iter().map(|(vm, _, _)| discard(d, vm))).await;
        return Err(ApiError::from_anyhow(e.context("spawning sandboxes")));
    }

    let now = unix_now();
    let ttl = req.ttl_secs.unwrap_or(d.cfg.default_ttl_secs);
    let mut out = Vec::new();
    let mut made = Vec::new();
    for (vm, t, hit) in vms {
        let rec = SandboxRecord {
            id: vm.id.clone(),
            snapshot_tag: req.tag.clone(),
            snapshot_id: sid.clone(),
            created_at_unix: now,
            pid: vm.pid(),
            memory_limit_mib: limits.memory_mib,
            cpus: limits.cpus,
            pids_max: limits.pids_max,
            expires_at_unix: if ttl > 0 { now.saturating_add(ttl) } else { 0 },
            hostname: vm.id.clone(),
            branch_count: 0,
            pool_hit: hit,
            spawn_ms: t.ready_ms,
            net: vm.record.net.clone(),
            egress: vm.record.net.as_ref().and(egress.cloned()),
            ports: Vec::new(),
            workspace: req.workspace.clone(),
        };
        let source = if hit { "pool" } else { "restore" };
        d.metrics
            .spawn_latency
            .with_label_values(&[source])
            .observe(t.ready_ms as f64 / 1e3);
        let sb = Arc::new(Sandbox::new(vm, rec));
        if let Err(e) = publish_ports(&sb, &req.ports).await {
            first_err.get_or_insert(e);
        }
        out.push(sb.record());
        made.push(sb);
    }
    if let Some(e) = first_err {
        for sb in made {
            sb.destroy().await;
        }
        return Err(ApiError::from_anyhow(e));
    }
    Ok((out, made))
}

/// Starts the proxies of `ports` for `sb` (guest side: its `guest_addr`)
/// and records the bound host ports in its record.
async fn publish_ports(sb: &Sandbox, ports: &[forkd_net::proxy::PortSpec]) -> anyhow::Result<()> {
    let Some(net) = sb.record().net else {
        return Ok(());
    };
    for p in ports {
        let published = forkd_net::proxy::publish(p, net.guest_addr).await?;
        sb.record.lock().unwrap().ports.push(published.spec.clone());
        sb.published.lock().unwrap().push(published);
    }
    Ok(())
}

/// The folders a spawn's children get: the snapshot's, with `rebind`
/// applied, each (recorded ones too) confined to `volume_roots` again.
fn child_volumes(
    d: &Daemon,
    src: &Source,
    rebind: &[forkd_vmm::Volume],
) -> ApiResult<Vec<forkd_vmm::Volume>> {
    let vols = forkd_snapshot::restore::child_volumes(&src.config.volumes, rebind)
        .map_err(ApiError::from_anyhow)?;
    vols.iter()
        .map(|v| super::volumes::confine(&d.cfg.volume_roots, v))
        .collect()
}

/// Restores one child of `src` on demand, confines it and hands it out.
async fn restore_one(
    d: &Arc<Daemon>,
    src: &Source,
    volumes: &[forkd_vmm::Volume],
    (egress, ca): (Option<&forkd_net::EgressPolicy>, Option<&CaBundle>),
    t0: Instant,
    limits: &Limits,
) -> anyhow::Result<(Vm, ChildTimings)> {
    let id = new_id();
    let mut t = ChildTimings::default();
    let mut vm =
        restore_paused_with(&d.paths, src, &id, Lifetime::Detached, volumes, &mut t).await?;
    let handed = async {
        confine(d, &vm, limits)?;
        hand_out(&mut vm, &id, Identity::Bare, egress, ca, t0, &mut t).await
    };
    match handed.await {
        Ok(()) => Ok((vm, t)),
        Err(e) => {
            discard(d, vm).await;
            Err(e)
        }
    }
}

/// Puts a paused child into its cgroups before it is resumed, so not one
/// guest instruction runs outside its limits. A pooled child joined them
/// when it was parked (with the default limits), so at hand-out this only
/// writes the request's values: joining costs the kernel an RCU grace
/// period (~15 ms measured here), too much for the spawn path.
fn confine(d: &Daemon, vm: &Vm, l: &Limits) -> anyhow::Result<()> {
    match (&d.cgroups, l.is_empty()) {
        (Some(h), false) => h.limit(&vm.id, &vm.pids(), l),
        _ => Ok(()),
    }
}

/// Destroys a child that never became a sandbox, with its cgroups.
async fn discard(d: &Daemon, vm: Vm) {
    let id = vm.id.clone();
    vm.destroy().await;
    remove_cgroups(d, &id);
}

/// Destroys a pooled child, with the cgroups it joined when parked.
async fn destroy_pooled(d: &Daemon, v: PooledVm) {
    v.vm.destroy().await;
    remove_cgroups(d, &v.record.vm_id);
}

/// The limits a sandbox record carries.
pub fn limits_of(r: &SandboxRecord) -> Limits {
    Limits {
        memory_mib: r.memory_limit_mib,
        cpus: r.cpus,
        pids_max: r.pids_max,
    }
}

/// Sets when sandbox `id` is killed automatically: `ttl_secs` from now (0
/// clears it). Durable before it returns; 404 when there is no such sandbox.
pub async fn set_ttl(d: &Arc<Daemon>, id: &str, ttl_secs: u64) -> ApiResult<SandboxRecord> {
    let sb = d
        .sandboxes
        .get(id)
        .ok_or_else(|| ApiError::not_found(format!("sandbox {id:?} not found")))?;
    let expires = if ttl_secs == 0 {
        0
    } else {
        unix_now().saturating_add(ttl_secs)
    };
    sb.record.lock().unwrap().expires_at_unix = expires;
    let rec = sb.record();
    let r2 = rec.clone();
    d.state
        .commit(move |s| {
            // Only while it exists: a concurrent delete must not be undone.
            if let Some(r) = s.sandboxes.get_mut(&r2.id) {
                *r = r2;
            }
        })
        .await
        .map_err(ApiError::from_anyhow)?;
    Ok(rec)
}

/// Destroys sandbox `id`: kills QEMU, removes its directory, cgroup and
/// record. Returns false when there is no such sandbox.
pub async fn destroy(d: &Arc<Daemon>, id: &str) -> bool {
    let Some(sb) = d.sandboxes.remove(id) else {
        return false;
    };
    sb.destroy().await;
    remove_cgroups(d, id);
    let id = id.to_string();
    if let Err(e) = d
        .state
        .commit(move |s| {
            s.sandboxes.remove(&id);
        })
        .await
    {
        tracing::error!("{e:#}");
    }
    d.metrics.sandboxes.set(d.sandboxes.len() as i64);
    true
}

/// Destroys pooled children in the background and forgets their records.
pub fn discard_pooled(d: &Arc<Daemon>, vms: Vec<PooledVm>) {
    if vms.is_empty() {
        return;
    }
    let d = d.clone();
    tokio::spawn(async move {
        let ids: Vec<String> = vms.iter().map(|v| v.record.vm_id.clone()).collect();
        futures::future::join_all(vms.into_iter().map(|v| destroy_pooled(&d, v))).await;
        if let Err(e) = d
            .state
            .commit(|s| {
                ids.iter().for_each(|id| {
                    s.pooled.remove(id);
                })
            })
            .await
        {
            tracing::error!("{e:#}");
        }
        update_pool_gauges(&d);
    });
}

/// Starts the refill loop, the TTL reaper and (with `auto_gc`) the store GC.
pub fn start_background(d: &Arc<Daemon>) {
    tokio::spawn(refill_loop(d.clone()));
    tokio::spawn(reaper_loop(d.clone()));
    if d.cfg.auto_gc {
        tokio::spawn(gc_loop(d.clone()));
    }
}

/// Deletes coming in together are reclaimed by one GC this long after the
/// first.
const GC_DEBOUNCE: Duration = Duration::from_secs(2);

/// Runs a store GC at start (what deletes made while poold was away left)
/// and after snapshot deletes, so deleted snapshots free their disk without
/// anyone running `forkd store gc`. GC takes the store's write turn, so it
/// waits for a create in flight and a create waits for it.
async fn gc_loop(d: Arc<Daemon>) {
    loop {
        match forkd_snapshot::store::with_rw(&d.paths, |store| Ok(store.gc()?)).await {
            Ok(r) => {
                if r.bytes_reclaimed > 0 || r.manifests_removed > 0 {
                    tracing::info!(
                        "store GC: {} manifests and {} chunks removed, {} packs deleted, {} MiB reclaimed in {} ms",
                        r.manifests_removed,
                        r.chunks_removed,
                        r.packs_deleted,
                        r.bytes_reclaimed >> 20,
                        r.elapsed_ms
                    );
                }
                for p in r.problems {
                    tracing::warn!("store GC: {p} (run `forkd store verify`)");
                }
            }
            Err(e) => tracing::warn!("store GC: {e:#}"),
        }
        d.gc_wake.notified().await;
        tokio::time::sleep(GC_DEBOUNCE).await;
    }
}

async fn refill_loop(d: Arc<Daemon>) {
    loop {
        // Also after a restart, a failed page-in, a larger keep_resident.
        start_page_ins(&d);
        let budget = d.refill_slots.available_permits();
        for ticket in d.pools.plan_refills(budget) {
            let Ok(permit) = d.refill_slots.clone().try_acquire_owned() else {
                d.pools.finish_refill(&ticket, None);
                continue;
            };
            let d = d.clone();
            tokio::spawn(async move {
                let vm = match refill_one(&d, &ticket).await {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::warn!("refilling pool {}: {e:#}", ticket.tag);
                        // Back off so a broken snapshot does not spin.
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        None
                    }
                };
                drop(permit);
                if let Some(extra) = d.pools.finish_refill(&ticket, vm) {
                    discard_pooled(&d, vec![extra]);
                }
                update_pool_gauges(&d);
                d.refill_wake.notify_one();
            });
        }
        update_pool_gauges(&d);
        tokio::select! {
            _ = d.refill_wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Restores one paused child for a pool, warms it once, records it.
async fn refill_one(d: &Arc<Daemon>, t: &RefillTicket) -> anyhow::Result<PooledVm> {
    d.check_headroom(&format!("refilling pool {}", t.tag))
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let src = source(d, &t.tag)
        .await
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let volumes = child_volumes(d, &src, &[]).map_err(|e| anyhow::anyhow!(e.message))?;
    let id = new_id();
    let mut timings = ChildTimings::default();
    let mut vm = restore_paused_with(
        &d.paths,
        &src,
        &id,
        Lifetime::Detached,
        &volumes,
        &mut timings,
    )
    .await?;
    // Into its cgroups now, with the default limits: the hand-out then
    // only adjusts values (see `confine`), and the warm-up's memory is
    // charged to the child.
    let defaults = d.default_limits();
    if let Err(e) = confine(d, &vm, &defaults) {
        discard(d, vm).await;
        return Err(e);
    }
    if t.warm {
        if let Err(e) = warm_once(&vm, &id, t.warm_eval.as_deref()).await {
            discard(d, vm).await;
            return Err(e);
        }
    }
    // The default egress policy is written while the child waits (paused,
    // so it sends nothing): a hand-out with the default skips the write.
    // Domain names in it are resolved now, not at hand-out.
    let policy = d.pools.spec(&t.tag).and_then(|s| s.network);
    let policy = policy.unwrap_or_else(forkd_vmm::net::default_egress);
    if let Err(e) = forkd_snapshot::restore::set_egress(&mut vm, &policy).await {
        discard(d, vm).await;
        return Err(e);
    }
    // The first `keep_resident` ready children stay resident: they go
    // first, and are what a refill replaces.
    let paged_out = t.page_out
        && d.pools.kept_resident(&t.tag) >= t.keep_resident
        && page_out_parked(d, &vm, &t.tag).await;
    let record = PooledRecord {
        vm_id: id.clone(),
        tag: t.tag.clone(),
        snapshot_id: src.id.to_string(),
        created_at_unix: unix_now(),
        identified: t.warm,
    };
    let r2 = record.clone();
    if let Err(e) = d
        .state
        .commit(move |s| {
            s.pooled.insert(r2.vm_id.clone(), r2);
        })
        .await
    {
        discard(d, vm).await;
        return Err(e);
    }
    Ok(PooledVm {
        vm,
        record,
        residency: if paged_out {
            Residency::PagedOut
        } else {
            Residency::Resident
        },
    })
}

/// Moves a paused child's memory to swap (its pool's `page_out`); true if
/// it did. A child that stays resident is still a good child, so failures
/// are logged.
async fn page_out_parked(d: &Daemon, vm: &Vm, tag: &str) -> bool {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if forkd_vmm::swap_total_kib() == 0 {
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "pool {tag} has page_out set but this host has no swap: its children stay resident (add swap, e.g. zram; docs/poold.md)"
            );
        }
        return false;
    }
    if let Some(h) = &d.cgroups {
        if let Err(e) = h.allow_swap(&vm.id) {
            tracing::warn!("pool {tag}: letting {} swap: {e:#}", vm.id);
        }
    }
    match vm.page_out().await {
        Ok(_) => {
            if let Ok(m) = forkd_vmm::mem_use(vm.pid()) {
                tracing::debug!(
                    "pool {tag}: parked {} paged out, {} KiB resident, {} KiB in swap",
                    vm.id,
                    m.pss_kib,
                    m.swap_pss_kib
                );
            }
            true
        }
        Err(e) => {
            tracing::warn!("pool {tag}: paging out {}: {e:#}", vm.id);
            false
        }
    }
}

/// Starts reading back from swap the paged-out children that pools keep
/// resident (see [`super::pool::Pools::plan_page_ins`]), each started when
/// the last ends. A failure leaves the child paged out, still a good child,
/// and is retried from the refill loop a second later.
fn start_page_ins(d: &Arc<Daemon>) {
    for t in d.pools.plan_page_ins(|v| v.vm.record.qemu) {
        let d = d.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let qemu = t.what;
            let r = tokio::task::spawn_blocking(move || forkd_vmm::page_in(&qemu))
                .await
                .map_err(anyhow::Error::from)
                .and_then(|r| r);
            match &r {
                Ok(bytes) => tracing::debug!(
                    "pool {}: paged {} back in, {} KiB in {:.1} ms",
                    t.tag,
                    t.vm_id,
                    bytes >> 10,
                    t0.elapsed().as_secs_f64() * 1e3
                ),
                // Destroyed meanwhile (its pool drained): nothing to say.
                Err(_) if !qemu.is_alive() => {}
                Err(e) => warn_page_in_failed(&t.tag, &t.vm_id, e),
            }
            d.pools.finish_page_in(&t.tag, &t.vm_id, r.is_ok());
            update_pool_gauges(&d);
            // The next one now, not at the next spawn: a pool emptied of
            // resident children by a burst refills them back to back.
            if r.is_ok() {
                start_page_ins(&d);
            }
        });
    }
}

/// Warns once per poold: a refusal (no ptrace access) would repeat every
/// second; later ones are debug lines.
fn warn_page_in_failed(tag: &str, vm_id: &str, e: &anyhow::Error) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::debug!("pool {tag}: paging {vm_id} back in: {e:#}");
    } else {
        tracing::warn!(
            "pool {tag}: paging {vm_id} back in: {e:#} (its hand-out reads it from swap; further failures are logged at debug level)"
        );
    }
}

/// Runs the child briefly and pauses it again: it gets its identity (all
/// but the clock, which the hand-out sets), and the code paths of its first
/// real request are translated, so neither costs the spawn.
async fn warm_once(vm: &Vm, hostname: &str, warm_eval: Option<&str>) -> anyhow::Result<()> {
    vm.resume().await?;
    forkd_snapshot::restore::give_identity(vm, hostname).await?;
    let p = vm.agent.ping(Duration::from_secs(30)).await?;
    if p.warm_ready {
        // The eval path too (the pipe to the warm interpreter and its loop):
        // by default a no-op expression, so nothing of the child's state
        // changes; the pool's `warm_eval` when it names a first request.
        let r = vm
            .agent
            .eval(warm_eval.unwrap_or("None"), Some(30_000))
            .await?;
        if let Some(e) = r.error {
            tracing::warn!("pool warm_eval failed in {hostname} (the child is parked anyway): {e}");
        }
    }
    vm.pause().await
}

fn update_pool_gauges(d: &Daemon) {
    for p in d.pools.status() {
        d.metrics
            .pool_ready
            .with_label_values(&[&p.tag])
            .set(p.ready as i64);
        d.metrics
            .pool_in_flight
            .with_label_values(&[&p.tag])
            .set(p.in_flight as i64);
    }
}

async fn reaper_loop(d: Arc<Daemon>) {
    // Sandboxes whose destroy is under way.
    let reaping = Arc::new(std::sync::Mutex::new(
        std::collections::HashSet::<String>::new(),
    ));
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let dead = d.pools.remove_dead();
        if !dead.is_empty() {
            tracing::warn!(
                "{} pooled children died while parked; refilling",
                dead.len()
            );
            discard_pooled(&d, dead);
            d.refill_wake.notify_one();
        }
        let now = unix_now();
        for sb in d.sandboxes.all() {
            let r = sb.record();
            rotate_console(&sb.dir.console());
            let expired = r.expires_at_unix != 0 && r.expires_at_unix <= now;
            let dead = !sb.dir.read_record().is_ok_and(|v| v.qemu.is_alive());
            if (expired || dead) && reaping.lock().unwrap().insert(r.id.clone()) {
                tracing::info!(
                    "sandbox {}: {}",
                    r.id,
                    if expired {
                        "TTL expired"
                    } else {
                        "QEMU exited"
                    }
                );
                // Each on its own task: one destroy that waits (a branch in
                // progress holds the VM lock until its QMP calls time out)
                // must not hold up every other expiry.
                let (d, reaping) = (d.clone(), reaping.clone());
                tokio::spawn(async move {
                    destroy(&d, &r.id).await;
                    reaping.lock().unwrap().remove(&r.id);
                });
            }
        }
    }
}

/// A console log is cut when it passes this size.
const CONSOLE_MAX_BYTES: u64 = 16 << 20;

/// Keeps a guest that floods its console from filling the disk: past
/// [`CONSOLE_MAX_BYTES`] the last MiB goes to `console.log.1` and the log
/// starts over (QEMU appends, so it keeps writing at the new end).
fn rotate_console(path: &std::path::Path) {
    let Ok(m) = std::fs::metadata(path) else {
        return;
    };
    if m.len() <= CONSOLE_MAX_BYTES {
        return;
    }
    use std::io::{Read, Seek, SeekFrom};
    let keep = 1u64 << 20;
    let mut tail = Vec::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = f.seek(SeekFrom::Start(m.len() - keep));
        let _ = f.take(keep).read_to_end(&mut tail);
    }
    let _ = forkd_vmm::private::write(&path.with_extension("log.1"), &tail);
    if let Ok(f) = std::fs::OpenOptions::new().write(true).open(path) {
        let _ = f.set_len(0);
    }
}

/// Re-adopts every sandbox and pooled child of the saved state whose QEMU
/// still runs; forgets the dead; kills detached VMs an earlier poold started
/// but never recorded.
pub async fn adopt_all(d: &Arc<Daemon>, saved: State) -> anyhow::Result<()> {
    let mut alive_ids = std::collections::HashSet::new();
    let mut dead_sb = Vec::new();
    // Reconnected all at once: one slow QEMU costs its own timeout, not
    // everyone's.
    let adopted = futures::future::join_all(saved.sandboxes.keys().map(|id| async move {
        let vm = Vm::adopt(VmDir::new(d.paths.vm_dir(id))).await;
        if let Ok(vm) = &vm {
            run_again(vm, id).await;
        }
        vm
    }))
    .await;
    for ((id, rec), vm) in saved.sandboxes.iter().zip(adopted) {
        match vm {
            Ok(vm) => {
                let mut rec = rec.clone();
                rec.pid = vm.pid();
                let ports = std::mem::take(&mut rec.ports);
                let sb = Arc::new(Sandbox::new(vm, rec));
                if let Err(e) = publish_ports(&sb, &ports).await {
                    tracing::warn!("sandbox {id}: publishing its ports again: {e:#}");
                }
                d.sandboxes.insert(sb);
                alive_ids.insert(id.clone());
            }
            Err(e) => {
                tracing::warn!("sandbox {id} cannot be re-adopted ({e:#}); removing it");
                forget_vm(d, id).await;
                dead_sb.push(id.clone());
            }
        }
    }
    let mut dead_pooled = Vec::new();
    let adopted = futures::future::join_all(
        saved
            .pooled
            .keys()
            .map(|id| Vm::adopt(VmDir::new(d.paths.vm_dir(id)))),
    )
    .await;
    for ((id, rec), vm) in saved.pooled.iter().zip(adopted) {
        let adopted = match vm {
            // Only a still-paused child may be parked again: one that was
            // being handed out when poold died has run, without its record.
            Ok(vm) => match vm.run_state().await {
                Ok(forkd_vmm::RunState::Paused) => Ok(vm),
                other => {
                    vm.destroy().await;
                    Err(anyhow::anyhow!("it is not paused ({other:?})"))
                }
            },
            Err(e) => Err(e),
        };
        match adopted {
            Ok(vm) => match d.pools.adopt(PooledVm {
                // Most of what it owns is in swap: it was paged out.
                residency: if forkd_vmm::mem_use(vm.pid())
                    .is_ok_and(|m| m.swap_pss_kib > m.pss_anon_kib)
                {
                    Residency::PagedOut
                } else {
                    Residency::Resident
                },
                vm,
                record: rec.clone(),
            }) {
                None => {
                    alive_ids.insert(id.clone());
                }
                Some(unwanted) => {
                    tracing::info!(
                        "pooled child {id}: its pool was deleted or shrunk; removing it"
                    );
                    unwanted.vm.destroy().await;
                    dead_pooled.push(id.clone());
                }
            },
            Err(e) => {
                tracing::warn!("pooled child {id} cannot be re-adopted ({e:#}); removing it");
                forget_vm(d, id).await;
                dead_pooled.push(id.clone());
            }
        }
    }
    kill_unrecorded(d, &alive_ids).await;
    // What a kill -9 mid-branch or mid-create left: the collector VM's
    // directory (an ephemeral VM of the dead poold) and staging files.
    let swept = forkd_vmm::sweep(&d.paths.vms_dir()).await;
    if !swept.is_empty() {
        tracing::warn!("removed VM directories of a dead poold: {swept:?}");
    }
    forkd_snapshot::staging::sweep(&d.paths.staging_dir());
    reconcile_networks(d).await;
    d.state
        .commit(move |s| {
            for id in dead_sb {
                s.sandboxes.remove(&id);
            }
            for id in dead_pooled {
                s.pooled.remove(&id);
            }
        })
        .await?;
    d.metrics.sandboxes.set(d.sandboxes.len() as i64);
    Ok(())
}

/// A sandbox always runs while poold is away; one that is stopped was left
/// so by a poold that died mid-branch (its migration to the collector
/// stops the vCPUs, or waits at pre-switchover). Cancels that migration
/// (the collector is gone with its poold) and resumes the vCPUs.
async fn run_again(vm: &Vm, id: &str) {
    use forkd_vmm::RunState;
    let state = match vm.run_state().await {
        Ok(RunState::Running) => return,
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("sandbox {id}: reading its run state: {e:#}");
            return;
        }
    };
    if !matches!(
        state,
        RunState::Paused | RunState::Postmigrate | RunState::FinishMigrate
    ) {
        tracing::warn!("sandbox {id} is {state:?}, not stopped by a branch; leaving it");
        return;
    }
    tracing::warn!("sandbox {id} was left {state:?} (a branch poold did not finish); resuming it");
    if vm
        .qmp
        .query_migrate()
        .await
        .is_ok_and(|m| m.status.is_in_progress())
    {
        let _ = vm
            .qmp
            .execute("migrate_cancel", serde_json::json!({}))
            .await;
        for _ in 0..100 {
            match vm.qmp.query_migrate().await {
                Ok(m) if m.status.is_in_progress() => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                _ => break,
            }
        }
    }
    if let Err(e) = vm.resume().await {
        tracing::warn!("sandbox {id}: resuming it: {e:#}");
    }
}

/// Removes every child network (namespace, link, rule) of this data dir
/// that no live VM owns: what a kill -9 at any step left behind. A VM is
/// live when its record's QEMU runs, whoever started it (this poold's
/// sandboxes and pools, a `forkd run` of the same data dir).
async fn reconcile_networks(d: &Daemon) {
    let owned: Vec<forkd_net::ChildNet> = std::fs::read_dir(d.paths.vms_dir())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| VmDir::new(e.path()).read_record().ok())
        .filter(|r| r.qemu.is_alive())
        .filter_map(|r| r.net)
        .collect();
    match forkd_vmm::net::reconcile(&d.paths.home, owned).await {
        Ok(r) if r != forkd_net::Reconciled::default() => {
            tracing::warn!("removed leaked child networks: {r:?}")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("reconciling child networks: {e:#}"),
    }
}

/// Removes a VM poold cannot use: kills its QEMU if it still runs (a VM
/// nobody can reach must not keep running), then its directory.
async fn forget_vm(d: &Daemon, id: &str) {
    let dir = VmDir::new(d.paths.vm_dir(id));
    if let Ok(r) = dir.read_record() {
        forkd_vmm::kill_proc(&r.qemu).await;
        if let Some(n) = r.net {
            forkd_vmm::net::teardown(n).await;
        }
    }
    remove_cgroups(d, id);
    let _ = std::fs::remove_dir_all(&dir.path);
}

/// Removes VM `id`'s cgroups, if it has any (its processes are gone):
/// every way a VM ends goes through here, whatever its limits were.
fn remove_cgroups(d: &Daemon, id: &str) {
    if let Some(h) = &d.cgroups {
        h.remove(id);
    }
}

/// Kills detached VMs whose owner is gone and that the state does not name.
async fn kill_unrecorded(d: &Daemon, known: &std::collections::HashSet<String>) {
    let Ok(rd) = std::fs::read_dir(d.paths.vms_dir()) else {
        return;
    };
    for ent in rd.flatten() {
        let name = ent.file_name().to_string_lossy().into_owned();
        if known.contains(&name) {
            continue;
        }
        let dir = VmDir::new(ent.path());
        let Ok(r) = dir.read_record() else { continue };
        if r.lifetime == Lifetime::Detached && !r.owner.is_alive() {
            tracing::warn!("killing unrecorded VM {name} (pid {})", r.qemu.pid);
            forkd_vmm::kill_proc(&r.qemu).await;
            if let Some(n) = r.net {
                forkd_vmm::net::teardown(n).await;
            }
            remove_cgroups(d, &name);
            let _ = std::fs::remove_dir_all(ent.path());
        }
    }
}

/// Deletes snapshot `rec` (named `tag`) and, with cascade, its dependents:
/// refuses dependents first, then stops refilling the pools of every tag
/// about to go, waits for their restores in flight, destroys their parked
/// children, and deletes from the store. On failure the pools are restored.
pub async fn delete_snapshot(
    d: &Arc<Daemon>,
    rec: forkd_layers::SnapshotRecord,
    tag: &str,
    deps: forkd_snapshot::delete::Dependents,
) -> ApiResult<()> {
    use forkd_snapshot::delete::{delete, Dependents};
    let cascade = deps == Dependents::Cascade;
    let tag = tag.to_string();
    // Everything about to go: its ids and tags. Dependents are refused
    // before any pool is touched.
    let (ids, tags, dependents) = d
        .read(move |v| {
            let mut ids = vec![rec.id];
            if cascade {
                let mut i = 0;
                while i < ids.len() {
                    ids.extend(v.dependents(&ids[i])?);
                    i += 1;
                }
            }
            let mut tags = Vec::new();
            for id in &ids {
                tags.extend(v.tags_of(id)?);
            }
            let deps: Vec<String> = v
                .dependents(&rec.id)?
                .iter()
                .map(|c| forkd_snapshot::info::label(v, c))
                .collect();
            Ok((ids, tags, deps))
        })
        .await
        .map_err(ApiError::from_anyhow)?;
    if deps == Dependents::Refuse && !dependents.is_empty() {
        return Err(ApiError::conflict(format!(
            "snapshot {tag} has dependent snapshots: {}; delete them first, or use cascade (delete them too) or force (keep them, orphaned)",
            dependents.join(", ")
        )));
    }
    super::workspace::refuse_deleting_states(d, &tags)?;
    // Pooled children map the snapshots: stop refilling their pools, wait
    // for restores in flight, and destroy every ready child of them.
    let id_strings: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let saved: Vec<_> = tags.iter().map(|t| (t.clone(), d.pools.spec(t))).collect();
    let mut doomed = Vec::new();
    for t in &tags {
        doomed.extend(d.pools.set(t, None));
    }
    d.pools
        .wait_refills_done(&tags, std::time::Duration::from_secs(60))
        .await;
    doomed.extend(d.pools.drain_snapshots(&id_strings));
    let vm_ids: Vec<String> = doomed.iter().map(|v| v.record.vm_id.clone()).collect();
    futures::future::join_all(doomed.into_iter().map(|v| destroy_pooled(d, v))).await;
    d.state
        .commit(move |s| {
            for id in &vm_ids {
                s.pooled.remove(id);
            }
        })
        .await
        .map_err(ApiError::from_anyhow)?;
    let p = d.paths.clone();
    let t = tag.clone();
    let result = forkd_snapshot::store::with_rw(&d.paths, move |store| delete(&p, store, &t, deps))
        .await
        .map_err(ApiError::from_anyhow);
    match &result {
        Ok(_) => {
            d.gc_wake.notify_one();
            // The pools of deleted tags go with them.
            let gone = tags.clone();
            d.state
                .commit(move |s| {
                    for t in &gone {
                        s.pools.remove(t);
                    }
                })
                .await
                .map_err(ApiError::from_anyhow)?;
        }
        Err(_) => {
            for (t, spec) in saved {
                d.pools.set(&t, spec);
            }
            d.refill_wake.notify_one();
        }
    }
    result.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn req() -> SpawnRequest {
        SpawnRequest {
            tag: "base".into(),
            n: 1,
            ..Default::default()
        }
    }

    /// The first complaint about a request, as (status, message).
    fn check(r: SpawnRequest, cgroups: bool) -> Result<(), (StatusCode, String)> {
        let h = Hierarchy::V2 {
            root: "/nonexistent".into(),
            controllers: vec!["memory".into(), "cpu".into(), "pids".into()],
        };
        r.validate(cgroups.then_some(&h), Limits::default())
            .map(drop)
            .map_err(|e| (e.status, e.message))
    }

    fn refused(r: SpawnRequest, cgroups: bool, why: &str) {
        let (st, msg) = check(r.clone(), cgroups).expect_err(why);
        assert_eq!(st, StatusCode::BAD_REQUEST, "{r:?}");
        assert!(msg.contains(why), "{r:?}: {msg}");
    }

    #[test]
    fn a_plain_request_passes() {
        assert_eq!(check(req(), false), Ok(()));
        let full = SpawnRequest {
            n: 1000,
            memory_limit_mib: Some(1),
            ttl_secs: Some(MAX_TTL_SECS),
            ..req()
        };
        assert_eq!(check(full, true), Ok(()));
    }

    #[test]
    fn each_rule_refuses_with_a_400() {
        refused(
            SpawnRequest {
                tag: "../x".into(),
                ..req()
            },
            true,
            "1-64",
        );
        refused(
            SpawnRequest {
                tag: String::new(),
                ..req()
            },
            true,
            "1-64",
        );
        refused(
            SpawnRequest {
                net: Some(false),
                network: Some(forkd_net::EgressPolicy::default()),
                ..req()
            },
            true,
            "net: false",
        );
        refused(
            SpawnRequest {
                n: 2,
                ports: vec![forkd_net::proxy::PortSpec::parse("9000:80").unwrap()],
                ..req()
            },
            true,
            "host_port with n > 1",
        );
        refused(SpawnRequest { n: 0, ..req() }, true, "n must be ≥ 1");
        refused(SpawnRequest { n: 1001, ..req() }, true, "≤ 1000");
        let mem = |m| SpawnRequest {
            memory_limit_mib: Some(m),
            ..req()
        };
        refused(mem(0), true, "memory_limit_mib must be ≥ 1");
        refused(mem(64), false, "cgroup memory controller");
        refused(
            SpawnRequest {
                cpus: Some(0.0),
                ..req()
            },
            true,
            "cpus must be",
        );
        refused(
            SpawnRequest {
                pids_max: Some(2),
                ..req()
            },
            true,
            "pids_max must be",
        );
        let ttl = SpawnRequest {
            ttl_secs: Some(MAX_TTL_SECS + 1),
            ..req()
        };
        refused(ttl, true, "ttl_secs must be at most");
    }

    /// A network from a snapshot without a NIC is refused naming the fix;
    /// `net: false` on a networked one denies all egress.
    #[test]
    fn network_requests_follow_the_snapshot() {
        let netns = SpawnRequest {
            per_child_netns: true,
            ..req()
        };
        let e = netns.egress(false, None).expect_err("refused");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("--net"), "{}", e.message);
        assert!(netns.egress(true, None).ok().flatten().is_some());
        assert_eq!(req().egress(false, None).ok(), Some(None));
        // A pool's policy is the default of its tag's spawns.
        let pool = forkd_net::EgressPolicy {
            allow_out: vec![forkd_net::Target::parse("10.0.5.20").unwrap()],
            deny_out: vec![],
        };
        assert_eq!(
            netns.egress(true, Some(pool.clone())).ok().flatten(),
            Some(pool.clone())
        );
        let own = SpawnRequest {
            network: Some(forkd_net::EgressPolicy::default()),
            ..req()
        };
        assert_eq!(
            own.egress(true, Some(pool)).ok().flatten(),
            Some(forkd_net::EgressPolicy::default())
        );
        let off = SpawnRequest {
            net: Some(false),
            ..req()
        };
        assert_eq!(
            off.egress(true, None).ok().flatten(),
            Some(forkd_net::EgressPolicy::deny_all())
        );
    }

    /// The rules run in forkd's order: the tag first, then netns, n,
    /// memory, TTL.
    #[test]
    fn the_first_broken_rule_answers() {
        let all_bad = SpawnRequest {
            tag: "../x".into(),
            n: 0,
            memory_limit_mib: Some(0),
            ttl_secs: Some(u64::MAX),
            net: Some(false),
            network: Some(forkd_net::EgressPolicy::default()),
            ..req()
        };
        refused(all_bad.clone(), false, "1-64");
        let r = SpawnRequest {
            tag: "ok".into(),
            ..all_bad
        };
        refused(r.clone(), false, "net: false");
        let r = SpawnRequest { network: None, ..r };
        refused(r.clone(), false, "n must be");
        let r = SpawnRequest { n: 2, ..r };
        refused(r.clone(), false, "memory_limit_mib must be ≥ 1");
        let r = SpawnRequest {
            memory_limit_mib: None,
            ..r
        };
        refused(r, false, "ttl_secs");
    }
}
