//! poold's command line: every config setting can be given as a flag, which
//! overrides the config file.

use crate::config::Config;
use clap::Parser;
use forkd_snapshot::Paths;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "poold",
    version,
    about = "forkd's daemon: the /v1 REST API, warm pools, sandboxes that survive restarts"
)]
pub struct Args {
    /// Data dir (default /var/lib/forkd).
    #[arg(long, env = "FORKD_HOME")]
    pub home: Option<PathBuf>,
    /// TOML config file.
    #[arg(long, env = "POOLD_CONFIG")]
    pub config: Option<PathBuf>,
    /// TCP address (default 127.0.0.1:8889).
    #[arg(long)]
    pub bind: Option<String>,
    /// Serve on a unix socket instead of TCP.
    #[arg(long)]
    pub unix: Option<PathBuf>,
    /// Bearer token file; required for a non-loopback bind.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Audit log (JSON lines).
    #[arg(long)]
    pub audit_log: Option<PathBuf>,
    /// Serve HTTPS on the TCP listener with this PEM certificate chain (with --tls-key).
    #[arg(long, value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// This node's name in a cluster (a DNS name, e.g. the Kubernetes node name): its
    /// token starts every sandbox id (docs/cluster.md).
    #[arg(long, env = "FORKD_NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    #[arg(long)]
    pub max_sandboxes: Option<usize>,
    /// Pool children restored at once in the background.
    #[arg(long)]
    pub refill_concurrency: Option<usize>,
    /// Children restored at once for one spawn request.
    #[arg(long)]
    pub spawn_parallel: Option<usize>,
    /// Kill sandboxes after this many seconds by default (0: never).
    #[arg(long)]
    pub default_ttl_secs: Option<u64>,
    /// Extra directory POST /v1/snapshots may read kernel/rootfs from (repeatable).
    #[arg(long = "allow-path")]
    pub allowed_paths: Vec<PathBuf>,
    /// A directory whose subfolders sandboxes may mount (repeatable;
    /// docs/volumes.md).
    #[arg(long = "volume-root", value_name = "DIR")]
    pub volume_roots: Vec<PathBuf>,
    /// A host name clients reach poold by, besides localhost and IP
    /// addresses (repeatable; DNS-rebinding protection refuses others).
    #[arg(long = "allow-host", value_name = "NAME")]
    pub allowed_hosts: Vec<String>,
    #[arg(long)]
    pub branch_concurrency: Option<usize>,
    /// Snapshot creations at once (503 beyond).
    #[arg(long)]
    pub snapshot_concurrency: Option<usize>,
    /// A pool: TAG=MIN[:MAX] (repeatable); add ",cold" to park children
    /// without their warm-up run.
    #[arg(long = "pool", value_name = "TAG=MIN[:MAX][,cold]")]
    pub pools: Vec<String>,
    /// Serve the E2B API (E2B_API_URL) here, e.g. 127.0.0.1:3000 (docs/e2b.md).
    #[arg(long, value_name = "IP:PORT")]
    pub e2b_bind: Option<String>,
    /// Serve E2B sandbox traffic (E2B_SANDBOX_URL) here, e.g. 127.0.0.1:3001.
    #[arg(long, value_name = "IP:PORT")]
    pub e2b_sandbox_bind: Option<String>,
    /// File holding the E2B API key (X-API-KEY); default: the bearer token.
    #[arg(long)]
    pub e2b_api_key_file: Option<PathBuf>,
    /// Domain of sandbox URLs (`get_host(port)` is PORT-ID.DOMAIN);
    /// default localhost:<sandbox plane port> (docs/e2b.md, "Ports").
    #[arg(long, value_name = "HOST[:PORT]")]
    pub e2b_sandbox_domain: Option<String>,
}

impl Args {
    /// The config file with the flags applied.
    pub fn config(&self) -> anyhow::Result<Config> {
        let mut c = Config::load(self.config.as_deref())?;
        if let Some(v) = &self.bind {
            c.bind = v.clone();
        }
        if let Some(v) = &self.unix {
            c.unix = Some(v.clone());
        }
        if let Some(v) = &self.token_file {
            c.token_file = Some(v.clone());
        }
        if let Some(v) = &self.audit_log {
            c.audit_log = Some(v.clone());
        }
        if let Some(v) = &self.tls_cert {
            c.tls_cert = Some(v.clone());
        }
        if let Some(v) = &self.tls_key {
            c.tls_key = Some(v.clone());
        }
        if let Some(v) = &self.node_name {
            c.node_name = Some(v.clone());
        }
        if let Some(v) = self.max_sandboxes {
            c.max_sandboxes = v;
        }
        if let Some(v) = self.refill_concurrency {
            c.refill_concurrency = v;
        }
        if let Some(v) = self.spawn_parallel {
            c.spawn_parallel = v;
        }
        if let Some(v) = self.default_ttl_secs {
            c.default_ttl_secs = v;
        }
        if let Some(v) = self.branch_concurrency {
            c.branch_concurrency = v;
        }
        if let Some(v) = self.snapshot_concurrency {
            c.snapshot_concurrency = v;
        }
        if let Some(v) = &self.e2b_bind {
            c.e2b.bind = Some(v.clone());
        }
        if let Some(v) = &self.e2b_sandbox_bind {
            c.e2b.sandbox_bind = Some(v.clone());
        }
        if let Some(v) = &self.e2b_api_key_file {
            c.e2b.api_key_file = Some(v.clone());
        }
        if let Some(v) = &self.e2b_sandbox_domain {
            c.e2b.sandbox_domain = Some(v.clone());
        }
        c.allowed_paths.extend(self.allowed_paths.iter().cloned());
        c.volume_roots.extend(self.volume_roots.iter().cloned());
        c.allowed_hosts.extend(self.allowed_hosts.iter().cloned());
        for p in &self.pools {
            let (tag, spec) = parse_pool(p)?;
            c.pools.insert(tag, spec);
        }
        c.validate()?;
        Ok(c)
    }
}

/// `TAG=MIN[:MAX][,cold]`: `cold` parks children without the warm-up run.
fn parse_pool(s: &str) -> anyhow::Result<(String, crate::config::PoolSpec)> {
    let bad = || {
        anyhow::anyhow!(
            "bad --pool {s:?}: expected TAG=MIN or TAG=MIN:MAX, optionally followed by ,cold"
        )
    };
    let (tag, spec) = s.split_once('=').ok_or_else(bad)?;
    let (n, warm) = match spec.split_once(',') {
        Some((n, "cold")) => (n, false),
        Some(_) => return Err(bad()),
        None => (spec, true),
    };
    let (min, max) = match n.split_once(':') {
        Some((a, b)) => (
            a.parse().map_err(|_| bad())?,
            Some(b.parse().map_err(|_| bad())?),
        ),
        None => (n.parse().map_err(|_| bad())?, None),
    };
    Ok((
        tag.to_string(),
        crate::config::PoolSpec {
            min_ready: min,
            max_ready: max,
            warm,
            warm_eval: None,
            page_out: false,
            keep_resident: None,
            network: None,
        },
    ))
}

/// Raises the soft limit on open files to the hard one: every sandbox
/// holds a QMP and an agent socket (and its published ports' sockets), so
/// the usual soft limit of 1024 would cap a host at a few hundred.
fn raise_nofile_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("could not raise the open-files limit from {soft} to {hard}: {e}");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("reading the open-files limit: {e}"),
    }
}

/// Entry point of the poold binary.
pub fn main() -> ExitCode {
    // Files poold creates hold sandbox data: private even where a mode is
    // not set explicitly (RocksDB, qemu-img, forkd-fs's socket and log).
    forkd_vmm::private::restrict_umask();
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("POOLD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    raise_nofile_limit();
    let paths = match &args.home {
        Some(h) => Paths::new(h),
        None => Paths::from_env(),
    };
    let result = args
        .config()
        .and_then(|cfg| tokio::runtime::Runtime::new()?.block_on(crate::run(paths, cfg)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("poold: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_pool;

    #[test]
    fn pool_flags() {
        let (t, p) = parse_pool("py=4:8").unwrap();
        assert_eq!(
            (t.as_str(), p.min_ready, p.max_ready, p.warm),
            ("py", 4, Some(8), true)
        );
        let (_, p) = parse_pool("py=2,cold").unwrap();
        assert_eq!((p.min_ready, p.max_ready, p.warm), (2, None, false));
        for bad in ["py", "py=x", "py=1:y", "py=1,hot", "py=1:2:3"] {
            let e = parse_pool(bad).unwrap_err().to_string();
            assert!(e.contains("TAG=MIN"), "{bad}: {e}");
        }
    }
}
