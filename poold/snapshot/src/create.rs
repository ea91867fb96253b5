//! Taking a warm snapshot: boot a parent whose RAM is a shared file, warm it
//! up, pause it, save its device state, and ingest RAM, device state and
//! disk into the layer store as one snapshot.

use super::config::{file_blake3, host_memory_mib, VmConfig, MAX_VCPUS, MIN_MEM_MIB};
use super::staging::Staging;
use super::SnapshotError;
use crate::boot::{cold_boot, BootSpec};
use crate::images::Image;
use crate::paths::Paths;
use crate::progress::Progress;
use anyhow::{bail, Context, Result};
use forkd_layers::{FileSource, IngestOptions, IngestSource, NewSnapshot, SnapshotRecord, Store};
use forkd_vmm::Accel;
use forkd_vmm::OverlayView;
use forkd_vmm::{kernel_cmdline, Machine, MACHINE_TYPE};
use forkd_vmm::{Lifetime, Memory, Vm};
use rootfs_init::protocol::ExecSpec;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Snapshot file names.
pub const MEMORY: &str = "memory.bin";
/// The device state QEMU saved (everything but RAM).
pub const VMSTATE: &str = "vmstate";
/// The guest's root disk, flattened to a raw image.
pub const ROOTFS: &str = "rootfs.img";

/// How long a warm-up command or eval may run.
pub const WARMUP_TIMEOUT: Duration = Duration::from_secs(600);

/// What a parent boots.
#[derive(Debug, Clone)]
pub enum ImageSource {
    /// A built image (`forkd image ls`).
    Named(String),
    /// A raw root filesystem image and optionally a kernel, by path (forkd's
    /// `rootfs`/`kernel`); the caller has checked the paths are allowed.
    Files {
        /// The raw root filesystem image.
        rootfs: std::path::PathBuf,
        /// A kernel to boot instead of the data dir's.
        kernel: Option<std::path::PathBuf>,
    },
}

impl ImageSource {
    /// A name for records and messages.
    pub fn name(&self) -> String {
        match self {
            ImageSource::Named(n) => n.clone(),
            ImageSource::Files { rootfs, .. } => format!("file:{}", rootfs.display()),
        }
    }
}

/// What to snapshot.
#[derive(Debug, Clone)]
pub struct CreateSpec {
    /// Tag the snapshot is committed under.
    pub tag: String,
    /// What the parent boots.
    pub image: ImageSource,
    /// Guest RAM, MiB.
    pub mem_mib: u64,
    /// Guest vCPUs.
    pub vcpus: u32,
    /// Accelerator the parent (and so every child) runs under.
    pub accel: Accel,
    /// Give the guest a NIC (docs/network.md); part of the machine
    /// signature, so its children all have one.
    pub net: bool,
    /// A shell command run in the parent before the pause; must exit 0.
    pub warmup_cmd: Option<String>,
    /// Python run in the warm interpreter before the pause; must not raise.
    pub eval_warmup: Option<String>,
    /// Move the tag if it already names a snapshot.
    pub replace_tag: bool,
    /// Dies with this process (CLI) rather than outliving it.
    pub lifetime: Lifetime,
    /// Show progress on stderr.
    pub verbose: bool,
    /// Host folders the parent mounts (docs/volumes.md): checked, with
    /// canonical host paths; recorded, and what children get by default.
    pub volumes: Vec<forkd_vmm::Volume>,
    /// Extra CA certificates installed in the parent before its warm-up:
    /// the warm-up and every child trust them (docs/network.md).
    pub ca: Option<crate::ca::CaBundle>,
}

/// Whether a snapshot of `image` gets a NIC: as asked (`--net`/`--no-net`),
/// else yes for python images (the quickstart's), no otherwise.
pub fn default_net(image: &str, net: bool, no_net: bool) -> bool {
    if net || no_net {
        return net;
    }
    image.starts_with("python")
}

/// Where the time went.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CreateTimings {
    /// Cold boot, from the start of the create until the VM was up, ms.
    pub boot_ms: u64,
    /// Warm-up (the warm interpreter, the warm-up command and eval) until the pause, ms.
    pub warmup_ms: u64,
    /// From `stop` to the device state on disk.
    pub save_ms: u64,
    /// Reading the files into the layer store and committing, ms.
    pub ingest_ms: u64,
    /// The whole create, ms.
    pub total_ms: u64,
}

/// A committed snapshot and what it cost.
#[derive(Debug, Clone)]
pub struct Created {
    /// The committed snapshot record.
    pub record: SnapshotRecord,
    /// Where the time went.
    pub timings: CreateTimings,
    /// Pack bytes this snapshot added to the store (what dedup did not save).
    pub new_stored_bytes: u64,
}

/// Takes a warm snapshot. Everything it started (QEMU, staging files, the
/// VM directory) is gone when it returns, on success and on failure.
pub async fn create(paths: &Paths, spec: CreateSpec) -> Result<Created> {
    forkd_layers::validate_tag(&spec.tag)?;
    if spec.mem_mib < MIN_MEM_MIB || spec.vcpus == 0 || spec.vcpus > MAX_VCPUS {
        return Err(SnapshotError::BadSpec(format!(
            "memory must be at least {MIN_MEM_MIB} MiB and vCPUs 1-{MAX_VCPUS}"
        ))
        .into());
    }
    let host_mib = host_memory_mib();
    if spec.mem_mib > host_mib {
        return Err(SnapshotError::BadSpec(format!(
            "memory of {} MiB must be at most this host's {host_mib} MiB",
            spec.mem_mib
        ))
        .into());
    }
    let qemu = forkd_vmm::check_qemu()?;
    let (rootfs, kernel, built_at) = match &spec.image {
        ImageSource::Named(n) => {
            let img = Image::load(&paths.images_dir(), n)?;
            (img.rootfs(), None, img.info.built_at_unix)
        }
        ImageSource::Files { rootfs, kernel } => {
            let m = std::fs::metadata(rootfs)
                .with_context(|| format!("root filesystem {}", rootfs.display()))?;
            let built = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            (rootfs.clone(), kernel.clone(), built)
        }
    };
    let image_name = spec.image.name();
    check_tag_free(paths, &spec.tag, spec.replace_tag).await?;
    super::staging::sweep(&paths.staging_dir());
    forkd_vmm::sweep(&paths.vms_dir()).await;

    let t0 = Instant::now();
    let say = |s: &str| {
        if spec.verbose {
            eprintln!("==> {s}");
        }
    };
    let staging = Staging::create(&paths.staging_dir(), "snap")?;
    forkd_vmm::volume::check_list(&spec.volumes)
        .map_err(|e| SnapshotError::BadSpec(format!("{e:#}")))?;
    let mut machine = Machine::new(spec.accel, spec.mem_mib, spec.vcpus);
    machine.net = spec.net;
    machine.volumes = spec.volumes.len() as u32;
    let extra = forkd_vmm::volume::cmdline_words(&spec.volumes);
    let id = format!("snap-{}", crate::util::random_hex(6));
    let hostname = "forkd".to_string();
    say(&format!(
        "booting a parent from image {} ({} MiB, {} vCPU, {})",
        image_name,
        spec.mem_mib,
        spec.vcpus,
        spec.accel.as_str()
    ));
    let mut vm = cold_boot(
        paths,
        BootSpec {
            id: id.clone(),
            rootfs,
            kernel: kernel.clone(),
            machine: machine.clone(),
            memory: Memory::Shared(staging.join(MEMORY)),
            hostname: hostname.clone(),
            lifetime: spec.lifetime,
            volumes: spec.volumes.clone(),
        },
    )
    .await?;
    let mut timings = CreateTimings {
        boot_ms: ms(t0.elapsed()),
        ..Default::default()
    };
    let saved = async {
        let t = Instant::now();
        let ping = warm_up(&vm, &spec, &say).await?;
        timings.warmup_ms = ms(t.elapsed());
        say("pausing and saving the device state");
        let t = Instant::now();
        vm.pause().await?;
        vm.save_state(&staging.join(super::create::VMSTATE)).await?;
        timings.save_ms = ms(t.elapsed());
        Ok::<_, anyhow::Error>(ping)
    }
    .await;
    vm.kill_now().await;
    let result = match saved {
        Ok(ping) => {
            let host_cpu = match machine.accel {
                Accel::Kvm => Some(super::config::host_cpu_id()?),
                Accel::Tcg => None,
            };
            let config = VmConfig {
                qemu_version: qemu,
                machine_signature: machine.signature(),
                machine_type: MACHINE_TYPE.into(),
                cmdline: kernel_cmdline(machine.accel, &hostname, machine.net, &extra),
                machine,
                kernel_blake3: file_blake3(kernel.as_deref().unwrap_or(&paths.vmlinuz()))?,
                initrd_blake3: file_blake3(&paths.initramfs())?,
                image: image_name.clone(),
                image_built_at_unix: built_at,
                host_cpu,
                volumes: spec.volumes.clone(),
            };
            let mut lineage = BTreeMap::new();
            lineage.insert("source".into(), json!(format!("image:{image_name}")));
            if let Some(c) = &spec.warmup_cmd {
                lineage.insert("warmup_cmd".into(), json!(c));
            }
            if let Some(c) = &spec.eval_warmup {
                lineage.insert("eval_warmup".into(), json!(c));
            }
            if let Some(ca) = &spec.ca {
                lineage.insert("ca_certs".into(), json!(ca.len()));
            }
            if let Some(pid) = ping.warm_pid {
                lineage.insert("warm_pid".into(), json!(pid));
            }
            lineage.insert("boot_ms".into(), json!(timings.boot_ms));
            lineage.insert("warmup_ms".into(), json!(timings.warmup_ms));
            say("ingesting memory, device state and disk into the store");
            let t = Instant::now();
            let r = ingest(
                paths,
                &vm.dir.disk(),
                &staging,
                Commit {
                    tag: spec.tag.clone(),
                    replace_tag: spec.replace_tag,
                    parent: None,
                    base_rootfs: None,
                    base_memory: None,
                    config: serde_json::to_value(&config)?,
                    lineage,
                },
                spec.verbose,
            )
            .await;
            timings.ingest_ms = ms(t.elapsed());
            r
        }
        Err(e) => Err(e),
    };
    let _ = std::fs::remove_dir_all(&vm.dir.path);
    drop(staging);
    let (record, new_stored_bytes) = result?;
    timings.total_ms = ms(t0.elapsed());
    Ok(Created {
        record,
        timings,
        new_stored_bytes,
    })
}

/// Runs the warm-up: waits for the warm interpreter, then the command and
/// the eval, failing with their output if they fail.
async fn warm_up(
    vm: &Vm,
    spec: &CreateSpec,
    say: &(dyn Fn(&str) + Sync),
) -> Result<rootfs_init::protocol::PingResult> {
    let ping = wait_warm_interpreter(vm).await?;
    if let Some(ca) = &spec.ca {
        say(&format!("installing {} extra CA certificate(s)", ca.len()));
        let installed = vm.agent.trust_ca(&ca.pem()).await?;
        if installed != ca.len() {
            bail!(
                "the guest installed {installed} of {} CA certificates: the image's agent predates `ca_certs`; rebuild the initramfs with this forkd",
                ca.len()
            );
        }
    }
    if let Some(cmd) = &spec.warmup_cmd {
        say(&format!("warm-up command: {cmd}"));
        let out = vm
            .agent
            .exec(
                ExecSpec {
                    shell: Some(cmd.clone()),
                    timeout_ms: Some(WARMUP_TIMEOUT.as_millis() as u64),
                    ..Default::default()
                },
                &[],
            )
            .await?;
        if out.result.status_code() != 0 {
            bail!(
                "warm-up command {cmd:?} failed with status {}:\n{}{}",
                out.result.status_code(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    if let Some(code) = &spec.eval_warmup {
        // Python, or JavaScript in a Node-mode image: whatever the image's
        // warm interpreter speaks.
        if ping.warm_pid.is_none() {
            bail!(
                "--eval-warmup needs the image's warm interpreter (Python, or Node in a Node-mode image), but image {} has none ({})",
                spec.image.name(),
                ping.warm_error.as_deref().unwrap_or("no python3")
            );
        }
        say(&format!("warm-up eval: {code}"));
        let r = vm
            .agent
            .eval(code, Some(WARMUP_TIMEOUT.as_millis() as u64))
            .await?;
        if let Some(err) = r.error {
            bail!(
                "warm-up eval {code:?} raised {err}\n{}",
                r.traceback.unwrap_or_default()
            );
        }
    }
    Ok(ping)
}

/// Waits until the agent reports its warm interpreter ready (or that there
/// is none), so the snapshot holds a finished warm-up.
pub async fn wait_warm_interpreter(vm: &Vm) -> Result<rootfs_init::protocol::PingResult> {
    let deadline = Instant::now() + WARMUP_TIMEOUT;
    loop {
        let p = vm.agent.ping(Duration::from_secs(10)).await?;
        if p.warm_ready || p.warm_error.is_some() {
            return Ok(p);
        }
        if Instant::now() > deadline {
            bail!("the warm interpreter did not become ready within {WARMUP_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How to commit what [`ingest`] reads.
pub struct Commit {
    /// Tag to commit the snapshot under.
    pub tag: String,
    /// Move the tag if it already names another snapshot.
    pub replace_tag: bool,
    /// The snapshot this one is a link on top of; None for a root.
    pub parent: Option<forkd_layers::SnapshotId>,
    /// The parent's rootfs manifest: only the ranges the disk's overlays
    /// hold are read; all others are taken from it unread.
    pub base_rootfs: Option<forkd_layers::ManifestId>,
    /// The parent's memory manifest (chunk size and dedup reference).
    pub base_memory: Option<forkd_layers::ManifestId>,
    /// The VM configuration to record (`VmConfig` as JSON).
    pub config: Value,
    /// Where the snapshot came from (`branched_from`, `pause_ms`, ...), kept in the record.
    pub lineage: BTreeMap<String, Value>,
}

/// Ingests `staging/{memory.bin,vmstate}` and a disk (a qcow2 overlay over
/// its backing chain, flattened without materialising it) and commits them
/// as one snapshot. Nothing may write to the disk meanwhile.
pub async fn ingest(
    paths: &Paths,
    disk: &std::path::Path,
    staging: &Staging,
    commit: Commit,
    verbose: bool,
) -> Result<(SnapshotRecord, u64)> {
    let disk = OverlayView::open(disk).await?;
    let memory = staging.join(MEMORY);
    let vmstate = staging.join(VMSTATE);
    crate::store::with_rw(paths, move |store| {
        let mut files = BTreeMap::new();
        let mut new_bytes = 0;
        let mut manifests = Vec::new();
        let res = (|| {
            for (name, path, base) in [
                (MEMORY, &memory, commit.base_memory),
                (VMSTATE, &vmstate, None),
            ] {
                let f = ingest_one(store, name, &FileSource::open(path)?, base, None, verbose)?;
                manifests.push(f.manifest);
                new_bytes += f.new_stored_bytes;
                files.insert(name.to_string(), f.file_ref());
            }
            let dirty = commit.base_rootfs.map(|_| disk.changed_ranges());
            let f = ingest_one(store, ROOTFS, &disk, commit.base_rootfs, dirty, verbose)?;
            manifests.push(f.manifest);
            new_bytes += f.new_stored_bytes;
            files.insert(ROOTFS.to_string(), f.file_ref());
            let rec = store.commit_snapshot(NewSnapshot {
                parent: commit.parent,
                files,
                config: commit.config,
                lineage: commit.lineage,
                tag: Some(commit.tag),
                replace_tag: commit.replace_tag,
            })?;
            Ok((rec, new_bytes))
        })();
        if res.is_err() {
            for m in &manifests {
                store.release(m);
            }
        }
        res
    })
    .await
}

/// Ingests one file; with `base` and `dirty`, only the dirty ranges are
/// read and everything else is taken from `base`.
fn ingest_one(
    store: &Store,
    name: &str,
    src: &dyn IngestSource,
    base: Option<forkd_layers::ManifestId>,
    dirty: Option<Vec<std::ops::Range<u64>>>,
    verbose: bool,
) -> Result<forkd_layers::IngestedFile> {
    let progress = Arc::new(Progress::new(name, !verbose));
    progress.set_total(src.size());
    let p = progress.clone();
    let last = std::sync::atomic::AtomicU64::new(0);
    let opts = IngestOptions {
        base,
        dirty,
        progress: Some(Arc::new(move |done, _total| {
            let prev = last.swap(done, std::sync::atomic::Ordering::Relaxed);
            p.inc(done.saturating_sub(prev));
        })),
        ..Default::default()
    };
    let f = store
        .ingest_source(src, &opts)
        .with_context(|| format!("ingesting {name}"))?;
    progress.finish();
    Ok(f)
}

/// Fails early when `tag` is taken (and may not be replaced).
async fn check_tag_free(paths: &Paths, tag: &str, replace: bool) -> Result<()> {
    if replace {
        return Ok(());
    }
    let tag = tag.to_string();
    crate::store::with_rw(paths, move |store| {
        if let Some(id) = store.tag(&tag)? {
            bail!("tag {tag:?} already names snapshot {id}; delete it first (`forkd snapshot rm {tag}`) or pick another tag");
        }
        Ok(())
    })
    .await
}

pub(crate) fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}
