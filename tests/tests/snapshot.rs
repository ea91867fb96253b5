//! Warm snapshots and copy-on-write children under TCG: warm state is
//! inherited, disks and identities are private, clean RAM pages are shared,
//! and bad snapshots are refused before QEMU starts.

use forkd_e2e::{block_on, create_snapshot, fork, paths, shared_snapshot, source};
use forkd_snapshot::delete::{delete, Dependents};
use forkd_snapshot::fork::destroy_all;
use rootfs_init::protocol::ExecSpec;
use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The warm-up also draws from OpenSSL (through `ssl`), whose generator a VM
/// fork would otherwise hand every child alike.
const NUMPY_WARMUP: &str =
    "import numpy\nnumpy._forkd_marker = 'warm'\nimport ssl\nssl.RAND_bytes(16)";

fn numpy_snapshot() -> String {
    shared_snapshot("python-numpy", 512, Some(NUMPY_WARMUP))
}

fn minimal_snapshot() -> String {
    shared_snapshot("minimal", 256, None)
}

async fn sh(vm: &forkd_vmm::Vm, cmd: &str) -> String {
    let out = vm
        .agent
        .exec(
            ExecSpec {
                shell: Some(cmd.into()),
                timeout_ms: Some(30_000),
                ..Default::default()
            },
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        out.result.exit_code,
        Some(0),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

async fn eval(vm: &forkd_vmm::Vm, code: &str) -> String {
    let r = vm.agent.eval(code, Some(30_000)).await.unwrap();
    assert!(r.error.is_none(), "{code}: {r:?}");
    r.result.unwrap_or_default()
}

#[test]
fn numpy_children_are_warm_isolated_and_distinct() {
    let tag = numpy_snapshot();
    block_on(async {
        source(&tag).await; // mounts forkd-fs
        let rec = forkd_snapshot::restore::read_record(&paths().mount_dir(), &tag).unwrap();
        let parent_warm_pid = rec.lineage["warm_pid"].as_u64().unwrap() as u32;
        let kids = fork(&tag, 4).await;
        let mut urandom = HashSet::new();
        let mut randoms = HashSet::new();
        let mut nprandoms = HashSet::new();
        let mut openssl = HashSet::new();
        let mut hostnames = HashSet::new();
        for (i, c) in kids.iter().enumerate() {
            let vm = &c.vm;
            // Warm: the parent's interpreter, with the parent's module object.
            let p = vm.agent.ping(Duration::from_secs(10)).await.unwrap();
            assert_eq!(p.warm_pid, Some(parent_warm_pid), "interpreter restarted");
            assert_eq!(eval(vm, "numpy._forkd_marker").await, "'warm'");
            assert_eq!(
                eval(vm, "numpy.zeros(5).tolist()").await,
                "[0.0, 0.0, 0.0, 0.0, 0.0]"
            );
            // Identity: fresh entropy, reseeded interpreter, own hostname, host clock.
            urandom.insert(sh(vm, "head -c 16 /dev/urandom | od -An -tx1").await);
            randoms.insert(eval(vm, "import random; random.random()").await);
            nprandoms.insert(eval(vm, "numpy.random.random()").await);
            openssl.insert(eval(vm, "ssl.RAND_bytes(16).hex()").await);
            hostnames.insert(sh(vm, "hostname").await);
            let guest: f64 = eval(vm, "import time; time.time()").await.parse().unwrap();
            let host = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs_f64();
            assert!(
                (guest - host).abs() < 1.0,
                "child {i} clock {guest} vs host {host}"
            );
            // Private disk: a file in / and in /tmp.
            vm.agent
                .write_file(&format!("/marker-{i}"), b"x", None, false)
                .await
                .unwrap();
            vm.agent
                .write_file(&format!("/tmp/marker-{i}"), b"x", None, false)
                .await
                .unwrap();
        }
        assert_eq!(urandom.len(), 4, "/dev/urandom repeats across children");
        assert_eq!(randoms.len(), 4, "random.random() repeats across children");
        assert_eq!(nprandoms.len(), 4, "numpy.random repeats across children");
        assert_eq!(
            openssl.len(),
            4,
            "OpenSSL's generator repeats across children"
        );
        assert_eq!(hostnames.len(), 4);
        for (i, c) in kids.iter().enumerate() {
            let seen = sh(&c.vm, "ls / /tmp | grep marker- | sort | tr '\\n' ' '").await;
            assert_eq!(
                seen,
                format!("marker-{i} marker-{i}"),
                "child {i} sees {seen}"
            );
        }
        // Neither does the snapshot: a later child starts clean.
        let later = fork(&tag, 1).await;
        let seen = sh(&later[0].vm, "ls / /tmp | grep -c marker- || true").await;
        assert_eq!(seen, "0");
        destroy_all(kids).await;
        destroy_all(later).await;
    });
}

/// Per-mapping numbers from /proc/<pid>/smaps for the mapping of `needle`.
fn smaps_kib(pid: u32, needle: &str) -> std::collections::HashMap<String, u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut out = std::collections::HashMap::new();
    let mut inside = false;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            inside = line.ends_with(needle);
            continue;
        }
        if inside {
            if let Some((k, v)) = line.split_once(':') {
                if let Some(n) = v.trim().strip_suffix(" kB") {
                    *out.entry(k.to_string()).or_default() += n.trim().parse::<u64>().unwrap();
                }
            }
        }
    }
    out
}

/// forkd-fs's point: eight children of one snapshot map the same page-cache
/// pages of memory.bin; its clean pages are resident once, not eight times.
#[test]
fn eight_children_share_one_copy_of_clean_memory() {
    let tag = minimal_snapshot();
    block_on(async {
        let src = source(&tag).await;
        let kids = fork(&tag, 8).await;
        for c in &kids {
            c.vm.agent.ping(Duration::from_secs(10)).await.unwrap();
        }
        let mem = src.memory();
        let needle = mem.to_string_lossy().to_string();
        let mut sum_clean_rss = 0;
        let mut sum_file_pss = 0;
        let mut max_clean_rss = 0;
        for c in &kids {
            let m = smaps_kib(c.vm.pid(), &needle);
            assert!(
                m.contains_key("Rss"),
                "QEMU {} does not map {needle}",
                c.vm.pid()
            );
            let clean = m["Rss"] - m["Anonymous"];
            sum_clean_rss += clean;
            sum_file_pss += m["Pss"] - m["Anonymous"];
            max_clean_rss = max_clean_rss.max(clean);
        }
        let cached_kib = forkd_bench::mem::resident_bytes(&mem).unwrap() / 1024;
        println!(
            "8 children: clean memory.bin pages mapped {sum_clean_rss} KiB in total, \
             proportional share {sum_file_pss} KiB, page cache holds {cached_kib} KiB of the file"
        );
        assert!(max_clean_rss > 1024, "children mapped almost nothing");
        assert!(
            sum_clean_rss > 4 * max_clean_rss,
            "children do not map the same pages ({sum_clean_rss} vs max {max_clean_rss})"
        );
        // Each shared page's PSS is split among its mappers: the sum is the
        // number of distinct pages, all of them one copy in the page cache.
        assert!(
            sum_file_pss <= cached_kib + 1024,
            "clean pages resident more than once: PSS {sum_file_pss} KiB > cache {cached_kib} KiB"
        );
        destroy_all(kids).await;
    });
}

/// A restore whose recorded QEMU version or CPU model differs from this
/// host's is refused before QEMU starts, naming both values; so is a
/// snapshot without device state. (`Source::resolve` is what every fork and
/// spawn calls before starting anything.)
#[test]
fn mismatched_or_incomplete_snapshots_are_refused_before_qemu_starts() {
    let tag = minimal_snapshot();
    let p = paths();
    let suffix = forkd_snapshot::random_hex(3);
    let (bad_qemu, bad_cpu, no_state) = (
        format!("t-badqemu-{suffix}"),
        format!("t-badcpu-{suffix}"),
        format!("t-nostate-{suffix}"),
    );
    let (t1, t2, t3, t0) = (
        bad_qemu.clone(),
        bad_cpu.clone(),
        no_state.clone(),
        tag.clone(),
    );
    block_on(forkd_snapshot::store::with_rw(&p, move |store| {
        let rec = store.resolve(&t0)?.unwrap();
        let commit = |tag: &str, config: serde_json::Value, drop_file: Option<&str>| {
            let mut files = rec.files.clone();
            if let Some(f) = drop_file {
                files.remove(f);
            }
            store.commit_snapshot(forkd_layers::NewSnapshot {
                files,
                config,
                tag: Some(tag.to_string()),
                ..Default::default()
            })
        };
        let mut c = rec.config.clone();
        c["qemu_version"] = "9.0.0".into();
        commit(&t1, c, None)?;
        let mut c = rec.config.clone();
        c["machine"]["cpu"] = "host".into();
        commit(&t2, c, None)?;
        commit(&t3, rec.config.clone(), Some("vmstate"))?;
        Ok(())
    }))
    .unwrap();
    block_on(async {
        let mount = forkd_snapshot::ensure_mount_async(&p).await.unwrap();
        let host = forkd_vmm::qemu_version().unwrap();
        let err = |t: &str| {
            format!(
                "{:#}",
                forkd_snapshot::restore::Source::resolve(&mount.mountpoint, t)
                    .err()
                    .unwrap_or_else(|| panic!("{t} was accepted"))
            )
        };
        let e = err(&bad_qemu);
        assert!(e.contains("9.0.0") && e.contains(&host), "{e}");
        let e = err(&bad_cpu);
        assert!(e.contains("cpu=host") && e.contains("cpu=max"), "{e}");
        let e = err(&no_state);
        assert!(e.contains("vmstate"), "{e}");
        let e = err("no-such-snapshot");
        assert!(e.contains("no snapshot"), "{e}");
        let e = err("../etc");
        assert!(e.contains("tag"), "{e}");
    });
    for t in [bad_qemu, bad_cpu, no_state] {
        let p2 = p.clone();
        block_on(forkd_snapshot::store::with_rw(&p, move |store| {
            delete(&p2, store, &t, Dependents::Refuse)
        }))
        .unwrap();
    }
}

/// `snapshot rm` is refused while a child maps the snapshot, and works once
/// the child is gone.
#[test]
fn delete_is_refused_while_children_map_the_snapshot() {
    let tag = format!("t-rm-{}", forkd_snapshot::random_hex(3));
    let p = paths();
    block_on(create_snapshot(&tag, "minimal", 128, None));
    let kids = block_on(fork(&tag, 1));
    let try_delete = |t: String| {
        let p2 = p.clone();
        block_on(forkd_snapshot::store::with_rw(&p, move |store| {
            delete(&p2, store, &t, Dependents::Refuse)
        }))
    };
    let e = format!("{:#}", try_delete(tag.clone()).unwrap_err());
    assert!(e.contains("in use"), "{e}");
    block_on(destroy_all(kids));
    let reports = try_delete(tag.clone()).unwrap();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].tags_removed, vec![tag.clone()]);
    let e = format!("{:#}", try_delete(tag).unwrap_err());
    assert!(e.contains("no snapshot"), "{e}");
}
