//! Snapshot hub tests against real hubs: a `file://` directory, a real
//! `forkd hub serve` process on 127.0.0.1, and a real S3-compatible server
//! (s3s-fs) on 127.0.0.1. Snapshots are synthetic (no VMs): a guest-memory
//! -like `memory.bin`, a `vmstate` and a `rootfs.img`, and a chain head that
//! shares most chunks with its base.

use forkd_hub::pack::{PackIndex, PackReader, FOOTER_LEN, FOOTER_MAGIC};
use forkd_hub::packs::Index;
use forkd_hub::{pull, push, Hub, Key, PullOptions, PushOptions};
use forkd_layers::{synth, IngestOptions, NewSnapshot, SnapshotId, Store, StoreOptions};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MEM: u64 = 16 << 20;

fn open(dir: &Path) -> Arc<Store> {
    Arc::new(Store::open(dir, StoreOptions::default()).unwrap())
}

/// A store holding `base` and `head` (a child of base with dirty memory
/// pages, a new vmstate and the same rootfs).
struct Fixture {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    base: SnapshotId,
    head: SnapshotId,
}

fn fixture(chunk_size: u32) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let (store, base, head) = build_chain(dir.path(), chunk_size, MEM);
    Fixture {
        _dir: dir,
        store,
        base,
        head,
    }
}

/// Builds `<dir>/store` with tags `base` and `head` (`mem` bytes of memory).
fn build_chain(dir: &Path, chunk_size: u32, mem_len: u64) -> (Arc<Store>, SnapshotId, SnapshotId) {
    let store = Arc::new(
        Store::open(
            &dir.join("store"),
            StoreOptions {
                chunk_size,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let mem = dir.join("memory.bin");
    let f = std::fs::File::create(&mem).unwrap();
    f.set_len(mem_len).unwrap();
    synth::guest_memory(11, mem_len, |off, page| {
        std::os::unix::fs::FileExt::write_all_at(&f, page, off).unwrap()
    });
    let config = serde_json::json!({"qemu_version": "10.0.2", "machine_signature": "test"});
    let rootfs = synth::mixed_file(5, (mem_len / 5) as usize, 65536);
    let ing = |r: &[u8]| store.ingest_reader(r, &IngestOptions::default()).unwrap();
    let base_mem = store.ingest_file(&mem, &IngestOptions::default()).unwrap();
    let files = BTreeMap::from([
        ("memory.bin".to_string(), base_mem.file_ref()),
        (
            "vmstate".to_string(),
            ing(&synth::mixed_file(6, 70_000, 4096)).file_ref(),
        ),
        ("rootfs.img".to_string(), ing(&rootfs).file_ref()),
    ]);
    let base = store
        .commit_snapshot(NewSnapshot {
            files: files.clone(),
            config: config.clone(),
            tag: Some("base".into()),
            ..Default::default()
        })
        .unwrap();
    // The head: 48 scattered pages rewritten.
    let mut dirty = Vec::new();
    let mut rng = synth::SplitMix64(99);
    for _ in 0..48 {
        let off = rng.below(mem_len / 4096) * 4096;
        let mut page = vec![0u8; 4096];
        synth::fill_page(&mut rng, synth::PageKind::Code, &mut page);
        std::os::unix::fs::FileExt::write_all_at(&f, &page, off).unwrap();
        dirty.push(off..off + 4096);
    }
    let head_mem = store
        .ingest_file(
            &mem,
            &IngestOptions {
                base: Some(base_mem.manifest),
                dirty: Some(dirty),
                ..Default::default()
            },
        )
        .unwrap();
    let mut files = files;
    files.insert("memory.bin".into(), head_mem.file_ref());
    files.insert(
        "vmstate".into(),
        ing(&synth::mixed_file(7, 70_000, 4096)).file_ref(),
    );
    let head = store
        .commit_snapshot(NewSnapshot {
            parent: Some(base.id),
            files,
            config,
            tag: Some("head".into()),
            ..Default::default()
        })
        .unwrap();
    std::fs::remove_file(&mem).unwrap();
    (store, base.id, head.id)
}

fn read_all(store: &Store, id: &SnapshotId, name: &str) -> Vec<u8> {
    let f = store.open_file(id, name).unwrap();
    let mut buf = vec![0u8; f.size() as usize];
    f.read_exact_at(&mut buf, 0).unwrap();
    buf
}

/// `dst` has snapshot `id` with the same record and byte-identical files.
fn assert_same(src: &Store, dst: &Store, id: &SnapshotId) {
    let rec = src.snapshot(id).unwrap().unwrap();
    assert_eq!(dst.snapshot(id).unwrap().as_ref(), Some(&rec));
    for name in rec.files.keys() {
        assert!(
            read_all(src, id, name) == read_all(dst, id, name),
            "{name} differs"
        );
    }
}

fn quiet_push() -> PushOptions {
    PushOptions {
        quiet: true,
        ..Default::default()
    }
}

fn quiet_pull() -> PullOptions {
    PullOptions {
        quiet: true,
        ..Default::default()
    }
}

/// The scenario on any hub: push base, push head (only the head's
/// unique chunks move), pull into an empty store (byte-exact), pull the head
/// into a store that has the base (only unique chunks move).
async fn scenario(hub: &Hub, fx: &Fixture) {
    let src = &fx.store;
    let base_rec = src.snapshot(&fx.base).unwrap().unwrap();
    let base_chunks = src.snapshot_chunks(&base_rec).unwrap().len() as u64;
    let r = push(src.view(), "base", hub, &quiet_push()).await.unwrap();
    assert_eq!((r.chunks, r.snapshots), (base_chunks, 1));
    let diff = src.diff(&fx.base, &fx.head).unwrap();
    assert!(diff.new_chunks > 0 && diff.new_chunks < base_chunks / 4);
    let r = push(src.view(), "head", hub, &quiet_push()).await.unwrap();
    assert_eq!(
        r.chunks, diff.new_chunks,
        "second push moves only the head's chunks"
    );
    assert_eq!(r.stored_bytes, diff.new_stored_bytes);
    assert_eq!(r.raw_bytes, diff.new_raw_bytes);
    assert_eq!(r.snapshots, 1);
    // Pushing again moves nothing.
    let r = push(src.view(), "head", hub, &quiet_push()).await.unwrap();
    assert_eq!((r.chunks, r.snapshots, r.manifests), (0, 0, 0));

    // Pull the head into an empty store: the whole chain arrives, ids kept.
    let d1 = tempfile::tempdir().unwrap();
    let s1 = open(d1.path());
    let r = pull(s1.clone(), hub, "head", &quiet_pull()).await.unwrap();
    assert_eq!(r.snapshots, 2);
    assert_eq!(r.stored_bytes, src.stats().unwrap().live_stored_bytes);
    assert_same(src, &s1, &fx.head);
    assert_same(src, &s1, &fx.base);
    assert_eq!(s1.tag("head").unwrap(), Some(fx.head));
    assert_eq!(s1.ancestors(&fx.head).unwrap(), vec![fx.base]);
    assert!(s1.verify().unwrap().is_ok());
    // Pulling again moves nothing.
    let r = pull(s1.clone(), hub, "head", &quiet_pull()).await.unwrap();
    assert_eq!((r.chunks, r.snapshots), (0, 0));

    // A store that has the base fetches only the head's unique chunks.
    let d2 = tempfile::tempdir().unwrap();
    let s2 = open(d2.path());
    pull(s2.clone(), hub, "base", &quiet_pull()).await.unwrap();
    let opts = PullOptions {
        as_tag: Some("renamed".into()),
        ..quiet_pull()
    };
    let r = pull(s2.clone(), hub, "head", &opts).await.unwrap();
    assert_eq!(
        r.chunks, diff.new_chunks,
        "only the head's unique chunks move"
    );
    assert_eq!(r.stored_bytes, diff.new_stored_bytes);
    assert_eq!(r.snapshots, 1);
    assert_same(src, &s2, &fx.head);
    assert_eq!(s2.tag("renamed").unwrap(), Some(fx.head));
    assert!(s2.verify().unwrap().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_hub_moves_only_missing_chunks() {
    let fx = fixture(65536);
    let dir = tempfile::tempdir().unwrap();
    let hub = Hub::open(&format!("file://{}", dir.path().display()), None).unwrap();
    scenario(&hub, &fx).await;
    // Layout: records and tags by name, chunks fanned out by id.
    assert!(dir
        .path()
        .join(format!("snapshots/{}.json", fx.head))
        .is_file());
    assert!(dir.path().join("tags/head").is_file());
    assert!(Hub::open("file://relative", None).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_byte_in_hub_chunk_fails_cleanly() {
    for layout in [1, 2] {
        let fx = fixture(65536);
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::open(&format!("file://{}", dir.path().display()), None).unwrap();
        flipped_byte(&fx, &hub, dir.path(), layout).await;

        // The same through `forkd hub serve`, whose objects live in its dir.
        let served = tempfile::tempdir().unwrap();
        let tf = token_file(served.path());
        let (_server, url) = start_hub_server(&served.path().join("hub"), &tf);
        let hub = Hub::open(&url, Some(TOKEN.into())).unwrap();
        flipped_byte(&fx, &hub, &served.path().join("hub"), layout).await;
    }
}

/// Where a chunk's object bytes are in a hub directory: its own object
/// (layout 1), or its range of a pack (layout 2, found through the index
/// objects). Returns the file and the offset of the chunk object's end.
fn chunk_bytes(objects: &Path, chunk: &forkd_layers::ChunkId) -> (PathBuf, usize) {
    let own = objects.join(Key::Chunk(*chunk).path());
    if own.is_file() {
        return (own.clone(), std::fs::metadata(&own).unwrap().len() as usize);
    }
    for e in std::fs::read_dir(objects.join("index")).unwrap() {
        let e = e.unwrap();
        let id: forkd_layers::ObjectId = e.file_name().to_string_lossy().parse().unwrap();
        let index = Index::decode(&id, &std::fs::read(e.path()).unwrap()).unwrap();
        for p in &index.packs {
            if let Some(en) = p.entries.iter().find(|en| en.chunk == *chunk) {
                let end = (en.offset + u64::from(en.len)) as usize;
                return (objects.join(Key::Pack(p.id).path()), end);
            }
        }
    }
    panic!("chunk {chunk} is nowhere on the hub");
}

/// Pushes the head, flips a byte of one of its chunks in the hub's
/// directory `objects`, and checks that pulls fail naming the chunk and
/// commit nothing, with or without the base already in the store.
async fn flipped_byte(fx: &Fixture, hub: &Hub, objects: &Path, layout: u32) {
    let opts = PushOptions {
        layout: Some(layout),
        ..quiet_push()
    };
    let r = push(fx.store.view(), "head", hub, &opts).await.unwrap();
    assert_eq!(r.layout, layout);
    // Corrupt one chunk of the head that is not in the base.
    let head = fx.store.snapshot(&fx.head).unwrap().unwrap();
    let base = fx.store.snapshot(&fx.base).unwrap().unwrap();
    let in_base = fx.store.snapshot_chunks(&base).unwrap();
    let victim = fx
        .store
        .snapshot_chunks(&head)
        .unwrap()
        .into_iter()
        .find(|c| !in_base.contains(c))
        .unwrap();
    let (path, end) = chunk_bytes(objects, &victim);
    let mut b = std::fs::read(&path).unwrap();
    b[end - 7] ^= 0x40;
    std::fs::write(&path, b).unwrap();

    for have_base in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let s = open(d.path());
        if have_base {
            pull(s.clone(), hub, &fx.base.to_string(), &quiet_pull())
                .await
                .unwrap();
        }
        let before = s.stats().unwrap();
        let snaps = s.list_snapshots().unwrap();
        let e = pull(s.clone(), hub, "head", &quiet_pull())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(&victim.to_string()), "{e}");
        assert!(e.contains("failed verification"), "{e}");
        let after = s.stats().unwrap();
        assert_eq!(s.list_snapshots().unwrap(), snaps, "no snapshot committed");
        assert_eq!(
            (after.chunks, after.manifests),
            (before.chunks, before.manifests)
        );
        assert_eq!(s.tag("head").unwrap(), None);
        assert!(s.verify().unwrap().is_ok());
    }
}

/// Runs in a child process (see `killed_pull_resumes`): pulls and SIGKILLs
/// itself right after the first durable import batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper run by killed_pull_resumes in a child process"]
async fn kill_child() {
    let (Ok(hub), Ok(store)) = (
        std::env::var("HUB_KILL_HUB"),
        std::env::var("HUB_KILL_STORE"),
    ) else {
        return;
    };
    let hub = Hub::open(&hub, std::env::var("HUB_KILL_TOKEN").ok()).unwrap();
    let opts = PullOptions {
        on_chunks: Some(Arc::new(|n| {
            if n > 0 {
                // SAFETY: kill(2) on ourselves; this is the test's crash.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
        })),
        jobs: Some(2),
        ..quiet_pull()
    };
    pull(open(Path::new(&store)), &hub, "head", &opts)
        .await
        .unwrap();
    panic!("the pull should have been killed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_pull_resumes() {
    // 16 KiB chunks: ~600 chunks, several durable import batches.
    let fx = fixture(16384);
    let dir = tempfile::tempdir().unwrap();
    killed_pull(&fx, &format!("file://{}", dir.path().display()), None).await;

    let served = tempfile::tempdir().unwrap();
    let tf = token_file(served.path());
    let (_server, url) = start_hub_server(&served.path().join("hub"), &tf);
    killed_pull(&fx, &url, Some(TOKEN)).await;
}

/// Pushes the head to `url`, SIGKILLs a pull of it in a child process
/// after its first durable batch, and checks the store is consistent and
/// the next pull moves only what the killed one had not.
async fn killed_pull(fx: &Fixture, url: &str, token: Option<&str>) {
    let hub = Hub::open(url, token.map(String::from)).unwrap();
    let pushed = push(fx.store.view(), "head", &hub, &quiet_push())
        .await
        .unwrap();
    assert!(pushed.chunks > 400, "{}", pushed.chunks);

    let dst = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap());
    child
        .args(["--exact", "kill_child", "--ignored", "--nocapture"])
        .env("HUB_KILL_HUB", url)
        .env("HUB_KILL_STORE", dst.path());
    if let Some(t) = token {
        child.env("HUB_KILL_TOKEN", t);
    }
    let status = child.status().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{url}: {status:?}");

    let s = open(dst.path());
    assert!(s.verify().unwrap().is_ok(), "consistent after kill -9");
    assert!(s.list_snapshots().unwrap().is_empty(), "nothing committed");
    let kept = s.stats().unwrap().chunks;
    assert!(kept > 0 && kept < pushed.chunks, "{url}: {kept}");
    let r = pull(s.clone(), &hub, "head", &quiet_pull()).await.unwrap();
    assert_eq!(r.chunks, pushed.chunks - kept, "{url}: the re-run resumes");
    assert_same(&fx.store, &s, &fx.head);
    assert!(s.verify().unwrap().is_ok());
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn forkd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_forkd"))
}

/// Starts `forkd hub serve DIR --bind 127.0.0.1:0 --token-file F`; returns
/// the process and its URL.
fn start_hub_server(dir: &Path, token_file: &Path) -> (Proc, String) {
    let mut child = forkd()
        .args(["hub", "serve"])
        .arg(dir)
        .args(["--bind", "127.0.0.1:0", "--token-file"])
        .arg(token_file)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_string();
    (Proc(child), url)
}

const TOKEN: &str = "b7Qx9-Lm2Pz4Rt8Vw1Ny6Kc3Hd5Jf0Gs_T";

fn token_file(dir: &Path) -> PathBuf {
    let p = dir.join("token");
    std::fs::write(&p, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_hub_served_by_forkd_hub_serve() {
    let fx = fixture(65536);
    let dir = tempfile::tempdir().unwrap();
    let tf = token_file(dir.path());
    let (_server, url) = start_hub_server(&dir.path().join("hub"), &tf);
    let hub = Hub::open(&url, Some(TOKEN.into())).unwrap();
    scenario(&hub, &fx).await;

    // Without the token, or with a wrong one: refused.
    for tok in [None, Some("x".repeat(40))] {
        let bad = Hub::open(&url, tok).unwrap();
        let e = pull(
            open(tempfile::tempdir().unwrap().path()),
            &bad,
            "head",
            &quiet_pull(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(e.contains("401"), "{e}");
    }
    // The server verifies what it is sent.
    let client = forkd_api::http_builder().build().unwrap();
    let put = |path: String, body: Vec<u8>| {
        client
            .put(format!("{url}/v1/objects/{path}"))
            .bearer_auth(TOKEN)
            .body(body)
            .send()
    };
    let id = forkd_layers::ChunkId::of(b"hello");
    let mut obj = b"FKHC\0\0\0\0".to_vec();
    obj.extend_from_slice(&5u32.to_le_bytes());
    obj.extend_from_slice(b"hellO");
    let r = put(Key::Chunk(id).path(), obj).await.unwrap();
    assert_eq!(r.status(), 422, "{:?}", r.text().await);
    let m = forkd_layers::FileManifest::new(
        5,
        4096,
        &[forkd_layers::ChunkRef::Chunk(forkd_layers::ChunkId::of(
            b"absent",
        ))],
    )
    .unwrap();
    let r = put(Key::Manifest(m.id()).path(), m.encode()).await.unwrap();
    assert_eq!(r.status(), 409);
    let r = put("tags/..%2F..%2Fx".into(), b"{}".to_vec())
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // A non-loopback bind without a token is refused.
    let out = forkd()
        .args([
            "hub",
            "serve",
            "/tmp/forkd-hub-never",
            "--bind",
            "0.0.0.0:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("without a token"));
}

/// Re-writes a pack's index (and footer) through `f`.
fn rewrite_index(path: &Path, f: impl FnOnce(&mut PackIndex)) {
    let mut b = std::fs::read(path).unwrap();
    let n = b.len();
    let footer = &b[n - FOOTER_LEN as usize..];
    let off = u64::from_le_bytes(footer[0..8].try_into().unwrap()) as usize;
    let mut index: PackIndex = serde_json::from_slice(&b[off..n - FOOTER_LEN as usize]).unwrap();
    f(&mut index);
    let json = serde_json::to_vec(&index).unwrap();
    b.truncate(off);
    b.extend_from_slice(&json);
    b.extend_from_slice(&(off as u64).to_le_bytes());
    b.extend_from_slice(&(json.len() as u64).to_le_bytes());
    b.extend_from_slice(blake3::hash(&json).as_bytes());
    b.extend_from_slice(FOOTER_MAGIC);
    std::fs::write(path, b).unwrap();
}

#[test]
fn pack_and_unpack_with_the_cli() {
    let fx = fixture(65536);
    let home = tempfile::tempdir().unwrap();
    // The CLI opens $FORKD_HOME/store: give it a copy of the fixture via a pack.
    let pack = home.path().join("head.fkpack");
    let progress = forkd_snapshot::Progress::quiet();
    forkd_hub::pack::write_pack(&fx.store, &fx.head, Some("head"), &pack, &progress).unwrap();

    let unpack = |file: &Path, extra: &[&str]| {
        forkd()
            .arg("--home")
            .arg(home.path())
            .arg("unpack")
            .arg(file)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = unpack(&pack, &["--as", "copy", "--quiet"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let store_dir = home.path().join("store");
    {
        let s = Store::open(&store_dir, StoreOptions::default()).unwrap();
        assert_same(&fx.store, &s, &fx.head);
        assert_eq!(s.tag("copy").unwrap(), Some(fx.head));
    }
    // Pack it again with the CLI and compare the bytes it holds.
    let pack2 = home.path().join("again.fkpack");
    let out = forkd()
        .arg("--home")
        .arg(home.path())
        .args(["pack", "copy", "-q", "-o"])
        .arg(&pack2)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = PackReader::open(&pack2).unwrap();
    assert_eq!((r.snapshot, r.tag.as_deref()), (fx.head, Some("copy")));

    // Refused packs: traversal, bad ids, bad tags, corrupt bytes.
    type Edit = Box<dyn Fn(&mut PackIndex)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "traversal",
            Box::new(|i| i.objects[0].0 = "../../etc/passwd".into()),
        ),
        (
            "absolute",
            Box::new(|i| i.objects[0].0 = "/etc/passwd".into()),
        ),
        (
            "dotdot inside",
            Box::new(|i| {
                let p = i.objects[0].0.clone();
                i.objects[0].0 = p.replacen("chunks/", "chunks/../", 1);
            }),
        ),
        (
            "bad id",
            Box::new(|i| i.objects[0].0 = "chunks/ab/abXYZ".into()),
        ),
        ("bad tag", Box::new(|i| i.tag = Some("../evil".into()))),
        (
            "bad tag object",
            Box::new(|i| {
                let last = i.objects.len() - 1;
                i.objects[last].0 = "tags/no way".into()
            }),
        ),
        ("out of range", Box::new(|i| i.objects[0].2 = 1 << 40)),
    ];
    for (what, f) in cases {
        let p = home
            .path()
            .join(format!("bad-{}.fkpack", what.replace(' ', "-")));
        std::fs::copy(&pack, &p).unwrap();
        rewrite_index(&p, f);
        let e = PackReader::open(&p)
            .err()
            .unwrap_or_else(|| panic!("{what}: accepted"));
        assert!(e.to_string().contains("refused"), "{what}: {e}");
        let out = unpack(&p, &["--as", "bad"]);
        assert!(!out.status.success(), "{what}");
    }
    // A flipped byte inside a chunk: refused before anything is committed.
    let bad = home.path().join("flipped.fkpack");
    let mut b = std::fs::read(&pack).unwrap();
    b[40] ^= 1; // inside the first chunk object's payload
    std::fs::write(&bad, b).unwrap();
    let fresh = tempfile::tempdir().unwrap();
    let out = forkd()
        .arg("--home")
        .arg(fresh.path())
        .args(["unpack", "--quiet"])
        .arg(&bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("failed verification"), "{err}");
    let s = Store::open(&fresh.path().join("store"), StoreOptions::default()).unwrap();
    assert!(s.list_snapshots().unwrap().is_empty());
    assert_eq!(s.stats().unwrap().chunks, 0);
}

#[test]
fn cli_push_and_pull_through_a_file_hub() {
    let fx = fixture(65536);
    let src_home = tempfile::tempdir().unwrap();
    let hub_dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", hub_dir.path().display());
    // Seed the CLI's store from the fixture through the library.
    let hub = Hub::open(&url, None).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(push(fx.store.view(), "head", &hub, &quiet_push()))
        .unwrap();
    let dst_home = tempfile::tempdir().unwrap();
    let run = |home: &Path, args: &[&str]| {
        let out = forkd().arg("--home").arg(home).args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, out) = run(dst_home.path(), &["pull", &url, "head", "--as", "mine"]);
    assert!(ok, "{out}");
    assert!(out.contains("pulled head"), "{out}");
    // Not a terminal: plain progress lines, and the QEMU warning came first.
    assert!(out.contains("warning:"), "{out}");
    let (ok, out) = run(
        dst_home.path(),
        &["pull", &url, "head", "--as", "mine", "--strict"],
    );
    assert!(!ok && out.contains("--strict"), "{out}");
    // Push back under another hub tag, from the pulled copy.
    let (ok, out) = run(
        dst_home.path(),
        &["push", "mine", &url, "--as", "again", "-q"],
    );
    assert!(ok, "{out}");
    assert!(out.contains("0 of"), "nothing new to send: {out}");
    let _ = src_home;
    let s = Store::open(&dst_home.path().join("store"), StoreOptions::default()).unwrap();
    assert_same(&fx.store, &s, &fx.head);
    assert!(hub_dir.path().join("tags/again").is_file());
}

/// The s3s-fs binary: $FORKD_TEST_S3S_FS, else on PATH, else where
/// `cargo install` puts it.
fn s3s_fs() -> PathBuf {
    if let Some(p) = std::env::var_os("FORKD_TEST_S3S_FS") {
        return PathBuf::from(p);
    }
    let mut dirs: Vec<PathBuf> =
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).collect();
    dirs.push("/usr/local/bin".into());
    if let Some(h) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(h).join(".cargo/bin"));
    }
    dirs.into_iter()
        .map(|d| d.join("s3s-fs"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "s3s-fs (the S3-compatible test server) is not installed: run scripts/setup.sh, or \
                 cargo install s3s-fs --version 0.14.1 --features binary --locked --root /usr/local"
            )
        })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_hub_on_a_real_s3_server() {
    let fx = fixture(65536);
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("forkd-test")).unwrap(); // the bucket
    let (key, secret) = ("forkdtestkey", "forkd-test-secret-0123456789");
    let port = free_port();
    let child = Command::new(s3s_fs())
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", key, "--secret-key", secret])
        .arg(root.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting s3s-fs");
    let _server = Proc(child);
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "s3s-fs did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The usual AWS environment, as a user would set it. Only this test
    // reads these variables.
    std::env::set_var("AWS_ACCESS_KEY_ID", key);
    std::env::set_var("AWS_SECRET_ACCESS_KEY", secret);
    std::env::set_var("AWS_REGION", "us-east-1");
    std::env::set_var("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"));
    let hub = Hub::open("s3://forkd-test/hubs/one", None).unwrap();
    scenario(&hub, &fx).await;
    // The objects are in the bucket under the prefix, named as on any hub.
    let tag = root.path().join("forkd-test/hubs/one/tags/head");
    assert!(tag.is_file(), "{}", tag.display());
    // A push of the chain is tens of requests, not one per chunk.
    let fresh = Hub::open("s3://forkd-test/hubs/requests", None).unwrap();
    let r = push(fx.store.view(), "head", &fresh, &quiet_push())
        .await
        .unwrap();
    assert!(r.chunks > 200, "{}", r.chunks);
    assert!(
        r.requests < 40,
        "{} requests for {} chunks",
        r.requests,
        r.chunks
    );
    // Lazy: records, manifests and locations in a handful of requests; then
    // ranged reads give the bytes.
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    let lazy = PullOptions {
        lazy: true,
        ..quiet_pull()
    };
    let r = pull(s.clone(), &fresh, "head", &lazy).await.unwrap();
    assert_eq!((r.chunks, r.snapshots), (0, 2));
    assert!(r.remote_chunks > 200 && r.requests < 20, "{r:?}");
    assert!(!s
        .residency(&s.snapshot(&fx.head).unwrap().unwrap())
        .unwrap()
        .is_local());
    // A full pull afterwards completes it.
    let r = pull(s.clone(), &fresh, "head", &quiet_pull())
        .await
        .unwrap();
    assert!(r.chunks > 200, "{r:?}");
    assert!(s.lazy_snapshots().unwrap().is_empty());
    assert_same(&fx.store, &s, &fx.head);
    assert!(s.verify().unwrap().is_ok());
    // With a working set the push publishes before the rest of its packs,
    // each promised, asked for and delivered, and the markers are gone
    // after: through the S3 protocol's LIST and DELETE.
    record_working_set(&fx, 16);
    let early = Hub::open("s3://forkd-test/hubs/early", None).unwrap();
    let opts = PushOptions {
        pack_bytes: Some(1 << 20),
        ..quiet_push()
    };
    let r = push(fx.store.view(), "head", &early, &opts).await.unwrap();
    assert!(r.late_packs > 0, "{}", r.summary());
    assert!(r.requests < 100, "{}", r.summary());
    let markers = root.path().join("forkd-test/hubs/early/pending");
    assert!(
        std::fs::read_dir(&markers).map_or(true, |mut d| d.next().is_none()),
        "markers left in {}",
        markers.display()
    );
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    pull(s.clone(), &early, "head", &quiet_pull())
        .await
        .unwrap();
    assert_same(&fx.store, &s, &fx.head);
    // Big have/want batches list fan-out directories instead of HEADing
    // (a layout-1 hub).
    let v1 = Hub::open("s3://forkd-test/hubs/v1", None).unwrap();
    let opts = PushOptions {
        layout: Some(1),
        ..quiet_push()
    };
    push(fx.store.view(), "head", &v1, &opts).await.unwrap();
    let hub = v1;
    let all: Vec<Key> = fx
        .store
        .snapshot_chunks(&fx.store.snapshot(&fx.head).unwrap().unwrap())
        .unwrap()
        .into_iter()
        .map(Key::Chunk)
        .chain((0..600).map(|i| Key::Chunk(forkd_layers::ChunkId::of(&[i as u8, 1]))))
        .collect();
    let have = hub.has(&all).await.unwrap();
    let n = have.len();
    assert!(have[..n - 600].iter().all(|h| *h) && have[n - 600..].iter().all(|h| !h));
    // Wrong credentials: refused by the server.
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "wrong-secret-wrong-secret");
    let bad = Hub::open("s3://forkd-test/hubs/one", None).unwrap();
    assert!(bad.get(&Key::tag("head").unwrap()).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_reports_the_unique_bytes() {
    let fx = fixture(65536);
    let work = tempfile::tempdir().unwrap();
    for hub in [None, Some("serve".to_string())] {
        let opts = forkd_hub::bench::BenchOptions {
            base: "base".into(),
            head: "head".into(),
            hub,
            token: None,
            jobs: None,
            work_dir: work.path().to_path_buf(),
        };
        let r = forkd_hub::bench::run(fx.store.clone(), &opts)
            .await
            .unwrap();
        let text = r.render();
        assert!(text.contains("exactly the unique chunks"), "{text}");
        assert_eq!(r.steps.len(), 5);
        assert_eq!(
            r.steps[4].report.stored_bytes, r.unique_stored_bytes,
            "{text}"
        );
        // --json: the same figures, and they read back as written.
        let file = work.path().join("hub.json");
        let j = r.json_report("base", "head", vec!["forkd".into()]);
        j.write(&file).unwrap();
        let back: forkd_hub::bench::JsonReport =
            serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        std::fs::remove_file(&file).unwrap();
        assert_eq!(back, j);
        assert_eq!(back.bench, "hub");
        assert_eq!(
            back.hub_kind,
            if opts.hub.is_none() { "file" } else { "serve" }
        );
        assert_eq!(back.steps.len(), 5);
        assert_eq!(back.steps[1].stored_bytes, r.unique_stored_bytes);
        assert_eq!(back.steps[1].name, "push head (hub has base)");
    }
    // Scratch space is removed.
    assert_eq!(std::fs::read_dir(work.path()).unwrap().count(), 0);
}

/// Builds a FORKD_HOME with a larger synthetic chain for `forkd hub bench`:
/// `HUB_BENCH_HOME=/tmp/h HUB_BENCH_MIB=512 cargo test --release --test hub -- --ignored make_bench_home`.
#[test]
#[ignore = "builds benchmark input on request"]
fn make_bench_home() {
    let Ok(home) = std::env::var("HUB_BENCH_HOME") else {
        return;
    };
    let mib: u64 = std::env::var("HUB_BENCH_MIB").map_or(256, |v| v.parse().unwrap());
    let (_, base, head) = build_chain(Path::new(&home), 65536, mib << 20);
    println!("built base {base} and head {head} in {home}/store");
}

/// A record as a hostile hub would serve it, naming one `memory.bin`
/// manifest the hub does not have.
fn forged_record(
    id: u8,
    parent: Option<SnapshotId>,
    config: serde_json::Value,
    mem: u64,
) -> Vec<u8> {
    let files = BTreeMap::from([(
        "memory.bin".to_string(),
        forkd_layers::FileRef {
            manifest: forkd_layers::ManifestId::default(),
            size: mem,
        },
    )]);
    let rec = forkd_layers::SnapshotRecord {
        id: SnapshotId([id; 16]),
        parent,
        files,
        config,
        lineage: BTreeMap::new(),
        created_at_unix: 1,
    };
    serde_json::to_vec(&rec).unwrap()
}

/// A hub serving a long chain of near-maximal records: the pull stops at
/// its record budget instead of holding every record in memory. (Before
/// the budget, the pull read all of them and failed only later, at the
/// first missing manifest.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_of_huge_records_is_refused_early() {
    let dir = tempfile::tempdir().unwrap();
    let hub = Hub::open(&format!("file://{}", dir.path().display()), None).unwrap();
    let pad = "x".repeat(3 << 20);
    let mut parent = None;
    for i in 1..=24u8 {
        let bytes = forged_record(i, parent, serde_json::json!({ "pad": pad }), 1 << 20);
        let id = SnapshotId([i; 16]);
        hub.put(&Key::Snapshot(id), bytes.into()).await.unwrap();
        parent = Some(id);
    }
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    let head = parent.unwrap().to_string();
    let e = pull(s.clone(), &hub, &head, &quiet_pull())
        .await
        .unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("records pass 64 MiB"), "{e}");
    assert!(s.view().list_snapshots().unwrap().is_empty());
}

/// A pulled record may not choose the child's CPU model or size its memory
/// past this host: a forged VM config is refused before any transfer,
/// naming what is wrong. (Before, such a pull only checked the QEMU version
/// and machine signature, which a forger sets to match.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_vm_config_is_refused() {
    use forkd_snapshot::VmConfig;
    use forkd_vmm::{Accel, Machine, MACHINE_TYPE};
    let dir = tempfile::tempdir().unwrap();
    let hub = Hub::open(&format!("file://{}", dir.path().display()), None).unwrap();
    let config = |m: Machine| {
        serde_json::to_value(VmConfig {
            qemu_version: forkd_vmm::qemu_version().unwrap_or_default(),
            machine_signature: m.signature(),
            machine_type: MACHINE_TYPE.into(),
            machine: m,
            kernel_blake3: String::new(),
            initrd_blake3: String::new(),
            cmdline: String::new(),
            image: "minimal".into(),
            image_built_at_unix: 0,
            host_cpu: None,
            volumes: Vec::new(),
        })
        .unwrap()
    };
    let mut evil_cpu = Machine::new(Accel::Tcg, 256, 1);
    evil_cpu.cpu = "max,+pdpe1gb".into();
    let huge = Machine::new(Accel::Tcg, 1 << 30, 1);
    let many = Machine::new(Accel::Tcg, 256, 100_000);
    let cases = [
        (
            1u8,
            config(evil_cpu),
            256u64 << 20,
            "CPU model \"max,+pdpe1gb\"",
        ),
        (2, config(huge), 1 << 50, "MiB of memory"),
        (3, config(many), 256 << 20, "100000 vCPUs"),
        (
            4,
            config(Machine::new(Accel::Tcg, 256, 1)),
            4096,
            "memory.bin is 4096 bytes",
        ),
    ];
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    for (i, cfg, mem, want) in cases {
        let id = SnapshotId([i; 16]);
        hub.put(&Key::Snapshot(id), forged_record(i, None, cfg, mem).into())
            .await
            .unwrap();
        let e = pull(s.clone(), &hub, &id.to_string(), &quiet_pull())
            .await
            .unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains("cannot be trusted") && e.contains(want), "{e}");
    }
    // A sane config passes the check and the pull goes on (to fail at the
    // manifest this fake hub does not have).
    let id = SnapshotId([9; 16]);
    let sane = config(Machine::new(Accel::Tcg, 256, 1));
    hub.put(
        &Key::Snapshot(id),
        forged_record(9, None, sane, 256 << 20).into(),
    )
    .await
    .unwrap();
    let e = pull(s.clone(), &hub, &id.to_string(), &quiet_pull())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("lacks manifest"), "{e:#}");
    assert!(s.view().list_snapshots().unwrap().is_empty());
}

/// Gives `head` a working set of the first `slots` chunk slots of its
/// memory.bin.
fn record_working_set(fx: &Fixture, slots: u32) {
    let mut ws = forkd_layers::WorkingSet::new();
    for s in 0..slots {
        ws.push("memory.bin", s);
    }
    fx.store.set_working_set(&fx.head, &ws).unwrap();
}

/// The pending markers in a file hub's directory, by pack file name.
fn pending_markers(hub_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(hub_dir.join("pending"))
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn pack_path(hub_dir: &Path, pack: &str) -> PathBuf {
    hub_dir.join("packs").join(&pack[..2]).join(pack)
}

/// What a file hub held when the push said it had published.
#[derive(Debug, Default)]
struct AtPublish {
    tag: bool,
    markers: Vec<String>,
    packs_up: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_publishes_once_the_working_set_is_up_and_promises_the_rest() {
    let fx = fixture(65536);
    record_working_set(&fx, 16);
    let dir = tempfile::tempdir().unwrap();
    let hub_dir = dir.path().to_path_buf();
    let hub = Hub::open(&format!("file://{}", hub_dir.display()), None).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(None));
    let opts = PushOptions {
        pack_bytes: Some(1 << 20),
        on_publish: Some(Arc::new({
            let (seen, hub_dir) = (seen.clone(), hub_dir.clone());
            move |_p: &forkd_hub::Published| {
                let markers = pending_markers(&hub_dir);
                let packs_up = markers
                    .iter()
                    .filter(|m| pack_path(&hub_dir, m).exists())
                    .count();
                *seen.lock().unwrap() = Some(AtPublish {
                    tag: hub_dir.join("tags/head").is_file(),
                    markers,
                    packs_up,
                });
            }
        })),
        ..quiet_push()
    };
    let r = push(fx.store.view(), "head", &hub, &opts).await.unwrap();
    let at = seen.lock().unwrap().take().expect("the push published");
    assert!(at.tag, "the tag is up when the push says it published");
    assert!(
        !at.markers.is_empty() && at.packs_up == 0,
        "packs outside the working set come after, each promised: {at:?}"
    );
    assert_eq!(r.late_packs as usize, at.markers.len());
    assert!(r.packs > r.late_packs, "the working set's packs came first");
    assert!(
        pending_markers(&hub_dir).is_empty(),
        "every marker goes once its pack is up"
    );
    // The hub is complete: a full pull is byte-exact.
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    pull(s.clone(), &hub, "head", &quiet_pull()).await.unwrap();
    assert_same(&fx.store, &s, &fx.head);

    // Without a working set (or on an HTTP hub) the tag is the last object:
    // nothing is promised.
    let fx2 = fixture(65536);
    let dir2 = tempfile::tempdir().unwrap();
    let hub2 = Hub::open(&format!("file://{}", dir2.path().display()), None).unwrap();
    let r = push(
        fx2.store.view(),
        "head",
        &hub2,
        &PushOptions {
            pack_bytes: Some(1 << 20),
            ..quiet_push()
        },
    )
    .await
    .unwrap();
    assert_eq!(r.late_packs, 0);
}

/// Pushes `fx`'s head with a working set and small packs, then takes one
/// pack outside the working set back off the hub and leaves its pending
/// marker, as a push killed before that pack would. Returns the pack's
/// file name and bytes.
async fn push_then_unfinish(fx: &Fixture, hub: &Hub, hub_dir: &Path) -> (String, Vec<u8>) {
    record_working_set(fx, 16);
    let markers = Arc::new(std::sync::Mutex::new(Vec::new()));
    let opts = PushOptions {
        pack_bytes: Some(1 << 20),
        on_publish: Some(Arc::new({
            let (markers, hub_dir) = (markers.clone(), hub_dir.to_path_buf());
            move |_p: &forkd_hub::Published| {
                let copies: Vec<(String, Vec<u8>)> = pending_markers(&hub_dir)
                    .into_iter()
                    .map(|m| {
                        let b = std::fs::read(hub_dir.join("pending").join(&m)).unwrap();
                        (m, b)
                    })
                    .collect();
                *markers.lock().unwrap() = copies;
            }
        })),
        ..quiet_push()
    };
    push(fx.store.view(), "head", hub, &opts).await.unwrap();
    let (pack, marker) = markers.lock().unwrap().last().cloned().expect("late packs");
    let path = pack_path(hub_dir, &pack);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::write(hub_dir.join("pending").join(&pack), marker).unwrap();
    (pack, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_waits_for_a_promised_pack_and_refuses_a_missing_one() {
    let fx = fixture(65536);
    let dir = tempfile::tempdir().unwrap();
    let hub_dir = dir.path().to_path_buf();
    let hub = Hub::open(&format!("file://{}", hub_dir.display()), None).unwrap();
    let (pack, bytes) = push_then_unfinish(&fx, &hub, &hub_dir).await;

    // The pack arrives (and its marker goes) 600 ms into the pull.
    let arrive = {
        let hub_dir = hub_dir.clone();
        let pack = pack.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(600));
            std::fs::write(pack_path(&hub_dir, &pack), &bytes).unwrap();
            std::fs::remove_file(hub_dir.join("pending").join(&pack)).unwrap();
            bytes
        })
    };
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    let t = Instant::now();
    pull(s.clone(), &hub, "head", &quiet_pull())
        .await
        .expect("a promised pack is waited for");
    assert!(t.elapsed() >= Duration::from_millis(600));
    assert_same(&fx.store, &s, &fx.head);
    let bytes = arrive.join().unwrap();

    // The same pack gone with no marker: refused at once, naming it.
    std::fs::remove_file(pack_path(&hub_dir, &pack)).unwrap();
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    let e = pull(s.clone(), &hub, "head", &quiet_pull())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains(&pack), "{e:#}");
    assert!(s.snapshot(&fx.head).unwrap().is_none());

    // A marker older than readers wait for is a push that died: refused.
    let stale = forkd_hub::Key::Pending(pack.parse().unwrap());
    let old = serde_json::json!({"since": 1, "index": forkd_layers::ObjectId::of(b"x")});
    hub.put(&stale, serde_json::to_vec(&old).unwrap().into())
        .await
        .unwrap();
    let t = Instant::now();
    let e = pull(s.clone(), &hub, "head", &quiet_pull())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains(&pack), "{e:#}");
    assert!(t.elapsed() < Duration::from_secs(30));
    std::fs::write(pack_path(&hub_dir, &pack), bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushing_again_completes_a_push_that_stopped_after_publishing() {
    let fx = fixture(65536);
    let dir = tempfile::tempdir().unwrap();
    let hub_dir = dir.path().to_path_buf();
    let hub = Hub::open(&format!("file://{}", hub_dir.display()), None).unwrap();
    let (pack, bytes) = push_then_unfinish(&fx, &hub, &hub_dir).await;
    let r = push(fx.store.view(), "head", &hub, &quiet_push())
        .await
        .unwrap();
    assert_eq!(r.completed_packs, 1, "{}", r.summary());
    assert_eq!(std::fs::read(pack_path(&hub_dir, &pack)).unwrap(), bytes);
    assert!(pending_markers(&hub_dir).is_empty());
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    pull(s.clone(), &hub, "head", &quiet_pull()).await.unwrap();
    assert_same(&fx.store, &s, &fx.head);
    // A store that lacks the pack's chunks leaves the marker alone.
    std::fs::remove_file(pack_path(&hub_dir, &pack)).unwrap();
    let marker = forkd_hub::Key::Pending(pack.parse().unwrap());
    let index = std::fs::read_dir(hub_dir.join("index"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let m = serde_json::json!({"since": now, "index": index.to_string_lossy()});
    hub.put(&marker, serde_json::to_vec(&m).unwrap().into())
        .await
        .unwrap();
    let d2 = tempfile::tempdir().unwrap();
    let lone = open(d2.path());
    let data = synth::mixed_file(42, 300_000, 65536);
    let f = lone
        .ingest_reader(&data[..], &IngestOptions::default())
        .unwrap();
    lone.commit_snapshot(NewSnapshot {
        files: BTreeMap::from([("rootfs.img".to_string(), f.file_ref())]),
        config: serde_json::json!({"qemu_version": "10.0.2", "machine_signature": "test"}),
        tag: Some("other".into()),
        ..Default::default()
    })
    .unwrap();
    let r = push(lone.view(), "other", &hub, &quiet_push())
        .await
        .unwrap();
    assert_eq!(r.completed_packs, 0);
    assert_eq!(pending_markers(&hub_dir), vec![pack]);
}

/// A push from a store that holds only some chunks of a pack another push
/// promised and never delivered cannot rebuild it: it leaves the promise
/// and counts on the pack like any other. Its snapshot becomes readable
/// once the push that promised the pack is run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dependent_snapshot_reads_once_the_unfinished_push_is_run_again() {
    let fx = fixture(65536);
    let dir = tempfile::tempdir().unwrap();
    let hub_dir = dir.path().to_path_buf();
    let hub = Hub::open(&format!("file://{}", hub_dir.display()), None).unwrap();
    let (pack, _) = push_then_unfinish(&fx, &hub, &hub_dir).await;
    // One chunk of the missing pack, with bytes of its own around it.
    let index = std::fs::read_dir(hub_dir.join("index"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find_map(|p| {
            let id: forkd_layers::ObjectId =
                p.file_name().unwrap().to_str().unwrap().parse().unwrap();
            let idx = Index::decode(&id, &std::fs::read(&p).unwrap()).unwrap();
            idx.packs.into_iter().find(|p| p.id.to_string() == pack)
        })
        .expect("an index names the pack");
    let shared = index.entries[0].chunk;
    let chunk = fx.store.view().chunk(&shared).unwrap();
    let mut data = synth::mixed_file(77, 256 << 10, 65536);
    data.extend_from_slice(&chunk);
    let d2 = tempfile::tempdir().unwrap();
    let other = open(d2.path());
    let f = other
        .ingest_reader(&data[..], &IngestOptions::default())
        .unwrap();
    let rec = other
        .commit_snapshot(NewSnapshot {
            files: BTreeMap::from([("rootfs.img".to_string(), f.file_ref())]),
            config: serde_json::json!({"qemu_version": "10.0.2", "machine_signature": "test"}),
            tag: Some("mix".into()),
            ..Default::default()
        })
        .unwrap();
    assert!(other.snapshot_chunks(&rec).unwrap().contains(&shared));
    let r = push(other.view(), "mix", &hub, &quiet_push())
        .await
        .unwrap();
    assert_eq!(r.completed_packs, 0, "it cannot rebuild the pack");
    assert_eq!(pending_markers(&hub_dir), vec![pack.clone()]);
    // The push that promised the pack, run again, delivers it; then the
    // dependent snapshot reads.
    let r = push(fx.store.view(), "head", &hub, &quiet_push())
        .await
        .unwrap();
    assert_eq!(r.completed_packs, 1);
    let d3 = tempfile::tempdir().unwrap();
    let s = open(d3.path());
    tokio::time::timeout(
        Duration::from_secs(30),
        pull(s.clone(), &hub, "mix", &quiet_pull()),
    )
    .await
    .expect("the pack is there now")
    .unwrap();
    assert_same(&other, &s, &rec.id);
}
