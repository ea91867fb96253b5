//! `fs-bench`: reads through a forkd-fs mount next to the same reads from a
//! plain file with the same content, cold and warm, as ratios.
//!
//! Builds (or takes with `--file`) a guest-memory-like file, ingests it into
//! a fresh store, serves the store over FUSE — in this process, and held
//! (`forkd-fs mount` as root: a holder relaying to a worker process, what
//! survives a crash; the `forkd-fs` binary next to this one) — and measures:
//! sequential read throughput (1 MiB reads), random 4 KiB `pread` latency,
//! and random 4 KiB first-touch latency through a MAP_PRIVATE mapping (what
//! a QEMU child's page faults cost). "Cold" = kernel page cache dropped
//! (`echo 3 > /proc/sys/vm/drop_caches`, root only) and, for the mount, a
//! remount (fresh decompressed-chunk cache and inode page cache).

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use forkd_fs::daemon::{hold, serve, ServeOptions};
use forkd_fs::mount;
use forkd_layers::synth::{self, SplitMix64};
use forkd_layers::{IngestOptions, NewSnapshot, SnapshotId, Store, StoreOptions};

#[derive(Parser)]
#[command(
    name = "fs-bench",
    about = "Read throughput and latency through a forkd-fs mount vs a plain file"
)]
struct Args {
    /// Use this file instead of a synthetic guest memory image (it is read
    /// as the plain-file baseline, so it should sit on ext4).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Size of the synthetic image, MiB.
    #[arg(long, default_value_t = 512)]
    size_mib: u64,
    /// Seed of the synthetic image.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Work directory (store, mount point, synthetic file) [default: a new
    /// directory in /var/tmp, removed afterwards].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Random 4 KiB reads per pass.
    #[arg(long, default_value_t = 2000)]
    random: usize,
    /// FUSE request threads.
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// Readahead window of the mount, KiB.
    #[arg(long, default_value_t = 1024)]
    readahead_kib: u32,
    /// Largest FUSE read request, KiB.
    #[arg(long, default_value_t = 256)]
    max_read_kib: u32,
    /// Decompressed-chunk cache, MiB.
    #[arg(long, default_value_t = 64)]
    cache_mib: usize,
    /// Skip the cold passes (they need root to drop the page cache).
    #[arg(long)]
    no_cold: bool,
}

/// A forkd-fs mount served by a thread of this process, or held by it and
/// served by a `forkd-fs worker` process (`held` names the binary).
struct Served {
    opts: ServeOptions,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Served {
    fn start(opts: ServeOptions, held: Option<PathBuf>) -> Result<Served> {
        let (tx, rx) = mpsc::channel();
        let o = opts.clone();
        let thread = std::thread::spawn(move || {
            let ready = |_: &Path| {
                let _ = tx.send(());
            };
            match held {
                Some(bin) => hold(&o, &bin, None, ready),
                None => serve(&o, ready),
            }
        });
        if rx.recv().is_err() {
            let e = thread.join().expect("serve thread panicked");
            return Err(e
                .err()
                .unwrap_or_else(|| anyhow::anyhow!("mount ended early")));
        }
        Ok(Served {
            opts,
            thread: Some(thread),
        })
    }

    fn stop(&mut self) -> Result<()> {
        if let Some(t) = self.thread.take() {
            mount::unmount(&self.opts.mountpoint)?;
            t.join().expect("serve thread panicked")?;
        }
        Ok(())
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = mount::unmount_lazy(&self.opts.mountpoint);
            let _ = self.thread.take().map(JoinHandle::join);
        }
    }
}

fn drop_page_cache() -> Result<()> {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .context("writing /proc/sys/vm/drop_caches (run as root, or pass --no-cold)")
}

/// Sequential read of the whole file in 1 MiB reads: MB/s.
fn seq_read(path: &Path) -> Result<f64> {
    let mut f = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let t = Instant::now();
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    Ok(total as f64 / 1e6 / t.elapsed().as_secs_f64())
}

/// (p50, p99) in microseconds.
fn percentiles(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
    (at(0.50), at(0.99))
}

fn rand_pread(path: &Path, offsets: &[u64]) -> Result<(f64, f64)> {
    let f = File::open(path)?;
    let mut buf = vec![0u8; 4096];
    let mut lat = Vec::with_capacity(offsets.len());
    for &o in offsets {
        let t = Instant::now();
        f.read_exact_at(&mut buf, o)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(percentiles(lat))
}

/// First touch of one byte per offset through a MAP_PRIVATE mapping.
fn rand_fault(path: &Path, offsets: &[u64]) -> Result<(f64, f64)> {
    let f = File::open(path)?;
    let len = f.metadata()?.len() as usize;
    // SAFETY: read-only private mapping of an open file, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        bail!(
            "mmap {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    let mut lat = Vec::with_capacity(offsets.len());
    let mut sum = 0u64;
    for &o in offsets {
        let t = Instant::now();
        // SAFETY: o < len; a volatile read forces the fault.
        sum += u64::from(unsafe { std::ptr::read_volatile((p as *const u8).add(o as usize)) });
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    // SAFETY: our own mapping.
    unsafe { libc::munmap(p, len) };
    std::hint::black_box(sum);
    Ok(percentiles(lat))
}

#[derive(Default)]
struct Results {
    seq: [Option<f64>; 2],
    pread: [Option<(f64, f64)>; 2],
    pread_data: [Option<(f64, f64)>; 2],
    fault: [Option<(f64, f64)>; 2],
}

/// One latency row of [`Results`]: cold and warm (p50, p99).
type LatColumn = fn(&Results) -> [Option<(f64, f64)>; 2];

/// Runs every pass on one file; `cold` prepares a cold pass.
fn run_passes(
    path: &Path,
    offsets: &[u64],
    data_offsets: &[u64],
    with_cold: bool,
    cold: &mut dyn FnMut() -> Result<()>,
) -> Result<Results> {
    let mut r = Results::default();
    for (i, is_cold) in [(0, true), (1, false)] {
        if is_cold && !with_cold {
            continue;
        }
        if is_cold {
            cold()?;
        }
        r.seq[i] = Some(seq_read(path)?);
        if is_cold {
            cold()?;
        } else {
            rand_pread(path, offsets)?;
        }
        r.pread[i] = Some(rand_pread(path, offsets)?);
        if is_cold {
            cold()?;
        } else {
            rand_pread(path, data_offsets)?;
        }
        r.pread_data[i] = Some(rand_pread(path, data_offsets)?);
        if is_cold {
            cold()?;
        } else {
            rand_fault(path, offsets)?;
        }
        r.fault[i] = Some(rand_fault(path, offsets)?);
    }
    Ok(r)
}

fn synth_file(path: &Path, size: u64, seed: u64) -> Result<()> {
    let f = File::create(path)?;
    f.set_len(size)?;
    let mut err = None;
    synth::guest_memory(seed, size, |off, page| {
        if err.is_none() && page.iter().any(|&b| b != 0) {
            err = f.write_all_at(page, off).err();
        }
    });
    if let Some(e) = err {
        return Err(e.into());
    }
    f.sync_all()?;
    Ok(())
}

fn fmt_tp(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0}"))
}

fn fmt_lat(v: Option<(f64, f64)>) -> String {
    v.map_or("-".into(), |(a, b)| format!("{a:.0} / {b:.0}"))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

fn ratio2(a: Option<(f64, f64)>, b: Option<(f64, f64)>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!(
            "{} / {}",
            ratio(Some(a.0), Some(b.0)),
            ratio(Some(a.1), Some(b.1))
        ),
        _ => "-".into(),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let tmp;
    let dir = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("fs-bench")
                .tempdir_in("/var/tmp")?;
            tmp.path().to_path_buf()
        }
    };
    let plain = match &args.file {
        Some(f) => f.clone(),
        None => {
            let p = dir.join("memory.bin");
            eprintln!(
                "writing a {} MiB synthetic guest memory image",
                args.size_mib
            );
            synth_file(&p, args.size_mib << 20, args.seed)?;
            p
        }
    };
    let size = std::fs::metadata(&plain)?.len();
    if size < 4096 {
        bail!("{} is too small", plain.display());
    }

    eprintln!("ingesting {}", plain.display());
    let store_dir = dir.join("store");
    let id: SnapshotId = {
        let store = Store::open(&store_dir, StoreOptions::default())?;
        let f = store.ingest_file(&plain, &IngestOptions::default())?;
        let mut files = std::collections::BTreeMap::new();
        files.insert("memory.bin".to_string(), f.file_ref());
        store
            .commit_snapshot(NewSnapshot {
                files,
                ..Default::default()
            })?
            .id
    };

    let mountpoint = dir.join("mnt");
    let opts = ServeOptions {
        secondary_dir: mount::default_secondary_dir(&mountpoint),
        control_socket: mount::default_control_socket(&mountpoint),
        mountpoint: mountpoint.clone(),
        store_dir,
        cache_bytes: args.cache_mib << 20,
        threads: args.threads,
        readahead_kib: args.readahead_kib,
        max_read_kib: args.max_read_kib,
        gid: None,
        handle_signals: false,
        lazy: Default::default(),
    };
    let fuse_path = forkd_fs::prefetch::file_path(&mountpoint, &id, "memory.bin");

    let mut rng = SplitMix64(args.seed ^ 0xBE4C);
    let pages = size / 4096;
    let offsets: Vec<u64> = (0..args.random).map(|_| rng.below(pages) * 4096).collect();
    let with_cold = !args.no_cold;
    // Offsets inside the file's data extents only (holes cost no I/O on
    // either side and dominate the unrestricted p50).
    let extents = forkd_fs::prefetch::data_extents(&File::open(&plain)?)?;
    let data_pages: Vec<u64> = extents
        .iter()
        .flat_map(|&(o, l)| (o.div_ceil(4096)..(o + l) / 4096).map(|p| p * 4096))
        .collect();
    if data_pages.is_empty() {
        bail!("{} has no data", plain.display());
    }
    let data_offsets: Vec<u64> = (0..args.random)
        .map(|_| data_pages[rng.below(data_pages.len() as u64) as usize])
        .collect();

    eprintln!("plain file passes");
    let ext4 = run_passes(
        &plain,
        &offsets,
        &data_offsets,
        with_cold,
        &mut drop_page_cache,
    )?;

    let fuse_passes = |held: Option<PathBuf>| -> Result<Results> {
        let mut served = Some(Served::start(opts.clone(), held.clone())?);
        let mut remount = || -> Result<()> {
            if let Some(mut s) = served.take() {
                s.stop()?;
            }
            drop_page_cache()?;
            served = Some(Served::start(opts.clone(), held.clone())?);
            Ok(())
        };
        let r = run_passes(&fuse_path, &offsets, &data_offsets, with_cold, &mut remount)?;
        if let Some(mut s) = served.take() {
            s.stop()?;
        }
        Ok(r)
    };
    eprintln!("forkd-fs passes (one process)");
    let fuse = fuse_passes(None)?;
    let forkd_fs_bin = std::env::current_exe()?.with_file_name("forkd-fs");
    let held = if forkd_fs::holder::can_hold() && forkd_fs_bin.exists() {
        eprintln!("forkd-fs passes (holder + worker)");
        fuse_passes(Some(forkd_fs_bin))?
    } else {
        eprintln!(
            "no held passes: they need root and {} (cargo build --release -p forkd-fs)",
            forkd_fs_bin.display()
        );
        Results::default()
    };

    let data: u64 = extents.iter().map(|r| r.1).sum();
    println!(
        "file: {} ({} MiB, {:.0}% data extents), {} random 4 KiB offsets, readahead {} KiB, FUSE requests up to {} KiB, {} FUSE threads",
        if args.file.is_some() { plain.display().to_string() } else { "synthetic guest memory".into() },
        size >> 20,
        data as f64 * 100.0 / size as f64,
        args.random,
        args.readahead_kib,
        args.max_read_kib,
        args.threads
    );
    println!();
    println!(
        "| pass | plain ext4 | forkd-fs | forkd-fs / ext4 | forkd-fs held | held / forkd-fs |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (i, label) in [(0, "cold"), (1, "warm")] {
        println!(
            "| sequential read, {label} (MB/s) | {} | {} | {} | {} | {} |",
            fmt_tp(ext4.seq[i]),
            fmt_tp(fuse.seq[i]),
            ratio(fuse.seq[i], ext4.seq[i]),
            fmt_tp(held.seq[i]),
            ratio(held.seq[i], fuse.seq[i])
        );
    }
    let lat_rows: [(&str, LatColumn); 3] = [
        ("random 4 KiB pread", |r| r.pread),
        ("random 4 KiB pread in data extents", |r| r.pread_data),
        ("random 4 KiB mmap first touch", |r| r.fault),
    ];
    for (name, get) in lat_rows {
        for (i, label) in [(0, "cold"), (1, "warm")] {
            let (e, f, h) = (get(&ext4)[i], get(&fuse)[i], get(&held)[i]);
            println!(
                "| {name}, {label}, p50 / p99 (us) | {} | {} | {} | {} | {} |",
                fmt_lat(e),
                fmt_lat(f),
                ratio2(f, e),
                fmt_lat(h),
                ratio2(h, f)
            );
        }
    }
    Ok(())
}
