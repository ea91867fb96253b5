//! `forkd bench spawn --tag T -n N`: spawn latency and fan-out wall clock
//! through a running poold, from a full pool, from an empty pool (restore on
//! demand), and cold boot (extrapolated from a few, measured locally), with
//! poold's own CPU time per spawned child.

use super::{median, pct};
use anyhow::{bail, Context, Result};
use forkd_api::Client;
use forkd_api::PoolStatus;
use forkd_api::{EvalReply, SandboxInfo};
use forkd_snapshot::Paths;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The benchmark's knobs.
#[derive(Debug, Clone)]
pub struct SpawnBench {
    /// Tag of the snapshot to spawn from (through poold).
    pub tag: String,
    /// Sandboxes spawned per phase.
    pub n: usize,
    /// Cold boots measured locally to extrapolate the cold-boot phase.
    pub cold_samples: usize,
    /// Python each child evaluates to count as ready.
    pub probe: String,
    /// A networked snapshot (`forkd snapshot create --net`) of the same
    /// image: adds a pool-hit row with per-child networking, so the cost of
    /// the network at hand-out (egress rules, resolv.conf) shows beside
    /// the pool hit without one.
    pub net_tag: Option<String>,
}

/// One phase's figures.
struct Phase {
    name: &'static str,
    spawn_ms: Vec<f64>,
    wall_ms: f64,
    cpu_ms_per_child: f64,
    hits: usize,
}

/// Runs the spawn benchmark against the poold of `Client::from_env` and prints its report.
pub async fn run(paths: &Paths, b: SpawnBench) -> Result<()> {
    let c = Client::from_env()?;
    let info: Value = c
        .get(&format!("/v1/snapshots/{}/info", b.tag))
        .await
        .context("looking up the snapshot")?;
    let live: Vec<SandboxInfo> = c.get("/v1/sandboxes").await?;
    if !live.is_empty() {
        bail!(
            "poold already runs {} sandboxes; the benchmark needs an idle daemon (forkd kill --all)",
            live.len()
        );
    }
    println!(
        "spawn benchmark: snapshot {} (image {}), N = {}, probe eval({:?}), through poold at {}",
        b.tag,
        info["config"]["image"].as_str().unwrap_or("?"),
        b.n,
        b.probe,
        std::env::var("FORKD_URL").unwrap_or_else(|_| forkd_api::DEFAULT_URL.into())
    );
    let mut phases = Vec::new();

    // Full pool.
    c.put::<PoolStatus>(
        &format!("/v1/pools/{}", b.tag),
        json!({"min_ready": b.n, "max_ready": b.n, "warm": true}),
    )
    .await?;
    let t_fill = Instant::now();
    wait_pool(&c, &b.tag, |p| p.ready >= b.n).await?;
    println!(
        "pool filled with {} paused children in {:.1} s",
        b.n,
        t_fill.elapsed().as_secs_f64()
    );
    hold_pool(&c, &b.tag, b.n).await?;
    phases.push(phase(&c, &b, &b.tag, "full pool").await?);
    if let Some(net_tag) = &b.net_tag {
        c.delete(&format!("/v1/pools/{}", b.tag)).await?;
        c.put::<PoolStatus>(
            &format!("/v1/pools/{net_tag}"),
            json!({"min_ready": b.n, "max_ready": b.n, "warm": true}),
        )
        .await?;
        wait_pool(&c, net_tag, |p| p.ready >= b.n).await?;
        hold_pool(&c, net_tag, b.n).await?;
        phases.push(phase(&c, &b, net_tag, "pool + net").await?);
        c.delete(&format!("/v1/pools/{net_tag}")).await?;
        wait_pool(&c, net_tag, |p| p.ready == 0 && p.in_flight == 0).await?;
    }

    // Empty pool: every child restored on demand.
    c.delete(&format!("/v1/pools/{}", b.tag)).await?;
    wait_pool(&c, &b.tag, |p| p.ready == 0 && p.in_flight == 0).await?;
    phases.push(phase(&c, &b, &b.tag, "empty pool").await?);

    // Cold boot, measured here, extrapolated to N.
    let image = info["config"]["image"]
        .as_str()
        .context("snapshot records no image")?
        .to_string();
    let mem = info["config"]["machine"]["mem_mib"].as_u64().unwrap_or(512);
    let accel: forkd_vmm::Accel =
        serde_json::from_value(info["config"]["machine"]["accel"].clone())?;
    let (cold, _) =
        super::fork::cold_samples(paths, &image, mem, accel, b.cold_samples, &b.probe).await?;
    let cold_med = median(&cold);

    println!();
    println!(
        "{:<12} {:>10} {:>10} {:>22} {:>14} {:>6}",
        "source", "spawn p50", "spawn p99", "wall to all eval-ready", "poold CPU/child", "hits"
    );
    for p in &phases {
        println!(
            "{:<12} {:>8.0}ms {:>8.0}ms {:>20.0}ms {:>12.2}ms {:>6}",
            p.name,
            median(&p.spawn_ms),
            pct(&p.spawn_ms, 99.0),
            p.wall_ms,
            p.cpu_ms_per_child,
            p.hits
        );
    }
    println!(
        "{:<12} {:>8.0}ms {:>8.0}ms {:>20.0}ms {:>14} {:>6}   <- extrapolated: {} sequential cold boots, x N",
        "cold boot",
        cold_med,
        pct(&cold, 99.0),
        cold_med * b.n as f64,
        "-",
        "-",
        cold.len()
    );
    println!();
    println!(
        "spawn: request received until that child's agent answered (poold's own clock, per child)."
    );
    println!("wall: from sending POST /v1/sandboxes until all N children answered the probe eval.");
    Ok(())
}

/// Spawns N, evaluates the probe in each, deletes them.
/// Keeps a filled pool's `n` children but stops refilling it, so the
/// hand-outs of a pool phase are measured without restores of
/// replacements competing for the CPU.
async fn hold_pool(c: &Client, tag: &str, n: usize) -> Result<()> {
    c.put::<PoolStatus>(
        &format!("/v1/pools/{tag}"),
        json!({"min_ready": 0, "max_ready": n, "warm": true}),
    )
    .await?;
    Ok(())
}

async fn phase(c: &Client, b: &SpawnBench, tag: &str, name: &'static str) -> Result<Phase> {
    let cpu0 = poold_cpu(c).await?;
    let t0 = Instant::now();
    let made: Vec<SandboxInfo> = c
        .post("/v1/sandboxes", json!({"snapshot_tag": tag, "n": b.n}))
        .await?;
    let evals = futures::future::join_all(made.iter().map(|s| async move {
        let r: EvalReply = c
            .post(
                &format!("/v1/sandboxes/{}/eval", s.id),
                json!({ "code": b.probe }),
            )
            .await?;
        match r.error {
            Some(e) => bail!("probe failed in {}: {e}", s.id),
            None => Ok(()),
        }
    }))
    .await;
    let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    let cpu1 = poold_cpu(c).await?;
    for e in evals {
        e?;
    }
    futures::future::join_all(
        made.iter()
            .map(|s| async move { c.delete(&format!("/v1/sandboxes/{}", s.id)).await }),
    )
    .await
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    Ok(Phase {
        name,
        spawn_ms: made.iter().map(|s| s.spawn_ms as f64).collect(),
        wall_ms,
        cpu_ms_per_child: (cpu1 - cpu0) * 1e3 / b.n as f64,
        hits: made.iter().filter(|s| s.pool_hit).count(),
    })
}

/// poold's user+system CPU seconds, from its metrics.
async fn poold_cpu(c: &Client) -> Result<f64> {
    let (_, body) = c.send(forkd_api::Method::GET, "/metrics", None).await?;
    let text = String::from_utf8_lossy(&body);
    Ok(text
        .lines()
        .filter(|l| l.starts_with("forkd_poold_cpu_seconds{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

async fn wait_pool(c: &Client, tag: &str, done: impl Fn(&PoolStatus) -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let p: PoolStatus = c.get(&format!("/v1/pools/{tag}")).await?;
        if done(&p) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("pool {tag} did not settle within 30 minutes: {p:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
