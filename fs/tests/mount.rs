//! Real FUSE mounts of a real store, served by the real `forkd-fs` binary.

mod common;

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::Arc;
use std::time::Duration;

use common::{alive, no_fuse, stop, wait_for, TestStore};
use forkd_fs::{mount, ControlError};
use forkd_layers::synth;
use rand::{Rng, SeedableRng};

const MIB: usize = 1 << 20;

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// Byte-compares `len` bytes at `off` of the mounted file with the source.
fn check_range(mounted: &File, src: &[u8], off: u64, len: usize) {
    let mut buf = vec![0u8; len];
    let n = mounted.read_at(&mut buf, off).unwrap();
    let end = (off as usize + len).min(src.len());
    let want = &src[(off as usize).min(end)..end];
    assert_eq!(n, want.len(), "short read at {off}+{len}");
    assert!(buf[..n] == *want, "wrong bytes at {off}+{len}");
}

/// mmap(MAP_PRIVATE) of a mounted file, as QEMU maps guest RAM.
struct Map {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Map {
    fn private(f: &File, len: usize, prot: i32) -> Map {
        // SAFETY: a fresh private mapping of an open file.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_PRIVATE,
                std::os::unix::io::AsRawFd::as_raw_fd(f),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        Map { ptr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes and lives as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }

    /// Pages of the mapping that are in the page cache.
    fn resident(&self) -> Vec<bool> {
        let pages = self.len.div_ceil(4096);
        let mut v = vec![0u8; pages];
        // SAFETY: v has one byte per page of the mapping.
        let r = unsafe { libc::mincore(self.ptr, self.len, v.as_mut_ptr()) };
        assert_eq!(r, 0);
        v.iter().map(|b| b & 1 == 1).collect()
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

#[test]
fn serves_snapshots_byte_exact() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let mem = synth::mixed_file(1, 24 * MIB + 1234, 65536);
    let vmstate = synth::mixed_file(2, 70_000, 4096);
    let mem_p = ts.source("memory.bin", &mem);
    let vm_p = ts.source("vmstate", &vmstate);
    // A 3 GiB sparse disk with data in a few places.
    let disk_size = 3u64 << 30;
    let pieces: Vec<(u64, Vec<u8>)> = [0u64, 1 << 30, (2 << 30) + 12345, disk_size - 5000]
        .iter()
        .enumerate()
        .map(|(i, &o)| (o, synth::mixed_file(10 + i as u64, 3000, 4096)))
        .map(|(o, mut d)| {
            d.iter_mut().for_each(|b| *b |= 1);
            (o, d)
        })
        .collect();
    let disk_p = ts.sparse_source("rootfs.img", disk_size, &pieces);
    let rec = ts.commit(
        &[
            ("memory.bin", &mem_p),
            ("vmstate", &vm_p),
            ("rootfs.img", &disk_p),
        ],
        Some("base"),
    );
    let m = ts.mount();
    let id = rec.id;

    // Layout, modes, generated snapshot.json.
    let dir = m.path(&format!("by-id/{id}"));
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["memory.bin", "rootfs.img", "snapshot.json", "vmstate"]
    );
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777,
        0o550
    );
    let md = std::fs::metadata(m.file(&id, "memory.bin")).unwrap();
    assert_eq!(md.permissions().mode() & 0o7777, 0o440);
    assert_eq!(md.len(), mem.len() as u64);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.file(&id, "snapshot.json")).unwrap()).unwrap();
    assert_eq!(json["id"], id.to_string());
    let by_id: Vec<_> = std::fs::read_dir(m.path("by-id")).unwrap().collect();
    assert_eq!(by_id.len(), 1);
    assert!(File::create(m.file(&id, "vmstate")).is_err());

    // The tag is a symlink to by-id/<id>; both paths reach one inode.
    let link = std::fs::read_link(m.path("base")).unwrap();
    assert_eq!(link.to_str().unwrap(), format!("by-id/{id}"));
    let ino = md.ino();
    for p in [m.file(&id, "memory.bin"), m.path("base/memory.bin")] {
        let f = File::open(&p).unwrap();
        assert_eq!(f.metadata().unwrap().ino(), ino, "{}", p.display());
    }
    assert_eq!(std::fs::read(m.path("base/vmstate")).unwrap(), vmstate);

    // Random offsets and lengths, from many threads at once.
    let mem = Arc::new(mem);
    let path = m.file(&id, "memory.bin");
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (mem, path) = (mem.clone(), path.clone());
            s.spawn(move || {
                let f = File::open(path).unwrap();
                let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                for _ in 0..150 {
                    let off = rng.gen_range(0..mem.len() as u64 + 10);
                    let len = rng.gen_range(1..300_000);
                    check_range(&f, &mem, off, len);
                }
            });
        }
    });

    // MAP_PRIVATE, read-only open (QEMU's share=off,readonly=on): the whole
    // file matches; writes stay private.
    let f = File::open(&path).unwrap();
    let mut map = Map::private(&f, mem.len(), libc::PROT_READ | libc::PROT_WRITE);
    assert!(map.bytes()[..] == mem[..]);
    map.bytes_mut()[4096] ^= 0xff;
    check_range(&f, &mem, 4096, 1);
    drop(map);

    // The sparse disk: size, data pieces, zero holes, SEEK_DATA.
    let disk = File::open(m.file(&id, "rootfs.img")).unwrap();
    assert_eq!(disk.metadata().unwrap().len(), disk_size);
    for (off, d) in &pieces {
        let mut buf = vec![0u8; d.len()];
        disk.read_exact_at(&mut buf, *off).unwrap();
        assert!(buf == *d, "disk piece at {off}");
    }
    let mut buf = vec![1u8; 1 << 20];
    disk.read_exact_at(&mut buf, 3 << 29).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    let extents = forkd_fs::prefetch::data_extents(&disk).unwrap();
    assert_eq!(extents.len(), pieces.len(), "{extents:?}");
    assert_eq!(extents[1].0, 1 << 30);
}

#[test]
fn snapshots_committed_after_mounting_are_visible_at_once() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let a = synth::mixed_file(3, 3 * MIB, 65536);
    let pa = ts.source("a", &a);
    let r1 = ts.commit(&[("memory.bin", &pa)], Some("t"));
    let m = ts.mount();
    assert!(m.file(&r1.id, "memory.bin").exists());
    for i in 0..3u64 {
        let b = synth::mixed_file(100 + i, 2 * MIB + i as usize, 65536);
        let pb = ts.source("b", &b);
        let r = ts.commit(&[("memory.bin", &pb)], Some("t"));
        // No refresh, no sleep: the miss catches up with the writer.
        assert_eq!(std::fs::read(m.file(&r.id, "memory.bin")).unwrap(), b);
        assert_eq!(
            std::fs::read_link(m.path("t")).unwrap().to_str().unwrap(),
            format!("by-id/{}", r.id)
        );
        assert_eq!(std::fs::read(m.path("t/memory.bin")).unwrap(), b);
        let tag = format!("new{i}");
        ts.store.set_tag(&tag, &r1.id).unwrap();
        assert_eq!(
            std::fs::read(m.path(&format!("{tag}/memory.bin"))).unwrap(),
            a
        );
    }
    let ids: Vec<_> = std::fs::read_dir(m.path("by-id")).unwrap().collect();
    assert_eq!(ids.len(), 4);
    assert!(!m.path("no-such-tag").exists());
    assert!(!m.path("by-id/0123456789abcdef0123456789abcdef").exists());
}

#[test]
fn corrupt_chunk_is_eio_on_exactly_its_range() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    // Every 64 KiB chunk distinct and non-zero.
    let mut data = vec![0u8; 4 * MIB];
    synth::SplitMix64(9).fill(&mut data);
    let p = ts.source("memory.bin", &data);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let reader = ts.store.open_file(&rec.id, "memory.bin").unwrap();
    let bad_off = 2 * MIB as u64 + 65536;
    let forkd_layers::ChunkRef::Chunk(chunk) = reader.chunk_at(bad_off) else {
        panic!("expected a stored chunk")
    };
    let loc = ts.store.chunk_location(&chunk).unwrap().unwrap();
    let pack = ts
        .root()
        .join("packs")
        .join(format!("pack-{:08}.dat", loc.pack));
    let pf = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&pack)
        .unwrap();
    let mut b = [0u8; 1];
    let at = loc.offset + 45 + u64::from(loc.stored_len) / 2;
    pf.read_exact_at(&mut b, at).unwrap();
    pf.write_all_at(&[b[0] ^ 0x40], at).unwrap();
    drop(pf);

    let m = ts.mount();
    // O_DIRECT: every 4 KiB page is its own FUSE read, no readahead.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.file(&rec.id, "memory.bin"))
        .unwrap();
    let mut page = AlignedPage::new();
    for off in (0..data.len() as u64).step_by(4096) {
        let r = f.read_at(page.buf(), off);
        let bad = (bad_off..bad_off + 65536).contains(&off);
        match r {
            Ok(n) if !bad => {
                assert_eq!(n, 4096);
                assert!(
                    page.buf()[..] == data[off as usize..off as usize + 4096],
                    "at {off}"
                );
            }
            Err(e) if bad => assert_eq!(errno(&e), libc::EIO, "at {off}"),
            other => panic!("at {off} (bad={bad}): {other:?}"),
        }
    }
    // Buffered reads elsewhere are unaffected; the bad range fails.
    let fb = File::open(m.file(&rec.id, "memory.bin")).unwrap();
    check_range(&fb, &data, 0, MIB);
    let mut buf = vec![0u8; 4096];
    assert_eq!(
        errno(&fb.read_at(&mut buf, bad_off + 8192).unwrap_err()),
        libc::EIO
    );
    let st = m.client().status().unwrap();
    assert!(st.reads.errors > 0);
    let log = m.log();
    let line = log
        .lines()
        .find(|l| l.contains(&chunk.to_string()))
        .unwrap_or_else(|| panic!("no log line names chunk {chunk}:\n{log}"));
    assert!(
        line.contains("memory.bin") && line.contains(&rec.id.to_string()),
        "{line}"
    );
    assert!(line.contains(&format!("offset={bad_off}")), "{line}");
}

/// A page-aligned 4 KiB buffer for O_DIRECT.
struct AlignedPage(Box<[u8; 8192]>, usize);

impl AlignedPage {
    fn new() -> AlignedPage {
        let b = Box::new([0u8; 8192]);
        let skew = (4096 - (b.as_ptr() as usize % 4096)) % 4096;
        AlignedPage(b, skew)
    }
    fn buf(&mut self) -> &mut [u8] {
        let s = self.1;
        &mut self.0[s..s + 4096]
    }
}

#[test]
fn delete_protocol_refuses_while_open() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(4, MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], Some("del"));
    let id = rec.id;
    let m = ts.mount();
    let mut c = m.client();

    // A mapping keeps the file in use after its fd is closed (QEMU's case).
    let f = File::open(m.file(&id, "memory.bin")).unwrap();
    let map = Map::private(&f, d.len(), libc::PROT_READ);
    drop(f);
    assert_eq!(c.in_use(&id).unwrap(), 1);
    let err = c.begin_delete(&id).unwrap_err();
    match err.downcast_ref::<ControlError>() {
        Some(ControlError::InUse { open_handles, .. }) => assert_eq!(*open_handles, 1),
        other => panic!("expected InUse, got {other:?} ({err:#})"),
    }
    assert!(map.bytes()[..] == d[..]);
    drop(map);
    assert!(wait_for(Duration::from_secs(5), || c.in_use(&id).unwrap() == 0));

    // Hidden while the deleter works; visible again if it did not delete.
    c.begin_delete(&id).unwrap();
    let e = File::open(m.file(&id, "memory.bin")).unwrap_err();
    assert_eq!(errno(&e), libc::ENOENT);
    assert!(!m.path("del").exists());
    assert_eq!(c.status().unwrap().hidden, vec![id.to_string()]);
    c.end_delete(&id, false).unwrap();
    assert_eq!(std::fs::read(m.file(&id, "memory.bin")).unwrap(), d);

    // The real thing (once the read's release, which FUSE sends after
    // close returns, has arrived).
    assert!(wait_for(Duration::from_secs(5), || c.in_use(&id).unwrap() == 0));
    c.begin_delete(&id).unwrap();
    ts.store.delete_snapshot(&id).unwrap();
    c.end_delete(&id, true).unwrap();
    assert!(!m.file(&id, "memory.bin").exists());
    assert!(!m.path(&format!("by-id/{id}")).exists());
    assert_eq!(std::fs::read_dir(m.path("by-id")).unwrap().count(), 0);
}

#[test]
fn record_then_prefetch() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(5, 16 * MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let id = rec.id;
    let m = ts.mount();
    let mut c = m.client();
    let path = m.file(&id, "memory.bin");

    c.record_start(&id, "memory.bin", true).unwrap();
    let f = File::open(&path).unwrap();
    let touched = [(MIB as u64, 4096usize), (9 * MIB as u64 + 8192, 100)];
    for &(off, len) in &touched {
        check_range(&f, &d, off, len);
    }
    drop(f);
    let ranges = c.record_stop(&id, "memory.bin").unwrap();
    for &(off, len) in &touched {
        assert!(
            ranges
                .iter()
                .any(|&(o, l)| o <= off && off + len as u64 <= o + l),
            "{off}+{len} not in {ranges:?}"
        );
    }
    assert!(
        ranges.windows(2).all(|w| w[0].0 + w[0].1 < w[1].0),
        "{ranges:?}"
    );
    let recorded: u64 = ranges.iter().map(|r| r.1).sum();
    assert!(recorded < 8 * MIB as u64, "recorded {recorded} bytes");
    assert!(c.record_stop(&id, "memory.bin").is_err());

    // The writer stores the list with the snapshot; the mount serves it.
    forkd_fs::prefetch::save_ranges(&ts.store, &id, "memory.bin", &ranges).unwrap();
    assert_eq!(
        c.stored_ranges(&id, "memory.bin").unwrap(),
        Some(ranges.clone())
    );

    // Drop the cached pages, then prefetch with the CLI: exactly the
    // recorded ranges become resident.
    let f = File::open(&path).unwrap();
    // SAFETY: fadvise on our fd.
    unsafe {
        libc::posix_fadvise(
            std::os::unix::io::AsRawFd::as_raw_fd(&f),
            0,
            0,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    let map = Map::private(&f, d.len(), libc::PROT_READ);
    let before = map.resident().iter().filter(|&&r| r).count();
    let out = std::process::Command::new(common::BIN)
        .args(["prefetch", &id.to_string(), "--mount"])
        .arg(&m.mountpoint)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("stored with the snapshot"), "{stdout}");
    let res = map.resident();
    for &(o, l) in &ranges {
        for pg in (o / 4096)..(o + l).div_ceil(4096) {
            assert!(res[pg as usize], "page {pg} not resident after prefetch");
        }
    }
    assert!(before < res.iter().filter(|&&r| r).count());

    // Control-socket prefetch (whole data extents when no list is given).
    let bytes = c
        .prefetch(&id, "memory.bin", Some(vec![(0, 65536)]), true)
        .unwrap();
    assert_eq!(bytes, 65536);
    drop(map);
}

#[test]
fn kill9_leaves_a_stale_mount_that_ensure_mounted_recovers() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(6, 2 * MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let mut m = ts.mount();
    let pid = m.note_pid();
    assert_eq!(std::fs::read(m.file(&rec.id, "memory.bin")).unwrap(), d);
    // Already live: a second call is a no-op.
    forkd_fs::ensure_mounted(&ts.config()).unwrap();
    assert_eq!(m.note_pid(), pid);

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL).unwrap();
    // The connection dies when the last thread of the process has closed
    // its /dev/fuse fd, a moment after the process shows as a zombie.
    assert!(wait_for(Duration::from_secs(5), || {
        nix::sys::statfs::statfs(&m.mountpoint).err() == Some(nix::errno::Errno::ENOTCONN)
    }));
    assert_eq!(
        mount::probe(&m.mountpoint, Duration::from_secs(2)),
        mount::Probe::NotConnected
    );
    assert!(mount::mount_at(&m.mountpoint)
        .unwrap()
        .unwrap()
        .is_forkd_fs());

    forkd_fs::ensure_mounted(&ts.config()).unwrap();
    let pid2 = m.note_pid();
    assert_ne!(pid2, pid);
    assert_eq!(std::fs::read(m.file(&rec.id, "memory.bin")).unwrap(), d);
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let here = m.mountpoint.to_str().unwrap();
    assert_eq!(
        mounts
            .lines()
            .filter(|l| l.contains(&format!(" {here} ")))
            .count(),
        1,
        "the stale mount was not detached"
    );
}

/// `umount -l` behind its users' backs: the detached mount keeps serving
/// what is open (a VM's mapping reads on), and `ensure_mounted` starts a
/// new mount at the same path, which takes over the control socket; each
/// serves its own files, each has its own journal, and the old one ends
/// once its last file closes.
#[test]
fn a_lazily_detached_mount_keeps_its_files_and_a_new_one_takes_its_place() {
    if no_fuse() || !nix::unistd::geteuid().is_root() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(12, 4 * MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let mut m = ts.mount();
    let old_holder = m.note_pid();
    let old = m.client().status().unwrap();
    assert!(old.dev.is_some(), "a holder's worker reports its device");
    let f = File::open(m.file(&rec.id, "memory.bin")).unwrap();
    let map = Map::private(&f, d.len(), libc::PROT_READ);

    mount::sys_unmount(&m.mountpoint, true).unwrap();
    assert!(mount::mount_at(&m.mountpoint).unwrap().is_none());
    assert!(mount::is_detached(&m.client().status().unwrap()));
    forkd_fs::ensure_mounted(&ts.config()).unwrap();
    let new_holder = m.note_pid();
    assert_ne!(new_holder, old_holder, "a new holder serves the path");
    let new = m.client().status().unwrap();
    assert_ne!(new.dev, old.dev);
    assert!(!mount::is_detached(&new));
    assert_eq!(std::fs::read(m.file(&rec.id, "memory.bin")).unwrap(), d);
    // Every page of the old mapping is read now, after the detach.
    assert_eq!(map.bytes(), &d[..], "the detached mount's mapping");
    for pid in [old_holder, new_holder] {
        let j = mount::journal_path(&m.control, pid as u32);
        assert!(j.exists(), "{} missing", j.display());
    }
    // A second call finds the new mount live and leaves it be.
    forkd_fs::ensure_mounted(&ts.config()).unwrap();
    assert_eq!(m.note_pid(), new_holder);

    drop(map);
    drop(f);
    assert!(
        wait_for(Duration::from_secs(10), || !alive(old_holder)),
        "the detached mount's holder outlived its last open file"
    );
    assert!(!mount::journal_path(&m.control, old_holder as u32).exists());
    assert_eq!(
        m.client().status().unwrap().pid,
        new.pid,
        "the socket stayed the new one's"
    );
}

#[test]
fn a_hung_daemon_is_aborted_and_replaced() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(8, MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let mut m = ts.mount();
    m.note_pid();
    // The process that serves requests hangs (behind a holder: the worker).
    let pid = m.client().status().unwrap().pid as i32;
    stop(pid);
    assert_eq!(
        mount::probe(&m.mountpoint, Duration::from_millis(300)),
        mount::Probe::Hung
    );

    forkd_fs::ensure_mounted(&ts.config()).unwrap();
    m.note_pid();
    assert_ne!(m.client().status().unwrap().pid as i32, pid);
    assert_eq!(std::fs::read(m.file(&rec.id, "memory.bin")).unwrap(), d);
    // The old holder kills its hung worker once the connection is gone.
    assert!(
        wait_for(Duration::from_secs(15), || !alive(pid)),
        "the hung worker outlived its aborted mount"
    );
}

/// The worker behind a holder is killed while it holds an unanswered
/// request (it was stopped first, so the request is surely in its hands):
/// the mount stays, a new worker answers that request, a mapping made
/// before the crash reads right after it, and the open-file count the
/// delete protocol relies on survives (journal).
/// Closing a file of the mount never waits for its daemon: a QEMU that
/// exits, or a process that execs with a file of the mount open, while the
/// worker restarts (or a holder is adopted) would hang in `close` on a
/// FUSE_FLUSH nobody answers.
#[test]
fn a_close_does_not_wait_for_a_stopped_worker() {
    if no_fuse() || !nix::unistd::geteuid().is_root() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(5, MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let mut m = ts.mount();
    m.note_pid();
    let worker = m.client().status().unwrap().pid as i32;
    let f = File::open(m.file(&rec.id, "memory.bin")).unwrap();
    stop(worker);
    let closed = std::thread::spawn(move || drop(f));
    let prompt = wait_for(Duration::from_secs(5), || closed.is_finished());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(worker),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    closed.join().unwrap();
    assert!(prompt, "close waited for the stopped worker (FUSE_FLUSH)");
}

#[test]
fn a_killed_worker_is_replaced_and_its_unanswered_requests_replayed() {
    if no_fuse() || !nix::unistd::geteuid().is_root() {
        return;
    }
    use nix::sys::signal::{kill, Signal};
    let ts = TestStore::new();
    let d = synth::mixed_file(9, 4 * MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let mut m = ts.mount();
    let holder = m.note_pid();
    let st = m.client().status().unwrap();
    assert_eq!((st.holder_pid, st.generation), (Some(holder as u32), 1));
    let worker = nix::unistd::Pid::from_raw(st.pid as i32);

    let f = File::open(m.file(&rec.id, "memory.bin")).unwrap();
    let map = Map::private(&f, d.len(), libc::PROT_READ);
    stop(worker.as_raw());
    let path = m.path("by-id");
    let pending = std::thread::spawn(move || std::fs::read_dir(path).unwrap().count());
    std::thread::sleep(Duration::from_millis(300));
    assert!(!pending.is_finished(), "a stopped worker answered");
    kill(worker, Signal::SIGKILL).unwrap();
    assert_eq!(pending.join().unwrap(), 1, "the replayed readdir");
    assert_eq!(map.bytes(), &d[..], "the mapping after the crash");

    let st = m.client().status().unwrap();
    m.note_pid();
    assert_eq!((st.holder_pid, st.generation), (Some(holder as u32), 2));
    assert_eq!(st.open_handles.get(&rec.id.to_string()), Some(&1), "{st:?}");
    let mut c = m.client();
    assert!(
        c.begin_delete(&rec.id).is_err(),
        "the mapped file counts as open"
    );
    drop(map);
    drop(f);
    assert!(wait_for(Duration::from_secs(5), || c
        .begin_delete(&rec.id)
        .is_ok()));
    c.end_delete(&rec.id, false).unwrap();
    assert_eq!(std::fs::read(m.file(&rec.id, "memory.bin")).unwrap(), d);
}

/// The holder killed (-9) while a keeper (this test, as poold does) holds
/// duplicates of its connection and request arena, with a request in the
/// stopped worker's hands: the mount stays, a holder started by the
/// keeper adopts both and answers that request, a mapping made before the
/// kill reads after it, and the open-file count survives (the dead
/// holder's journal, taken over).
#[test]
fn a_killed_holder_is_adopted_through_its_keeper_and_nothing_is_lost() {
    if no_fuse() || !nix::unistd::geteuid().is_root() {
        return;
    }
    use nix::sys::signal::{kill, Signal};
    let ts = TestStore::new();
    let d = synth::mixed_file(13, 4 * MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let mut m = ts.mount();
    let holder = m.note_pid();
    let worker = m.client().status().unwrap().pid as i32;
    let kept = forkd_fs::keeper::fetch(&m.mountpoint).unwrap();
    assert_eq!(kept.info.holder_pid, holder as u32);

    let f = File::open(m.file(&rec.id, "memory.bin")).unwrap();
    let map = Map::private(&f, d.len(), libc::PROT_READ);
    stop(worker);
    let path = m.path("by-id");
    let pending = std::thread::spawn(move || std::fs::read_dir(path).unwrap().count());
    std::thread::sleep(Duration::from_millis(300));
    assert!(!pending.is_finished(), "a stopped worker answered");
    kill(nix::unistd::Pid::from_raw(holder), Signal::SIGKILL).unwrap();
    assert!(wait_for(Duration::from_secs(10), || {
        forkd_fs::keeper::holder_gone(holder as u32) && !alive(worker)
    }));
    assert!(
        mount::mount_at(&m.mountpoint).unwrap().is_some(),
        "the kept connection keeps the mount"
    );

    forkd_fs::keeper::adopt(&ts.config(), &kept).unwrap();
    drop(kept);
    assert_eq!(pending.join().unwrap(), 1, "the replayed readdir");
    assert_eq!(map.bytes(), &d[..], "the mapping after the holder died");
    let st = m.client().status().unwrap();
    let new_holder = m.note_pid();
    assert_ne!(new_holder, holder);
    assert_eq!(st.open_handles.get(&rec.id.to_string()), Some(&1), "{st:?}");
    assert!(!mount::journal_path(&m.control, holder as u32).exists());
    assert!(mount::journal_path(&m.control, new_holder as u32).exists());
    assert_eq!(std::fs::read(m.file(&rec.id, "memory.bin")).unwrap(), d);
    // The new holder serves its own keeper socket.
    let again = forkd_fs::keeper::fetch(&m.mountpoint).unwrap();
    assert_eq!(again.info.holder_pid, new_holder as u32);
    drop(again);
    drop(map);
    drop(f);
    let mut c = m.client();
    assert!(wait_for(Duration::from_secs(5), || c
        .begin_delete(&rec.id)
        .is_ok()));
    c.end_delete(&rec.id, false).unwrap();
}

#[test]
fn sigterm_unmounts_cleanly() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(7, MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let term = |pid: i32| {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGTERM).unwrap()
    };

    // Idle: unmounted, socket gone, process exits.
    let mut m = ts.mount();
    let pid = m.note_pid();
    term(pid);
    assert!(
        wait_for(Duration::from_secs(5), || !alive(pid)),
        "still running"
    );
    assert!(mount::mount_at(&m.mountpoint).unwrap().is_none());
    assert!(!m.control.exists());

    // Busy (a VM maps a file): detached at once, the open file keeps
    // working, the process exits when it is closed.
    forkd_fs::ensure_mounted(&ts.config()).unwrap();
    let pid = m.note_pid();
    let mut f = File::open(m.file(&rec.id, "memory.bin")).unwrap();
    term(pid);
    assert!(wait_for(Duration::from_secs(5), || mount::mount_at(
        &m.mountpoint
    )
    .unwrap()
    .is_none()));
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    assert_eq!(back, d);
    assert!(alive(pid));
    drop(f);
    assert!(
        wait_for(Duration::from_secs(5), || !alive(pid)),
        "did not exit after close"
    );

    // And a new mount starts fine afterwards.
    forkd_fs::ensure_mounted(&ts.config()).unwrap();
    m.note_pid();
    assert_eq!(std::fs::read(m.file(&rec.id, "memory.bin")).unwrap(), d);
    forkd_fs::unmount(&m.mountpoint).unwrap();
    assert!(mount::mount_at(&m.mountpoint).unwrap().is_none());
}

/// Runs `cat path` as uid 65534 (nobody) with primary group `gid` and no
/// other groups; true when it could read the file.
fn reads_as(gid: u32, path: &std::path::Path) -> bool {
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
fn only_root_and_the_jail_group_read_the_mount() {
    if no_fuse() {
        return;
    }
    const JAIL_GID: u32 = 0x7000_0000 + 4242;
    let ts = TestStore::new();
    // Let anyone traverse down to the mount point: only the mount's own
    // modes stand between another user and the files.
    std::fs::set_permissions(ts.dir.path(), PermissionsExt::from_mode(0o755)).unwrap();
    let data = synth::mixed_file(7, MIB, 65536);
    let src = ts.source("m", &data);
    let rec = ts.commit(&[("memory.bin", &src)], Some("t"));

    let m = ts.mount_gid(Some(JAIL_GID));
    let file = m.file(&rec.id, "memory.bin");
    let md = std::fs::metadata(&file).unwrap();
    assert_eq!(
        (md.uid(), md.gid(), md.mode() & 0o7777),
        (0, JAIL_GID, 0o440)
    );
    let dir = std::fs::metadata(file.parent().unwrap()).unwrap();
    assert_eq!((dir.gid(), dir.mode() & 0o7777), (JAIL_GID, 0o550));
    assert_eq!(m.client().status().unwrap().gid, Some(JAIL_GID));
    // The jail group reads, through the id and through the tag; nobody
    // does not, by either path; root does.
    assert!(reads_as(JAIL_GID, &file), "the jail group cannot read");
    assert!(reads_as(JAIL_GID, &m.path("t/memory.bin")));
    assert!(!reads_as(65534, &file), "nobody read {}", file.display());
    assert!(!reads_as(65534, &m.path("t/memory.bin")));
    assert_eq!(std::fs::read(&file).unwrap(), data);
    // The check itself can succeed: nobody reads a world-readable file.
    assert!(reads_as(65534, std::path::Path::new("/etc/hostname")));

    // Asking for another group remounts (nothing is open); asking for none
    // leaves root alone: not even the former group gets in.
    drop(m);
    let mut m = ts.mount_gid(None);
    m.note_pid();
    assert_eq!(m.client().status().unwrap().gid, None);
    assert!(!reads_as(JAIL_GID, &file), "group read without --gid");
    assert_eq!(std::fs::read(&file).unwrap(), data);
    // ensure_mounted with a group now remounts the live mount for it.
    let mut cfg = ts.config();
    cfg.gid = Some(JAIL_GID);
    forkd_fs::ensure_mounted(&cfg).unwrap();
    m.note_pid();
    assert_eq!(m.client().status().unwrap().gid, Some(JAIL_GID));
    assert!(reads_as(JAIL_GID, &file));
}

/// The mount's readahead window is the configured one (1 MiB by default).
/// A held mount set it before the INIT answer, which cut it back to the
/// kernel's 128 KiB: every cold fault became its own FUSE round trip
/// (fs-bench: cold mmap first touch p50 4 -> 199 us).
#[test]
fn the_mount_keeps_its_readahead_window() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let mut m = ts.mount();
    m.note_pid();
    let entry = mount::mount_at(&m.mountpoint).unwrap().unwrap();
    let kb =
        std::fs::read_to_string(format!("/sys/class/bdi/{}/read_ahead_kb", entry.dev)).unwrap();
    assert_eq!(kb.trim(), "1024");
}

/// Two test threads (or poold and a CLI) mounting the same store at once
/// must end with one mount and both callers succeeding; before the mount
/// lock, both started a daemon and both failed (CI, branch.rs).
#[test]
fn concurrent_ensure_mounted_callers_share_one_mount() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(7, MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], None);
    let mut guard = common::Mounted {
        mountpoint: ts.mountpoint(),
        control: ts.config().control(),
        pids: Vec::new(),
    };
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| forkd_fs::ensure_mounted(&ts.config())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    guard.note_pid();
    for r in &results {
        assert!(r.is_ok(), "a concurrent mount failed: {r:?}");
    }
    assert_eq!(std::fs::read(guard.file(&rec.id, "memory.bin")).unwrap(), d);
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let here = guard.mountpoint.to_str().unwrap();
    assert_eq!(
        mounts
            .lines()
            .filter(|l| l.contains(&format!(" {here} ")))
            .count(),
        1,
        "concurrent callers stacked mounts"
    );
}

/// The daemon must not keep fds its caller inherited: a lock (flock(1)
/// around a test run) or a pipe someone waits on for EOF stayed held for
/// as long as the mount lived.
#[test]
fn the_daemon_keeps_none_of_its_callers_fds() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    // A pipe whose write end the mount command inherits (no CLOEXEC).
    let (r, w) = nix::unistd::pipe().unwrap();
    let m = ts.mount();
    drop(w);
    let mut fds = [nix::poll::PollFd::new(
        std::os::fd::AsFd::as_fd(&r),
        nix::poll::PollFlags::POLLIN,
    )];
    let ready = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(3000u16)).unwrap();
    let hup = fds[0]
        .revents()
        .is_some_and(|e| e.intersects(nix::poll::PollFlags::POLLHUP));
    assert!(
        ready == 1 && hup,
        "the forkd-fs daemon still holds the write end of its caller's pipe"
    );
    drop(m);
}

/// A snapshot deleted and then committed again (a pull of the same content
/// makes the same id) is served again: it stayed hidden for the rest of
/// the mount, so spawning from a pulled-back snapshot failed with 404
/// (the soak's hub round trips).
#[test]
fn a_deleted_snapshot_committed_again_is_served_again() {
    if no_fuse() {
        return;
    }
    let ts = TestStore::new();
    let d = synth::mixed_file(8, MIB, 65536);
    let p = ts.source("memory.bin", &d);
    let rec = ts.commit(&[("memory.bin", &p)], Some("again"));
    let id = rec.id;
    let m = ts.mount();
    let mut c = m.client();
    assert_eq!(std::fs::read(m.file(&id, "memory.bin")).unwrap(), d);

    let manifest = rec.files["memory.bin"].manifest;
    let manifest_bytes = ts.store.manifest_bytes(&manifest).unwrap();
    // FUSE sends the read's release after close returns.
    assert!(wait_for(Duration::from_secs(5), || c.in_use(&id).unwrap() == 0));
    c.begin_delete(&id).unwrap();
    ts.store.delete_snapshot(&id).unwrap();
    c.end_delete(&id, true).unwrap();
    assert!(!m.path("again").exists());
    assert!(!m.file(&id, "memory.bin").exists());

    // What a pull does: the record comes back under its original id.
    ts.store
        .import_manifest(&manifest, &manifest_bytes)
        .unwrap();
    assert!(ts.store.commit_imported(&rec, Some("again"), true).unwrap());
    assert_eq!(std::fs::read(m.path("again/memory.bin")).unwrap(), d);
    assert_eq!(std::fs::read(m.file(&id, "memory.bin")).unwrap(), d);
    let listed: Vec<String> = std::fs::read_dir(m.path("by-id"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(listed, vec![id.to_string()]);
    // And a worker that replaces this one (replaying the journal) agrees.
    let st = c.status().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(st.pid as i32),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_for(Duration::from_secs(10), || {
        forkd_fs::Client::connect(&m.control)
            .and_then(|mut c| c.status())
            .is_ok_and(|s| s.pid != st.pid)
    }));
    assert_eq!(std::fs::read(m.path("again/memory.bin")).unwrap(), d);
}
