//! poold over HTTP, the real binary with real guests under TCG: every
//! endpoint and its error codes, the tag rule, auth, pools, and a restart
//! that loses nothing.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use serde_json::{json, Value};
use std::time::Duration;

const MINIMAL_MIB: u64 = 128;

/// Every unsafe tag of the tag rule (`^[A-Za-z0-9_-]{1,64}$`).
fn bad_tags() -> Vec<String> {
    vec![
        "../x".into(),
        "a/b".into(),
        ".".into(),
        "x".repeat(65),
        String::new(),
    ]
}

/// Percent-encodes a path segment (so `a/b` and `.` reach the server as is).
fn seg(s: &str) -> String {
    s.bytes().map(|b| format!("%{b:02X}")).collect()
}

#[test]
fn snapshot_and_sandbox_endpoints_with_their_errors() {
    let home = Home::new();
    // poold raises its open-files soft limit to the hard one (two sockets
    // per sandbox would otherwise cap a host at a few hundred). Start it
    // with a low soft limit, as many hosts do, to see it raised.
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, 1024.min(hard), hard).unwrap();
    let p = Poold::start(&home.dir, &[], None);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", p.child.id())).unwrap();
    let files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(files[3], files[4], "{limits}");
    block_on(async {
        // Status endpoints.
        let (st, h) = p.get("/healthz").await;
        assert_eq!((st, &h["ok"]), (200, &json!(true)), "{h}");
        assert_eq!(h["mount"]["ok"], true, "{h}");
        assert_eq!(h["mount"]["recoveries"], 0, "{h}");
        let (st, v) = p.get("/version").await;
        assert_eq!((st, v["api"].as_str()), (200, Some("v1")));
        let (st, v) = p.get("/no/such/route").await;
        assert_eq!(st, 404);
        assert!(v["error"].is_string(), "{v}");

        // POST /v1/snapshots.
        let info = p.snapshot("base", "minimal", MINIMAL_MIB).await;
        assert_eq!(info["tag"], "base");
        assert_eq!(info["status"], "ready");
        assert_eq!(info["bootable"], true);
        let (st, v) = p
            .post("/v1/snapshots", json!({"tag": "base", "image": "minimal"}))
            .await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains("DELETE first"));
        for (body, why) in [
            (json!({"tag": "x", "image": "no-such-image"}), "not built"),
            (json!({"tag": "x"}), "missing image"),
            (json!({"tag": "x", "rootfs": "/etc/passwd"}), "outside"),
            (
                json!({"tag": "x", "rootfs": "/var/../etc/shadow"}),
                "outside",
            ),
            (
                json!({"tag": "x", "image": "minimal", "boot_wait_secs": 61}),
                "≤ 60",
            ),
            (
                json!({"tag": "x", "image": "minimal", "tap": "tap0"}),
                "tap",
            ),
            (
                json!({"tag": "x", "image": "minimal", "nonsense": 1}),
                "unknown field",
            ),
        ] {
            let (st, v) = p.post("/v1/snapshots", body.clone()).await;
            assert_eq!(st, 400, "{body}: {v}");
            let e = v["error"].as_str().unwrap();
            assert!(e.contains(why), "{body}: {e}");
        }

        // GET /v1/snapshots, info.
        let (st, v) = p.get("/v1/snapshots").await;
        assert_eq!(st, 200);
        assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
        let (st, v) = p.get("/v1/snapshots/base/info").await;
        assert_eq!(st, 200);
        assert_eq!(v["chain_depth"], 0);
        assert!(v["memory_logical_bytes"].as_u64().unwrap() > 0);
        assert!(v["vmstate_bytes"].as_u64().unwrap() > 0);
        assert_eq!(p.get("/v1/snapshots/nope/info").await.0, 404);

        // The tag rule, everywhere a tag goes in: 400 and nothing created.
        for t in bad_tags() {
            let mut answers = vec![
                p.post("/v1/snapshots", json!({"tag": t, "image": "minimal"}))
                    .await,
                p.post("/v1/sandboxes", json!({"snapshot_tag": t})).await,
                p.post("/v1/snapshots/base/compact", json!({"to": t})).await,
            ];
            // In a URL path "." and "" are dot/empty segments every client
            // normalizes away; the rest reach poold percent-encoded.
            if !(t == "." || t.is_empty()) {
                let e = seg(&t);
                answers.push(p.get(&format!("/v1/snapshots/{e}/info")).await);
                answers.push(p.delete(&format!("/v1/snapshots/{e}")).await);
                answers.push(
                    p.put(&format!("/v1/pools/{e}"), json!({"min_ready": 1}))
                        .await,
                );
            }
            for (st, v) in answers {
                assert_eq!(st, 400, "tag {t:?}: {v}");
                assert!(v["error"].as_str().unwrap().contains("1-64"), "{v}");
            }
        }
        let (_, v) = p.get("/v1/snapshots").await;
        assert_eq!(
            v.as_array().unwrap().len(),
            1,
            "a bad tag created something: {v}"
        );
        assert_eq!(p.get("/v1/sandboxes").await.1, json!([]));
        let staged = std::fs::read_dir(home.dir.join("staging")).map_or(0, |d| d.count());
        assert_eq!(staged, 0);

        // POST /v1/sandboxes errors.
        for (body, code) in [
            (json!({"snapshot_tag": "base", "n": 0}), 400),
            (json!({"snapshot_tag": "base", "n": 1001}), 400),
            (json!({"snapshot_tag": "missing"}), 404),
            (
                json!({"snapshot_tag": "base", "per_child_netns": true}),
                400,
            ),
            (json!({"snapshot_tag": "base", "memory_limit_mib": 0}), 400),
            (json!({"snapshot_tag": "base", "ttl_secs": u64::MAX}), 400),
            (json!({"n": 1}), 400),
        ] {
            let (st, v) = p.post("/v1/sandboxes", body.clone()).await;
            assert_eq!(st, code, "{body}: {v}");
            assert!(v["error"].is_string(), "{v}");
        }

        // Spawn, list, get.
        let (st, made) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "base", "n": 2, "memory_limit_mib": 256}),
            )
            .await;
        assert_eq!(st, 201, "{made}");
        let sb = ids(&made);
        assert_eq!(sb.len(), 2);
        for s in made.as_array().unwrap() {
            assert!(s["id"].as_str().unwrap().len() >= 27, "guessable id {s}");
            assert_eq!(s["snapshot_tag"], "base");
            assert!(s["pid"].as_u64().is_some());
            assert_eq!(s["memory_limit_mib"], 256);
        }
        let (_, list) = p.get("/v1/sandboxes").await;
        assert_eq!(ids(&list).len(), 2);
        let a = &sb[0];
        assert_eq!(p.get(&format!("/v1/sandboxes/{a}")).await.0, 200);
        assert_eq!(p.get("/v1/sandboxes/sb-nope").await.0, 404);
        let limits = forkd_vmm::Hierarchy::detect().unwrap().read_limits(a);
        assert_eq!(limits.memory_mib, Some(256));

        // ping / exec / eval.
        let (st, v) = p.post(&format!("/v1/sandboxes/{a}/ping"), json!({})).await;
        assert_eq!((st, v["pong"].clone()), (200, json!(true)), "{v}");
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{a}/exec"),
                json!({"args": ["sh", "-c", "echo out; echo err >&2; exit 3"]}),
            )
            .await;
        assert_eq!(st, 200);
        assert_eq!(
            (
                v["stdout"].as_str(),
                v["stderr"].as_str(),
                v["exit_code"].as_i64()
            ),
            (Some("out\n"), Some("err\n"), Some(3))
        );
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{a}/exec"),
                json!({"args": ["sleep", "10"], "timeout_secs": 0.5}),
            )
            .await;
        assert_eq!((st, v["timed_out"].as_bool()), (200, Some(true)), "{v}");
        assert_eq!(
            p.post(&format!("/v1/sandboxes/{a}/exec"), json!({"args": []}))
                .await
                .0,
            400
        );
        // As forkd: a command that cannot start is a failed command.
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{a}/exec"),
                json!({"args": ["no-such-command"]}),
            )
            .await;
        assert_eq!((st, v["exit_code"].as_i64()), (200, Some(127)), "{v}");
        // A huge eval is refused, not a crash.
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{a}/eval"),
                json!({"code": "x".repeat(2 << 20)}),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(
            p.post("/v1/sandboxes/sb-nope/exec", json!({"args": ["true"]}))
                .await
                .0,
            404
        );
        // The minimal image has no Python: eval answers with a clear error.
        let (st, v) = p
            .post(&format!("/v1/sandboxes/{a}/eval"), json!({"code": "1+1"}))
            .await;
        assert_eq!(st, 409, "{v}");
        assert!(v["error"].as_str().unwrap().contains("python3"), "{v}");

        // Streaming exec (NDJSON).
        let (st, bytes) = p
            .client
            .send(
                forkd_api::Method::POST,
                &format!("/v1/sandboxes/{a}/exec/stream"),
                Some(json!({"cmd": "echo one; sleep 0.2; echo two"})),
            )
            .await
            .unwrap();
        assert_eq!(st.as_u16(), 200);
        let lines: Vec<Value> = String::from_utf8_lossy(&bytes)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.first().unwrap()["type"], "started");
        let out: String = lines
            .iter()
            .filter(|l| l["type"] == "stdout")
            .map(|l| l["data"].as_str().unwrap())
            .collect();
        assert_eq!(out, "one\ntwo\n");
        assert_eq!(lines.last().unwrap()["type"], "exit");
        assert_eq!(lines.last().unwrap()["exit_code"], 0);

        // Files.
        let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        let (st, bytes) = p
            .client
            .send_bytes(
                forkd_api::Method::PUT,
                &format!("/v1/sandboxes/{a}/files?path=/tmp/d/blob&mode=0600"),
                data.clone(),
            )
            .await
            .unwrap();
        assert_eq!(st.as_u16(), 200, "{}", String::from_utf8_lossy(&bytes));
        let (st, got) = p
            .client
            .send(
                forkd_api::Method::GET,
                &format!("/v1/sandboxes/{a}/files?path=/tmp/d/blob"),
                None,
            )
            .await
            .unwrap();
        assert_eq!((st.as_u16(), got.to_vec()), (200, data));
        let (st, v) = p
            .get(&format!("/v1/sandboxes/{a}/files/stat?path=/tmp/d/blob"))
            .await;
        assert_eq!((st, v["size"].as_u64()), (200, Some(100_000)), "{v}");
        assert_eq!(v["mode"].as_u64().map(|m| m & 0o777), Some(0o600), "{v}");
        let (st, v) = p
            .get(&format!("/v1/sandboxes/{a}/files/list?path=/tmp/d"))
            .await;
        assert_eq!(st, 200);
        assert_eq!(v["entries"][0]["name"], "blob", "{v}");
        assert_eq!(
            p.post(
                &format!("/v1/sandboxes/{a}/files/mkdir"),
                json!({"path": "/tmp/x/y", "parents": true})
            )
            .await
            .0,
            200
        );
        assert_eq!(
            p.get(&format!("/v1/sandboxes/{a}/files?path=/tmp/nope"))
                .await
                .0,
            404
        );
        assert_eq!(
            p.get(&format!("/v1/sandboxes/{a}/files?path=relative"))
                .await
                .0,
            400
        );
        assert_eq!(
            p.delete(&format!(
                "/v1/sandboxes/{a}/files?path=/tmp/d&recursive=true"
            ))
            .await
            .0,
            204
        );
        // A directory read as a file (409); a file over one request's limit
        // (413) that reads fine in parts.
        assert_eq!(
            p.get(&format!("/v1/sandboxes/{a}/files?path=/tmp")).await.0,
            409
        );
        let big = forkd_node::limits::MAX_FILE_BYTES + 1;
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{a}/exec"),
                json!({"args": ["truncate", "-s", big.to_string(), "/tmp/big"]}),
            )
            .await;
        assert_eq!((st, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
        let (st, v) = p
            .get(&format!("/v1/sandboxes/{a}/files?path=/tmp/big"))
            .await;
        assert_eq!(st, 413, "{v}");
        assert!(v["error"].as_str().unwrap().contains("offset"), "{v}");
        let (st, part) = p
            .client
            .send(
                forkd_api::Method::GET,
                &format!("/v1/sandboxes/{a}/files?path=/tmp/big&offset=4096&len=10"),
                None,
            )
            .await
            .unwrap();
        assert_eq!((st.as_u16(), part.to_vec()), (200, vec![0u8; 10]));

        // Request errors on exec and eval.
        for (route, body) in [
            ("exec", json!({"args": ["true"], "cmd": "true"})),
            ("exec", json!({"args": ["true"], "timeout_secs": 0})),
            ("eval", json!({"code": "1", "timeout_secs": -1})),
            ("eval", json!({})),
        ] {
            let (st, v) = p
                .post(&format!("/v1/sandboxes/{a}/{route}"), body.clone())
                .await;
            assert_eq!(st, 400, "{route} {body}: {v}");
            assert!(v["error"].is_string(), "{v}");
        }
        // Every per-sandbox route answers 404 for an unknown id.
        for (route, body) in [
            ("ping", json!({})),
            ("eval", json!({"code": "1"})),
            ("ttl", json!({"ttl_secs": 5})),
            ("exec/stream", json!({"cmd": "true"})),
            ("files/mkdir", json!({"path": "/x"})),
        ] {
            let (st, v) = p
                .post(&format!("/v1/sandboxes/sb-nope/{route}"), body)
                .await;
            assert_eq!(st, 404, "{route}: {v}");
        }
        for route in [
            "logs",
            "files?path=/x",
            "files/stat?path=/x",
            "files/list?path=/x",
        ] {
            assert_eq!(
                p.get(&format!("/v1/sandboxes/sb-nope/{route}")).await.0,
                404,
                "{route}"
            );
        }

        // The other sandbox never saw any of it.
        let b = &sb[1];
        assert_eq!(
            p.get(&format!("/v1/sandboxes/{b}/files/stat?path=/tmp/x"))
                .await
                .0,
            404
        );

        // Logs and TTL.
        let (st, _) = p.get(&format!("/v1/sandboxes/{a}/logs")).await;
        assert_eq!(st, 200);
        let (st, v) = p
            .post(&format!("/v1/sandboxes/{b}/ttl"), json!({"ttl_secs": 1}))
            .await;
        assert_eq!(st, 200, "{v}");
        let mut gone = false;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if p.get(&format!("/v1/sandboxes/{b}")).await.0 == 404 {
                gone = true;
                break;
            }
        }
        assert!(gone, "sandbox with an expired TTL is still there");

        // Snapshot deletes: in use (409), dependents (409), cascade/force.
        let (st, v) = p
            .post("/v1/snapshots/base/compact", json!({"to": "copy"}))
            .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["branched_from"], "compact:base");
        assert_eq!(
            p.post("/v1/snapshots/base/compact", json!({"to": "copy"}))
                .await
                .0,
            409
        );
        assert_eq!(
            p.post("/v1/snapshots/base/compact", json!({"to": "base"}))
                .await
                .0,
            400
        );
        let (st, v) = p.delete("/v1/snapshots/base").await;
        assert_eq!(st, 409, "deleting a snapshot a sandbox maps: {v}");
        // A client that hangs up before the answer is still audited (499):
        // the line used to be lost while the work ran on.
        {
            use std::io::Write;
            let addr = p.url.trim_start_matches("http://").to_string();
            let body = r#"{"args":["sleep","3"]}"#;
            let mut c = std::net::TcpStream::connect(&addr).unwrap();
            write!(
                c,
                "POST /v1/sandboxes/{a}/exec HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let exec_path = format!("\"path\":\"/v1/sandboxes/{a}/exec\"");
        let mut hung_up = false;
        for _ in 0..100 {
            let audit = std::fs::read_to_string(home.dir.join("poold/audit.jsonl")).unwrap();
            hung_up = audit
                .lines()
                .any(|l| l.contains(&exec_path) && l.contains("\"status\":499"));
            if hung_up {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(hung_up, "no 499 line for the abandoned exec");
        assert_eq!(p.delete(&format!("/v1/sandboxes/{a}")).await.0, 204);
        assert_eq!(p.delete(&format!("/v1/sandboxes/{a}")).await.0, 404);
        assert_eq!(
            p.delete("/v1/snapshots/base?cascade=true&force=true")
                .await
                .0,
            400
        );
        assert_eq!(p.delete("/v1/snapshots/nope").await.0, 404);
        assert_eq!(p.delete("/v1/snapshots/copy").await.0, 204);
        assert_eq!(p.delete("/v1/snapshots/base").await.0, 204);
        assert_eq!(p.get("/v1/snapshots").await.1, json!([]));

        // Metrics and the audit log.
        assert!(p.metric("forkd_build_info", "").await >= 1.0);
        assert_eq!(p.metric("forkd_sandboxes_active", "").await, 0.0);
        let audit = std::fs::read_to_string(home.dir.join("poold/audit.jsonl")).unwrap();
        assert!(audit.lines().count() > 50);
        assert!(audit.contains("\"path\":\"/v1/sandboxes\""));
        // The query string is audited with the path.
        assert!(
            audit.contains("\"query\":\"cascade=true&force=true\""),
            "{audit}"
        );
    });
    drop(p);
    assert!(home.qemu_pids().is_empty(), "QEMU left running");
}

#[test]
fn auth_tokens_are_checked_and_audited() {
    let home = Home::new();
    let token = "Zq3v9LkP0xW7rT2mB8nC4dF6gH1jK5sA";
    let tf = home.dir.join("token");
    std::fs::write(&tf, format!("{token}\n")).unwrap();
    let tfs = tf.to_str().unwrap();

    // No token on a public address, or a weak one: refused at start.
    let e = Poold::try_start(&home.dir, &["--bind", "0.0.0.0:0"], None)
        .err()
        .expect("poold served 0.0.0.0 without a token");
    assert!(e.contains("without a token"), "{e}");
    let weak = home.dir.join("weak");
    std::fs::write(&weak, "changeme").unwrap();
    let e = Poold::try_start(&home.dir, &["--token-file", weak.to_str().unwrap()], None)
        .err()
        .expect("poold accepted a weak token");
    assert!(e.contains("too weak"), "{e}");

    let p = Poold::start(&home.dir, &["--token-file", tfs], Some(token));
    let anon = forkd_api::Client::new(&p.url, None).unwrap();
    let wrong =
        forkd_api::Client::new(&p.url, Some("Zq3v9LkP0xW7rT2mB8nC4dF6gH1jK5sB".into())).unwrap();
    block_on(async {
        use forkd_api::Method;
        let (st, _) = anon.send(Method::GET, "/healthz", None).await.unwrap();
        assert_eq!(st.as_u16(), 200, "healthz needs no token");
        for c in [&anon, &wrong] {
            for (m, path) in [
                (Method::GET, "/v1/sandboxes"),
                (Method::GET, "/v1/snapshots"),
                (Method::GET, "/metrics"),
                (Method::DELETE, "/v1/snapshots/x"),
            ] {
                let (st, body) = c.send(m, path, None).await.unwrap();
                assert_eq!(st.as_u16(), 401, "{path}");
                let v: Value = serde_json::from_slice(&body).unwrap();
                assert!(v["error"].as_str().unwrap().contains("token"));
            }
        }
        assert_eq!(p.get("/v1/sandboxes").await.0, 200);
        assert_eq!(p.get("/metrics").await.0, 200);
    });
    let audit = std::fs::read_to_string(home.dir.join("poold/audit.jsonl")).unwrap();
    let entries: Vec<Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |auth: &str, status: u64| {
        entries
            .iter()
            .filter(|e| e["auth"] == auth && e["status"] == status)
            .count()
    };
    assert_eq!(of("missing", 401), 4);
    assert_eq!(of("bad", 401), 4);
    assert_eq!(of("ok", 200), 2);
}

/// The VM names (`-name`) of this home's QEMU processes, with their pids.
fn vm_names(home: &Home) -> Vec<(u32, String)> {
    home.qemu_pids()
        .into_iter()
        .filter_map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<String> = cmd
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let i = args.iter().position(|a| a == "-name")?;
            Some((pid, args.get(i + 1)?.clone()))
        })
        .collect()
}

/// Whether `pid` is a member of VM `name`'s pids group.
fn in_group(h: &forkd_vmm::Hierarchy, name: &str, pid: u32) -> bool {
    h.group(forkd_vmm::Controller::Pids, name)
        .and_then(|g| std::fs::read_to_string(g.join("cgroup.procs")).ok())
        .is_some_and(|procs| procs.lines().any(|l| l == pid.to_string()))
}

#[test]
fn pool_hits_refill_and_misses() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &["--refill-concurrency", "2"], None);
    block_on(async {
        p.snapshot("py", "python-numpy", 256).await;
        let (st, v) = p.put("/v1/pools/py", json!({"min_ready": 4})).await;
        assert_eq!(st, 200, "{v}");
        for (body, why) in [
            (json!({"min_ready": 4, "max_ready": 2}), "below"),
            (json!({"min_ready": 5000}), "cap"),
            (json!({"min": 4}), "unknown field"),
        ] {
            let (st, v) = p.put("/v1/pools/py", body).await;
            assert_eq!(st, 400, "{v}");
            assert!(v["error"].as_str().unwrap().contains(why), "{v}");
        }
        assert_eq!(
            p.put("/v1/pools/nope", json!({"min_ready": 1})).await.0,
            404
        );
        p.wait_pool("py", 4).await;
        assert_eq!(p.metric("forkd_pool_ready", "tag=\"py\"").await, 4.0);

        // Parked children are in their cgroups already (default limits);
        // a hand-out gives them the request's values.
        let parked = vm_names(&home);
        assert_eq!(parked.len(), 4, "{parked:?}");
        // Under TCG, QEMU runs without transparent huge pages (they only
        // round up what a paused child holds).
        for (pid, name) in &parked {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
            if String::from_utf8_lossy(&cmd).contains("\0tcg") {
                let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
                assert!(st.contains("THP_enabled:\t0"), "{name}: THP still on");
                // Nor does guest RAM carry QEMU's huge-page advice, which
                // made each fault on memory.bin read a 2 MiB block.
                let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
                let mem = smaps
                    .split_once("/memory.bin")
                    .unwrap_or_else(|| panic!("{name}: no memory.bin mapping"))
                    .1;
                let flags = mem.lines().find(|l| l.starts_with("VmFlags")).unwrap();
                assert!(
                    !flags.contains(" hg"),
                    "{name}: guest RAM advised huge: {flags}"
                );
            }
        }
        // (Where the host has a pids controller: poold's default pids_max
        // puts every child in a group.)
        let cg = forkd_vmm::Hierarchy::detect()
            .ok()
            .filter(|h| h.supports(forkd_vmm::Controller::Pids));
        if let Some(h) = &cg {
            for (pid, name) in &parked {
                assert!(in_group(h, name, *pid), "parked {name} is not in its group");
            }
        }
        let (st, four) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "py", "n": 4, "pids_max": 256}),
            )
            .await;
        assert_eq!(st, 201, "{four}");
        assert!(four
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["pool_hit"] == true));
        if let Some(h) = &cg {
            for s in four.as_array().unwrap() {
                let id = s["id"].as_str().unwrap();
                assert_eq!(h.read_limits(id).pids_max, Some(256), "{id}");
                let pid = s["pid"].as_u64().unwrap() as u32;
                assert!(in_group(h, id, pid), "{id} left its group");
            }
        }
        assert_eq!(p.metric("forkd_pool_hits_total", "tag=\"py\"").await, 4.0);
        assert_eq!(p.metric("forkd_pool_misses_total", "tag=\"py\"").await, 0.0);
        p.wait_pool("py", 4).await;
        // Parked children's clocks stand still: wait long enough that one
        // handed out without its clock set would be visibly behind.
        std::thread::sleep(Duration::from_secs(5));

        let (st, ten) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "py", "n": 10}))
            .await;
        assert_eq!(st, 201, "{ten}");
        let hits = ten
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["pool_hit"] == true)
            .count();
        assert_eq!(hits, 4);
        assert_eq!(p.metric("forkd_pool_hits_total", "tag=\"py\"").await, 8.0);
        assert_eq!(p.metric("forkd_pool_misses_total", "tag=\"py\"").await, 6.0);
        assert_eq!(
            p.metric("forkd_spawn_latency_seconds_count", "").await,
            14.0
        );
        // All ten answer eval, each as itself.
        let answers = futures::future::join_all(ten.as_array().unwrap().iter().map(|s| {
            let id = s["id"].as_str().unwrap().to_string();
            let p = &p;
            async move {
                p.post(
                    &format!("/v1/sandboxes/{id}/eval"),
                    json!({"code": "import socket; (socket.gethostname(), numpy.zeros(2).tolist())"}),
                )
                .await
            }
        }))
        .await;
        for ((st, v), s) in answers.iter().zip(ten.as_array().unwrap()) {
            assert_eq!(*st, 200, "{v}");
            assert_eq!(
                v["result"].as_str().unwrap(),
                format!("('{}', [0.0, 0.0])", s["id"].as_str().unwrap())
            );
        }
        // Pool hits (identity given when parked, clock at hand-out) and
        // restores alike: every child's RNGs are its own, its clock is the
        // host's.
        let code = "import random, time; (random.random(), float(numpy.random.random()), \
                    open('/dev/urandom', 'rb').read(8).hex(), time.time())";
        let mut seen = std::collections::HashSet::new();
        for s in ten.as_array().unwrap() {
            let id = s["id"].as_str().unwrap();
            let (st, v) = p
                .post(&format!("/v1/sandboxes/{id}/eval"), json!({ "code": code }))
                .await;
            assert_eq!(st, 200, "{v}");
            let r = v["result"]
                .as_str()
                .unwrap()
                .trim_matches(|c| c == '(' || c == ')');
            let parts: Vec<&str> = r.split(", ").collect();
            assert_eq!(parts.len(), 4, "{r}");
            let host = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs_f64();
            let guest: f64 = parts[3].parse().unwrap();
            assert!(
                (host - guest).abs() < 3.0,
                "{id} (pool hit: {}): guest clock {guest} vs host {host}",
                s["pool_hit"]
            );
            for (k, x) in parts[..3].iter().enumerate() {
                assert!(
                    seen.insert((k, x.to_string())),
                    "{id}: RNG output {k} repeats: {x}"
                );
            }
        }
        let (_, pools) = p.get("/v1/pools").await;
        assert_eq!(pools[0]["hits"], 8);
        // A result over the channel's 1 MiB header limit is a prompt 400
        // naming the way out; it used to panic the agent's reply task and
        // leave the caller waiting for its timeout. The child still answers.
        let one = ten[0]["id"].as_str().unwrap();
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{one}/eval"),
                json!({"code": "'x' * 2_000_000", "timeout_secs": 60}),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains("files API"), "{v}");
        let (st, v) = p
            .post(&format!("/v1/sandboxes/{one}/eval"), json!({"code": "2+2"}))
            .await;
        assert_eq!((st, v["result"].as_str()), (200, Some("4")), "{v}");

        // warm_eval: the warm-up runs it in every child parked from now
        // on, in the child's own interpreter, so a pool hit finds what it
        // defined. Refused without warm, or empty.
        for (body, why) in [
            (
                json!({"min_ready": 4, "warm": false, "warm_eval": "1"}),
                "needs warm",
            ),
            (
                json!({"min_ready": 4, "warm_eval": " "}),
                "warm_eval must be",
            ),
        ] {
            let (st, v) = p.put("/v1/pools/py", body).await;
            assert_eq!(st, 400, "{v}");
            assert!(v["error"].as_str().unwrap().contains(why), "{v}");
        }
        let (st, v) = p
            .put(
                "/v1/pools/py",
                json!({"min_ready": 4, "warm_eval": "parked_marker = 7"}),
            )
            .await;
        assert_eq!(
            (st, v["warm_eval"].as_str()),
            (200, Some("parked_marker = 7")),
            "{v}"
        );
        p.wait_pool("py", 4).await;
        // The four parked before the change go first.
        let (_, older) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "py", "n": 4}))
            .await;
        p.wait_pool("py", 4).await;
        let (_, newer) = p.post("/v1/sandboxes", json!({"snapshot_tag": "py"})).await;
        assert_eq!(newer[0]["pool_hit"], true, "{newer}");
        let marked = newer[0]["id"].as_str().unwrap();
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{marked}/eval"),
                json!({"code": "parked_marker"}),
            )
            .await;
        assert_eq!((st, v["result"].as_str()), (200, Some("7")), "{v}");
        for id in ids(&older).iter().chain(ids(&newer).iter()) {
            assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
        }

        // Deleting the snapshot drains its pool first.
        for id in ids(&four).iter().chain(ids(&ten).iter()) {
            assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
        }
        p.wait_pool("py", 4).await;
        let parked = vm_names(&home);
        assert_eq!(p.delete("/v1/snapshots/py").await.0, 204);
        assert_eq!(p.get("/v1/pools/py").await.1["ready"], 0);
        // The drained children's groups went with them.
        if let Some(h) = &cg {
            for (_, name) in &parked {
                let g = h.group(forkd_vmm::Controller::Pids, name);
                assert!(!g.as_ref().is_some_and(|g| g.exists()), "{g:?} left behind");
            }
        }
    });
    drop(p);
    std::thread::sleep(Duration::from_millis(500));
    assert!(home.qemu_pids().is_empty(), "QEMU left running");
}

/// A swap file this test adds while it runs, when the host has no swap:
/// swapped off and deleted on drop.
struct SwapFile(Option<std::path::PathBuf>);

impl SwapFile {
    fn ensure(dir: &std::path::Path) -> SwapFile {
        if forkd_vmm::swap_total_kib() > 0 {
            return SwapFile(None);
        }
        let f = dir.join("test.swap");
        let run = |cmd: &str, args: &[&str]| {
            let out = std::process::Command::new(cmd).args(args).output().unwrap();
            assert!(out.status.success(), "{cmd} {args:?}: {out:?}");
        };
        let path = f.to_str().unwrap();
        run("fallocate", &["-l", "256M", path]);
        std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        run("mkswap", &[path]);
        run("swapon", &[path]);
        SwapFile(Some(f))
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            let _ = std::process::Command::new("swapoff").arg(&f).status();
            let _ = std::fs::remove_file(f);
        }
    }
}

#[test]
fn parked_children_page_out_to_swap() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        p.snapshot("py", "python-numpy", 256).await;
        let (st, v) = p
            .put("/v1/pools/py", json!({"min_ready": 2, "keep_resident": 1}))
            .await;
        assert_eq!(st, 400, "{v}");
        assert!(
            v["error"].as_str().unwrap().contains("needs page_out"),
            "{v}"
        );
        let spec = json!({"min_ready": 3, "page_out": true, "keep_resident": 1});
        // Without swap the pool is refused, with what to do.
        if forkd_vmm::swap_total_kib() == 0 {
            let (st, v) = p.put("/v1/pools/py", spec.clone()).await;
            assert_eq!(st, 400, "{v}");
            assert!(v["error"].as_str().unwrap().contains("needs swap"), "{v}");
        }
        let _swap = SwapFile::ensure(&home.dir);
        let (st, v) = p.put("/v1/pools/py", spec).await;
        assert_eq!((st, &v["page_out"]), (200, &json!(true)), "{v}");
        p.wait_pool("py", 3).await;
        // One parked child stays resident (keep_resident); the others' own
        // memory (TCG code, QEMU's heap, the guest pages they wrote) is in
        // swap.
        let parked = vm_names(&home);
        assert_eq!(parked.len(), 3, "{parked:?}");
        let (paged, resident): (Vec<_>, Vec<_>) = parked.iter().partition(|(pid, _)| {
            let m = forkd_vmm::mem_use(*pid).unwrap();
            m.swap_pss_kib >= 4 << 10 && m.pss_anon_kib < m.swap_pss_kib / 2
        });
        assert_eq!((paged.len(), resident.len()), (2, 1), "{parked:?}");
        let v = p.get("/v1/pools/py").await.1;
        assert_eq!(
            (&v["keep_resident"], &v["resident"]),
            (&json!(1), &json!(1)),
            "{v}"
        );
        // The resident child goes first. The oldest paged-out one is read
        // back from swap at once (far cheaper than the refill's restore),
        // so the refill's replacement is parked paged out.
        let (st, one) = p.post("/v1/sandboxes", json!({"snapshot_tag": "py"})).await;
        assert_eq!(st, 201, "{one}");
        assert_eq!(one[0]["pid"], resident[0].0, "{one}");
        assert_eq!(
            p.delete(&format!("/v1/sandboxes/{}", one[0]["id"].as_str().unwrap()))
                .await
                .0,
            204
        );
        p.wait_pool("py", 3).await;
        p.wait_pool_until("py", |v| v["resident"] == 1).await;
        let now: Vec<_> = vm_names(&home)
            .into_iter()
            .filter(|(pid, _)| {
                let m = forkd_vmm::mem_use(*pid).unwrap();
                m.swap_pss_kib < m.pss_anon_kib / 4
            })
            .collect();
        assert_eq!(now.len(), 1, "{now:?}");
        assert!(
            paged.iter().any(|(pid, _)| *pid == now[0].0),
            "the resident child {now:?} should be one that was paged out: {paged:?}"
        );
        // A hand-out reads back what it touches and works as any other;
        // a memory limit turns swapping off again (cgroup v2).
        let (st, two) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "py", "n": 2, "memory_limit_mib": 2048}),
            )
            .await;
        assert_eq!(st, 201, "{two}");
        let cg = forkd_vmm::Hierarchy::detect().ok();
        for s in two.as_array().unwrap() {
            assert_eq!(s["pool_hit"], true, "{s}");
            let id = s["id"].as_str().unwrap();
            let (st, v) = p
                .post(
                    &format!("/v1/sandboxes/{id}/eval"),
                    json!({"code": "numpy.arange(4).sum().item()"}),
                )
                .await;
            assert_eq!((st, v["result"].as_str()), (200, Some("6")), "{v}");
            if let Some(g) = cg
                .as_ref()
                .and_then(|h| h.group(forkd_vmm::Controller::Memory, id))
                .map(|g| g.join("memory.swap.max"))
                .filter(|f| f.exists())
            {
                assert_eq!(std::fs::read_to_string(&g).unwrap().trim(), "0", "{id}");
            }
            assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
        }
        // Drained, refills in flight included (parked children outlive poold).
        assert_eq!(p.delete("/v1/pools/py").await.0, 204);
        p.wait_pool("py", 0).await;
    });
    drop(p);
    std::thread::sleep(Duration::from_millis(500));
    assert!(home.qemu_pids().is_empty(), "QEMU left running");
}

#[test]
fn kill_9_and_restart_loses_no_sandbox() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &["--pool", "r=2"], None);
    let five = block_on(async {
        p.snapshot("r", "minimal", MINIMAL_MIB).await;
        p.wait_pool("r", 2).await;
        let (st, five) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "r", "n": 5}))
            .await;
        assert_eq!(st, 201, "{five}");
        p.wait_pool("r", 2).await;
        ids(&five)
    });
    let qemus = home.qemu_pids();
    assert_eq!(qemus.len(), 7, "5 sandboxes + 2 pooled");
    p.kill9();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(home.qemu_pids(), qemus, "children died with poold");

    let p = Poold::start(&home.dir, &["--pool", "r=2"], None);
    block_on(async {
        let (_, list) = p.get("/v1/sandboxes").await;
        let mut got = ids(&list);
        got.sort();
        let mut want = five.clone();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(p.get("/v1/pools/r").await.1["ready"], 2);
        for id in &five {
            let (st, v) = p
                .post(
                    &format!("/v1/sandboxes/{id}/exec"),
                    json!({"args": ["echo", "still here"]}),
                )
                .await;
            assert_eq!(
                (st, v["stdout"].as_str()),
                (200, Some("still here\n")),
                "{v}"
            );
        }
        // Pooled children were re-adopted too: a spawn takes them.
        let (_, two) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "r", "n": 2}))
            .await;
        assert!(two
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["pool_hit"] == true));
        for id in five.iter().chain(ids(&two).iter()) {
            assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
        }
        assert_eq!(p.delete("/v1/pools/r").await.0, 204);
        p.wait_pool("r", 0).await;
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        home.qemu_pids().is_empty(),
        "QEMU leaked: {:?}",
        home.qemu_pids()
    );
}

#[test]
fn branch_endpoint_follows_forkd_rules() {
    let home = Home::new();
    let p = Poold::start(
        &home.dir,
        &["--branch-concurrency", "1", "--max-sandboxes", "2"],
        None,
    );
    block_on(async {
        p.snapshot("base", "minimal", MINIMAL_MIB).await;
        let (_, made) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "base", "n": 1}))
            .await;
        let id = ids(&made).remove(0);
        let (st, _) = p
            .post(
                &format!("/v1/sandboxes/{id}/exec"),
                json!({"args": ["sh", "-c", "echo one > /marker"]}),
            )
            .await;
        assert_eq!(st, 200);
        let br = format!("/v1/sandboxes/{id}/branch");

        // forkd's validation, in order.
        for (body, code, why) in [
            (json!({"tag": "../x"}), 400, "1-64"),
            (
                json!({"tag": "b", "mode": "live", "diff": true}),
                400,
                "mode",
            ),
            (
                json!({"tag": "b", "diff": true, "live": true}),
                400,
                "exclusive",
            ),
            (json!({"tag": "b", "wait": false}), 400, "live"),
            (json!({"tag": "b", "mode": "sideways"}), 400, "unknown mode"),
            (json!({"tag": "base"}), 409, "exists"),
            (
                json!({"tag": "b", "mode": "diff", "parent_tag": "other"}),
                400,
                "parent_tag",
            ),
            (
                json!({"tag": "b", "mode": "live", "parent_tag": "base"}),
                400,
                "parent_tag",
            ),
        ] {
            let (st, v) = p.post(&br, body.clone()).await;
            assert_eq!(st, code, "{body}: {v}");
            assert!(v["error"].as_str().unwrap().contains(why), "{body}: {v}");
        }
        // A parent_tag mismatch names both snapshots.
        let (_, v) = p
            .post(
                &br,
                json!({"tag": "b", "mode": "diff", "parent_tag": "other"}),
            )
            .await;
        let e = v["error"].as_str().unwrap();
        assert!(e.contains("\"other\"") && e.contains("\"base\""), "{v}");
        assert_eq!(
            p.post("/v1/sandboxes/sb-nope/branch", json!({"tag": "b"}))
                .await
                .0,
            404
        );

        // A live branch while a second one is refused at the cap (503).
        let (first, second) =
            futures::join!(p.post(&br, json!({"tag": "b1", "mode": "live"})), async {
                tokio::time::sleep(Duration::from_millis(150)).await;
                p.post(&br, json!({"tag": "b2", "mode": "live"})).await
            });
        assert_eq!(first.0, 201, "{}", first.1);
        assert_eq!(first.1["branched_from"], id.as_str());
        // An integer, as forkd answers (its SDK and recipes parse one).
        let pause = first.1["pause_ms"].as_u64();
        assert!(pause.is_some_and(|ms| ms > 0), "{}", first.1);
        assert_eq!(first.1["status"], "ready");
        assert_eq!(second.0, 503, "{}", second.1);

        // The source moves on; a child of b1 sees the instant of the branch.
        p.post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": ["sh", "-c", "echo two > /marker"]}),
        )
        .await;
        let (st, kid) = p.post("/v1/sandboxes", json!({"snapshot_tag": "b1"})).await;
        assert_eq!(st, 201, "{kid}");
        let kid = ids(&kid).remove(0);
        // Two are running: at --max-sandboxes 2 a third is refused.
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "b1"})).await;
        assert_eq!(st, 503, "{v}");
        assert!(
            v["error"].as_str().unwrap().contains("max_sandboxes"),
            "{v}"
        );
        let (_, v) = p
            .post(
                &format!("/v1/sandboxes/{kid}/exec"),
                json!({"args": ["cat", "/marker"]}),
            )
            .await;
        assert_eq!(v["stdout"], "one\n");
        let (_, info) = p.get("/v1/snapshots/b1/info").await;
        assert_eq!(info["chain_depth"], 1);
        assert_eq!(info["parent_tag"], "base");
        assert_eq!(info["ancestors"], json!(["base"]));
        // forkd's v0.5 carve-out: live_fork on a chained snapshot is a 400
        // (before the sandbox cap's 503), naming both snapshots.
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "b1", "live_fork": true}),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        let e = v["error"].as_str().unwrap();
        assert!(
            e.contains("live_fork") && e.contains("b1") && e.contains("base"),
            "{v}"
        );

        // wait:false answers 202 "writing", then the snapshot turns ready;
        // the default tag follows forkd's pattern.
        let (st, v) = p.post(&br, json!({"live": true, "wait": false})).await;
        assert_eq!(st, 202, "{v}");
        assert_eq!(v["status"], "writing");
        let tag = v["tag"].as_str().unwrap().to_string();
        assert!(tag.starts_with(&format!("branch-{id}-")), "{tag}");
        let mut ready = false;
        for _ in 0..300 {
            let (_, list) = p.get("/v1/snapshots").await;
            if list
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["tag"] == tag.as_str() && s["status"] == "ready")
            {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(ready, "the wait:false branch never became ready");
        let (_, sb) = p.get(&format!("/v1/sandboxes/{id}")).await;
        assert_eq!(sb["branch_count"], 2);
        assert_eq!(sb["has_branched"], true);

        // A grandchild link: base <- b1 <- c1.
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{kid}/branch"),
                json!({"tag": "c1", "mode": "live"}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(
            p.post("/v1/snapshots/nope/compact", json!({"to": "z"}))
                .await
                .0,
            404
        );

        // A parent with dependents: 409 naming them; `force` deletes only
        // the parent, and its children stay restorable as roots; `cascade`
        // deletes a subtree.
        for s in [&id, &kid] {
            assert_eq!(p.delete(&format!("/v1/sandboxes/{s}")).await.0, 204);
        }
        let (st, v) = p.delete("/v1/snapshots/base").await;
        assert_eq!(st, 409, "{v}");
        assert!(v["error"].as_str().unwrap().contains("b1"), "{v}");
        assert_eq!(p.delete("/v1/snapshots/base?force=true").await.0, 204);
        let (st, info) = p.get("/v1/snapshots/b1/info").await;
        assert_eq!((st, info["chain_depth"].clone()), (200, json!(0)), "{info}");
        let (st, again) = p.post("/v1/sandboxes", json!({"snapshot_tag": "b1"})).await;
        assert_eq!(st, 201, "b1 after its parent was force-deleted: {again}");
        let again = ids(&again).remove(0);
        let (_, v) = p
            .post(
                &format!("/v1/sandboxes/{again}/exec"),
                json!({"args": ["cat", "/marker"]}),
            )
            .await;
        assert_eq!(v["stdout"], "one\n");
        assert_eq!(p.delete(&format!("/v1/sandboxes/{again}")).await.0, 204);
        let (st, v) = p.delete("/v1/snapshots/b1").await;
        assert_eq!(st, 409, "{v}");
        assert!(v["error"].as_str().unwrap().contains("c1"), "{v}");
        assert_eq!(p.delete("/v1/snapshots/b1?cascade=true").await.0, 204);
        assert_eq!(p.delete(&format!("/v1/snapshots/{tag}")).await.0, 204);
        assert_eq!(p.get("/v1/snapshots").await.1, json!([]));
    });
}

/// Snapshot creations past `snapshot_concurrency` are a 503 naming the
/// setting, not more VMs booting at once (there was no limit).
#[test]
fn snapshot_creations_past_the_cap_are_refused() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &["--snapshot-concurrency", "1"], None);
    block_on(async {
        let body = |tag: &str| json!({"tag": tag, "image": "minimal", "mem_mib": 128});
        let (a, b) = tokio::join!(
            p.post("/v1/snapshots", body("cap-a")),
            p.post("/v1/snapshots", body("cap-b"))
        );
        let mut codes = [a.0, b.0];
        codes.sort();
        assert_eq!(codes, [201, 503], "{a:?} {b:?}");
        let refused = if a.0 == 503 { &a.1 } else { &b.1 };
        assert!(
            refused["error"]
                .as_str()
                .unwrap()
                .contains("snapshot_concurrency"),
            "{refused}"
        );
    });
}

#[test]
fn unix_socket_serves_api_and_cli() {
    let home = Home::new();
    // A file that is not a socket at the path: refused, and left alone.
    let sock = home.dir.join("poold.sock");
    std::fs::write(&sock, "precious").unwrap();
    let e = Poold::try_start(&home.dir, &["--unix", sock.to_str().unwrap()], None)
        .err()
        .expect("poold started over a regular file");
    assert!(e.contains("not a socket"), "{e}");
    assert_eq!(std::fs::read_to_string(&sock).unwrap(), "precious");
    std::fs::remove_file(&sock).unwrap();

    let p = Poold::start(&home.dir, &["--unix", sock.to_str().unwrap()], None);
    assert_eq!(p.url, format!("unix://{}", sock.display()));
    block_on(async {
        assert_eq!(p.get("/v1/snapshots").await, (200, json!([])));
    });
    let out = std::process::Command::new(forkd_e2e::bin("forkd"))
        .args(["ls"])
        .env("FORKD_HOME", &home.dir)
        .env("FORKD_URL", &p.url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "forkd ls over the unix socket: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn foreign_host_headers_are_refused_and_audited() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &["--allow-host", "poold.internal"], None);
    // A DNS-rebinding page's requests name its own host: refused on every
    // route, /healthz included, with advice on what to configure.
    for path in ["/healthz", "/version", "/v1/sandboxes"] {
        let (st, body) = p.raw_get(path, Some("evil.example:8889"));
        assert_eq!(st, 421, "{path}: {body}");
        let v: Value = serde_json::from_str(body.trim()).unwrap_or_else(|_| {
            // chunked bodies: take the JSON object out
            let s = &body[body.find('{').unwrap()..=body.rfind('}').unwrap()];
            serde_json::from_str(s).unwrap()
        });
        let e = v["error"].as_str().unwrap();
        assert!(e.contains("--allow-host evil.example"), "{e}");
    }
    assert_eq!(p.raw_get("/healthz", None).0, 421, "no Host at all");
    // The names poold is known by pass, with or without the port.
    let port = p.url.rsplit(':').next().unwrap().to_string();
    for host in [
        "localhost".to_string(),
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        "127.0.0.1".to_string(),
        "[::1]".to_string(),
        "poold.internal".to_string(),
        format!("POOLD.internal:{port}"),
    ] {
        let (st, body) = p.raw_get("/healthz", Some(&host));
        assert_eq!(st, 200, "{host}: {body}");
    }
    let audit = std::fs::read_to_string(home.dir.join("poold/audit.jsonl")).unwrap();
    let refused: Vec<Value> = audit
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["status"] == 421)
        .collect();
    assert_eq!(refused.len(), 4, "{audit}");
    assert_eq!(refused[0]["host"], "evil.example:8889");
    assert_eq!(refused[0]["path"], "/healthz");
}

#[test]
fn version_reports_the_accelerator_and_tcg_warns_at_start() {
    let home = Home::new();
    let mut p = Poold::start(&home.dir, &[], None);
    let want = forkd_vmm::AccelChoice::from_env()
        .unwrap()
        .resolve()
        .unwrap();
    block_on(async {
        let (st, v) = p.get("/version").await;
        assert_eq!(st, 200);
        assert_eq!(v["api"], "v1");
        assert!(v["version"].is_string(), "{v}");
        assert_eq!(v["accelerator"], want.as_str(), "{v}");
        assert_eq!(v["jail"], true, "{v}");
        let iso = v["isolation"].as_str().unwrap();
        if want == forkd_vmm::Accel::Tcg {
            assert!(iso.contains("TCG") && iso.contains("weaker"), "{iso}");
        }
    });
    let log = p.stderr_now();
    let warned = log
        .lines()
        .any(|l| l.contains("WARN") && l.contains("TCG") && l.contains("docs/security.md"));
    assert_eq!(
        warned,
        want == forkd_vmm::Accel::Tcg,
        "TCG warning at start iff TCG; log:\n{log}"
    );
}
