//! Crash safety: a child process ingests, commits, deletes and collects in a
//! loop and is killed with SIGKILL at random points, many times. Afterwards
//! the store must verify clean and every committed snapshot must read back
//! byte-exact (its content is regenerated from the seed and iteration
//! recorded in its lineage).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use forkd_layers::synth::{crash_content, SplitMix64};

const CHUNK: usize = 64 * 1024;

#[test]
fn kill9_at_random_points_leaves_a_consistent_store() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let bin = env!("CARGO_BIN_EXE_layers-crash-child");
    let mut rng = SplitMix64(0xC0FFEE);
    let start = Instant::now();
    let mut kills = 0;
    for seed in 1..=40u64 {
        if start.elapsed() > Duration::from_secs(50) && kills >= 30 {
            break;
        }
        let mut child = Command::new(bin)
            .arg(&root)
            .arg(seed.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn crash child");
        // Open + a few iterations; kill anywhere in between.
        std::thread::sleep(Duration::from_millis(30 + rng.below(600)));
        if let Ok(Some(status)) = child.try_wait() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "crash child exited by itself ({status}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGKILL);
        }
        child.wait().unwrap();
        kills += 1;
    }
    assert!(kills >= 30, "only {kills} kills");

    let store = common::open(&root, CHUNK as u32);
    let v = store.verify().unwrap();
    assert!(v.is_ok(), "verify after {kills} kills: {v:#?}");
    let snaps = store.list_snapshots().unwrap();
    assert!(!snaps.is_empty(), "no snapshot survived");
    for rec in &snaps {
        let seed = rec.lineage["seed"].as_u64().unwrap();
        let iter = rec.lineage["iter"].as_u64().unwrap();
        let want = crash_content(seed, iter, CHUNK);
        let got = common::read_all(&store, rec, "data.bin");
        assert!(
            got == want,
            "snapshot {} (seed {seed} iter {iter}) differs",
            rec.id
        );
    }
    // Garbage left by the kills is collectable, and the store stays sound.
    store.gc().unwrap();
    let v = store.verify().unwrap();
    assert!(v.is_ok(), "verify after gc: {v:#?}");
    let s = store.stats().unwrap();
    eprintln!(
        "crash test: {kills} kills, {} snapshots survived, {} chunks, {:.1}s",
        snaps.len(),
        s.chunks,
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn writer_in_another_process_holds_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let bin = env!("CARGO_BIN_EXE_layers-crash-child");
    let mut child = Command::new(bin)
        .arg(&root)
        .arg("7")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn crash child");
    // Wait until the child has created and opened the store.
    let start = Instant::now();
    while !root.join("packs").exists() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let opts = forkd_layers::StoreOptions {
        lock_timeout: Duration::from_millis(200),
        ..common::opts(CHUNK as u32)
    };
    let err = forkd_layers::Store::open(&root, opts).err();
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGKILL);
    }
    child.wait().unwrap();
    let err = err.expect("second writer must not open the store");
    let msg = err.to_string();
    assert!(
        msg.contains("another forkd process") && msg.contains("LOCK"),
        "{msg}"
    );
    // Once the holder is gone the store opens (RocksDB's lock dies with it).
    common::open(&root, CHUNK as u32);
}

/// fs/'s situation: a long-lived secondary in another process reads
/// snapshots while the writer ingests, deletes and collects. Every read that
/// succeeds must be byte-exact; a read may fail only for a snapshot the
/// writer deleted meanwhile.
#[test]
fn secondary_reads_while_another_process_writes() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let bin = env!("CARGO_BIN_EXE_layers-crash-child");
    let mut child = Command::new(bin)
        .arg(&root)
        .arg("99")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn writer");
    let start = Instant::now();
    let reader = loop {
        match forkd_layers::StoreReader::open_secondary(&root, &dir.path().join("sec")) {
            Ok(r) => break r,
            Err(_) if start.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("secondary never opened: {e}"),
        }
    };
    let (mut ok, mut gone) = (0, 0);
    let mut rng = SplitMix64(5);
    let deadline = Instant::now() + Duration::from_secs(6);
    while Instant::now() < deadline {
        reader.catch_up().unwrap();
        let all = reader.list_snapshots().unwrap();
        // The newest, plus two at random (older ones get deleted and GC'd).
        let picks: Vec<_> = all
            .last()
            .into_iter()
            .chain(
                (0..2)
                    .filter(|_| !all.is_empty())
                    .map(|_| &all[rng.below(all.len() as u64) as usize]),
            )
            .cloned()
            .collect();
        // Open first, read a little later: the writer may delete and collect
        // a snapshot in between (as it can under a FUSE mount).
        let opened: Vec<_> = picks
            .iter()
            .filter_map(|rec| Some((rec, reader.open_file(&rec.id, "data.bin").ok()?)))
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        for (rec, f) in &opened {
            let want = crash_content(
                rec.lineage["seed"].as_u64().unwrap(),
                rec.lineage["iter"].as_u64().unwrap(),
                CHUNK,
            );
            let mut got = vec![0u8; f.size() as usize];
            match f.read_exact_at(&mut got, 0) {
                Ok(()) => {
                    assert!(got == want, "wrong bytes for {}", rec.id);
                    ok += 1;
                }
                Err(e) => {
                    reader.catch_up().unwrap();
                    if reader.snapshot(&rec.id).unwrap().is_some() {
                        panic!("live snapshot {} unreadable: {e}", rec.id);
                    }
                    gone += 1;
                }
            }
        }
        reader.drop_cache();
    }
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGKILL);
    }
    child.wait().unwrap();
    eprintln!("secondary: {ok} byte-exact reads, {gone} of deleted snapshots");
    assert!(ok > 20, "only {ok} reads succeeded");
}
