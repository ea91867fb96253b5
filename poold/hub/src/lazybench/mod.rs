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

mod net;
pub mod propagate;

use anyhow::{anyhow, bail, Context, Result};
use forkd_snapshot::Paths;
use net::{wait_port, DelayProxy, Net, Proc};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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
    /// `--propagate`: the numbers of nodes to propagate to.
    #[arg(long, value_delimiter = ',', default_value = "1,3,5")]
    pub nodes: Vec<usize>,
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
    /// When the snapshot was published on the hub, s: before the end when
    /// the push sent the packs outside the working set after it.
    #[serde(default)]
    pub published_s: Option<f64>,
}

impl PushFigures {
    /// When the snapshot was published, s (a report from before pushes
    /// published early: the push's end).
    pub fn published(&self) -> f64 {
        self.published_s.unwrap_or(self.seconds)
    }
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

/// What every report of these benches opens with: which bench, the
/// source snapshot, the links. Flattened into each report's JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    /// Which bench: "hub-lazy" or "hub-propagate".
    pub bench: String,
    /// Layout version of this report.
    pub schema: u32,
    /// The command line.
    pub command: Vec<String>,
    /// forkd's version.
    pub version: String,
    /// Host CPUs.
    pub host_cpus: usize,
    /// The tag benchmarked.
    pub tag: String,
    /// Its snapshot id.
    pub snapshot: String,
    /// Pack bytes of the snapshot at the origin (its chunks, stored).
    pub stored_bytes: u64,
    /// Chunks it names.
    pub chunks: u64,
    /// Rate of the shaped links, Mbit/s.
    pub rate_mbit: u32,
    /// Round trip added on the shaped links, ms.
    pub rtt_ms: u64,
    /// The eval each first child answers.
    pub eval: String,
}

impl Header {
    /// The header of `bench`'s report on `tag`, whose [`source`] is `src`.
    fn new(bench: &str, tag: &str, src: Source, args: &Args) -> Header {
        Header {
            bench: bench.into(),
            schema: 1,
            command: Vec::new(),
            version: env!("CARGO_PKG_VERSION").into(),
            host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            tag: tag.into(),
            snapshot: src.0.to_string(),
            stored_bytes: src.1,
            chunks: src.2,
            rate_mbit: args.rate_mbit,
            rtt_ms: args.rtt_ms,
            eval: args.eval.clone(),
        }
    }

    /// The first line of a rendered report: the snapshot.
    fn render(&self) -> String {
        format!(
            "snapshot {} ({}): {} chunks, {} stored",
            self.tag,
            self.snapshot,
            self.chunks,
            forkd_snapshot::mib(self.stored_bytes)
        )
    }
}

/// Writes a report as pretty JSON.
fn write_json(path: &Path, report: &impl Serialize) -> Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(report)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// The lazy bench's report (`--json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// The bench, the snapshot and the links.
    #[serde(flatten)]
    pub head: Header,
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
    let src = source(paths, tag).await?;
    let sfx = forkd_snapshot::random_hex(3);
    let work = paths.staging_dir().join(format!("lazybench-{sfx}"));
    std::fs::create_dir_all(work.join("s3").join(BUCKET))?;
    let net = Net::new(&sfx, 2)?;
    let result = run_in(paths, tag, src, args, &work, &net).await;
    drop(net);
    let _ = std::fs::remove_dir_all(&work);
    result
}

#[allow(clippy::too_many_arguments)]
async fn run_in(
    paths: &Paths,
    tag: &str,
    src: Source,
    args: &Args,
    work: &Path,
    net: &Net,
) -> Result<Report> {
    if args.links.iter().any(|l| l == "shaped") {
        net.shape(link_host("shaped"), args.rate_mbit)?;
    }
    let _s3 = start_s3(net, args, work)?;
    let _unshaped_proxy = DelayProxy::start(&net.hub, UNSHAPED_PORT, Duration::ZERO)?;
    let _shaped_proxy = DelayProxy::start(
        &net.hub,
        SHAPED_PORT,
        Duration::from_millis(args.rtt_ms) / 2,
    )?;
    wait_port(&net.hub, S3_PORT)?;
    let forkd = std::env::current_exe().context("finding the forkd binary")?;
    let url = format!("s3://{BUCKET}/lazybench");

    // Host A pushes (over the unshaped link).
    let push = push(forkd_cmd(&forkd, &paths.home, net, "unshaped"), tag, &url)?;

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
        head: Header::new("hub-lazy", tag, src, args),
        push,
        runs,
        summary,
    })
}

/// A bench's source snapshot: its id, stored bytes and chunks.
type Source = (forkd_layers::SnapshotId, u64, u64);

/// The bench's source snapshot `tag` in this data dir, all local.
async fn source(paths: &Paths, tag: &str) -> Result<Source> {
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
    .await
}

/// s3s-fs on the hub's loopback, serving `work`/s3.
fn start_s3(net: &Net, args: &Args, work: &Path) -> Result<Proc> {
    Proc::spawn(
        Command::new("ip")
            .args(["netns", "exec", &net.hub])
            .arg(&args.s3s_fs)
            .args(["--host", "127.0.0.1", "--port", &S3_PORT.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(work.join("s3")),
    )
}

/// `forkd push TAG URL` with the command `forkd` (a [`forkd_in`]).
fn push(forkd: Command, tag: &str, url: &str) -> Result<PushFigures> {
    start_push(forkd, tag, url)?.finish()
}

/// A `forkd push` that has published its snapshot and may still be
/// uploading the packs outside the working set.
struct PushUnderWay {
    child: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
    /// Its stderr, drained on a thread of its own so it never fills.
    err: std::thread::JoinHandle<String>,
    /// Its stdout so far.
    text: String,
    t0: Instant,
    published_s: f64,
}

/// Starts `forkd push TAG URL` and returns once the snapshot is published:
/// at the push's "published after" line, or at its end when it publishes
/// last.
fn start_push(mut forkd: Command, tag: &str, url: &str) -> Result<PushUnderWay> {
    use std::io::BufRead;
    let t0 = Instant::now();
    let mut child = forkd
        .args(["push", tag, url, "-q"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running forkd push")?;
    let mut out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut stderr = child.stderr.take().expect("piped");
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let mut text = String::new();
    loop {
        let at = text.len();
        if out
            .read_line(&mut text)
            .context("reading forkd push's output")?
            == 0
        {
            // It ended: published last, or failed before publishing (then
            // no node may start).
            if !child.wait().context("waiting for forkd push")?.success() {
                bail!(
                    "forkd push failed: {}",
                    err.join().unwrap_or_default().trim()
                );
            }
            break;
        }
        if text[at..].starts_with("published after ") {
            break;
        }
    }
    Ok(PushUnderWay {
        child,
        out,
        err,
        text,
        t0,
        published_s: t0.elapsed().as_secs_f64(),
    })
}

impl PushUnderWay {
    /// Waits for the push to end; its figures.
    fn finish(mut self) -> Result<PushFigures> {
        use std::io::Read;
        let mut rest = std::mem::take(&mut self.text);
        self.out
            .read_to_string(&mut rest)
            .context("reading forkd push's output")?;
        let status = self.child.wait().context("waiting for forkd push")?;
        let err = self.err.join().unwrap_or_default();
        if !status.success() {
            bail!("forkd push failed: {err}");
        }
        let line = rest
            .lines()
            .rfind(|l| l.starts_with("pushed "))
            .unwrap_or_default();
        Ok(PushFigures {
            requests: figure(line, " requests").unwrap_or(0),
            packs: figure(line, " packs").unwrap_or(0),
            wire_bytes: mib_figure(line, " on the wire").unwrap_or(0),
            seconds: seconds_figure(line).unwrap_or_else(|| self.t0.elapsed().as_secs_f64()),
            working_set: line.contains("with its working set"),
            published_s: Some(self.published_s),
        })
    }
}

/// The proxy in front of s3s-fs that adds nothing.
const UNSHAPED_PORT: u16 = 9100;
/// The proxy that adds `--rtt-ms`.
const SHAPED_PORT: u16 = 9101;

/// The host of link `link`: 0 unshaped, 1 shaped.
fn link_host(link: &str) -> usize {
    usize::from(link == "shaped")
}

/// `forkd` in `link`'s host namespace, with the S3 environment pointing
/// at that link's proxy and `home` as the data dir.
fn forkd_cmd(forkd: &Path, home: &Path, net: &Net, link: &str) -> Command {
    let port = if link == "shaped" {
        SHAPED_PORT
    } else {
        UNSHAPED_PORT
    };
    forkd_in(forkd, home, net, link_host(link), port)
}

/// `forkd` in host `host`'s namespace, with the S3 environment pointing
/// at the hub's proxy on `port` and `home` as the data dir.
fn forkd_in(forkd: &Path, home: &Path, net: &Net, host: usize, port: u16) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", net.host(host)))
        .arg(forkd)
        .env("FORKD_HOME", home)
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env("AWS_REGION", "us-east-1")
        .env(
            "AWS_ENDPOINT_URL",
            format!("http://{}:{port}", net.hub_ip(host)),
        )
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
    let t0 = Instant::now();
    let pull = || forkd_cmd(forkd, home, net, link);
    let a = pull_and_answer(forkd, paths, home, pull, mode == "lazy", tag, url, eval, t0)?;
    let mut run = Run {
        link: link.into(),
        mode: mode.into(),
        pull_s: a.pull_s,
        first_answer_s: a.first_answer_s,
        bytes_before_answer: a.bytes,
        requests_before_answer: a.requests,
        converged_s: None,
        answer: a.answer,
    };
    if mode == "lazy" {
        run.converged_s = Some(wait_local(forkd, home, tag, t0).await?);
    }
    Ok(run)
}

/// What one host did from "never seen TAG" to its first child's answer.
struct Answered {
    /// The pull's end, s since `t0`.
    pull_s: f64,
    /// The answer, s since `t0`.
    first_answer_s: f64,
    /// Hub bytes received by then (pull + forkd-fs).
    bytes: u64,
    /// Hub requests by then (pull + forkd-fs).
    requests: u64,
    /// forkd-fs's reads that waited outside the working set by then.
    waits_outside_working_set: u64,
    /// What the child answered.
    answer: String,
}

/// On a fresh data dir `home` (kernel and images linked from `paths`):
/// `forkd pull [--lazy]` of `tag` from `url` with the command `pull`
/// makes (in the host's namespace: so runs the forkd-fs it starts), then
/// `forkd fork --tag TAG -n 1 --eval EVAL`; times since `t0`.
#[allow(clippy::too_many_arguments)]
fn pull_and_answer(
    forkd: &Path,
    paths: &Paths,
    home: &Path,
    pull: impl Fn() -> Command,
    lazy: bool,
    tag: &str,
    url: &str,
    eval: &str,
    t0: Instant,
) -> Result<Answered> {
    std::fs::create_dir_all(home)?;
    for sub in ["kernel", "images"] {
        std::os::unix::fs::symlink(paths.home.join(sub), home.join(sub))?;
    }
    let mut pull = pull();
    pull.args(["pull", url, tag, "-q"]);
    if lazy {
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
    // The child: forkd-fs already runs in the host's namespace (the pull
    // started it); QEMU and the CLI need no network.
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
    Ok(Answered {
        pull_s,
        first_answer_s,
        bytes: pull_bytes + fs.lazy.fetched_bytes,
        requests: pull_requests + fs.lazy.requests,
        waits_outside_working_set: fs.lazy.slow_reads_outside_working_set,
        answer,
    })
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
        r.head.command = command;
        write_json(path, &r)
    }

    /// The results as Markdown: the push, every median side by side with
    /// the lazy/full ratio.
    pub fn render(&self) -> String {
        let mib = forkd_snapshot::mib;
        let mut s = format!(
            "{}\npush into an empty S3 hub: {} requests, {} packs, {} in {:.1} s{}\n\n",
            self.head.render(),
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
                100.0 * m.bytes_before_answer as f64 / self.head.stored_bytes.max(1) as f64,
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
