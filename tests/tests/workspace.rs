//! Workspaces end to end on a real poold and python-numpy guests: state
//! (files and the warm interpreter's variables) survives a suspend, a
//! kill -9 of poold and a resume; settings survive a resume; a re-suspend
//! replaces the previous state; a poold killed in the middle of a suspend
//! leaves the workspace running or suspended, never lost.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{Home, Poold};
use serde_json::{json, Value};
use std::time::Duration;

const PY_MIB: u64 = 512;

/// Whether this host can enforce memory limits (cgroup v2 memory controller).
fn has_memory_cgroup() -> bool {
    std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
        .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"))
}

async fn sh(p: &Poold, sb: &str, cmd: &str) -> String {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{sb}/exec"),
            json!({"args": ["/bin/sh", "-c", cmd], "timeout_secs": 60}),
        )
        .await;
    assert_eq!((st, v["exit_code"].as_i64()), (200, Some(0)), "{cmd}: {v}");
    v["stdout"].as_str().unwrap().to_string()
}

async fn eval(p: &Poold, sb: &str, code: &str) -> Value {
    let (st, v) = p
        .post(&format!("/v1/sandboxes/{sb}/eval"), json!({"code": code}))
        .await;
    assert_eq!((st, v["exit_code"].as_i64()), (200, Some(0)), "{code}: {v}");
    v["result"].clone()
}

async fn workspace(p: &Poold, name: &str) -> Value {
    let (st, w) = p.get(&format!("/v1/workspaces/{name}")).await;
    assert_eq!(st, 200, "{w}");
    w
}

async fn snapshot_tags(p: &Poold) -> Vec<String> {
    let (st, v) = p.get("/v1/snapshots").await;
    assert_eq!(st, 200, "{v}");
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s["tag"].as_str().unwrap().to_string())
        .collect()
}

fn live(w: &Value) -> String {
    w["live_sandbox_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no live sandbox: {w}"))
        .to_string()
}

#[test]
fn suspended_workspace_survives_a_poold_kill_and_resumes_with_its_state() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let limit = has_memory_cgroup().then_some(700u64);
    let first_sb = block_on(async {
        p.snapshot("py", "python-numpy", PY_MIB).await;
        let mut body = json!({"name": "dev", "snapshot_tag": "py"});
        if let Some(m) = limit {
            body["memory_limit_mib"] = json!(m);
        }
        let (st, w) = p.post("/v1/workspaces", body.clone()).await;
        assert_eq!(st, 201, "{w}");
        assert_eq!(w["status"], "running", "{w}");
        assert_eq!(w["source_snapshot_tag"], "py");
        assert!(w["id"].as_str().unwrap().starts_with("ws-"), "{w}");
        assert!(w["current_state_tag"].is_null(), "{w}");
        let sb = live(&w);

        // Refusals: a taken name, an unsafe one, a missing workspace.
        let (st, v) = p.post("/v1/workspaces", body).await;
        assert_eq!(st, 409, "{v}");
        let (st, v) = p
            .post(
                "/v1/workspaces",
                json!({"name": "../x", "snapshot_tag": "py"}),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        let (st, v) = p.post("/v1/workspaces/nope/suspend", json!({})).await;
        assert_eq!(st, 404, "{v}");
        let (st, v) = p.post("/v1/workspaces/dev/resume", json!({})).await;
        assert_eq!(st, 400, "resuming a running workspace: {v}");

        sh(
            &p,
            &sb,
            "mkdir -p /root/proj && echo 'hello workspace' > /root/proj/note.txt",
        )
        .await;
        eval(&p, &sb, "ws_value = int(numpy.arange(10).sum()) * 2").await;

        let (st, w) = p
            .post("/v1/workspaces/dev/suspend", json!({"diff": true}))
            .await;
        assert_eq!(st, 200, "{w}");
        assert_eq!(w["status"], "suspended", "{w}");
        assert_eq!(w["current_state_tag"], "ws-dev-s1", "{w}");
        assert!(w["live_sandbox_id"].is_null(), "{w}");
        eprintln!(
            "first suspend stored {} bytes",
            w["last_suspend_stored_bytes"]
        );
        let (st, _) = p.get(&format!("/v1/sandboxes/{sb}")).await;
        assert_eq!(st, 404, "the suspended workspace's sandbox is gone");
        let (st, v) = p.post("/v1/workspaces/dev/suspend", json!({})).await;
        assert_eq!(st, 400, "suspending a suspended workspace: {v}");
        sb
    });

    p.kill9();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let w = workspace(&p, "dev").await;
        assert_eq!(w["status"], "suspended", "after the restart: {w}");
        let (st, w) = p.post("/v1/workspaces/dev/resume", json!({})).await;
        assert_eq!(st, 200, "{w}");
        assert_eq!(w["status"], "running", "{w}");
        let sb = live(&w);
        assert_ne!(sb, first_sb);
        // Settings kept (forkd bug #287 dropped them on resume).
        let (st, info) = p.get(&format!("/v1/sandboxes/{sb}")).await;
        assert_eq!(st, 200, "{info}");
        assert_eq!(info["memory_limit_mib"].as_u64(), limit, "{info}");
        assert_eq!(info["snapshot_tag"], "ws-dev-s1", "{info}");

        assert_eq!(
            sh(&p, &sb, "cat /root/proj/note.txt").await,
            "hello workspace\n"
        );
        assert_eq!(eval(&p, &sb, "ws_value").await, "90");

        // A second round: the new state replaces the first.
        eval(&p, &sb, "ws_value += 1").await;
        sh(&p, &sb, "echo more >> /root/proj/note.txt").await;
        let (st, w) = p.post("/v1/workspaces/dev/suspend", json!({})).await;
        assert_eq!(st, 200, "{w}");
        assert_eq!(w["current_state_tag"], "ws-dev-s2", "{w}");
        assert_eq!(w["suspend_count"], 2, "{w}");
        eprintln!(
            "second suspend stored {} bytes",
            w["last_suspend_stored_bytes"]
        );
        let tags = snapshot_tags(&p).await;
        assert!(tags.contains(&"ws-dev-s2".to_string()), "{tags:?}");
        assert!(
            !tags.contains(&"ws-dev-s1".to_string()),
            "the previous state is deleted: {tags:?}"
        );

        let (st, w) = p.post("/v1/workspaces/dev/resume", json!({})).await;
        assert_eq!(st, 200, "{w}");
        let sb = live(&w);
        assert_eq!(eval(&p, &sb, "ws_value").await, "91");
        assert_eq!(
            sh(&p, &sb, "cat /root/proj/note.txt").await,
            "hello workspace\nmore\n"
        );

        let (st, list) = p.get("/v1/workspaces").await;
        assert_eq!(st, 200);
        assert_eq!(list.as_array().unwrap().len(), 1, "{list}");

        let (st, v) = p.delete("/v1/workspaces/dev").await;
        assert_eq!(st, 204, "{v}");
        let (st, _) = p.get("/v1/workspaces/dev").await;
        assert_eq!(st, 404);
        let (st, _) = p.get(&format!("/v1/sandboxes/{sb}")).await;
        assert_eq!(st, 404, "a deleted workspace's sandbox is gone");
        let tags = snapshot_tags(&p).await;
        assert!(tags.iter().all(|t| !t.starts_with("ws-dev-")), "{tags:?}");
        assert!(
            tags.contains(&"py".to_string()),
            "the source stays: {tags:?}"
        );
    });
}

/// poold killed at several instants of a suspend: after the restart the
/// workspace is running (its sandbox answers with its state) or suspended
/// (a resume brings its state back); it is never lost, and exactly one
/// sandbox serves it.
#[test]
fn a_poold_killed_mid_suspend_leaves_the_workspace_whole() {
    let home = Home::new();
    let mut p = Poold::start(&home.dir, &[], None);
    block_on(async {
        p.snapshot("py", "python-numpy", PY_MIB).await;
        let (st, w) = p
            .post("/v1/workspaces", json!({"name": "w", "snapshot_tag": "py"}))
            .await;
        assert_eq!(st, 201, "{w}");
        let sb = live(&w);
        eval(&p, &sb, "kept = 'still here'").await;
    });
    for wait_ms in [200u64, 1500, 5000] {
        let _held = p.post_in_background("/v1/workspaces/w/suspend", "{}");
        std::thread::sleep(Duration::from_millis(wait_ms));
        p.kill9();
        p = Poold::start(&home.dir, &[], None);
        block_on(async {
            // The restart finishes a suspend whose state was recorded in
            // the background; wait for that to settle.
            let mut w = workspace(&p, "w").await;
            for _ in 0..600 {
                if w["status"] == "running" || w["status"] == "suspended" {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                w = workspace(&p, "w").await;
            }
            eprintln!("killed {wait_ms} ms into a suspend: {}", w["status"]);
            if w["status"] == "suspended" {
                let (st, v) = p.post("/v1/workspaces/w/resume", json!({})).await;
                assert_eq!(st, 200, "{v}");
                w = v;
            }
            assert_eq!(w["status"], "running", "{w}");
            let sb = live(&w);
            assert_eq!(eval(&p, &sb, "kept").await, "'still here'");
            let (st, all) = p.get("/v1/sandboxes").await;
            assert_eq!(st, 200);
            let ids: Vec<&str> = all
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["id"].as_str().unwrap())
                .collect();
            assert_eq!(ids, [sb.as_str()], "only the workspace's sandbox runs");
        });
    }
    block_on(async {
        let (st, v) = p.delete("/v1/workspaces/w").await;
        assert_eq!(st, 204, "{v}");
    });
}

/// A resume keeps the workspace's network and limits (forkd's resume
/// dropped both, its bug #287): a networked workspace with a task limit
/// comes back in a network namespace of its own, reachable on its guest
/// address, with the same limit.
#[test]
fn a_resume_keeps_the_network_and_the_limits() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (child networks)");
        return;
    }
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "mnet", "image": "minimal", "mem_mib": 128, "net": true}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let (st, w) = p
            .post(
                "/v1/workspaces",
                json!({"name": "net-ws", "snapshot_tag": "mnet", "per_child_netns": true, "pids_max": 300}),
            )
            .await;
        assert_eq!(st, 201, "{w}");
        assert_eq!(w["per_child_netns"], true, "{w}");
        let (st, w) = p.post("/v1/workspaces/net-ws/suspend", json!({})).await;
        assert_eq!(st, 200, "{w}");
        let (st, w) = p.post("/v1/workspaces/net-ws/resume", json!({})).await;
        assert_eq!(st, 200, "{w}");
        let (st, info) = p.get(&format!("/v1/sandboxes/{}", live(&w))).await;
        assert_eq!(st, 200, "{info}");
        assert_eq!(info["pids_max"], 300, "{info}");
        assert!(
            info["netns"].is_string(),
            "no network after the resume: {info}"
        );
        let addr = info["guest_addr"]
            .as_str()
            .expect("a guest address")
            .to_string();
        // The guest answers on its own address: forkd's agent line protocol.
        let reply = tokio::task::spawn_blocking(move || {
            use std::io::{BufRead, BufReader, Write};
            let mut c = std::net::TcpStream::connect((addr.as_str(), 8888)).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            writeln!(
                c,
                "{}",
                json!({"action": "exec", "args": ["echo", "reachable"]})
            )
            .unwrap();
            let mut l = String::new();
            BufReader::new(c).read_line(&mut l).unwrap();
            l
        })
        .await
        .unwrap();
        assert!(reply.contains("reachable"), "{reply}");
        let (st, v) = p.delete("/v1/workspaces/net-ws").await;
        assert_eq!(st, 204, "{v}");
    });
}
