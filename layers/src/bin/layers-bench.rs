//! Layer-store benchmark: ingest speed, random read latency, stored bytes and
//! dirty-ingest cost for each candidate chunk size. Not a timed test; see
//! docs/BENCHMARKS.md ("Layer store") for results and the chosen default.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use forkd_layers::synth::{guest_memory, SplitMix64};
use forkd_layers::{ChunkRef, IngestOptions, NewSnapshot, Store, StoreOptions};

const HELP: &str = "\
layers-bench: benchmark the forkd layer store on a guest-memory-like file

USAGE: layers-bench [OPTIONS]

OPTIONS:
  --file PATH          use a real memory.bin (e.g. from a warmed guest) instead
                       of generating a synthetic one
  --size-mib N         size of the synthetic file (default 512)
  --seed N             seed of the synthetic file (default 1)
  --dir DIR            scratch directory (default: a new dir under /tmp)
  --chunk-sizes LIST   comma-separated KiB (default 64,256,1024)
  --level N            zstd level (default 3)
  --levels LIST        also sweep zstd levels at the first chunk size, e.g. 1,3,6
  --reads N            random 4 KiB reads per measurement (default 2000)
  --runs N             ingest each configuration N times into a fresh store
                       and report the median speed (default 3)
  --dirty-pages N      scattered 4 KiB pages changed for the dirty test (default 64)
  --threads N          ingest threads (default: all cores)
  --drop-os-cache      echo 1 > /proc/sys/vm/drop_caches before the cold-read
                       pass (root only); otherwise the OS page cache is warm
  --keep               keep the scratch directory
  -h, --help           print this help
";

struct Args {
    file: Option<PathBuf>,
    size_mib: u64,
    seed: u64,
    dir: Option<PathBuf>,
    chunk_kib: Vec<u32>,
    level: i32,
    levels: Vec<i32>,
    reads: usize,
    runs: usize,
    dirty_pages: usize,
    threads: Option<usize>,
    drop_os_cache: bool,
    keep: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        file: None,
        size_mib: 512,
        seed: 1,
        dir: None,
        chunk_kib: vec![64, 256, 1024],
        level: 3,
        levels: Vec::new(),
        reads: 2000,
        runs: 3,
        dirty_pages: 64,
        threads: None,
        drop_os_cache: false,
        keep: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || {
            it.next().unwrap_or_else(|| {
                eprintln!("{arg} needs a value\n\n{HELP}");
                std::process::exit(2)
            })
        };
        match arg.as_str() {
            "--file" => a.file = Some(val().into()),
            "--size-mib" => a.size_mib = num(&val()),
            "--seed" => a.seed = num(&val()),
            "--dir" => a.dir = Some(val().into()),
            "--chunk-sizes" => a.chunk_kib = val().split(',').map(num).collect(),
            "--level" => a.level = num(&val()),
            "--levels" => a.levels = val().split(',').map(num).collect(),
            "--reads" => a.reads = num(&val()),
            "--runs" => a.runs = num::<usize>(&val()).max(1),
            "--dirty-pages" => a.dirty_pages = num(&val()),
            "--threads" => a.threads = Some(num(&val())),
            "--drop-os-cache" => a.drop_os_cache = true,
            "--keep" => a.keep = true,
            "-h" | "--help" => {
                print!("{HELP}");
                std::process::exit(0)
            }
            other => {
                eprintln!("unknown argument {other}\n\n{HELP}");
                std::process::exit(2)
            }
        }
    }
    a
}

fn num<T: std::str::FromStr>(s: &str) -> T {
    s.trim().parse().unwrap_or_else(|_| {
        eprintln!("not a number: {s}");
        std::process::exit(2)
    })
}

/// One row of the result table.
struct Row {
    label: String,
    ingest_mbps: f64,
    stored: u64,
    chunks: u64,
    cold: (Duration, Duration),
    warm: (Duration, Duration),
    dirty_added: u64,
    dirty_ms: f64,
}

fn main() {
    let args = parse_args();
    let scratch = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("layers-bench-{}", std::process::id()))
    });
    std::fs::create_dir_all(&scratch).expect("create scratch dir");
    let (input, source) = match &args.file {
        Some(p) => (p.clone(), format!("real file {}", p.display())),
        None => {
            let p = scratch.join("synthetic-memory.bin");
            write_synthetic(&p, args.size_mib << 20, args.seed);
            (
                p,
                format!(
                    "synthetic {} MiB guest-memory-like file (seed {}): ~55% zero pages \
                     (40% of 2 MiB regions untouched = holes), ~10% duplicate pages, rest \
                     text/code/random pages",
                    args.size_mib, args.seed
                ),
            )
        }
    };
    let size = std::fs::metadata(&input).expect("input file").len();
    let dirty_input = scratch.join("dirty-memory.bin");
    let dirty = make_dirty_copy(&input, &dirty_input, args.dirty_pages, args.seed);
    println!("source: {source}");
    let (zero, dup, pages) = page_census(&input);
    println!(
        "measured: {pages} pages of 4 KiB, {:.1}% zero, {:.1}% duplicates of an earlier non-zero page",
        100.0 * zero as f64 / pages.max(1) as f64,
        100.0 * dup as f64 / pages.max(1) as f64
    );
    println!(
        "machine: {} cores, load average at start {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "ingest MB/s = file size / median of {} ingests into a fresh store (includes fdatasync + RocksDB commit)",
        args.runs
    );
    println!(
        "cold read = store's decompressed-chunk cache dropped before every read; OS page cache {}",
        if args.drop_os_cache {
            "dropped once before the cold pass"
        } else {
            "warm (pack files were just written)"
        }
    );
    println!(
        "reads: {} random 4 KiB-aligned offsets inside non-zero chunks; dirty test: {} scattered 4 KiB pages changed, ingested with base+dirty ranges\n",
        args.reads, args.dirty_pages
    );
    let mut rows = Vec::new();
    for &kib in &args.chunk_kib {
        let r = bench_one(
            &args,
            &scratch,
            &input,
            &dirty_input,
            &dirty,
            size,
            kib,
            args.level,
        );
        rows.push(r);
    }
    if let Some(&kib) = args.chunk_kib.first() {
        for &level in &args.levels {
            rows.push(bench_one(
                &args,
                &scratch,
                &input,
                &dirty_input,
                &dirty,
                size,
                kib,
                level,
            ));
        }
    }
    print_table(size, &rows);
    if !args.keep {
        let _ = std::fs::remove_dir_all(&scratch);
    }
}

#[allow(clippy::too_many_arguments)]
fn bench_one(
    args: &Args,
    scratch: &Path,
    input: &Path,
    dirty_input: &Path,
    dirty: &[std::ops::Range<u64>],
    size: u64,
    kib: u32,
    level: i32,
) -> Row {
    let root = scratch.join(format!("store-{kib}k-l{level}"));
    let mut opts = StoreOptions {
        chunk_size: kib * 1024,
        zstd_level: level,
        cache_bytes: 2 << 30,
        ..StoreOptions::default()
    };
    if let Some(t) = args.threads {
        opts.ingest_threads = t;
    }
    // Ingest into a fresh store `runs` times; keep the last store.
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..args.runs {
        drop(last.take());
        let _ = std::fs::remove_dir_all(&root);
        let store = Store::open(&root, opts.clone()).expect("open store");
        let t = Instant::now();
        let ing = store
            .ingest_file(input, &IngestOptions::default())
            .expect("ingest");
        times.push(t.elapsed().as_secs_f64());
        last = Some((store, ing));
    }
    times.sort_by(f64::total_cmp);
    let ingest_s = times[times.len() / 2];
    let (store, ing) = last.expect("at least one run");
    let mut files = BTreeMap::new();
    files.insert("memory.bin".to_string(), ing.file_ref());
    let rec = store
        .commit_snapshot(NewSnapshot {
            files: files.clone(),
            ..Default::default()
        })
        .expect("commit");
    let stored = store.stats().expect("stats").stored_bytes;
    let reader = store.open_file(&rec.id, "memory.bin").expect("open");
    let offsets = read_offsets(&reader, size, args.reads, args.seed);
    if args.drop_os_cache {
        drop_os_cache();
    }
    let mut page = vec![0u8; 4096];
    let cold = percentiles(offsets.iter().map(|&o| {
        store.drop_cache();
        let t = Instant::now();
        reader.read_exact_at(&mut page, o).expect("read");
        t.elapsed()
    }));
    for &o in &offsets {
        reader.read_exact_at(&mut page, o).expect("read");
    }
    let warm = percentiles(offsets.iter().map(|&o| {
        let t = Instant::now();
        reader.read_exact_at(&mut page, o).expect("read");
        t.elapsed()
    }));
    let before = store.stats().expect("stats").stored_bytes;
    let t = Instant::now();
    let d = store
        .ingest_file(
            dirty_input,
            &IngestOptions {
                base: Some(ing.manifest),
                dirty: Some(dirty.to_vec()),
                ..Default::default()
            },
        )
        .expect("dirty ingest");
    let dirty_ms = t.elapsed().as_secs_f64() * 1e3;
    let after = store.stats().expect("stats").stored_bytes;
    assert_eq!(after - before, d.new_stored_bytes);
    Row {
        label: format!("{kib} KiB, zstd {level}"),
        ingest_mbps: size as f64 / 1e6 / ingest_s,
        stored,
        chunks: ing.new_chunks,
        cold,
        warm,
        dirty_added: d.new_stored_bytes,
        dirty_ms,
    }
}

/// Random page-aligned offsets whose chunk is stored (not zero).
fn read_offsets(reader: &forkd_layers::FileReader, size: u64, n: usize, seed: u64) -> Vec<u64> {
    let mut rng = SplitMix64(seed ^ 0xBEEF);
    let pages = size / 4096;
    let mut out = Vec::with_capacity(n);
    let mut tries = 0;
    while out.len() < n && tries < n * 1000 {
        tries += 1;
        let o = rng.below(pages) * 4096;
        if reader.chunk_at(o) != ChunkRef::Zero {
            out.push(o);
        }
    }
    out
}

fn percentiles(samples: impl Iterator<Item = Duration>) -> (Duration, Duration) {
    let mut v: Vec<Duration> = samples.collect();
    if v.is_empty() {
        return (Duration::ZERO, Duration::ZERO);
    }
    v.sort();
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (at(0.50), at(0.99))
}

fn write_synthetic(path: &Path, len: u64, seed: u64) {
    let f = File::create(path).expect("create synthetic file");
    f.set_len(len).unwrap();
    guest_memory(seed, len, |off, page| {
        f.write_all_at(page, off).unwrap();
    });
    f.sync_all().unwrap();
}

/// Copies `src` (sparse-preserving via reflink-free copy of data pages) and
/// changes `n` scattered pages; returns the changed ranges.
fn make_dirty_copy(src: &Path, dst: &Path, n: usize, seed: u64) -> Vec<std::ops::Range<u64>> {
    let inp = File::open(src).expect("open input");
    let len = inp.metadata().unwrap().len();
    let out = File::create(dst).expect("create dirty copy");
    out.set_len(len).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < len {
        let k = (len - off).min(buf.len() as u64) as usize;
        inp.read_exact_at(&mut buf[..k], off).unwrap();
        for (i, pg) in buf[..k].chunks(4096).enumerate() {
            if pg.iter().any(|&b| b != 0) {
                out.write_all_at(pg, off + (i * 4096) as u64).unwrap();
            }
        }
        off += k as u64;
    }
    let mut rng = SplitMix64(seed ^ 0xD1D1);
    let mut ranges = Vec::new();
    let mut page = vec![0u8; 4096];
    for _ in 0..n {
        let o = rng.below(len / 4096) * 4096;
        rng.fill(&mut page);
        out.write_all_at(&page, o).unwrap();
        ranges.push(o..o + 4096);
    }
    out.sync_all().unwrap();
    ranges
}

/// Counts zero pages and non-zero pages that repeat an earlier page.
fn page_census(path: &Path) -> (u64, u64, u64) {
    let f = File::open(path).expect("open input");
    let len = f.metadata().unwrap().len();
    let mut seen = std::collections::HashSet::new();
    let (mut zero, mut dup, mut pages) = (0u64, 0u64, 0u64);
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < len {
        let k = (len - off).min(buf.len() as u64) as usize;
        f.read_exact_at(&mut buf[..k], off).unwrap();
        for pg in buf[..k].chunks(4096) {
            pages += 1;
            if pg.iter().all(|&b| b == 0) {
                zero += 1;
            } else if !seen.insert(*blake3::hash(pg).as_bytes()) {
                dup += 1;
            }
        }
        off += k as u64;
    }
    (zero, dup, pages)
}

fn drop_os_cache() {
    // SAFETY-free: plain file write; needs root.
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "1\n") {
        eprintln!("warning: could not drop the OS page cache: {e}");
    }
}

fn us(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1e6)
}

fn print_table(size: u64, rows: &[Row]) {
    println!("file size: {:.1} MiB\n", size as f64 / (1u64 << 20) as f64);
    println!(
        "| chunk size, level | ingest MB/s | stored MiB | stored chunks | cold 4K read p50 / p99 (us) | warm 4K read p50 / p99 (us) | dirty ingest adds KiB | dirty ingest ms |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {:.0} | {:.1} | {} | {} / {} | {} / {} | {:.0} | {:.0} |",
            r.label,
            r.ingest_mbps,
            r.stored as f64 / (1u64 << 20) as f64,
            r.chunks,
            us(r.cold.0),
            us(r.cold.1),
            us(r.warm.0),
            us(r.warm.1),
            r.dirty_added as f64 / 1024.0,
            r.dirty_ms,
        );
    }
}
