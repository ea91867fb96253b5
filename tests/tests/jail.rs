//! The VM jail and quotas, on real guests through a real poold: every QEMU
//! (pool children, sandboxes, the branch collector) runs unprivileged under
//! seccomp in a root of its own; other local users cannot read a snapshot's
//! memory or a child's disk; a guest fork bomb and a busy loop on 2 vCPUs
//! under a CPU quota leave poold and a sibling answering.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};

fn status_field(pid: u32, field: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

/// Asserts everything the jail promises about one QEMU process.
fn assert_jailed(pid: u32) {
    let uids = status_field(pid, "Uid");
    assert!(
        uids.split_whitespace().all(|u| u != "0"),
        "QEMU {pid} runs as root: Uid {uids}"
    );
    assert_eq!(
        status_field(pid, "Seccomp"),
        "2",
        "QEMU {pid} has no seccomp filter"
    );
    assert_eq!(status_field(pid, "NoNewPrivs"), "1", "QEMU {pid}");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(
            status_field(pid, cap),
            "0000000000000000",
            "QEMU {pid} keeps {cap}"
        );
    }
    // Its root is a tmpfs of its own, not the host's /.
    let root = Path::new("/proc").join(pid.to_string()).join("root");
    assert!(
        !root.join("etc/passwd").exists() && !root.join("proc/self").exists(),
        "QEMU {pid} sees the host's root"
    );
    assert!(root.join("usr/bin").is_dir(), "QEMU {pid} has no /usr");
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/mnt")).unwrap();
    assert_ne!(
        ns(&pid.to_string()),
        ns("self"),
        "QEMU {pid} shares our mount namespace"
    );
}

/// Runs `cat path` as `nobody`; true when it could read it.
fn nobody_reads(path: &Path) -> bool {
    reads_as(65534, path)
}

/// Runs `cat path` as uid 65534 with primary group `gid` and no other.
fn reads_as(gid: u32, path: &Path) -> bool {
    std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            &format!("--regid={gid}"),
            "--clear-groups",
            "cat",
        ])
        .arg(path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("setpriv (util-linux)")
        .success()
}

#[test]
fn every_qemu_is_jailed_and_private() {
    let home = Home::new();
    // An fd poold inherits from whoever started it (here, this test: a
    // file opened without O_CLOEXEC) must never reach a QEMU.
    let marker = home.dir.join("inherited-by-poold");
    std::fs::write(&marker, b"").unwrap();
    let inherited = std::fs::File::open(&marker).unwrap();
    nix::fcntl::fcntl(
        std::os::fd::AsRawFd::as_raw_fd(&inherited),
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    )
    .unwrap();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        p.snapshot("jb", "minimal", 128).await;
        let (st, _) = p.put("/v1/pools/jb", json!({"min_ready": 1})).await;
        assert_eq!(st, 200);
        p.wait_pool("jb", 1).await;
        let (st, made) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "jb", "n": 2}))
            .await;
        assert_eq!(st, 201, "{made}");
        let sb = ids(&made);
        p.wait_pool("jb", 1).await;
        let pids = home.qemu_pids();
        assert!(pids.len() >= 3, "pool child and two sandboxes: {pids:?}");
        for pid in &pids {
            assert_jailed(*pid);
            for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
                let target = std::fs::read_link(fd.unwrap().path()).unwrap_or_default();
                assert_ne!(target, marker, "QEMU {pid} holds an fd poold inherited");
            }
        }
        // No two VMs share a uid.
        let mut uids: Vec<String> = pids.iter().map(|p| status_field(*p, "Uid")).collect();
        uids.sort();
        uids.dedup();
        assert_eq!(uids.len(), pids.len(), "VMs share a uid: {uids:?}");

        // A jailed child still branches (the collector is jailed too, and
        // gets the migration by descriptor) and its branch spawns.
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{}/branch", sb[0]),
                json!({"tag": "jb2"}),
            )
            .await;
        assert!(st == 200 || st == 201, "{st}: {v}");
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "jb2"}))
            .await;
        assert_eq!(st, 201, "{v}");
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{}/exec", ids(&v)[0]),
                json!({"args": ["true"]}),
            )
            .await;
        assert_eq!(st, 200, "{v}");

        // Other local users read nothing of a snapshot or a child.
        let memory = home.dir.join("mnt/jb/memory.bin");
        assert!(memory.exists());
        assert!(!nobody_reads(&memory), "nobody read {}", memory.display());
        let disk = home.dir.join("run/vms").join(&sb[1]).join("disk.qcow2");
        assert!(disk.exists());
        assert!(!nobody_reads(&disk), "nobody read {}", disk.display());
        // The check itself can succeed: nobody reads a world-readable file.
        assert!(nobody_reads(Path::new("/etc/hostname")));

        // Even with every directory on the way opened for traversal, the
        // files' own modes keep nobody out: poold creates them private.
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let vm = home.dir.join("run/vms").join(&sb[1]);
        for d in [
            home.dir.clone(),
            home.dir.join("poold"),
            home.dir.join("run"),
            home.dir.join("run/vms"),
            vm.clone(),
        ] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711)).unwrap();
        }
        for f in [
            home.dir.join("poold/state.json"),
            home.dir.join("poold/audit.jsonl"),
            home.dir.join("poold/poold.lock"),
            vm.join("vm.json"),
            vm.join("qemu.log"),
            vm.join("console.log"),
            vm.join("disk.qcow2"),
        ] {
            let m = std::fs::metadata(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            assert_eq!(
                m.mode() & 0o077,
                0,
                "{} is mode {:o}",
                f.display(),
                m.mode() & 0o7777
            );
            assert!(!nobody_reads(&f), "nobody read {}", f.display());
        }
        // The snapshot on forkd-fs: root's and the jail group's only. A
        // process of the jail group (as a jailed QEMU is) reads it.
        let jail_gid = forkd_vmm::JailConfig::get().unwrap().gid;
        let m = std::fs::metadata(&memory).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (0, jail_gid, 0o440));
        let by_id = std::fs::canonicalize(&memory).unwrap();
        std::fs::set_permissions(&home.dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        assert!(!nobody_reads(&by_id), "nobody read {}", by_id.display());
        assert!(
            reads_as(jail_gid, &by_id),
            "the jail group cannot read {}",
            by_id.display()
        );
    });
}

/// Times `GET /healthz`, which must answer while the guest is hostile.
async fn healthz_ms(p: &Poold) -> u128 {
    let t = Instant::now();
    let (st, _) = p.get("/healthz").await;
    assert_eq!(st, 200);
    t.elapsed().as_millis()
}

/// Asserts that sandbox `id` runs `echo alive`; on failure the panic
/// carries what tells a starved guest from a lost reply: poold's log, the
/// guest's console, each QEMU's CPU time and CFS throttling, the host load.
async fn sibling_alive(p: &mut Poold, id: &str, all: &[String], when: &str) {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": ["echo", "alive"], "timeout_secs": 30}),
        )
        .await;
    if st == 200 && v["stdout"] == "alive\n" {
        return;
    }
    let mut why = format!("{id} {when}: {st} {v}\n");
    let (_, console) = p.get(&format!("/v1/sandboxes/{id}/logs")).await;
    let console = console.as_str().unwrap_or_default().to_string();
    let tail: Vec<&str> = console.lines().rev().take(30).collect();
    why += &format!("console tail (newest first):\n{}\n", tail.join("\n"));
    let h = forkd_vmm::Hierarchy::detect().unwrap();
    for sb in all {
        let (_, info) = p.get(&format!("/v1/sandboxes/{sb}")).await;
        let pid = info["pid"].as_u64().unwrap_or(0);
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let cpu = h
            .group(forkd_vmm::Controller::Cpu, sb)
            .and_then(|g| std::fs::read_to_string(g.join("cpu.stat")).ok())
            .unwrap_or_default();
        why += &format!("{sb} pid {pid} stat [{stat}] cpu.stat [{cpu}]\n");
    }
    why += &format!(
        "loadavg {}poold log:\n{}",
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default(),
        p.stderr_now()
    );
    panic!("{why}");
}

#[test]
fn fork_bomb_and_busy_loop_leave_poold_and_a_sibling_answering() {
    let home = Home::new();
    let mut p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "busy", "image": "minimal", "mem_mib": 192, "vcpus": 2}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        // Limits are visible and enforced: a quota of half a core each.
        let (st, made) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "busy", "n": 2, "cpus": 0.5, "pids_max": 128, "memory_limit_mib": 512}),
            )
            .await;
        assert_eq!(st, 201, "{made}");
        let sb = ids(&made);
        let (_, info) = p.get(&format!("/v1/sandboxes/{}", sb[0])).await;
        assert_eq!(info["cpus"], json!(0.5), "{info}");
        assert_eq!(info["pids_max"], json!(128), "{info}");
        assert_eq!(info["memory_limit_mib"], json!(512), "{info}");
        let limits = forkd_vmm::Hierarchy::detect().unwrap().read_limits(&sb[0]);
        assert_eq!(limits.cpus, Some(0.5));
        assert_eq!(limits.pids_max, Some(128));
        for bad in [
            json!({"cpus": 0}),
            json!({"pids_max": 3}),
            json!({"cpus": -1.0}),
        ] {
            let mut body = bad.clone();
            body["snapshot_tag"] = json!("busy");
            let (st, v) = p.post("/v1/sandboxes", body).await;
            assert_eq!(st, 400, "{bad}: {v}");
        }

        // The hostile one: a busy loop on each vCPU, then a fork bomb (a
        // second later, so this exec's own reply gets out first).
        let hostile = &sb[0];
        let sibling = &sb[1];
        // Both answer before the hostile one turns: a sibling that fails
        // later failed because of its neighbour, not its spawn.
        for id in [hostile, sibling] {
            sibling_alive(&mut p, id, &sb, "before the hostile exec").await;
        }
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{hostile}/exec"),
                json!({"args": ["sh", "-c", "for i in 1 2; do (while :; do :; done) & done; b() { b | b & }; (sleep 1; b) >/dev/null 2>&1 & exit 0"]}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut worst = 0;
        for _ in 0..10 {
            worst = worst.max(healthz_ms(&p).await);
            sibling_alive(&mut p, sibling, &sb, "beside the hostile one").await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(
            worst < 1000,
            "/healthz took {worst} ms under a hostile guest"
        );
        // The quota holds: the hostile VM used at most about half a core.
        let pid = info["pid"].as_u64().unwrap();
        let ticks = || {
            let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let f: Vec<u64> = s
                .rsplit(')')
                .next()
                .unwrap()
                .split_whitespace()
                .skip(11)
                .take(2)
                .map(|x| x.parse().unwrap())
                .collect();
            f[0] + f[1]
        };
        let (c0, t0) = (ticks(), Instant::now());
        tokio::time::sleep(Duration::from_secs(3)).await;
        let hz = 100.0; // USER_HZ
        let cpus = (ticks() - c0) as f64 / hz / t0.elapsed().as_secs_f64();
        assert!(
            cpus < 0.75,
            "hostile VM used {cpus:.2} CPUs under a 0.5 quota"
        );
        let (st, _) = p.delete(&format!("/v1/sandboxes/{hostile}")).await;
        assert_eq!(st, 204);
        assert!(
            forkd_vmm::Hierarchy::detect()
                .unwrap()
                .read_limits(hostile)
                .cpus
                .is_none(),
            "the cgroup of a deleted sandbox stays"
        );
    });
}
