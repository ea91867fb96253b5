//! Admission and bounded buffering: a host short of memory or disk refuses
//! new work with a clear 503 and keeps running work; many clients moving
//! big files cannot make poold hold more than a few bodies at once.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use serde_json::json;
use std::path::Path;
use std::time::Duration;

const MINIMAL_MIB: u64 = 128;

/// A poold config file in `home` with `body`; returns its path.
fn config(home: &Path, body: &str) -> String {
    let p = home.join("poold-test.toml");
    std::fs::write(&p, body).unwrap();
    p.to_string_lossy().into_owned()
}

/// A field of /proc/PID/status in KiB (e.g. `VmHWM`, the peak RSS).
fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// With the host under its memory floor, spawns, snapshot creates,
/// branches and pool refills get 503 naming the knob, while a sandbox
/// started before keeps answering. The disk floor refuses the same way.
#[test]
fn low_memory_refuses_new_work_and_keeps_running_work() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let id = block_on(async {
        p.snapshot("r", "minimal", MINIMAL_MIB).await;
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "r"})).await;
        assert_eq!(st, 201, "{v}");
        ids(&v).remove(0)
    });
    p.kill9();

    // A floor no host meets: everything new is refused.
    let huge = 1u64 << 40;
    let cfg = config(
        &home.dir,
        &format!("min_free_memory_mib = {huge}\n[pools.r]\nmin_ready = 1\n"),
    );
    let p = Poold::start(&home.dir, &["--config", &cfg], None);
    block_on(async {
        let refused = |(st, v): (u16, serde_json::Value), what: &str| {
            assert_eq!(st, 503, "{what}: {v}");
            let msg = v["error"].as_str().unwrap_or_default().to_string();
            assert!(
                msg.contains("min_free_memory_mib") && msg.contains("memory available"),
                "{what}: {msg}"
            );
        };
        refused(
            p.post("/v1/sandboxes", json!({"snapshot_tag": "r"})).await,
            "spawn",
        );
        refused(
            p.post(
                "/v1/snapshots",
                json!({"tag": "s2", "image": "minimal", "mem_mib": MINIMAL_MIB}),
            )
            .await,
            "snapshot create",
        );
        refused(
            p.post(&format!("/v1/sandboxes/{id}/branch"), json!({"tag": "b"}))
                .await,
            "branch",
        );
        // Running work is untouched.
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{id}/exec"),
                json!({"args": ["echo", "alive"], "timeout_secs": 30}),
            )
            .await;
        assert_eq!((st, v["stdout"].as_str()), (200, Some("alive\n")), "{v}");
        // The pool asked for one child and gets none.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let (_, pool) = p.get("/v1/pools/r").await;
        assert_eq!(pool["ready"], 0, "a refill ran under the floor: {pool}");
    });
    assert_eq!(home.qemu_pids().len(), 1, "only the running sandbox");
    p.kill9();

    // The disk floor refuses the same way, naming its own knob.
    let cfg = config(&home.dir, &format!("min_free_disk_mib = {huge}\n"));
    let p = Poold::start(&home.dir, &["--config", &cfg], None);
    block_on(async {
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "r"})).await;
        assert_eq!(st, 503, "{v}");
        assert!(
            v["error"].as_str().unwrap().contains("min_free_disk_mib"),
            "{v}"
        );
        assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
    });
}

/// Many clients uploading and downloading 8 MiB files at once: poold
/// buffered every body in full (its peak RSS grew with the number of
/// clients). Now at most `transfer_concurrency` transfers hold a body; the
/// rest wait for a slot, and every transfer still completes intact.
#[test]
fn concurrent_file_transfers_are_bounded_in_memory() {
    const CLIENTS: usize = 16;
    const SIZE: usize = 8 << 20;
    let home = Home::new();
    let cfg = config(&home.dir, "transfer_concurrency = 2\n");
    let p = Poold::start(&home.dir, &["--config", &cfg], None);
    let pid = p.child.id();
    block_on(async {
        // /tmp is a tmpfs of half the guest's memory: room for every file.
        p.snapshot("r", "minimal", 512).await;
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "r"})).await;
        assert_eq!(st, 201, "{v}");
        let id = ids(&v).remove(0);
        let base_kib = status_kib(pid, "VmHWM");

        let paths: Vec<String> = (0..CLIENTS)
            .map(|i| format!("/v1/sandboxes/{id}/files?path=/tmp/f{i}"))
            .collect();
        let uploads = paths.iter().enumerate().map(|(i, path)| {
            p.client
                .send_bytes(forkd_api::Method::PUT, path, vec![i as u8; SIZE])
        });
        for (i, r) in futures::future::join_all(uploads)
            .await
            .into_iter()
            .enumerate()
        {
            let (st, body) = r.unwrap();
            assert_eq!(
                st.as_u16(),
                200,
                "upload {i}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        let downloads = paths
            .iter()
            .map(|path| p.client.send(forkd_api::Method::GET, path, None));
        for (i, r) in futures::future::join_all(downloads)
            .await
            .into_iter()
            .enumerate()
        {
            let (st, body) = r.unwrap();
            assert_eq!(st.as_u16(), 200, "download {i}");
            assert!(
                body.len() == SIZE && body.iter().all(|b| *b == i as u8),
                "download {i}: {} bytes, not what was uploaded",
                body.len()
            );
        }
        let grew_mib = status_kib(pid, "VmHWM").saturating_sub(base_kib) / 1024;
        eprintln!("poold's peak RSS grew {grew_mib} MiB over {CLIENTS} x 8 MiB transfers each way");
        // Unbounded, every body is held at once: CLIENTS x 8 MiB = 128 MiB
        // at the least. Two slots hold a few copies of two bodies.
        assert!(
            grew_mib < 100,
            "poold's peak RSS grew {grew_mib} MiB: transfers are not bounded"
        );
        assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
    });
}

/// Every branch freezes a sandbox's disk overlay and stacks a new one on
/// it: branched ten times, its disk read through eleven qcow2 files (and
/// past 64 it could not be branched at all). Now the chain is flattened
/// past `MAX_DISK_LAYERS`, and what the guest wrote before, between and
/// after the branches reads back, in it and in a child of the last branch.
#[test]
fn a_sandbox_branched_many_times_keeps_a_short_disk_chain() {
    use forkd_snapshot::branch::MAX_DISK_LAYERS;
    const BRANCHES: usize = MAX_DISK_LAYERS + 2;
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let vm_dir = |id: &str| forkd_snapshot::Paths::new(&home.dir).vm_dir(id);
    let layers = |id: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(vm_dir(id))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".qcow2"))
            .collect();
        v.sort();
        v
    };
    let sh = |id: String, cmd: String| {
        let p = &p;
        async move {
            let (st, v) = p
                .post(
                    &format!("/v1/sandboxes/{id}/exec"),
                    json!({"args": ["sh", "-c", cmd], "timeout_secs": 60}),
                )
                .await;
            assert_eq!((st, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
            v["stdout"].as_str().unwrap().to_string()
        }
    };
    block_on(async {
        p.snapshot("r", "minimal", MINIMAL_MIB).await;
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "r"})).await;
        assert_eq!(st, 201, "{v}");
        let id = ids(&v).remove(0);
        let mut most = 0;
        for i in 0..BRANCHES {
            sh(
                id.clone(),
                format!("mkdir -p /var/t && echo {i} > /var/t/{i} && sync"),
            )
            .await;
            let (st, v) = p
                .post(
                    &format!("/v1/sandboxes/{id}/branch"),
                    json!({"tag": format!("b{i}"), "mode": "full"}),
                )
                .await;
            assert_eq!(st, 201, "branch {i}: {v}");
            let now = layers(&id);
            most = most.max(now.len());
            assert!(
                now.len() <= MAX_DISK_LAYERS,
                "after branch {i} the disk is {} layers: {now:?}",
                now.len()
            );
        }
        assert!(
            most > 2,
            "the chain never grew: is every branch adding a layer?"
        );
        let want: String = (0..BRANCHES).map(|i| format!("{i}\n")).collect();
        let cat = format!("for i in $(seq 0 {}); do cat /var/t/$i; done", BRANCHES - 1);
        assert_eq!(sh(id.clone(), cat.clone()).await, want, "in the sandbox");
        sh(id.clone(), "echo after > /var/t/after && sync".into()).await;
        assert_eq!(sh(id.clone(), "cat /var/t/after".into()).await, "after\n");

        let last = format!("b{}", BRANCHES - 1);
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": last})).await;
        assert_eq!(st, 201, "{v}");
        let child = ids(&v).remove(0);
        assert_eq!(sh(child.clone(), cat).await, want, "in a child of {last}");
        for s in [id, child] {
            assert_eq!(p.delete(&format!("/v1/sandboxes/{s}")).await.0, 204);
        }
    });
}

/// The processes whose parent is this one and that are zombies.
fn my_zombies() -> Vec<String> {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|s| {
            let rest = s.rsplit_once(") ").map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            f.first() == Some(&"Z") && f.get(1) == Some(&me.as_str())
        })
        .collect()
}

/// A QEMU that exits during start-up (here: it cannot have 200 TiB of
/// RAM) is reaped, not left a zombie, and its VM directory is removed.
#[test]
fn a_qemu_that_fails_to_start_leaves_no_zombie() {
    use forkd_vmm::{Boot, DiskBase, Lifetime, Memory, StartSpec, Vm, VmDir};
    let img = forkd_e2e::image("minimal");
    let dir = VmDir::new(forkd_e2e::paths().vm_dir("test-nokernel"));
    let spec = StartSpec {
        id: "test-nokernel".into(),
        machine: forkd_e2e::machine(200 << 20),
        memory: Memory::Anonymous,
        boot: Boot::Incoming,
        disk: DiskBase::Image(img.rootfs()),
        lifetime: Lifetime::Ephemeral,
        nic: None,
        volumes: Vec::new(),
    };
    let err = block_on(Vm::start(dir.clone(), spec, async |_: &mut Vm| Ok(())))
        .err()
        .expect("a QEMU with 200 TiB of RAM cannot start");
    eprintln!("start failed as it should: {err:#}");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(my_zombies(), Vec::<String>::new(), "zombie QEMU left");
    assert!(!dir.path.exists(), "VM directory left");
}
