//! Lazy snapshots with real guests: a snapshot pushed to a real S3 server
//! (s3s-fs on 127.0.0.1) and pulled with `--lazy` into a data dir that has
//! never seen it; children fault its chunks in through forkd-fs.
//!
//! - a lazy spawn on a fresh data dir answers, and the data dir converges
//!   to holding the whole snapshot;
//! - the hub dies while the snapshot is not all here: a running child that
//!   needs a chunk waits for it and carries on once the hub is back; a new
//!   spawn meanwhile gets a clear error;
//! - a chunk corrupted on the hub is refused: the read fails, nothing wrong
//!   is served or stored;
//! - a pool of a lazy snapshot parks no child until the snapshot's working
//!   set is local, and says why meanwhile.

use forkd_e2e::daemon::{Home, Poold};
use forkd_e2e::s3::{BUCKET, S3};
use forkd_e2e::{bin, block_on, create_snapshot, fork, paths};
use forkd_layers::{ChunkRef, StoreReader};
use forkd_remote::layout::Key;
use forkd_remote::packs::Index;
use forkd_snapshot::fork::destroy_all;
use forkd_snapshot::restore::Source;
use forkd_snapshot::{Paths, SnapshotError};
use rootfs_init::protocol::ExecSpec;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Runs the forkd CLI on data dir `home` with `env`; (success, output).
fn forkd(home: &Path, args: &[&str], env: &[(&str, String)]) -> (bool, String) {
    let out = Command::new(bin("forkd"))
        .args(args)
        .env("FORKD_HOME", home)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn ok(home: &Path, args: &[&str], env: &[(&str, String)]) -> String {
    let (good, out) = forkd(home, args, env);
    assert!(good, "forkd {args:?} failed: {out}");
    out
}

/// A `minimal` snapshot whose working set was recorded (its first child
/// ran), shared by this binary's tests.
fn recorded_snapshot() -> String {
    static TAG: OnceLock<Mutex<Option<String>>> = OnceLock::new();
    let mut g = TAG.get_or_init(Default::default).lock().unwrap();
    if let Some(t) = g.as_ref() {
        return t.clone();
    }
    let tag = format!("t-lazy-{}", forkd_snapshot::random_hex(4));
    block_on(async {
        create_snapshot(&tag, "minimal", 128, None).await;
        let kids = fork(&tag, 1).await;
        let r = kids[0].vm.agent.exec(sh("echo first"), &[]).await.unwrap();
        assert_eq!(r.result.exit_code, Some(0));
        destroy_all(kids).await;
    });
    // forkd-fs saves the working set once the child has been quiet a while.
    let p = paths();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = ok(&p.home, &["snapshot", "info", &tag, "--json"], &[]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        if v["residency"]["working_set_chunks"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no working set recorded for {tag}: {out}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    *g = Some(tag.clone());
    tag
}

fn sh(cmd: &str) -> ExecSpec {
    ExecSpec {
        shell: Some(cmd.into()),
        ..Default::default()
    }
}

/// The `lazy` part of forkd-fs's status on data dir `home`.
fn lazy_status(home: &Path) -> forkd_fs::lazy::LazyStatus {
    let mount = Paths::new(home).mount_dir();
    forkd_fs::Client::connect(&forkd_fs::default_control_socket(&mount))
        .unwrap()
        .status()
        .unwrap()
        .lazy
}

fn residency(home: &Path, tag: &str) -> serde_json::Value {
    let out = ok(home, &["snapshot", "info", tag, "--json"], &[]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["residency"].clone()
}

#[test]
fn a_lazy_spawn_on_a_fresh_data_dir_answers_and_converges() {
    let tag = recorded_snapshot();
    let s3 = S3::start();
    let url = s3.url("one");
    let out = ok(&paths().home, &["push", &tag, &url, "-q"], &s3.env());
    assert!(out.contains("with its working set"), "{out}");

    let b = Home::new();
    let out = ok(&b.dir, &["pull", &url, &tag, "--lazy", "-q"], &s3.env());
    assert!(out.contains("left on the hub"), "{out}");
    let r = residency(&b.dir, &tag);
    assert!(r["remote_chunks"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["source"].as_str(), Some(url.as_str()));

    // A child of the lazy snapshot answers.
    let out = ok(&b.dir, &["fork", "--tag", &tag, "-n", "1", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["children"].as_array().unwrap().len(), 1, "{out}");
    let st = lazy_status(&b.dir);
    assert!(st.fetched_chunks > 0, "{st:?}");
    assert!(st.failures.is_empty(), "{st:?}");

    // The fill makes it all local.
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let r = residency(&b.dir, &tag);
        if r["remote_chunks"] == 0 && r["source"].is_null() {
            break;
        }
        assert!(Instant::now() < deadline, "not all local: {r}");
        std::thread::sleep(Duration::from_millis(500));
    }
    ok(&b.dir, &["store", "verify"], &[]);
    // Children now need the hub no more: it is gone and they still start.
    drop(s3);
    let before = lazy_status(&b.dir).fetched_chunks;
    let out = ok(&b.dir, &["fork", "--tag", &tag, "-n", "2", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["children"].as_array().unwrap().len(), 2, "{out}");
    assert_eq!(lazy_status(&b.dir).fetched_chunks, before);
}

#[test]
fn a_dead_hub_stalls_running_children_until_it_returns_and_refuses_new_ones() {
    let tag = recorded_snapshot();
    let mut s3 = S3::start();
    let url = s3.url("two");
    ok(&paths().home, &["push", &tag, &url, "-q"], &s3.env());

    // Host B fetches only what reads need (no fill), so the snapshot stays
    // partly remote: "mid-fill" for as long as the test wants.
    let b = Home::new();
    let pb = Paths::new(&b.dir);
    drop(forkd_snapshot::store::open_rw(&pb).unwrap());
    let mut cfg = forkd_snapshot::mount_config(&pb).unwrap();
    cfg.no_fill = true;
    cfg.remote_deadline_secs = Some(300);
    forkd_fs::ensure_mounted(&cfg).unwrap();
    ok(&b.dir, &["pull", &url, &tag, "--lazy", "-q"], &s3.env());
    let mount = pb.mount_dir();

    block_on(async {
        let src = Source::resolve(&mount, &tag).unwrap();
        let kids = forkd_snapshot::fork::fork(&pb, &src, 1, 1, forkd_vmm::Lifetime::Ephemeral)
            .await
            .unwrap()
            .children;
        let vm = &kids[0].vm;
        assert_eq!(
            vm.agent
                .exec(sh("echo up"), &[])
                .await
                .unwrap()
                .result
                .exit_code,
            Some(0)
        );

        s3.kill();
        // forkd-fs's last "the hub answers" stands for a second (a burst of
        // spawns probes once); the restore above may have been quicker.
        std::thread::sleep(Duration::from_millis(1500));
        // A new child now gets a clear error instead of hanging on faults.
        let e = Source::resolve(&mount, &tag).unwrap_err();
        let se = e
            .downcast_ref::<SnapshotError>()
            .unwrap_or_else(|| panic!("not a snapshot error: {e:#}"));
        assert!(
            matches!(se, SnapshotError::RemoteUnavailable { .. }),
            "{e:#}"
        );
        let msg = format!("{e:#}");
        assert!(
            msg.contains("does not answer") && msg.contains(&url),
            "{msg}"
        );
        let (good, out) = forkd(&b.dir, &["fork", "--tag", &tag, "-n", "1"], &[]);
        assert!(!good && out.contains("does not answer"), "{out}");

        // The running child reads disk blocks nobody fetched yet: it
        // waits (the hub is down) ...
        {
            let spec = ExecSpec {
                timeout_ms: Some(300_000),
                ..sh("head -c 48000000 /dev/vda | md5sum")
            };
            let reader = vm.agent.exec(spec, &[]);
            tokio::pin!(reader);
            assert!(
                tokio::time::timeout(Duration::from_secs(4), &mut reader)
                    .await
                    .is_err(),
                "the read did not need the hub"
            );
            let st = lazy_status(&b.dir);
            assert!(st.retries > 0, "{st:?}");
            assert!(st.sources.iter().any(|s| !s.healthy), "{st:?}");
            // ... and carries on once the hub is back.
            s3.run();
            let r = tokio::time::timeout(Duration::from_secs(120), reader)
                .await
                .expect("the child did not resume after the hub came back")
                .unwrap();
            assert_eq!(r.result.exit_code, Some(0), "{r:?}");
            assert_eq!(
                vm.agent
                    .exec(sh("echo still"), &[])
                    .await
                    .unwrap()
                    .result
                    .exit_code,
                Some(0)
            );
        }
        let st = lazy_status(&b.dir);
        assert!(st.failures.is_empty(), "nothing failed for good: {st:?}");
        // And new children start again.
        Source::resolve(&mount, &tag).unwrap();
        destroy_all(kids).await;
    });
}

#[test]
fn a_chunk_corrupted_on_the_hub_is_refused() {
    let tag = recorded_snapshot();
    let s3 = S3::start();
    let url = s3.url("three");
    ok(&paths().home, &["push", &tag, &url, "-q"], &s3.env());

    // Flip a byte of vmstate's first chunk where s3s-fs keeps its pack.
    let p = paths();
    let sec = p
        .home
        .join(format!("sec-lazy-{}", forkd_snapshot::random_hex(3)));
    let victim = {
        let a = StoreReader::open_secondary(&p.store_dir(), &sec).unwrap();
        let rec = a.resolve(&tag).unwrap().unwrap();
        let m = a.manifest(&rec.files["vmstate"].manifest).unwrap();
        match (0..m.len())
            .map(|i| m.entry(i))
            .find(|e| *e != ChunkRef::Zero)
        {
            Some(ChunkRef::Chunk(c)) => c,
            _ => panic!("vmstate has no data"),
        }
    };
    let _ = std::fs::remove_dir_all(&sec);
    let objects = s3.root.join(BUCKET).join("three");
    let mut flipped = false;
    for e in std::fs::read_dir(objects.join("index")).unwrap() {
        let e = e.unwrap();
        let Ok(Key::Index(id)) = Key::parse(&format!("index/{}", e.file_name().to_string_lossy()))
        else {
            continue;
        };
        let index = Index::decode(&id, &std::fs::read(e.path()).unwrap()).unwrap();
        for pack in &index.packs {
            if let Some(en) = pack.entries.iter().find(|en| en.chunk == victim) {
                let path = objects.join(Key::Pack(pack.id).path());
                let mut b = std::fs::read(&path).unwrap();
                b[(en.offset + u64::from(en.len)) as usize - 5] ^= 0x10;
                std::fs::write(&path, b).unwrap();
                flipped = true;
            }
        }
    }
    assert!(
        flipped,
        "chunk {victim} is in no pack of {}",
        objects.display()
    );

    let b = Home::new();
    ok(&b.dir, &["pull", &url, &tag, "--lazy", "-q"], &s3.env());
    let (good, out) = forkd(&b.dir, &["fork", "--tag", &tag, "-n", "1"], &[]);
    assert!(!good, "a child restored from a corrupt vmstate: {out}");
    let st = lazy_status(&b.dir);
    let f = st
        .failures
        .iter()
        .find(|f| f.chunk == victim.to_string())
        .unwrap_or_else(|| panic!("the refusal is not reported: {st:?}"));
    assert!(f.error.contains("failed verification"), "{}", f.error);
    // Reading it through the mount fails too; the store never has it.
    let vmstate = Paths::new(&b.dir).mount_dir().join(&tag).join("vmstate");
    let e = std::fs::read(&vmstate).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let sec = b.dir.join("sec-check");
    let bs = StoreReader::open_secondary(&Paths::new(&b.dir).store_dir(), &sec).unwrap();
    assert_eq!(bs.has_chunks(&[victim]).unwrap(), vec![false]);
    ok(&b.dir, &["store", "verify"], &[]);
}

/// Pools refill only from snapshots whose working set is local. The hub's
/// packs are moved away before a lazy pull (which needs only records,
/// indexes and the working set), so no chunk can arrive: the pool parks
/// nothing and says why. Once the packs are back it fills, and its child
/// answers.
#[test]
fn a_pool_of_a_lazy_snapshot_waits_until_its_working_set_is_local() {
    let tag = recorded_snapshot();
    let s3 = S3::start();
    let url = s3.url("four");
    ok(&paths().home, &["push", &tag, &url, "-q"], &s3.env());
    let packs = s3.root.join(BUCKET).join("four").join("packs");
    let away = s3.root.join("packs-away");
    std::fs::rename(&packs, &away).unwrap();

    let b = Home::new();
    ok(&b.dir, &["pull", &url, &tag, "--lazy", "-q"], &s3.env());
    let p = Poold::start(&b.dir, &["--pool", &format!("{tag}=1")], None);
    block_on(async {
        // Held back, with the reason, for as long as the chunks are away
        // (several refill rounds).
        let waiting = p.wait_pool_until(&tag, |v| v["waiting"].is_string()).await;
        assert!(
            waiting["waiting"]
                .as_str()
                .unwrap()
                .contains("working set is still being fetched"),
            "{waiting}"
        );
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            let (_, v) = p.get(&format!("/v1/pools/{tag}")).await;
            assert_eq!(v["ready"], 0, "a child parked without its working set: {v}");
            assert_eq!(
                v["in_flight"], 0,
                "a restore started without its working set: {v}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(lazy_status(&b.dir).fetched_chunks, 0);

        // The chunks can be fetched again: the pool fills, and says nothing.
        std::fs::rename(&away, &packs).unwrap();
        let v = p
            .wait_pool_until(&tag, |v| v["ready"] == 1 && v["in_flight"] == 0)
            .await;
        assert!(v["waiting"].is_null(), "{v}");
        assert!(lazy_status(&b.dir).fetched_chunks > 0);
        let (st, v) = p
            .post("/v1/sandboxes", serde_json::json!({"snapshot_tag": tag}))
            .await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(v[0]["pool_hit"], true, "{v}");
        let id = v[0]["id"].as_str().unwrap().to_string();
        let (st, _) = p.delete(&format!("/v1/sandboxes/{id}")).await;
        assert!(st == 204 || st == 200, "{st}");
    });
}
