//! `forkd bench browser --tag T`: what forking a warm Chromium saves
//! (docs/browser.md). Through a running poold, from snapshot `T` of the
//! `browser` image (networked, so a child's DevTools port is published):
//!
//! - **first CDP answer**, one spawn after another: the spawn request (with
//!   `ports: [9222]`) until `Browser.getVersion` answered over the
//!   WebSocket that `/json/version` names, through the published port,
//!   client clock; from a full pool (pool hit) and from an empty one (on
//!   demand: the restore is in the path);
//! - **cold**: a fresh VM of the image booted here, Chromium started by its
//!   warm-up, until the same command answered in the guest (through the
//!   agent's eval, as a local boot has no published port);
//! - **navigation**: in forked children, `Page.navigate` to a small page
//!   until its load event, then `Page.captureScreenshot`, each done twice
//!   (the first pays what the child has not warmed);
//! - **memory**: K children alive after their first answer, the host
//!   memory per child (QEMU PSS outside memory.bin plus an equal share of
//!   memory.bin's page cache).
//!
//! Prints the figures and, with `--json`, writes them for
//! `scripts/plot-benchmarks.py`.

use super::mem::ChildrenMem;
use super::{median, ms, pct, wait_pool};
use anyhow::{bail, Context, Result};
use forkd_api::{Client, PoolStatus, SandboxInfo};
use forkd_snapshot::Paths;
use futures::{SinkExt, StreamExt};
use serde::Serialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

/// The DevTools port the browser image's forwarder serves.
pub const DEVTOOLS_PORT: u16 = 9222;
/// What a cold VM evaluates: the same command, from inside the guest.
const COLD_PROBE: &str = "forkd_browser.cdp('Browser.getVersion')['product']";
/// The page the navigation figures load: markup and text, no fetch.
const PAGE: &str =
    "data:text/html,<title>forkd</title><h1 style='font:48px sans-serif'>forked browser</h1>";
/// Bound on one DevTools exchange (TCG is slow, a loaded host slower).
const CDP_TIMEOUT: Duration = Duration::from_secs(300);

/// The benchmark's knobs.
#[derive(Debug, Clone)]
pub struct BrowserBench {
    /// Tag of a networked snapshot of the `browser` image.
    pub tag: String,
    /// Sequential spawns per source (pool hit, on demand).
    pub seq: usize,
    /// Cold boots measured (0: none).
    pub cold_samples: usize,
    /// Children alive at once for the memory figure (0: skip).
    pub mem_children: usize,
    /// Where to write the report as JSON.
    pub json: Option<PathBuf>,
}

/// Sequential spawns from one source.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// "pool hit", "on demand" or "cold boot".
    pub source: String,
    /// Spawns measured.
    pub samples: usize,
    /// Request sent → first CDP command answered, p50.
    pub p50_ms: f64,
    /// 99th percentile of the same.
    pub p99_ms: f64,
    /// poold's own spawn figure (request → agent answered), p50; NaN for cold boots.
    pub spawn_p50_ms: f64,
}

/// A forked child's first and second navigation and screenshot, medians.
#[derive(Debug, Clone, Serialize)]
pub struct Navigation {
    /// Children measured.
    pub samples: usize,
    /// First `Page.navigate` until the load event.
    pub first_navigate_ms: f64,
    /// The second navigation.
    pub second_navigate_ms: f64,
    /// First `Page.captureScreenshot`.
    pub first_screenshot_ms: f64,
    /// The second screenshot.
    pub second_screenshot_ms: f64,
}

/// Host memory of forked browser children alive at once.
#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    /// Children alive.
    pub children: usize,
    /// Per child: private PSS plus an equal share of memory.bin's page cache.
    pub mib_per_child: f64,
    /// Per child, without the shared cache: what one more child adds.
    pub private_mib_per_child: f64,
    /// memory.bin's page cache, shared by all of them.
    pub shared_cache_mib: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The snapshot's tag.
    pub tag: String,
    /// Its image.
    pub image: String,
    /// Its guest RAM, MiB.
    pub mem_mib: u64,
    /// "kvm" or "tcg".
    pub accel: String,
    /// Host CPUs.
    pub host_cpus: usize,
    /// forkd's version.
    pub version: String,
    /// The browser's version, as DevTools reports it.
    pub product: String,
    /// First CDP answer per source.
    pub rows: Vec<Row>,
    /// Navigation in forked children.
    pub navigation: Option<Navigation>,
    /// Memory per forked child.
    pub memory: Option<Memory>,
}

/// Runs the benchmark against the poold of `Client::from_env` and prints its report.
pub async fn run(paths: &Paths, b: BrowserBench) -> Result<Report> {
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
    let config = &info["config"];
    if config["machine"]["net"] != json!(true) {
        bail!(
            "snapshot {} has no network, so its DevTools port cannot be published: \
             take it with --net (forkd snapshot create --tag {} --image browser --net)",
            b.tag,
            b.tag
        );
    }
    let image = config["image"].as_str().unwrap_or("?").to_string();
    let mem_mib = config["machine"]["mem_mib"].as_u64().unwrap_or(0);
    let accel: forkd_vmm::Accel = serde_json::from_value(config["machine"]["accel"].clone())?;
    let snap_id = info["id"].as_str().context("snapshot info has no id")?;
    let memory_bin = paths
        .mount_dir()
        .join("by-id")
        .join(snap_id)
        .join("memory.bin");
    println!(
        "browser benchmark: snapshot {} (image {image}, {mem_mib} MiB, {accel:?}), {} spawns per source, \
         {} cold boots, through poold at {}",
        b.tag,
        b.seq,
        b.cold_samples,
        std::env::var("FORKD_URL").unwrap_or_else(|_| forkd_api::DEFAULT_URL.into())
    );
    let mut report = Report {
        tag: b.tag.clone(),
        image: image.clone(),
        mem_mib,
        accel: format!("{accel:?}").to_lowercase(),
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        version: env!("CARGO_PKG_VERSION").into(),
        product: String::new(),
        rows: Vec::new(),
        navigation: None,
        memory: None,
    };
    let mut navs = Vec::new();
    if b.seq > 0 {
        fill_and_hold(&c, &b.tag, b.seq).await?;
        let (row, product) = sequential(&c, &b.tag, b.seq, "pool hit", &mut navs).await?;
        report.rows.push(row);
        report.product = product;
        drain(&c, &b.tag).await?;
        let (row, _) = sequential(&c, &b.tag, b.seq, "on demand", &mut navs).await?;
        report.rows.push(row);
    }
    if b.cold_samples > 0 {
        let (cold, _) =
            super::fork::cold_samples(paths, &image, mem_mib, accel, b.cold_samples, COLD_PROBE)
                .await?;
        report.rows.push(Row {
            source: "cold boot".into(),
            samples: cold.len(),
            p50_ms: median(&cold),
            p99_ms: pct(&cold, 99.0),
            spawn_p50_ms: f64::NAN,
        });
    }
    if !navs.is_empty() {
        let col = |f: fn(&[f64; 4]) -> f64| median(&navs.iter().map(f).collect::<Vec<_>>());
        report.navigation = Some(Navigation {
            samples: navs.len(),
            first_navigate_ms: col(|n| n[0]),
            second_navigate_ms: col(|n| n[1]),
            first_screenshot_ms: col(|n| n[2]),
            second_screenshot_ms: col(|n| n[3]),
        });
    }
    if b.mem_children > 0 {
        report.memory = Some(memory(&c, paths, &b.tag, b.mem_children, &memory_bin).await?);
    }
    print_report(&report);
    if let Some(path) = &b.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("\nreport written to {}", path.display());
    }
    Ok(report)
}

/// A spawn from `tag` with the DevTools port published; its sandbox and
/// the host port.
async fn spawn(c: &Client, tag: &str, n: usize) -> Result<Vec<(SandboxInfo, u16)>> {
    let made: Vec<SandboxInfo> = c
        .post(
            "/v1/sandboxes",
            json!({"snapshot_tag": tag, "n": n, "ports": [{"guest_port": DEVTOOLS_PORT}]}),
        )
        .await?;
    made.into_iter()
        .map(|s| {
            let port = s
                .ports
                .iter()
                .find(|p| p.guest_port == DEVTOOLS_PORT)
                .map(|p| p.host_port)
                .context("the spawn published no DevTools port")?;
            Ok((s, port))
        })
        .collect()
}

/// `seq` spawns from `tag`, one after another, each timed until its first
/// CDP answer, then navigated (not in that time) and deleted. Returns the
/// row and the browser's product string.
async fn sequential(
    c: &Client,
    tag: &str,
    seq: usize,
    source: &str,
    navs: &mut Vec<[f64; 4]>,
) -> Result<(Row, String)> {
    let (mut answer, mut spawned) = (Vec::new(), Vec::new());
    let mut product = String::new();
    for _ in 0..seq {
        let t0 = Instant::now();
        let (sb, port) = spawn(c, tag, 1).await?.pop().context("no sandbox")?;
        product = browser_version(port).await?;
        answer.push(ms(t0));
        spawned.push(sb.spawn_ms as f64);
        navs.push(navigate_twice(port).await?);
        c.delete(&format!("/v1/sandboxes/{}", sb.id)).await?;
    }
    let row = Row {
        source: source.into(),
        samples: answer.len(),
        p50_ms: median(&answer),
        p99_ms: pct(&answer, 99.0),
        spawn_p50_ms: median(&spawned),
    };
    Ok((row, product))
}

/// With `k` children alive (each answered its first command), their host
/// memory.
async fn memory(
    c: &Client,
    paths: &Paths,
    tag: &str,
    k: usize,
    memory_bin: &std::path::Path,
) -> Result<Memory> {
    let made = spawn(c, tag, k).await?;
    let answered =
        futures::future::join_all(made.iter().map(|(_, port)| browser_version(*port))).await;
    let pids = super::spawn::pooled_pids(paths)?;
    let m = ChildrenMem::measure(&pids, memory_bin);
    for (sb, _) in &made {
        c.delete(&format!("/v1/sandboxes/{}", sb.id)).await?;
    }
    answered.into_iter().collect::<Result<Vec<_>>>()?;
    let n = m.children.max(1) as f64;
    Ok(Memory {
        children: m.children,
        mib_per_child: m.per_child_mib(),
        private_mib_per_child: m.private_mib / n,
        shared_cache_mib: m.shared_cache_mib,
    })
}

/// `GET /json/version` through the published `port`, then
/// `Browser.getVersion` over the WebSocket it names; returns the product.
pub async fn browser_version(port: u16) -> Result<String> {
    let version = http_json(port, "/json/version").await?;
    let ws = version["webSocketDebuggerUrl"]
        .as_str()
        .context("/json/version names no webSocketDebuggerUrl")?;
    let mut s = Cdp::connect(ws).await?;
    let r = s.call("Browser.getVersion", json!({})).await?;
    Ok(r["product"].as_str().unwrap_or("").to_string())
}

/// Navigates the child's page to [`PAGE`] and screenshots it, twice each;
/// returns [first navigation, second, first screenshot, second] in ms.
async fn navigate_twice(port: u16) -> Result<[f64; 4]> {
    let pages = http_json(port, "/json/list").await?;
    let ws = pages
        .as_array()
        .and_then(|l| l.iter().find(|t| t["type"] == "page"))
        .and_then(|t| t["webSocketDebuggerUrl"].as_str())
        .context("the child's browser lists no page")?
        .to_string();
    let mut s = Cdp::connect(&ws).await?;
    s.call("Page.enable", json!({})).await?;
    let nav1 = s.navigate(PAGE).await?;
    let nav2 = s.navigate(PAGE).await?;
    let shot1 = s.screenshot().await?;
    let shot2 = s.screenshot().await?;
    Ok([nav1, nav2, shot1, shot2])
}

async fn http_json(port: u16, path: &str) -> Result<Value> {
    let url = format!("http://127.0.0.1:{port}{path}");
    let r = forkd_api::http_builder()
        .timeout(CDP_TIMEOUT)
        .build()?
        .get(&url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    if !r.status().is_success() {
        bail!("GET {url}: {}", r.status());
    }
    Ok(r.json().await?)
}

/// One DevTools WebSocket session: commands answered in order, events
/// kept until asked for.
struct Cdp {
    ws: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    next_id: u64,
    events: Vec<Value>,
}

impl Cdp {
    async fn connect(url: &str) -> Result<Cdp> {
        let (ws, _) = tokio::time::timeout(CDP_TIMEOUT, tokio_tungstenite::connect_async(url))
            .await
            .with_context(|| format!("connecting to {url}: timed out"))?
            .with_context(|| format!("connecting to {url}"))?;
        Ok(Cdp {
            ws,
            next_id: 1,
            events: Vec::new(),
        })
    }

    /// The next message from DevTools.
    async fn recv(&mut self) -> Result<Value> {
        loop {
            let msg = tokio::time::timeout(CDP_TIMEOUT, self.ws.next())
                .await
                .context("DevTools did not answer in time")?
                .context("DevTools closed the WebSocket")??;
            match msg {
                Message::Text(t) => return Ok(serde_json::from_str(t.as_str())?),
                Message::Close(_) => bail!("DevTools closed the WebSocket"),
                _ => continue,
            }
        }
    }

    /// Sends `method` and returns its result (events meanwhile are kept).
    async fn call(&mut self, method: &str, params: Value) -> Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        let msg = json!({"id": id, "method": method, "params": params});
        self.ws.send(Message::text(msg.to_string())).await?;
        loop {
            let v = self.recv().await?;
            if v["id"] == json!(id) {
                if let Some(e) = v.get("error") {
                    bail!("{method}: {}", e["message"]);
                }
                return Ok(v["result"].clone());
            }
            if v.get("method").is_some() {
                self.events.push(v);
            }
        }
    }

    /// Navigates the session's page to `url`; ms until its load event.
    async fn navigate(&mut self, url: &str) -> Result<f64> {
        let t0 = Instant::now();
        self.events.clear();
        self.call("Page.navigate", json!({ "url": url })).await?;
        self.event("Page.loadEventFired").await?;
        Ok(ms(t0))
    }

    /// Captures the page as a PNG; ms until it arrived.
    async fn screenshot(&mut self) -> Result<f64> {
        let t0 = Instant::now();
        self.call("Page.captureScreenshot", json!({"format": "png"}))
            .await?;
        Ok(ms(t0))
    }

    /// Waits for event `method` (one that came already counts).
    async fn event(&mut self, method: &str) -> Result<Value> {
        if let Some(i) = self.events.iter().position(|e| e["method"] == method) {
            return Ok(self.events.remove(i));
        }
        loop {
            let v = self.recv().await?;
            if v["method"] == method {
                return Ok(v);
            }
        }
    }
}

/// Fills `tag`'s pool with `n` children given their identity while parked,
/// then stops it refilling (no restore competes with the hand-outs).
async fn fill_and_hold(c: &Client, tag: &str, n: usize) -> Result<()> {
    let spec = |min: usize| json!({"min_ready": min, "max_ready": n, "warm": true});
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

fn print_report(r: &Report) {
    println!();
    println!("browser: {}", r.product);
    println!("first CDP command answered (Browser.getVersion), request → answer, client clock:");
    println!(
        "{:<12} {:>7} {:>11} {:>11} {:>11} {:>10}",
        "source", "spawns", "p50", "p99", "poold p50", "cold / p50"
    );
    let cold = r
        .rows
        .iter()
        .find(|x| x.source == "cold boot")
        .map_or(f64::NAN, |x| x.p50_ms);
    for x in &r.rows {
        println!(
            "{:<12} {:>7} {:>9.0}ms {:>9.0}ms {:>11} {:>9.1}x",
            x.source,
            x.samples,
            x.p50_ms,
            x.p99_ms,
            if x.spawn_p50_ms.is_nan() {
                "-".to_string()
            } else {
                format!("{:.0}ms", x.spawn_p50_ms)
            },
            cold / x.p50_ms
        );
    }
    println!(
        "pool hit / on demand: a forked child over the published port; cold boot: a fresh VM, \
         Chromium started by its warm-up, the command answered in the guest"
    );
    if let Some(n) = &r.navigation {
        println!();
        println!(
            "in a forked child (median of {}): navigate {:.0} ms, then {:.0} ms; screenshot {:.0} ms, then {:.0} ms",
            n.samples,
            n.first_navigate_ms,
            n.second_navigate_ms,
            n.first_screenshot_ms,
            n.second_screenshot_ms
        );
    }
    if let Some(m) = &r.memory {
        println!();
        println!(
            "memory, {} forked browsers alive: {:.1} MiB per child ({:.1} private + a share of \
             {:.1} MiB of memory.bin's page cache)",
            m.children, m.mib_per_child, m.private_mib_per_child, m.shared_cache_mib
        );
    }
}
