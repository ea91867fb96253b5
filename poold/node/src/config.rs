//! The node's settings: its limits, concurrency caps, admission floors,
//! default sandbox limits, pools and child networking. poold reads them
//! from its TOML file and flags (`poold::config`, docs/poold.md) along
//! with what its front-ends need (listeners, TLS, tokens).

use anyhow::{bail, Context, Result};
pub use forkd_api::PoolSpec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Everything the node can be told.
#[derive(Debug, Clone)]
pub struct Config {
    /// Live sandboxes at most (pooled children not counted).
    pub max_sandboxes: usize,
    /// Pool children restored at once in the background.
    pub refill_concurrency: usize,
    /// Children restored at once for one spawn request (pool misses).
    pub spawn_parallel: usize,
    /// Sandboxes are killed after this many seconds unless the spawn sets
    /// its own TTL; 0 disables.
    pub default_ttl_secs: u64,
    /// Extra directories a snapshot create may read `kernel`/`rootfs`
    /// from (besides the data dir).
    pub allowed_paths: Vec<PathBuf>,
    /// Directories whose subfolders snapshots and sandboxes may mount as
    /// volumes (docs/volumes.md); none: no volumes.
    pub volume_roots: Vec<PathBuf>,
    /// Concurrent branches; more are refused ([`crate::Error::AtCapacity`]).
    pub branch_concurrency: usize,
    /// Concurrent snapshot creations (each boots a VM and writes the store).
    pub snapshot_concurrency: usize,
    /// Reclaim store space by itself: a GC at start and shortly after every
    /// snapshot delete (deletes only release references).
    pub auto_gc: bool,
    /// New work (spawns, refills, snapshot creates, branches) is refused
    /// while the host's MemAvailable is under this (the admission module).
    pub min_free_memory_mib: u64,
    /// ... or while the data dir's filesystem has less free than this.
    pub min_free_disk_mib: u64,
    /// Pools by snapshot tag (pools set through the API override them).
    pub pools: BTreeMap<String, PoolSpec>,
    /// CPU quota (in CPUs) of a sandbox whose spawn sets no `cpus`.
    pub default_cpus: Option<f64>,
    /// Task limit of a sandbox whose spawn sets no `pids_max`.
    pub default_pids_max: Option<u64>,
    /// Memory limit of a sandbox whose spawn sets no `memory_limit_mib`.
    pub default_memory_limit_mib: Option<u64>,
    /// Child networking (docs/network.md).
    pub net: NetConfig,
    /// PEM file of extra CA certificates every sandbox trusts from its
    /// hand-out on (a TLS-inspecting proxy's CA; docs/network.md). Read
    /// when the node opens.
    pub ca_certs_file: Option<PathBuf>,
    /// This node's name in a cluster (a DNS name; docs/cluster.md): its
    /// token is minted into every sandbox id, so a gateway routes an id to
    /// its node without asking ([`forkd_api::ids`]).
    pub node_name: Option<String>,
}

/// `[net]`: the range host-side child addresses come from, the egress
/// policy of a spawn that sets none, and extra internal ranges.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetConfig {
    /// A CIDR of /30 or larger (default 10.201.0.0/16: 16384 children).
    pub range: forkd_net::AddrPool,
    /// Default egress policy (`allow_out`, `deny_out`); default: the public
    /// internet, nothing internal (private, shared, link-local, loopback,
    /// reserved ranges and the host's own addresses).
    pub egress: forkd_net::EgressPolicy,
    /// More ranges every child is denied unless its `allow_out` names them,
    /// like the built-in internal ones (a cluster's pod and service CIDRs
    /// where they are not private addresses). CIDRs only.
    pub internal_ranges: Vec<forkd_net::Target>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_sandboxes: 1000,
            refill_concurrency: 1,
            spawn_parallel: 4,
            default_ttl_secs: 0,
            allowed_paths: Vec::new(),
            volume_roots: Vec::new(),
            branch_concurrency: 4,
            snapshot_concurrency: 2,
            auto_gc: true,
            min_free_memory_mib: 256,
            min_free_disk_mib: 1024,
            pools: BTreeMap::new(),
            default_cpus: None,
            default_pids_max: Some(1024),
            default_memory_limit_mib: None,
            net: NetConfig::default(),
            ca_certs_file: None,
            node_name: None,
        }
    }
}

impl Config {
    /// The limits a sandbox gets when its spawn sets none.
    pub fn default_limits(&self) -> forkd_vmm::Limits {
        forkd_vmm::Limits {
            memory_mib: self.default_memory_limit_mib,
            cpus: self.default_cpus,
            pids_max: self.default_pids_max,
        }
    }

    /// `net.internal_ranges` as networks (names refused).
    pub fn internal_ranges(&self) -> Result<Vec<forkd_net::Ipv4Net>> {
        forkd_net::policy::networks_only(&self.net.internal_ranges, "net.internal_ranges")
            .context("net.internal_ranges (docs/network.md)")
    }

    /// The CA certificates of `ca_certs_file`, read and checked.
    pub fn guest_ca(&self) -> Result<forkd_snapshot::ca::CaBundle> {
        match &self.ca_certs_file {
            Some(p) => {
                forkd_snapshot::ca::CaBundle::read(p).context("ca_certs_file (docs/network.md)")
            }
            None => Ok(Default::default()),
        }
    }

    /// Checks every value.
    pub fn validate(&self) -> Result<()> {
        if self.max_sandboxes == 0 {
            bail!("max_sandboxes must be at least 1");
        }
        if let Some(name) = &self.node_name {
            forkd_api::ids::validate_node_name(name)
                .map_err(|e| anyhow::anyhow!("node_name: {e}"))?;
        }
        if self.refill_concurrency == 0 || self.spawn_parallel == 0 {
            bail!("refill_concurrency and spawn_parallel must be at least 1");
        }
        if self.branch_concurrency == 0 || self.snapshot_concurrency == 0 {
            bail!("branch_concurrency and snapshot_concurrency must be at least 1");
        }
        self.default_limits()
            .validate()
            .context("default_memory_limit_mib / default_cpus / default_pids_max")?;
        for (tag, p) in &self.pools {
            forkd_layers::validate_tag(tag).with_context(|| format!("pool {tag:?}"))?;
            p.validate().with_context(|| format!("pool {tag:?}"))?;
        }
        self.net
            .egress
            .validate()
            .context("net.egress (docs/network.md)")?;
        self.internal_ranges()?;
        self.guest_ca()?;
        for p in &self.allowed_paths {
            if !p.is_absolute() {
                bail!("allowed_paths entry {} must be absolute", p.display());
            }
        }
        for p in &self.volume_roots {
            if !p.is_absolute() || p == Path::new("/") {
                bail!(
                    "volume_roots entry {} must be an absolute directory other than /",
                    p.display()
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_and_zero_caps_do_not() {
        Config::default().validate().unwrap();
        for bad in [
            Config {
                max_sandboxes: 0,
                ..Config::default()
            },
            Config {
                branch_concurrency: 0,
                ..Config::default()
            },
            Config {
                volume_roots: vec!["/".into()],
                ..Config::default()
            },
            Config {
                allowed_paths: vec!["rel".into()],
                ..Config::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
