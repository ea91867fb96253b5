//! `forkd store stats|verify|gc|ls`: inspect and maintain the layer store.

use anyhow::{bail, Result};
use clap::Subcommand;
use forkd_layers::{SnapshotRecord, Store};
use forkd_snapshot::mib;
use forkd_snapshot::Paths;

#[derive(Subcommand, Debug)]
pub enum StoreCmd {
    /// Space and object counts: logical, unique and stored bytes, dedup and compression ratios.
    Stats {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Re-hash every stored chunk and cross-check all metadata; exits 1 if anything is wrong.
    Verify,
    /// Reclaim the space of chunks no snapshot references.
    Gc,
    /// List every snapshot in the store (tagged or not) with its parent and size.
    Ls,
}

pub async fn run(paths: &Paths, cmd: StoreCmd) -> Result<i32> {
    forkd_snapshot::store::with_rw(paths, move |store| match cmd {
        StoreCmd::Stats { json } => stats(store, json),
        StoreCmd::Verify => verify(store),
        StoreCmd::Gc => gc(store),
        StoreCmd::Ls => ls(store),
    })
    .await
}

fn stats(store: &Store, json: bool) -> Result<i32> {
    let s = store.stats()?;
    if json {
        let v = serde_json::json!({
            "snapshots": s.snapshots, "tags": s.tags, "manifests": s.manifests,
            "chunks": s.chunks, "referenced_chunks": s.referenced_chunks, "packs": s.packs,
            "logical_bytes": s.logical_bytes, "zero_bytes": s.zero_bytes,
            "unique_bytes": s.unique_bytes, "stored_bytes": s.stored_bytes,
            "live_stored_bytes": s.live_stored_bytes, "garbage_bytes": s.garbage_bytes,
            "index_bytes": s.index_bytes, "dedup_ratio": s.dedup_ratio,
            "compression_ratio": s.compression_ratio,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    println!("store:            {}", store.root().display());
    println!("snapshots:        {} ({} tags)", s.snapshots, s.tags);
    println!(
        "chunks:           {} indexed, {} referenced, {} packs",
        s.chunks, s.referenced_chunks, s.packs
    );
    println!(
        "logical:          {} ({} of it zero)",
        mib(s.logical_bytes),
        mib(s.zero_bytes)
    );
    println!("unique:           {}", mib(s.unique_bytes));
    println!(
        "stored:           {} ({} live, {} garbage; `forkd store gc` reclaims garbage)",
        mib(s.stored_bytes),
        mib(s.live_stored_bytes),
        mib(s.garbage_bytes)
    );
    println!("index:            {}", mib(s.index_bytes));
    println!(
        "dedup ratio:      {:.2}x   compression ratio: {:.2}x",
        s.dedup_ratio, s.compression_ratio
    );
    Ok(0)
}

fn verify(store: &Store) -> Result<i32> {
    let r = store.verify()?;
    println!(
        "checked {} chunks ({}) in {} snapshots",
        r.chunks_checked,
        mib(r.bytes_checked),
        r.snapshots_checked
    );
    for b in &r.bad_chunks {
        let pack = b
            .pack
            .as_ref()
            .map_or("(not indexed)".into(), |p| p.display().to_string());
        println!(
            "BAD chunk {} in {pack} at offset {}: {}",
            b.id, b.offset, b.reason
        );
        for u in &b.users {
            println!("    used by snapshot {} file {}", u.snapshot, u.file);
        }
    }
    for p in &r.problems {
        println!("PROBLEM {p}");
    }
    if r.is_ok() {
        println!("store is consistent");
        Ok(0)
    } else {
        println!(
            "{} bad chunks, {} metadata problems",
            r.bad_chunks.len(),
            r.problems.len()
        );
        Ok(1)
    }
}

fn gc(store: &Store) -> Result<i32> {
    let r = store.gc()?;
    println!(
        "removed {} manifests and {} chunks; deleted {} packs ({} rewritten, {} moved); reclaimed {} in {} ms",
        r.manifests_removed,
        r.chunks_removed,
        r.packs_deleted,
        r.packs_rewritten,
        mib(r.bytes_moved),
        mib(r.bytes_reclaimed),
        r.elapsed_ms
    );
    for p in &r.problems {
        println!("PROBLEM {p}");
    }
    if r.problems.is_empty() {
        Ok(0)
    } else {
        bail!("gc kept packs it could not read; run `forkd store verify`")
    }
}

fn ls(store: &Store) -> Result<i32> {
    let snaps = store.list_snapshots()?;
    println!(
        "{:<32}  {:<24} {:<32} {:>10}  FILES",
        "ID", "TAGS", "PARENT", "LOGICAL"
    );
    for r in &snaps {
        print_row(store, r)?;
    }
    println!("{} snapshots", snaps.len());
    Ok(0)
}

fn print_row(store: &Store, r: &SnapshotRecord) -> Result<()> {
    let tags = store.tags_of(&r.id)?.join(",");
    let parent = r
        .parent
        .map(|p| p.to_string())
        .unwrap_or_else(|| "-".into());
    let files: Vec<&str> = r.files.keys().map(String::as_str).collect();
    println!(
        "{:<32}  {:<24} {:<32} {:>10}  {}",
        r.id.to_string(),
        if tags.is_empty() { "-".into() } else { tags },
        parent,
        mib(r.logical_bytes()),
        files.join(",")
    );
    Ok(())
}
