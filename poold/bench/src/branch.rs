//! `forkd bench branch`: pauses and costs of BRANCH on a guest that is busy
//! writing memory, spawn latency from chain heads of several depths, and the
//! stored size of a link that installs one Debian package.

use super::{median, pct};
use anyhow::{bail, Context, Result};
use forkd_snapshot::branch::{branch, Branched, Mode};
use forkd_snapshot::create::{create, CreateSpec, ImageSource};
use forkd_snapshot::fork::{destroy_all, fork};
use forkd_snapshot::mib;
use forkd_snapshot::restore::{read_record, Source};
use forkd_snapshot::Paths;
use forkd_vmm::Accel;
use forkd_vmm::{Lifetime, Vm};
use rootfs_init::protocol::ExecSpec;
use std::collections::BTreeMap;
use std::path::Path;

/// The benchmark's knobs.
#[derive(Debug, Clone)]
pub struct BranchBench {
    /// Guest image the busy source is booted from (`forkd image ls`).
    pub image: String,
    /// Guest RAM of every VM, MiB.
    pub mem_mib: u64,
    /// Accelerator every VM runs under.
    pub accel: Accel,
    /// Live branches of the busy source.
    pub branches: usize,
    /// Chain depths to spawn from.
    pub depths: Vec<usize>,
    /// Spawns measured per depth.
    pub spawns: usize,
    /// Debian package installed for the "one package" link.
    pub package: String,
    /// MiB of the array the busy source rewrites in a loop.
    pub busy_mib: u64,
}

/// What every created snapshot is tagged with (deleted at the end).
fn tag(run: &str, what: &str) -> String {
    format!("bench-br-{run}-{what}")
}

/// Runs the branch benchmark and prints its report; every snapshot it made is deleted at the end.
pub async fn run(paths: &Paths, b: BranchBench) -> Result<()> {
    let qemu = forkd_vmm::check_qemu()?;
    let run = forkd_snapshot::random_hex(3);
    let base = tag(&run, "base");
    println!(
        "branch benchmark: image {}, {} MiB, {}, QEMU {qemu}; the source adds 1 to every byte of a {} MiB array of random bytes in a loop (each pass makes every chunk of it new)",
        b.image,
        b.mem_mib,
        b.accel.as_str(),
        b.busy_mib
    );
    create(
        paths,
        CreateSpec {
            net: false,
            tag: base.clone(),
            image: ImageSource::Named(b.image.clone()),
            mem_mib: b.mem_mib,
            vcpus: 1,
            accel: b.accel,
            warmup_cmd: None,
            eval_warmup: Some("import numpy".into()),
            replace_tag: false,
            lifetime: Lifetime::Ephemeral,
            verbose: false,
        },
    )
    .await?;
    let mount = forkd_snapshot::ensure_mount_async(paths).await?.mountpoint;
    let result = measure(paths, &mount, &b, &run, &base).await;
    cleanup(paths, &base).await;
    result
}

async fn measure(
    paths: &Paths,
    mount: &Path,
    b: &BranchBench,
    run: &str,
    base: &str,
) -> Result<()> {
    let parent = read_record(mount, base)?;

    // 1. Pauses of a busy source.
    let src = fork(
        paths,
        &Source::new(mount, &parent)?,
        1,
        1,
        Lifetime::Ephemeral,
    )
    .await?
    .children;
    let busy = async {
        let s = &src[0].vm;
        sh(
            s,
            &format!(
                "nohup python3 -c 'import numpy\na = numpy.random.randint(0, 256, {} << 20, numpy.uint8)\nwhile True:\n    a += 1' >/dev/null 2>&1 &",
                b.busy_mib
            ),
        )
        .await?;
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let mut live = Vec::new();
        for i in 0..b.branches {
            live.push(one(paths, mount, s, &parent, &tag(run, &format!("live{i}")), Mode::Live).await?);
        }
        let full = one(paths, mount, s, &parent, &tag(run, "full"), Mode::Full).await?;
        Ok::<_, anyhow::Error>((live, full))
    }
    .await;
    destroy_all(src).await;
    let (live, full) = busy?;
    let pauses: Vec<f64> = live.iter().map(|x| x.pause_ms).collect();
    let totals: Vec<f64> = live.iter().map(|x| x.total_ms as f64).collect();
    let stored: Vec<f64> = live.iter().map(|x| x.new_stored_bytes as f64).collect();
    println!();
    println!(
        "{} live branches of the busy source: pause_ms p50 {:.1} / p90 {:.1} / max {:.1}; total branch time p50 {:.0} ms; stored per branch p50 {}",
        live.len(),
        median(&pauses),
        pct(&pauses, 90.0),
        pct(&pauses, 100.0),
        median(&totals),
        mib(median(&stored) as u64)
    );
    println!(
        "1 full (stop-and-copy) branch for comparison: pause_ms {:.1}, total {} ms, stored {}",
        full.pause_ms,
        full.total_ms,
        mib(full.new_stored_bytes)
    );

    // 2. Spawn latency from chain heads at several depths.
    let max_depth = b.depths.iter().copied().max().unwrap_or(0);
    let mut heads = vec![base.to_string()];
    for d in 1..=max_depth {
        let head = tag(run, &format!("d{d}"));
        link(
            paths,
            mount,
            &heads[d - 1],
            &head,
            &format!("echo {d} > /depth"),
            &[],
        )
        .await?;
        heads.push(head);
    }
    println!();
    println!(
        "{:>6}  {:>22}  {:>14}   (spawn = restore + resume + first agent answer, {} spawns each)",
        "depth", "spawn p50 / max (ms)", "link stores", b.spawns
    );
    for &d in &b.depths {
        let src = Source::resolve(mount, &heads[d])?;
        let mut ready = Vec::new();
        for _ in 0..b.spawns.max(1) {
            let kids = fork(paths, &src, 1, 1, Lifetime::Ephemeral).await?;
            ready.push(kids.children[0].timings.ready_ms as f64);
            destroy_all(kids.children).await;
        }
        let stores = link_bytes(paths, &heads[d]).await?;
        println!(
            "{d:>6}  {:>10.0} / {:<10.0}  {:>14}",
            median(&ready),
            pct(&ready, 100.0),
            mib(stores)
        );
    }

    // 3. One Debian package on top of the base.
    let deb = fetch_deb(paths, &b.package).await?;
    let pkg_tag = tag(run, "pkg");
    let data = std::fs::read(&deb)?;
    let made = link(
        paths,
        mount,
        base,
        &pkg_tag,
        &format!(
            "dpkg -i /root/pkg.deb >/dev/null && dpkg -s {} >/dev/null && rm /root/pkg.deb && sync",
            b.package
        ),
        &[("/root/pkg.deb", data.as_slice())],
    )
    .await?;
    let _ = std::fs::remove_file(&deb);
    let raw = link_raw_bytes(paths, &pkg_tag).await?;
    println!();
    println!(
        "link that installs Debian package {:?} ({} .deb, apt-get download on the host, dpkg -i in the guest): stores {} ({} uncompressed)",
        b.package,
        mib(data.len() as u64),
        mib(made.new_stored_bytes),
        mib(raw)
    );
    Ok(())
}

/// Branches `s` and reports it.
async fn one(
    paths: &Paths,
    mount: &Path,
    s: &Vm,
    parent: &forkd_layers::SnapshotRecord,
    tag: &str,
    mode: Mode,
) -> Result<Branched> {
    branch(paths, mount, s, parent, tag, mode, BTreeMap::new()).await
}

/// A child of `from` runs `cmd` (after `files` are written) and is
/// branched as `tag`.
async fn link(
    paths: &Paths,
    mount: &Path,
    from: &str,
    tag: &str,
    cmd: &str,
    files: &[(&str, &[u8])],
) -> Result<Branched> {
    let parent = read_record(mount, from)?;
    let kids = fork(
        paths,
        &Source::new(mount, &parent)?,
        1,
        1,
        Lifetime::Ephemeral,
    )
    .await?;
    let r = async {
        let vm = &kids.children[0].vm;
        for (p, d) in files {
            vm.agent.write_file(p, d, None, false).await?;
        }
        sh(vm, cmd).await?;
        branch(paths, mount, vm, &parent, tag, Mode::Live, BTreeMap::new()).await
    }
    .await;
    destroy_all(kids.children).await;
    r
}

async fn sh(vm: &Vm, cmd: &str) -> Result<()> {
    let out = vm
        .agent
        .exec(
            ExecSpec {
                shell: Some(cmd.into()),
                timeout_ms: Some(300_000),
                ..Default::default()
            },
            &[],
        )
        .await?;
    if out.result.status_code() != 0 {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.result.status_code(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Stored bytes a snapshot holds beyond its parent.
async fn link_bytes(paths: &Paths, tag: &str) -> Result<u64> {
    let t = tag.to_string();
    forkd_snapshot::store::with_rw(paths, move |s| {
        let rec = s.resolve(&t)?.context("snapshot vanished")?;
        let d = forkd_snapshot::info::detail(s, &rec)?;
        Ok(d.this.unique_stored_bytes)
    })
    .await
}

async fn link_raw_bytes(paths: &Paths, tag: &str) -> Result<u64> {
    let t = tag.to_string();
    forkd_snapshot::store::with_rw(paths, move |s| {
        let rec = s.resolve(&t)?.context("snapshot vanished")?;
        Ok(forkd_snapshot::info::detail(s, &rec)?.this.unique_raw_bytes)
    })
    .await
}

/// `apt-get download PACKAGE` into the staging dir.
async fn fetch_deb(paths: &Paths, package: &str) -> Result<std::path::PathBuf> {
    if !package
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || b"+-.".contains(&c))
    {
        bail!("{package:?} is not a Debian package name");
    }
    let dir = paths
        .staging_dir()
        .join(format!("deb-{}", forkd_snapshot::random_hex(4)));
    std::fs::create_dir_all(&dir)?;
    // apt's _apt user downloads into it.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))?;
    let out = tokio::process::Command::new("apt-get")
        .args(["download", "-q", package])
        .current_dir(&dir)
        .output()
        .await
        .context("running apt-get download")?;
    if !out.status.success() {
        bail!(
            "apt-get download {package}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let deb = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("apt-get download left no .deb")?;
    let keep = paths.staging_dir().join(format!("{package}.deb"));
    std::fs::rename(&deb, &keep)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(keep)
}

/// Deletes everything the run made (the base and its whole subtree).
async fn cleanup(paths: &Paths, base: &str) {
    let p = paths.clone();
    let b = base.to_string();
    let _ = forkd_snapshot::store::with_rw(paths, move |s| {
        forkd_snapshot::delete::delete(&p, s, &b, forkd_snapshot::delete::Dependents::Cascade)
    })
    .await;
}
