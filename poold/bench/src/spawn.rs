//! `forkd bench spawn --tag T`: what a spawn through a running poold costs.
//!
//! - **Sequential**: single spawns (`n = 1`), one after another, from a full
//!   pool, from an empty pool (restore on demand) and as cold boots
//!   (measured locally); for each, request → agent answered as the client
//!   sees it (p50/p99), and the first eval after the hand-out next to the
//!   second, so a first request that pays for something shows.
//! - **Fan-out**: for each N, a pool filled with N paused children, then one
//!   `POST n=N` until all N answered the probe eval; with the memory of the
//!   N paused children measured before the spawn (PSS per child, and where
//!   one child's memory goes).
//!
//! A pool phase holds its pool (no refills) while it is measured, so
//! restores of replacements never compete with the hand-outs. Figures are
//! printed and, with `--json`, written for `scripts/plot-benchmarks.py`.

use super::mem::{breakdown, swap_kind, ChildrenMem, MemBreakdown};
use super::{median, ms, pct, wait_pool};
use anyhow::{bail, Context, Result};
use forkd_api::Client;
use forkd_api::PoolStatus;
use forkd_api::{EvalReply, SandboxInfo};
use forkd_snapshot::Paths;
use serde::Serialize;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The benchmark's knobs.
#[derive(Debug, Clone)]
pub struct SpawnBench {
    /// Tag of the snapshot to spawn from (through poold).
    pub tag: String,
    /// Sequential single spawns per source.
    pub seq: usize,
    /// Fan-out sizes (each a full pool, then one request for all of it).
    pub fanout: Vec<usize>,
    /// Cold boots measured locally.
    pub cold_samples: usize,
    /// Python each child evaluates to count as ready.
    pub probe: String,
    /// The pools' `warm_eval` (None: the default no-op warm-up).
    pub warm_eval: Option<String>,
    /// The pools' `page_out`: parked children paged out to swap.
    pub page_out: bool,
    /// The pools' `keep_resident` (None: poold's default).
    pub keep_resident: Option<usize>,
    /// A networked snapshot of the same image: adds a sequential pool-hit
    /// row with per-child networking.
    pub net_tag: Option<String>,
    /// Where to write the report as JSON.
    pub json: Option<PathBuf>,
}

/// One source's sequential single spawns.
#[derive(Debug, Clone, Serialize)]
pub struct SeqRow {
    /// "pool hit", "pool hit + net", "on demand", "cold boot".
    pub source: String,
    /// Spawns measured.
    pub samples: usize,
    /// Request sent → response (the child's agent answered), client clock.
    pub spawn_p50_ms: f64,
    /// 99th percentile of the same.
    pub spawn_p99_ms: f64,
    /// poold's own figure (request received → agent answered), p50.
    pub poold_p50_ms: f64,
    /// The first eval of the probe after the hand-out, p50.
    pub first_eval_p50_ms: f64,
    /// The second eval of the probe, p50.
    pub later_eval_p50_ms: f64,
    /// Spawns that were pool hits.
    pub hits: usize,
}

/// One fan-out size.
#[derive(Debug, Clone, Serialize)]
pub struct FanRow {
    /// Children requested in one `POST /v1/sandboxes`.
    pub n: usize,
    /// Filling the pool with N paused children, seconds.
    pub fill_s: f64,
    /// Request sent → all N answered the probe eval.
    pub wall_ms: f64,
    /// poold's per-child spawn figure, p50 and p99.
    pub spawn_p50_ms: f64,
    /// 99th percentile of the same.
    pub spawn_p99_ms: f64,
    /// Of the N, pool hits.
    pub hits: usize,
    /// poold's CPU time per child during the spawn.
    pub poold_cpu_ms_per_child: f64,
    /// Host memory per paused pooled child while all N were parked: its
    /// QEMU's PSS outside memory.bin plus an equal share of memory.bin's
    /// page cache.
    pub pooled_mib_per_child: f64,
    /// The same, without the shared page cache: what one more child adds.
    pub pooled_private_mib_per_child: f64,
    /// memory.bin's page cache, shared by all N.
    pub shared_cache_mib: f64,
    /// Per pooled child, its pages in swap (SwapPss): not in the figures
    /// above. 0 unless the pool pages children out (or the host is short of RAM).
    pub swapped_mib_per_child: f64,
    /// What those swapped pages hold of RAM when swap is compressed RAM
    /// (zram, zswap), per child; None for swap on disk or no swap in use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compressed_mib_per_child: Option<f64>,
    /// Where one pooled child's memory goes (the first one's).
    pub one_child: Option<MemBreakdown>,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The snapshot's tag.
    pub tag: String,
    /// Its image.
    pub image: String,
    /// "kvm" or "tcg".
    pub accel: String,
    /// Host CPUs.
    pub host_cpus: usize,
    /// forkd's version.
    pub version: String,
    /// The probe each child evaluates.
    pub probe: String,
    /// The pools' `warm_eval`, if set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_eval: Option<String>,
    /// Whether the pools paged their children out to swap.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub page_out: bool,
    /// With `page_out`, the pools' `keep_resident` (poold's default when
    /// the bench did not set it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_resident: Option<usize>,
    /// The host's swap, when it has some (`zram0 (lzo-rle)`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swap: Option<String>,
    /// Sequential single spawns per source.
    pub sequential: Vec<SeqRow>,
    /// Fan-out, per N.
    pub fanout: Vec<FanRow>,
}

/// Runs the spawn benchmark against the poold of `Client::from_env` and prints its report.
pub async fn run(paths: &Paths, b: SpawnBench) -> Result<Report> {
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
    let image = info["config"]["image"]
        .as_str()
        .context("snapshot records no image")?
        .to_string();
    let accel: forkd_vmm::Accel =
        serde_json::from_value(info["config"]["machine"]["accel"].clone())?;
    let snap_id = info["id"].as_str().context("snapshot info has no id")?;
    let memory = paths
        .mount_dir()
        .join("by-id")
        .join(snap_id)
        .join("memory.bin");
    println!(
        "spawn benchmark: snapshot {} (image {image}, {accel:?}), {} sequential spawns per source, \
         fan-out {:?}, probe eval({:?}), through poold at {}",
        b.tag,
        b.seq,
        b.fanout,
        b.probe,
        std::env::var("FORKD_URL").unwrap_or_else(|_| forkd_api::DEFAULT_URL.into())
    );
    let mut report = Report {
        tag: b.tag.clone(),
        image: image.clone(),
        accel: format!("{accel:?}").to_lowercase(),
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        version: env!("CARGO_PKG_VERSION").into(),
        probe: b.probe.clone(),
        warm_eval: b.warm_eval.clone(),
        page_out: b.page_out,
        keep_resident: b
            .page_out
            .then(|| b.keep_resident.unwrap_or(forkd_api::DEFAULT_KEEP_RESIDENT)),
        swap: swap_kind(),
        sequential: Vec::new(),
        fanout: Vec::new(),
    };

    if b.seq > 0 {
        fill_and_hold(&c, &b, &b.tag, b.seq).await?;
        report
            .sequential
            .push(sequential(&c, &b, &b.tag, "pool hit").await?);
        drain(&c, &b.tag).await?;
        if let Some(net_tag) = &b.net_tag {
            fill_and_hold(&c, &b, net_tag, b.seq).await?;
            report
                .sequential
                .push(sequential(&c, &b, net_tag, "pool hit + net").await?);
            drain(&c, net_tag).await?;
        }
        report
            .sequential
            .push(sequential(&c, &b, &b.tag, "on demand").await?);
        // 0 cold samples: no cold-boot row (the fork bench's helper boots
        // at least once, for its memory figure).
        if b.cold_samples > 0 {
            let mem = info["config"]["machine"]["mem_mib"].as_u64().unwrap_or(512);
            let (cold, _) =
                super::fork::cold_samples(paths, &image, mem, accel, b.cold_samples, &b.probe)
                    .await?;
            report.sequential.push(SeqRow {
                source: "cold boot".into(),
                samples: cold.len(),
                spawn_p50_ms: median(&cold),
                spawn_p99_ms: pct(&cold, 99.0),
                poold_p50_ms: f64::NAN,
                first_eval_p50_ms: f64::NAN,
                later_eval_p50_ms: f64::NAN,
                hits: 0,
            });
        }
        print_sequential(&report.sequential);
    }

    for &n in &b.fanout {
        let fill = Instant::now();
        fill_and_hold(&c, &b, &b.tag, n).await?;
        let fill_s = fill.elapsed().as_secs_f64();
        let row = fan_out(&c, &b, paths, &memory, n, fill_s).await?;
        drain(&c, &b.tag).await?;
        report.fanout.push(row);
    }
    if !report.fanout.is_empty() {
        print_fanout(&report.fanout);
    }

    if let Some(path) = &b.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("\nreport written to {}", path.display());
    }
    Ok(report)
}

/// `seq` single spawns from `tag`, one after another, each followed by two
/// probe evals and a delete (not timed).
async fn sequential(c: &Client, b: &SpawnBench, tag: &str, source: &str) -> Result<SeqRow> {
    let (mut spawn, mut poold, mut first, mut later) = (vec![], vec![], vec![], vec![]);
    let mut hits = 0;
    for _ in 0..b.seq {
        let t0 = Instant::now();
        let made: Vec<SandboxInfo> = c
            .post("/v1/sandboxes", json!({"snapshot_tag": tag, "n": 1}))
            .await?;
        spawn.push(ms(t0));
        let sb = made.first().context("the spawn returned no sandbox")?;
        poold.push(sb.spawn_ms as f64);
        hits += usize::from(sb.pool_hit);
        let t1 = Instant::now();
        probe(c, &sb.id, &b.probe).await?;
        first.push(ms(t1));
        let t2 = Instant::now();
        probe(c, &sb.id, &b.probe).await?;
        later.push(ms(t2));
        c.delete(&format!("/v1/sandboxes/{}", sb.id)).await?;
    }
    Ok(SeqRow {
        source: source.into(),
        samples: spawn.len(),
        spawn_p50_ms: median(&spawn),
        spawn_p99_ms: pct(&spawn, 99.0),
        poold_p50_ms: median(&poold),
        first_eval_p50_ms: median(&first),
        later_eval_p50_ms: median(&later),
        hits,
    })
}

/// With N children parked: measures their memory, spawns all N in one
/// request and waits until every one answered the probe.
async fn fan_out(
    c: &Client,
    b: &SpawnBench,
    paths: &Paths,
    memory: &Path,
    n: usize,
    fill_s: f64,
) -> Result<FanRow> {
    let pids = pooled_pids(paths)?;
    let mem = ChildrenMem::measure(&pids, memory);
    let one_child = pids.first().and_then(|&p| breakdown(p, memory));
    let cpu0 = poold_cpu(c).await?;
    let t0 = Instant::now();
    let made: Vec<SandboxInfo> = c
        .post("/v1/sandboxes", json!({"snapshot_tag": b.tag, "n": n}))
        .await?;
    let evals = futures::future::join_all(made.iter().map(|s| probe(c, &s.id, &b.probe))).await;
    let wall_ms = ms(t0);
    let cpu1 = poold_cpu(c).await?;
    futures::future::join_all(
        made.iter()
            .map(|s| async move { c.delete(&format!("/v1/sandboxes/{}", s.id)).await }),
    )
    .await
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    evals.into_iter().collect::<Result<Vec<_>>>()?;
    let spawn: Vec<f64> = made.iter().map(|s| s.spawn_ms as f64).collect();
    let k = mem.children.max(1) as f64;
    Ok(FanRow {
        n,
        fill_s,
        wall_ms,
        spawn_p50_ms: median(&spawn),
        spawn_p99_ms: pct(&spawn, 99.0),
        hits: made.iter().filter(|s| s.pool_hit).count(),
        poold_cpu_ms_per_child: (cpu1 - cpu0) * 1e3 / n as f64,
        pooled_mib_per_child: mem.per_child_mib(),
        pooled_private_mib_per_child: mem.private_mib / k,
        shared_cache_mib: mem.shared_cache_mib,
        swapped_mib_per_child: mem.swapped_mib / k,
        compressed_mib_per_child: mem.compressed_mib.map(|z| z / k),
        one_child,
    })
}

/// Evaluates the probe in sandbox `id`; a Python error is a failure.
async fn probe(c: &Client, id: &str, code: &str) -> Result<()> {
    let r: EvalReply = c
        .post(&format!("/v1/sandboxes/{id}/eval"), json!({ "code": code }))
        .await?;
    match r.error {
        Some(e) => bail!("probe failed in {id}: {e}"),
        None => Ok(()),
    }
}

/// The QEMU pids of every VM poold keeps. With no sandboxes running (the
/// benchmark checks), those are the pooled children.
pub(crate) fn pooled_pids(paths: &Paths) -> Result<Vec<u32>> {
    let mut pids = Vec::new();
    let dir = paths.vms_dir();
    for e in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let vm = forkd_vmm::VmDir::new(e?.path());
        if let Ok(r) = vm.read_record() {
            if r.qemu.is_alive() {
                pids.push(r.qemu.pid);
            }
        }
    }
    Ok(pids)
}

/// Fills `tag`'s pool with `n` paused children, then stops it refilling,
/// so what is measured next runs without restores competing for the CPU.
async fn fill_and_hold(c: &Client, b: &SpawnBench, tag: &str, n: usize) -> Result<()> {
    let spec = |min: usize| {
        let mut s = json!({"min_ready": min, "max_ready": n, "warm": true, "page_out": b.page_out});
        if let Some(code) = &b.warm_eval {
            s["warm_eval"] = json!(code);
        }
        if let Some(k) = b.keep_resident {
            s["keep_resident"] = json!(k);
        }
        s
    };
    c.put::<PoolStatus>(&format!("/v1/pools/{tag}"), spec(n))
        .await?;
    wait_pool(c, tag, |p| p.ready >= n).await?;
    c.put::<PoolStatus>(&format!("/v1/pools/{tag}"), spec(0))
        .await?;
    Ok(())
}

/// Deletes `tag`'s pool and waits until its children are gone.
async fn drain(c: &Client, tag: &str) -> Result<()> {
    c.delete(&format!("/v1/pools/{tag}")).await?;
    wait_pool(c, tag, |p| p.ready == 0 && p.in_flight == 0).await
}

fn print_sequential(rows: &[SeqRow]) {
    let hit = rows
        .iter()
        .find(|r| r.source == "pool hit")
        .map_or(f64::NAN, |r| r.spawn_p50_ms);
    println!();
    println!("sequential single spawns (request → agent answered, client clock):");
    println!(
        "{:<16} {:>7} {:>10} {:>10} {:>11} {:>11} {:>11} {:>11}",
        "source", "spawns", "p50", "p99", "poold p50", "1st eval", "2nd eval", "p50 / hit"
    );
    for r in rows {
        println!(
            "{:<16} {:>7} {:>10} {:>10} {:>11} {:>11} {:>11} {:>10.1}x",
            r.source,
            r.samples,
            fmt_ms(r.spawn_p50_ms),
            fmt_ms(r.spawn_p99_ms),
            fmt_ms(r.poold_p50_ms),
            fmt_ms(r.first_eval_p50_ms),
            fmt_ms(r.later_eval_p50_ms),
            r.spawn_p50_ms / hit
        );
    }
}

fn print_fanout(rows: &[FanRow]) {
    println!();
    println!(
        "fan-out from a full pool (one request for N; wall = until all N answered the probe):"
    );
    println!(
        "{:>5} {:>9} {:>11} {:>10} {:>10} {:>5} {:>12} {:>13} {:>14}",
        "N",
        "fill",
        "wall",
        "spawn p50",
        "spawn p99",
        "hits",
        "poold CPU/ch",
        "pooled MiB/ch",
        "private MiB/ch"
    );
    for r in rows {
        println!(
            "{:>5} {:>7.1}s {:>9.0}ms {:>8.0}ms {:>8.0}ms {:>5} {:>10.2}ms {:>13.1} {:>14.1}",
            r.n,
            r.fill_s,
            r.wall_ms,
            r.spawn_p50_ms,
            r.spawn_p99_ms,
            r.hits,
            r.poold_cpu_ms_per_child,
            r.pooled_mib_per_child,
            r.pooled_private_mib_per_child
        );
    }
    if rows.iter().any(|r| r.swapped_mib_per_child > 0.0) {
        println!();
        println!(
            "in swap ({}), not resident (not in the columns above):",
            swap_kind().unwrap_or_else(|| "none now".into())
        );
        println!(
            "{:>5} {:>15} {:>18} {:>22}",
            "N", "swapped MiB/ch", "compressed MiB/ch", "pooled + compressed"
        );
        for r in rows {
            let (z, all) = match r.compressed_mib_per_child {
                Some(z) => (
                    format!("{z:.1}"),
                    format!("{:.1}", z + r.pooled_mib_per_child),
                ),
                None => ("-".into(), "-".into()),
            };
            println!(
                "{:>5} {:>15.1} {:>18} {:>22}",
                r.n, r.swapped_mib_per_child, z, all
            );
        }
    }
    if let Some(b) = rows.last().and_then(|r| r.one_child.as_ref()) {
        println!();
        println!(
            "one paused pooled child, PSS MiB: total {:.1} = guest RAM written {:.1} + guest RAM \
             shared {:.1} + TCG code {:.1} + QEMU heap {:.1} + other anonymous {:.1} + QEMU and \
             libraries {:.1}",
            b.total_mib,
            b.guest_private_mib,
            b.guest_shared_mib,
            b.tcg_code_mib,
            b.heap_mib,
            b.other_anon_mib,
            b.binaries_mib
        );
    }
    println!(
        "pooled MiB/ch: each QEMU's PSS outside memory.bin plus an equal share of memory.bin's \
         page cache, all N parked."
    );
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

/// `12.3ms`, or `-` for a figure not measured (NaN).
fn fmt_ms(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.1}ms")
    }
}
