//! The snapshot hub with real snapshots: push a base and a chain head made
//! by BRANCH, pull them into an empty data dir, and fork children there.
//! The head costs only its own chunks, both ways.

use forkd_e2e::daemon::Home;
use forkd_e2e::{bin, block_on, create_snapshot, fork, paths};
use forkd_snapshot::branch::{branch, Mode};
use forkd_snapshot::fork::destroy_all;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

fn forkd(home: &Path, args: &[&str]) -> String {
    let out = Command::new(bin("forkd"))
        .args(args)
        .env("FORKD_HOME", home)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "forkd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// "N of M chunks" in a push/pull report → N.
fn moved(report: &str) -> u64 {
    let i = report.find(" of ").expect(report);
    report[..i].rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn pushed_snapshots_fork_on_another_host_and_heads_move_only_new_chunks() {
    let p = paths();
    let sfx = forkd_snapshot::random_hex(3);
    let (base, head) = (format!("t-hb-{sfx}"), format!("t-hh-{sfx}"));
    block_on(async {
        create_snapshot(&base, "minimal", 128, None).await;
        let kids = fork(&base, 1).await;
        let vm = &kids[0].vm;
        vm.agent
            .write_file("/head", b"head\n", None, false)
            .await
            .unwrap();
        let parent = forkd_snapshot::restore::read_record(&p.mount_dir(), &base).unwrap();
        branch(
            &p,
            &p.mount_dir(),
            vm,
            &parent,
            &head,
            Mode::Live,
            BTreeMap::new(),
        )
        .await
        .unwrap();
        destroy_all(kids).await;
    });
    let (b, h) = (base.clone(), head.clone());
    let unique = block_on(forkd_snapshot::store::with_rw(&p, move |s| {
        let (bid, hid) = (s.resolve(&b)?.unwrap().id, s.resolve(&h)?.unwrap().id);
        Ok(s.diff(&bid, &hid)?.new_chunks)
    }))
    .unwrap();

    let hub_dir = tempfile_dir();
    let hub = format!("file://{}", hub_dir.display());
    let r = forkd(&p.home, &["push", &base, &hub, "-q"]);
    assert!(moved(&r) > 0, "{r}");
    let r = forkd(&p.home, &["push", &head, &hub, "-q"]);
    assert_eq!(
        moved(&r),
        unique,
        "the head's push sent more than its own chunks: {r}"
    );

    // Another host: an empty data dir with the same kernel and images.
    let other = Home::new();
    let r = forkd(&other.dir, &["pull", &hub, &base, "-q"]);
    assert!(moved(&r) > 0, "{r}");
    let out = forkd(&other.dir, &["fork", "--tag", &base, "-n", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["children"].as_array().unwrap().len(), 2);
    let r = forkd(&other.dir, &["pull", &hub, &head, "-q"]);
    assert_eq!(
        moved(&r),
        unique,
        "pulling the head fetched more than its own chunks: {r}"
    );
    // A child of the pulled head sees what the source wrote before the branch.
    let sv = forkd(&other.dir, &["snapshot", "info", &head, "--json"]);
    let info: serde_json::Value = serde_json::from_str(&sv).unwrap();
    assert_eq!(info["chain_depth"], 1);
    block_on(async {
        let op = forkd_snapshot::Paths::new(&other.dir);
        let mount = forkd_snapshot::ensure_mount_async(&op).await.unwrap();
        let src = forkd_snapshot::restore::Source::resolve(&mount.mountpoint, &head).unwrap();
        let kids = forkd_snapshot::fork::fork(&op, &src, 1, 1, forkd_vmm::Lifetime::Ephemeral)
            .await
            .unwrap()
            .children;
        let (_, data) = kids[0].vm.agent.read_file("/head", 0, None).await.unwrap();
        assert_eq!(&data[..], b"head\n");
        destroy_all(kids).await;
    });
    let _ = std::fs::remove_dir_all(&hub_dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::path::PathBuf::from(format!("/tmp/fdt-hub-{}", forkd_snapshot::random_hex(4)));
    std::fs::create_dir_all(&d).unwrap();
    d
}
