//! The unmodified E2B SDK from PyPI against a real poold with real guests
//! (docs/e2b.md): `e2b` and `e2b-code-interpreter` at the pinned newest
//! versions (tests/python/requirements.txt, `FORKD_TEST_PYTHON`) and the
//! oldest supported `e2b` (tests/python/requirements-e2b-oldest.txt,
//! `FORKD_TEST_PYTHON_E2B_OLDEST`) run tests/python/e2b_sdk.py: create
//! from a python-numpy snapshot tagged `code-interpreter-v1` (the code
//! interpreter's default template), commands, files, timeouts, info, list,
//! connect, run_code on the warm numpy, kill. The SDK's failures fail this
//! test; so do wrong keys and tokens getting through. A second test kills
//! poold with SIGKILL under a sandbox created through E2B and checks, with
//! the SDK (tests/python/e2b_restart.py), that its metadata, template,
//! create-time envs and access token survived the restart.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{Home, Poold};
use serde_json::json;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// The code interpreter's default template, as a snapshot tag.
const TEMPLATE: &str = "code-interpreter-v1";

fn client(var: &str) -> PathBuf {
    let p = std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} is not set: scripts/test.sh installs the test clients (tests/python, tests/js) and sets it"
        )
    });
    let p = PathBuf::from(p);
    assert!(p.exists(), "{var}={} does not exist", p.display());
    p
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/e2b_sdk.py")
}

/// `program` (Python or Node) with the SDK's environment pointed at poold's
/// E2B listeners (and nothing of a real E2B account's left in it).
fn sdk_client(program: &PathBuf, api: &str, sbx: &str, key: &str) -> Command {
    let mut c = Command::new(program);
    c.env("E2B_API_URL", api)
        .env("E2B_SANDBOX_URL", sbx)
        .env("E2B_API_KEY", key)
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_ACCESS_TOKEN");
    c
}

/// Runs the SDK test with `py`; panics with its output unless it passed.
fn run_sdk(py: &PathBuf, api: &str, sbx: &str, key: &str, extra: &[&str], want_version: &str) {
    let t0 = Instant::now();
    let out = sdk_client(py, api, sbx, key)
        .arg(script())
        .arg(TEMPLATE)
        .args(extra)
        .output()
        .expect("running the E2B SDK test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "{} in {:.1}s:\n{stdout}",
        py.display(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        out.status.success(),
        "the E2B SDK test failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(&format!("E2B SDK OK {want_version}")),
        "the SDK test did not finish with e2b {want_version}:\n{stdout}\n{stderr}"
    );
}

/// One raw HTTP/1.1 request; the status.
fn raw(addr: &str, head: &str, body: &str) -> u16 {
    raw_answer(addr, head, body).0
}

/// A raw `GET /` naming `host`; the status and the whole answer.
fn raw_with_host(addr: &str, host: &str) -> (u16, String) {
    exchange(
        addr,
        &format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
    )
}

/// One raw HTTP/1.1 request; the status and the body.
fn raw_answer(addr: &str, head: &str, body: &str) -> (u16, String) {
    let (status, resp) = exchange(
        addr,
        &format!(
            "{head}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    );
    let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}

/// Sends `request` as is and reads the answer to its end: its status and
/// the whole answer.
fn exchange(addr: &str, request: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr.trim_start_matches("http://")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {resp:?}"));
    (status, resp)
}

#[test]
fn unmodified_e2b_sdk_against_poold() {
    let new_py = client("FORKD_TEST_PYTHON");
    let old_py = client("FORKD_TEST_PYTHON_E2B_OLDEST");
    let home = Home::new();
    let (p, key) = e2b_poold(&home);
    let (api, sbx) = p.e2b.clone().expect("poold printed its E2B listeners");

    block_on(async {
        p.snapshot(TEMPLATE, "python-numpy", 512).await;
        let (st, v) = p
            .put(
                &format!("/v1/pools/{TEMPLATE}"),
                json!({"min_ready": 1, "max_ready": 2}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let (_, v) = p.get(&format!("/v1/pools/{TEMPLATE}")).await;
            if v["ready"].as_u64().unwrap_or(0) >= 1 {
                break;
            }
            assert!(Instant::now() < deadline, "the pool never filled: {v}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });

    // Keys and tokens: a wrong one gets 401 before anything runs.
    let create = format!("{{\"templateID\":\"{TEMPLATE}\"}}");
    assert_eq!(raw(&api, "POST /v2/sandboxes HTTP/1.1", &create), 401);
    assert_eq!(
        raw(
            &api,
            "POST /v2/sandboxes HTTP/1.1\r\nX-API-KEY: wrong",
            &create
        ),
        401
    );
    assert_eq!(
        raw(
            &sbx,
            "POST /process.Process/List HTTP/1.1\r\nE2b-Sandbox-Id: sb-000000000000000000000000\r\nX-Access-Token: x",
            "{}"
        ),
        502
    );
    assert_eq!(
        raw(
            &sbx,
            "POST /process.Process/List HTTP/1.1\r\nX-Access-Token: guess",
            "{}"
        ),
        401
    );

    let hits0 = block_on(p.metric("forkd_pool_hits_total", ""));
    run_sdk(&new_py, &api, &sbx, &key, &["--code-interpreter"], "2.63.0");
    run_sdk(&old_py, &api, &sbx, &key, &[], "2.7.0");
    run_js_sdk(&api, &sbx, &key);
    let hits = block_on(p.metric("forkd_pool_hits_total", "")) - hits0;
    assert!(
        hits >= 1.0,
        "no E2B create was a pool hit (the pool had a child ready)"
    );

    // Everything the SDK created is gone.
    let (_, v) = block_on(p.get("/v1/sandboxes"));
    assert_eq!(v, json!([]), "sandboxes left behind");
}

/// Runs tests/js/e2b_sdk.cjs with the pinned JavaScript SDKs (scripts/test.sh
/// installs them: `FORKD_TEST_NODE`, `FORKD_TEST_NODE_PATH`); panics with its
/// output unless it passed.
fn run_js_sdk(api: &str, sbx: &str, key: &str) {
    let node = client("FORKD_TEST_NODE");
    let modules = client("FORKD_TEST_NODE_PATH");
    let t0 = Instant::now();
    let out = sdk_client(&node, api, sbx, key)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("js/e2b_sdk.cjs"))
        .arg(TEMPLATE)
        .env("NODE_PATH", modules)
        .output()
        .expect("running node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("E2B JS OK 2.51.0"),
        "the E2B JavaScript SDK test failed ({}) after {:?}:\n{stdout}\n{stderr}",
        out.status,
        t0.elapsed()
    );
}

/// A poold in `home` serving the E2B endpoints, and the API key it takes
/// (in `home`/e2b.key, so a restart with [`e2b_args`] keeps it), shaped
/// like E2B's (`e2b_` and hex), which the JavaScript SDK insists on.
fn e2b_poold(home: &Home) -> (Poold, String) {
    let key = format!("e2b_{}", forkd_snapshot::random_hex(20));
    let key_file = home.dir.join("e2b.key");
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let args = e2b_args(&key_file);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    (Poold::start(&home.dir, &args, None), key)
}

/// The E2B listener flags, with the API key in `key_file`.
fn e2b_args(key_file: &std::path::Path) -> Vec<String> {
    [
        "--e2b-bind",
        "127.0.0.1:0",
        "--e2b-sandbox-bind",
        "127.0.0.1:0",
        "--e2b-api-key-file",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([key_file.display().to_string()])
    .collect()
}

/// What E2B keeps of a sandbox (metadata, create-time envs, template,
/// access token) is the node's durable state, and so is a paused sandbox.
/// The unmodified SDK pauses a sandbox holding Python state and a file,
/// resumes it through the same object and pauses it again; a second
/// sandbox pauses itself at its timeout. poold killed with SIGKILL and
/// started again, a connect resumes the first with its Python state and
/// file, the token the create answered still opens the sandbox plane (a
/// wrong one still does not), `get_info()` and `list` show the same
/// metadata and template, commands still get the envs; the auto-paused one
/// resumes too, and killing them (one paused) leaves no state behind
/// (tests/python/e2b_restart.py).
#[test]
fn e2b_state_survives_kill_9_of_poold() {
    let py = client("FORKD_TEST_PYTHON");
    let home = Home::new();
    let (p, key) = e2b_poold(&home);
    let args = e2b_args(&home.dir.join("e2b.key"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let template = "restart-t";
    let run_id = forkd_snapshot::random_hex(8);

    let (api, _) = p.e2b.clone().expect("poold printed its E2B listeners");
    block_on(p.snapshot(template, "python-numpy", 512));
    let create = json!({
        "templateID": template,
        "timeout": 900,
        "metadata": {"run": run_id},
        "envVars": {"SBX_ENV": "from-create"},
    })
    .to_string();
    let (st, body) = raw_answer(
        &api,
        &format!("POST /sandboxes HTTP/1.1\r\nX-API-KEY: {key}"),
        &create,
    );
    assert_eq!(st, 201, "create: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let token = v["envdAccessToken"].as_str().unwrap().to_string();
    assert_eq!(v["templateID"], template, "{v}");

    let (_, sbx) = p.e2b.clone().expect("poold printed its E2B listeners");
    restart_script(&py, &api, &sbx, &key, "pause", template, &id, &run_id);
    p.kill9();
    let p = Poold::start(&home.dir, &args, None);
    let (api, sbx) = p.e2b.clone().expect("poold printed its E2B listeners");

    // Connect resumes the paused sandbox (201, as E2B answers a resume)...
    let (st, body) = raw_answer(
        &api,
        &format!("POST /sandboxes/{id}/connect HTTP/1.1\r\nX-API-KEY: {key}"),
        r#"{"timeout": 900}"#,
    );
    assert_eq!(st, 201, "connect to the paused sandbox: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["envdAccessToken"],
        token.as_str(),
        "the token after the resume"
    );
    // ...and the token the create answered still opens the sandbox plane.
    let list = |tok: &str| {
        raw(
            &sbx,
            &format!(
                "POST /process.Process/List HTTP/1.1\r\nE2b-Sandbox-Id: {id}\r\nX-Access-Token: {tok}"
            ),
            "{}",
        )
    };
    assert_eq!(list(&token), 200, "the access token after the restart");
    assert_eq!(list("guess"), 401, "a wrong token after the restart");

    restart_script(&py, &api, &sbx, &key, "resume", template, &id, &run_id);
    let (_, v) = block_on(p.get("/v1/sandboxes"));
    assert_eq!(v, json!([]), "the SDK's kill left the sandbox behind");
    // A paused sandbox killed takes its stored states along.
    let (_, v) = block_on(p.get("/v1/workspaces"));
    assert_eq!(v, json!([]), "the kills left paused sandboxes' workspaces");
    let (_, v) = block_on(p.get("/v1/snapshots"));
    let tags: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["tag"].as_str())
        .collect();
    assert_eq!(tags, [template], "the kills left paused states behind");
}

/// Runs one phase of tests/python/e2b_restart.py.
#[allow(clippy::too_many_arguments)]
fn restart_script(
    py: &PathBuf,
    api: &str,
    sbx: &str,
    key: &str,
    phase: &str,
    template: &str,
    id: &str,
    run_id: &str,
) {
    let out = sdk_client(py, api, sbx, key)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/e2b_restart.py"))
        .args([phase, template, id, run_id])
        .output()
        .expect("running the E2B SDK restart test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("E2B RESTART OK"),
        "the E2B SDK restart test ({phase}) failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
}

/// `forkd store stats --json` of data dir `home`.
fn store_stats(home: &std::path::Path) -> serde_json::Value {
    let out = Command::new(forkd_e2e::bin("forkd"))
        .args(["store", "stats", "--json"])
        .env("FORKD_HOME", home)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "forkd store stats: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The `e2b-fork-*` tags among the node's snapshots.
async fn fork_tags(p: &Poold) -> Vec<String> {
    let (st, v) = p.get("/v1/snapshots").await;
    assert_eq!(st, 200, "{v}");
    v.as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["tag"].as_str())
        .filter(|t| t.starts_with("e2b-fork-"))
        .map(str::to_string)
        .collect()
}

/// Forking per request leaves nothing behind (#30): five E2B forks of a
/// live sandbox; each fork's snapshot lives as long as its child, and once
/// the children are killed every `e2b-fork-*` snapshot is deleted and the
/// store's GC gives its space back.
#[test]
fn e2b_fork_snapshots_are_reclaimed_once_their_children_are_gone() {
    let home = Home::new();
    let (p, key) = e2b_poold(&home);
    let (api, _) = p.e2b.clone().expect("poold printed its E2B listeners");
    block_on(p.snapshot("fork-src", "minimal", 128));
    let before = store_stats(&home.dir);

    let call = |head: &str, body: &str| {
        let (st, body) = raw_answer(&api, &format!("{head} HTTP/1.1\r\nX-API-KEY: {key}"), body);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or(json!(body));
        (st, v)
    };
    let (st, v) = call(
        "POST /sandboxes",
        r#"{"templateID":"fork-src","timeout":600}"#,
    );
    assert_eq!(st, 201, "{v}");
    let parent = v["sandboxID"].as_str().unwrap().to_string();
    let mut children = Vec::new();
    for _ in 0..5 {
        let (st, v) = call(
            &format!("POST /sandboxes/{parent}/fork"),
            r#"{"count":1,"timeout":600}"#,
        );
        assert_eq!(st, 201, "{v}");
        let child = v[0]["sandbox"]["sandboxID"].as_str();
        children.push(child.unwrap_or_else(|| panic!("{v}")).to_string());
    }
    block_on(async {
        // Their snapshots stay while their children live (the reclaim loop
        // looks every 2 s).
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(fork_tags(&p).await.len(), 5, "a live child's snapshot went");
    });
    for child in &children {
        let (st, v) = call(&format!("DELETE /sandboxes/{child}"), "");
        assert_eq!(st, 204, "{v}");
    }
    let (st, v) = call(&format!("DELETE /sandboxes/{parent}"), "");
    assert_eq!(st, 204, "{v}");

    block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = fork_tags(&p).await;
            if left.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "fork snapshots left: {left:?}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    // The GC runs a moment after the deletes.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = store_stats(&home.dir);
        let stored = |v: &serde_json::Value| v["stored_bytes"].as_u64().expect("stored_bytes");
        if stored(&now) <= stored(&before) {
            assert_eq!(now["snapshots"], before["snapshots"], "{now} vs {before}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the store did not return to its size before the forks: {now} vs {before}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// E2B volumes (docs/e2b.md, "Volumes"): with `volume_roots` configured,
/// the unmodified SDK (tests/python/e2b_volumes.py) makes a volume,
/// writes, lists, chmods (set-id bits dropped) and removes its files
/// through the content API with no sandbox, mounts it by object and by
/// name into two sandboxes of an `e2b-base` template whose snapshot has a
/// volume at /mnt/vol (commands run as E2B's `user`; each sees the
/// other's writes and the API's), cannot read a
/// guest's symlink to /etc/passwd through the API, is refused a mount
/// where the template has no volume and a volume that does not exist, and
/// destroys it. On the host, the volume's files are gone after.
#[test]
fn e2b_volumes_mount_into_sandboxes_and_serve_their_files() {
    let py = client("FORKD_TEST_PYTHON");
    let home = Home::new();
    let root = home.dir.join("volumes");
    let slot = root.join("slot");
    std::fs::create_dir_all(&slot).unwrap();
    let key = format!("e2b_{}", forkd_snapshot::random_hex(20));
    let key_file = home.dir.join("e2b.key");
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let mut args = e2b_args(&key_file);
    args.extend(["--volume-root".to_string(), root.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = Poold::start(&home.dir, &args, None);
    let (api, sbx) = p.e2b.clone().expect("poold printed its E2B listeners");
    let (st, v) = block_on(p.post(
        "/v1/snapshots",
        json!({"tag": "e2b-vol", "image": "e2b-base", "mem_mib": 512,
               "volumes": [{"host_path": slot, "guest_path": "/mnt/vol"}]}),
    ));
    assert_eq!(st, 201, "{v}");
    let out = sdk_client(&py, &api, &sbx, &key)
        .env("E2B_VOLUME_API_URL", &api)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/e2b_volumes.py"))
        .arg("e2b-vol")
        .output()
        .expect("running tests/python/e2b_volumes.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("E2B VOLUMES OK"),
        "e2b_volumes.py failed:\n{stdout}\n{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(root.join("e2b-volumes"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "a destroyed volume left {left:?}");
    assert_eq!(
        std::fs::read_dir(&slot).unwrap().count(),
        0,
        "the template's own folder was not written"
    );
}

/// E2B's sandboxes run as `user` (home `/home/user`, passwordless sudo):
/// against a snapshot of the `e2b-base` image (which has that account) the
/// unmodified SDK (tests/python/e2b_users.py) runs commands as `user` in
/// its home by default and as root when asked, gets files it writes (and
/// the directories made for them) owned by `user`, sees owners, groups and
/// a symlink's absolute target in `get_info`, and an account the guest
/// lacks is refused, never run as root. A PTY (`sbx.pty`) runs an
/// interactive shell and program, and a resize reaches it. `get_metrics`
/// reports the guest's CPUs, memory and disk, and a busy loop. Then snapshots: `create_snapshot`
/// leaves the sandbox running, `Sandbox.create(snapshot_id)` has the state
/// of that moment, a taken name and a filesystem-only snapshot are
/// refused, `list_snapshots` pages, `delete_snapshot` deletes.
#[test]
fn e2b_users_files_terminals_and_snapshots() {
    let py = client("FORKD_TEST_PYTHON");
    let home = Home::new();
    let (p, key) = e2b_poold(&home);
    let (api, sbx) = p.e2b.clone().expect("poold printed its E2B listeners");
    block_on(p.snapshot("e2b-users", "e2b-base", 512));
    let out = sdk_client(&py, &api, &sbx, &key)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/e2b_users.py"))
        .arg("e2b-users")
        .output()
        .expect("running tests/python/e2b_users.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("E2B USERS OK"),
        "e2b_users.py failed:\n{stdout}\n{stderr}"
    );
    // A sandbox spawned through /v1 is not opened by its URL alone: its
    // ports answer only requests with its token.
    let (st, v) = block_on(p.post(
        "/v1/sandboxes",
        json!({"snapshot_tag": "e2b-users", "n": 1}),
    ));
    assert_eq!(st, 201, "{v}");
    let id = v[0]["id"].as_str().expect("a sandbox id").to_string();
    let plane_port = sbx.rsplit(':').next().expect("IP:PORT");
    let (status, body) = raw_with_host(&sbx, &format!("8000-{id}.localhost:{plane_port}"));
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("not public"), "{body}");
    let (st, v) = block_on(p.delete(&format!("/v1/sandboxes/{id}")));
    assert!(st < 300, "{st} {v}");
    let (_, v) = block_on(p.get("/v1/sandboxes"));
    assert_eq!(v, json!([]), "sandboxes left behind");
}

/// A template of the `code-interpreter` image runs E2B's code interpreter
/// in the guest (Jupyter kernels); poold proxies port 49999 to it through
/// the agent's tunnel, so the unmodified `e2b-code-interpreter` SDK gets
/// what E2B gives: streamed stdout, a matplotlib chart as a PNG result
/// with E2B's chart data, errors, a timeout after which the kernel still
/// runs cells, JavaScript and bash, per-call envs, the sandbox's create-time
/// envs in every context, and contexts; a sandbox killed while a cell runs
/// ends that cell's call in an error.
///
/// Run with the newest pinned SDK and the oldest supported one (2.9.0, the
/// first to honour `E2B_SANDBOX_URL`; tests/python/requirements-e2b-code-interpreter-oldest.txt).
#[test]
fn e2b_code_interpreter_template_runs_jupyter_through_poold() {
    let sdks = [
        (client("FORKD_TEST_PYTHON"), "2.11.5"),
        (client("FORKD_TEST_PYTHON_CI_OLDEST"), "2.9.0"),
    ];
    let home = Home::new();
    let (p, key) = e2b_poold(&home);
    let (api, sbx) = p.e2b.clone().expect("poold printed its E2B listeners");
    block_on(p.snapshot("ci-rich", "code-interpreter", 1024));
    let script = r#"
import importlib.metadata
import sys
from e2b import TimeoutException
from e2b_code_interpreter import Sandbox

print("e2b-code-interpreter", importlib.metadata.version("e2b-code-interpreter"))

sbx = Sandbox.create(template="ci-rich", timeout=300, envs={"SBX_ENV": "from-create"})
try:
    ex = sbx.run_code("import os; print(os.environ.get('SBX_ENV'))")
    assert ex.logs.stdout == ["from-create\n"], ex
    assert sbx.run_code("echo $SBX_ENV", language="bash").logs.stdout == ["from-create\n"]
    seen = []
    ex = sbx.run_code("print('hello'); 6 * 7", on_stdout=lambda m: seen.append(m.line))
    assert ex.text == "42", ex
    assert ex.logs.stdout == ["hello\n"], ex.logs
    assert seen == ["hello\n"], seen
    ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.show()")
    png = [r for r in ex.results if r.png]
    assert png and png[0].chart is not None and png[0].chart.type == "line", ex.results
    ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert ex.results and ex.results[0].html and "<table" in ex.results[0].html, ex.results
    ex = sbx.run_code("1 / 0")
    assert ex.error.name == "ZeroDivisionError", ex.error
    try:
        sbx.run_code("import time; time.sleep(3600)", timeout=3)
        raise AssertionError("no timeout")
    except TimeoutException:
        pass
    assert sbx.run_code("1 + 1", timeout=300).text == "2"
    assert sbx.run_code("console.log('js'); 1 + 2", language="javascript").text == "3"
    assert sbx.run_code("echo $FOO", language="bash", envs={"FOO": "bar"}).logs.stdout == ["bar\n"]
    ctx = sbx.create_code_context(cwd="/tmp")
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    assert sbx.commands.run("whoami").stdout == "user\n"
finally:
    sbx.kill()

# A sandbox killed while a cell runs: the cell's stream is cut, not ended
# (an ended one would read as a finished cell), which the SDK reports as
# its "sandbox was killed" error, and at once, not at the cell's timeout.
import threading
victim = Sandbox.create(template="ci-rich", timeout=300)
assert victim.run_code("1").text == "1"
threading.Timer(3, victim.kill).start()
try:
    ex = victim.run_code("import time; time.sleep(600)", timeout=120)
    raise AssertionError(f"a cell of a killed sandbox answered {ex}")
except TimeoutException as e:
    assert "sandbox was killed" in str(e), f"not the killed-sandbox error: {e!r}"
print("CI OK")
"#;
    for (py, version) in &sdks {
        let out = sdk_client(py, &api, &sbx, &key)
            .args(["-c", script])
            .output()
            .expect("running the code interpreter SDK");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            text.contains(&format!("e2b-code-interpreter {version}\n")),
            "not the pinned SDK {version}: {text}"
        );
        assert!(
            out.status.success() && text.contains("CI OK"),
            "{version}: {text}"
        );
    }
    let (_, v) = block_on(p.get("/v1/sandboxes"));
    assert_eq!(v, json!([]), "sandboxes left behind");
}
