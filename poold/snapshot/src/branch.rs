//! BRANCH: a snapshot of a *running* child, taken with a pause of a few
//! milliseconds (docs/design.md, "Branch: live migration to a
//! collector").
//!
//! 1. A *collector* QEMU starts with the child's devices, RAM in a new
//!    shared file, waiting for an incoming migration on a unix socket.
//! 2. The child migrates to it. Live mode: precopy, the child keeps running
//!    while its RAM is copied; full mode: the child is stopped first
//!    (stop-and-copy). `pause-before-switchover` stops the migration once
//!    the child's vCPUs are stopped for the last round.
//! 3. In that window the child's disk is snapshotted (`blockdev-snapshot-
//!    sync`): its overlay becomes a read-only backing file and a new overlay
//!    takes the writes. No disk data is copied inside the pause.
//! 4. The migration finishes, the child is resumed (`cont`). `pause_ms` is
//!    the time between QEMU's STOP and RESUME events on the child.
//! 5. The collector, paused, holds the exact state with RAM in a file: a
//!    normal x-ignore-shared save gives the vmstate.
//! 6. RAM, vmstate and the frozen disk are ingested against the parent
//!    snapshot's manifests: only chunks that differ are stored.

use super::create::{ingest, ms, Commit, MEMORY, ROOTFS, VMSTATE};
use super::restore::Source;
use super::staging::Staging;
use crate::paths::Paths;
use anyhow::{anyhow, bail, Context, Result};
use forkd_layers::SnapshotRecord;
use forkd_vmm::MigrationStatus;
use forkd_vmm::{Boot, DiskBase, Lifetime, Memory, StartSpec, Vm, VmDir};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How the child is captured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Precopy: the child runs while its RAM is copied; paused only for the
    /// last dirty pages and the disk switch.
    Live,
    /// forkd's diff mode. Here it is the same precopy as `live`: what a link
    /// stores is decided by content (only chunks the parent lacks), not by
    /// the capture.
    Diff,
    /// Stop-and-copy: the child is paused for the whole RAM copy.
    Full,
}

impl Mode {
    /// The mode's API name: `live`, `diff` or `full`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Live => "live",
            Mode::Diff => "diff",
            Mode::Full => "full",
        }
    }
}

/// How long a capture may take.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest pause precopy aims for, ms. QEMU switches over once the dirty
/// pages left can be sent within it.
const DOWNTIME_LIMIT_MS: u64 = 20;
/// How long precopy may try to converge before a longer pause is allowed.
const CONVERGE_PATIENCE: Duration = Duration::from_secs(20);
const RELAXED_DOWNTIME_MS: u64 = 2000;

/// A captured branch whose files are still to be ingested.
pub struct Captured {
    staging: Staging,
    /// The child's disk as it stood in the pause (now a read-only backing
    /// file of the child's new overlay).
    frozen_disk: PathBuf,
    /// Time between QEMU's STOP and RESUME events on the child, ms.
    pub pause_ms: f64,
    /// Whole capture, from its start until the child ran again, ms.
    pub capture_ms: u64,
    /// The mode it was captured in.
    pub mode: Mode,
    /// The child's host folders, which the branch records as its own.
    volumes: Vec<forkd_vmm::Volume>,
}

/// A committed branch.
#[derive(Debug, Clone)]
pub struct Branched {
    /// The committed snapshot record.
    pub record: SnapshotRecord,
    /// Time between QEMU's STOP and RESUME events on the child, ms.
    pub pause_ms: f64,
    /// From the start of the capture until the snapshot was committed.
    pub total_ms: u64,
    /// Pack bytes this link added to the store.
    pub new_stored_bytes: u64,
}

/// Captures the running VM `vm`, a child of snapshot `parent` served at
/// `mount`. The VM is running again when this returns, on success and on
/// failure.
pub async fn capture(
    paths: &Paths,
    mount: &Path,
    vm: &Vm,
    parent: &SnapshotRecord,
    mode: Mode,
) -> Result<Captured> {
    let t0 = Instant::now();
    let src = Source::new(mount, parent)?;
    let staging = Staging::create(&paths.staging_dir(), "branch")?;
    let volumes = vm.record.volumes.clone();
    let collector = start_collector(paths, &src, &staging, &volumes).await?;
    let result = migrate(vm, &collector.dir.migrate_sock(), mode).await;
    let result = match result {
        Ok((pause_ms, frozen_disk)) => {
            let saved = async {
                collector
                    .qmp
                    .wait_migration(MIGRATION_TIMEOUT)
                    .await
                    .context("collector")?;
                collector.save_state(&staging.join(VMSTATE)).await
            }
            .await;
            saved.map(|()| (pause_ms, frozen_disk))
        }
        Err(e) => Err(e),
    };
    collector.destroy().await;
    let (pause_ms, frozen_disk) = result?;
    take_back_frozen(vm, &frozen_disk, &src.rootfs())?;
    Ok(Captured {
        staging,
        frozen_disk,
        pause_ms,
        capture_ms: ms(t0.elapsed()),
        mode,
        volumes,
    })
}

/// Ingests a capture as a child of `parent` and commits it under `tag`.
pub async fn commit(
    paths: &Paths,
    captured: Captured,
    parent: &SnapshotRecord,
    tag: &str,
    mut lineage: BTreeMap<String, Value>,
) -> Result<Branched> {
    let t0 = Instant::now();
    lineage.insert("pause_ms".into(), json!(captured.pause_ms));
    lineage.insert("branch_mode".into(), json!(captured.mode.as_str()));
    lineage.insert("capture_ms".into(), json!(captured.capture_ms));
    let base_rootfs = parent.files.get(ROOTFS).map(|f| f.manifest);
    let base_memory = parent.files.get(MEMORY).map(|f| f.manifest);
    // A branch's volumes are its child's (which a spawn may have rebound).
    let mut config = parent.config.clone();
    if !captured.volumes.is_empty() {
        config["volumes"] = serde_json::to_value(&captured.volumes)?;
    }
    let (record, new_stored_bytes) = ingest(
        paths,
        &captured.frozen_disk,
        &captured.staging,
        Commit {
            tag: tag.to_string(),
            replace_tag: false,
            parent: Some(parent.id),
            base_rootfs,
            base_memory,
            config,
            lineage,
        },
        false,
    )
    .await?;
    Ok(Branched {
        record,
        pause_ms: captured.pause_ms,
        total_ms: captured.capture_ms + ms(t0.elapsed()),
        new_stored_bytes,
    })
}

/// [`capture`] then [`commit`].
pub async fn branch(
    paths: &Paths,
    mount: &Path,
    vm: &Vm,
    parent: &SnapshotRecord,
    tag: &str,
    mode: Mode,
    lineage: BTreeMap<String, Value>,
) -> Result<Branched> {
    forkd_layers::validate_tag(tag)?;
    let c = capture(paths, mount, vm, parent, mode).await?;
    commit(paths, c, parent, tag, lineage).await
}

/// Most qcow2 files a child's disk stacks above the snapshot's rootfs.
/// Every branch freezes the child's overlay and adds a new one on top, so
/// a sandbox branched again and again would read through an ever longer
/// chain (and past 64 files could not be branched at all).
pub const MAX_DISK_LAYERS: usize = 8;

/// How long flattening a child's disk chain may take.
const FLATTEN_TIMEOUT: Duration = Duration::from_secs(600);

/// Keeps a branched child's disk chain within [`MAX_DISK_LAYERS`]: past it,
/// QEMU streams every layer above `rootfs` into the active overlay while
/// the child runs (`block-stream`), and the now unused layers are removed.
/// Call after the branch's commit (the frozen layer is ingested by then).
/// Returns the number of layers left above `rootfs`.
pub async fn bound_disk_chain(vm: &Vm, rootfs: &Path) -> Result<usize> {
    let (active, _) = active_disk(vm).await?;
    let chain = forkd_vmm::backing_chain(&active)?;
    let layers = chain.len().saturating_sub(1);
    if layers <= MAX_DISK_LAYERS {
        return Ok(layers);
    }
    const JOB: &str = "forkd-flatten";
    vm.qmp
        .execute(
            "block-stream",
            json!({"job-id": JOB, "device": "root", "base": rootfs, "auto-dismiss": false}),
        )
        .await
        .context("starting to flatten the disk chain")?;
    let deadline = Instant::now() + FLATTEN_TIMEOUT;
    let job = loop {
        let jobs = vm.qmp.execute("query-block-jobs", json!({})).await?;
        let job = jobs
            .as_array()
            .and_then(|a| a.iter().find(|j| j["device"] == JOB).cloned())
            .ok_or_else(|| anyhow!("the flatten job vanished: {jobs}"))?;
        if job["status"] == "concluded" {
            break job;
        }
        if Instant::now() > deadline {
            let _ = vm
                .qmp
                .execute("block-job-cancel", json!({"device": JOB, "force": true}))
                .await;
            bail!("flattening the disk chain of {} timed out", vm.id);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = vm.qmp.execute("job-dismiss", json!({"id": JOB})).await;
    if let Some(e) = job["error"].as_str() {
        bail!("flattening the disk chain of {}: {e}", vm.id);
    }
    let now = forkd_vmm::backing_chain(&active)?;
    if now.len() != 2 || now.last().map(PathBuf::as_path) != Some(rootfs) {
        bail!("the disk chain of {} after flattening is {now:?}", vm.id);
    }
    // The middle layers are in the VM directory (checked at every branch)
    // and no longer read. Those a branch added stay open in QEMU until
    // deleted (the command line's first disk closes by itself).
    for layer in &chain[1..layers] {
        let _ = vm
            .qmp
            .execute("blockdev-del", json!({"node-name": overlay_node(layer)}))
            .await;
        if layer.parent() == Some(vm.dir.path.as_path()) {
            let _ = std::fs::remove_file(layer);
        }
    }
    Ok(1)
}

/// Starts the collector: the child's machine and devices, RAM in a new
/// shared file, waiting for the migration on its `migrate.sock` (in its own
/// socket directory), paused (-S) after it.
async fn start_collector(
    paths: &Paths,
    src: &Source,
    staging: &Staging,
    volumes: &[forkd_vmm::Volume],
) -> Result<Vm> {
    let id = format!("collect-{}", crate::util::random_hex(6));
    let dir = VmDir::new(paths.vm_dir(&id));
    let sock = dir.migrate_sock();
    crate::paths::check_socket_path(&sock)?;
    let spec = StartSpec {
        id,
        machine: src.config.machine.clone(),
        memory: Memory::Shared(staging.join(MEMORY)),
        boot: Boot::Incoming,
        disk: DiskBase::Snapshot {
            path: src.rootfs(),
            size: src.rootfs_size,
        },
        lifetime: Lifetime::Ephemeral,
        nic: None,
        // The child's own folders: virtiofsd's state (the guest's open
        // files, by path) migrates into the collector's virtiofsd.
        volumes: volumes.to_vec(),
    };
    Vm::start(dir, spec, async |vm: &mut Vm| {
        vm.set_ignore_shared(false).await?;
        let uri = format!("unix:{}", sock.display());
        vm.qmp
            .execute("migrate-incoming", json!({ "uri": uri }))
            .await
            .context("arming the collector")?;
        Ok(())
    })
    .await
}

/// Migrates `vm` to the collector on `sock`, snapshotting its disk inside
/// the final pause. Returns the pause in ms and the frozen disk file. The VM
/// is running when this returns, whatever happened.
async fn migrate(vm: &Vm, sock: &Path, mode: Mode) -> Result<(f64, PathBuf)> {
    let mut events = vm.qmp.events();
    let disk = prepare_overlay(vm).await?;
    let armed = async {
        vm.qmp
            .execute(
                "migrate-set-capabilities",
                json!({"capabilities": [
                    {"capability": "x-ignore-shared", "state": false},
                    {"capability": "pause-before-switchover", "state": true},
                    // A guest that dirties RAM faster than it is copied is
                    // throttled until the rest fits in the downtime limit.
                    {"capability": "auto-converge", "state": true},
                ]}),
            )
            .await?;
        vm.qmp
            .execute(
                "migrate-set-parameters",
                json!({"max-bandwidth": 64u64 << 30, "downtime-limit": DOWNTIME_LIMIT_MS}),
            )
            .await?;
        if mode == Mode::Full {
            vm.pause().await?;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    if let Err(e) = armed {
        disk.abandon(vm).await;
        let _ = vm.resume().await;
        return Err(e);
    }
    let mut switched = false;
    let run = async {
        // The child's QEMU is jailed and cannot reach the collector's
        // socket: poold connects and hands it the connection.
        let conn = connect_collector(sock)?;
        vm.qmp
            .send_fd(MIGRATE_FD, std::os::fd::AsFd::as_fd(&conn))
            .await
            .context("passing the collector connection to the child")?;
        drop(conn);
        vm.qmp
            .execute("migrate", json!({ "uri": format!("fd:{MIGRATE_FD}") }))
            .await
            .context("starting the migration to the collector")?;
        let t = Instant::now();
        wait_status(vm, MigrationStatus::PreSwitchover).await?;
        let t_pre = t.elapsed();
        // vCPUs are stopped: freeze the disk at this instant. The new
        // overlay was created and opened before the pause; this only
        // re-points the drive at it.
        vm.qmp
            .execute(
                "blockdev-snapshot",
                json!({"node": "root", "overlay": disk.node}),
            )
            .await
            .context("switching the disk to a new overlay")?;
        switched = true;
        let t_disk = t.elapsed();
        vm.qmp
            .execute("migrate-continue", json!({"state": "pre-switchover"}))
            .await?;
        let done = vm
            .qmp
            .wait_migration(MIGRATION_TIMEOUT)
            .await
            .context("migrating to the collector")?;
        tracing::debug!(
            "branch {}: precopy {:?}, disk switch {:?}, switchover done {:?}; QEMU: {done}",
            vm.id,
            t_pre,
            t_disk - t_pre,
            t.elapsed() - t_disk
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    if run.is_err() {
        let _ = vm.qmp.execute("migrate_cancel", json!({})).await;
        let _ = wait_settled(vm).await;
    }
    // Whatever happened, the child runs again.
    let t = Instant::now();
    let resumed = vm.resume().await;
    tracing::debug!("branch {}: cont took {:?}", vm.id, t.elapsed());
    let pause_ms = pause_from_events(&mut events).await;
    if !switched {
        disk.abandon(vm).await;
    }
    run?;
    resumed.context("resuming the child after the branch")?;
    Ok((pause_ms?, disk.frozen))
}

/// Makes the frozen disk root's again (the child reads it through the jail
/// group but can no longer write it) and checks that its qcow2 backing
/// chain stays in the VM directory and ends at the snapshot's rootfs: poold
/// reads it as root, and a compromised QEMU could have rewritten its header
/// to name any host file.
fn take_back_frozen(vm: &Vm, frozen: &Path, rootfs: &Path) -> Result<()> {
    if vm.record.jail_uid.is_some() {
        let gid = forkd_vmm::JailConfig::get()?.gid;
        forkd_vmm::set_owner(frozen, 0, gid, 0o640)?;
    }
    let chain = forkd_vmm::backing_chain(frozen)?;
    let (last, disks) = chain.split_last().context("empty backing chain")?;
    if last != rootfs
        || disks
            .iter()
            .any(|d| d.parent() != Some(vm.dir.path.as_path()))
    {
        bail!(
            "the frozen disk of {} has an unexpected backing chain {chain:?}; refusing to store it",
            vm.id
        );
    }
    Ok(())
}

/// The QMP name of the migration connection passed to the child.
const MIGRATE_FD: &str = "forkd-branch";

/// Connects to the collector's migration socket, refusing anything but a
/// socket at that path (never following a link planted there).
fn connect_collector(sock: &Path) -> Result<std::os::unix::net::UnixStream> {
    use std::os::unix::fs::FileTypeExt;
    let m = std::fs::symlink_metadata(sock).with_context(|| {
        format!(
            "the collector has no migration socket at {}",
            sock.display()
        )
    })?;
    if !m.file_type().is_socket() {
        bail!("{} is not a socket", sock.display());
    }
    std::os::unix::net::UnixStream::connect(sock)
        .with_context(|| format!("connecting to the collector at {}", sock.display()))
}

/// The overlay a branch switches the child's disk to, made and opened
/// before the pause so the pause only re-points the drive.
struct NextOverlay {
    node: String,
    file: PathBuf,
    /// The file the disk writes to until the switch (frozen after it).
    frozen: PathBuf,
}

impl NextOverlay {
    /// Removes an overlay that was never switched to.
    async fn abandon(&self, vm: &Vm) {
        let _ = vm
            .qmp
            .execute("blockdev-del", json!({"node-name": self.node}))
            .await;
        let _ = std::fs::remove_file(&self.file);
    }
}

/// Creates the next overlay file over the disk's active file and opens it
/// in QEMU as a node without a backing (blockdev-snapshot attaches it).
/// Like every forkd disk node it never flushes (cache=unsafe) and never
/// drops the page cache when re-activated after a migration.
async fn prepare_overlay(vm: &Vm) -> Result<NextOverlay> {
    let (frozen, size) = active_disk(vm).await?;
    let file = next_overlay(&vm.dir, &frozen);
    forkd_vmm::create_overlay_on(&frozen, "qcow2", size, &file).await?;
    if let Err(e) = vm.give(&file) {
        let _ = std::fs::remove_file(&file);
        return Err(e);
    }
    let node = overlay_node(&file);
    let added = vm
        .qmp
        .execute(
            "blockdev-add",
            json!({
                "driver": "qcow2",
                "node-name": node,
                "discard": "unmap",
                "cache": {"direct": false, "no-flush": true},
                "file": {"driver": "file", "filename": file, "drop-cache": false},
                "backing": null,
            }),
        )
        .await;
    if let Err(e) = added {
        let _ = std::fs::remove_file(&file);
        return Err(e.context("opening the next disk overlay"));
    }
    Ok(NextOverlay { node, file, frozen })
}

/// The QMP node name a branch gives the overlay `file` it adds.
fn overlay_node(file: &Path) -> String {
    format!(
        "ovl-{}",
        file.file_stem()
            .map_or("x".into(), |s| s.to_string_lossy().replace('.', "-"))
    )
}

/// The file the child's root disk currently writes to, and its size.
async fn active_disk(vm: &Vm) -> Result<(PathBuf, u64)> {
    let blocks = vm.qmp.execute("query-block", json!({})).await?;
    let root = blocks
        .as_array()
        .and_then(|a| a.iter().find(|b| b["device"] == "root"))
        .ok_or_else(|| anyhow!("the VM has no root disk in query-block: {blocks}"))?;
    let file = root["inserted"]["file"]
        .as_str()
        .ok_or_else(|| anyhow!("root disk without a file: {root}"))?;
    let size = root["inserted"]["image"]["virtual-size"]
        .as_u64()
        .ok_or_else(|| anyhow!("root disk without a size: {root}"))?;
    // QEMU's answer is not trusted: poold later reads this file as root.
    let file = PathBuf::from(file);
    if file.parent() != Some(vm.dir.path.as_path()) {
        bail!(
            "VM {} reports its root disk at {}, outside its directory; refusing to branch it",
            vm.id,
            file.display()
        );
    }
    Ok((file, size))
}

/// A new overlay name in the VM directory: `disk.1.qcow2`, `disk.2.qcow2`...
fn next_overlay(dir: &VmDir, active: &Path) -> PathBuf {
    let mut n = 1;
    loop {
        let p = dir.path.join(format!("disk.{n}.qcow2"));
        if !p.exists() && p != active {
            return p;
        }
        n += 1;
    }
}

async fn wait_status(vm: &Vm, want: MigrationStatus) -> Result<()> {
    let start = Instant::now();
    let deadline = start + MIGRATION_TIMEOUT;
    let mut relaxed = false;
    loop {
        let st = vm.qmp.query_migrate().await?;
        if !relaxed && start.elapsed() > CONVERGE_PATIENCE {
            // Still not converged (throttling a TCG guest is coarse): accept
            // a longer pause rather than copy forever.
            relaxed = true;
            tracing::warn!(
                "branch of {}: precopy has not converged after {CONVERGE_PATIENCE:?}; allowing a pause of up to {RELAXED_DOWNTIME_MS} ms",
                vm.id
            );
            vm.qmp
                .execute(
                    "migrate-set-parameters",
                    json!({ "downtime-limit": RELAXED_DOWNTIME_MS }),
                )
                .await?;
        }
        match st.status {
            s if s == want => return Ok(()),
            s if s.is_failed() => bail!("migration to the collector failed: {}", st.error_desc()),
            _ if Instant::now() > deadline => bail!("migration did not reach {want:?}: {st}"),
            _ => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

/// Waits until a cancelled migration is over.
async fn wait_settled(vm: &Vm) -> Result<()> {
    for _ in 0..1000 {
        if !vm.qmp.query_migrate().await?.status.is_in_progress() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// The time between the last STOP and the next RESUME event, from QEMU's
/// own event timestamps.
async fn pause_from_events(rx: &mut tokio::sync::broadcast::Receiver<Value>) -> Result<f64> {
    let ts = |v: &Value| {
        let t = &v["timestamp"];
        t["seconds"].as_f64().unwrap_or(0.0) * 1e3 + t["microseconds"].as_f64().unwrap_or(0.0) / 1e3
    };
    let mut stop = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let ev = match tokio::time::timeout_at(deadline, rx.recv()).await {
            Err(_) => bail!("QEMU sent no STOP/RESUME events for the branch"),
            Ok(Ok(ev)) => ev,
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => continue,
            Ok(Err(e)) => return Err(anyhow!("QMP event stream: {e}")),
        };
        match ev["event"].as_str() {
            Some("STOP") => stop = Some(ts(&ev)),
            Some("RESUME") if stop.is_some() => return Ok(ts(&ev) - stop.unwrap_or(0.0)),
            _ => {}
        }
    }
}
