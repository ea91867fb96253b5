//! Spawning sandboxes (docs/design.md, "Spawn"): pool hits first, restores
//! on demand for the rest, every child confined to its cgroups before it
//! runs an instruction and recorded in one state commit.
//!
//! Invariants:
//! - [`SpawnRequest::validate`] is the one place spawn input is checked,
//!   in forkd's order; whether the snapshot exists and the node has room
//!   is checked by [`spawn`];
//! - a spawn is all or nothing: on any failure every child of the request
//!   is destroyed, with its cgroups, and the pool records of its hits are
//!   dropped;
//! - the hits keep their pool records until the commit that records the
//!   sandboxes, so a crash in between loses no child (`adopt`).

use crate::error::{check_tag, Error, Result};
use crate::limits::{check_env, check_metadata, MAX_PORTS, MAX_SPAWN, MAX_TTL_SECS};
use crate::node::Node;
use crate::pool::PooledVm;
use crate::sandbox::Sandbox;
use crate::state::SandboxRecord;
use crate::teardown::{discard, discard_pooled, forget_pooled};
use crate::token::AccessToken;
use crate::workspace::record::Kept;
use forkd_snapshot::ca::CaBundle;
use forkd_snapshot::restore::{hand_out, restore_paused_with, ChildTimings, Identity, Source};
use forkd_snapshot::unix_now;
use forkd_vmm::{Hierarchy, Limits};
use forkd_vmm::{Lifetime, Vm};
use futures::stream::{self, StreamExt};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// What a spawn asks for.
#[derive(Debug, Clone, Default)]
pub struct SpawnRequest {
    /// The snapshot tag to fork.
    pub tag: String,
    /// How many sandboxes, 1 to [`MAX_SPAWN`].
    pub n: usize,
    /// Memory limit, MiB (cgroup memory controller).
    pub memory_limit_mib: Option<u64>,
    /// CPU quota in CPUs (cgroup cpu controller).
    pub cpus: Option<f64>,
    /// Most tasks its QEMU may hold (cgroup pids controller).
    pub pids_max: Option<u64>,
    /// Killed this long after the spawn (0: never; None: the node's default).
    pub ttl_secs: Option<u64>,
    /// forkd's per-child network namespace: every child of a networked
    /// snapshot has one; asking for it from a snapshot without a NIC is
    /// refused.
    pub per_child_netns: bool,
    /// forkd's memfd-backed children: every child here is copy-on-write
    /// already, so it changes nothing, except that (as in forkd) it is
    /// refused on a chained snapshot.
    pub live_fork: bool,
    /// false: no way out (deny-all); true: must be a networked snapshot.
    pub net: Option<bool>,
    /// The egress policy (None: the config's default).
    pub network: Option<forkd_net::EgressPolicy>,
    /// Guest ports to publish on the host.
    pub ports: Vec<forkd_net::proxy::PortSpec>,
    /// Host folders rebinding the snapshot's volumes (docs/volumes.md).
    pub volumes: Vec<forkd_api::VolumeSpec>,
    /// Labels front-ends keep with each sandbox (`SandboxRecord::metadata`).
    pub metadata: BTreeMap<String, String>,
    /// Environment every command in each sandbox gets (`SandboxRecord::envs`).
    pub envs: BTreeMap<String, String>,
    /// The name the sandboxes were asked for by (`SandboxRecord::alias`).
    pub alias: Option<String>,
    /// Extra CA certificates (PEM) the children trust, besides the
    /// config's `ca_certs_file` (docs/network.md).
    pub ca_certs: Option<String>,
    /// Paused, not killed, when the TTL passes (E2B's `autoPause`;
    /// `SandboxRecord::auto_pause`).
    pub auto_pause: bool,
    /// How clients reach the guest ports by URL (`SandboxRecord::port_access`).
    pub port_access: crate::state::PortAccess,
}

impl SpawnRequest {
    /// Every check of a spawn request that needs nothing but the request
    /// and whether this host can limit memory (`cgroups`): the one place
    /// spawn input is validated, in forkd's order, each refusal an
    /// [`Error::Invalid`] naming its field. Returns the limits the
    /// sandboxes get (the request's, with the node's `defaults` filling
    /// the rest).
    pub fn validate(&self, cgroups: Option<&Hierarchy>, defaults: Limits) -> Result<Limits> {
        check_tag(&self.tag)?;
        if let Some(p) = &self.network {
            p.validate()
                .map_err(|e| Error::invalid("network", format!("network: {e}")))?;
            if self.net == Some(false) {
                return Err(Error::invalid(
                    "network",
                    "network: an egress policy with net: false; drop one of them",
                ));
            }
        }
        if self.ports.len() > MAX_PORTS {
            return Err(Error::invalid(
                "ports",
                format!("ports: at most {MAX_PORTS} per sandbox"),
            ));
        }
        for p in &self.ports {
            p.validate()
                .map_err(|e| Error::invalid("ports", format!("{e}")))?;
        }
        if self.n > 1 && self.ports.iter().any(|p| p.host_port != 0) {
            return Err(Error::invalid(
                "ports",
                "ports: a fixed host_port with n > 1 would be bound twice; leave host_port out (any free port) or spawn one at a time",
            ));
        }
        if self.n == 0 {
            return Err(Error::invalid("n", "n must be ≥ 1"));
        }
        if self.n > MAX_SPAWN {
            return Err(Error::invalid(
                "n",
                format!("n must be ≤ {MAX_SPAWN} (sanity cap)"),
            ));
        }
        let limits = self.limits(defaults);
        check_limits(cgroups, &limits)?;
        if self.ttl_secs.is_some_and(|t| t > MAX_TTL_SECS) {
            return Err(Error::invalid(
                "ttl_secs",
                format!(
                    "ttl_secs must be at most {MAX_TTL_SECS} (10 years); leave it out for no TTL"
                ),
            ));
        }
        check_metadata(&self.metadata).map_err(|m| Error::invalid("metadata", m))?;
        check_env(&self.envs).map_err(|m| Error::invalid("envs", format!("envs: {m}")))?;
        if self
            .alias
            .as_ref()
            .is_some_and(|a| a.is_empty() || a.len() > 256 || a.chars().any(char::is_control))
        {
            return Err(Error::invalid(
                "alias",
                "alias: 1-256 bytes without control characters",
            ));
        }
        Ok(limits)
    }

    /// The CA certificates asked for, checked ([`Error::Invalid`] says
    /// what is wrong with them).
    pub fn ca(&self) -> Result<Option<CaBundle>> {
        self.ca_certs
            .as_deref()
            .map(|t| CaBundle::parse(t, "ca_certs"))
            .transpose()
            .map_err(|e| Error::invalid("ca_certs", e.to_string()))
    }

    /// Checks the network fields against the snapshot (`has_nic`): a
    /// network from a snapshot without a NIC is refused. Returns the
    /// egress policy the children get (None: no network): the request's,
    /// else the pool's (`pool_default`), else the config's.
    pub fn egress(
        &self,
        has_nic: bool,
        pool_default: Option<forkd_net::EgressPolicy>,
    ) -> Result<Option<forkd_net::EgressPolicy>> {
        let wants = self.per_child_netns
            || self.net == Some(true)
            || self.network.is_some()
            || !self.ports.is_empty();
        if !has_nic {
            if wants {
                return Err(Error::invalid(
                    "net",
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

    /// The limits asked for, with the node's defaults filling the rest.
    pub fn limits(&self, defaults: Limits) -> Limits {
        Limits {
            memory_mib: self.memory_limit_mib,
            cpus: self.cpus,
            pids_max: self.pids_max,
        }
        .or(defaults)
    }
}

/// Each limit on its own, so the refusal names its field: first every
/// value's range, then whether the host has its controller.
fn check_limits(cgroups: Option<&Hierarchy>, l: &Limits) -> Result<()> {
    let each = [
        (
            "memory_limit_mib",
            Limits {
                memory_mib: l.memory_mib,
                ..Limits::default()
            },
        ),
        (
            "cpus",
            Limits {
                cpus: l.cpus,
                ..Limits::default()
            },
        ),
        (
            "pids_max",
            Limits {
                pids_max: l.pids_max,
                ..Limits::default()
            },
        ),
    ];
    for (field, one) in each {
        one.validate()
            .map_err(|e| Error::invalid(field, format!("{e:#}")))?;
    }
    for (field, one) in each {
        Hierarchy::check(cgroups, &one).map_err(|e| Error::invalid(field, format!("{e:#}")))?;
    }
    Ok(())
}

/// Resolves a tag to a restorable snapshot: [`Error::NotFound`] when
/// unknown, [`Error::Incompatible`] when it cannot be restored here
/// (mismatched QEMU, missing files). Reads the forkd-fs mount, so on a
/// blocking thread (a mount whose worker is being replaced answers only
/// once the new one serves).
pub(crate) async fn source(n: &Node, tag: &str) -> Result<Source> {
    check_tag(tag)?;
    let (mount, tag) = (n.mount.clone(), tag.to_string());
    // Both fail with a typed `SnapshotError`, classified by the node's Error.
    Ok(tokio::task::spawn_blocking(move || {
        forkd_snapshot::restore::read_record(&mount, &tag).and_then(|rec| Source::new(&mount, &rec))
    })
    .await
    .map_err(Error::internal)??)
}

/// Spawns `req.n` sandboxes (after [`SpawnRequest::validate`]), for
/// `workspace` when one spawns its sandbox: ready pool children are resumed
/// first, the rest restored on demand; returns once every child's agent
/// answered. On any failure every child of this request is destroyed.
/// forkd refuses `live_fork` on a chained snapshot (one with a parent) with
/// a 400, and its clients test for that: so do we, although every child
/// here is a copy-on-write mapping and `live_fork` changes nothing else.
async fn refuse_live_fork_of_chain(n: &Arc<Node>, tag: &str) -> Result<()> {
    let rec = crate::snapshots::resolve(n, tag).await?;
    let Some(parent) = rec.parent else {
        return Ok(());
    };
    let (t, parent_label) = (tag.to_string(), parent);
    let parent_label = n
        .read(move |v| Ok(forkd_snapshot::info::label(v, &parent_label)))
        .await?;
    Err(Error::invalid(
        "live_fork",
        format!(
            "live_fork is not supported on a chained snapshot: {t} is a branch of {parent_label}; spawn without live_fork (children are copy-on-write either way) or spawn from a compacted copy (POST /v1/snapshots/{t}/compact)"
        ),
    ))
}

pub(crate) async fn spawn(
    n: &Arc<Node>,
    req: SpawnRequest,
    workspace: Option<String>,
    kept: Option<&Kept>,
) -> Result<Vec<SandboxRecord>> {
    let t0 = Instant::now();
    let limits = req.validate(n.cgroups.as_ref(), n.default_limits())?;
    let ca = req.ca()?;
    let rebind = crate::volumes::accept(&n.cfg.volume_roots, &req.volumes)?;
    if req.live_fork {
        refuse_live_fork_of_chain(n, &req.tag).await?;
    }
    let src = source(n, &req.tag).await?;
    let source_ms = t0.elapsed().as_secs_f64() * 1e3;
    let volumes = child_volumes(n, &src, &rebind)?;
    let pool_egress = n.pools.spec(&req.tag).and_then(|s| s.network);
    let egress = req.egress(src.config.machine.net, pool_egress)?;
    if let Some(p) = &egress {
        // Names that do not resolve are the caller's error, before any VM.
        p.resolve()
            .await
            .map_err(|e| Error::invalid("network", format!("network: {e}")))?;
    }
    if let Some(k) = kept {
        check_kept(n, &req, k)?;
    }
    let _reserved = n.reserve(req.n)?;
    n.check_headroom("spawn")?;
    let sid = src.id.to_string();
    // Pooled children have the snapshot's folders: a rebind restores anew.
    // A kept sandbox is restored as itself.
    let (hits, stale) = if rebind.is_empty() && kept.is_none() {
        n.pools.take(&req.tag, &sid, req.n)
    } else {
        (Vec::new(), Vec::new())
    };
    let n_hits = hits.len();
    n.metrics
        .pool_hits
        .with_label_values(&[&req.tag])
        .inc_by(n_hits as u64);
    n.metrics
        .pool_misses
        .with_label_values(&[&req.tag])
        .inc_by((req.n - n_hits) as u64);
    discard_pooled(n, stale);
    // Before any refill can park: its child then counts the page-in.
    crate::parking::start_page_ins(n);
    n.refill_wake.notify_one();

    // The hits keep their pool records until the one commit below that
    // records the sandboxes: a crash in between leaves them listed as
    // pooled, and the next start parks again only those still paused (never
    // resumed); one that has run is destroyed (`adopt`). One durable
    // write per spawn instead of two: each costs an fsync.
    let hit_ids: Vec<String> = hits.iter().map(|h| h.record.vm_id.clone()).collect();
    let plan = Plan {
        req: &req,
        workspace,
        kept,
        src: &src,
        volumes: &volumes,
        egress: egress.as_ref(),
        ca: ca.as_ref(),
        limits,
        t0,
    };
    let (out, made) = match spawn_hits_and_misses(n, &plan, hits).await {
        Ok(x) => x,
        Err(e) => {
            forget_pooled(n, hit_ids).await;
            return Err(e);
        }
    };
    let handed_ms = t0.elapsed().as_secs_f64() * 1e3;
    let records = out.clone();
    let committed = n
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
        n.sandboxes.insert(sb.clone());
    }
    n.metrics.sandboxes.set(n.sandboxes.len() as i64);
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
            crate::teardown::destroy(n, sb.id()).await;
        }
        return Err(e.into());
    }
    Ok(out)
}

/// A kept sandbox comes back alone, and only while no sandbox has its id.
fn check_kept(n: &Node, req: &SpawnRequest, k: &Kept) -> Result<()> {
    if req.n != 1 {
        return Err(Error::internal("a kept sandbox is spawned alone"));
    }
    if n.sandboxes.get(&k.sandbox_id).is_some() {
        return Err(Error::Conflict(format!(
            "sandbox {} is already running",
            k.sandbox_id
        )));
    }
    Ok(())
}

/// What every child of one spawn gets.
struct Plan<'a> {
    req: &'a SpawnRequest,
    workspace: Option<String>,
    /// The sandbox spawned again (a paused sandbox's resume).
    kept: Option<&'a Kept>,
    /// The snapshot.
    src: &'a Source,
    /// The folders its restored children get.
    volumes: &'a [forkd_vmm::Volume],
    egress: Option<&'a forkd_net::EgressPolicy>,
    /// The spawn's own CAs (the config's are added at hand-out).
    ca: Option<&'a CaBundle>,
    limits: Limits,
    /// When the request arrived.
    t0: Instant,
}

/// Hands out the pool `hits` and restores the rest of the request on
/// demand; on success, the new sandboxes (not yet recorded or listed),
/// else nothing is left of any of them.
async fn spawn_hits_and_misses(
    n: &Arc<Node>,
    plan: &Plan<'_>,
    hits: Vec<PooledVm>,
) -> Result<(Vec<SandboxRecord>, Vec<Arc<Sandbox>>)> {
    let n_hits = hits.len();
    // Hand-outs are bounded too: resuming a hundred children at once makes
    // them all crawl (each first request is CPU-bound, under TCG doubly so);
    // a few at a time finishes every one of them sooner.
    let handout_parallel = std::thread::available_parallelism().map_or(2, |n| n.get()) * 2;
    let handed = stream::iter(hits.into_iter().map(|h| async move {
        let mut t = ChildTimings::default();
        let mut vm = h.vm;
        let id = vm.id.clone();
        let identity = if h.record.identified {
            Identity::Given
        } else {
            Identity::Bare
        };
        let handed = async {
            confine(n, &vm, &plan.limits)?;
            hand_out(
                &mut vm,
                &id,
                identity,
                plan.egress,
                plan.ca,
                plan.t0,
                &mut t,
            )
            .await
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
                discard(n, vm).await;
                restore_one(n, plan).await.map(|(vm, t)| (vm, t, false))
            }
        }
    }))
    .buffer_unordered(handout_parallel)
    .collect::<Vec<_>>();
    let restored = stream::iter(0..plan.req.n - n_hits)
        .map(|_| async move { restore_one(n, plan).await.map(|(vm, t)| (vm, t, false)) })
        .buffer_unordered(n.cfg.spawn_parallel)
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
        futures::future::join_all(vms.into_iter().map(|(vm, _, _)| discard(n, vm))).await;
        return Err(e.context("spawning sandboxes").into());
    }

    let now = unix_now();
    let ttl = plan.req.ttl_secs.unwrap_or(n.cfg.default_ttl_secs);
    let mut out = Vec::new();
    let mut made = Vec::new();
    for (vm, t, hit) in vms {
        let rec = SandboxRecord {
            id: vm.id.clone(),
            snapshot_tag: plan.req.tag.clone(),
            snapshot_id: plan.src.id.to_string(),
            created_at_unix: now,
            pid: vm.pid(),
            memory_limit_mib: plan.limits.memory_mib,
            cpus: plan.limits.cpus,
            pids_max: plan.limits.pids_max,
            expires_at_unix: if ttl > 0 { now.saturating_add(ttl) } else { 0 },
            hostname: vm.id.clone(),
            branch_count: 0,
            pool_hit: hit,
            spawn_ms: t.ready_ms,
            net: vm.record.net.clone(),
            egress: vm.record.net.as_ref().and(plan.egress.cloned()),
            egress_pending: false,
            volumes: plan.volumes.to_vec(),
            ports: Vec::new(),
            workspace: plan.workspace.clone(),
            metadata: plan.req.metadata.clone(),
            envs: plan.req.envs.clone(),
            alias: plan.req.alias.clone(),
            access_token: plan
                .kept
                .map_or_else(AccessToken::mint, |k| k.access_token.clone()),
            auto_pause: plan.req.auto_pause,
            port_access: plan.req.port_access.clone(),
        };
        let source = if hit { "pool" } else { "restore" };
        n.metrics
            .spawn_latency
            .with_label_values(&[source])
            .observe(t.ready_ms as f64 / 1e3);
        let sb = Arc::new(Sandbox::new(vm, rec));
        if let Err(e) = publish_ports(&sb, &plan.req.ports).await {
            first_err.get_or_insert(e);
        }
        out.push(sb.record());
        made.push(sb);
    }
    if let Some(e) = first_err {
        for sb in made {
            sb.destroy().await;
        }
        return Err(e.into());
    }
    Ok((out, made))
}

/// Starts the proxies of `ports` for `sb` (guest side: its `guest_addr`)
/// and records the bound host ports in its record.
pub(crate) async fn publish_ports(
    sb: &Sandbox,
    ports: &[forkd_net::proxy::PortSpec],
) -> anyhow::Result<()> {
    let Some(net) = sb.record().net else {
        return Ok(());
    };
    for p in ports {
        sb.publish(forkd_net::proxy::publish(p, net.guest_addr).await?);
    }
    Ok(())
}

/// The folders a spawn's children get: the snapshot's, with `rebind`
/// applied, each (recorded ones too) confined to `volume_roots` again.
pub(crate) fn child_volumes(
    n: &Node,
    src: &Source,
    rebind: &[forkd_vmm::Volume],
) -> Result<Vec<forkd_vmm::Volume>> {
    let vols = forkd_snapshot::restore::child_volumes(&src.config.volumes, rebind)?;
    vols.iter()
        .map(|v| crate::volumes::confine(&n.cfg.volume_roots, v))
        .collect()
}

/// Restores one child of the plan's snapshot on demand, confines it and
/// hands it out.
async fn restore_one(n: &Arc<Node>, plan: &Plan<'_>) -> anyhow::Result<(Vm, ChildTimings)> {
    let id = plan
        .kept
        .map_or_else(|| n.new_id(), |k| k.sandbox_id.clone());
    let mut t = ChildTimings::default();
    let mut vm = restore_paused_with(
        &n.paths,
        plan.src,
        &id,
        Lifetime::Detached,
        plan.volumes,
        &mut t,
    )
    .await
    .inspect_err(|e| crate::mount_watch::suspect(n, &format!("{e:#}")))?;
    let handed = async {
        confine(n, &vm, &plan.limits)?;
        let bare = Identity::Bare;
        hand_out(&mut vm, &id, bare, plan.egress, plan.ca, plan.t0, &mut t).await
    };
    match handed.await {
        Ok(()) => Ok((vm, t)),
        Err(e) => {
            discard(n, vm).await;
            Err(e)
        }
    }
}

/// Puts a paused child into its cgroups before it is resumed, so not one
/// guest instruction runs outside its limits. A pooled child joined them
/// when it was parked (with the default limits), so at hand-out this only
/// writes the request's values: joining costs the kernel an RCU grace
/// period (~15 ms measured here), too much for the spawn path.
pub(crate) fn confine(n: &Node, vm: &Vm, l: &Limits) -> anyhow::Result<()> {
    match (&n.cgroups, l.is_empty()) {
        (Some(h), false) => h.limit(&vm.id, &vm.pids(), l),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> SpawnRequest {
        SpawnRequest {
            tag: "base".into(),
            n: 1,
            ..Default::default()
        }
    }

    /// The first complaint about a request: the field it names and the message.
    fn check(r: SpawnRequest, cgroups: bool) -> std::result::Result<(), (&'static str, String)> {
        let h = Hierarchy::V2 {
            root: "/nonexistent".into(),
            controllers: vec!["memory".into(), "cpu".into(), "pids".into()],
        };
        r.validate(cgroups.then_some(&h), Limits::default())
            .map(drop)
            .map_err(|e| match e {
                Error::Invalid { field, reason } => (field, reason),
                other => panic!("not an Invalid: {other:?}"),
            })
    }

    fn refused(r: SpawnRequest, cgroups: bool, field: &str, why: &str) {
        let (f, msg) = check(r.clone(), cgroups).expect_err(why);
        assert_eq!(f, field, "{r:?}: {msg}");
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
    fn each_rule_refuses_naming_its_field() {
        let tag = |t: &str| SpawnRequest {
            tag: t.into(),
            ..req()
        };
        refused(tag("../x"), true, "tag", "1-64");
        refused(tag(""), true, "tag", "1-64");
        refused(
            SpawnRequest {
                net: Some(false),
                network: Some(forkd_net::EgressPolicy::default()),
                ..req()
            },
            true,
            "network",
            "net: false",
        );
        refused(
            SpawnRequest {
                n: 2,
                ports: vec![forkd_net::proxy::PortSpec::parse("9000:80").unwrap()],
                ..req()
            },
            true,
            "ports",
            "host_port with n > 1",
        );
        refused(SpawnRequest { n: 0, ..req() }, true, "n", "n must be ≥ 1");
        refused(SpawnRequest { n: 1001, ..req() }, true, "n", "≤ 1000");
        let mem = |m| SpawnRequest {
            memory_limit_mib: Some(m),
            ..req()
        };
        refused(
            mem(0),
            true,
            "memory_limit_mib",
            "memory_limit_mib must be ≥ 1",
        );
        refused(
            mem(64),
            false,
            "memory_limit_mib",
            "cgroup memory controller",
        );
        refused(
            SpawnRequest {
                cpus: Some(0.0),
                ..req()
            },
            true,
            "cpus",
            "cpus must be",
        );
        refused(
            SpawnRequest {
                pids_max: Some(2),
                ..req()
            },
            true,
            "pids_max",
            "pids_max must be",
        );
        let ttl = SpawnRequest {
            ttl_secs: Some(MAX_TTL_SECS + 1),
            ..req()
        };
        refused(ttl, true, "ttl_secs", "ttl_secs must be at most");
        let many: BTreeMap<_, _> = (0..=crate::limits::MAX_METADATA)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        refused(
            SpawnRequest {
                metadata: many,
                ..req()
            },
            true,
            "metadata",
            "at most 64 keys",
        );
        refused(
            SpawnRequest {
                envs: [("1X".to_string(), "v".to_string())].into(),
                ..req()
            },
            true,
            "envs",
            "envs: environment variable name",
        );
        refused(
            SpawnRequest {
                alias: Some(String::new()),
                ..req()
            },
            true,
            "alias",
            "alias: 1-256 bytes",
        );
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
        assert!(matches!(e, Error::Invalid { field: "net", .. }), "{e:?}");
        assert!(e.to_string().contains("--net"), "{e}");
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

    /// CA certificates are checked before anything else happens, and a
    /// refusal names the field.
    #[test]
    fn ca_certs_are_checked() {
        assert!(req().ca().unwrap().is_none());
        let bad = SpawnRequest {
            ca_certs: Some("not a certificate".into()),
            ..req()
        };
        let e = bad.ca().expect_err("refused");
        assert!(
            matches!(
                e,
                Error::Invalid {
                    field: "ca_certs",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("no PEM certificate"), "{e}");
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
        refused(all_bad.clone(), false, "tag", "1-64");
        let r = SpawnRequest {
            tag: "ok".into(),
            ..all_bad
        };
        refused(r.clone(), false, "network", "net: false");
        let r = SpawnRequest { network: None, ..r };
        refused(r.clone(), false, "n", "n must be");
        let r = SpawnRequest { n: 2, ..r };
        refused(
            r.clone(),
            false,
            "memory_limit_mib",
            "memory_limit_mib must be ≥ 1",
        );
        let r = SpawnRequest {
            memory_limit_mib: None,
            ..r
        };
        refused(r, false, "ttl_secs", "ttl_secs");
    }
}
