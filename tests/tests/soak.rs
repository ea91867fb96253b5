//! Soak and chaos: spawns, execs, branches, deletes (of sandboxes and
//! snapshots) and hub round trips (push a branch snapshot to a `file://`
//! hub, delete it, pull it back while poold runs, spawn from it) in a loop
//! against a real poold, while poold, the forkd-fs worker, the forkd-fs
//! holder and single QEMUs are killed with SIGKILL, some of them in the
//! middle of a request. After every fault, and every 20 operations, the
//! invariants are checked:
//!
//! - after a holder kill, the mount serves again within 30 s without a
//!   restart (`/healthz` counts the recovery): a new holder adopted the
//!   connection poold kept and nothing was lost, or (a holder poold did
//!   not keep yet) poold mounted again and the sandboxes that mapped the
//!   dead connection are reported lost and leave the list;
//! - every sandbox poold lists answers an exec;
//! - the pool is refilled to its size;
//! - the QEMUs of the data dir are exactly the listed sandboxes and the
//!   pooled children, with one VM directory each, within [`SETTLE`] (a
//!   sandbox leaves the list before its teardown ends: a teardown in
//!   flight is not a leak, one that never ends is); no staging file is left;
//! - exactly one forkd-fs mount, answering;
//! - while poold is down after a kill, `forkd store verify` passes;
//! - at the end, with every branch snapshot deleted, the store is back to
//!   its size after the first snapshot (plus RocksDB's own slack).
//!
//! `FORKD_SOAK_MINUTES` (default 3: the CI run) sets the length,
//! `FORKD_SOAK_SEED` the random sequence. It prints a summary: operations,
//! faults, recoveries, p50/p99 per operation. Run it longer with
//! `FORKD_SOAK_MINUTES=30 scripts/test.sh -- -p forkd-e2e --test soak --nocapture`.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{Home, Poold};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

const POOL: u64 = 2;
const MAX_LIVE: usize = 5;
const MAX_BRANCHES: usize = 3;
/// How long a teardown in flight may take before its leftovers count as
/// leaked (killing a VM and removing its network and directory takes well
/// under a second; a loaded CI machine gets slack).
const SETTLE: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Tally {
    /// Latencies per operation, ms.
    ops: BTreeMap<&'static str, Vec<f64>>,
    faults: BTreeMap<&'static str, u32>,
    recoveries: u32,
    /// Requests that failed while a fault was being injected (expected).
    cut: u32,
    /// Sandboxes reported lost by a mount recovery (a holder kill).
    lost: usize,
    /// Holder kills survived by adopting the kept connection.
    adopted: u32,
    violations: Vec<String>,
}

impl Tally {
    fn time(&mut self, op: &'static str, t0: Instant) {
        self.ops
            .entry(op)
            .or_default()
            .push(t0.elapsed().as_secs_f64() * 1e3);
    }
    fn violation(&mut self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violations.push(what);
    }
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() - 1) as f64 * p).round() as usize]
}

fn entries(d: &Path) -> Vec<String> {
    std::fs::read_dir(d)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn forkd_fs(home: &Path, args: &[&str]) -> Result<serde_json::Value, String> {
    let out = std::process::Command::new(forkd_e2e::bin("forkd-fs"))
        .args(args)
        .arg("--mount")
        .arg(home.join("mnt"))
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout).unwrap_or_default())
}

struct Soak {
    /// Before `home`: fields drop in order, and a poold still running when
    /// its data dir is removed writes `poold/` back into it (left behind).
    p: Option<Poold>,
    home: Home,
    rng: StdRng,
    t: Tally,
    branches: Vec<String>,
    next_branch: u32,
}

impl Soak {
    fn p(&self) -> &Poold {
        self.p.as_ref().expect("poold runs")
    }

    fn sandboxes(&self) -> Vec<String> {
        let (st, v) = block_on(self.p().get("/v1/sandboxes"));
        assert_eq!(st, 200, "{v}");
        v.as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s["id"].as_str().map(String::from))
            .collect()
    }

    fn pick(&mut self, from: &[String]) -> Option<String> {
        (!from.is_empty()).then(|| from[self.rng.gen_range(0..from.len())].clone())
    }

    /// One random operation.
    fn step(&mut self) {
        let live = self.sandboxes();
        let roll = self.rng.gen_range(0..100);
        let t0 = Instant::now();
        if live.len() < 2 || (roll < 25 && live.len() < MAX_LIVE) {
            let n = self.rng.gen_range(1..=2);
            let (st, v) = block_on(
                self.p()
                    .post("/v1/sandboxes", json!({"snapshot_tag": "base", "n": n})),
            );
            if st != 201 {
                return self.t.violation(format!("spawn n={n}: {st} {v}"));
            }
            self.t.time("spawn", t0);
        } else if roll < 60 {
            let id = self.pick(&live).unwrap();
            match self.exec(&id) {
                Ok(()) => self.t.time("exec", t0),
                Err(e) => self.t.violation(e),
            }
        } else if roll < 70 && !self.branches.is_empty() && self.rng.gen_bool(0.5) {
            let tag = self.branches[self.rng.gen_range(0..self.branches.len())].clone();
            match self.round_trip(&tag) {
                Ok(()) => self.t.time("hub push, delete, pull, spawn", t0),
                Err(e) => self.t.violation(e),
            }
        } else if roll < 75 {
            let id = self.pick(&live).unwrap();
            let tag = format!("s{}", self.next_branch);
            self.next_branch += 1;
            let mode = if self.rng.gen_bool(0.5) {
                "live"
            } else {
                "full"
            };
            let (st, v) = block_on(self.p().post(
                &format!("/v1/sandboxes/{id}/branch"),
                json!({"tag": tag, "mode": mode}),
            ));
            if st != 201 {
                return self.t.violation(format!("branch {id} ({mode}): {st} {v}"));
            }
            self.t.time("branch", t0);
            self.branches.push(tag);
            if self.branches.len() > MAX_BRANCHES {
                let old = self.branches.remove(0);
                self.delete_snapshot(&old);
            }
        } else {
            let id = self.pick(&live).unwrap();
            let (st, v) = block_on(self.p().delete(&format!("/v1/sandboxes/{id}")));
            if st != 204 {
                return self.t.violation(format!("delete {id}: {st} {v}"));
            }
            self.t.time("delete", t0);
        }
    }

    fn exec(&self, id: &str) -> Result<(), String> {
        let (st, v) = block_on(self.p().post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": ["echo", "ok"], "timeout_secs": 60}),
        ));
        match (st, v["stdout"].as_str()) {
            (200, Some("ok\n")) => Ok(()),
            _ => Err(format!("exec in {id}: {st} {v}")),
        }
    }

    /// Runs the `forkd` CLI on this data dir (as a second process next to
    /// poold, taking turns on the store).
    fn forkd(&self, args: &[&str]) -> Result<String, String> {
        let out = std::process::Command::new(forkd_e2e::bin("forkd"))
            .args(args)
            .env("FORKD_HOME", &self.home.dir)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "forkd {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Pushes snapshot `tag` to the hub, deletes it, pulls it back while
    /// poold runs and spawns a child of it that answers.
    fn round_trip(&mut self, tag: &str) -> Result<(), String> {
        let hub = format!("file://{}", self.home.dir.join("hub").display());
        self.forkd(&["push", tag, &hub, "-q"])?;
        let (st, v) = block_on(self.p().delete(&format!("/v1/snapshots/{tag}")));
        if st != 204 {
            return Err(format!("deleting {tag} before its pull: {st} {v}"));
        }
        self.forkd(&["pull", &hub, tag, "-q"])?;
        let (st, v) = block_on(self.p().post("/v1/sandboxes", json!({"snapshot_tag": tag})));
        if st != 201 {
            // What tells a store fault from a view fault: the primary's
            // verdict and what the mount logged last.
            let verify = self.forkd(&["store", "verify"]);
            let log = std::fs::read_to_string(self.home.dir.join("mnt.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            return Err(format!(
                "spawning from the pulled {tag}: {st} {v}\nstore verify: {verify:?}\nforkd-fs log, newest first:\n{}",
                tail.join("\n")
            ));
        }
        let id = v[0]["id"].as_str().unwrap_or_default().to_string();
        self.exec(&id)?;
        let (st, v) = block_on(self.p().delete(&format!("/v1/sandboxes/{id}")));
        if st != 204 {
            return Err(format!("deleting the child of the pulled {tag}: {st} {v}"));
        }
        Ok(())
    }

    fn delete_snapshot(&mut self, tag: &str) {
        let t0 = Instant::now();
        let (st, v) = block_on(self.p().delete(&format!("/v1/snapshots/{tag}")));
        if st != 204 {
            return self
                .t
                .violation(format!("deleting snapshot {tag}: {st} {v}"));
        }
        self.t.time("snapshot delete", t0);
    }

    /// One random fault, then recovery and the invariants.
    fn fault(&mut self) {
        match self.rng.gen_range(0..4) {
            0 => self.kill_poold(),
            1 => self.kill_fs_worker(),
            2 => self.kill_fs_holder(),
            _ => self.kill_qemu(),
        }
        self.check("after a fault");
    }

    fn kill_poold(&mut self) {
        *self.t.faults.entry("poold kill -9").or_default() += 1;
        // Mid-request half the time: a spawn or a branch in flight.
        let live = self.sandboxes();
        let held = match (self.rng.gen_bool(0.5), self.pick(&live)) {
            (true, Some(id)) if self.rng.gen_bool(0.5) => {
                let tag = format!("s{}", self.next_branch);
                self.next_branch += 1;
                let body = json!({"tag": tag, "mode": "full"}).to_string();
                Some(
                    self.p()
                        .post_in_background(&format!("/v1/sandboxes/{id}/branch"), &body),
                )
            }
            (true, _) => Some(self.p().post_in_background(
                "/v1/sandboxes",
                &json!({"snapshot_tag": "base"}).to_string(),
            )),
            _ => None,
        };
        if held.is_some() {
            self.t.cut += 1;
            std::thread::sleep(Duration::from_millis(self.rng.gen_range(50..1500)));
        }
        self.p.take().unwrap().kill9();
        drop(held);
        // The store, closed by the kill, must be consistent.
        let out = std::process::Command::new(forkd_e2e::bin("forkd"))
            .args(["store", "verify"])
            .env("FORKD_HOME", &self.home.dir)
            .output()
            .unwrap();
        if !out.status.success() {
            self.t.violation(format!(
                "store verify after a kill: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let t0 = Instant::now();
        self.p = Some(Poold::start(&self.home.dir, &[], None));
        self.t.time("poold restart", t0);
        self.t.recoveries += 1;
        // A branch cut mid-way may have finished: keep its tag for deletion.
        let (_, snaps) = block_on(self.p().get("/v1/snapshots"));
        for s in snaps.as_array().into_iter().flatten() {
            let tag = s["tag"].as_str().unwrap_or_default().to_string();
            if tag.starts_with('s') && !self.branches.contains(&tag) {
                self.branches.push(tag);
            }
        }
    }

    fn kill_fs_worker(&mut self) {
        *self.t.faults.entry("forkd-fs worker kill -9").or_default() += 1;
        let st = match forkd_fs(&self.home.dir, &["status"]) {
            Ok(st) => st,
            Err(e) => return self.t.violation(format!("forkd-fs status: {e}")),
        };
        let generation = st["generation"].as_u64().unwrap_or(0);
        let pid = st["pid"].as_i64().unwrap() as i32;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let t0 = Instant::now();
        // Work goes on right away; the new worker answers what waits.
        if let Some(id) = self.pick(&self.sandboxes()) {
            if let Err(e) = self.exec(&id) {
                self.t
                    .violation(format!("right after the worker kill: {e}"));
            }
        }
        while forkd_fs(&self.home.dir, &["status"])
            .ok()
            .and_then(|s| s["generation"].as_u64())
            .is_none_or(|g| g <= generation)
        {
            if t0.elapsed() > Duration::from_secs(30) {
                return self
                    .t
                    .violation("no new forkd-fs worker within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.t.time("forkd-fs worker replaced", t0);
        self.t.recoveries += 1;
    }

    /// The holder (the process that opened /dev/fuse) dies. When poold
    /// keeps its connection (`kept_holder`), a new holder adopts it and
    /// nothing is lost; otherwise (a holder not kept yet: just started, or
    /// poold just restarted) the connection dies with it and poold mounts
    /// again by itself, reporting the VMs that mapped it lost
    /// (docs/design.md, "The mount, healed").
    fn kill_fs_holder(&mut self) {
        *self.t.faults.entry("forkd-fs holder kill -9").or_default() += 1;
        let holder = match forkd_fs(&self.home.dir, &["status"]) {
            Ok(st) => st["holder_pid"].as_u64(),
            Err(e) => return self.t.violation(format!("forkd-fs status: {e}")),
        };
        let Some(holder) = holder else {
            return self.t.violation("forkd-fs status names no holder".into());
        };
        let health = self.mount_health();
        let before = health["recoveries"].as_u64().unwrap_or(0);
        let kept = health["kept_holder"].as_u64() == Some(holder);
        let listed = self.sandboxes();
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(holder as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let t0 = Instant::now();
        let mount = loop {
            let m = self.mount_health();
            if m["ok"] == true && m["recoveries"].as_u64().unwrap_or(0) > before {
                break m;
            }
            if t0.elapsed() > Duration::from_secs(30) {
                return self.t.violation(format!(
                    "the mount was not recovered within 30 s of a holder kill: {m}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        self.t.recoveries += 1;
        let r = &mount["last_recovery"];
        let lost = r["lost_sandboxes"].as_u64().unwrap_or(0) as usize;
        if kept {
            self.t.time("holder adopted (killed)", t0);
            self.t.adopted += 1;
            let live = self.sandboxes();
            let gone: Vec<&String> = listed.iter().filter(|id| !live.contains(id)).collect();
            if r["cause"] != "holder_died" || lost != 0 || !gone.is_empty() {
                self.t.violation(format!(
                    "a kept holder's death lost something: {mount}; gone from the list: {gone:?}"
                ));
            }
            return;
        }
        self.t.time("mount recovered (holder killed)", t0);
        if r["cause"] != "dead" && r["cause"] != "hung" {
            self.t.violation(format!(
                "a holder kill recovered as something other than a dead connection: {mount}"
            ));
        }
        // Lost sandboxes left the list (a QEMU that met the dead mount on
        // its own before the recovery may have left it too; any sandbox
        // still listed answers an exec in the check that follows).
        self.t.lost += lost;
        let live = self.sandboxes();
        let gone = listed.iter().filter(|id| !live.contains(id)).count();
        if gone < lost {
            self.t.violation(format!(
                "{gone} sandboxes left the list after a holder kill, {lost} reported lost: {mount}"
            ));
        }
    }

    /// `/healthz`'s `mount` (answered with 503 while the mount is down).
    fn mount_health(&self) -> serde_json::Value {
        let (_, v) = block_on(self.p().get("/healthz"));
        v["mount"].clone()
    }

    fn kill_qemu(&mut self) {
        *self.t.faults.entry("sandbox QEMU kill -9").or_default() += 1;
        let live = self.sandboxes();
        let Some(id) = self.pick(&live) else { return };
        let rec = forkd_vmm::VmDir::new(forkd_snapshot::Paths::new(&self.home.dir).vm_dir(&id))
            .read_record();
        let Ok(rec) = rec else {
            return self.t.violation(format!("sandbox {id} has no VM record"));
        };
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(rec.qemu.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let t0 = Instant::now();
        while self.sandboxes().contains(&id) {
            if t0.elapsed() > Duration::from_secs(30) {
                return self.t.violation(format!(
                    "sandbox {id} still listed 30 s after its QEMU died"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.t.time("dead sandbox removed", t0);
        self.t.recoveries += 1;
    }

    /// The invariants of the module doc.
    fn check(&mut self, when: &str) {
        let live = self.sandboxes();
        for id in &live {
            if let Err(e) = self.exec(id) {
                self.t.violation(format!("{when}: {e}"));
            }
        }
        block_on(self.p().wait_pool("base", POOL));
        let paths = forkd_snapshot::Paths::new(&self.home.dir);
        let want = live.len() + POOL as usize;
        let t0 = Instant::now();
        let (qemus, dirs) = loop {
            let qemus = self.home.qemu_pids().len();
            let dirs = entries(&paths.vms_dir());
            if (qemus == want && dirs.len() == want) || t0.elapsed() > SETTLE {
                break (qemus, dirs);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if qemus != want || dirs.len() != want {
            self.t.violation(format!(
                "{when}: {} sandboxes + {POOL} pooled, but {qemus} QEMUs and VM dirs {dirs:?}",
                live.len()
            ));
        }
        let staged = entries(&paths.staging_dir());
        if !staged.is_empty() {
            self.t
                .violation(format!("{when}: staging files left: {staged:?}"));
        }
        let mnt = self.home.dir.join("mnt");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some(mnt.to_str().unwrap()))
            .count();
        if mounts != 1 {
            self.t
                .violation(format!("{when}: {mounts} mounts at {}", mnt.display()));
        }
        if let Err(e) = forkd_fs(&self.home.dir, &["status"]) {
            self.t.violation(format!("{when}: forkd-fs status: {e}"));
        }
    }

    fn store_bytes(&self) -> u64 {
        fn walk(p: &Path) -> u64 {
            std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => walk(&e.path()),
                    _ => e.metadata().map_or(0, |m| m.len()),
                })
                .sum()
        }
        walk(&self.home.dir.join("store"))
    }

    fn summary(&self, minutes: f64, seed: u64) {
        eprintln!("\nsoak: {minutes} min, seed {seed}");
        eprintln!(
            "{:<26} {:>6} {:>10} {:>10}",
            "operation", "count", "p50 ms", "p99 ms"
        );
        for (op, v) in &self.t.ops {
            eprintln!(
                "{op:<26} {:>6} {:>10.1} {:>10.1}",
                v.len(),
                percentile(v, 0.5),
                percentile(v, 0.99)
            );
        }
        for (f, n) in &self.t.faults {
            eprintln!("fault: {f:<28} {n}");
        }
        eprintln!(
            "recoveries {}, requests cut by a fault {}, holder kills adopted {}, sandboxes lost with a mount {}, invariant violations {}",
            self.t.recoveries,
            self.t.cut,
            self.t.adopted,
            self.t.lost,
            self.t.violations.len()
        );
    }
}

#[test]
fn soak_with_faults_keeps_every_invariant() {
    let minutes: f64 = std::env::var("FORKD_SOAK_MINUTES")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(3.0);
    let seed: u64 = std::env::var("FORKD_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        p.snapshot("base", "minimal", 128).await;
        let (st, v) = p.put("/v1/pools/base", json!({"min_ready": POOL})).await;
        assert_eq!(st, 200, "{v}");
        p.wait_pool("base", POOL).await;
    });
    let mut s = Soak {
        home,
        p: Some(p),
        rng: StdRng::seed_from_u64(seed),
        t: Tally::default(),
        branches: Vec::new(),
        next_branch: 0,
    };
    let baseline = s.store_bytes();
    let end = Instant::now() + Duration::from_secs_f64(minutes * 60.0);
    let mut steps = 0u64;
    while Instant::now() < end {
        if s.rng.gen_bool(0.1) {
            s.fault();
        } else {
            s.step();
        }
        steps += 1;
        if steps.is_multiple_of(20) {
            s.check("periodic check");
        }
    }
    s.check("at the end");

    // Everything deleted: the store returns to its size after `base`.
    for id in s.sandboxes() {
        block_on(s.p().delete(&format!("/v1/sandboxes/{id}")));
    }
    for tag in std::mem::take(&mut s.branches) {
        s.delete_snapshot(&tag);
    }
    // poold's GC runs 2 s after deletes.
    let t0 = Instant::now();
    let slack = 64u64 << 20;
    while s.store_bytes() > baseline + slack && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(500));
    }
    let now = s.store_bytes();
    eprintln!(
        "store: {} MiB after the first snapshot, {} MiB after deleting everything since",
        baseline >> 20,
        now >> 20
    );
    if now > baseline + slack {
        s.t.violation(format!(
            "the store holds {} MiB more than after the first snapshot",
            (now - baseline) >> 20
        ));
    }
    s.summary(minutes, seed);
    assert!(
        s.t.violations.is_empty(),
        "{} invariant violations (seed {seed}):\n{}",
        s.t.violations.len(),
        s.t.violations.join("\n")
    );
}
