//! Round-trip properties: any file reads back byte-exact; zero regions and
//! repeated content cost nothing; dirty-range ingest equals a full ingest.

mod common;

use std::os::unix::fs::FileExt;

use forkd_layers::synth::SplitMix64;
use forkd_layers::{ChunkRef, IngestOptions};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Content with zero runs, repeated chunk-aligned blocks, text and random bytes.
fn content(seed: u64, size: usize, cs: usize) -> Vec<u8> {
    let mut rng = SplitMix64(seed);
    let mut out = Vec::with_capacity(size);
    while out.len() < size {
        let n = (rng.below(3 * cs as u64) as usize + 1).min(size - out.len());
        match rng.below(4) {
            0 => out.resize(out.len() + n, 0),
            1 if out.len() >= cs => {
                let src = rng.below((out.len() / cs) as u64) as usize * cs;
                let n = n.min(cs);
                let block = out[src..src + n].to_vec();
                out.extend_from_slice(&block);
            }
            2 => out.extend((0..n).map(|i| b"forkd layer store "[i % 18])),
            _ => {
                let start = out.len();
                out.resize(start + n, 0);
                rng.fill(&mut out[start..]);
            }
        }
    }
    out
}

fn size_strategy(cs: usize) -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(cs - 1),
        Just(cs),
        Just(cs + 1),
        Just(3 * cs + 1),
        0..400_000usize,
    ]
}

#[test]
fn any_file_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(&dir.path().join("store"), 65536);
    let scratch = dir.path().join("scratch.bin");
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    let strat = prop_oneof![Just(4096usize), Just(16384), Just(65536)]
        .prop_flat_map(|cs| (Just(cs), size_strategy(cs), any::<u64>()));
    runner
        .run(&strat, |(cs, size, seed)| {
            let data = content(seed, size, cs);
            let opts = IngestOptions {
                chunk_size: Some(cs as u32),
                ..Default::default()
            };
            let a = store.ingest_reader(&data[..], &opts).unwrap();
            common::write_sparse(&scratch, &data);
            let b = store.ingest_file(&scratch, &opts).unwrap();
            // Content addressing: the same bytes give the same manifest
            // whichever way they were ingested.
            prop_assert_eq!(a.manifest, b.manifest);
            prop_assert_eq!(a.size, size as u64);
            let rec = common::commit_files(&store, &[("data.bin", a.file_ref())], None);
            prop_assert!(common::read_all(&store, &rec, "data.bin") == data);
            // chunk_at tells zero regions apart.
            let r = store.open_file(&rec.id, "data.bin").unwrap();
            for (i, slot) in data.chunks(cs).enumerate() {
                let zero = slot.iter().all(|&x| x == 0);
                prop_assert_eq!(r.chunk_at((i * cs) as u64) == ChunkRef::Zero, zero);
            }
            Ok(())
        })
        .unwrap();
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{report:?}");
}

#[test]
fn sparse_4gib_file_costs_almost_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(&dir.path().join("store"), 256 * 1024);
    let path = dir.path().join("sparse.bin");
    let size: u64 = 4 << 30;
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    let islands = [0u64, (2 << 30) + 12345, size - 100_000];
    let mut rng = SplitMix64(42);
    for &off in &islands {
        let mut buf = vec![0u8; ((size - off).min(1 << 20)) as usize];
        rng.fill(&mut buf);
        f.write_all_at(&buf, off).unwrap();
    }
    drop(f);
    let ing = store.ingest_file(&path, &IngestOptions::default()).unwrap();
    assert_eq!(ing.size, size);
    assert!(ing.bytes_read <= 4 << 20, "read {} bytes", ing.bytes_read);
    let rec = common::commit_files(&store, &[("memory.bin", ing.file_ref())], None);
    let stats = store.stats().unwrap();
    assert!(stats.stored_bytes < 4 << 20, "{stats:?}");
    assert_eq!(stats.logical_bytes, size);
    // Byte-exact against the file, 16 MiB at a time.
    let r = store.open_file(&rec.id, "memory.bin").unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let mut want = vec![0u8; 16 << 20];
    let mut got = vec![0u8; 16 << 20];
    let mut off = 0u64;
    while off < size {
        f.read_exact_at(&mut want, off).unwrap();
        assert_eq!(r.read_at(&mut got, off).unwrap(), want.len());
        assert!(got == want, "mismatch in block at {off}");
        off += want.len() as u64;
    }
}

#[test]
fn zero_regions_and_repeats_cost_no_space() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(&dir.path().join("store"), 65536);
    let zeros = vec![0u8; 10 << 20];
    let ing = store
        .ingest_reader(&zeros[..], &IngestOptions::default())
        .unwrap();
    assert_eq!(ing.new_chunks, 0);
    assert_eq!(ing.zero_chunks, 160);
    common::commit_files(&store, &[("zeros", ing.file_ref())], None);
    assert_eq!(store.stats().unwrap().stored_bytes, 0);

    // One random block repeated 32 times is stored once.
    let mut block = vec![0u8; 65536];
    SplitMix64(1).fill(&mut block);
    let data: Vec<u8> = block.iter().copied().cycle().take(32 * 65536).collect();
    let a = store
        .ingest_reader(&data[..], &IngestOptions::default())
        .unwrap();
    assert_eq!((a.new_chunks, a.reused_chunks), (1, 31));
    common::commit_files(&store, &[("rep", a.file_ref())], None);
    let s1 = store.stats().unwrap();
    // A second ingest of the same content adds nothing.
    let b = store
        .ingest_reader(&data[..], &IngestOptions::default())
        .unwrap();
    assert_eq!(b.manifest, a.manifest);
    assert_eq!(b.new_stored_bytes, 0);
    common::commit_files(&store, &[("rep", b.file_ref())], None);
    let s2 = store.stats().unwrap();
    assert_eq!(s1.stored_bytes, s2.stored_bytes);
    assert_eq!(s2.logical_bytes, s1.logical_bytes + data.len() as u64);
    assert!(s2.dedup_ratio > 60.0, "{s2:?}");
}

#[test]
fn dirty_range_ingest_equals_full_ingest() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(&dir.path().join("store"), 16384);
    let path = dir.path().join("f.bin");
    let mut runner = TestRunner::new(Config {
        cases: 24,
        ..Config::default()
    });
    let strat = (
        1usize..600_000,
        any::<u64>(),
        0usize..20,
        -70_000i64..70_000,
    );
    runner
        .run(&strat, |(size, seed, n_dirty, grow)| {
            let base = content(seed, size, 16384);
            common::write_sparse(&path, &base);
            let b = store.ingest_file(&path, &IngestOptions::default()).unwrap();
            let mut rng = SplitMix64(seed ^ 7);
            let mut data = base.clone();
            let new_len = (size as i64 + grow).max(0) as usize;
            data.resize(new_len, 0);
            if new_len > size {
                rng.fill(&mut data[size..]);
            }
            let mut dirty = Vec::new();
            for _ in 0..n_dirty {
                if data.is_empty() {
                    break;
                }
                let o = rng.below(data.len() as u64) as usize;
                let n = (rng.below(9000) as usize + 1).min(data.len() - o);
                rng.fill(&mut data[o..o + n]);
                dirty.push(o as u64..(o + n) as u64);
            }
            if new_len > size {
                dirty.push(size as u64..new_len as u64);
            }
            common::write_sparse(&path, &data);
            let incr = store
                .ingest_file(
                    &path,
                    &IngestOptions {
                        base: Some(b.manifest),
                        dirty: Some(dirty),
                        ..Default::default()
                    },
                )
                .unwrap();
            let full = store.ingest_file(&path, &IngestOptions::default()).unwrap();
            prop_assert_eq!(incr.manifest, full.manifest);
            prop_assert!(incr.bytes_read <= full.bytes_read);
            let rec = common::commit_files(&store, &[("m", incr.file_ref())], None);
            prop_assert!(common::read_all(&store, &rec, "m") == data);
            Ok(())
        })
        .unwrap();
}

#[test]
fn dirty_ingest_reads_only_dirty_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(&dir.path().join("store"), 65536);
    let path = dir.path().join("f.bin");
    let mut data = vec![0u8; 8 << 20];
    SplitMix64(3).fill(&mut data);
    std::fs::write(&path, &data).unwrap();
    let base = store.ingest_file(&path, &IngestOptions::default()).unwrap();
    data[100_000] ^= 1;
    data[5_000_000] ^= 1;
    std::fs::write(&path, &data).unwrap();
    let progress = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let p2 = progress.clone();
    let incr = store
        .ingest_file(
            &path,
            &IngestOptions {
                base: Some(base.manifest),
                dirty: Some(vec![100_000..100_001, 5_000_000..5_000_001]),
                progress: Some(std::sync::Arc::new(move |done, total| {
                    p2.lock().unwrap().push((done, total))
                })),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(incr.bytes_read, 2 * 65536);
    assert_eq!(incr.new_chunks, 2);
    assert_eq!(incr.base_chunks, 126);
    let p = progress.lock().unwrap();
    assert_eq!(p.last(), Some(&(8 << 20, 8 << 20)));
    // Dirty ranges without a base, or on a stream, are refused.
    let e = store
        .ingest_file(
            &path,
            &IngestOptions {
                dirty: Some(vec![0..1, 5..6]),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("base"), "{e}");
}
