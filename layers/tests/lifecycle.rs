//! Snapshots, tags, refcounts, GC (including against concurrent ingests),
//! diff, secondary readers and the store lock.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use forkd_layers::synth::{mixed_file, SplitMix64};
use forkd_layers::{Error, FileRef, FileStatus, IngestOptions, NewSnapshot, Store, StoreReader};

fn random(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    SplitMix64(seed).fill(&mut v);
    v
}

#[test]
fn tag_rule_and_tag_moves() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536);
    let a = common::commit_bytes(&store, b"hello", None);
    let b = common::commit_bytes(&store, b"world", None);
    for bad in ["../x", "a/b", ".", "", &"x".repeat(65)] {
        let e = store.set_tag(bad, &a.id).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("invalid tag '{bad}': 1-64 chars, ASCII alnum or dash/underscore")
        );
    }
    let long = "x".repeat(64);
    store.set_tag(&long, &a.id).unwrap();
    store.set_tag(&long, &a.id).unwrap(); // idempotent
    assert!(matches!(
        store.set_tag(&long, &b.id),
        Err(Error::TagExists { .. })
    ));
    store.set_tag_force(&long, &b.id).unwrap();
    assert_eq!(store.resolve(&long).unwrap().unwrap().id, b.id);
    assert_eq!(store.resolve(&a.id.to_string()).unwrap().unwrap().id, a.id);
    assert!(store.resolve("nope").unwrap().is_none());
    store.untag(&long).unwrap();
    assert!(matches!(store.untag(&long), Err(Error::NoSuchTag(_))));
    // Commit with a tag is atomic with the record; taken tags need replace.
    let mut files = BTreeMap::new();
    files.insert("f".to_string(), a.files["data.bin"]);
    let spec = NewSnapshot {
        files,
        tag: Some("base".into()),
        ..Default::default()
    };
    let c = store.commit_snapshot(spec.clone()).unwrap();
    assert!(matches!(
        store.commit_snapshot(spec.clone()),
        Err(Error::TagExists { .. })
    ));
    let d = store
        .commit_snapshot(NewSnapshot {
            replace_tag: true,
            ..spec
        })
        .unwrap();
    assert_eq!(store.tags().unwrap(), vec![("base".to_string(), d.id)]);
    assert_ne!(c.id, d.id);
}

#[test]
fn commit_validation() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536);
    let ing = store
        .ingest_reader(&b"abc"[..], &IngestOptions::default())
        .unwrap();
    let bad_name = NewSnapshot {
        files: [("../etc".to_string(), ing.file_ref())].into(),
        ..Default::default()
    };
    assert!(matches!(
        store.commit_snapshot(bad_name),
        Err(Error::InvalidFileName(_))
    ));
    let wrong_size = NewSnapshot {
        files: [(
            "f".to_string(),
            FileRef {
                manifest: ing.manifest,
                size: 4,
            },
        )]
        .into(),
        ..Default::default()
    };
    assert!(store.commit_snapshot(wrong_size).is_err());
    let missing = NewSnapshot {
        files: [(
            "f".to_string(),
            FileRef {
                manifest: forkd_layers::ManifestId([7; 32]),
                size: 3,
            },
        )]
        .into(),
        ..Default::default()
    };
    assert!(matches!(
        store.commit_snapshot(missing),
        Err(Error::MissingManifest(_))
    ));
    let orphan = NewSnapshot {
        parent: Some(forkd_layers::SnapshotId([1; 16])),
        files: [("f".to_string(), ing.file_ref())].into(),
        ..Default::default()
    };
    assert!(matches!(
        store.commit_snapshot(orphan),
        Err(Error::NoSuchSnapshot(_))
    ));
}

#[test]
fn lineage_and_delete_with_dependents() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536);
    let root = common::commit_bytes(&store, b"root", None);
    let child = common::commit_bytes(&store, b"child", Some(root.id));
    let grandchild = common::commit_bytes(&store, b"gc", Some(child.id));
    store.set_tag("child", &child.id).unwrap();
    assert_eq!(
        store.ancestors(&grandchild.id).unwrap(),
        vec![root.id, child.id]
    );
    assert_eq!(store.ancestors(&root.id).unwrap(), vec![]);
    assert_eq!(store.dependents(&root.id).unwrap(), vec![child.id]);
    let e = store.delete_snapshot(&child.id).unwrap_err();
    assert!(
        matches!(&e, Error::HasDependents { children, .. } if children == &vec![grandchild.id])
    );
    assert!(e.to_string().contains(&grandchild.id.to_string()), "{e}");
    store.delete_snapshot(&grandchild.id).unwrap();
    let rep = store.delete_snapshot(&child.id).unwrap();
    assert_eq!(rep.tags_removed, vec!["child".to_string()]);
    assert!(store.tags().unwrap().is_empty());
    assert!(store.snapshot(&child.id).unwrap().is_none());
    assert_eq!(store.list_snapshots().unwrap().len(), 1);
    assert!(store.verify().unwrap().is_ok());
}

#[test]
fn refcounts_reach_zero_with_last_snapshot_and_gc_reclaims() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536);
    let data = random(1, 40 * 65536);
    let a = common::commit_bytes(&store, &data, None);
    let mut more = data.clone();
    more.extend(random(2, 3 * 65536));
    let b = common::commit_bytes(&store, &more, None);
    let c = common::commit_bytes(&store, &data, None);
    let s = store.stats().unwrap();
    assert_eq!(s.referenced_chunks, 43);
    // a and c share a manifest; deleting one of them releases nothing.
    let r = store.delete_snapshot(&a.id).unwrap();
    assert_eq!((r.manifests_released, r.chunks_released), (0, 0));
    // b's own 3 chunks go when b goes; the shared 40 stay.
    let r = store.delete_snapshot(&b.id).unwrap();
    assert_eq!((r.manifests_released, r.chunks_released), (1, 3));
    assert_eq!(store.stats().unwrap().referenced_chunks, 40);
    let r = store.delete_snapshot(&c.id).unwrap();
    assert_eq!((r.manifests_released, r.chunks_released), (1, 40));
    assert_eq!(store.stats().unwrap().referenced_chunks, 0);
    assert!(store.verify().unwrap().is_ok());
    let g = store.gc().unwrap();
    assert_eq!(g.chunks_removed, 43);
    assert_eq!(g.manifests_removed, 2);
    let s = store.stats().unwrap();
    assert_eq!(
        (s.stored_bytes, s.chunks, s.manifests, s.packs),
        (0, 0, 0, 0)
    );
    // The store still works after everything was collected.
    let d = common::commit_bytes(&store, &data, None);
    assert!(common::read_all(&store, &d, "data.bin") == data);
    assert!(store.verify().unwrap().is_ok());
}

#[test]
fn gc_rewrites_mostly_garbage_packs() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536); // 1 MiB packs
    let mut recs = Vec::new();
    for i in 0..12 {
        let data = random(100 + i, 6 * 65536);
        recs.push((common::commit_bytes(&store, &data, None), data));
    }
    let before = store.stats().unwrap();
    // Delete 3 of every 4 snapshots: most packs become >50% garbage.
    for (i, (r, _)) in recs.iter().enumerate() {
        if i % 4 != 0 {
            store.delete_snapshot(&r.id).unwrap();
        }
    }
    let g = store.gc().unwrap();
    assert!(g.packs_rewritten > 0, "{g:?}");
    let after = store.stats().unwrap();
    assert!(
        after.stored_bytes < before.stored_bytes / 2,
        "{before:?} {after:?}"
    );
    assert!(after.garbage_bytes < after.stored_bytes / 2, "{after:?}");
    for (i, (r, data)) in recs.iter().enumerate() {
        if i % 4 == 0 {
            store.drop_cache();
            assert!(common::read_all(&store, r, "data.bin") == *data);
        }
    }
    assert!(store.verify().unwrap().is_ok());
}

#[test]
fn gc_keeps_chunks_of_uncommitted_ingests() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536);
    let data = random(5, 10 * 65536);
    let s1 = common::commit_bytes(&store, &data, None);
    store.delete_snapshot(&s1.id).unwrap(); // chunks now at refcount 0
                                            // Re-ingest dedups against the zero-ref chunks (adds nothing) ...
    let ing = store
        .ingest_reader(&data[..], &IngestOptions::default())
        .unwrap();
    assert_eq!(ing.new_chunks, 0);
    // ... GC runs before the commit and must not drop them ...
    let g = store.gc().unwrap();
    assert_eq!(g.chunks_removed, 0, "{g:?}");
    // ... so the commit and reads succeed.
    let s2 = common::commit_files(&store, &[("data.bin", ing.file_ref())], None);
    store.drop_cache();
    assert!(common::read_all(&store, &s2, "data.bin") == data);
    // A released (abandoned) ingest is collectable, and committing it later
    // is refused rather than referencing deleted data.
    let other = random(6, 3 * 65536);
    let ing2 = store
        .ingest_reader(&other[..], &IngestOptions::default())
        .unwrap();
    store.release(&ing2.manifest);
    let g = store.gc().unwrap();
    assert_eq!((g.chunks_removed, g.manifests_removed), (3, 1), "{g:?}");
    let spec = NewSnapshot {
        files: [("x".to_string(), ing2.file_ref())].into(),
        ..Default::default()
    };
    assert!(store.commit_snapshot(spec).is_err());
    assert!(store.verify().unwrap().is_ok());
}

#[test]
fn gc_concurrent_with_ingest_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(common::open(dir.path(), 65536));
    let stop = Arc::new(AtomicBool::new(false));
    let gc = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut runs = 0;
            while !stop.load(Ordering::Relaxed) {
                store.gc().unwrap();
                runs += 1;
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            runs
        })
    };
    let mut live = Vec::new();
    for i in 0..60u64 {
        // mixed_file shares pool blocks across files: lots of dedup against
        // chunks that other snapshots' deletion just released.
        let data = mixed_file(i, 500_000, 65536);
        let rec = common::commit_bytes(&store, &data, None);
        live.push((rec, data));
        if i % 2 == 1 {
            let (victim, _) = live.remove((i as usize * 7) % live.len());
            store.delete_snapshot(&victim.id).unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    let runs = gc.join().unwrap();
    assert!(runs > 0);
    store.gc().unwrap();
    store.drop_cache();
    for (rec, data) in &live {
        assert!(common::read_all(&store, rec, "data.bin") == *data);
    }
    let v = store.verify().unwrap();
    assert!(v.is_ok(), "{v:?}");
}

#[test]
fn diff_counts_new_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536);
    let base = random(9, 16 * 65536);
    let a = common::commit_bytes(&store, &base, None);
    let mut changed = base.clone();
    for slot in [1usize, 7, 15] {
        changed[slot * 65536 + 100] ^= 0xff;
    }
    changed.truncate(15 * 65536 + 1000); // last chunk short and changed
    let m1 = store
        .ingest_reader(&changed[..], &IngestOptions::default())
        .unwrap();
    let extra = random(10, 2 * 65536 + 5);
    let m2 = store
        .ingest_reader(&extra[..], &IngestOptions::default())
        .unwrap();
    let b = common::commit_files(
        &store,
        &[("data.bin", m1.file_ref()), ("vmstate", m2.file_ref())],
        Some(a.id),
    );
    let d = store.diff(&a.id, &b.id).unwrap();
    let f = &d.files["data.bin"];
    assert_eq!(f.status, FileStatus::Changed);
    assert_eq!(f.new_chunks, 3);
    assert_eq!(f.new_raw_bytes, 2 * 65536 + 1000);
    let v = &d.files["vmstate"];
    assert_eq!(v.status, FileStatus::Added);
    assert_eq!((v.new_chunks, v.new_raw_bytes), (3, 2 * 65536 + 5));
    assert_eq!(d.new_chunks, 6);
    assert_eq!(
        d.new_stored_bytes,
        m1.new_stored_bytes + m2.new_stored_bytes
    );
    assert_eq!(d.new_raw_bytes, m1.new_raw_bytes + m2.new_raw_bytes);
    let same = store.diff(&a.id, &a.id).unwrap();
    assert_eq!(same.new_chunks, 0);
    assert_eq!(same.files["data.bin"].status, FileStatus::Unchanged);
    let back = store.diff(&b.id, &a.id).unwrap();
    assert_eq!(back.removed_files, vec!["vmstate".to_string()]);
}

#[test]
fn secondary_reader_follows_primary() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let store = Store::open(
        &root,
        forkd_layers::StoreOptions {
            gc_rewrite_threshold: 0.01,
            ..common::opts(65536)
        },
    )
    .unwrap();
    let d1 = random(11, 5 * 65536);
    let s1 = common::commit_bytes(&store, &d1, None);
    let reader = StoreReader::open_secondary(&root, &dir.path().join("sec")).unwrap();
    assert!(reader.is_secondary());
    assert_eq!(reader.list_snapshots().unwrap().len(), 1);
    let d2 = random(12, 5 * 65536);
    let s2 = common::commit_bytes(&store, &d2, Some(s1.id));
    store.set_tag("two", &s2.id).unwrap();
    assert!(reader.snapshot(&s2.id).unwrap().is_none());
    reader.catch_up().unwrap();
    assert_eq!(reader.resolve("two").unwrap().unwrap().id, s2.id);
    assert_eq!(reader.ancestors(&s2.id).unwrap(), vec![s1.id]);
    let r = reader.open_file(&s2.id, "data.bin").unwrap();
    let mut got = vec![0u8; d2.len()];
    r.read_exact_at(&mut got, 0).unwrap();
    assert!(got == d2);
    // GC on the primary moves s3's chunks to a new pack and deletes the old
    // one. A secondary that learned the old location reads anyway: the one
    // holding an fd keeps reading the unlinked pack, a fresh one finds the
    // pack gone, catches up and retries.
    for i in 0..6 {
        let junk = common::commit_bytes(&store, &random(100 + i, 3 * 65536), None);
        store.delete_snapshot(&junk.id).unwrap();
    }
    store.delete_snapshot(&s2.id).unwrap();
    let s3 = common::commit_bytes(&store, &d2, Some(s1.id));
    let fresh = StoreReader::open_secondary(&root, &dir.path().join("sec2")).unwrap();
    reader.catch_up().unwrap();
    let before = fresh
        .chunk_location(&first_chunk(&fresh, &s3))
        .unwrap()
        .unwrap();
    let g = store.gc().unwrap();
    assert!(g.packs_rewritten > 0, "{g:?}");
    assert!(!forkd_layers::packs_dir(&root)
        .join(format!("pack-{:08}.dat", before.pack))
        .exists());
    for rd in [&reader, &fresh] {
        rd.drop_cache();
        let r = rd.open_file(&s3.id, "data.bin").unwrap();
        let mut got = vec![0u8; d2.len()];
        r.read_exact_at(&mut got, 0).unwrap();
        assert!(got == d2);
    }
    // A secondary needs an existing store.
    assert!(StoreReader::open_secondary(&dir.path().join("nope"), &dir.path().join("s2")).is_err());
}

fn first_chunk(
    view: &forkd_layers::StoreView,
    rec: &forkd_layers::SnapshotRecord,
) -> forkd_layers::ChunkId {
    let m = view.manifest(&rec.files["data.bin"].manifest).unwrap();
    m.distinct_chunks()[0]
}

#[test]
fn second_writer_waits_then_names_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let _store = common::open(dir.path(), 65536);
    let t = std::time::Instant::now();
    let e = match Store::open(dir.path(), common::opts(65536)) {
        Err(e) => e,
        Ok(_) => panic!("second writer opened"),
    };
    assert!(t.elapsed() >= std::time::Duration::from_millis(300));
    let msg = e.to_string();
    assert!(
        msg.contains("LOCK") && msg.contains("another forkd process"),
        "{msg}"
    );
}

#[test]
fn concurrent_reads_from_many_threads() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open(dir.path(), 65536);
    let data = mixed_file(77, 3 << 20, 65536);
    let rec = common::commit_bytes(&store, &data, None);
    let r = store.open_file(&rec.id, "data.bin").unwrap();
    let data = Arc::new(data);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (r, data) = (&r, data.clone());
            s.spawn(move || {
                let mut rng = SplitMix64(t);
                let mut buf = vec![0u8; 10_000];
                for _ in 0..300 {
                    let off = rng.below(data.len() as u64) as usize;
                    let n = r.read_at(&mut buf, off as u64).unwrap();
                    assert_eq!(&buf[..n], &data[off..off + n]);
                }
            });
        }
    });
    assert!(store.cache_stats().hits > 0);
}

#[test]
fn pack_numbers_are_never_reused() {
    let dir = tempfile::tempdir().unwrap();
    let pack_of = |store: &Store, rec: &forkd_layers::SnapshotRecord| {
        let c = first_chunk(store, rec);
        store.chunk_location(&c).unwrap().unwrap().pack
    };
    let old = {
        let store = common::open(dir.path(), 65536);
        let a = common::commit_bytes(&store, &random(1, 4 * 65536), None);
        let n = pack_of(&store, &a);
        store.delete_snapshot(&a.id).unwrap();
        let g = store.gc().unwrap();
        assert_eq!(g.packs_deleted, 1, "{g:?}");
        n
    };
    // After a restart with an empty packs/ directory, the new pack must not
    // take the deleted pack's number (a secondary may hold its old fd).
    let store = common::open(dir.path(), 65536);
    let b = common::commit_bytes(&store, &random(2, 4 * 65536), None);
    assert!(pack_of(&store, &b) > old);
}

/// A chunk deleted by GC and indexed again by a later writer, with the
/// primary closed and reopened in between (as poold and the CLI take turns
/// on the store): a secondary that saw the deletion must see the chunk
/// again after a catch-up. RocksDB's own catch-up keeps serving the
/// deletion from the secondary's memtable once the primary has flushed the
/// newer entry at reopen (facebook/rocksdb#14444, #15051).
#[test]
fn secondary_sees_a_chunk_indexed_again_after_primary_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let data = random(21, 4 * 65536);
    let open = || Store::open(&root, common::opts(65536)).unwrap();
    let store = open();
    let keep = common::commit_bytes(&store, &random(20, 2 * 65536), None);
    let first = common::commit_bytes(&store, &data, None);
    let reader = StoreReader::open_secondary(&root, &dir.path().join("sec")).unwrap();
    let chunk = first_chunk(&reader, &first);
    assert!(reader.chunk_location(&chunk).unwrap().is_some());
    // Deleted and collected: the secondary replays the deletion.
    store.delete_snapshot(&first.id).unwrap();
    store.gc().unwrap();
    reader.catch_up().unwrap();
    assert!(reader.chunk_location(&chunk).unwrap().is_none());
    drop(store);
    // Another writer session indexes the same bytes again; the one after it
    // flushes that at open.
    let store = open();
    let again = common::commit_bytes(&store, &data, Some(keep.id));
    drop(store);
    let store = open();
    reader.catch_up().unwrap();
    assert!(
        reader.chunk_location(&chunk).unwrap().is_some(),
        "the secondary still misses a chunk the primary has"
    );
    let r = reader.open_file(&again.id, "data.bin").unwrap();
    let mut got = vec![0u8; data.len()];
    r.read_exact_at(&mut got, 0).unwrap();
    assert!(got == data);
    drop(store);
}

/// A secondary opened, or caught up, while another writer opens the store:
/// the primary's open flushes the WAL it recovers into a table file, writes
/// a new MANIFEST and deletes that WAL. A secondary that read the old
/// MANIFEST but found the WAL gone saw an empty store ("no format version
/// recorded") or missed the newest commits. Every open and catch-up must
/// see every commit made before it began.
#[test]
fn secondary_opened_while_a_writer_opens_sees_every_commit() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let open = || Store::open(&root, common::opts(65536)).unwrap();
    drop(open());
    let follower = StoreReader::open_secondary(&root, &dir.path().join("sec")).unwrap();
    let mut rng = SplitMix64(77);
    for i in 0..120u64 {
        // A commit left in the WAL, as every writer session leaves it.
        let store = open();
        let rec = common::commit_bytes(&store, &random(1000 + i, 65536), None);
        drop(store);
        let delay = std::time::Duration::from_micros(rng.below(4000));
        let writer = std::thread::spawn({
            let root = root.clone();
            move || drop(Store::open(&root, common::opts(65536)).unwrap())
        });
        std::thread::sleep(delay);
        let fresh = StoreReader::open_secondary(&root, &dir.path().join(format!("s{i}")))
            .unwrap_or_else(|e| panic!("round {i}: a secondary failed to open: {e}"));
        assert!(
            fresh.snapshot(&rec.id).unwrap().is_some(),
            "round {i}: a fresh secondary misses a commit made before it opened"
        );
        follower.catch_up().unwrap();
        assert!(
            follower.snapshot(&rec.id).unwrap().is_some(),
            "round {i}: a caught-up secondary misses a commit made before the catch-up"
        );
        writer.join().unwrap();
        drop(fresh);
        let _ = std::fs::remove_dir_all(dir.path().join(format!("s{i}")));
    }
}
