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
//! [pools.py]                       # a pool for snapshot tag "py"
//! min_ready = 4
//! max_ready = 8
//! ```

use anyhow::{bail, Context, Result};
pub use forkd_api::PoolSpec;
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
    /// IP addresses (DNS-rebinding protection, `daemon::hosts`).
    pub allowed_hosts: Vec<String>,
    /// Concurrent branches (forkd's cap); more get 503.
    pub branch_concurrency: usize,
    /// Concurrent snapshot creations (each boots a VM and writes the
    /// store); more get 503.
    pub snapshot_concurrency: usize,
    /// Large requests (file transfers, bodies over 1 MiB) in flight at
    /// once; more wait up to 60 s, then get 503 (`daemon::transfers`).
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
    pub e2b: crate::daemon::e2b::E2bConfig,
    /// PEM file of extra CA certificates every sandbox trusts from its
    /// hand-out on (a TLS-inspecting proxy's CA; docs/network.md). Read at
    /// start.
    pub ca_certs_file: Option<PathBuf>,
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
            bind: DEFAULT_BIND.into(),
            unix: None,
            token_file: None,
            audit_log: None,
            tls_cert: None,
            tls_key: None,
            max_sandboxes: 1000,
            refill_concurrency: 1,
            spawn_parallel: 4,
            default_ttl_secs: 0,
            allowed_paths: Vec::new(),
            volume_roots: Vec::new(),
            allowed_hosts: Vec::new(),
            branch_concurrency: 4,
            snapshot_concurrency: 2,
            transfer_concurrency: 8,
            auto_gc: true,
            min_free_memory_mib: 256,
            min_free_disk_mib: 1024,
            pools: BTreeMap::new(),
            default_cpus: None,
            default_pids_max: Some(1024),
            default_memory_limit_mib: None,
            net: NetConfig::default(),
            e2b: Default::default(),
            ca_certs_file: None,
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

    /// The limits a sandbox gets when its spawn sets none.
    pub fn default_limits(&self) -> forkd_vmm::Limits {
        forkd_vmm::Limits {
            memory_mib: self.default_memory_limit_mib,
            cpus: self.default_cpus,
            pids_max: self.default_pids_max,
        }
    }

    /// The TCP address, parsed.
    pub fn bind_addr(&self) -> Result<SocketAddr> {
        self.bind
            .parse()
            .with_context(|| format!("bad bind address {:?} (want IP:PORT)", self.bind))
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
        if self.max_sandboxes == 0 {
            bail!("max_sandboxes must be at least 1");
        }
        if self.refill_concurrency == 0 || self.spawn_parallel == 0 {
            bail!("refill_concurrency and spawn_parallel must be at least 1");
        }
        if self.branch_concurrency == 0
            || self.snapshot_concurrency == 0
            || self.transfer_concurrency == 0
        {
            bail!(
                "branch_concurrency, snapshot_concurrency and transfer_concurrency must be at least 1"
            );
        }
        self.default_limits()
            .validate()
            .context("default_memory_limit_mib / default_cpus / default_pids_max")?;
        for (tag, p) in &self.pools {
            forkd_layers::validate_tag(tag).with_context(|| format!("pool {tag:?}"))?;
            p.validate().with_context(|| format!("pool {tag:?}"))?;
        }
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
        self.net
            .egress
            .validate()
            .context("net.egress (docs/network.md)")?;
        self.internal_ranges()?;
        self.guest_ca()?;
        self.e2b.addrs()?;
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
        assert_eq!(c.internal_ranges().unwrap().len(), 2);
        let c: Config = toml::from_str("[net]\ninternal_ranges = [\"pods.local\"]\n").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("domain name"));
        let c: Config = toml::from_str("ca_certs_file = \"/nonexistent/ca.pem\"\n").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("ca_certs_file"));
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
