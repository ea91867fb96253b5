//! `forkd bench e2b --tag T -n N`: what serving the E2B API costs. The same
//! round trip, create a sandbox and run the probe in it, through poold's
//! E2B endpoints (`POST /v2/sandboxes`, then the code interpreter's
//! `/execute` through the sandbox plane) and through `/v1` (spawn, then
//! eval), from the same full pool, one sandbox at a time, the two paths
//! alternating. Prints the medians side by side and their difference.

use super::{median, ms, pct, wait_pool};
use anyhow::{bail, Context, Result};
use forkd_api::{Client, EvalReply, PoolStatus, SandboxInfo};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The benchmark's knobs.
#[derive(Debug, Clone)]
pub struct E2bBench {
    /// Snapshot tag (the E2B template).
    pub tag: String,
    /// Round trips per path.
    pub n: usize,
    /// Python each sandbox runs.
    pub probe: String,
    /// poold's E2B API (`E2B_API_URL`).
    pub api_url: String,
    /// poold's E2B sandbox plane (`E2B_SANDBOX_URL`).
    pub sandbox_url: String,
    /// The E2B API key.
    pub api_key: String,
}

/// One round trip's figures, ms.
#[derive(Debug, Default)]
struct Trip {
    create: f64,
    run: f64,
    spawn: f64,
    hit: bool,
}

/// Runs the benchmark against the poold of `Client::from_env` and prints its report.
pub async fn run(b: E2bBench) -> Result<()> {
    let c = Client::from_env()?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?;
    let _: Value = c
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
        "E2B benchmark: template {}, {} create + run-code round trips per path, probe {:?}",
        b.tag, b.n, b.probe
    );
    println!(
        "  /v1 at {}, E2B API at {}, sandbox plane at {}",
        std::env::var("FORKD_URL").unwrap_or_else(|_| forkd_api::DEFAULT_URL.into()),
        b.api_url,
        b.sandbox_url
    );
    // Both paths draw from one full pool that is not refilled meanwhile,
    // so every create is a hand-out and no restore competes for the CPU.
    let total = 2 * b.n;
    let pool = format!("/v1/pools/{}", b.tag);
    c.put::<PoolStatus>(
        &pool,
        json!({"min_ready": total, "max_ready": total, "warm": true}),
    )
    .await?;
    wait_pool(&c, &b.tag, |p| p.ready >= total).await?;
    c.put::<PoolStatus>(
        &pool,
        json!({"min_ready": 0, "max_ready": total, "warm": true}),
    )
    .await?;

    let (mut v1, mut e2b) = (Vec::new(), Vec::new());
    for i in 0..b.n {
        if i % 2 == 0 {
            v1.push(v1_trip(&c, &b).await?);
            e2b.push(e2b_trip(&c, &http, &b).await?);
        } else {
            e2b.push(e2b_trip(&c, &http, &b).await?);
            v1.push(v1_trip(&c, &b).await?);
        }
    }
    c.delete(&pool).await?;

    println!();
    println!(
        "{:<6} {:>12} {:>12} {:>14} {:>14} {:>16} {:>6}",
        "path",
        "create p50",
        "run p50",
        "create+run p50",
        "create+run p99",
        "poold spawn p50",
        "hits"
    );
    let row = |name: &str, t: &[Trip]| {
        let both: Vec<f64> = t.iter().map(|t| t.create + t.run).collect();
        println!(
            "{:<6} {:>10.1}ms {:>10.1}ms {:>12.1}ms {:>12.1}ms {:>14.1}ms {:>6}",
            name,
            median(&t.iter().map(|t| t.create).collect::<Vec<_>>()),
            median(&t.iter().map(|t| t.run).collect::<Vec<_>>()),
            median(&both),
            pct(&both, 99.0),
            median(&t.iter().map(|t| t.spawn).collect::<Vec<_>>()),
            t.iter().filter(|t| t.hit).count()
        );
        median(&both)
    };
    let a = row("/v1", &v1);
    let e = row("E2B", &e2b);
    println!();
    println!(
        "E2B path minus /v1 path, create+run medians: {:+.1} ms",
        e - a
    );
    println!("create: request sent until the sandbox's answer (201) arrived, at the client.");
    println!("run: the probe through /v1 eval, or through the sandbox plane's /execute (NDJSON).");
    println!("poold spawn: poold's own clock for the spawn inside either create.");
    Ok(())
}

async fn v1_trip(c: &Client, b: &E2bBench) -> Result<Trip> {
    let t0 = Instant::now();
    let made: Vec<SandboxInfo> = c
        .post("/v1/sandboxes", json!({"snapshot_tag": b.tag, "n": 1}))
        .await?;
    let create = ms(t0);
    let s = made.first().context("spawn answered no sandbox")?;
    let t1 = Instant::now();
    let r: EvalReply = c
        .post(
            &format!("/v1/sandboxes/{}/eval", s.id),
            json!({"code": b.probe}),
        )
        .await?;
    let run = ms(t1);
    c.delete(&format!("/v1/sandboxes/{}", s.id)).await?;
    if let Some(e) = r.error {
        bail!("the probe failed in {}: {e}", s.id);
    }
    Ok(Trip {
        create,
        run,
        spawn: s.spawn_ms as f64,
        hit: s.pool_hit,
    })
}

async fn e2b_trip(c: &Client, http: &reqwest::Client, b: &E2bBench) -> Result<Trip> {
    let t0 = Instant::now();
    let resp = http
        .post(format!("{}/v2/sandboxes", b.api_url.trim_end_matches('/')))
        .header("X-API-KEY", &b.api_key)
        .json(&json!({"templateID": b.tag, "timeout": 300}))
        .send()
        .await
        .context("E2B create: is poold serving the E2B API there (--e2b-bind)?")?;
    let status = resp.status();
    let body: Value = resp.json().await?;
    let create = ms(t0);
    if status.as_u16() != 201 {
        bail!("E2B create answered {status}: {body}");
    }
    let id = body["sandboxID"]
        .as_str()
        .context("no sandboxID")?
        .to_string();
    let token = body["envdAccessToken"].as_str().unwrap_or("").to_string();
    let t1 = Instant::now();
    let resp = http
        .post(format!("{}/execute", b.sandbox_url.trim_end_matches('/')))
        .header("E2b-Sandbox-Id", &id)
        .header("E2b-Sandbox-Port", "49999")
        .header("X-Access-Token", &token)
        .json(&json!({"code": b.probe, "context_id": null, "language": null, "env_vars": null}))
        .send()
        .await?;
    let status = resp.status();
    let text = resp.text().await?;
    let run = ms(t1);
    let info: SandboxInfo = c.get(&format!("/v1/sandboxes/{id}")).await?;
    http.delete(format!(
        "{}/sandboxes/{id}",
        b.api_url.trim_end_matches('/')
    ))
    .header("X-API-KEY", &b.api_key)
    .send()
    .await?;
    let ok = status.is_success()
        && text
            .lines()
            .any(|l| serde_json::from_str::<Value>(l).is_ok_and(|v| v["type"] == "result"));
    if !ok {
        bail!("run_code through the E2B sandbox plane answered {status}: {text}");
    }
    Ok(Trip {
        create,
        run,
        spawn: info.spawn_ms as f64,
        hit: info.pool_hit,
    })
}
