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

async fn exec_echo(p: &Poold, id: &str) -> (u16, serde_json::Value) {
    p.post(
        &format!("/v1/sandboxes/{id}/exec"),
        json!({"args": ["echo", "running"], "timeout_secs": 20}),
    )
    .await
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
        let entries = |d: std::path::PathBuf| -> Vec<String> {
            std::fs::read_dir(d)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        assert_eq!(entries(paths.vms_dir()), vec![id.clone()], "VM dirs left");
        assert_eq!(
            entries(paths.staging_dir()),
            Vec::<String>::new(),
            "staging left"
        );
        let done = block_on(p.get(&format!("/v1/snapshots/b{i}"))).0 == 200;
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
