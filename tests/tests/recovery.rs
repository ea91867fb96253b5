//! poold killed at a bad moment, then restarted: what it left half-done is
//! finished or undone, and every sandbox answers.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use forkd_vmm::{Qmp, RunState, VmDir};
use serde_json::json;
use std::time::Duration;

const MINIMAL_MIB: u64 = 128;

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
        let _held = p.post_in_background(&format!("/v1/sandboxes/{id}/branch"), &body);
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
        let _held = p.post_in_background("/v1/snapshots", &body.to_string());
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
    let _held = p.post_in_background(
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

/// The forkd-fs mount's status, through its CLI.
fn fs_status(home: &std::path::Path) -> serde_json::Value {
    let out = std::process::Command::new(forkd_e2e::bin("forkd-fs"))
        .args(["status", "--mount"])
        .arg(home.join("mnt"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Waits until the mount reports worker `generation`.
fn wait_generation(home: &std::path::Path, generation: u64) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = std::process::Command::new(forkd_e2e::bin("forkd-fs"))
            .args(["status", "--mount"])
            .arg(home.join("mnt"))
            .output()
            .unwrap();
        if let Ok(st) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            if st["generation"] == generation {
                return st;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no worker {generation} after 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every sandbox writes 32 MiB of fresh guest memory (tmpfs pages it never
/// touched, so their faults read memory.bin through the mount).
async fn touch_new_memory(p: &Poold, ids: &[String]) {
    // The page cache of memory.bin would answer without forkd-fs; pages
    // no VM maps are dropped so the faults reach the mount.
    std::fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    for id in ids {
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{id}/exec"),
                json!({"args": ["sh", "-c", "dd if=/dev/zero of=/dev/shm/t bs=1M count=32 2>/dev/null && md5sum < /dev/shm/t && rm /dev/shm/t"], "timeout_secs": 120}),
            )
            .await;
        assert_eq!(
            (st, v["stdout"].as_str()),
            (200, Some("58f06dd588d8ffb3beb46ada6309436b  -\n")),
            "sandbox {id}: {v}"
        );
    }
}

/// forkd-fs killed (-9) under a running poold: every running sandbox died
/// at its next uncached page fault and every spawn failed with ENOTCONN
/// until poold restarted. Now the mount's holder keeps the connection and
/// starts a new worker, which replays what the dead one had not answered:
/// five running sandboxes keep answering with new memory, a full pool
/// still hands out, spawns work, and `forkd-fs upgrade` swaps the worker
/// the same way. The journal kept the open-file counts right: the
/// snapshot can be deleted once its sandboxes are.
#[test]
fn sandboxes_and_pools_survive_a_forkd_fs_crash_and_an_upgrade() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let running = block_on(async {
        p.snapshot("r", "minimal", 256).await;
        let (st, v) = p.put("/v1/pools/r", json!({"min_ready": 2})).await;
        assert_eq!(st, 200, "{v}");
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "r", "n": 5}))
            .await;
        assert_eq!(st, 201, "{v}");
        p.wait_pool("r", 2).await;
        ids(&v)
    });
    let before = fs_status(&home.dir);
    assert_eq!(before["generation"], 1, "{before}");
    let worker = before["pid"].as_u64().unwrap() as i32;
    assert_ne!(Some(worker as u64), before["holder_pid"].as_u64());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(worker),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    block_on(async {
        touch_new_memory(&p, &running).await;
        // Two pool hits and one restore on demand.
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "r", "n": 3}))
            .await;
        assert_eq!(st, 201, "spawning after the crash: {v}");
        touch_new_memory(&p, &ids(&v)).await;
        for id in ids(&v) {
            assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
        }
    });
    let after = wait_generation(&home.dir, 2);
    assert_eq!(after["holder_pid"], before["holder_pid"], "{after}");

    let out = std::process::Command::new(forkd_e2e::bin("forkd-fs"))
        .args(["upgrade", "--mount"])
        .arg(home.dir.join("mnt"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_generation(&home.dir, 3);
    block_on(async {
        touch_new_memory(&p, &running).await;
        for id in &running {
            assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
        }
        assert_eq!(p.delete("/v1/pools/r").await.0, 204);
        let (st, v) = p.delete("/v1/snapshots/r").await;
        assert_eq!(
            st, 204,
            "the snapshot is in use only if a handle count was lost: {v}"
        );
    });
}

/// A sandbox's and a pooled child's cgroups outlived them when their QEMU
/// died while poold was down: the restart forgot the records but left the
/// groups, and every such restart leaked more (found ~170 empty
/// `forkd/sb-*` groups on the test host). Now forgetting a VM removes them.
#[test]
fn children_dead_while_poold_was_down_leave_no_cgroups() {
    let h = forkd_vmm::Hierarchy::detect().expect("this test needs cgroups");
    let home = Home::new();
    let paths = forkd_snapshot::Paths::new(&home.dir);
    let p = Poold::start(&home.dir, &["--pool", "c=1"], None);
    block_on(async {
        p.snapshot("c", "minimal", MINIMAL_MIB).await;
        p.wait_pool("c", 1).await;
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "c", "pids_max": 64}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        p.wait_pool("c", 1).await;
    });
    // The sandbox, the pooled child that replaced it: both limited (the
    // request's pids_max, poold's default one), so both have groups.
    let vms = entries(paths.vms_dir());
    assert_eq!(vms.len(), 2, "{vms:?}");
    let group = |id: &str| h.group(forkd_vmm::Controller::Pids, id).unwrap();
    for id in &vms {
        assert!(group(id).is_dir(), "{id} has no pids group");
    }
    p.kill9();
    for pid in home.qemu_pids() {
        // SAFETY: kill(2) on a test QEMU's pid.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(home.qemu_pids().is_empty());
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let (_, list) = p.get("/v1/sandboxes").await;
        assert_eq!(ids(&list), Vec::<String>::new(), "a dead sandbox is listed");
    });
    for id in &vms {
        assert!(!group(id).exists(), "the cgroup of dead VM {id} stays");
    }
    drop(p);
}

/// CPU time `pid` used (all its threads), in seconds.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15, the 12th and 13th after the name.
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}

/// A poold restart disconnects every agent's port for a moment; the
/// guest's epoll then reports a hang-up that tokio never clears, so the
/// agent spun on EAGAIN reads forever after (a whole host core per adopted
/// sandbox, measured). Now the agent re-registers the port and idles.
#[test]
fn an_adopted_sandbox_idles_after_poold_restarts() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let id = block_on(async {
        p.snapshot("idle", "minimal", MINIMAL_MIB).await;
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "idle"}))
            .await;
        assert_eq!(st, 201, "{v}");
        ids(&v).remove(0)
    });
    p.kill9();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let (st, v) = exec_echo(&p, &id).await;
        assert_eq!((st, v["stdout"].as_str()), (200, Some("running\n")), "{v}");
    });
    let qemu = home.qemu_pids()[0];
    std::thread::sleep(Duration::from_secs(1));
    let (c0, t0) = (cpu_secs(qemu), std::time::Instant::now());
    std::thread::sleep(Duration::from_secs(4));
    let used = (cpu_secs(qemu) - c0) / t0.elapsed().as_secs_f64();
    // Idle is ~1% of a core under TCG; the spin was ~100%.
    assert!(
        used < 0.3,
        "the adopted sandbox's QEMU uses {used:.2} CPUs idle"
    );
    let (st, _) = block_on(p.delete(&format!("/v1/sandboxes/{id}")));
    assert_eq!(st, 204);
}

/// Waits (up to the 5 s the mount watch has) until `/healthz` reports
/// `count` recoveries; returns the last one.
async fn wait_recovery(p: &Poold, count: u64) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (st, h) = p.get("/healthz").await;
        if h["mount"]["recoveries"] == count {
            assert_eq!((st, &h["ok"]), (200, &json!(true)), "{h}");
            return h["mount"]["last_recovery"].clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no recovery {count} within 5 s: {st} {h}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `/healthz` says poold keeps holder `pid`'s connection.
async fn wait_kept(p: &Poold, pid: i32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, h) = p.get("/healthz").await;
        if h["mount"]["kept_holder"] == pid {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "poold keeps no connection of holder {pid}: {h}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn holder_pid(home: &std::path::Path) -> i32 {
    fs_status(home)["holder_pid"].as_i64().unwrap() as i32
}

/// Aborts the FUSE connection mounted at `mnt` (`/sys/fs/fuse/connections`):
/// the kernel ends it for good, as when a holder dies with nobody keeping
/// its connection. forkd-fs's own abort, which mounts fusectl first where
/// nothing has (a host without systemd, as this test once found).
fn abort_connection(mnt: &std::path::Path) {
    let entry = forkd_fs::mount::mount_at(mnt)
        .unwrap()
        .expect("the mount is in the mount table");
    forkd_fs::mount::abort_connection(&entry).unwrap();
}

/// The holder of the mount killed (-9; an OOM kill, an operator's `pkill
/// forkd-fs`) under a full pool and five running sandboxes. Before, the
/// connection died with it: every VM mapping the mount died at its next
/// uncached page, and poold mounted again and reported them lost. Now
/// poold keeps a duplicate of the connection and of the holder's request
/// arena: a new holder adopts both, replays what the dead one had read and
/// not answered, and nothing is lost: every sandbox answers with new
/// memory, the pool hands out, a spawn works within the watch's 5 s, and
/// `/healthz` and the metrics say what happened.
#[test]
fn a_killed_holder_is_adopted_and_nothing_is_lost() {
    use nix::sys::signal::{kill, Signal};
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let running = block_on(async {
        p.snapshot("r", "minimal", 256).await;
        let (st, v) = p.put("/v1/pools/r", json!({"min_ready": 2})).await;
        assert_eq!(st, 200, "{v}");
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "r", "n": 5}))
            .await;
        assert_eq!(st, 201, "{v}");
        p.wait_pool("r", 2).await;
        ids(&v)
    });
    let holder = holder_pid(&home.dir);
    block_on(wait_kept(&p, holder));
    kill(nix::unistd::Pid::from_raw(holder), Signal::SIGKILL).unwrap();
    block_on(async {
        let r = wait_recovery(&p, 1).await;
        assert_eq!(r["cause"], "holder_died", "{r}");
        assert_eq!(r["lost_sandboxes"], 0, "{r}");
        assert_eq!(r["discarded_pooled"], 0, "{r}");
        // Two pool hits (pooled before the kill) and one restore.
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "r", "n": 3}))
            .await;
        assert_eq!(st, 201, "spawning after the holder died: {v}");
        let (_, list) = p.get("/v1/sandboxes").await;
        assert_eq!(ids(&list).len(), 8, "{list}");
        touch_new_memory(&p, &running).await;
        touch_new_memory(&p, &ids(&v)).await;
        assert_eq!(p.metric("forkd_sandboxes_lost_total", "").await, 0.0);
        assert_eq!(
            p.metric("forkd_mount_recoveries_total", r#"cause="holder_died""#)
                .await,
            1.0
        );
    });
    let new_holder = holder_pid(&home.dir);
    assert_ne!(new_holder, holder, "a new holder serves the mount");
    // It is kept in turn: a second kill is adopted too.
    block_on(wait_kept(&p, new_holder));
    kill(nix::unistd::Pid::from_raw(new_holder), Signal::SIGKILL).unwrap();
    block_on(async {
        let r = wait_recovery(&p, 2).await;
        assert_eq!(r["cause"], "holder_died", "{r}");
        touch_new_memory(&p, &running).await;
    });
}

/// The mount dies under a running poold. Before, poold mounted only at
/// start: `umount -l` made every restore fail until poold was restarted by
/// hand, and a killed holder took every spawn and refill down with
/// ENOTCONN. Now the mount watch notices within seconds and mounts again:
/// - `umount -l`: the detached mount keeps serving its VMs, so nothing is
///   lost; spawns (pool hits and restores on the new mount) work;
/// - the new mount's connection aborted (its holder alive, but the kernel
///   ended it: nothing can adopt it): the VMs that mapped it (the one
///   sandbox restored on it; the children pooled on it) cannot live on,
///   so they are destroyed and reported lost, and the rest, still on the
///   detached mount, answer with new memory; a spawn works again.
#[test]
fn poold_mounts_again_after_an_unmount_or_a_dead_connection() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let first = block_on(async {
        p.snapshot("r", "minimal", 256).await;
        let (st, v) = p.put("/v1/pools/r", json!({"min_ready": 2})).await;
        assert_eq!(st, 200, "{v}");
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "r", "n": 3}))
            .await;
        assert_eq!(st, 201, "{v}");
        p.wait_pool("r", 2).await;
        let (st, h) = p.get("/healthz").await;
        assert_eq!((st, &h["mount"]["recoveries"]), (200, &json!(0)), "{h}");
        ids(&v)
    });
    let old_holder = holder_pid(&home.dir);

    nix::mount::umount2(&home.dir.join("mnt"), nix::mount::MntFlags::MNT_DETACH).unwrap();
    let second = block_on(async {
        let r = wait_recovery(&p, 1).await;
        assert_eq!(r["cause"], "unmounted", "{r}");
        assert_eq!(r["lost_sandboxes"], 0, "{r}");
        // Two pool hits (pooled on the detached mount), one restore on the
        // new one.
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "r", "n": 3}))
            .await;
        assert_eq!(st, 201, "spawning after the unmount: {v}");
        let all: Vec<String> = first.iter().cloned().chain(ids(&v)).collect();
        touch_new_memory(&p, &all).await;
        p.wait_pool("r", 2).await;
        ids(&v)
    });
    let new_holder = holder_pid(&home.dir);
    assert_ne!(new_holder, old_holder, "a new mount serves the path");
    assert!(
        std::path::Path::new(&format!("/proc/{old_holder}")).exists(),
        "the detached mount's holder still serves its VMs"
    );

    abort_connection(&home.dir.join("mnt"));
    block_on(async {
        let r = wait_recovery(&p, 2).await;
        assert_eq!(r["cause"], "dead", "{r}");
        assert_eq!(r["lost_sandboxes"], 1, "the one restored on it: {r}");
        assert_eq!(r["discarded_pooled"], 2, "the two pooled on it: {r}");
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "r"})).await;
        assert_eq!(st, 201, "spawning after the holder died: {v}");
        let (_, list) = p.get("/v1/sandboxes").await;
        let listed = ids(&list);
        let survivors: Vec<String> = first
            .iter()
            .chain(&second)
            .filter(|id| listed.contains(id))
            .cloned()
            .collect();
        assert_eq!(survivors.len(), 5, "one of six lost: {list}");
        touch_new_memory(&p, &survivors).await;
        touch_new_memory(&p, &ids(&v)).await;
        assert_eq!(p.metric("forkd_sandboxes_lost_total", "").await, 1.0);
        assert_eq!(
            p.metric("forkd_mount_recoveries_total", r#"cause="dead""#)
                .await,
            1.0
        );
        p.wait_pool("r", 2).await;
    });
}
