//! The web console (docs/console.md) end to end: a real poold with a
//! bearer token and real guests, and the console in Debian's headless
//! Chromium driven by Playwright (tests/python/console_browser.py; the
//! system's Chromium is launched, none is downloaded). The browser opens
//! the console without the token (its data calls are refused with 401 and
//! it says so), with a wrong one, then the right one; it lists a spawned
//! sandbox, runs `echo` in its terminal over the PTY WebSocket, spawns
//! another from the form, kills the first and resizes a pool, whose
//! children fill. The node's own API then confirms each effect.
//!
//! The same run through a `forkd-gateway` in front of the node, with its
//! own token: the gateway serves the console, lists its node, merges the
//! node's `/metrics` and relays the terminal.
//!
//! Also checked without a browser: the console's security headers, and
//! that the PTY WebSocket takes the token as a subprotocol
//! (`forkd.bearer.<hex>`, answered with `forkd.pty` only) and refuses a
//! missing or wrong one, while a plain request cannot use that route to
//! the token.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use forkd_e2e::gateway::Gateway;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

const MINIMAL_MIB: u64 = 128;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The Python with Playwright (tests/python/requirements.txt).
fn python() -> PathBuf {
    let p = std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| {
        panic!("FORKD_TEST_PYTHON is not set: scripts/test.sh builds the Python venv of tests/python and sets it")
    });
    let p = PathBuf::from(p);
    assert!(
        p.exists(),
        "FORKD_TEST_PYTHON={} does not exist",
        p.display()
    );
    p
}

/// Debian's Chromium (`FORKD_TEST_CHROMIUM` overrides the path).
fn chromium() -> PathBuf {
    let p = PathBuf::from(
        std::env::var("FORKD_TEST_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()),
    );
    assert!(
        p.exists(),
        "{} does not exist: install Debian's Chromium (apt-get install chromium) or set FORKD_TEST_CHROMIUM",
        p.display()
    );
    p
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// Opens the PTY WebSocket of `id` at `base` (a poold's or a gateway's
/// URL) offering `protocols`; the handshake's answer, or its refusal's
/// HTTP status.
async fn pty(base: &str, id: &str, protocols: Option<&str>) -> Result<(Ws, Option<String>), u16> {
    let url = format!(
        "{}/v1/sandboxes/{id}/pty",
        base.replacen("http://", "ws://", 1)
    );
    let mut req = url.into_client_request().unwrap();
    if let Some(v) = protocols {
        req.headers_mut()
            .insert("sec-websocket-protocol", HeaderValue::from_str(v).unwrap());
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok((ws, resp)) => {
            let proto = resp
                .headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().unwrap().to_string());
            Ok((ws, proto))
        }
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
        Err(e) => panic!("pty handshake: {e}"),
    }
}

/// The PTY route's browser auth at `p` (a poold's or a gateway's URL),
/// without a browser.
async fn websocket_auth(p: &str, id: &str, token: &str) {
    assert_eq!(pty(p, id, None).await.err(), Some(401), "no token");
    assert_eq!(
        pty(p, id, Some("forkd.pty")).await.err(),
        Some(401),
        "only the app protocol"
    );
    let wrong = format!("forkd.pty, forkd.bearer.{}", hex(&format!("{token}x")));
    assert_eq!(
        pty(p, id, Some(&wrong)).await.err(),
        Some(401),
        "wrong token"
    );
    assert_eq!(
        pty(p, id, Some("forkd.pty, forkd.bearer.not-hex"))
            .await
            .err(),
        Some(401),
        "undecodable token"
    );

    let good = format!("forkd.pty, forkd.bearer.{}", hex(token));
    let (mut ws, proto) = pty(p, id, Some(&good)).await.expect("the right token");
    assert_eq!(
        proto.as_deref(),
        Some("forkd.pty"),
        "the token is never echoed"
    );
    let marker = format!("ws-{}", forkd_snapshot::random_hex(4));
    ws.send(Message::Binary(
        format!("echo {marker}\r").into_bytes().into(),
    ))
    .await
    .unwrap();
    let mut out = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !out.lines().any(|l| l.trim() == marker) {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => out.push_str(&String::from_utf8_lossy(&b)),
            Ok(Some(Ok(_))) => {}
            other => panic!("waiting for {marker}: {other:?}; output {out:?}"),
        }
    }
    let _ = ws.close(None).await;

    // A subprotocol is read only on an upgrade: a plain request with it
    // is refused like one without a token.
    let r = forkd_api::http_builder()
        .build()
        .unwrap()
        .get(format!("{p}/v1/sandboxes"))
        .header("sec-websocket-protocol", good.as_str())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

/// The console's own answers at `base`: no token needed, strict headers;
/// the API beside it still wants the token.
async fn console_headers(base: &str) {
    let c = forkd_api::http_builder().build().unwrap();
    for path in ["/console/", "/console/app.js", "/console/style.css"] {
        let r = c.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path}");
        let h = r.headers();
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(csp.starts_with("default-src 'self';"), "{csp}");
        assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
        assert!(!csp.contains("unsafe-inline"), "{csp}");
        assert_eq!(h["x-frame-options"], "DENY");
        assert_eq!(h["x-content-type-options"], "nosniff");
    }
    let r = c.get(format!("{base}/v1/sandboxes")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

fn path_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.find('/').map_or("/", |i| &rest[i..])
}

/// Runs tests/python/console_browser.py against the console at `base`
/// with `token`, for sandbox `id` of snapshot `m`; what it saw.
fn browse(base: &str, token: &str, id: &str) -> (Value, String) {
    let (python, chromium) = (python(), chromium());
    let marker = format!("hi-{}", forkd_snapshot::random_hex(4));
    let spec = json!({
        "url": format!("{base}/console/"),
        "token": token,
        "sandbox": id,
        "tag": "m",
        "marker": marker,
        "chromium": chromium,
    });
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/console_browser.py");
    let run = Command::new(&python)
        .arg(&script)
        .arg(spec.to_string())
        .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}: {stderr}", script.display());
    let out: Value = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&run.stdout)));
    eprintln!("{}", serde_json::to_string_pretty(&out).unwrap());
    (out, marker)
}

/// Checks what the browser saw, and the node `p`'s state after it: the
/// first sandbox `id` killed, one spawned from the form, pool `m` at 2.
fn check_run(out: &Value, marker: &str, p: &Poold, id: &str) {
    // 1. Without the token: the page loads, every data call is 401, the
    // page says so and lists nothing; a wrong token likewise.
    assert_eq!(out["page_status"], 200);
    let responses = out["responses"].as_array().unwrap();
    for phase in ["no-token", "wrong-token"] {
        let data: Vec<(&str, u64)> = responses
            .iter()
            .filter(|r| r["phase"] == phase)
            .map(|r| {
                (
                    path_of(r["url"].as_str().unwrap()),
                    r["status"].as_u64().unwrap(),
                )
            })
            .filter(|(path, _)| path.starts_with("/v1/") || ["/metrics", "/version"].contains(path))
            .collect();
        assert!(
            data.iter().any(|(path, _)| *path == "/v1/sandboxes"),
            "{phase}: the page asked for no data: {data:?}"
        );
        assert!(data.iter().all(|(_, st)| *st == 401), "{phase}: {data:?}");
    }
    assert!(
        out["refusal_text"].as_str().unwrap().contains("401"),
        "{}",
        out["refusal_text"]
    );
    assert_eq!(out["rows_without_token"], 0);
    assert!(responses.iter().any(|r| r["phase"] == "token"
        && path_of(r["url"].as_str().unwrap()) == "/v1/sandboxes"
        && r["status"] == 200));
    // No script error, no CSP violation (the page has no inline code).
    let errors: Vec<&str> = out["console_errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        // Chromium logs each refused call (and a missing favicon).
        .filter(|e| !e.starts_with("Failed to load resource"))
        .collect();
    assert!(errors.is_empty(), "{errors:?}");

    // 2., 3. Listed; the terminal ran echo.
    assert!(out["row_text"].as_str().unwrap().contains("m"));
    let term = out["terminal"].as_str().unwrap();
    assert!(term.lines().any(|l| l.trim() == marker), "{term:?}");

    // 4., 5. The console's spawn made one; its kill removed the first.
    let spawned = out["spawn_status"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .find(|w| w.starts_with("sb-"))
        .map(|w| w.trim_end_matches(['.', ',']).to_string())
        .expect("the spawned id");
    assert_eq!(out["rows_after_kill"], 1);
    block_on(async {
        let (st, _) = p.get(&format!("/v1/sandboxes/{id}")).await;
        assert_eq!(st, 404, "killed from the console");
        let (_, list) = p.get("/v1/sandboxes").await;
        assert_eq!(ids(&list), vec![spawned.clone()]);

        // 6. The pool the console sized: what it showed is what the node has.
        let pool = p.wait_pool_until("m", |v| v["ready"] == 2).await;
        assert_eq!(pool["min_ready"], 2, "{pool}");
    });
    let seen = out["pool_seen"].as_array().unwrap();
    let last = seen.last().expect("the pool was shown");
    assert_eq!(
        (last[3].as_str(), last[4].as_str()),
        (Some("2"), Some("0")),
        "{seen:?}"
    );
    let ready: Vec<u64> = seen
        .iter()
        .map(|r| r[3].as_str().unwrap().parse().unwrap())
        .collect();
    assert!(ready.windows(2).all(|w| w[0] <= w[1]), "filling: {ready:?}");

    // The plots and the snapshot tree were drawn from real data, in
    // plain words.
    let latency = out["latency_desc"].as_str().unwrap();
    assert!(latency.contains("Latest mean spawn latency"), "{latency}");
    assert!(!latency.contains("none ms"), "{latency}");
    let fanout = out["fanout_desc"].as_str().unwrap();
    assert!(
        fanout.contains("1 sandbox running") || fanout.contains("sandboxes running"),
        "{fanout}"
    );
    assert!(!fanout.contains(" 1 sandboxes"), "{fanout}");
    let tree = out["snapshot_tree"].as_str().unwrap();
    assert!(
        tree.contains("m \u{2014} ready") && tree.contains("stores"),
        "{tree}"
    );
}

fn token_file(home: &Home, name: &str, prefix: &str) -> (String, PathBuf) {
    let token = format!("{prefix}-{}", forkd_snapshot::random_hex(16));
    let file = home.dir.join(name);
    std::fs::write(&file, &token).unwrap();
    (token, file)
}

#[test]
fn the_console_drives_a_real_node_in_a_browser() {
    let home = Home::new();
    let (token, file) = token_file(&home, "token", "tok");
    let p = Poold::start(
        &home.dir,
        &["--token-file", file.to_str().unwrap()],
        Some(&token),
    );
    let id = block_on(async {
        p.snapshot("m", "minimal", MINIMAL_MIB).await;
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "m"})).await;
        assert_eq!(st, 201, "{v}");
        let id = ids(&v).remove(0);
        console_headers(&p.url).await;
        // The Host check covers the console too (DNS rebinding).
        let (st, _) = p.raw_get("/console/", Some("evil.example"));
        assert_eq!(st, 421);
        websocket_auth(&p.url, &id, &token).await;
        id
    });
    let (out, marker) = browse(&p.url, &token, &id);
    let nodes = out["nodes_text"].as_str().unwrap();
    assert!(nodes.contains("up"), "{nodes}");
    check_run(&out, &marker, &p, &id);
}

#[test]
fn the_console_drives_a_cluster_through_the_gateway() {
    let home = Home::new();
    let (node_token, node_file) = token_file(&home, "node-token", "node");
    let (token, file) = token_file(&home, "gateway-token", "gw");
    let p = Poold::start(
        &home.dir,
        &["--token-file", node_file.to_str().unwrap()],
        Some(&node_token),
    );
    let gw = Gateway::start_with(
        &[("alpha", &p.url)],
        &[
            "--token-file",
            file.to_str().unwrap(),
            "--node-token-file",
            node_file.to_str().unwrap(),
        ],
        Some(&token),
    );
    let id = block_on(async {
        p.snapshot("m", "minimal", MINIMAL_MIB).await;
        gw.wait_nodes("up", |s| s.get("alpha").is_some_and(|h| h == "up"))
            .await;
        let (st, v) = gw
            .req(
                forkd_api::Method::POST,
                "/v1/sandboxes",
                Some(json!({"snapshot_tag": "m"})),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let id = ids(&v).remove(0);
        console_headers(&gw.url).await;
        // The node's token is not the gateway's.
        websocket_auth(&gw.url, &id, &token).await;
        let theirs = format!("forkd.pty, forkd.bearer.{}", hex(&node_token));
        assert_eq!(
            pty(&gw.url, &id, Some(&theirs)).await.err(),
            Some(401),
            "the node's token at the gateway"
        );

        // The gateway's /metrics: the node's families once, labelled.
        let (st, text) = gw
            .client
            .send(forkd_api::Method::GET, "/metrics", None)
            .await
            .unwrap();
        assert_eq!(st.as_u16(), 200);
        let text = String::from_utf8_lossy(&text);
        assert_eq!(
            text.matches("# TYPE forkd_sandboxes_active ").count(),
            1,
            "{text}"
        );
        assert!(
            text.contains("forkd_sandboxes_active{node=\"alpha\"} 1"),
            "{text}"
        );
        let (st, v) = gw.req(forkd_api::Method::GET, "/version", None).await;
        assert_eq!((st, v["role"].as_str()), (200, Some("gateway")), "{v}");
        id
    });
    let (out, marker) = browse(&gw.url, &token, &id);
    let nodes = out["nodes_text"].as_str().unwrap();
    assert!(nodes.contains("alpha") && nodes.contains("up"), "{nodes}");
    assert!(
        out["node_line"]
            .as_str()
            .unwrap()
            .contains("1 of 1 node up"),
        "{}",
        out["node_line"]
    );
    assert!(
        out["row_text"].as_str().unwrap().contains("alpha"),
        "{}",
        out["row_text"]
    );
    check_run(&out, &marker, &p, &id);
}
