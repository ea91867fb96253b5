//! The commands that drive a running poold: `forkd spawn|ls|kill|exec|eval`
//! and `forkd pool get|set|rm` (`$FORKD_URL`, `$FORKD_TOKEN`).

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use forkd_api::Client;
use forkd_api::PoolStatus;
use forkd_api::{EvalReply, ExecReply, SandboxInfo};
use serde_json::json;
use std::io::Write;

#[derive(Args, Debug)]
pub struct SpawnArgs {
    /// Snapshot tag.
    #[arg(long)]
    pub tag: String,
    #[arg(short = 'n', long, default_value_t = 1)]
    pub n: usize,
    /// Kill the sandboxes after this many seconds.
    #[arg(long)]
    pub ttl: Option<u64>,
    #[command(flatten)]
    pub settings: SandboxSettings,
    /// PEM file of extra CA certificates the sandboxes trust, e.g. a
    /// TLS-inspecting proxy's (docs/network.md); checked here first.
    #[arg(long = "ca-cert", value_name = "PEM")]
    pub ca_cert: Option<std::path::PathBuf>,
    /// Print the JSON answer.
    #[arg(long)]
    pub json: bool,
}

/// What a sandbox is given besides its snapshot: limits, network, published
/// ports, host folders. Shared by `forkd spawn` and `forkd workspace create`,
/// whose API bodies take the same fields.
#[derive(Args, Debug)]
pub struct SandboxSettings {
    /// Memory limit per sandbox (cgroup), MiB.
    #[arg(long)]
    pub memory_limit_mib: Option<u64>,
    /// CPU quota per sandbox (cgroup), in CPUs: 0.5 is half a core.
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Most tasks a sandbox's VM process may hold (cgroup pids).
    #[arg(long)]
    pub pids_max: Option<u64>,
    /// Require a network (the snapshot must have a NIC).
    #[arg(long, conflicts_with = "no_net")]
    pub net: bool,
    /// No way out for a networked snapshot's sandboxes (deny all egress).
    #[arg(long)]
    pub no_net: bool,
    /// Allow egress to an address, CIDR or domain name (repeatable);
    /// docs/network.md has the rules.
    #[arg(long = "allow-out", value_name = "TARGET", conflicts_with = "no_net")]
    pub allow_out: Vec<String>,
    /// Deny egress to an address, CIDR or domain name (repeatable);
    /// `--deny-out 0.0.0.0/0` denies all but --allow-out.
    #[arg(long = "deny-out", value_name = "TARGET", conflicts_with = "no_net")]
    pub deny_out: Vec<String>,
    /// Publish a guest port: GUEST_PORT, HOST_PORT:GUEST_PORT or
    /// HOST_ADDR:HOST_PORT:GUEST_PORT (repeatable; default address 127.0.0.1).
    #[arg(long = "publish", short = 'p', value_name = "PORTS")]
    pub publish: Vec<String>,
    /// Give the sandboxes another host folder at one of the snapshot's
    /// volume guest paths: HOST:GUEST[:ro|rw] (repeatable; docs/volumes.md).
    #[arg(long = "volume", short = 'v', value_name = "HOST:GUEST[:ro|rw]")]
    pub volumes: Vec<String>,
}

impl SandboxSettings {
    /// Sets the request fields these flags name in `body`; checks network
    /// targets and ports here, so a typo fails before any request.
    pub fn apply(&self, body: &mut serde_json::Value) -> Result<()> {
        if !self.volumes.is_empty() {
            body["volumes"] = json!(volume_specs(&self.volumes)?);
        }
        if let Some(m) = self.memory_limit_mib {
            body["memory_limit_mib"] = json!(m);
        }
        if let Some(c) = self.cpus {
            body["cpus"] = json!(c);
        }
        if let Some(p) = self.pids_max {
            body["pids_max"] = json!(p);
        }
        if self.net || self.no_net {
            body["net"] = json!(self.net);
        }
        if !self.allow_out.is_empty() || !self.deny_out.is_empty() {
            for t in self.allow_out.iter().chain(&self.deny_out) {
                forkd_net::Target::parse(t)?;
            }
            body["network"] = json!({"allow_out": self.allow_out, "deny_out": self.deny_out});
        }
        if !self.publish.is_empty() {
            let ports = self
                .publish
                .iter()
                .map(|p| forkd_net::proxy::PortSpec::parse(p))
                .collect::<Result<Vec<_>, _>>()?;
            body["ports"] = json!(ports);
        }
        Ok(())
    }
}

#[derive(Args, Debug)]
pub struct ExecArgs {
    /// Sandbox id.
    pub id: String,
    /// Seconds before the command's process group is killed.
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

#[derive(Args, Debug)]
pub struct BranchArgs {
    /// Sandbox id.
    pub id: String,
    /// Tag for the new snapshot (default: branch-<id>-<unix>-<suffix>).
    #[arg(long)]
    pub tag: Option<String>,
    /// live (precopy, ms pause), diff (the same here) or full (stop-and-copy).
    #[arg(long, default_value = "live")]
    pub mode: String,
    /// Return once the sandbox runs again; the snapshot is written in the
    /// background (live mode only).
    #[arg(long)]
    pub no_wait: bool,
}

#[derive(Subcommand, Debug)]
pub enum PoolCmd {
    /// Show one pool, or all.
    Get { tag: Option<String> },
    /// Keep MIN paused children of TAG ready (at most MAX).
    Set {
        tag: String,
        #[arg(long)]
        min: usize,
        #[arg(long)]
        max: Option<usize>,
        /// Park children without the warm-up round trip.
        #[arg(long, conflicts_with = "warm_eval")]
        no_warm: bool,
        /// Code the warm-up evaluates in each child before parking it (your
        /// typical first request): under TCG the child's first request is
        /// then as fast as later ones. What it defines stays defined.
        #[arg(long, value_name = "CODE")]
        warm_eval: Option<String>,
        /// Page each parked child out to swap: a few MiB resident instead
        /// of ~30 (TCG), a slower hand-out. Needs swap on the host
        /// (docs/poold.md, "Parking children in swap").
        #[arg(long)]
        page_out: bool,
        /// With --page-out: ready children kept resident and handed out
        /// first (default 2).
        #[arg(long, requires = "page_out", value_name = "N")]
        keep_resident: Option<usize>,
    },
    /// Remove a pool and destroy its children.
    Rm { tag: String },
}

pub async fn spawn(a: SpawnArgs) -> Result<i32> {
    let c = Client::from_env()?;
    let mut body = json!({"snapshot_tag": a.tag, "n": a.n});
    a.settings.apply(&mut body)?;
    if let Some(t) = a.ttl {
        body["ttl_secs"] = json!(t);
    }
    if let Some(p) = &a.ca_cert {
        body["ca_certs"] = json!(forkd_snapshot::ca::CaBundle::read(p)?.pem());
    }
    let t0 = std::time::Instant::now();
    let made: Vec<SandboxInfo> = c.post("/v1/sandboxes", body).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&made)?);
    } else {
        for s in &made {
            match &s.guest_addr {
                Some(addr) => {
                    let ports: Vec<String> = s
                        .ports
                        .iter()
                        .map(|p| format!("{}:{}->{}", p.host_addr, p.host_port, p.guest_port))
                        .collect();
                    println!("{}\t{addr}\t{}", s.id, ports.join(","));
                }
                None => println!("{}", s.id),
            }
        }
        let hits = made.iter().filter(|s| s.pool_hit).count();
        eprintln!(
            "{} sandboxes of {} ready in {} ms ({hits} from the pool)",
            made.len(),
            a.tag,
            t0.elapsed().as_millis()
        );
    }
    Ok(0)
}

pub async fn ls(json_out: bool) -> Result<i32> {
    let c = Client::from_env()?;
    let all: Vec<SandboxInfo> = c.get("/v1/sandboxes").await?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(0);
    }
    println!(
        "{:<28} {:<20} {:>8} {:>9}  CREATED",
        "ID", "SNAPSHOT", "PID", "MEM LIMIT"
    );
    for s in &all {
        println!(
            "{:<28} {:<20} {:>8} {:>9}  {}",
            s.id,
            s.snapshot_tag,
            s.pid.map_or("-".into(), |p| p.to_string()),
            s.memory_limit_mib.map_or("-".into(), |m| format!("{m}M")),
            forkd_snapshot::format_unix(s.created_at_unix)
        );
    }
    Ok(0)
}

pub async fn kill(ids: Vec<String>, all: bool) -> Result<i32> {
    let c = Client::from_env()?;
    let ids = if all {
        let l: Vec<SandboxInfo> = c.get("/v1/sandboxes").await?;
        l.into_iter().map(|s| s.id).collect()
    } else if ids.is_empty() {
        bail!("name the sandboxes to kill, or --all");
    } else {
        ids
    };
    for id in &ids {
        c.delete(&format!("/v1/sandboxes/{}", path_part(id)?))
            .await?;
        println!("killed {id}");
    }
    Ok(0)
}

pub async fn exec(a: ExecArgs) -> Result<i32> {
    let c = Client::from_env()?;
    let r: ExecReply = c
        .post(
            &format!("/v1/sandboxes/{}/exec", path_part(&a.id)?),
            json!({"args": a.cmd, "timeout_secs": a.timeout}),
        )
        .await?;
    std::io::stdout().write_all(r.stdout.as_bytes())?;
    std::io::stderr().write_all(r.stderr.as_bytes())?;
    if r.timed_out {
        eprintln!("forkd: command timed out and was killed");
    }
    Ok(r.exit_code.clamp(0, 255) as i32)
}

pub async fn eval(id: String, code: String) -> Result<i32> {
    let c = Client::from_env()?;
    let r: EvalReply = c
        .post(
            &format!("/v1/sandboxes/{}/eval", path_part(&id)?),
            json!({ "code": code }),
        )
        .await?;
    print!("{}", r.stdout);
    eprint!("{}", r.stderr);
    if let Some(e) = r.error {
        eprintln!("{}", r.traceback.unwrap_or(e));
        return Ok(1);
    }
    if let Some(v) = r.result {
        println!("{v}");
    }
    Ok(0)
}

pub async fn branch(a: BranchArgs) -> Result<i32> {
    let c = Client::from_env()?;
    let mut body = json!({"mode": a.mode});
    if let Some(t) = &a.tag {
        body["tag"] = json!(t);
    }
    if a.no_wait {
        body["wait"] = json!(false);
    }
    let info: forkd_api::SnapshotInfo = c
        .post(&format!("/v1/sandboxes/{}/branch", path_part(&a.id)?), body)
        .await?;
    println!(
        "{} {} (paused {} ms{})",
        if info.status == "writing" {
            "writing"
        } else {
            "snapshot"
        },
        info.tag,
        info.pause_ms.unwrap_or(0),
        info.diff_physical_bytes
            .map(|b| format!(", {} new in the store", forkd_snapshot::mib(b)))
            .unwrap_or_default()
    );
    Ok(0)
}

pub async fn pool(cmd: PoolCmd) -> Result<i32> {
    let c = Client::from_env()?;
    let show = |p: &PoolStatus| {
        println!(
            "{:<24} ready {:>3}/{:<3} (max {:>3}) in flight {:>2}  hits {:>5} misses {:>5}{}{}",
            p.tag,
            p.ready,
            p.min_ready,
            p.max_ready,
            p.in_flight,
            p.hits,
            p.misses,
            if p.warm { "" } else { "  (no warm-up)" },
            if p.page_out {
                format!("  (paged out, {} resident)", p.resident)
            } else {
                String::new()
            }
        )
    };
    match cmd {
        PoolCmd::Get { tag: None } => {
            let all: Vec<PoolStatus> = c.get("/v1/pools").await?;
            all.iter().for_each(show);
        }
        PoolCmd::Get { tag: Some(t) } => {
            show(&c.get(&format!("/v1/pools/{}", path_part(&t)?)).await?)
        }
        PoolCmd::Set {
            tag,
            min,
            max,
            no_warm,
            warm_eval,
            page_out,
            keep_resident,
        } => {
            let mut body =
                json!({"min_ready": min, "max_ready": max, "warm": !no_warm, "page_out": page_out});
            if let Some(k) = keep_resident {
                body["keep_resident"] = json!(k);
            }
            if let Some(code) = warm_eval {
                body["warm_eval"] = json!(code);
            }
            let p: PoolStatus = c
                .put(&format!("/v1/pools/{}", path_part(&tag)?), body)
                .await?;
            show(&p);
        }
        PoolCmd::Rm { tag } => {
            c.delete(&format!("/v1/pools/{}", path_part(&tag)?)).await?;
            println!("removed pool {tag}");
        }
    }
    Ok(0)
}

/// A tag or id as one URL path segment: refuses anything that is not
/// `[A-Za-z0-9_-]`, so it cannot change the path.
pub(crate) fn path_part(s: &str) -> Result<&str> {
    if s.is_empty()
        || s.len() > 64
        || !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        bail!("{s:?} is not a valid id or tag (1-64 of A-Z a-z 0-9 _ -)");
    }
    Ok(s)
}

/// `--volume HOST:GUEST[:ro|rw]` values as the API's volumes; a relative
/// host path is taken from the current directory.
pub fn volume_specs(args: &[String]) -> Result<Vec<forkd_api::VolumeSpec>> {
    args.iter()
        .map(|s| {
            let v = forkd_vmm::Volume::parse(s)?;
            let host = std::path::absolute(&v.host_path)?;
            Ok(forkd_api::VolumeSpec {
                host_path: host.to_string_lossy().into_owned(),
                guest_path: v.guest_path,
                read_only: v.read_only,
            })
        })
        .collect()
}
