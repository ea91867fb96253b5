//! `forkd bench e2b --tag T -n N`: what serving the E2B API costs. The same
//! round trip, create a sandbox and run the probe in it, through poold's
//! E2B endpoints (`POST /v2/sandboxes`, then the code interpreter's
//! `/execute` through the sandbox plane) and through `/v1` (spawn, then
//! eval), from the same full pool, one sandbox at a time, the two paths
//! alternating. Prints the medians side by side and their difference.
//! Then `n` pause → resume cycles of one E2B sandbox (pause, connect, the
//! probe sees the state), and with `--chart-tag` (a template of the
//! `code-interpreter` image) `n` cells that return a matplotlib chart.

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
    /// A code-interpreter template to time a chart cell on (None: skipped).
    pub chart_tag: Option<String>,
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
    let http = forkd_api::http_builder()
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
    pause_cycles(&c, &http, &b).await?;
    if let Some(tag) = &b.chart_tag {
        charts(&http, &b, tag).await?;
    }
    Ok(())
}

/// The E2B API's base URL and key, for the calls below.
struct Api<'a> {
    http: &'a reqwest::Client,
    b: &'a E2bBench,
}

impl Api<'_> {
    /// POSTs `body` to the control plane's `path`; the status and the JSON
    /// answer (null when there is none).
    async fn post(&self, path: &str, body: Value) -> Result<(u16, Value)> {
        let resp = self
            .http
            .post(format!("{}{path}", self.b.api_url.trim_end_matches('/')))
            .header("X-API-KEY", &self.b.api_key)
            .json(&body)
            .send()
            .await
            .with_context(|| format!("E2B {path}"))?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    /// Creates a sandbox of `tag`: its id and access token.
    async fn create(&self, tag: &str) -> Result<(String, String)> {
        let (st, v) = self
            .post("/v2/sandboxes", json!({"templateID": tag, "timeout": 600}))
            .await?;
        if st != 201 {
            bail!("E2B create of {tag} answered {st}: {v}");
        }
        let id = v["sandboxID"].as_str().context("no sandboxID")?;
        let token = v["envdAccessToken"].as_str().unwrap_or("");
        Ok((id.to_string(), token.to_string()))
    }

    async fn kill(&self, id: &str) -> Result<()> {
        self.http
            .delete(format!(
                "{}/sandboxes/{id}",
                self.b.api_url.trim_end_matches('/')
            ))
            .header("X-API-KEY", &self.b.api_key)
            .send()
            .await?;
        Ok(())
    }

    /// Runs `code` through the sandbox plane's `/execute`: its NDJSON lines.
    async fn execute(&self, id: &str, token: &str, code: &str) -> Result<Vec<Value>> {
        let resp = self
            .http
            .post(format!(
                "{}/execute",
                self.b.sandbox_url.trim_end_matches('/')
            ))
            .header("E2b-Sandbox-Id", id)
            .header("E2b-Sandbox-Port", "49999")
            .header("X-Access-Token", token)
            .json(&json!({"code": code, "context_id": null, "language": null, "env_vars": null}))
            .send()
            .await?;
        let status = resp.status();
        let text = resp.text().await?;
        if !status.is_success() {
            bail!("/execute answered {status}: {text}");
        }
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }
}

/// The text of the `result` line of an execution, if any.
fn result_text(lines: &[Value]) -> Option<&str> {
    lines
        .iter()
        .find(|v| v["type"] == "result")
        .and_then(|v| v["text"].as_str())
}

/// `n` pause → resume cycles of one sandbox: pause until 204, connect
/// until 201 (the resume), then the probe, which must see the state set
/// before the first pause. Prints medians and the bytes each pause stored.
async fn pause_cycles(c: &Client, http: &reqwest::Client, b: &E2bBench) -> Result<()> {
    let api = Api { http, b };
    let (id, token) = api.create(&b.tag).await?;
    let outcome = async {
        api.execute(&id, &token, "bench_state = 41").await?;
        let (mut pause, mut resume, mut first_run, mut stored) = (vec![], vec![], vec![], vec![]);
        for _ in 0..b.n {
            let t0 = Instant::now();
            let (st, v) = api
                .post(&format!("/sandboxes/{id}/pause"), json!({}))
                .await?;
            if st != 204 {
                bail!("pause answered {st}: {v}");
            }
            pause.push(ms(t0));
            let ws: Value = c.get(&format!("/v1/workspaces/{id}")).await?;
            stored.push(ws["last_suspend_stored_bytes"].as_f64().unwrap_or(0.0));
            let t1 = Instant::now();
            let (st, v) = api
                .post(&format!("/sandboxes/{id}/connect"), json!({"timeout": 600}))
                .await?;
            if st != 201 {
                bail!("connect to the paused sandbox answered {st}: {v}");
            }
            resume.push(ms(t1));
            let t2 = Instant::now();
            let lines = api.execute(&id, &token, "bench_state + 1").await?;
            first_run.push(ms(t2));
            if result_text(&lines) != Some("42") {
                bail!("the state did not survive a pause: {lines:?}");
            }
        }
        Ok((pause, resume, first_run, stored))
    }
    .await;
    api.kill(&id).await?;
    let (pause, resume, first_run, stored) = outcome?;
    let cycle: Vec<f64> = (0..pause.len())
        .map(|i| pause[i] + resume[i] + first_run[i])
        .collect();
    println!();
    println!("pause → resume, {} cycles of one sandbox:", pause.len());
    println!(
        "{:>10} {:>11} {:>16} {:>10} {:>10} {:>18}",
        "pause p50", "resume p50", "first run p50", "cycle p50", "cycle p99", "stored/pause p50"
    );
    println!(
        "{:>8.1}ms {:>9.1}ms {:>14.1}ms {:>8.1}ms {:>8.1}ms {:>14.2}MiB",
        median(&pause),
        median(&resume),
        median(&first_run),
        median(&cycle),
        pct(&cycle, 99.0),
        median(&stored) / (1024.0 * 1024.0)
    );
    println!("pause: POST /sandboxes/{{id}}/pause until 204 (memory and disk stored, VM gone).");
    println!("resume: POST /sandboxes/{{id}}/connect until 201 (restored, same id and token).");
    println!("first run: the probe after the resume, which must see the state from before.");
    Ok(())
}

/// A matplotlib chart cell: E2B's SDK gets a PNG and its chart data.
const CHART_CELL: &str = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('bench')\nplt.show()";

/// `n` chart cells on fresh sandboxes of `tag`: create, then the cell until
/// its PNG result arrived.
async fn charts(http: &reqwest::Client, b: &E2bBench, tag: &str) -> Result<()> {
    let api = Api { http, b };
    let (mut create, mut run) = (vec![], vec![]);
    for _ in 0..b.n {
        let t0 = Instant::now();
        let (id, token) = api.create(tag).await?;
        create.push(ms(t0));
        let t1 = Instant::now();
        let lines = api.execute(&id, &token, CHART_CELL).await;
        run.push(ms(t1));
        api.kill(&id).await?;
        let lines = lines?;
        if !lines
            .iter()
            .any(|v| v["type"] == "result" && v["png"].is_string())
        {
            bail!("the chart cell returned no PNG: {lines:?}");
        }
    }
    let both: Vec<f64> = (0..create.len()).map(|i| create[i] + run[i]).collect();
    println!();
    println!(
        "run_code returning a chart on {tag}, {} fresh sandboxes:",
        create.len()
    );
    println!(
        "{:>11} {:>14} {:>16} {:>16}",
        "create p50", "chart cell p50", "create+cell p50", "create+cell p99"
    );
    println!(
        "{:>9.1}ms {:>12.1}ms {:>14.1}ms {:>14.1}ms",
        median(&create),
        median(&run),
        median(&both),
        pct(&both, 99.0)
    );
    println!(
        "chart cell: /execute of a matplotlib plot until its PNG result (and the end) arrived."
    );
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
