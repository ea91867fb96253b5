//! The cluster gateway in front of three real poold nodes (docs/cluster.md):
//! placement over warm pools, per-sandbox routing with streamed bodies, the
//! `forkd` CLI and the unmodified E2B SDK (tests/python/e2b_gateway.py,
//! newest and oldest supported) through it, a node killed mid-run and
//! rejoining, and a
//! gateway restart that loses nothing (ids carry their node's token, so a
//! new replica routes them, and names a dead node, without asking).
//!
//! The nodes are three poolds on this host, each with its own data dir,
//! forkd-fs mount, and network namespace with its own address (`nsenter
//! --net`: each node's listeners, children's links and `table inet forkd`
//! are its own); each makes its own snapshot of the same tag.
//! A second test gives two nodes one S3 hub (`[hub]`): a snapshot made
//! through the gateway on one spawns on the other, pulled lazily.

use forkd_api::{Client, Method};
use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use forkd_e2e::gateway::Gateway;
use forkd_e2e::netns::{free_lan, suffix, TestNs};
use forkd_e2e::s3::S3;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::process::Command;
use std::time::Duration;

const MINIMAL_MIB: u64 = 128;
const TAG: &str = "gw";

/// The node each sandbox id lives on, asked of the nodes themselves.
async fn where_are(names: &[&str], pools: &[Option<Poold>]) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for (name, p) in names.iter().zip(pools) {
        let (st, v) = p.as_ref().unwrap().get("/v1/sandboxes").await;
        assert_eq!(st, 200, "{v}");
        for id in ids(&v) {
            out.insert(id, name.to_string());
        }
    }
    out
}

/// `POST /v1/sandboxes` through the gateway.
async fn spawn(gw: &Gateway, body: serde_json::Value) -> (u16, serde_json::Value) {
    gw.req(Method::POST, "/v1/sandboxes", Some(body)).await
}

fn forkd_cli(gw: &Gateway, args: &[&str]) -> String {
    let mut cmd = Command::new(forkd_e2e::bin("forkd"));
    cmd.args(args).env("FORKD_URL", &gw.url);
    match &gw.token {
        Some(t) => cmd.env("FORKD_TOKEN", t),
        None => cmd.env_remove("FORKD_TOKEN"),
    };
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "forkd {args:?} through the gateway: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn three_nodes_behind_one_gateway_place_route_survive_a_node_and_a_gateway_restart() {
    // Each node is a host of its own: a network namespace with its own
    // address (dropped last, after the nodes and their children).
    let nets: Vec<(TestNs, String)> = (0..3u8)
        .map(|i| {
            let lan = free_lan(77);
            let root = Ipv4Addr::new(lan[0], lan[1], lan[2], 1);
            let inner = Ipv4Addr::new(lan[0], lan[1], lan[2], 2);
            let link = format!("fgw{i}{}", suffix());
            (
                TestNs::new("node", &link, root, inner, 30),
                inner.to_string(),
            )
        })
        .collect();
    let homes = [Home::new(), Home::new(), Home::new()];
    let names = ["a", "b", "c"];
    // Off loopback a node needs a token: one for all, the gateway's
    // --node-token-file (and the E2B key the gateway sends them).
    let token_path = homes[0].dir.join("node-token");
    std::fs::write(&token_path, format!("{NODE_TOKEN}\n")).unwrap();
    let token_file = token_path.to_str().unwrap().to_string();
    // Their E2B key is not their token (the E2B planes are plain HTTP).
    let key_path = homes[0].dir.join("node-e2b-key");
    std::fs::write(&key_path, format!("{NODE_E2B_KEY}\n")).unwrap();
    let key_file = key_path.to_str().unwrap().to_string();
    // The gateway's own token: clients' bearer token and E2B API key.
    let gw_token_path = homes[0].dir.join("gateway-token");
    std::fs::write(&gw_token_path, format!("{GATEWAY_TOKEN}\n")).unwrap();
    let gw_token_file = gw_token_path.to_str().unwrap().to_string();
    let start_node = |i: usize, port: u16| {
        let (ns, addr) = &nets[i];
        let bind = format!("{addr}:{port}");
        let e2b = format!("{addr}:0");
        // Each node is named as the gateway lists it: its token starts
        // every id it mints, so any gateway replica routes an id without
        // asking.
        let args = [
            "--bind",
            &bind,
            "--token-file",
            &token_file,
            "--node-name",
            names[i],
            "--e2b-bind",
            &e2b,
            "--e2b-sandbox-bind",
            &e2b,
            "--e2b-api-key-file",
            &key_file,
        ];
        Poold::start_in_netns(&homes[i].dir, &ns.name, &args, Some(NODE_TOKEN))
    };
    let mut pools: Vec<Option<Poold>> = (0..3).map(|i| Some(start_node(i, 0))).collect();
    let urls: Vec<String> = pools
        .iter()
        .map(|p| p.as_ref().unwrap().url.clone())
        .collect();
    let node_list: Vec<(&str, &str)> = names
        .iter()
        .copied()
        .zip(urls.iter().map(String::as_str))
        .collect();

    block_on(async {
        // Each node makes the snapshot (in parallel: three TCG boots).
        let snaps = pools
            .iter()
            .map(|p| p.as_ref().unwrap().snapshot(TAG, "minimal", MINIMAL_MIB));
        futures::future::join_all(snaps).await;
    });

    let gw_args = gateway_args(&gw_token_file, &token_file, &key_file);
    let mut gw = Gateway::start_with(&node_list, &gw_args, Some(GATEWAY_TOKEN));
    block_on(async {
        gw.wait_nodes("up", |s| s.len() == 3 && s.values().all(|h| h == "up"))
            .await;
        gateway_auth(&gw).await;

        // The gateway's own errors are clear and bounded.
        let (st, v) = gw
            .req(Method::POST, "/v1/sandboxes", Some(json!({"n": 1})))
            .await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains("snapshot_tag"), "{v}");
        let (st, v) = gw
            .req(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"snapshot_tag": TAG, "n": 0})),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        let (st, v) = spawn(&gw, json!({"snapshot_tag": "nowhere"})).await;
        assert_eq!(st, 404, "{v}");
        assert!(
            v["error"]
                .as_str()
                .unwrap()
                .contains("no healthy node holds"),
            "{v}"
        );
        let (st, _) = gw.req(Method::GET, "/v1/sandboxes/..%2Fx/logs", None).await;
        assert_eq!(st, 400);
        let (st, v) = gw.req(Method::GET, "/v1/workspaces", None).await;
        assert_eq!(st, 501, "{v}");
        // A node's own refusal passes through unchanged.
        let (st, v) = gw
            .req(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"snapshot_tag": TAG, "no_such_field": 1})),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        assert!(
            v["error"].as_str().unwrap().contains("no_such_field"),
            "{v}"
        );

        // A pool of three on every node, set once through the gateway.
        let (st, v) = gw
            .req(
                Method::PUT,
                &format!("/v1/pools/{TAG}"),
                Some(json!({"min_ready": 3})),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        for p in pools.iter().flatten() {
            p.wait_pool(TAG, 3).await;
        }
        let (_, v) = gw.req(Method::GET, &format!("/v1/pools/{TAG}"), None).await;
        assert_eq!(v["ready"], 9, "the cluster's pool: {v}");
        // Let a poll see the full pools before placing.
        tokio::time::sleep(Duration::from_millis(600)).await;

        // n = 9: three pool hits on each node.
        let (st, v) = gw
            .req(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"snapshot_tag": TAG, "n": 9})),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let spawned = ids(&v);
        assert_eq!(spawned.len(), 9);
        assert!(
            v.as_array().unwrap().iter().all(|s| s["pool_hit"] == true),
            "{v}"
        );
        let placed = where_are(&names, &pools).await;
        for name in names {
            let k = spawned.iter().filter(|id| placed[*id] == name).count();
            assert_eq!(k, 3, "node {name} got {k} of 9: {placed:?}");
        }
        for id in &spawned {
            let token = forkd_api::ids::node_token(&placed[id]);
            assert_eq!(forkd_api::ids::id_token(id), Some(token.as_str()), "{id}");
        }

        // Per-sandbox calls reach each sandbox's node: exec, a streamed
        // exec, files, through the gateway.
        for id in &spawned {
            let (st, v) = gw.exec(id, &["hostname"]).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["stdout"].as_str().map(str::trim), Some(id.as_str()));
        }
        let (st, bytes) = gw
            .client
            .send(
                Method::POST,
                &format!("/v1/sandboxes/{}/exec/stream", spawned[0]),
                Some(json!({"cmd": "echo one; sleep 0.2; echo two"})),
            )
            .await
            .unwrap();
        assert_eq!(st.as_u16(), 200);
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.lines().next().unwrap().contains("started"), "{text}");
        assert!(text.contains("one") && text.contains("two"), "{text}");
        let (st, v) = gw.req(Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(st, 200);
        let mut listed = ids(&v);
        listed.sort();
        let mut want = spawned.clone();
        want.sort();
        assert_eq!(listed, want);
    });

    // The forkd CLI works through the gateway unchanged.
    let out = forkd_cli(&gw, &["ls"]);
    let spawned: Vec<String> = block_on(async {
        let (_, v) = gw.req(Method::GET, "/v1/sandboxes", None).await;
        ids(&v)
    });
    assert!(spawned.iter().all(|id| out.contains(id.as_str())), "{out}");
    let out = forkd_cli(&gw, &["exec", &spawned[4], "--", "echo", "via-cli"]);
    assert!(out.contains("via-cli"), "{out}");

    // The unmodified E2B SDK through the gateway's E2B planes: the newest
    // and the oldest supported (whose connect names no sandbox, so the
    // gateway finds it by its access token).
    for (var, count) in [
        ("FORKD_TEST_PYTHON", 3),
        ("FORKD_TEST_PYTHON_E2B_OLDEST", 2),
    ] {
        block_on(async {
            for p in pools.iter().flatten() {
                p.wait_pool(TAG, 3).await;
            }
            // Let a poll see the full pools before placing.
            tokio::time::sleep(Duration::from_millis(600)).await;
        });
        let left = e2b_sdk(&gw, var, count);
        block_on(async {
            let placed = where_are(&names, &pools).await;
            let on: HashSet<&String> = left.iter().map(|id| &placed[id]).collect();
            // Three creates over three full pools: one on each node, and
            // the script killed the last, so two nodes hold the rest.
            assert_eq!(on.len(), left.len(), "{left:?} on {on:?}");
            for id in &left {
                assert_eq!(
                    e2b_call(
                        &gw,
                        reqwest::Method::DELETE,
                        &format!("/sandboxes/{id}"),
                        None
                    )
                    .await
                    .0,
                    204
                );
            }
        });
    }

    // Node b dies (SIGKILL: its children live on, unreachable through it).
    let b_ids: Vec<String> = block_on(async {
        let placed = where_are(&names, &pools).await;
        spawned
            .iter()
            .filter(|id| placed[*id] == "b")
            .cloned()
            .collect()
    });
    pools[1].take().unwrap().kill9();
    block_on(async {
        gw.wait_nodes("b down", |s| s["b"] == "down").await;
        let (st, v) = gw.exec(&b_ids[0], &["true"]).await;
        assert_eq!(st, 410, "{v}");
        assert!(v["error"].as_str().unwrap().contains("node b"), "{v}");
        // E2B's planes say the same, in E2B's error shape.
        let (st, v) = e2b_call(
            &gw,
            reqwest::Method::GET,
            &format!("/sandboxes/{}", b_ids[0]),
            None,
        )
        .await;
        assert_eq!(st, 410, "{v}");
        assert!(v["message"].as_str().unwrap().contains("node b"), "{v}");
        let (st, v) = e2b_call(
            &gw,
            reqwest::Method::POST,
            "/sandboxes",
            Some(json!({"templateID": TAG})),
        )
        .await;
        assert_eq!(st, 201, "an E2B create with node b down: {v}");
        let id = v["sandboxID"].as_str().unwrap();
        let (st, _) = e2b_call(
            &gw,
            reqwest::Method::DELETE,
            &format!("/sandboxes/{id}"),
            None,
        )
        .await;
        assert_eq!(st, 204);
        // Spawns keep working, on the nodes that are up.
        let (st, v) = gw
            .req(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"snapshot_tag": TAG, "n": 2})),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        for id in ids(&v) {
            let (st, _) = gw
                .req(
                    Method::POST,
                    &format!("/v1/sandboxes/{id}/ping"),
                    Some(json!({})),
                )
                .await;
            assert_eq!(st, 200);
        }
        // The merged list says whom it could not ask.
        let (st, _) = gw.req(Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(st, 200);
    });
    let r = unreachable_header(&gw);
    assert_eq!(r.as_deref(), Some("b"), "forkd-unreachable-nodes");

    // A gateway restart loses nothing: it knows no ids, and finds them.
    drop(gw);
    gw = Gateway::start_with(&node_list, &gw_args, Some(GATEWAY_TOKEN));
    block_on(async {
        gw.wait_nodes("a, c up", |s| s["a"] == "up" && s["c"] == "up")
            .await;
        let a_or_c: Vec<&String> = spawned.iter().filter(|id| !b_ids.contains(id)).collect();
        let (st, v) = gw.exec(a_or_c[0], &["true"]).await;
        assert_eq!(st, 200, "{v}");
        // The new replica never saw b's ids, nor b up: the id's token
        // names its node, so the answer is the clear 410, not a 404.
        let (st, v) = gw.exec(&b_ids[0], &["true"]).await;
        assert_eq!(st, 410, "{v}");
        assert!(v["error"].as_str().unwrap().contains("node b"), "{v}");
    });

    // Node b returns on its data dir, adopts its children, and rejoins.
    let port: u16 = urls[1].rsplit(':').next().unwrap().parse().unwrap();
    pools[1] = Some(start_node(1, port));
    block_on(async {
        gw.wait_nodes("b back", |s| s["b"] == "up").await;
        for id in &b_ids {
            let (st, v) = gw.exec(id, &["hostname"]).await;
            assert_eq!(st, 200, "{v}");
        }
        // Kill everything through the gateway.
        let (_, v) = gw.req(Method::GET, "/v1/sandboxes", None).await;
        for id in ids(&v) {
            let (st, v) = gw
                .req(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
                .await;
            assert!(st == 200 || st == 204, "{st} {v}");
        }
        let (_, v) = gw.req(Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(ids(&v), Vec::<String>::new());
    });
}

/// The nodes' bearer token.
const NODE_TOKEN: &str = "Zq3v9LkP0xW7rT2mB8nC4dF6gH1jK5sA";
/// The gateway's token: its clients' bearer token and E2B API key.
const GATEWAY_TOKEN: &str = "Gw7kP2mQ9xR4tV6yB1nC3dF5hJ8lZ0sA";
/// The nodes' E2B key.
const NODE_E2B_KEY: &str = "e2b_0f1e2d3c4b5a69788796a5b4c3d2e1f0aa55cc33";

/// The gateway's flags: its own token, the nodes' token and E2B key, and
/// its E2B planes on ephemeral loopback ports.
fn gateway_args<'a>(
    token_file: &'a str,
    node_token_file: &'a str,
    node_key_file: &'a str,
) -> Vec<&'a str> {
    vec![
        "--token-file",
        token_file,
        "--node-token-file",
        node_token_file,
        "--node-e2b-key-file",
        node_key_file,
        "--e2b-bind",
        "127.0.0.1:0",
        "--e2b-sandbox-bind",
        "127.0.0.1:0",
    ]
}

/// Runs tests/python/e2b_gateway.py with the Python in `var` against the
/// gateway's E2B planes; the ids of the sandboxes it left running.
fn e2b_sdk(gw: &Gateway, var: &str, count: usize) -> Vec<String> {
    let py = std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: scripts/test.sh installs the test clients and sets it")
    });
    let (api, sbx) = gw.e2b.clone().expect("the gateway serves E2B");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/e2b_gateway.py");
    let out = Command::new(py)
        .arg(script)
        .arg(TAG)
        .arg(count.to_string())
        .env("E2B_API_URL", api)
        .env("E2B_SANDBOX_URL", sbx)
        .env("E2B_API_KEY", gw.token.as_deref().expect("a gateway token"))
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_ACCESS_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("E2B GATEWAY OK"),
        "the E2B SDK through the gateway ({var}) failed:\n{stdout}\n{stderr}"
    );
    let ids = stdout
        .lines()
        .find_map(|l| l.strip_prefix("IDS "))
        .expect("the script prints the ids it left");
    serde_json::from_str(ids).unwrap()
}

/// One call to the gateway's E2B control plane with its key: status and
/// JSON body.
async fn e2b_call(
    gw: &Gateway,
    method: reqwest::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    e2b_call_as(gw, gw.token.as_deref(), method, path, body).await
}

/// [`e2b_call`] with `key` (None: no `X-API-Key`).
async fn e2b_call_as(
    gw: &Gateway,
    key: Option<&str>,
    method: reqwest::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let (api, _) = gw.e2b.clone().expect("the gateway serves E2B");
    let mut rb = forkd_api::http_builder()
        .build()
        .unwrap()
        .request(method, format!("{api}{path}"));
    if let Some(k) = key {
        rb = rb.header("X-API-KEY", k);
    }
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let r = rb.send().await.unwrap();
    let st = r.status().as_u16();
    let bytes = r.bytes().await.unwrap();
    (
        st,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// The gateway takes its token, and only that, on both front-ends: the
/// `/v1` bearer token, the E2B API key (the nodes' key is not it).
async fn gateway_auth(gw: &Gateway) {
    for token in [None, Some(NODE_TOKEN)] {
        let c = Client::new(&gw.url, token.map(str::to_string)).unwrap();
        let (st, body) = c.send(Method::GET, "/v1/sandboxes", None).await.unwrap();
        let body = String::from_utf8_lossy(&body);
        assert_eq!(st.as_u16(), 401, "/v1 with token {token:?}: {body}");
    }
    let get = reqwest::Method::GET;
    for key in [
        None,
        Some("e2b_wrong"),
        Some(NODE_E2B_KEY),
        Some(NODE_TOKEN),
    ] {
        let (st, v) = e2b_call_as(gw, key, get.clone(), "/sandboxes", None).await;
        assert_eq!(st, 401, "E2B API with key {key:?}: {v}");
        assert!(v["message"].is_string(), "E2B's error shape: {v}");
    }
    let (st, v) = e2b_call(gw, get, "/sandboxes", None).await;
    assert_eq!(st, 200, "E2B API with the gateway's token: {v}");
}

/// The `forkd-unreachable-nodes` header of `GET /v1/sandboxes`.
fn unreachable_header(gw: &Gateway) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(gw.url.trim_start_matches("http://")).unwrap();
    let auth = gw
        .token
        .as_ref()
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp.lines()
        .find_map(|l| l.strip_prefix("forkd-unreachable-nodes: "))
        .map(|v| v.trim().to_string())
}

/// Snapshots everywhere (docs/cluster.md): two nodes with one S3 hub,
/// `pull = "lazy"`, `push = true`. A snapshot made through the gateway
/// lands on one node and is pushed in the background; a pool set through
/// the gateway fills on both (the other pulls the tag lazily, refills once
/// its working set is local); a spawn of two takes a ready child from each;
/// a delete through the gateway deletes the hub's tag too, so no node
/// pulls it again.
#[test]
fn a_snapshot_made_on_one_node_spawns_on_the_other_through_the_hub() {
    let s3 = S3::start();
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let homes = [Home::new(), Home::new()];
    let names = ["a", "b"];
    let start = |i: usize, bind: &str| {
        let cfg = homes[i].dir.join("poold.toml");
        std::fs::write(
            &cfg,
            format!(
                "[hub]\nurl = \"{}\"\npull = \"lazy\"\npush = true\n",
                s3.url("cluster")
            ),
        )
        .unwrap();
        let cfg = cfg.to_str().unwrap().to_string();
        let args = ["--bind", bind, "--node-name", names[i], "--config", &cfg];
        Poold::start_env(&homes[i].dir, &args, None, &env)
    };
    let mut pools: Vec<Poold> = (0..2).map(|i| start(i, "127.0.0.1:0")).collect();
    let node_list: Vec<(&str, &str)> = names
        .iter()
        .copied()
        .zip(pools.iter().map(|p| p.url.as_str()))
        .collect();
    let gw = Gateway::start(&node_list);
    let other = block_on(async {
        gw.wait_nodes("up", |s| s.len() == 2 && s.values().all(|h| h == "up"))
            .await;
        let (_, v) = pools[0].get("/version").await;
        assert_eq!(v["hub"], s3.url("cluster"), "{v}");

        // A tag no node has and the hub lacks: the hub node's 404.
        let (st, v) = spawn(&gw, json!({"snapshot_tag": "nowhere"})).await;
        assert_eq!(st, 404, "{v}");

        let (st, v) = gw
            .req(
                Method::POST,
                "/v1/snapshots",
                Some(json!({"tag": "hubbed", "image": "minimal", "mem_mib": MINIMAL_MIB})),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        // Which node made it; wait for its background push.
        let mut maker = None;
        for (i, p) in pools.iter().enumerate() {
            let (st, _) = p.get("/v1/snapshots/hubbed/info").await;
            if st == 200 {
                maker = Some(i);
            }
        }
        let maker = maker.expect("a node holds the new snapshot");
        let other = 1 - maker;
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while pools[maker]
            .metric("forkd_hub_pushes_total", "outcome=\"ok\"")
            .await
            < 1.0
        {
            assert_eq!(
                pools[maker]
                    .metric("forkd_hub_pushes_total", "outcome=\"error\"")
                    .await,
                0.0,
                "the push failed: see node {}'s log",
                names[maker]
            );
            assert!(std::time::Instant::now() < deadline, "no push in 120 s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (st, _) = pools[other].get("/v1/snapshots/hubbed/info").await;
        assert_eq!(st, 404, "node {} has not pulled it yet", names[other]);

        // A pool through the gateway: both nodes, the other one pulling.
        tokio::time::sleep(Duration::from_millis(1200)).await; // a poll sees the snapshot
        let (st, v) = gw
            .req(
                Method::PUT,
                "/v1/pools/hubbed",
                Some(json!({"min_ready": 1})),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        for p in &pools {
            p.wait_pool("hubbed", 1).await;
        }
        let (_, info) = pools[other].get("/v1/snapshots/hubbed/info").await;
        tokio::time::sleep(Duration::from_millis(1200)).await; // a poll sees both pools
        let (st, v) = spawn(&gw, json!({"snapshot_tag": "hubbed", "n": 2})).await;
        assert_eq!(st, 201, "{v}");
        let ids = ids(&v);
        assert_eq!(ids.len(), 2, "{v}");
        let mut on = Vec::new();
        for id in &ids {
            let (st, v) = gw.exec(id, &["echo", "hello from the hub"]).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["stdout"], "hello from the hub\n", "{v}");
            for (name, p) in names.iter().zip(&pools) {
                if p.get(&format!("/v1/sandboxes/{id}")).await.0 == 200 {
                    on.push(*name);
                }
            }
        }
        on.sort();
        assert_eq!(
            on,
            ["a", "b"],
            "one child from each node's pool; the pulled node's snapshot: {info}"
        );
        for id in &ids {
            let (st, _) = gw
                .req(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
                .await;
            assert_eq!(st, 204);
        }

        let (st, v) = gw.req(Method::DELETE, "/v1/pools/hubbed", None).await;
        assert!(st == 200 || st == 204, "{st} {v}");
        other
    });

    // The other node is down while the tag is deleted through the
    // gateway: gone on the maker and on the hub, which keeps a tombstone.
    let url = pools[other].url.clone();
    pools.remove(other).kill9();
    block_on(async {
        gw.wait_nodes("down", |s| s[names[other]] == "down").await;
        let (st, v) = gw.req(Method::DELETE, "/v1/snapshots/hubbed", None).await;
        assert!(st == 200 || st == 204, "{st} {v}");
        let (st, _) = pools[0].get("/v1/snapshots/hubbed/info").await;
        assert_eq!(st, 404);
    });
    // Back, it finds the tombstone naming its copy and deletes it too.
    pools.insert(other, start(other, url.trim_start_matches("http://")));
    block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while pools[other].get("/v1/snapshots/hubbed/info").await.0 != 404 {
            assert!(
                std::time::Instant::now() < deadline,
                "node {} kept a tag deleted while it was down",
                names[other]
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (st, v) = pools[other]
            .post("/v1/sandboxes", json!({"snapshot_tag": "hubbed"}))
            .await;
        assert_eq!(st, 404, "the hub's tag is deleted too: {v}");
    });
    drop(gw);
    drop(pools);
}
