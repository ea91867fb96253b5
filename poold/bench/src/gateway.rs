//! `forkd bench gateway --tag T --direct URL --gateway URL`: what the
//! cluster gateway adds to a call, next to the same call made to the node.
//!
//! Two calls, each measured both ways in one run, interleaved (direct,
//! gateway, direct, ...) so drift in the node (refills, page cache) hits
//! both paths alike:
//! - **pool-hit spawn**: `POST /v1/sandboxes` with `n = 1` while the tag's
//!   pool has a ready child: the pool is filled first and not refilled
//!   while measured, so every sample is a hand-out (the answer says so; a
//!   miss is reported, not counted);
//! - **exec**: `POST /v1/sandboxes/{id}/exec` of `true` in one sandbox
//!   (after one untimed exec each way).
//!
//! The gateway must front the node given as `--direct` (alone, or the
//! spawn may land elsewhere: the answer's node is checked by id). Figures
//! are client-side wall clock, p50 and p99, and the gateway's extra time
//! as the difference of the medians; `--json` writes them for
//! `scripts/plot-benchmarks.py`.

use super::{median, ms, pct, wait_pool};
use anyhow::{bail, Context, Result};
use forkd_api::{Client, PoolStatus, SandboxInfo};
use serde::Serialize;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

/// The benchmark's knobs.
pub struct GatewayBench {
    /// Snapshot tag whose pool serves the spawns.
    pub tag: String,
    /// Samples per call and path.
    pub n: usize,
    /// The node's own `/v1` (poold).
    pub direct: Client,
    /// The gateway's `/v1`, fronting that node.
    pub gateway: Client,
    /// Where to write the report as JSON.
    pub json: Option<PathBuf>,
}

/// One call measured both ways.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// "pool-hit spawn" or "exec".
    pub call: String,
    /// Samples per path.
    pub samples: usize,
    /// Direct to the node, p50 (ms).
    pub direct_p50_ms: f64,
    /// Direct, p99 (ms).
    pub direct_p99_ms: f64,
    /// Through the gateway, p50 (ms).
    pub gateway_p50_ms: f64,
    /// Through the gateway, p99 (ms).
    pub gateway_p99_ms: f64,
    /// Gateway p50 minus direct p50 (ms): what the extra hop costs.
    pub added_p50_ms: f64,
    /// Every sample direct to the node, in order (ms).
    pub direct_ms: Vec<f64>,
    /// Every sample through the gateway, in order (ms).
    pub gateway_ms: Vec<f64>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Always "gateway".
    pub bench: &'static str,
    /// Layout version of this report.
    pub schema: u32,
    /// forkd's version.
    pub version: &'static str,
    /// Host CPUs.
    pub host_cpus: usize,
    /// The tag spawned.
    pub tag: String,
    /// One row per call.
    pub rows: Vec<Row>,
    /// Spawns that were not pool hits (left out of the figures).
    pub misses: usize,
}

/// Runs the benchmark and prints its table.
pub async fn run(b: GatewayBench) -> Result<Report> {
    if b.n == 0 {
        bail!("-n must be at least 1");
    }
    // One full pool that is not refilled while measured: every spawn is
    // a hand-out, and no restore competes for the CPU.
    let pool = format!("/v1/pools/{}", b.tag);
    let total = 2 * b.n + 1;
    let spec = |min: usize| json!({ "min_ready": min, "max_ready": total, "warm": true });
    let _: PoolStatus = b
        .direct
        .put(&pool, spec(total))
        .await
        .with_context(|| format!("filling pool {} on the node ({} children)", b.tag, total))?;
    wait_pool(&b.direct, &b.tag, |p| p.ready >= total).await?;
    let _: PoolStatus = b.direct.put(&pool, spec(0)).await?;
    let (mut spawn_d, mut spawn_g, mut misses) = (Vec::new(), Vec::new(), 0);
    for i in 0..2 * b.n {
        let via = if i % 2 == 0 { &b.direct } else { &b.gateway };
        let (t, sb) = spawn_one(via, &b.tag).await?;
        b.direct.delete(&format!("/v1/sandboxes/{}", sb.id)).await?;
        if !sb.pool_hit {
            misses += 1;
        } else if i % 2 == 0 {
            spawn_d.push(t);
        } else {
            spawn_g.push(t);
        }
    }
    let (_, sb) = spawn_one(&b.direct, &b.tag).await?;
    let exec = exec_both(&b, &sb.id).await;
    b.direct.delete(&format!("/v1/sandboxes/{}", sb.id)).await?;
    b.direct.delete(&pool).await?;
    let (exec_d, exec_g) = exec?;
    let rows = vec![
        row("pool-hit spawn", &spawn_d, &spawn_g),
        row("exec", &exec_d, &exec_g),
    ];
    let report = Report {
        bench: "gateway",
        schema: 1,
        version: env!("CARGO_PKG_VERSION"),
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        tag: b.tag.clone(),
        rows,
        misses,
    };
    print(&report);
    if let Some(p) = &b.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(report)
}

async fn spawn_one(c: &Client, tag: &str) -> Result<(f64, SandboxInfo)> {
    let t0 = Instant::now();
    let mut v: Vec<SandboxInfo> = c
        .post("/v1/sandboxes", json!({ "snapshot_tag": tag, "n": 1 }))
        .await?;
    let t = ms(t0);
    let sb = v.pop().context("the spawn answered no sandbox")?;
    Ok((t, sb))
}

async fn exec_both(b: &GatewayBench, id: &str) -> Result<(Vec<f64>, Vec<f64>)> {
    let path = format!("/v1/sandboxes/{id}/exec");
    // One untimed exec each way first: a new sandbox's first exec pages
    // in the agent's exec path (hundreds of ms under TCG), which would
    // land in whichever path went first.
    for via in [&b.direct, &b.gateway] {
        let _: serde_json::Value = via.post(&path, json!({ "args": ["true"] })).await?;
    }
    let (mut d, mut g) = (Vec::new(), Vec::new());
    for i in 0..2 * b.n {
        let via = if i % 2 == 0 { &b.direct } else { &b.gateway };
        let t0 = Instant::now();
        let r: serde_json::Value = via.post(&path, json!({ "args": ["true"] })).await?;
        let t = ms(t0);
        if r.get("exit_code").and_then(|c| c.as_i64()) != Some(0) {
            bail!("exec of `true` in {id} did not exit 0: {r}");
        }
        if i % 2 == 0 { &mut d } else { &mut g }.push(t);
    }
    Ok((d, g))
}

fn row(call: &str, d: &[f64], g: &[f64]) -> Row {
    Row {
        call: call.to_string(),
        samples: d.len().min(g.len()),
        direct_p50_ms: median(d),
        direct_p99_ms: pct(d, 99.0),
        gateway_p50_ms: median(g),
        gateway_p99_ms: pct(g, 99.0),
        added_p50_ms: median(g) - median(d),
        direct_ms: d.to_vec(),
        gateway_ms: g.to_vec(),
    }
}

fn print(r: &Report) {
    println!("gateway overhead, tag {}:", r.tag);
    println!(
        "  {:<16} {:>7} {:>11} {:>11} {:>12} {:>12} {:>10}",
        "call", "samples", "direct p50", "direct p99", "gateway p50", "gateway p99", "added p50"
    );
    for x in &r.rows {
        println!(
            "  {:<16} {:>7} {:>9.2}ms {:>9.2}ms {:>10.2}ms {:>10.2}ms {:>8.2}ms",
            x.call,
            x.samples,
            x.direct_p50_ms,
            x.direct_p99_ms,
            x.gateway_p50_ms,
            x.gateway_p99_ms,
            x.added_p50_ms
        );
    }
    if r.misses > 0 {
        println!(
            "  ({} spawns were not pool hits and are left out)",
            r.misses
        );
    }
}
