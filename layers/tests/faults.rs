//! Bad input: corrupted or missing pack data is detected and reported, never
//! served; a full disk fails an ingest cleanly.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use forkd_layers::synth::SplitMix64;
use forkd_layers::{packs_dir, Error, IngestOptions, Store};

fn random(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    SplitMix64(seed).fill(&mut v);
    v
}

#[test]
fn corrupted_pack_byte_is_reported_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let store = common::open(&root, 65536);
    // Chunk 0 incompressible (stored raw), chunk 1 text (stored zstd).
    let mut data = random(1, 65536);
    data.extend((0..65536).map(|i| b"compressible text "[i % 18]));
    let rec = common::commit_bytes(&store, &data, None);
    store.set_tag("victim", &rec.id).unwrap();
    let m = store.manifest(&rec.files["data.bin"].manifest).unwrap();
    for (slot, chunk) in m.distinct_chunks().iter().enumerate() {
        let loc = store.chunk_location(chunk).unwrap().unwrap();
        let pack = packs_dir(&root).join(format!("pack-{:08}.dat", loc.pack));
        // Flip one payload byte in place (the test plays a bad disk).
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&pack)
            .unwrap();
        let at = loc.offset + 45 + u64::from(loc.stored_len) / 2;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
        drop(f);
        store.drop_cache();
        let r = store.open_file(&rec.id, "data.bin").unwrap();
        let mut buf = vec![0u8; 4096];
        let file_off = slot as u64 * 65536 + 8192;
        let e = r.read_at(&mut buf, file_off).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&chunk.to_string()), "{msg}");
        assert!(msg.contains(&format!("offset {}", loc.offset)), "{msg}");
        assert!(msg.contains(&pack.display().to_string()), "{msg}");
        assert!(
            msg.contains("data.bin") && msg.contains(&format!("offset {file_off}")),
            "{msg}"
        );
        match e {
            Error::FileRead { source, .. } => {
                assert!(matches!(*source, Error::CorruptChunk { .. }), "{source:?}")
            }
            other => panic!("unexpected {other:?}"),
        }
        // Never served from the cache afterwards either.
        assert!(r.read_at(&mut buf, file_off).is_err());
    }
    let v = store.verify().unwrap();
    assert_eq!(v.bad_chunks.len(), 2, "{v:?}");
    for b in &v.bad_chunks {
        assert!(b.pack.is_some());
        assert_eq!(b.users.len(), 1);
        assert_eq!(b.users[0].snapshot, rec.id);
        assert_eq!(b.users[0].file, "data.bin");
    }
    assert!(!v.is_ok());
}

#[test]
fn missing_pack_is_an_error_naming_the_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let data = random(2, 3 * 65536);
    let rec = {
        let store = common::open(&root, 65536);
        common::commit_bytes(&store, &data, None)
    };
    for p in std::fs::read_dir(packs_dir(&root)).unwrap() {
        std::fs::remove_file(p.unwrap().path()).unwrap();
    }
    let store = common::open(&root, 65536);
    let r = store.open_file(&rec.id, "data.bin").unwrap();
    let mut buf = [0u8; 10];
    let e = r.read_at(&mut buf, 70000).unwrap_err();
    assert!(e.to_string().contains("is gone"), "{e}");
    let v = store.verify().unwrap();
    assert_eq!(v.bad_chunks.len(), 3, "{v:?}");
}

/// A tiny tmpfs, unmounted on drop.
struct TinyFs(PathBuf);

impl TinyFs {
    fn mount(dir: &Path, size: &str) -> Option<TinyFs> {
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        ok.then(|| TinyFs(dir.to_path_buf()))
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Writes 256 KiB blocks of random bytes until the filesystem is full.
fn fill_disk(path: &Path) {
    let f = std::fs::File::create(path).unwrap();
    let block = random(99, 256 << 10);
    let mut off = 0;
    while f.write_all_at(&block, off).is_ok() {
        off += block.len() as u64;
    }
}

#[test]
fn full_disk_fails_ingest_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = TinyFs::mount(dir.path(), "40m") else {
        eprintln!("SKIP full_disk_fails_ingest_cleanly: cannot mount tmpfs (needs root)");
        return;
    };
    let root = fs.0.join("store");
    let store = Store::open(&root, common::opts(65536)).unwrap();
    let d1 = random(1, 2 << 20);
    let s1 = common::commit_bytes(&store, &d1, None);
    let throwaway = common::commit_bytes(&store, &random(3, 1 << 20), None);
    let filler = fs.0.join("filler");
    fill_disk(&filler);
    // Leave ~1 MiB free: enough for RocksDB, not for a 4 MiB ingest.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&filler)
        .unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len.saturating_sub(1 << 20)).unwrap();
    drop(f);
    let big = random(2, 4 << 20);
    let stored_before = store.stats().unwrap().stored_bytes;
    let e = store
        .ingest_reader(&big[..], &IngestOptions::default())
        .unwrap_err();
    assert!(e.is_no_space(), "{e:?}");
    assert!(e.to_string().contains("no space left"), "{e}");
    // The failed ingest gave back the pack space it had used.
    assert_eq!(store.stats().unwrap().stored_bytes, stored_before);
    // Metadata writes that add data are refused before RocksDB sees them
    // (a failed WAL write would leave RocksDB read-only until reopened).
    let e = store
        .commit_snapshot(forkd_layers::NewSnapshot {
            files: s1.files.clone(),
            ..Default::default()
        })
        .unwrap_err();
    assert!(e.is_no_space(), "{e:?}");
    // Writes that free space still work on the full disk.
    store.delete_snapshot(&throwaway.id).unwrap();
    let g = store.gc().unwrap();
    assert_eq!(g.chunks_removed, 16, "{g:?}");
    // Consistent: old snapshot reads, verify passes.
    store.drop_cache();
    assert!(common::read_all(&store, &s1, "data.bin") == d1);
    let v = store.verify().unwrap();
    assert!(v.is_ok(), "{v:?}");
    // Free space: the same ingest now works.
    std::fs::remove_file(&filler).unwrap();
    let s2 = common::commit_bytes(&store, &big, Some(s1.id));
    store.drop_cache();
    assert!(common::read_all(&store, &s2, "data.bin") == big);
    let v = store.verify().unwrap();
    assert!(v.is_ok(), "{v:?}");
    drop(store);
    // And after a reopen.
    let store = Store::open(&root, common::opts(65536)).unwrap();
    assert!(common::read_all(&store, &s2, "data.bin") == big);
    drop(store);
    drop(fs);
}

/// A reader that fails after `left` bytes.
struct FailingReader {
    data: Vec<u8>,
    pos: usize,
    fail_at: usize,
}

impl std::io::Read for FailingReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.pos >= self.fail_at {
            return Err(std::io::Error::other("source went away"));
        }
        let n = buf.len().min(self.fail_at - self.pos);
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[test]
fn failed_ingest_gives_its_pack_space_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536); // 1 MiB packs
    let s1 = common::commit_bytes(&store, &random(1, 700_000), None);
    let before = store.stats().unwrap();
    // Fails after ~2.5 MiB: several chunks appended, packs rolled over.
    let r = FailingReader {
        data: random(2, 4 << 20),
        pos: 0,
        fail_at: 2_500_000,
    };
    let e = store
        .ingest_reader(r, &IngestOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("source went away"), "{e}");
    let after = store.stats().unwrap();
    assert_eq!(
        after.stored_bytes, before.stored_bytes,
        "{before:?} {after:?}"
    );
    assert_eq!(after.packs, before.packs);
    // The store goes on normally.
    let data = random(3, 300_000);
    let s2 = common::commit_bytes(&store, &data, Some(s1.id));
    assert!(common::read_all(&store, &s2, "data.bin") == data);
    assert!(store.verify().unwrap().is_ok());
}

#[test]
fn gc_cuts_a_torn_pack_tail() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let data = random(4, 200_000);
    let rec = {
        let store = common::open(&root, 65536);
        common::commit_bytes(&store, &data, None)
    };
    // What a process killed mid-append leaves: bytes no index entry names.
    let pack = std::fs::read_dir(packs_dir(&root))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    let len = std::fs::metadata(&pack).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(&pack)
        .unwrap();
    f.write_all_at(&random(5, 30_000), len).unwrap();
    drop(f);
    let store = common::open(&root, 65536);
    assert_eq!(store.stats().unwrap().garbage_bytes, 30_000);
    let g = store.gc().unwrap();
    assert_eq!(g.bytes_reclaimed, 30_000, "{g:?}");
    assert_eq!(std::fs::metadata(&pack).unwrap().len(), len);
    assert!(common::read_all(&store, &rec, "data.bin") == data);
    // New appends land where the tail was and read back fine.
    let more = random(6, 100_000);
    let rec2 = common::commit_bytes(&store, &more, None);
    store.drop_cache();
    assert!(common::read_all(&store, &rec2, "data.bin") == more);
    assert!(store.verify().unwrap().is_ok());
}
