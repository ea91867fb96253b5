//! Lazy snapshots through a real mount: a store that has a snapshot's
//! records and manifests but none of its chunks, a layout-2 hub directory
//! (packs) holding them, and forkd-fs fetching what reads need. Needs
//! /dev/fuse and root (skipped otherwise).

mod common;

use common::*;
use forkd_fs::MountConfig;
use forkd_layers::{
    synth, ChunkId, IngestOptions, NewSnapshot, RemoteChunk, SnapshotRecord, Store, StoreOptions,
    StoreReader,
};
use forkd_remote::layout::Key;
use forkd_remote::packs::PackBuilder;
use forkd_remote::FileHub;
use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const MEM: usize = 6 << 20;

/// Host A's store (the source), a hub directory with its chunks packed,
/// and host B's store holding the snapshot lazily (closed, so forkd-fs
/// can import into it).
struct Lazy {
    dir: tempfile::TempDir,
    rec: SnapshotRecord,
    data: Vec<u8>,
    /// `(chunk, pack file, end of its chunk object in the pack)`.
    places: Vec<(ChunkId, PathBuf, u64)>,
}

impl Lazy {
    fn new(seed: u64) -> Lazy {
        Lazy::packed(seed, usize::MAX)
    }

    /// As [`Lazy::new`], with a pack closed after every `per_pack` chunks
    /// (or at 1 MiB, whichever comes first).
    fn packed(seed: u64, per_pack: usize) -> Lazy {
        let dir = tempfile::Builder::new()
            .prefix("forkd-fs-lazy")
            .tempdir()
            .unwrap();
        let data = synth::mixed_file(seed, MEM, 65536);
        let a = Store::open(&dir.path().join("a"), StoreOptions::default()).unwrap();
        let f = a
            .ingest_reader(&data[..], &IngestOptions::default())
            .unwrap();
        let rec = a
            .commit_snapshot(NewSnapshot {
                files: [("memory.bin".to_string(), f.file_ref())].into(),
                config: serde_json::json!({"test": true}),
                ..Default::default()
            })
            .unwrap();
        let hub = FileHub::open(&dir.path().join("hub")).unwrap();
        let mut b = PackBuilder::new(1 << 20);
        let mut packs = Vec::new();
        for (i, c) in a.snapshot_chunks(&rec).unwrap().into_iter().enumerate() {
            packs.extend(b.add(&a.stored_chunk(&c).unwrap()));
            if (i + 1) % per_pack == 0 {
                packs.extend(std::mem::replace(&mut b, PackBuilder::new(1 << 20)).finish());
            }
        }
        packs.extend(b.finish());
        let b_store = Store::open(&dir.path().join("b"), StoreOptions::default()).unwrap();
        let src = b_store
            .add_remote_source(&format!("file://{}", dir.path().join("hub").display()), 2)
            .unwrap();
        let mut locs = Vec::new();
        let mut places = Vec::new();
        for p in &packs {
            hub.put(&Key::Pack(p.info.id), &p.bytes).unwrap();
            for e in &p.info.entries {
                locs.push((
                    e.chunk,
                    RemoteChunk {
                        source: src.id,
                        object: p.info.id,
                        offset: e.offset,
                        len: e.len,
                        raw_len: e.raw_len,
                    },
                ));
                places.push((
                    e.chunk,
                    hub.path(&Key::Pack(p.info.id)),
                    e.offset + u64::from(e.len),
                ));
            }
        }
        let mid = rec.files["memory.bin"].manifest;
        let mbytes = a.manifest_bytes(&mid).unwrap();
        b_store.import_remote(&[(mid, &mbytes)], &locs).unwrap();
        b_store
            .commit_imported_lazy(&rec, Some("lazy"), false, src.id)
            .unwrap();
        Lazy {
            dir,
            rec,
            data,
            places,
        }
    }

    fn config(&self, no_fill: bool) -> MountConfig {
        MountConfig {
            mountpoint: self.dir.path().join("mnt"),
            store_dir: self.dir.path().join("b"),
            secondary_dir: None,
            control_socket: None,
            binary: Some(PathBuf::from(BIN)),
            gid: None,
            no_fill,
            remote_deadline_secs: Some(10),
        }
    }

    fn mount(&self, no_fill: bool) -> Mounted {
        let cfg = self.config(no_fill);
        let mut m = Mounted {
            mountpoint: cfg.mountpoint.clone(),
            control: cfg.control(),
            pids: Vec::new(),
        };
        forkd_fs::ensure_mounted(&cfg).unwrap();
        m.note_pid();
        m
    }

    /// Takes the pack holding `places[i]` off the hub and leaves a fresh
    /// pending marker for it, as a push that has not sent it yet does.
    fn promise_pack(&self, i: usize) -> Promised {
        let (victim, pack, _) = self.places[i].clone();
        let pack_id = pack.file_name().unwrap().to_string_lossy().into_owned();
        let aside = self.dir.path().join(format!("pack-aside-{i}"));
        std::fs::rename(&pack, &aside).unwrap();
        let pending = self.dir.path().join("hub").join("pending");
        std::fs::create_dir_all(&pending).unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let marker = serde_json::json!({"since": now, "index": victim.to_string()});
        std::fs::write(pending.join(&pack_id), marker.to_string()).unwrap();
        Promised {
            victim,
            marker: pending.join(&pack_id),
            wanted: self.dir.path().join("hub").join("wanted").join(&pack_id),
            pack,
            aside,
        }
    }

    /// Records `ws` as the snapshot's working set in host B's store, as a
    /// recording (or a pull of one) leaves it.
    fn set_working_set(&self, ws: &forkd_layers::WorkingSet) {
        Store::open(&self.dir.path().join("b"), StoreOptions::default())
            .unwrap()
            .set_annotation(
                &self.rec.id,
                forkd_layers::workingset::ANNOTATION,
                &ws.encode(),
            )
            .unwrap();
    }

    /// A read-only view of host B's store.
    fn b(&self) -> StoreReader {
        let sec = self
            .dir
            .path()
            .join(format!("sec-{}", rand::random::<u32>()));
        StoreReader::open_secondary(&self.dir.path().join("b"), &sec).unwrap()
    }
}

/// A read of `chunk`'s 64 KiB of memory.bin on a thread of its own, as a
/// faulting guest does: its slot in the file, and the read.
fn fault_on(
    l: &Lazy,
    m: &Mounted,
    chunk: ChunkId,
) -> (usize, std::thread::JoinHandle<std::io::Result<Vec<u8>>>) {
    let man = l.b().manifest(&l.rec.files["memory.bin"].manifest).unwrap();
    let slot = (0..man.len())
        .find(|&i| man.entry(i) == forkd_layers::ChunkRef::Chunk(chunk))
        .unwrap();
    let path = m.file(&l.rec.id, "memory.bin");
    let read = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact_at(&mut buf, slot as u64 * 65536)
            .map(|()| buf)
    });
    (slot, read)
}

/// A pack taken off the hub with a pending marker left in its place.
struct Promised {
    /// A chunk in the pack.
    victim: ChunkId,
    marker: PathBuf,
    /// Where a reader asks for the pack.
    wanted: PathBuf,
    pack: PathBuf,
    aside: PathBuf,
}

impl Promised {
    /// Puts the pack in place and drops its marker: the push is done.
    fn land(&self) {
        std::fs::rename(&self.aside, &self.pack).unwrap();
        std::fs::remove_file(&self.marker).unwrap();
    }
}

/// Reads all of `path` with O_DIRECT in 64 KiB pieces from `threads`
/// threads, in an order that differs per thread.
fn read_all_direct(path: &Path, len: usize, threads: usize) -> Vec<u8> {
    use std::os::unix::fs::OpenOptionsExt;
    let out = std::sync::Mutex::new(vec![0u8; len]);
    std::thread::scope(|s| {
        for t in 0..threads {
            let out = &out;
            s.spawn(move || {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(path)
                    .unwrap();
                let mut buf = AlignedBuf::new(65536);
                let pieces = len / 65536;
                for i in 0..pieces {
                    let p = (i * 7 + t * 13) % pieces;
                    f.read_exact_at(buf.as_mut(), (p * 65536) as u64).unwrap();
                    out.lock().unwrap()[p * 65536..(p + 1) * 65536].copy_from_slice(buf.as_mut());
                }
            });
        }
    });
    out.into_inner().unwrap()
}

/// A page-aligned buffer for O_DIRECT.
struct AlignedBuf {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let v = vec![0u8; len + 4096];
        let off = v.as_ptr().align_offset(4096);
        AlignedBuf { v, off, len }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}

#[test]
fn lazy_reads_are_fetched_once_verified_and_imported() {
    if no_fuse() {
        return;
    }
    let l = Lazy::new(21);
    let m = l.mount(true);
    let path = m.file(&l.rec.id, "memory.bin");
    // Eight threads read every piece: each chunk is fetched once (single
    // flight), and the bytes are the source's.
    let got = read_all_direct(&path, MEM, 8);
    assert!(got == l.data, "lazy bytes differ from the source");
    let distinct: HashSet<ChunkId> = l.places.iter().map(|(c, _, _)| *c).collect();
    let st = m.client().status().unwrap();
    assert_eq!(
        st.lazy.fetched_chunks,
        distinct.len() as u64,
        "every chunk exactly once: {:?}",
        st.lazy
    );
    assert!(st.lazy.failures.is_empty(), "{:?}", st.lazy.failures);
    // The writer imports them: the store has them, the marker goes once
    // asked (no fill runs here, but every chunk was read).
    assert!(
        wait_for(Duration::from_secs(20), || {
            let b = l.b();
            b.has_chunks(&distinct.iter().copied().collect::<Vec<_>>())
                .unwrap()
                .iter()
                .all(|h| *h)
        }),
        "fetched chunks were not imported: {:?}",
        m.client().status().unwrap().lazy
    );
    // Read again after the import: from the store, no more fetches.
    let before = m.client().status().unwrap().lazy.fetched_chunks;
    let again = read_all_direct(&path, MEM, 2);
    assert!(again == l.data);
    assert_eq!(m.client().status().unwrap().lazy.fetched_chunks, before);
}

/// While a child faults, the writer leaves the store alone (each import
/// opens it read-write: CPU and disk the restore would wait behind), and
/// imports once the faults have stopped. The old writer imported on every
/// 250 ms tick, under the faults.
#[test]
fn fetched_chunks_wait_for_the_faults_to_stop_before_import() {
    if no_fuse() {
        return;
    }
    let l = Lazy::new(25);
    let m = l.mount(true);
    let f = std::fs::File::open(m.file(&l.rec.id, "memory.bin")).unwrap();
    let mut buf = vec![0u8; 4096];
    // A fault every 100 ms for two seconds, each on a chunk not read yet.
    let start = std::time::Instant::now();
    let mut off = 0u64;
    while start.elapsed() < Duration::from_secs(2) && off < MEM as u64 {
        f.read_exact_at(&mut buf, off).unwrap();
        let faulted = std::time::Instant::now();
        off += 512 << 10;
        std::thread::sleep(Duration::from_millis(100));
        let st = m.client().status().unwrap().lazy;
        // Only while the fault is recent (a stalled host may let the quiet
        // second pass, and then the writer may import).
        if faulted.elapsed() < Duration::from_millis(600) {
            assert_eq!(st.imported_chunks, 0, "imported while faulting: {st:?}");
        }
    }
    let st = m.client().status().unwrap().lazy;
    assert!(st.fetched_chunks > 0 && st.pending_chunks > 0, "{st:?}");
    assert!(
        wait_for(Duration::from_secs(20), || {
            let st = m.client().status().unwrap().lazy;
            st.pending_chunks == 0 && st.imported_chunks == st.fetched_chunks
        }),
        "not imported after the faults: {:?}",
        m.client().status().unwrap().lazy
    );
}

/// ...but not for ever: a child that never stops faulting (or reads that
/// keep failing) still gets its chunks imported every few seconds.
#[test]
fn a_child_that_keeps_faulting_does_not_hold_imports_for_ever() {
    use std::os::unix::fs::OpenOptionsExt;
    if no_fuse() {
        return;
    }
    let l = Lazy::new(26);
    let m = l.mount(true);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.file(&l.rec.id, "memory.bin"))
        .unwrap();
    let mut buf = AlignedBuf::new(65536);
    // A new chunk every 100 ms (no readahead: O_DIRECT), up to 96 of them.
    let mut imported = false;
    for i in 0..MEM / 65536 {
        f.read_exact_at(buf.as_mut(), (i * 65536) as u64).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        if m.client().status().unwrap().lazy.imported_chunks > 0 {
            imported = true;
            break;
        }
    }
    assert!(
        imported,
        "nothing imported in 9.6 s of faults: {:?}",
        m.client().status().unwrap().lazy
    );
}

#[test]
fn the_fill_makes_a_lazy_snapshot_local() {
    if no_fuse() {
        return;
    }
    let l = Lazy::new(22);
    let m = l.mount(false);
    // Nothing reads; the fill (after its grace, there is no working set)
    // fetches everything and the snapshot stops being lazy.
    assert!(
        wait_for(Duration::from_secs(60), || l
            .b()
            .lazy_snapshots()
            .unwrap()
            .is_empty()),
        "not filled: {:?}",
        m.client().status().unwrap().lazy
    );
    let b = l.b();
    let r = b.residency(&l.rec).unwrap();
    assert!(r.is_local(), "{r:?}");
    let f = b.open_file(&l.rec.id, "memory.bin").unwrap();
    let mut out = vec![0u8; MEM];
    f.read_exact_at(&mut out, 0).unwrap();
    assert!(out == l.data);
}

#[test]
fn a_corrupt_chunk_from_the_hub_is_refused() {
    if no_fuse() {
        return;
    }
    let l = Lazy::new(23);
    // Flip a byte inside the 5th chunk's payload in its pack.
    let (victim, pack, end) = l.places[4].clone();
    let mut b = std::fs::read(&pack).unwrap();
    b[end as usize - 9] ^= 0x20;
    std::fs::write(&pack, b).unwrap();
    let m = l.mount(true);
    let path = m.file(&l.rec.id, "memory.bin");
    let f = std::fs::File::open(&path).unwrap();
    // Where the victim is in the file.
    let b_view = l.b();
    let man = b_view
        .manifest(&l.rec.files["memory.bin"].manifest)
        .unwrap();
    let slot = (0..man.len())
        .find(|&i| man.entry(i) == forkd_layers::ChunkRef::Chunk(victim))
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let e = f
        .read_exact_at(&mut buf, slot as u64 * 65536)
        .expect_err("wrong bytes were served");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let st = m.client().status().unwrap();
    let fail = st
        .lazy
        .failures
        .iter()
        .find(|f| f.chunk == victim.to_string())
        .unwrap_or_else(|| panic!("no failure recorded: {:?}", st.lazy));
    assert!(fail.error.contains("failed verification"), "{}", fail.error);
    assert_eq!(st.lazy.retries, 0, "bad bytes are not retried");
    assert!(m.log().contains(&victim.to_string()));
    // Other chunks read fine; the bad one is never stored.
    let other = (0..man.len())
        .find(|&i| matches!(man.entry(i), forkd_layers::ChunkRef::Chunk(c) if c != victim))
        .unwrap();
    f.read_exact_at(&mut buf, other as u64 * 65536).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(l.b().has_chunks(&[victim]).unwrap(), vec![false]);
}

/// The worker is killed while a read is certainly inside it: the read
/// waits on a pack a push has promised (see the next test), and the kill
/// comes once the worker has asked for that pack. The holder's next worker
/// replays the read, and it completes once the pack lands.
#[test]
fn a_worker_killed_mid_fetch_loses_nothing() {
    if no_fuse() || !forkd_fs::holder::can_hold() {
        return;
    }
    let l = Lazy::new(24);
    let promised = l.promise_pack(4);
    let mut m = l.mount(true);
    let path = m.file(&l.rec.id, "memory.bin");
    let worker = m.client().status().unwrap().pid;
    let reader = {
        let path = path.clone();
        std::thread::spawn(move || read_all_direct(&path, MEM, 4))
    };
    assert!(
        wait_for(Duration::from_secs(20), || promised.wanted.is_file()),
        "the worker never asked for the promised pack"
    );
    assert!(!reader.is_finished(), "the read should wait for the pack");
    // SAFETY: kill(2) on the worker we started.
    unsafe { libc::kill(worker as i32, libc::SIGKILL) };
    assert!(wait_for(Duration::from_secs(20), || !alive(worker as i32)));
    let st = wait_for_status(&m, |st| st.generation >= 2);
    assert_ne!(st.pid, worker);
    promised.land();
    let got = reader.join().unwrap();
    assert!(got == l.data, "bytes differ after the worker was killed");
    m.note_pid();
    // Whatever was imported is whole: the store verifies.
    std::thread::sleep(Duration::from_secs(1));
    let b = l.b();
    let r = b.residency(&l.rec).unwrap();
    assert_eq!(r.local_chunks + r.remote_chunks, r.chunks);
}

/// The control socket's status once it answers and `ok` holds: a worker
/// the holder just started binds the socket a moment after it is forked.
fn wait_for_status(m: &Mounted, ok: impl Fn(&forkd_fs::Status) -> bool) -> forkd_fs::Status {
    let mut seen = None;
    let status = || forkd_fs::Client::connect(&m.control).and_then(|mut c| c.status());
    let answered = wait_for(Duration::from_secs(20), || {
        seen = status().ok().filter(&ok);
        seen.is_some()
    });
    assert!(answered, "no new worker answered in 20 s");
    seen.unwrap()
}

/// A pack a push has promised (its pending marker is on the hub) but not
/// uploaded yet: the read waits for it instead of failing, and asks the
/// pusher for it (`wanted/<pack>`). The old reader refused at once.
#[test]
fn a_read_waits_for_a_pack_a_push_promised_and_asks_for_it() {
    if no_fuse() {
        return;
    }
    let l = Lazy::new(27);
    let promised = l.promise_pack(4);
    let man = l.b().manifest(&l.rec.files["memory.bin"].manifest).unwrap();
    let slot = (0..man.len())
        .find(|&i| man.entry(i) == forkd_layers::ChunkRef::Chunk(promised.victim))
        .unwrap();
    // A working set without that chunk (over a file the snapshot does not
    // have, so its prefetch fetches nothing and cannot ask for the pack in
    // the read's place): the wait is counted as outside it.
    let mut ws = forkd_layers::WorkingSet::new();
    ws.push("elsewhere.bin", 0);
    l.set_working_set(&ws);
    let m = l.mount(true);
    let path = m.file(&l.rec.id, "memory.bin");
    let (asked, promised) = (promised.wanted.clone(), std::sync::Arc::new(promised));
    let arrive = std::thread::spawn({
        let promised = promised.clone();
        move || {
            std::thread::sleep(Duration::from_millis(800));
            let asked = asked.is_file();
            promised.land();
            asked
        }
    });
    let t = std::time::Instant::now();
    let f = std::fs::File::open(&path).unwrap();
    let mut buf = vec![0u8; 65536];
    f.read_exact_at(&mut buf, slot as u64 * 65536)
        .expect("a promised pack is waited for");
    assert!(t.elapsed() >= Duration::from_millis(800));
    let at = slot * 65536;
    assert!(buf == l.data[at..at + 65536], "wrong bytes served");
    assert!(arrive.join().unwrap(), "the reader asked for the pack");
    let st = m.client().status().unwrap();
    assert!(st.lazy.failures.is_empty(), "{:?}", st.lazy.failures);
    assert!(st.lazy.sources.iter().all(|s| s.healthy), "{:?}", st.lazy);
    assert!(
        st.lazy.slow_reads >= 1 && st.lazy.slow_reads_outside_working_set >= 1,
        "{:?}",
        st.lazy
    );
}

/// A slow read is outside the working set only by the chunks it waited
/// for: one that waits for a working-set chunk and also covers a chunk
/// already fetched, which the working set lacks, is slow but not outside.
/// (A check by the read's slots would count it.)
#[test]
fn a_slow_read_is_outside_the_working_set_only_by_what_it_waited_for() {
    use std::os::unix::fs::OpenOptionsExt;
    if no_fuse() {
        return;
    }
    let l = Lazy::packed(31, 8);
    let man = l.b().manifest(&l.rec.files["memory.bin"].manifest).unwrap();
    let pack_of = |c: ChunkId| l.places.iter().position(|p| p.0 == c);
    let chunk_at = |s: usize| match man.entry(s) {
        forkd_layers::ChunkRef::Chunk(c) => pack_of(c).map(|i| (c, i)),
        _ => None,
    };
    // Two neighbouring slots whose chunks lie in different packs.
    let (slot, victim) = (1..man.len())
        .find_map(|s| match (chunk_at(s - 1), chunk_at(s)) {
            (Some((_, a)), Some((_, b))) if l.places[a].1 != l.places[b].1 => Some((s, b)),
            _ => None,
        })
        .expect("two neighbouring slots in different packs");
    let promised = l.promise_pack(victim);
    let mut ws = forkd_layers::WorkingSet::new();
    ws.push("memory.bin", slot as u32);
    l.set_working_set(&ws);
    let m = l.mount(true);
    // O_DIRECT: reads reach forkd-fs as made, none from the page cache.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.file(&l.rec.id, "memory.bin"))
        .unwrap();
    let mut one = AlignedBuf::new(65536);
    f.read_exact_at(one.as_mut(), (slot as u64 - 1) * 65536)
        .expect("the neighbour's pack is up");
    let before = m.client().status().unwrap().lazy;
    let promised = std::sync::Arc::new(promised);
    let arrive = std::thread::spawn({
        let promised = promised.clone();
        move || {
            std::thread::sleep(Duration::from_millis(800));
            promised.land();
        }
    });
    // The last page of the neighbour and the first of the victim: one
    // read (forkd-fs takes reads of up to 64 KiB behind its holder).
    let at = slot * 65536 - 4096;
    let t = std::time::Instant::now();
    let mut two = AlignedBuf::new(8192);
    f.read_exact_at(two.as_mut(), at as u64)
        .expect("a promised pack is waited for");
    assert!(t.elapsed() >= Duration::from_millis(800));
    arrive.join().unwrap();
    assert!(two.as_mut() == &l.data[at..at + 8192], "wrong bytes served");
    let st = m.client().status().unwrap().lazy;
    assert!(st.slow_reads > before.slow_reads, "{st:?}");
    assert_eq!(
        st.slow_reads_outside_working_set, before.slow_reads_outside_working_set,
        "a read that waited only for a working-set chunk counted as outside: {st:?}"
    );
}

/// A push slower than the read deadline is no failure: the fill polls a
/// promised pack without asking for it (the packs faults wait on go
/// first), gives it up quietly at the deadline and comes back to it, and
/// a fault on it long after the deadline is asked for and served once the
/// pack lands. The old fill recorded the read's chunks as failed at the
/// deadline (10 s here).
#[test]
fn a_slow_push_is_no_fill_failure_and_a_late_fault_is_served() {
    if no_fuse() {
        return;
    }
    let l = Lazy::new(29);
    let promised = l.promise_pack(4);
    let m = l.mount(false);
    // Past the 10 s deadline of the fill's first read, with room for a
    // slow start.
    std::thread::sleep(Duration::from_secs(15));
    let st = m.client().status().unwrap().lazy;
    assert!(st.failures.is_empty(), "{:?}", st.failures);
    assert!(st.retries > 0, "the fill polled the promised pack: {st:?}");
    assert!(!promised.wanted.is_file(), "the fill asked on its own");
    let (slot, fault) = fault_on(&l, &m, promised.victim);
    assert!(
        wait_for(Duration::from_secs(20), || promised.wanted.is_file()),
        "a fault waits, and nobody asked for the pack"
    );
    assert!(!fault.is_finished(), "the pack is not up: the fault waits");
    promised.land();
    assert!(
        wait_for(Duration::from_secs(20), || fault.is_finished()),
        "the fault was not served once the pack landed"
    );
    let buf = fault.join().unwrap().expect("the fault is served");
    let at = slot * 65536;
    assert!(buf == l.data[at..at + 65536], "wrong bytes served");
    let st = m.client().status().unwrap().lazy;
    assert!(st.failures.is_empty(), "{:?}", st.failures);
}

/// A fill read waiting on a promised pack gives its request slot up while
/// it sleeps: the fill's other reads run, and a fault on a chunk of a
/// pack that is up is served at once even when it waits on one of those
/// reads. The old fill held both of its slots with reads of promised
/// packs, and the fault waited for the push.
#[test]
fn a_fill_read_waiting_on_a_push_does_not_hold_up_the_others() {
    if no_fuse() {
        return;
    }
    let l = Lazy::packed(30, 8);
    // The fill reads packs in file order: the first two are promised.
    let mut packs: Vec<usize> = Vec::new();
    for (i, (_, pack, _)) in l.places.iter().enumerate() {
        if packs.last().is_none_or(|&j| l.places[j].1 != *pack) {
            packs.push(i);
        }
    }
    assert!(packs.len() > 2, "the snapshot needs three packs or more");
    let first = l.promise_pack(packs[0]);
    let second = l.promise_pack(packs[1]);
    let m = l.mount(false);
    let status = || m.client().status().unwrap().lazy;
    assert!(
        wait_for(Duration::from_secs(20), || status().retries >= 2),
        "the fill never polled the promised packs: {:?}",
        status()
    );
    let (victim, _, _) = l.places.last().unwrap().clone();
    let (slot, fault) = fault_on(&l, &m, victim);
    assert!(
        wait_for(Duration::from_secs(5), || fault.is_finished()),
        "a fault on a pack that is up waited for the promised ones"
    );
    assert!(first.marker.is_file() && second.marker.is_file());
    let buf = fault.join().unwrap().expect("the fault is served");
    let at = slot * 65536;
    assert!(buf == l.data[at..at + 65536], "wrong bytes served");
    first.land();
    second.land();
    assert!(
        wait_for(Duration::from_secs(20), || {
            let r = l.b().residency(&l.rec).unwrap();
            r.local_chunks == r.chunks
        }),
        "the fill completes once the packs land"
    );
    assert!(status().failures.is_empty(), "{:?}", status().failures);
}
