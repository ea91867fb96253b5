//! `forkd hub bench --base TAG --head TAG [--hub URL|serve]`: push/pull
//! throughput and bytes moved against the head's unique bytes, for any two
//! snapshots of the local store (e.g. a python-numpy base and one chain link).
//!
//! Steps, each into a fresh hub and fresh scratch stores: push base, push
//! head (must move exactly the head's unique chunks, `Store::diff`), pull
//! head into an empty store, pull base into another empty store and then
//! head on top (again only the unique chunks).

use super::server::{serve, ServeOptions};
use super::transfer::{pull, push, PullOptions, PushOptions, TransferReport};
use super::Hub;
use anyhow::{anyhow, bail, Context, Result};
use forkd_layers::{Store, StoreOptions};
use forkd_snapshot::mib;
use std::path::PathBuf;
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

async fn run_in(
    store: Arc<Store>,
    opts: &BenchOptions,
    work: &std::path::Path,
) -> Result<BenchResult> {
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
    };
    let pull_opts = PullOptions {
        jobs: opts.jobs,
        quiet: true,
        ..Default::default()
    };
    let mut steps = Vec::new();
    let r = push(
        store.clone(),
        &base.id.to_string(),
        &hub,
        &push_opts("base"),
    )
    .await?;
    steps.push(BenchStep {
        name: "push base (empty hub)",
        report: r,
    });
    let r = push(
        store.clone(),
        &head.id.to_string(),
        &hub,
        &push_opts("head"),
    )
    .await?;
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
        unique_chunks: diff.new_chunks,
        unique_stored_bytes: diff.new_stored_bytes,
        unique_raw_bytes: diff.new_raw_bytes,
        steps,
    })
}

/// A scratch `forkd hub serve` on 127.0.0.1 with a random token.
async fn start_server(work: &std::path::Path) -> Result<Hub> {
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

impl BenchResult {
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
