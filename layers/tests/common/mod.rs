//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

use forkd_layers::{FileRef, IngestOptions, NewSnapshot, SnapshotRecord, Store, StoreOptions};

/// Options for tests: small packs so rollover and GC rewrites happen.
pub fn opts(chunk_size: u32) -> StoreOptions {
    StoreOptions {
        chunk_size,
        max_pack_bytes: 1 << 20,
        cache_bytes: 8 << 20,
        lock_timeout: std::time::Duration::from_millis(300),
        ..StoreOptions::default()
    }
}

pub fn open(root: &Path, chunk_size: u32) -> Store {
    Store::open(root, opts(chunk_size)).unwrap()
}

/// Ingests `data` and commits it as a one-file snapshot.
pub fn commit_bytes(
    store: &Store,
    data: &[u8],
    parent: Option<forkd_layers::SnapshotId>,
) -> SnapshotRecord {
    let ing = store
        .ingest_reader(data, &IngestOptions::default())
        .unwrap();
    commit_files(store, &[("data.bin", ing.file_ref())], parent)
}

pub fn commit_files(
    store: &Store,
    files: &[(&str, FileRef)],
    parent: Option<forkd_layers::SnapshotId>,
) -> SnapshotRecord {
    let files: BTreeMap<String, FileRef> = files.iter().map(|(n, f)| (n.to_string(), *f)).collect();
    store
        .commit_snapshot(NewSnapshot {
            parent,
            files,
            ..Default::default()
        })
        .unwrap()
}

/// Reads a whole snapshot file through a FileReader, in odd-sized pieces.
pub fn read_all(store: &Store, rec: &SnapshotRecord, name: &str) -> Vec<u8> {
    let r = store.open_file(&rec.id, name).unwrap();
    let mut out = vec![0u8; r.size() as usize];
    let mut off = 0usize;
    let mut step = 1000usize;
    while off < out.len() {
        let end = (off + step).min(out.len());
        let n = r.read_at(&mut out[off..end], off as u64).unwrap();
        assert_eq!(n, end - off);
        off = end;
        step = step * 3 % 300_007 + 1;
    }
    let mut tail = [0u8; 8];
    assert_eq!(r.read_at(&mut tail, r.size()).unwrap(), 0);
    out
}

/// Writes `data` to `path`, leaving all-zero 4 KiB pages as holes.
pub fn write_sparse(path: &Path, data: &[u8]) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(data.len() as u64).unwrap();
    for (i, pg) in data.chunks(4096).enumerate() {
        if pg.iter().any(|&b| b != 0) {
            f.write_all_at(pg, (i * 4096) as u64).unwrap();
        }
    }
}
