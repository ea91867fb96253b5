//! The VM runner's side of per-child networking (docs/network.md): the
//! process-wide address range and default policy, and async wrappers
//! around `forkd_net`'s blocking calls. A networked snapshot's children get
//! their namespace when restored ([`create_child`]) and their policy and
//! DNS when handed out; [`super::Vm::destroy`] tears the network down.

use anyhow::{Context, Result};
use forkd_net::{AddrPool, Baseline, ChildNet, EffectivePolicy, EgressPolicy};
use std::path::Path;
use std::sync::OnceLock;

struct Settings {
    pool: AddrPool,
    egress: EgressPolicy,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Sets the address range and default egress policy (poold's config) once,
/// before any child is restored. Later calls are ignored.
pub fn configure(pool: AddrPool, egress: EgressPolicy) {
    let _ = SETTINGS.set(Settings { pool, egress });
}

/// The operator's ranges denied like the built-in internal ones
/// (`net.internal_ranges`).
static INTERNAL: OnceLock<Vec<forkd_net::Ipv4Net>> = OnceLock::new();

/// Sets the extra internal ranges (poold's config) once, before any child
/// is restored. Later calls are ignored.
pub fn configure_internal(ranges: Vec<forkd_net::Ipv4Net>) {
    let _ = INTERNAL.set(ranges);
}

fn settings() -> &'static Settings {
    SETTINGS.get_or_init(|| Settings {
        pool: std::env::var("FORKD_NET_RANGE")
            .ok()
            .and_then(|r| AddrPool::parse(&r).ok())
            .unwrap_or_default(),
        egress: EgressPolicy::default(),
    })
}

/// The configured range of host-side addresses.
pub fn pool() -> AddrPool {
    settings().pool
}

/// The default egress policy for a spawn that names none.
pub fn default_egress() -> EgressPolicy {
    settings().egress.clone()
}

/// Set once the root namespace is prepared in this process.
static HOST_READY: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

/// Prepares the root namespace (forwarding, `table inet forkd`) once per
/// process; a failure is returned and retried by the next caller. poold
/// calls it at start, and every child network's creation before it, so a
/// `forkd fork` or `forkd run` of a networked snapshot gets NAT too.
pub async fn ensure_host() -> Result<()> {
    HOST_READY
        .get_or_try_init(|| async {
            let pool = pool();
            tokio::task::spawn_blocking(move || forkd_net::host_setup(&pool))
                .await
                .context("network setup task panicked")?
                .context("preparing the host for child networks (docs/network.md)")
                .map(drop)
        })
        .await
        .map(drop)
}

/// Creates the network of VM `id` of the data dir `data_dir` (its scope,
/// [`forkd_net::scope_of`]).
pub async fn create_child(data_dir: &Path, id: &str) -> Result<ChildNet> {
    ensure_host().await?;
    let (pool, id) = (pool(), id.to_string());
    let scope = forkd_net::scope_of(data_dir);
    tokio::task::spawn_blocking(move || forkd_net::create_child(&pool, &scope, &id))
        .await
        .context("network setup task panicked")?
        .context("creating the child's network namespace (docs/network.md)")
}

/// What every child gets whatever its policy: the internal ranges (built-in
/// and configured) and the host's upstream resolvers, read now.
pub fn baseline() -> Baseline {
    let extra = INTERNAL.get().map(Vec::as_slice).unwrap_or_default();
    Baseline::new(extra, forkd_net::upstream_resolvers())
}

/// What a child with `policy` may reach (`SandboxInfo.egress`).
pub fn effective(policy: &EgressPolicy) -> EffectivePolicy {
    baseline().effective(policy)
}

/// Applies `policy` to the child's network (replacing the previous one).
pub async fn apply_policy(net: &ChildNet, policy: &EgressPolicy) -> Result<()> {
    let (net, policy) = (net.clone(), policy.clone());
    tokio::task::spawn_blocking(move || forkd_net::apply_policy(&net, &policy, &baseline()))
        .await
        .context("network policy task panicked")?
        .map_err(anyhow::Error::from)
}

/// Applies a policy already resolved (`EgressPolicy::resolve`) to the
/// child's network: no lookup between the caller's check and the write.
pub async fn apply_resolved(net: &ChildNet, resolved: &forkd_net::ResolvedPolicy) -> Result<()> {
    let (net, resolved) = (net.clone(), resolved.clone());
    tokio::task::spawn_blocking(move || forkd_net::apply_resolved(&net, &resolved, &baseline()))
        .await
        .context("network policy task panicked")?
        .map_err(anyhow::Error::from)
}

/// Tears a child's network down; failures are logged (reconcile at the
/// next start removes what is left).
pub async fn teardown(net: ChildNet) {
    let name = net.netns.clone();
    match tokio::task::spawn_blocking(move || forkd_net::teardown(&net)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("tearing down network {name}: {e}"),
        Err(e) => tracing::warn!("tearing down network {name}: {e}"),
    }
}

/// Removes every child network of the data dir `data_dir` that no VM in
/// `owned` has (and what provably belongs to no instance).
pub async fn reconcile(data_dir: &Path, owned: Vec<ChildNet>) -> Result<forkd_net::Reconciled> {
    let scope = forkd_net::scope_of(data_dir);
    tokio::task::spawn_blocking(move || forkd_net::reconcile(&scope, &owned))
        .await
        .context("network reconcile task panicked")?
        .map_err(anyhow::Error::from)
}

/// Up to three of the host's upstream resolvers, for the guest.
pub fn nameservers() -> Vec<std::net::Ipv4Addr> {
    let mut r = forkd_net::upstream_resolvers();
    r.truncate(3);
    r
}
