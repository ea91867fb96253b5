//! poold killed at a bad moment, then restarted: what it left half-done is
//! finished or undone, and every sandbox answers.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use forkd_vmm::{Qmp, RunState, VmDir};
use serde_json::json;
use std::time::Duration;

const MINIMAL_MIB: u64 = 128;

/// Sends a request without waiting for the answer; the connection stays
/// open while the returned stream lives.
fn post_in_background(url: &str, path: &str, body: &str) -> std::net::TcpStream {
    use std::io::Write;
    let addr = url.strip_prefix("http://").expect("a TCP poold");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// Whether poold lists a snapshot tagged `tag`.
async fn has_snapshot(p: &Poold, tag: &str) -> bool {
    let (st, v) = p.get("/v1/snapshots").await;
    assert_eq!(st, 200, "{v}");
    v.as_array()
        .expect("a list")
        .iter()
        .any(|s| s["tag"] == tag)
}

async fn exec_echo(p: &Poold, id: &str) -> (u16, serde_json::Value) {
    p.post(
        &format!("/v1/sandboxes/{id}/exec"),
        json!({"args": ["echo", "running"], "timeout_secs": 20}),
    )
    .await
}

/// Names in a directory (empty if it does not exist).
fn entries(d: std::path::PathBuf) -> Vec<String> {
    std::fs::read_dir(d)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A branch stops the source's vCPUs (full mode, or the last round of a
/// live one). poold killed right then left the sandbox stopped for good
/// and re-adopted it as if fine: every later exec timed out. Now the
/// restart resumes it. The first part recreates that state exactly (kill
/// poold, `stop` over QMP); the second kills poold during real branches.
#[test]
fn sandbox_left_stopped_by_a_dead_poold_runs_again() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let id = block_on(async {
        p.snapshot("r", "minimal", MINIMAL_MIB).await;
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "r"})).await;
        assert_eq!(st, 201, "{v}");
        ids(&v).remove(0)
    });
    p.kill9();
    let qmp = VmDir::new(forkd_snapshot::Paths::new(&home.dir).vm_dir(&id)).qmp();
    block_on(async {
        let q = Qmp::connect(&qmp, Duration::from_secs(5)).await.unwrap();
        q.execute("stop", json!({})).await.unwrap();
        assert_eq!(q.query_status().await.unwrap(), RunState::Paused);
    });

    let mut p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let (st, v) = exec_echo(&p, &id).await;
        assert_eq!((st, v["stdout"].as_str()), (200, Some("running\n")), "{v}");
    });

    // poold killed while branches are in flight, at a few different
    // instants: after each restart the source answers and only it runs.
    for (i, wait_ms) in [150u64, 400, 900].into_iter().enumerate() {
        let body = json!({"tag": format!("b{i}"), "mode": "full"}).to_string();
        let _held = post_in_background(&p.url, &format!("/v1/sandboxes/{id}/branch"), &body);
        std::thread::sleep(Duration::from_millis(wait_ms));
        p.kill9();
        p = Poold::start(&home.dir, &[], None);
        block_on(async {
            let (st, v) = exec_echo(&p, &id).await;
            assert_eq!((st, v["stdout"].as_str()), (200, Some("running\n")), "{v}");
        });
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            home.qemu_pids().len(),
            1,
            "only the sandbox runs after the restart (no collector left)"
        );
        let paths = forkd_snapshot::Paths::new(&home.dir);
        assert_eq!(entries(paths.vms_dir()), vec![id.clone()], "VM dirs left");
        assert_eq!(
            entries(paths.staging_dir()),
            Vec::<String>::new(),
            "staging left"
        );
        let done = block_on(has_snapshot(&p, &format!("b{i}")));
        eprintln!(
            "kill after {wait_ms} ms: the branch {}",
            if done { "had finished" } else { "was cut" }
        );
    }
    block_on(async {
        assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
    });
    drop(p);
    std::thread::sleep(Duration::from_millis(500));
    assert!(home.qemu_pids().is_empty(), "QEMU left running");
}

/// poold killed while it takes a snapshot (parent booting, warming up,
/// saving): after the restart no parent QEMU, VM directory or staging file
/// is left, the tag is either absent or complete, and a new create works.
#[test]
fn kill_9_mid_create_leaves_nothing_behind() {
    let home = Home::new();
    let paths = forkd_snapshot::Paths::new(&home.dir);
    let mut p = Poold::start(&home.dir, &[], None);
    for (i, wait_ms) in [500u64, 2500, 6000].into_iter().enumerate() {
        let body = json!({"tag": format!("s{i}"), "image": "minimal", "mem_mib": MINIMAL_MIB});
        let _held = post_in_background(&p.url, "/v1/snapshots", &body.to_string());
        std::thread::sleep(Duration::from_millis(wait_ms));
        p.kill9();
        p = Poold::start(&home.dir, &[], None);
        std::thread::sleep(Duration::from_millis(300));
        assert!(home.qemu_pids().is_empty(), "parent QEMU left running");
        assert_eq!(
            entries(paths.vms_dir()),
            Vec::<String>::new(),
            "VM dirs left"
        );
        assert_eq!(
            entries(paths.staging_dir()),
            Vec::<String>::new(),
            "staging left"
        );
        let done = block_on(has_snapshot(&p, &format!("s{i}")));
        eprintln!(
            "kill after {wait_ms} ms: the snapshot {}",
            if done { "was complete" } else { "was cut" }
        );
    }
    block_on(async {
        p.snapshot("after", "minimal", MINIMAL_MIB).await;
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "after"}))
            .await;
        assert_eq!(st, 201, "{v}");
        let id = ids(&v).remove(0);
        let (st, v) = exec_echo(&p, &id).await;
        assert_eq!((st, v["stdout"].as_str()), (200, Some("running\n")), "{v}");
        assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
    });
    drop(p);
    std::thread::sleep(Duration::from_millis(500));
    assert!(home.qemu_pids().is_empty(), "QEMU left running");
}

/// The TTL reaper destroyed expired sandboxes one after another, so one
/// whose destroy waits (a branch in progress holds its VM until QMP times
/// out, 30 s, when its QEMU is wedged) held up every other expiry. Fails on
/// the previous code: `b` outlived its TTL by the whole wait.
#[test]
fn a_wedged_sandbox_does_not_hold_up_other_expiries() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let spawn = |ttl: u64| {
        let (st, v) = block_on(p.post(
            "/v1/sandboxes",
            json!({"snapshot_tag": "r", "ttl_secs": ttl}),
        ));
        assert_eq!(st, 201, "{v}");
        ids(&v).remove(0)
    };
    block_on(p.snapshot("r", "minimal", MINIMAL_MIB));
    let a = spawn(2);
    let b = spawn(6);
    let spawned = std::time::Instant::now();
    // Wedge a's QEMU, and start a branch of it: the branch holds a's VM
    // while its QMP calls wait.
    let pid = block_on(p.get(&format!("/v1/sandboxes/{a}"))).1["pid"]
        .as_u64()
        .expect("pid") as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let _held = post_in_background(
        &p.url,
        &format!("/v1/sandboxes/{a}/branch"),
        &json!({"tag": "wedged", "mode": "full"}).to_string(),
    );
    // b expires at 6 s; the reaper ticks every second. Well before a's
    // branch gives up (30 s), b must be gone.
    let gone = loop {
        let (st, _) = block_on(p.get(&format!("/v1/sandboxes/{b}")));
        if st == 404 {
            break true;
        }
        if spawned.elapsed() > Duration::from_secs(20) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert!(
        gone,
        "sandbox b outlived its 6 s TTL while a's destroy waited"
    );
    // a goes too, once its branch has failed.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGCONT,
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while block_on(p.get(&format!("/v1/sandboxes/{a}"))).0 != 404 {
        assert!(
            std::time::Instant::now() < deadline,
            "sandbox a never expired"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    drop(p);
    std::thread::sleep(Duration::from_millis(500));
    assert!(home.qemu_pids().is_empty(), "QEMU left running");
}

/// A restart gave each QEMU 5 s to answer before killing it as dead, so a
/// sandbox whose QEMU was stalled for a moment (a loaded host; here a
/// SIGSTOP for 8 s) was destroyed. Fails on the previous code.
#[test]
fn a_qemu_stalled_across_a_restart_is_adopted_not_killed() {
    use nix::sys::signal::{kill, Signal};
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(p.snapshot("r", "minimal", MINIMAL_MIB));
    let (st, v) = block_on(p.post("/v1/sandboxes", json!({"snapshot_tag": "r"})));
    assert_eq!(st, 201, "{v}");
    let id = ids(&v).remove(0);
    let pid = block_on(p.get(&format!("/v1/sandboxes/{id}"))).1["pid"]
        .as_u64()
        .expect("pid") as i32;
    let pid = nix::unistd::Pid::from_raw(pid);
    p.kill9();
    kill(pid, Signal::SIGSTOP).unwrap();
    let waker = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(8));
        kill(pid, Signal::SIGCONT).unwrap();
    });
    let p = Poold::start(&home.dir, &[], None);
    waker.join().unwrap();
    block_on(async {
        let (st, v) = exec_echo(&p, &id).await;
        assert_eq!((st, v["stdout"].as_str()), (200, Some("running\n")), "{v}");
        assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
    });
    drop(p);
    std::thread::sleep(Duration::from_millis(500));
    assert!(home.qemu_pids().is_empty(), "QEMU left running");
}
