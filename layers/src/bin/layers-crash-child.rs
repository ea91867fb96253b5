//! Crash-test workload (used by layers/tests/crash.rs, killed with SIGKILL
//! at random points): ingests deterministic content, commits snapshots,
//! deletes some and runs GC, forever.
//!
//! Usage: layers-crash-child STORE_DIR SEED
//!
//! Every snapshot's lineage records `seed` and `iter`; its single file
//! `data.bin` is `crash_content(seed, iter)`, so the test can regenerate it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use forkd_layers::synth::{crash_content, SplitMix64};
use forkd_layers::{IngestOptions, NewSnapshot, Store, StoreOptions};

/// Chunk size of the crash workload (small, for many chunks per file).
const CHUNK: u32 = 64 * 1024;

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(dir), Some(seed)) = (args.next(), args.next()) else {
        eprintln!("usage: layers-crash-child STORE_DIR SEED");
        std::process::exit(2);
    };
    let seed: u64 = seed.parse().expect("numeric seed");
    let root = PathBuf::from(dir);
    let opts = StoreOptions {
        chunk_size: CHUNK,
        max_pack_bytes: 2 << 20,
        lock_timeout: std::time::Duration::from_secs(30),
        ..StoreOptions::default()
    };
    let store = Store::open(&root, opts).expect("open store");
    let scratch = root.with_extension("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let mut rng = SplitMix64(seed);
    let mut parent = None;
    for iter in 0u64.. {
        let data = crash_content(seed, iter, CHUNK as usize);
        let ingested = if iter % 2 == 0 {
            store
                .ingest_reader(&data[..], &IngestOptions::default())
                .unwrap()
        } else {
            let path = scratch.join(format!("{seed}-{iter}.bin"));
            write_sparse(&path, &data);
            let r = store.ingest_file(&path, &IngestOptions::default()).unwrap();
            std::fs::remove_file(&path).unwrap();
            r
        };
        let mut files = BTreeMap::new();
        files.insert("data.bin".to_string(), ingested.file_ref());
        let mut lineage = BTreeMap::new();
        lineage.insert("seed".to_string(), seed.into());
        lineage.insert("iter".to_string(), iter.into());
        let rec = store
            .commit_snapshot(NewSnapshot {
                parent: if rng.chance(0.5) { parent } else { None },
                files,
                config: serde_json::json!({"workload": "crash"}),
                lineage,
                tag: Some(format!("crash-{}", iter % 3)),
                replace_tag: true,
            })
            .unwrap();
        parent = Some(rec.id);
        if iter % 3 == 2 {
            delete_some_leaf(&store, &mut rng, rec.id);
        }
        if iter % 5 == 4 {
            store.gc().unwrap();
        }
    }
}

/// Deletes a random snapshot that has no children (never `keep`).
fn delete_some_leaf(store: &Store, rng: &mut SplitMix64, keep: forkd_layers::SnapshotId) {
    let all = store.list_snapshots().unwrap();
    let leaves: Vec<_> = all
        .iter()
        .filter(|r| r.id != keep && store.dependents(&r.id).unwrap().is_empty())
        .collect();
    if !leaves.is_empty() {
        let victim = leaves[rng.below(leaves.len() as u64) as usize].id;
        store.delete_snapshot(&victim).unwrap();
    }
}

/// Writes `data` leaving zero 4 KiB pages as holes.
fn write_sparse(path: &std::path::Path, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(path).unwrap();
    f.set_len(data.len() as u64).unwrap();
    for (i, pg) in data.chunks(4096).enumerate() {
        if pg.iter().any(|&b| b != 0) {
            f.write_all_at(pg, (i * 4096) as u64).unwrap();
        }
    }
}
