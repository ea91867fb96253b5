//! `forkd bench fork`: cold boot + warm-up per child against restoring
//! children from a warm snapshot, for several N in one run, with the time
//! until every child answered `eval("numpy.zeros(5).tolist()")` and the host
//! memory each child costs while all are alive (docs/BENCHMARKS.md).

use super::mem::{proc_mem, ChildrenMem};
use super::{median, pct};
use anyhow::{bail, Result};
use forkd_snapshot::boot::{cold_boot, BootSpec};
use forkd_snapshot::create::{create, wait_warm_interpreter, CreateSpec, ImageSource};
use forkd_snapshot::fork::{destroy_all, fork};
use forkd_snapshot::restore::Source;
use forkd_snapshot::Paths;
use forkd_vmm::Accel;
use forkd_vmm::{Lifetime, Machine, Memory, Vm};
use std::time::Instant;

/// The benchmark's knobs.
#[derive(Debug, Clone)]
pub struct ForkBench {
    /// Guest image the snapshot and the cold boots start from.
    pub image: String,
    /// Guest RAM of every VM, MiB.
    pub mem_mib: u64,
    /// Accelerator every VM runs under.
    pub accel: Accel,
    /// The child counts N measured, one fork per value.
    pub ns: Vec<usize>,
    /// Cold boots measured (sequentially) to extrapolate cold totals.
    pub cold_samples: usize,
    /// Most children restored at once during a fork.
    pub parallel: usize,
    /// The code every child evaluates to count as ready.
    pub probe: String,
}

/// Runs it and prints the report.
pub async fn run(paths: &Paths, b: ForkBench) -> Result<()> {
    let qemu = forkd_vmm::check_qemu()?;
    let tag = format!("bench-fork-{}", forkd_snapshot::random_hex(4));
    println!(
        "fork benchmark: image {}, {} MiB, 1 vCPU, {}, QEMU {qemu}, {} host cores; probe eval({:?})",
        b.image,
        b.mem_mib,
        b.accel.as_str(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        b.probe
    );
    let made = create(
        paths,
        CreateSpec {
            net: false,
            tag: tag.clone(),
            image: ImageSource::Named(b.image.clone()),
            mem_mib: b.mem_mib,
            vcpus: 1,
            accel: b.accel,
            warmup_cmd: None,
            eval_warmup: Some(b.probe.clone()),
            replace_tag: false,
            lifetime: Lifetime::Ephemeral,
            verbose: false,
            volumes: Vec::new(),
            ca: None,
        },
    )
    .await?;
    let t = &made.timings;
    println!(
        "snapshot create: {} ms (boot {}, warm-up {}, pause+save {}, ingest {}); {:.1} MiB new in the store",
        t.total_ms,
        t.boot_ms,
        t.warmup_ms,
        t.save_ms,
        t.ingest_ms,
        made.new_stored_bytes as f64 / (1u64 << 20) as f64
    );
    let result = measure(paths, &b, &tag).await;
    let p = paths.clone();
    let _ = forkd_snapshot::store::with_rw(paths, move |s| {
        forkd_snapshot::delete::delete(&p, s, &tag, Default::default())
    })
    .await;
    result
}

async fn measure(paths: &Paths, b: &ForkBench, tag: &str) -> Result<()> {
    let (cold_ms, cold_mib) = cold_samples(
        paths,
        &b.image,
        b.mem_mib,
        b.accel,
        b.cold_samples,
        &b.probe,
    )
    .await?;
    let cold_med = median(&cold_ms);
    println!(
        "cold boot + warm-up + probe, per child: median {cold_med:.0} ms over {} sequential boots; {cold_mib:.0} MiB PSS per cold VM",
        cold_ms.len()
    );
    let mount = forkd_snapshot::ensure_mount_async(paths).await?.mountpoint;
    let src = Source::resolve(&mount, tag)?;
    println!();
    println!(
        "{:>5}  {:>14}  {:>16}  {:>18}  {:>8}  {:>12}  {:>12}  {:>10}",
        "N",
        "all ready (ms)",
        "per child p50/p99",
        "cold, extrapolated",
        "speedup",
        "MiB/child",
        "shared cache",
        "cold MiB"
    );
    // What N children will need: until a smaller N has been measured, N
    // cold VMs; after, 1.5 x the private part per child plus the cache.
    let mut seen: Option<ChildrenMem> = None;
    for &n in &b.ns {
        let need = match &seen {
            Some(m) => {
                n as f64 * 1.5 * m.private_mib / m.children.max(1) as f64 + m.shared_cache_mib
            }
            None => n as f64 * cold_mib,
        };
        if available_mib() < need {
            println!(
                "{n:>5}  skipped: MemAvailable is below the {need:.0} MiB {n} children would need"
            );
            continue;
        }
        let t0 = Instant::now();
        let forked = fork(paths, &src, n, b.parallel, Lifetime::Ephemeral).await?;
        let probes =
            futures::future::join_all(forked.children.iter().map(|c| probe(&c.vm, &b.probe, t0)))
                .await;
        let all_ready = t0.elapsed().as_secs_f64() * 1e3;
        let mut per: Vec<f64> = Vec::new();
        for p in probes {
            per.push(p?);
        }
        let pids: Vec<u32> = forked.children.iter().map(|c| c.vm.pid()).collect();
        let mem = ChildrenMem::measure(&pids, &src.memory());
        destroy_all(forked.children).await;
        seen = Some(mem);
        let cold_total = cold_med * n as f64;
        println!(
            "{n:>5}  {all_ready:>14.0}  {:>7.0} / {:<7.0}  {:>18.0}  {:>7.1}x  {:>12.1}  {:>12.1}  {:>10.0}",
            median(&per),
            pct(&per, 99.0),
            cold_total,
            cold_total / all_ready,
            mem.per_child_mib(),
            mem.shared_cache_mib,
            cold_mib
        );
    }
    println!();
    println!("all ready: from the start of the fork until every child returned the probe eval.");
    println!(
        "per child: each child's own start to its probe answer (children restore {} at a time).",
        b.parallel
    );
    println!("cold, extrapolated: N x the median sequential cold boot (this host has too few cores to boot N at once).");
    println!("MiB/child: (sum of each QEMU's PSS outside memory.bin + memory.bin's page cache) / N, while all N are alive.");
    Ok(())
}

/// Evaluates the probe; returns ms from `t0` until it answered.
async fn probe(vm: &Vm, code: &str, t0: Instant) -> Result<f64> {
    let r = vm.agent.eval(code, Some(60_000)).await?;
    if let Some(e) = r.error {
        bail!("probe failed in {}: {e}", vm.id);
    }
    Ok(t0.elapsed().as_secs_f64() * 1e3)
}

/// Boots `k` fresh VMs of `image` one after another, each to a finished
/// warm-up and an answered probe. Returns their times (ms) and the PSS of
/// the first (MiB).
pub async fn cold_samples(
    paths: &Paths,
    image: &str,
    mem_mib: u64,
    accel: Accel,
    k: usize,
    code: &str,
) -> Result<(Vec<f64>, f64)> {
    let img = forkd_snapshot::images::Image::load(&paths.images_dir(), image)?;
    let mut times = Vec::new();
    let mut pss_mib = 0.0;
    for i in 0..k.max(1) {
        let t0 = Instant::now();
        let vm = cold_boot(
            paths,
            BootSpec {
                id: format!("bench-cold-{}", forkd_snapshot::random_hex(4)),
                rootfs: img.rootfs(),
                kernel: None,
                machine: Machine::new(accel, mem_mib, 1),
                memory: Memory::Anonymous,
                hostname: "forkd".into(),
                lifetime: Lifetime::Ephemeral,
                volumes: Vec::new(),
            },
        )
        .await?;
        let r = async {
            wait_warm_interpreter(&vm).await?;
            probe(&vm, code, t0).await
        }
        .await;
        if i == 0 {
            pss_mib = proc_mem(vm.pid(), std::path::Path::new("/nonexistent"))
                .map_or(0.0, |m| m.pss_kib as f64 / 1024.0);
        }
        vm.destroy().await;
        times.push(r?);
    }
    Ok((times, pss_mib))
}

/// MemAvailable, MiB.
fn available_mib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}
