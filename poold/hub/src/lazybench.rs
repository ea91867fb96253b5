//! `forkd hub bench --lazy TAG`: how long a host that has never seen a
//! snapshot takes to answer from its first child, lazy pull vs full pull,
//! over an S3 hub behind a shaped link (docs/BENCHMARKS.md, "Lazy
//! snapshots").
//!
//! The setup, all on this machine, names unique per run:
//! - a network namespace for the hub running **s3s-fs** (a real S3 server)
//!   on its loopback, with a small **delaying TCP proxy** in front of it
//!   (this kernel has no netem: the proxy holds every piece of data for
//!   half the extra round trip, in each direction, keeping order);
//! - one namespace per link kind for "host B", joined to the hub's by a
//!   veth pair: `unshaped`, and `shaped` (`tc tbf` at `--rate-mbit` on both
//!   ends, `--rtt-ms` added by the proxy);
//! - host A is this data dir: TAG is pushed once (over the unshaped link),
//!   counting requests;
//! - each run uses a fresh data dir (kernel and images linked from this
//!   one): `forkd pull [--lazy]` runs in B's namespace (so does the
//!   forkd-fs it starts), then `forkd fork --tag TAG -n 1 --eval CODE`; the
//!   time is from before the pull to the child's answer. Bytes and requests
//!   before the answer are the pull's plus what forkd-fs fetched by then
//!   (its `status`); a lazy run then waits until the snapshot is all local.
//!
//! Runs alternate lazy and full; the report has every run and the medians.

use anyhow::{anyhow, bail, Context, Result};
use forkd_snapshot::Paths;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Options of the lazy bench.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Runs per link and mode (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Rate of the shaped link, Mbit/s (tc tbf on both ends).
    #[arg(long, default_value_t = 100)]
    pub rate_mbit: u32,
    /// Round trip the proxy adds on the shaped link, ms.
    #[arg(long, default_value_t = 10)]
    pub rtt_ms: u64,
    /// Python the first child evaluates.
    #[arg(long, default_value = "numpy.zeros(5).tolist()")]
    pub eval: String,
    /// Links to run (unshaped, shaped).
    #[arg(long, value_delimiter = ',', default_value = "unshaped,shaped")]
    pub links: Vec<String>,
    /// Modes to run (lazy, full).
    #[arg(long, value_delimiter = ',', default_value = "lazy,full")]
    pub modes: Vec<String>,
    /// The s3s-fs binary.
    #[arg(long, default_value = "/usr/local/bin/s3s-fs")]
    pub s3s_fs: PathBuf,
}

/// One pull-and-answer on a fresh data dir.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    /// `shaped` or `unshaped`.
    pub link: String,
    /// `lazy` or `full`.
    pub mode: String,
    /// The pull alone, s.
    pub pull_s: f64,
    /// From before the pull to the first child's answer, s.
    pub first_answer_s: f64,
    /// Hub bytes received before the answer (pull + forkd-fs).
    pub bytes_before_answer: u64,
    /// Hub requests before the answer (pull + forkd-fs).
    pub requests_before_answer: u64,
    /// Lazy: from before the pull until the snapshot was all local, s.
    pub converged_s: Option<f64>,
    /// What the child answered.
    pub answer: String,
}

/// Push of TAG into the empty hub.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PushFigures {
    /// Requests.
    pub requests: u64,
    /// Packs written.
    pub packs: u64,
    /// Bytes sent.
    pub wire_bytes: u64,
    /// Wall time, s.
    pub seconds: f64,
    /// The snapshot had a recorded working set to send.
    pub working_set: bool,
}

/// Medians of one link and mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// `shaped` or `unshaped`.
    pub link: String,
    /// `lazy` or `full`.
    pub mode: String,
    /// Runs.
    pub runs: usize,
    /// Median time to the first answer, s.
    pub first_answer_s: f64,
    /// Median bytes before the answer.
    pub bytes_before_answer: u64,
    /// Median requests before the answer.
    pub requests_before_answer: u64,
    /// Median pull time, s.
    pub pull_s: f64,
    /// Median time to all local (lazy), s.
    pub converged_s: Option<f64>,
}

/// The bench's report (`--json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Always "hub-lazy".
    pub bench: String,
    /// Layout version of this report.
    pub schema: u32,
    /// The command line.
    pub command: Vec<String>,
    /// forkd's version.
    pub version: String,
    /// Host CPUs.
    pub host_cpus: usize,
    /// The tag benchmarked and its snapshot id.
    pub tag: String,
    /// Its id.
    pub snapshot: String,
    /// Pack bytes of the snapshot on host A (its chunks, stored).
    pub stored_bytes: u64,
    /// Chunks it names.
    pub chunks: u64,
    /// Shaped link rate, Mbit/s.
    pub rate_mbit: u32,
    /// Round trip added on the shaped link, ms.
    pub rtt_ms: u64,
    /// The eval.
    pub eval: String,
    /// The push.
    pub push: PushFigures,
    /// Every run, in order.
    pub runs: Vec<Run>,
    /// Medians per link and mode.
    pub summary: Vec<Summary>,
}

const ACCESS_KEY: &str = "forkdbenchkey";
const SECRET_KEY: &str = "forkd-bench-secret-0123456789";
const BUCKET: &str = "bench";
const S3_PORT: u16 = 9000;

/// Runs the bench for `tag` of the data dir at `paths` (host A).
pub async fn run(paths: &Paths, tag: &str, args: &Args) -> Result<Report> {
    if !args.s3s_fs.is_file() {
        bail!(
            "{} is not there: the bench needs s3s-fs (cargo install s3s-fs --version 0.14.1 --features binary --locked --root /usr/local)",
            args.s3s_fs.display()
        );
    }
    for l in &args.links {
        if l != "shaped" && l != "unshaped" {
            bail!("unknown link {l:?}: use shaped, unshaped");
        }
    }
    for m in &args.modes {
        if m != "lazy" && m != "full" {
            bail!("unknown mode {m:?}: use lazy, full");
        }
    }
    let (snapshot, stored_bytes, chunks) = {
        let p = paths.clone();
        let t = tag.to_string();
        crate::blocking(move || {
            let s = forkd_snapshot::store::open_rw(&p)?;
            let rec = s
                .resolve(&t)?
                .ok_or_else(|| anyhow!("no snapshot {t:?} in {}", p.home.display()))?;
            let r = s.residency(&rec)?;
            if !r.is_local() {
                bail!("snapshot {t} is not all local here; it cannot be the bench's source");
            }
            Ok((rec.id, r.local_bytes, r.chunks))
        })
        .await?
    };
    let sfx = forkd_snapshot::random_hex(3);
    let work = paths.staging_dir().join(format!("lazybench-{sfx}"));
    std::fs::create_dir_all(work.join("s3").join(BUCKET))?;
    let net = Net::new(&sfx)?;
    let result = run_in(
        paths,
        tag,
        snapshot,
        stored_bytes,
        chunks,
        args,
        &work,
        &net,
    )
    .await;
    drop(net);
    let _ = std::fs::remove_dir_all(&work);
    result
}

#[allow(clippy::too_many_arguments)]
async fn run_in(
    paths: &Paths,
    tag: &str,
    snapshot: forkd_layers::SnapshotId,
    stored_bytes: u64,
    chunks: u64,
    args: &Args,
    work: &Path,
    net: &Net,
) -> Result<Report> {
    if args.links.iter().any(|l| l == "shaped") {
        net.shape("shaped", args.rate_mbit)?;
    }
    let _s3 = Proc::spawn(
        Command::new("ip")
            .args(["netns", "exec", &net.hub])
            .arg(&args.s3s_fs)
            .args(["--host", "127.0.0.1", "--port", &S3_PORT.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(work.join("s3")),
    )?;
    let _unshaped_proxy = DelayProxy::start(&net.hub, 9100, Duration::ZERO)?;
    let _shaped_proxy = DelayProxy::start(&net.hub, 9101, Duration::from_millis(args.rtt_ms) / 2)?;
    wait_port(&net.hub, S3_PORT)?;
    let forkd = std::env::current_exe().context("finding the forkd binary")?;
    let url = format!("s3://{BUCKET}/lazybench");

    // Host A pushes (over the unshaped link).
    let push_out = forkd_cmd(&forkd, &paths.home, net, "unshaped")
        .args(["push", tag, &url, "-q"])
        .output()
        .context("running forkd push")?;
    if !push_out.status.success() {
        bail!(
            "forkd push failed: {}",
            String::from_utf8_lossy(&push_out.stderr)
        );
    }
    let push_line = String::from_utf8_lossy(&push_out.stdout).to_string();
    let push = PushFigures {
        requests: figure(&push_line, " requests").unwrap_or(0),
        packs: figure(&push_line, " packs").unwrap_or(0),
        wire_bytes: mib_figure(&push_line, " on the wire").unwrap_or(0),
        seconds: seconds_figure(&push_line).unwrap_or(0.0),
        working_set: push_line.contains("with its working set"),
    };

    let mut runs = Vec::new();
    for i in 0..args.runs {
        for link in &args.links {
            for mode in &args.modes {
                let home = work.join(format!("b-{link}-{mode}-{i}"));
                let r = one_run(&forkd, paths, &home, net, link, mode, tag, &url, &args.eval).await;
                teardown_home(&home);
                let r = r.with_context(|| format!("run {i} ({link}, {mode})"))?;
                eprintln!(
                    "{link:>8} {mode:>4} run {i}: first answer {:.2} s, {} before it in {} requests",
                    r.first_answer_s,
                    forkd_snapshot::mib(r.bytes_before_answer),
                    r.requests_before_answer
                );
                runs.push(r);
            }
        }
    }
    let mut summary = Vec::new();
    for link in &args.links {
        for mode in &args.modes {
            let rs: Vec<&Run> = runs
                .iter()
                .filter(|r| &r.link == link && &r.mode == mode)
                .collect();
            if rs.is_empty() {
                continue;
            }
            let conv: Vec<f64> = rs.iter().filter_map(|r| r.converged_s).collect();
            summary.push(Summary {
                link: link.clone(),
                mode: mode.clone(),
                runs: rs.len(),
                first_answer_s: median_f(rs.iter().map(|r| r.first_answer_s).collect()),
                bytes_before_answer: median_u(rs.iter().map(|r| r.bytes_before_answer).collect()),
                requests_before_answer: median_u(
                    rs.iter().map(|r| r.requests_before_answer).collect(),
                ),
                pull_s: median_f(rs.iter().map(|r| r.pull_s).collect()),
                converged_s: (!conv.is_empty()).then(|| median_f(conv)),
            });
        }
    }
    Ok(Report {
        bench: "hub-lazy".into(),
        schema: 1,
        command: Vec::new(),
        version: env!("CARGO_PKG_VERSION").into(),
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        tag: tag.into(),
        snapshot: snapshot.to_string(),
        stored_bytes,
        chunks,
        rate_mbit: args.rate_mbit,
        rtt_ms: args.rtt_ms,
        eval: args.eval.clone(),
        push,
        runs,
        summary,
    })
}

/// `forkd` in host namespace `link`, with the S3 environment pointing at
/// that link's proxy and `home` as the data dir.
fn forkd_cmd(forkd: &Path, home: &Path, net: &Net, link: &str) -> Command {
    let (ns, ip, port) = match link {
        "shaped" => (&net.shaped, net.hub_ip("shaped"), 9101),
        _ => (&net.unshaped, net.hub_ip("unshaped"), 9100),
    };
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{ns}"))
        .arg(forkd)
        .env("FORKD_HOME", home)
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ENDPOINT_URL", format!("http://{ip}:{port}"))
        .stdin(Stdio::null());
    c
}

#[allow(clippy::too_many_arguments)]
async fn one_run(
    forkd: &Path,
    paths: &Paths,
    home: &Path,
    net: &Net,
    link: &str,
    mode: &str,
    tag: &str,
    url: &str,
    eval: &str,
) -> Result<Run> {
    std::fs::create_dir_all(home)?;
    for sub in ["kernel", "images"] {
        std::os::unix::fs::symlink(paths.home.join(sub), home.join(sub))?;
    }
    let t0 = Instant::now();
    let mut pull = forkd_cmd(forkd, home, net, link);
    pull.args(["pull", url, tag, "-q"]);
    if mode == "lazy" {
        pull.arg("--lazy");
    }
    let out = pull.output().context("running forkd pull")?;
    if !out.status.success() {
        bail!(
            "forkd pull failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let pull_s = t0.elapsed().as_secs_f64();
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    let pull_requests = figure(&line, " requests").unwrap_or(0);
    let pull_bytes = mib_figure(&line, " on the wire").unwrap_or(0);
    // The child: forkd-fs already runs in B's namespace (the pull started
    // it); QEMU and the CLI need no network.
    let out = Command::new(forkd)
        .env("FORKD_HOME", home)
        .args(["fork", "--tag", tag, "-n", "1", "--eval", eval])
        .stdin(Stdio::null())
        .output()
        .context("running forkd fork")?;
    let first_answer_s = t0.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!(
            "forkd fork failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let answer = child_answer(&String::from_utf8_lossy(&out.stdout)).ok_or_else(|| {
        anyhow!(
            "forkd fork printed no answer of its child: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    let mount = Paths::new(home).mount_dir();
    let fs = forkd_fs::Client::connect(&forkd_fs::default_control_socket(&mount))
        .and_then(|mut c| c.status())
        .context("reading forkd-fs's status after the answer")?;
    let mut run = Run {
        link: link.into(),
        mode: mode.into(),
        pull_s,
        first_answer_s,
        bytes_before_answer: pull_bytes + fs.lazy.fetched_bytes,
        requests_before_answer: pull_requests + fs.lazy.requests,
        converged_s: None,
        answer,
    };
    if mode == "lazy" {
        run.converged_s = Some(wait_local(forkd, home, tag, t0).await?);
    }
    Ok(run)
}

/// Waits until `tag` is all local in `home`; the time since `t0`, s.
async fn wait_local(forkd: &Path, home: &Path, tag: &str, t0: Instant) -> Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let out = Command::new(forkd)
            .env("FORKD_HOME", home)
            .args(["snapshot", "info", tag, "--json"])
            .output()?;
        if out.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            if v["residency"]["remote_chunks"].as_u64() == Some(0)
                && v["residency"]["source"].is_null()
            {
                return Ok(t0.elapsed().as_secs_f64());
            }
        }
        if Instant::now() > deadline {
            bail!(
                "{tag} in {} was not all local after 10 minutes",
                home.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn teardown_home(home: &Path) {
    let mount = Paths::new(home).mount_dir();
    let _ = forkd_fs::unmount(&mount).or_else(|_| forkd_fs::unmount_lazy(&mount));
    let _ = std::fs::remove_dir_all(home);
}

/// The child's answer in `forkd fork -n 1 --eval`'s output: the value after
/// "<child id>: " on the line before "… children answered the eval …" (the
/// "ready in" line above it is the fork's summary, not an answer).
fn child_answer(stdout: &str) -> Option<String> {
    let lines: Vec<&str> = stdout.lines().collect();
    let end = lines
        .iter()
        .position(|l| l.contains("children answered the eval"))?;
    let (_, value) = lines.get(end.checked_sub(1)?)?.split_once(": ")?;
    Some(value.to_string())
}

/// The number before `what` in a CLI summary line ("…; 12 requests; …").
fn figure(line: &str, what: &str) -> Option<u64> {
    let i = line.find(what)?;
    line[..i].rsplit([' ', '(']).next()?.parse().ok()
}

/// "… 123.4 MiB on the wire" → bytes.
fn mib_figure(line: &str, what: &str) -> Option<u64> {
    let i = line.find(what)?;
    let head = line[..i].trim_end();
    let num = head.strip_suffix("MiB")?.trim_end();
    let v: f64 = num.rsplit([' ', '(']).next()?.parse().ok()?;
    Some((v * (1u64 << 20) as f64) as u64)
}

/// "… in 1.2s" at the end of a summary → seconds.
fn seconds_figure(line: &str) -> Option<f64> {
    let s = line.trim_end().strip_suffix('s')?;
    s.rsplit(' ').next()?.parse().ok()
}

fn median_f(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn median_u(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

impl Report {
    /// Writes the report as pretty JSON, with the command line.
    pub fn write(&self, path: &Path, command: Vec<String>) -> Result<()> {
        let mut r = self.clone();
        r.command = command;
        std::fs::write(path, serde_json::to_vec_pretty(&r)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// The results as Markdown: the push, every median side by side with
    /// the lazy/full ratio.
    pub fn render(&self) -> String {
        let mib = forkd_snapshot::mib;
        let mut s = format!(
            "snapshot {} ({}): {} chunks, {} stored\npush into an empty S3 hub: {} requests, {} packs, {} in {:.1} s{}\n\n",
            self.tag,
            self.snapshot,
            self.chunks,
            mib(self.stored_bytes),
            self.push.requests,
            self.push.packs,
            mib(self.push.wire_bytes),
            self.push.seconds,
            if self.push.working_set {
                ", with its working set"
            } else {
                ", WITHOUT a working set (no child ran before the push)"
            }
        );
        s.push_str("| link | mode | runs | first answer (s) | bytes before it | % of stored | requests before it | pull (s) | all local (s) |\n");
        s.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for m in &self.summary {
            s.push_str(&format!(
                "| {} | {} | {} | {:.2} | {} | {:.0}% | {} | {:.2} | {} |\n",
                m.link,
                m.mode,
                m.runs,
                m.first_answer_s,
                mib(m.bytes_before_answer),
                100.0 * m.bytes_before_answer as f64 / self.stored_bytes.max(1) as f64,
                m.requests_before_answer,
                m.pull_s,
                m.converged_s.map_or("-".into(), |c| format!("{c:.1}"))
            ));
        }
        for link in ["unshaped", "shaped"] {
            let get = |mode: &str| {
                self.summary
                    .iter()
                    .find(|m| m.link == link && m.mode == mode)
            };
            if let (Some(l), Some(f)) = (get("lazy"), get("full")) {
                s.push_str(&format!(
                    "\n{link}: lazy/full first answer {:.2}x, bytes before it {:.2}x",
                    l.first_answer_s / f.first_answer_s.max(1e-9),
                    l.bytes_before_answer as f64 / f.bytes_before_answer.max(1) as f64
                ));
            }
        }
        s.push('\n');
        s
    }
}

/// The namespaces and links of one bench, removed when dropped.
struct Net {
    hub: String,
    unshaped: String,
    shaped: String,
    /// Third octet of the 10.254.X.0/24 the links use.
    octet: u8,
}

impl Net {
    fn new(sfx: &str) -> Result<Net> {
        let octet = 1 + (u32::from_str_radix(&sfx[..2], 16).unwrap_or(0) % 250) as u8;
        let net = Net {
            hub: format!("fkbh-{sfx}"),
            unshaped: format!("fkbu-{sfx}"),
            shaped: format!("fkbs-{sfx}"),
            octet,
        };
        for ns in [&net.hub, &net.unshaped, &net.shaped] {
            ip(&["netns", "add", ns])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        for (i, (ns, kind)) in [(&net.unshaped, "u"), (&net.shaped, "s")]
            .into_iter()
            .enumerate()
        {
            let (h, b) = (format!("fkh{kind}{sfx}"), format!("fkb{kind}{sfx}"));
            ip(&["link", "add", &h, "type", "veth", "peer", "name", &b])?;
            ip(&["link", "set", &h, "netns", &net.hub])?;
            ip(&["link", "set", &b, "netns", ns])?;
            let base = 4 * i as u8;
            ip(&[
                "-n",
                &net.hub,
                "addr",
                "add",
                &format!("10.254.{octet}.{}/30", base + 1),
                "dev",
                &h,
            ])?;
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("10.254.{octet}.{}/30", base + 2),
                "dev",
                &b,
            ])?;
            ip(&["-n", &net.hub, "link", "set", &h, "up"])?;
            ip(&["-n", ns, "link", "set", &b, "up"])?;
        }
        Ok(net)
    }

    /// The hub's address on `link`'s veth.
    fn hub_ip(&self, link: &str) -> String {
        let base = if link == "shaped" { 4 } else { 0 };
        format!("10.254.{}.{}", self.octet, base + 1)
    }

    /// tc tbf at `mbit` on both ends of the shaped link.
    fn shape(&self, link: &str, mbit: u32) -> Result<()> {
        let sfx = self.hub.trim_start_matches("fkbh-");
        let kind = if link == "shaped" { "s" } else { "u" };
        let ns_b = if link == "shaped" {
            &self.shaped
        } else {
            &self.unshaped
        };
        for (ns, dev) in [
            (&self.hub, format!("fkh{kind}{sfx}")),
            (ns_b, format!("fkb{kind}{sfx}")),
        ] {
            let status = Command::new("ip")
                .args([
                    "netns", "exec", ns, "tc", "qdisc", "add", "dev", &dev, "root",
                ])
                .args(["tbf", "rate", &format!("{mbit}mbit"), "burst", "128kb"])
                .args(["latency", "50ms"])
                .status()?;
            if !status.success() {
                bail!("tc tbf on {dev} in {ns} failed (is sch_tbf available?)");
            }
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in [&self.hub, &self.unshaped, &self.shaped] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Waits until something listens on `port` on the loopback of `ns`.
fn wait_port(ns: &str, port: u16) -> Result<()> {
    let start = Instant::now();
    loop {
        let ok = in_netns(ns, move || {
            Ok(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
        })?;
        if ok {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(20) {
            bail!("nothing listens on port {port} in {ns} after 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `f` on a thread that joined network namespace `ns` (sockets it
/// makes stay in that namespace).
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
        nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)
            .with_context(|| format!("joining {path}"))?;
        f()
    })
    .join()
    .map_err(|_| anyhow!("a netns thread panicked"))?
}

/// A child process killed when dropped.
struct Proc(Child);

impl Proc {
    fn spawn(c: &mut Command) -> Result<Proc> {
        Ok(Proc(
            c.stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting a bench process")?,
        ))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A TCP proxy in the hub's namespace, from `0.0.0.0:port` to s3s-fs,
/// holding every piece of data `delay` in each direction (order kept, so
/// throughput is unchanged and each round trip gains twice `delay`).
struct DelayProxy {
    stop: tokio::sync::watch::Sender<bool>,
}

impl DelayProxy {
    fn start(ns: &str, port: u16, delay: Duration) -> Result<DelayProxy> {
        let (stop, rx) = tokio::sync::watch::channel(false);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let path = format!("/run/netns/{ns}");
        std::thread::Builder::new()
            .name(format!("delay-proxy-{port}"))
            .spawn(move || {
                let run = || -> Result<()> {
                    let fd = std::fs::File::open(&path)?;
                    nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)?;
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    rt.block_on(proxy(port, delay, rx, ready_tx.clone()))
                };
                if let Err(e) = run() {
                    let _ = ready_tx.send(Err(format!("{e:#}")));
                }
            })?;
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => Ok(DelayProxy { stop }),
            Ok(Err(e)) => bail!("the delaying proxy did not start: {e}"),
            Err(_) => bail!("the delaying proxy did not start within 10 s"),
        }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn proxy(
    port: u16,
    delay: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
    ready: std::sync::mpsc::Sender<std::result::Result<(), String>>,
) -> Result<()> {
    let l = tokio::net::TcpListener::bind(("0.0.0.0", port)).await?;
    let _ = ready.send(Ok(()));
    loop {
        tokio::select! {
            _ = stop.changed() => return Ok(()),
            a = l.accept() => {
                let (client, _) = a?;
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", S3_PORT)).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, delay), pipe(sr, cw, delay));
                });
            }
        }
    }
}

/// Copies `r` to `w`, each piece of data written `delay` after it was read.
async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(4096);
    let reader = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let due = tokio::time::Instant::now() + delay;
                    if tx.send((due, buf[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, b)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if w.write_all(&b).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_lines_parse() {
        let l = "pulled py (snapshot x) from s3://b/p: 10 of 20 chunks moved (1.5 MiB stored, 2.0 MiB on the wire, 3 packs), 3 manifests, 1 snapshot records; 17 requests; hub layout 2 in 0.4s";
        assert_eq!(figure(l, " requests"), Some(17));
        assert_eq!(figure(l, " packs"), Some(3));
        assert_eq!(mib_figure(l, " on the wire"), Some(2 << 20));
        assert_eq!(seconds_figure(l), Some(0.4));
        assert_eq!(median_u(vec![3, 1, 2]), 2);
        assert_eq!(median_f(vec![3.0, 1.0]), 3.0);
    }

    #[test]
    fn the_answer_is_the_childs_not_the_summary() {
        let out = "1 children of py ready in 849 ms (per child: median 849 ms, max 849 ms)\n\
                   c-1a2b: [0.0, 0.0, 0.0, 0.0, 0.0]\n\
                   1 children answered the eval 1200 ms after the fork began\n";
        assert_eq!(
            child_answer(out).as_deref(),
            Some("[0.0, 0.0, 0.0, 0.0, 0.0]")
        );
        assert_eq!(child_answer("1 children of py ready in 849 ms\n"), None);
    }
}
