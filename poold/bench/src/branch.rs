//! `forkd bench branch`: pauses and costs of BRANCH on a guest that is busy
//! writing memory, spawn latency from chain heads of several depths, and the
//! stored size of a link that installs one Debian package.
//!
//! Figures are printed and, with `--json`, written as a [`Report`] (every
//! sample, plus the summaries printed) for `scripts/plot-benchmarks.py`.

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
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    /// Where to write the report as JSON.
    pub json: Option<PathBuf>,
}

/// Layout version of the JSON report; bumped when a field changes meaning
/// or goes away (new fields do not bump it).
pub const SCHEMA: u32 = 1;

/// Everything one run measured, as `--json` writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Always "branch": which bench wrote the file.
    pub bench: String,
    /// [`SCHEMA`] of the writer.
    pub schema: u32,
    /// The command line of the run (argv).
    pub command: Vec<String>,
    /// forkd's version.
    pub version: String,
    /// QEMU's version.
    pub qemu: String,
    /// Host CPUs.
    pub host_cpus: usize,
    /// "kvm" or "tcg".
    pub accel: String,
    /// Guest image of every VM.
    pub image: String,
    /// Guest RAM of every VM, MiB.
    pub mem_mib: u64,
    /// MiB of the array the busy source rewrites in a loop.
    pub busy_mib: u64,
    /// Branches of the busy source.
    pub busy: BusyBranches,
    /// The chain's links in the order made: link `d` is a live branch of a
    /// child of the head at depth `d - 1`.
    pub chain: Vec<ChainLink>,
    /// Spawns from the heads at the measured depths.
    pub depths: Vec<DepthSpawns>,
    /// The link that installs one Debian package.
    pub package: PackageLink,
}

/// One BRANCH as measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchSample {
    /// The source's vCPUs stopped (QEMU's STOP to RESUME), ms.
    pub pause_ms: f64,
    /// Start of the capture until the snapshot was committed, ms.
    pub total_ms: u64,
    /// Pack bytes the branch added to the store.
    pub new_stored_bytes: u64,
}

impl From<&Branched> for BranchSample {
    fn from(b: &Branched) -> Self {
        BranchSample {
            pause_ms: b.pause_ms,
            total_ms: b.total_ms,
            new_stored_bytes: b.new_stored_bytes,
        }
    }
}

/// The branches of the busy source and the summary printed for them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BusyBranches {
    /// The live branches, one after another, in order.
    pub live: Vec<BranchSample>,
    /// The one full (stop-and-copy) branch taken after them.
    pub full: BranchSample,
    /// Of `live`: pause p50, ms.
    pub live_pause_p50_ms: f64,
    /// Of `live`: pause p90, ms.
    pub live_pause_p90_ms: f64,
    /// Of `live`: the longest pause, ms.
    pub live_pause_max_ms: f64,
    /// Of `live`: total branch time p50, ms.
    pub live_total_p50_ms: f64,
    /// Of `live`: stored bytes per branch, p50.
    pub live_stored_p50_bytes: u64,
}

/// One link of the chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainLink {
    /// Its depth (1 = a branch of a child of the base).
    pub depth: usize,
    /// Its branch (of a mostly idle child that wrote one file).
    pub branch: BranchSample,
}

/// One restore from a chain head, ms from the start of the restore.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpawnSample {
    /// QEMU started and its sockets connected.
    pub process_ms: u64,
    /// Device state loaded (still paused).
    pub restored_ms: u64,
    /// vCPUs running.
    pub resumed_ms: u64,
    /// The agent answered: the figure printed as *spawn*.
    pub ready_ms: u64,
}

/// Spawns from the head at one depth and the summary printed for them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DepthSpawns {
    /// Chain depth (0 = the base).
    pub depth: usize,
    /// Each spawn, in order.
    pub spawns: Vec<SpawnSample>,
    /// `ready_ms` p50.
    pub ready_p50_ms: f64,
    /// `ready_ms` max.
    pub ready_max_ms: f64,
    /// Stored bytes the head holds beyond its parent (the whole base at depth 0).
    pub link_stored_bytes: u64,
}

/// The one-package link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackageLink {
    /// Debian package installed.
    pub name: String,
    /// Size of its .deb.
    pub deb_bytes: u64,
    /// Pack bytes the link added.
    pub stored_bytes: u64,
    /// The link's unique chunks, uncompressed.
    pub raw_bytes: u64,
    /// The link's branch.
    pub branch: BranchSample,
}

impl Report {
    /// Writes the report as pretty JSON to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", path.display()))
    }
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
            volumes: Vec::new(),
            ca: None,
        },
    )
    .await?;
    let mount = forkd_snapshot::ensure_mount_async(paths).await?.mountpoint;
    let result = measure(paths, &mount, &b, &run, &base, &qemu).await;
    cleanup(paths, &base).await;
    let report = result?;
    if let Some(path) = &b.json {
        report.write(path)?;
        println!("\nreport written to {}", path.display());
    }
    Ok(())
}

async fn measure(
    paths: &Paths,
    mount: &Path,
    b: &BranchBench,
    run: &str,
    base: &str,
    qemu: &str,
) -> Result<Report> {
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
    let busy = BusyBranches {
        live: live.iter().map(BranchSample::from).collect(),
        full: BranchSample::from(&full),
        live_pause_p50_ms: median(&pauses),
        live_pause_p90_ms: pct(&pauses, 90.0),
        live_pause_max_ms: pct(&pauses, 100.0),
        live_total_p50_ms: median(&totals),
        live_stored_p50_bytes: median(&stored) as u64,
    };

    // 2. Spawn latency from chain heads at several depths.
    let max_depth = b.depths.iter().copied().max().unwrap_or(0);
    let mut heads = vec![base.to_string()];
    let mut chain = Vec::new();
    for d in 1..=max_depth {
        let head = tag(run, &format!("d{d}"));
        let made = link(
            paths,
            mount,
            &heads[d - 1],
            &head,
            &format!("echo {d} > /depth"),
            &[],
        )
        .await?;
        chain.push(ChainLink {
            depth: d,
            branch: BranchSample::from(&made),
        });
        heads.push(head);
    }
    println!();
    println!(
        "{:>6}  {:>22}  {:>14}   (spawn = restore + resume + first agent answer, {} spawns each)",
        "depth", "spawn p50 / max (ms)", "link stores", b.spawns
    );
    let mut depths = Vec::new();
    for &d in &b.depths {
        let src = Source::resolve(mount, &heads[d])?;
        let mut ready = Vec::new();
        let mut spawns = Vec::new();
        for _ in 0..b.spawns.max(1) {
            let kids = fork(paths, &src, 1, 1, Lifetime::Ephemeral).await?;
            let t = &kids.children[0].timings;
            ready.push(t.ready_ms as f64);
            spawns.push(SpawnSample {
                process_ms: t.process_ms,
                restored_ms: t.restored_ms,
                resumed_ms: t.resumed_ms,
                ready_ms: t.ready_ms,
            });
            destroy_all(kids.children).await;
        }
        let stores = link_bytes(paths, &heads[d]).await?;
        println!(
            "{d:>6}  {:>10.0} / {:<10.0}  {:>14}",
            median(&ready),
            pct(&ready, 100.0),
            mib(stores)
        );
        depths.push(DepthSpawns {
            depth: d,
            spawns,
            ready_p50_ms: median(&ready),
            ready_max_ms: pct(&ready, 100.0),
            link_stored_bytes: stores,
        });
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
    Ok(Report {
        bench: "branch".into(),
        schema: SCHEMA,
        command: std::env::args().collect(),
        version: env!("CARGO_PKG_VERSION").into(),
        qemu: qemu.into(),
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        accel: b.accel.as_str().into(),
        image: b.image.clone(),
        mem_mib: b.mem_mib,
        busy_mib: b.busy_mib,
        busy,
        chain,
        depths,
        package: PackageLink {
            name: b.package.clone(),
            deb_bytes: data.len() as u64,
            stored_bytes: made.new_stored_bytes,
            raw_bytes: raw,
            branch: BranchSample::from(&made),
        },
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(pause_ms: f64) -> BranchSample {
        BranchSample {
            pause_ms,
            total_ms: 3000,
            new_stored_bytes: 128 << 20,
        }
    }

    #[test]
    fn the_json_report_reads_back_as_written() {
        let r = Report {
            bench: "branch".into(),
            schema: SCHEMA,
            command: vec!["forkd".into(), "bench".into(), "branch".into()],
            version: "0.1.0".into(),
            qemu: "10.0.2".into(),
            host_cpus: 2,
            accel: "tcg".into(),
            image: "python-numpy".into(),
            mem_mib: 512,
            busy_mib: 128,
            busy: BusyBranches {
                live: vec![sample(25.9), sample(47.4)],
                full: sample(1333.1),
                live_pause_p50_ms: 25.9,
                live_pause_p90_ms: 47.4,
                live_pause_max_ms: 47.4,
                live_total_p50_ms: 3000.0,
                live_stored_p50_bytes: 128 << 20,
            },
            chain: vec![ChainLink {
                depth: 1,
                branch: sample(8.5),
            }],
            depths: vec![DepthSpawns {
                depth: 0,
                spawns: vec![SpawnSample {
                    process_ms: 40,
                    restored_ms: 150,
                    resumed_ms: 151,
                    ready_ms: 208,
                }],
                ready_p50_ms: 208.0,
                ready_max_ms: 208.0,
                link_stored_bytes: 117 << 20,
            }],
            package: PackageLink {
                name: "hello".into(),
                deb_bytes: 53_000,
                stored_bytes: 4 << 20,
                raw_bytes: 39 << 20,
                branch: sample(9.0),
            },
        };
        let dir = std::env::temp_dir().join(format!("branch-json-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("branch.json");
        r.write(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let back: Report = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
        // The plot script reads these names; renaming one breaks it.
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["bench"], "branch");
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["busy"]["live"][1]["pause_ms"], 47.4);
        assert_eq!(v["depths"][0]["spawns"][0]["ready_ms"], 208);
    }
}
