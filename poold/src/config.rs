//! poold's settings: a TOML file (path by `--config` or `$POOLD_CONFIG`),
//! every setting overridable by a flag. Unknown keys are an error, so a typo
//! does not silently fall back to a default.
//!
//! ```toml
//! bind = "127.0.0.1:8889"          # or unix = "/run/forkd/poold.sock"
//! token_file = "/etc/forkd/token"  # required for a non-loopback bind
//! tls_cert = "/etc/forkd/tls.crt"  # serve HTTPS (PEM chain, leaf first) ...
//! tls_key = "/etc/forkd/tls.key"   # ... with this PEM key; both or neither
//! audit_log = "/var/log/forkd/audit.jsonl"
//! max_sandboxes = 1000
//! refill_concurrency = 1
//! spawn_parallel = 4
//! default_ttl_secs = 0             # 0: sandboxes live until deleted
//! allowed_paths = ["/srv/images"]  # where POST /v1/snapshots may read kernel/rootfs
//! volume_roots = ["/srv/forkd-volumes"] # host folders sandboxes may mount (docs/volumes.md)
//! allowed_hosts = ["poold.internal"] # Host names answered besides localhost and IPs
//! default_cpus = 1.0               # CPU quota of a sandbox that asks for none (unset: unlimited)
//! default_pids_max = 1024          # tasks per sandbox VM process (cgroup pids)
//! default_memory_limit_mib = 2048  # unset: the guest's RAM is its only bound
//! ca_certs_file = "/etc/forkd/proxy-ca.pem" # CAs every sandbox trusts (docs/network.md)
//! node_name = "poold-0"            # this node's name in a cluster; its token starts every sandbox id (docs/cluster.md)
//!
//! [net]                            # docs/network.md
//! egress = { allow_out = ["10.0.5.20"] }  # default: public internet only
//! internal_ranges = ["44.0.0.0/8"] # denied like private ranges unless allowed
//!
//! [e2b]                            # the E2B API (docs/e2b.md); both or neither
//! bind = "127.0.0.1:3000"          # E2B_API_URL
//! sandbox_bind = "127.0.0.1:3001"  # E2B_SANDBOX_URL
//! api_key_file = "/etc/forkd/e2b-key" # unset: the token_file's token is the key
//!
//! [hub]                            # docs/hub.md, docs/cluster.md
//! url = "s3://bucket/forkd"        # AWS_* from poold's environment
//! pull = "lazy"                    # tags this node lacks: records now, chunks on demand
//! push = true                      # snapshots made here are pushed: tags are cluster-wide
//!
//! [pools.py]                       # a pool for snapshot tag "py"
//! min_ready = 4
//! max_ready = 8
//! ```

use anyhow::{bail, Context, Result};
pub use forkd_node::{NetConfig, PoolSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Default TCP address (forkd's).
pub const DEFAULT_BIND: &str = "127.0.0.1:8889";

/// Everything poold can be told.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// TCP address to serve on.
    pub bind: String,
    /// Serve on this unix socket instead of TCP.
    pub unix: Option<PathBuf>,
    /// Bearer token file (first line); required for a non-loopback bind.
    pub token_file: Option<PathBuf>,
    /// JSON-lines audit log; default `$FORKD_HOME/poold/audit.jsonl`.
    pub audit_log: Option<PathBuf>,
    /// PEM certificate chain: the TCP listener serves HTTPS (with `tls_key`).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// Live sandboxes at most (pooled children not counted).
    pub max_sandboxes: usize,
    /// Pool children restored at once in the background.
    pub refill_concurrency: usize,
    /// Children restored at once for one spawn request (pool misses).
    pub spawn_parallel: usize,
    /// Sandboxes are killed after this many seconds unless the request sets
    /// its own `ttl_secs`; 0 disables.
    pub default_ttl_secs: u64,
    /// Extra directories `POST /v1/snapshots` may read `kernel`/`rootfs`
    /// from (besides the data dir).
    pub allowed_paths: Vec<PathBuf>,
    /// Directories whose subfolders snapshots and sandboxes may mount as
    /// volumes (docs/volumes.md); none: no volumes.
    pub volume_roots: Vec<PathBuf>,
    /// Host names (`Host` header) poold answers to besides `localhost` and
    /// IP addresses (DNS-rebinding protection, `forkd_edge::hosts`).
    pub allowed_hosts: Vec<String>,
    /// Concurrent branches (forkd's cap); more get 503.
    pub branch_concurrency: usize,
    /// Concurrent snapshot creations (each boots a VM and writes the
    /// store); more get 503.
    pub snapshot_concurrency: usize,
    /// Large requests (file transfers, bodies over 1 MiB) in flight at
    /// once; more wait up to 60 s, then get 503 (`forkd_edge::transfers`).
    pub transfer_concurrency: usize,
    /// Reclaim store space by itself: a GC runs at start and shortly after
    /// every snapshot delete (deletes only release references).
    pub auto_gc: bool,
    /// New work (spawns, pool refills, snapshot creates, branches) is
    /// refused with 503 while the host's MemAvailable is under this.
    pub min_free_memory_mib: u64,
    /// ... or while the data dir's filesystem has less free than this.
    pub min_free_disk_mib: u64,
    /// Pools by snapshot tag.
    pub pools: BTreeMap<String, PoolSpec>,
    /// CPU quota (in CPUs) of a sandbox whose spawn sets no `cpus`.
    pub default_cpus: Option<f64>,
    /// Task limit of a sandbox whose spawn sets no `pids_max`.
    pub default_pids_max: Option<u64>,
    /// Memory limit of a sandbox whose spawn sets no `memory_limit_mib`.
    pub default_memory_limit_mib: Option<u64>,
    /// Child networking (docs/network.md).
    pub net: NetConfig,
    /// The E2B API's listeners and key (docs/e2b.md).
    pub e2b: forkd_e2b::E2bConfig,
    /// PEM file of extra CA certificates every sandbox trusts from its
    /// hand-out on (a TLS-inspecting proxy's CA; docs/network.md). Read at
    /// start.
    pub ca_certs_file: Option<PathBuf>,
    /// This node's name in a cluster (a DNS name): its token starts every
    /// sandbox id, so a gateway routes ids without asking (docs/cluster.md).
    pub node_name: Option<String>,
    /// The snapshot hub: tags pulled at start, tags this node lacks pulled
    /// on demand, snapshots made here pushed (docs/cluster.md).
    pub hub: Option<forkd_hub::lazy::HubConfig>,
}

impl Default for Config {
    fn default() -> Self {
        let node = forkd_node::Config::default();
        Config {
            bind: DEFAULT_BIND.into(),
            unix: None,
            token_file: None,
            audit_log: None,
            tls_cert: None,
            tls_key: None,
            max_sandboxes: node.max_sandboxes,
            refill_concurrency: node.refill_concurrency,
            spawn_parallel: node.spawn_parallel,
            default_ttl_secs: node.default_ttl_secs,
            allowed_paths: node.allowed_paths,
            volume_roots: node.volume_roots,
            allowed_hosts: Vec::new(),
            branch_concurrency: node.branch_concurrency,
            snapshot_concurrency: node.snapshot_concurrency,
            transfer_concurrency: 8,
            auto_gc: node.auto_gc,
            min_free_memory_mib: node.min_free_memory_mib,
            min_free_disk_mib: node.min_free_disk_mib,
            pools: node.pools,
            default_cpus: node.default_cpus,
            default_pids_max: node.default_pids_max,
            default_memory_limit_mib: node.default_memory_limit_mib,
            net: node.net,
            e2b: Default::default(),
            ca_certs_file: node.ca_certs_file,
            node_name: node.node_name,
            hub: None,
        }
    }
}

impl Config {
    /// Loads `path`, or the defaults when `path` is `None`.
    pub fn load(path: Option<&Path>) -> Result<Config> {
        let Some(path) = path else {
            return Ok(Config::default());
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        let cfg: Config =
            toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))?;
        Ok(cfg)
    }

    /// The node's part of the settings.
    pub fn node(&self) -> forkd_node::Config {
        forkd_node::Config {
            max_sandboxes: self.max_sandboxes,
            refill_concurrency: self.refill_concurrency,
            spawn_parallel: self.spawn_parallel,
            default_ttl_secs: self.default_ttl_secs,
            allowed_paths: self.allowed_paths.clone(),
            volume_roots: self.volume_roots.clone(),
            branch_concurrency: self.branch_concurrency,
            snapshot_concurrency: self.snapshot_concurrency,
            auto_gc: self.auto_gc,
            min_free_memory_mib: self.min_free_memory_mib,
            min_free_disk_mib: self.min_free_disk_mib,
            pools: self.pools.clone(),
            default_cpus: self.default_cpus,
            default_pids_max: self.default_pids_max,
            default_memory_limit_mib: self.default_memory_limit_mib,
            net: self.net.clone(),
            ca_certs_file: self.ca_certs_file.clone(),
            node_name: self.node_name.clone(),
        }
    }

    /// The TCP address, parsed.
    pub fn bind_addr(&self) -> Result<SocketAddr> {
        self.bind
            .parse()
            .with_context(|| format!("bad bind address {:?} (want IP:PORT)", self.bind))
    }

    /// Checks every value; called once flags are applied.
    pub fn validate(&self) -> Result<()> {
        if self.unix.is_none() {
            self.bind_addr()?;
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) | (None, Some(_)) => {
                bail!("tls_cert and tls_key go together: give both (PEM certificate chain and its key) or neither")
            }
            (Some(_), Some(_)) if self.unix.is_some() => {
                bail!("tls_cert/tls_key apply to the TCP listener; a unix socket is served without TLS (drop one of them)")
            }
            _ => {}
        }
        if self.transfer_concurrency == 0 {
            bail!("transfer_concurrency must be at least 1");
        }
        self.node().validate()?;
        for h in &self.allowed_hosts {
            let ok = !h.is_empty()
                && h.len() <= 253
                && h.trim_end_matches('.').split('.').all(|l| {
                    !l.is_empty()
                        && l.len() <= 63
                        && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                });
            if !ok {
                bail!("allowed_hosts entry {h:?} is not a host name (letters, digits, '-' and '.'; no port, no scheme)");
            }
        }
        self.e2b.addrs()?;
        if let Some(h) = &self.hub {
            forkd_hub::Hub::open(&h.url, None).with_context(|| format!("[hub] url {:?}", h.url))?;
            for t in &h.tags {
                forkd_hub::Key::tag(t).with_context(|| format!("[hub] tags: {t:?}"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pools_and_refuses_typos() {
        let c: Config =
            toml::from_str("bind = \"127.0.0.1:9000\"\n[pools.py]\nmin_ready = 4\nmax_ready = 8\n")
                .unwrap();
        c.validate().unwrap();
        assert_eq!(c.pools["py"].min_ready, 4);
        assert_eq!(c.pools["py"].max(), 8);
        assert!(c.pools["py"].warm);
        assert!(toml::from_str::<Config>("bnid = \"x\"").is_err());
        let bad: Config = toml::from_str("[pools.\"../x\"]\nmin_ready = 1\n").unwrap();
        assert!(bad.validate().is_err());
        let c: Config = toml::from_str("allowed_hosts = [\"poold.internal\"]").unwrap();
        c.validate().unwrap();
        for bad in ["http://x", "x:80", "", "a..b", "a b"] {
            let c = Config {
                allowed_hosts: vec![bad.into()],
                ..Config::default()
            };
            assert!(c.validate().is_err(), "{bad:?}");
        }
        let bad: Config = toml::from_str("[pools.a]\nmin_ready = 4\nmax_ready = 2\n").unwrap();
        assert!(bad.validate().is_err());
    }

    #[test]
    fn tls_needs_cert_and_key_and_tcp() {
        let c: Config = toml::from_str("tls_cert = \"/c\"\ntls_key = \"/k\"\n").unwrap();
        c.validate().unwrap();
        let c: Config = toml::from_str("tls_cert = \"/c\"\n").unwrap();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("go together"));
        let c: Config =
            toml::from_str("tls_cert = \"/c\"\ntls_key = \"/k\"\nunix = \"/s\"\n").unwrap();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("unix socket"));
    }

    #[test]
    fn net_section_parses_and_refuses_bad_ranges() {
        let c: Config = toml::from_str(
            "[net]\nrange = \"10.77.0.0/20\"\negress = { deny_out = [\"0.0.0.0/0\"], allow_out = [\"192.0.2.0/24\"] }\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.net.range.slots(), 1024);
        assert_eq!(Config::default().net.range.slots(), 16384);
        let c: Config =
            toml::from_str("[net]\ninternal_ranges = [\"44.0.0.0/8\", \"10.96.0.0/12\"]\n")
                .unwrap();
        assert_eq!(c.node().internal_ranges().unwrap().len(), 2);
        let c: Config = toml::from_str("[net]\ninternal_ranges = [\"pods.local\"]\n").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("domain name"));
        let c: Config = toml::from_str("ca_certs_file = \"/nonexistent/ca.pem\"\n").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("ca_certs_file"));
        let c: Config = toml::from_str("node_name = \"poold-0\"\n").unwrap();
        c.validate().unwrap();
        assert_eq!(c.node().node_name.as_deref(), Some("poold-0"));
        let c: Config = toml::from_str("node_name = \"Poold_0\"\n").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("node_name"));
        for bad in [
            "range = \"10.77.0.1/20\"",
            "range = \"10.42.0.0/16\"",
            "rnage = \"x\"",
        ] {
            let e = toml::from_str::<Config>(&format!("[net]\n{bad}\n"));
            assert!(e.is_err(), "{bad}");
        }
    }
}
