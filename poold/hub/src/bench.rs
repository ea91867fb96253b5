//! `forkd hub bench --base TAG --head TAG [--hub URL|serve]`: push/pull
//! throughput and bytes moved against the head's unique bytes, for any two
//! snapshots of the local store (e.g. a python-numpy base and one chain link).
//!
//! Steps, each into a fresh hub and fresh scratch stores: push base, push
//! head (must move exactly the head's unique chunks, `Store::diff`), pull
//! head into an empty store, pull base into another empty store and then
//! head on top (again only the unique chunks).
//!
//! [`BenchResult::render`] is what the command prints; with `--json`,
//! [`BenchResult::json_report`] is written too (every step's figures, for
//! `scripts/plot-benchmarks.py`).

use super::server::{serve, ServeOptions};
use super::transfer::{pull, push, PullOptions, PushOptions, TransferReport};
use super::Hub;
use anyhow::{anyhow, bail, Context, Result};
use forkd_layers::{Store, StoreOptions};
use forkd_snapshot::mib;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What to benchmark.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Tag of the local snapshot pushed and pulled first.
    pub base: String,
    /// Tag of the local snapshot on top of `base` (e.g. one chain link), whose unique chunks are the expected traffic.
    pub head: String,
    /// `None`: a scratch `file://` hub; `"serve"`: a scratch `forkd hub serve`
    /// on 127.0.0.1; otherwise a hub URL (a scratch prefix or subdirectory is
    /// used for `s3://` and `file://`).
    pub hub: Option<String>,
    /// Bearer token for an HTTP hub.
    pub token: Option<String>,
    /// Concurrent object transfers (default: per hub kind).
    pub jobs: Option<usize>,
    /// Scratch space (hub directory, scratch stores); removed afterwards.
    pub work_dir: PathBuf,
}

/// One measured step.
#[derive(Debug, Clone)]
pub struct BenchStep {
    /// What the step did, e.g. "push head (hub has base)".
    pub name: &'static str,
    /// What it moved and how long it took.
    pub report: TransferReport,
}

/// The benchmark's results.
#[derive(Debug, Clone)]
pub struct BenchResult {
    /// The hub URL used (the scratch one when none was given).
    pub hub: String,
    /// "file", "serve" (a scratch `forkd hub serve`), "http" or "s3".
    pub hub_kind: String,
    /// Concurrent object transfers each step used.
    pub jobs: usize,
    /// The base snapshot's id.
    pub base_id: String,
    /// The head snapshot's id.
    pub head_id: String,
    /// The head's chunks the base lacks (`Store::diff`).
    pub unique_chunks: u64,
    /// Stored (compressed) bytes of those chunks.
    pub unique_stored_bytes: u64,
    /// Uncompressed bytes of those chunks.
    pub unique_raw_bytes: u64,
    /// Each measured step, in the order run.
    pub steps: Vec<BenchStep>,
}

/// Runs the benchmark; the scratch space is removed whatever happens.
pub async fn run(store: Arc<Store>, opts: &BenchOptions) -> Result<BenchResult> {
    let work = opts
        .work_dir
        .join(format!("hub-bench-{}", forkd_snapshot::random_hex(4)));
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let result = run_in(store, opts, &work).await;
    let _ = std::fs::remove_dir_all(&work);
    result
}

async fn run_in(store: Arc<Store>, opts: &BenchOptions, work: &Path) -> Result<BenchResult> {
    let resolve = |t: &str| {
        store
            .resolve(t)?
            .ok_or_else(|| anyhow!("no snapshot or tag '{t}' in the local store"))
    };
    let (base, head) = (resolve(&opts.base)?, resolve(&opts.head)?);
    if !store.ancestors(&head.id)?.contains(&base.id) {
        bail!(
            "{} is not an ancestor of {}: bench needs a chain",
            opts.base,
            opts.head
        );
    }
    let diff = store.diff(&base.id, &head.id)?;
    let suffix = forkd_snapshot::random_hex(4);
    let hub_kind = match opts.hub.as_deref() {
        None => "file",
        Some("serve") => "serve",
        Some(u) if u.starts_with("s3://") => "s3",
        Some(u) if u.starts_with("file://") => "file",
        Some(_) => "http",
    };
    let hub = match opts.hub.as_deref() {
        None => Hub::open(&format!("file://{}", work.join("hub").display()), None)?,
        Some("serve") => start_server(work).await?,
        Some(u) if u.starts_with("s3://") || u.starts_with("file://") => Hub::open(
            &format!("{}/forkd-bench-{suffix}", u.trim_end_matches('/')),
            opts.token.clone(),
        )?,
        Some(u) => Hub::open(u, opts.token.clone())?,
    };
    let push_opts = |tag: &str| PushOptions {
        hub_tag: Some(format!("bench-{tag}-{suffix}")),
        jobs: opts.jobs,
        quiet: true,
        ..Default::default()
    };
    let pull_opts = PullOptions {
        jobs: opts.jobs,
        quiet: true,
        ..Default::default()
    };
    let mut steps = Vec::new();
    let r = push(store.view(), &base.id.to_string(), &hub, &push_opts("base")).await?;
    steps.push(BenchStep {
        name: "push base (empty hub)",
        report: r,
    });
    let r = push(store.view(), &head.id.to_string(), &hub, &push_opts("head")).await?;
    steps.push(BenchStep {
        name: "push head (hub has base)",
        report: r,
    });

    let s1 = Arc::new(Store::open(
        &work.join("store-empty"),
        StoreOptions::default(),
    )?);
    let r = pull(s1.clone(), &hub, &head.id.to_string(), &pull_opts).await?;
    steps.push(BenchStep {
        name: "pull head (empty store)",
        report: r,
    });
    if s1.snapshot(&head.id)?.as_ref() != Some(&head) {
        bail!("the pulled head's record differs from the source");
    }
    let s2 = Arc::new(Store::open(
        &work.join("store-base"),
        StoreOptions::default(),
    )?);
    let r = pull(s2.clone(), &hub, &base.id.to_string(), &pull_opts).await?;
    steps.push(BenchStep {
        name: "pull base (empty store)",
        report: r,
    });
    let r = pull(s2.clone(), &hub, &head.id.to_string(), &pull_opts).await?;
    steps.push(BenchStep {
        name: "pull head (store has base)",
        report: r,
    });
    Ok(BenchResult {
        hub: hub.describe(),
        hub_kind: hub_kind.into(),
        jobs: opts.jobs.unwrap_or_else(|| hub.default_jobs()),
        base_id: base.id.to_string(),
        head_id: head.id.to_string(),
        unique_chunks: diff.new_chunks,
        unique_stored_bytes: diff.new_stored_bytes,
        unique_raw_bytes: diff.new_raw_bytes,
        steps,
    })
}

/// A scratch `forkd hub serve` on 127.0.0.1 with a random token.
async fn start_server(work: &Path) -> Result<Hub> {
    let token = forkd_snapshot::random_hex(32);
    let opts = ServeOptions {
        dir: work.join("served"),
        bind: "127.0.0.1:0".parse().unwrap(),
        token: Some(token.clone()),
        read_only: false,
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        if let Err(e) = serve(opts, |a| {
            let _ = tx.send(a);
        })
        .await
        {
            eprintln!("bench hub server: {e:#}");
        }
    });
    let addr = rx.await.context("the bench hub server did not start")?;
    Hub::open(&format!("http://{addr}"), Some(token))
}

/// Layout version of [`JsonReport`]; bumped when a field changes meaning or
/// goes away (new fields do not bump it).
pub const SCHEMA: u32 = 1;

/// The benchmark's results as `forkd hub bench --json` writes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonReport {
    /// Always "hub": which bench wrote the file.
    pub bench: String,
    /// [`SCHEMA`] of the writer.
    pub schema: u32,
    /// The command line of the run (argv).
    pub command: Vec<String>,
    /// forkd's version.
    pub version: String,
    /// Host CPUs.
    pub host_cpus: usize,
    /// The base's tag as given.
    pub base: String,
    /// The head's tag as given.
    pub head: String,
    /// The base snapshot's id.
    pub base_id: String,
    /// The head snapshot's id.
    pub head_id: String,
    /// The hub URL used.
    pub hub: String,
    /// "file", "serve", "http" or "s3".
    pub hub_kind: String,
    /// Concurrent object transfers per step.
    pub jobs: usize,
    /// The head's chunks the base lacks (`Store::diff`).
    pub unique_chunks: u64,
    /// Their stored (compressed) bytes.
    pub unique_stored_bytes: u64,
    /// Their uncompressed bytes.
    pub unique_raw_bytes: u64,
    /// Each step, in the order run.
    pub steps: Vec<JsonStep>,
}

/// One step of [`JsonReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonStep {
    /// What the step did, e.g. "push head (hub has base)".
    pub name: String,
    /// Snapshot records moved.
    pub snapshots: u64,
    /// Manifests moved.
    pub manifests: u64,
    /// Distinct chunks of the snapshots moved.
    pub chunks_total: u64,
    /// Chunks moved (those the other side lacked).
    pub chunks: u64,
    /// Their uncompressed bytes.
    pub raw_bytes: u64,
    /// Their stored bytes (the unit of `unique_stored_bytes`).
    pub stored_bytes: u64,
    /// Object bytes that crossed the wire.
    pub wire_bytes: u64,
    /// Wall time, seconds.
    pub seconds: f64,
}

impl JsonReport {
    /// Writes the report as pretty JSON to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", path.display()))
    }
}

impl BenchResult {
    /// The result for `--json`; `base` and `head` as the user named them,
    /// `command` the command line that ran it.
    pub fn json_report(&self, base: &str, head: &str, command: Vec<String>) -> JsonReport {
        JsonReport {
            bench: "hub".into(),
            schema: SCHEMA,
            command,
            version: env!("CARGO_PKG_VERSION").into(),
            host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            base: base.into(),
            head: head.into(),
            base_id: self.base_id.clone(),
            head_id: self.head_id.clone(),
            hub: self.hub.clone(),
            hub_kind: self.hub_kind.clone(),
            jobs: self.jobs,
            unique_chunks: self.unique_chunks,
            unique_stored_bytes: self.unique_stored_bytes,
            unique_raw_bytes: self.unique_raw_bytes,
            steps: self
                .steps
                .iter()
                .map(|st| JsonStep {
                    name: st.name.into(),
                    snapshots: st.report.snapshots,
                    manifests: st.report.manifests,
                    chunks_total: st.report.chunks_total,
                    chunks: st.report.chunks,
                    raw_bytes: st.report.raw_bytes,
                    stored_bytes: st.report.stored_bytes,
                    wire_bytes: st.report.wire_bytes,
                    seconds: st.report.elapsed.as_secs_f64(),
                })
                .collect(),
        }
    }

    /// The result as a Markdown table plus a summary line.
    pub fn render(&self) -> String {
        let mut s = format!(
            "hub: {}\nhead's unique chunks vs base (Store::diff): {} chunks, {} stored, {} raw\n\n",
            self.hub,
            self.unique_chunks,
            mib(self.unique_stored_bytes),
            mib(self.unique_raw_bytes)
        );
        s.push_str("| step | chunks moved | stored | wire | time | raw MiB/s | wire MiB/s |\n");
        s.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
        for st in &self.steps {
            let r = &st.report;
            let secs = r.elapsed.as_secs_f64().max(1e-6);
            let rate = |b: u64| b as f64 / secs / (1u64 << 20) as f64;
            s.push_str(&format!(
                "| {} | {} | {} | {} | {:.2} s | {:.1} | {:.1} |\n",
                st.name,
                r.chunks,
                mib(r.stored_bytes),
                mib(r.wire_bytes),
                secs,
                rate(r.raw_bytes),
                rate(r.wire_bytes)
            ));
        }
        if let Some(h) = self.steps.get(1) {
            s.push_str(&format!(
                "\npush head moved {} of stored chunk bytes for {} unique ({}).\n",
                mib(h.report.stored_bytes),
                mib(self.unique_stored_bytes),
                if h.report.stored_bytes == self.unique_stored_bytes {
                    "exactly the unique chunks"
                } else {
                    "MISMATCH"
                }
            ));
        }
        s
    }
}
