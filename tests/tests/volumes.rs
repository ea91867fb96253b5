//! Host folders over virtio-fs (docs/volumes.md), through a real poold:
//! a parent mounts a read-only and a read-write folder while it warms up;
//! its children get them, or their own read-write folders, and a branch
//! keeps its child's.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use serde_json::{json, Value};
use std::path::Path;

const MIB: u64 = 128;

async fn sh(p: &Poold, id: &str, cmd: &str) -> (i64, String, String) {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": ["sh", "-c", cmd], "timeout_secs": 60}),
        )
        .await;
    assert_eq!(st, 200, "exec {cmd}: {v}");
    (
        v["exit_code"].as_i64().unwrap(),
        v["stdout"].as_str().unwrap().to_string(),
        v["stderr"].as_str().unwrap().to_string(),
    )
}

async fn spawn(p: &Poold, tag: &str, volumes: Value) -> String {
    let (st, v) = p
        .post(
            "/v1/sandboxes",
            json!({"snapshot_tag": tag, "n": 1, "volumes": volumes, "pids_max": 512}),
        )
        .await;
    assert_eq!(st, 201, "spawn of {tag} with {volumes}: {v}");
    ids(&v).remove(0)
}

fn vol(host: &Path, guest: &str, ro: bool) -> Value {
    json!({"host_path": host, "guest_path": guest, "read_only": ro})
}

/// virtiofsd processes (each with its sandboxed child) whose VM directory
/// starts with `prefix`.
fn backends_under(prefix: &str) -> Vec<u32> {
    let needle = format!("FORKD_VM_DIR={prefix}");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("environ")).is_ok_and(|env| {
                env.split(|b| *b == 0)
                    .any(|kv| kv.starts_with(needle.as_bytes()))
            })
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// virtiofsd processes serving VMs of this data dir.
fn backends_of(home: &Path) -> usize {
    backends_under(&format!("{}/", home.display())).len()
}

/// A process's cgroup membership, as /proc shows it.
fn cgroup_of(pid: u64) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default()
}

#[test]
fn folders_read_only_read_write_and_per_child() {
    let home = Home::new();
    let root = home.dir.join("vols");
    let (data, shared, a, b, outside) = (
        root.join("data"),
        root.join("shared"),
        root.join("a"),
        root.join("b"),
        home.dir.join("outside"),
    );
    for d in [&data, &shared, &a, &b, &outside] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(data.join("input.txt"), "hello from the host\n").unwrap();
    let root_arg = root.display().to_string();
    let p = Poold::start(&home.dir, &["--volume-root", &root_arg], None);
    block_on(async {
        // Refusals name what to fix, before any VM starts.
        for (vols, why) in [
            (
                json!([vol(&outside, "/data", true)]),
                "outside volume_roots",
            ),
            (
                json!([vol(&root.join("data/../../outside"), "/data", true)]),
                "outside volume_roots",
            ),
            (json!([vol(&data, "/etc", true)]), "system directory"),
            (json!([vol(&data, "data", true)]), "absolute"),
            (
                json!([vol(&root.join("missing"), "/data", true)]),
                "create the directory",
            ),
            (
                json!([vol(&data, "/data", true), vol(&shared, "/data/x", false)]),
                "overlap",
            ),
        ] {
            let (st, v) = p
                .post(
                    "/v1/snapshots",
                    json!({"tag": "bad", "image": "minimal", "mem_mib": MIB, "volumes": vols}),
                )
                .await;
            assert_eq!(st, 400, "{vols}: {v}");
            assert!(v["error"].as_str().unwrap().contains(why), "{vols}: {v}");
        }

        // The parent reads the read-only folder into its own disk and
        // writes the read-write one while it warms up.
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({
                    "tag": "vol", "image": "minimal", "mem_mib": MIB,
                    "volumes": [vol(&data, "/data", true), vol(&shared, "/out", false)],
                    "warmup": "cp /data/input.txt /warm.txt && echo parent > /out/parent.txt",
                }),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(
            std::fs::read_to_string(shared.join("parent.txt")).unwrap(),
            "parent\n"
        );

        // A rebind must name one of the snapshot's guest paths.
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "vol", "volumes": [vol(&a, "/elsewhere", false)]}),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains("/out"), "{v}");

        // Two children, each with its own read-write folder at /out.
        let ca = spawn(&p, "vol", json!([vol(&a, "/out", false)])).await;
        let cb = spawn(&p, "vol", json!([vol(&b, "/out", false)])).await;
        for c in [&ca, &cb] {
            // The warm state (the parent's disk) and the read-only folder.
            assert_eq!(sh(&p, c, "cat /warm.txt").await.1, "hello from the host\n");
            assert_eq!(
                sh(&p, c, "cat /data/input.txt").await.1,
                "hello from the host\n"
            );
        }
        assert_eq!(sh(&p, &ca, "echo A > /out/a.txt").await.0, 0);
        assert_eq!(sh(&p, &cb, "echo B > /out/b.txt").await.0, 0);
        assert_eq!(std::fs::read_to_string(a.join("a.txt")).unwrap(), "A\n");
        assert_eq!(std::fs::read_to_string(b.join("b.txt")).unwrap(), "B\n");
        assert!(!a.join("b.txt").exists() && !b.join("a.txt").exists());
        assert!(!shared.join("a.txt").exists() && !shared.join("b.txt").exists());
        // Each sees only its own folder (not the parent's, not its sibling's).
        assert_eq!(sh(&p, &ca, "ls /out").await.1, "a.txt\n");
        assert_eq!(sh(&p, &cb, "ls /out").await.1, "b.txt\n");

        // A child's virtiofsd (one per folder, each with its sandboxed
        // child) is in the child's cgroup with its QEMU.
        let (_, info) = p.get(&format!("/v1/sandboxes/{ca}")).await;
        let qemu_cg = cgroup_of(info["pid"].as_u64().expect("pid"));
        assert!(qemu_cg.contains(&format!("forkd/{ca}")), "{qemu_cg}");
        let served = backends_under(&format!("{}/run/vms/{ca}", home.dir.display()));
        assert_eq!(served.len(), 4, "two folders, two processes each");
        for pid in served {
            assert_eq!(cgroup_of(pid.into()), qemu_cg, "virtiofsd {pid}");
        }

        // poold killed -9 and restarted: the children and their virtiofsd
        // are adopted again and still serve; none was started or lost.
        let before = backends_of(&home.dir);
        assert!(before > 0);
        p.kill9();
        let p = Poold::start(&home.dir, &["--volume-root", &root_arg], None);
        assert_eq!(sh(&p, &ca, "cat /out/a.txt").await.1, "A\n");
        assert_eq!(sh(&p, &cb, "cat /out/b.txt").await.1, "B\n");
        assert_eq!(backends_of(&home.dir), before);

        // Read-only is refused in the guest, and on the host side even
        // after the guest remounts the folder read-write.
        let (code, _, err) = sh(&p, &ca, "echo x > /data/x").await;
        assert_ne!(code, 0, "a write to a read-only folder succeeded");
        assert!(err.contains("Read-only"), "{err}");
        let (_, out, err) = sh(
            &p,
            &ca,
            "mount -o remount,rw /data && echo remounted; echo y > /data/y; echo rc=$?",
        )
        .await;
        assert!(out.contains("rc=1"), "write after remount: {out}{err}");
        assert!(!data.join("x").exists() && !data.join("y").exists());

        // The host's changes show at once.
        std::fs::write(data.join("later.txt"), "after the snapshot\n").unwrap();
        assert_eq!(
            sh(&p, &cb, "cat /data/later.txt").await.1,
            "after the snapshot\n"
        );

        // A child without a rebind gets the snapshot's folders.
        let cs = spawn(&p, "vol", json!([])).await;
        assert_eq!(sh(&p, &cs, "cat /out/parent.txt").await.1, "parent\n");
        assert_eq!(sh(&p, &cs, "echo S > /out/s.txt").await.0, 0);
        assert_eq!(
            std::fs::read_to_string(shared.join("s.txt")).unwrap(),
            "S\n"
        );

        // A branch of child A records A's folders: its children write there.
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{ca}/branch"),
                json!({"tag": "vol-a", "mode": "live"}),
            )
            .await;
        assert_eq!(st, 201, "branch: {v}");
        let ka = spawn(&p, "vol-a", json!([])).await;
        assert_eq!(sh(&p, &ka, "cat /out/a.txt").await.1, "A\n");
        assert_eq!(sh(&p, &ka, "echo K > /out/k.txt").await.0, 0);
        assert_eq!(std::fs::read_to_string(a.join("k.txt")).unwrap(), "K\n");
        // The branched source still works.
        assert_eq!(sh(&p, &ca, "cat /out/k.txt").await.1, "K\n");

        // Deleting the sandboxes ends their virtiofsd processes.
        assert!(backends_of(&home.dir) > 0);
        for id in [&ca, &cb, &cs, &ka] {
            assert_eq!(p.delete(&format!("/v1/sandboxes/{id}")).await.0, 204);
        }
        for _ in 0..100 {
            if backends_of(&home.dir) == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(backends_of(&home.dir), 0, "virtiofsd left running");
    });
}

/// A poold without `volume_roots` mounts nothing.
#[test]
fn no_volume_roots_no_volumes() {
    let home = Home::new();
    let dir = home.dir.join("d");
    std::fs::create_dir_all(&dir).unwrap();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "v", "image": "minimal", "mem_mib": MIB,
                       "volumes": [vol(&dir, "/data", false)]}),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains("volume_roots"), "{v}");
    });
}
