//! Restoring children from a snapshot served by forkd-fs (docs/design.md,
//! "The VMM and its QMP sequences", "Restore a child"): RAM is a private
//! copy-on-write mapping of the snapshot's `memory.bin`, the disk a private
//! qcow2 overlay over its `rootfs.img`, and
//! the device state comes from its `vmstate`. A restored child is paused
//! until [`hand_out`] resumes it and gives it its own identity.

use super::config::VmConfig;
use super::create::{ms, MEMORY, ROOTFS, VMSTATE};
use super::SnapshotError;
use crate::ca::CaBundle;
use crate::paths::Paths;
use anyhow::{anyhow, Result};
use forkd_layers::{SnapshotId, SnapshotRecord};
use forkd_vmm::{Boot, DiskBase, Lifetime, Memory, Nic, StartSpec, Vm, VmDir, Volume};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How long a resumed child may take to answer its first request.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A snapshot as children see it: its files on the forkd-fs mount.
#[derive(Debug, Clone)]
pub struct Source {
    /// The snapshot's id in the layer store.
    pub id: SnapshotId,
    /// Its directory on the forkd-fs mount, `MOUNT/by-id/<id>/`.
    pub dir: PathBuf,
    /// The VM configuration children must be started with.
    pub config: VmConfig,
    /// Size of `rootfs.img`, bytes, so the overlay is made without a stat through FUSE.
    pub rootfs_size: u64,
}

impl Source {
    /// Resolves a tag or snapshot id through the mount (its `snapshot.json`),
    /// so forking never needs the store's write lock.
    pub fn resolve(mount: &std::path::Path, tag_or_id: &str) -> Result<Source> {
        Source::new(mount, &read_record(mount, tag_or_id)?)
    }

    /// The snapshot `rec` served from the mount at `mount`. Checks that this
    /// host can restore it and that its files are there; a refusal is a
    /// [`SnapshotError`] (`Incompatible`, `MissingFile`, `FileUnreadable`).
    pub fn new(mount: &std::path::Path, rec: &SnapshotRecord) -> Result<Source> {
        let incompatible = |e: anyhow::Error| SnapshotError::Incompatible {
            reason: format!("{e:#}"),
        };
        let config = VmConfig::from_record(rec).map_err(incompatible)?;
        config.check_restorable().map_err(incompatible)?;
        config
            .check_sane(
                rec.files.get(MEMORY).map(|f| f.size),
                super::config::host_memory_mib(),
            )
            .map_err(incompatible)?;
        let dir = forkd_fs::prefetch::file_path(mount, &rec.id, MEMORY)
            .parent()
            .map(PathBuf::from)
            .ok_or_else(|| anyhow!("bad mount path"))?;
        for f in [MEMORY, VMSTATE, ROOTFS] {
            if !rec.files.contains_key(f) {
                return Err(SnapshotError::MissingFile {
                    id: rec.id,
                    file: f,
                }
                .into());
            }
            let path = dir.join(f);
            if let Err(source) = std::fs::metadata(&path) {
                return Err(SnapshotError::FileUnreadable {
                    id: rec.id,
                    file: f,
                    path,
                    source,
                }
                .into());
            }
        }
        check_remote(mount, &rec.id)?;
        Ok(Source {
            id: rec.id,
            dir,
            config,
            rootfs_size: rec.files[ROOTFS].size,
        })
    }

    /// Whether the snapshot's working set is local (always, for a snapshot
    /// that is not lazy): what a pool waits for before it refills from a
    /// lazy snapshot, so parked children never wait on a hub. Asks
    /// forkd-fs, which also counts the chunks it fetched but has not
    /// imported yet, and starts fetching the set. As in `check_remote`, a
    /// forkd-fs without lazy snapshots serves none: local.
    pub fn working_set_local(&self, mount: &std::path::Path) -> Result<bool> {
        let sock = forkd_fs::default_control_socket(mount);
        let Ok(mut c) = forkd_fs::Client::connect(&sock) else {
            return Ok(true);
        };
        match c.remote_ready(&self.id, std::time::Duration::ZERO) {
            Ok(r) => Ok(r.working_set_local),
            Err(e) => match e.downcast_ref::<forkd_fs::ControlError>() {
                Some(forkd_fs::ControlError::Refused(msg)) if msg.starts_with("bad request") => {
                    Ok(true)
                }
                _ => Err(e),
            },
        }
    }

    /// `memory.bin`, mapped privately by each child.
    pub fn memory(&self) -> PathBuf {
        self.dir.join(MEMORY)
    }
    /// The device state children load.
    pub fn vmstate(&self) -> PathBuf {
        self.dir.join(VMSTATE)
    }
    /// The disk each child's overlay sits on.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join(ROOTFS)
    }
}

/// Refuses to start a child of a lazy snapshot whose hub does not answer
/// ([`SnapshotError::RemoteUnavailable`]); for a lazy one whose hub does,
/// starts fetching its working set now, while the restore gets going.
/// A forkd-fs from before lazy snapshots (it does not know the request)
/// serves none, so nothing is checked.
fn check_remote(mount: &std::path::Path, id: &SnapshotId) -> Result<()> {
    let sock = forkd_fs::default_control_socket(mount);
    let Ok(mut c) = forkd_fs::Client::connect(&sock) else {
        return Ok(());
    };
    match c.remote_ready(id, std::time::Duration::ZERO) {
        Ok(_) => Ok(()),
        Err(e) => match e.downcast_ref::<forkd_fs::ControlError>() {
            Some(forkd_fs::ControlError::Refused(msg)) if msg.starts_with("bad request") => Ok(()),
            Some(forkd_fs::ControlError::Refused(msg)) => Err(SnapshotError::RemoteUnavailable {
                id: *id,
                reason: msg.clone(),
            }
            .into()),
            _ => Err(e),
        },
    }
}

/// Reads a snapshot record from the mount by tag or id. The name is
/// validated before it touches a path. Fails with a [`SnapshotError`]
/// (`NotFound`, `Unreadable`, `Corrupt`) inside the chain.
pub fn read_record(mount: &std::path::Path, tag_or_id: &str) -> Result<SnapshotRecord> {
    // A tag wins over an id spelled the same (as in the store's resolve).
    let as_tag = forkd_layers::validate_tag(tag_or_id).map(|()| mount.join(tag_or_id));
    let dir = match (as_tag, tag_or_id.parse::<SnapshotId>()) {
        (Ok(link), _) if link.join("snapshot.json").exists() => link,
        (_, Ok(id)) => mount.join("by-id").join(id.to_string()),
        (Ok(link), Err(_)) => link,
        (Err(e), Err(_)) => return Err(e.into()),
    };
    let json = dir.join("snapshot.json");
    let bytes = std::fs::read(&json).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            SnapshotError::NotFound {
                tag: tag_or_id.to_string(),
            }
        } else {
            SnapshotError::Unreadable {
                path: json.clone(),
                source,
            }
        }
    })?;
    Ok(serde_json::from_slice(&bytes)
        .map_err(|source| SnapshotError::Corrupt { path: json, source })?)
}

/// When each phase of one child's start finished, in ms from its start.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChildTimings {
    /// QEMU started and its QMP and agent sockets connected.
    pub process_ms: u64,
    /// Device state loaded (migration-in completed); still paused.
    pub restored_ms: u64,
    /// vCPUs running.
    pub resumed_ms: u64,
    /// The agent answered (identity applied).
    pub ready_ms: u64,
}

/// Starts QEMU for one child of `src` and loads its state; the child is
/// left paused. On failure nothing of it is left behind. A child of a
/// snapshot with volumes gets the snapshot's host folders.
pub async fn restore_paused(
    paths: &Paths,
    src: &Source,
    id: &str,
    lifetime: Lifetime,
    timings: &mut ChildTimings,
) -> Result<Vm> {
    restore_paused_with(paths, src, id, lifetime, &src.config.volumes, timings).await
}

/// The volumes of a child of a snapshot recorded with `recorded`: each
/// entry of `rebind` gives one of the snapshot's guest paths another host
/// folder (or another mode); the rest keep the snapshot's. A child cannot
/// gain a volume: its devices are its snapshot's.
pub fn child_volumes(recorded: &[Volume], rebind: &[Volume]) -> Result<Vec<Volume>> {
    let mut out = recorded.to_vec();
    for r in rebind {
        let Some(slot) = out.iter_mut().find(|v| v.guest_path == r.guest_path) else {
            let have: Vec<&str> = recorded.iter().map(|v| v.guest_path.as_str()).collect();
            return Err(SnapshotError::BadSpec(if have.is_empty() {
                format!(
                    "volume {:?}: this snapshot has no volumes, and a child can only rebind its snapshot's; take the snapshot with --volume",
                    r.guest_path
                )
            } else {
                format!(
                    "volume {:?}: a child can only rebind its snapshot's guest paths ({}); take the snapshot with a volume there",
                    r.guest_path,
                    have.join(", ")
                )
            })
            .into());
        };
        *slot = r.clone();
    }
    Ok(out)
}

/// Where a child with volumes gets its shared RAM: a directory of its own
/// on tmpfs (`$FORKD_RAM_DIR`, default `/dev/shm/forkd-ram`), removed as
/// soon as QEMU has mapped the file.
pub fn shared_ram_dir(id: &str) -> PathBuf {
    let base = std::env::var_os("FORKD_RAM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm/forkd-ram"));
    base.join(id)
}

/// Removes a child's shared RAM directory when dropped (QEMU keeps its
/// mapping; the memory is freed when QEMU exits).
pub struct RamDir(pub Option<PathBuf>);

impl Drop for RamDir {
    fn drop(&mut self) {
        if let Some(d) = self.0.take() {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// [`restore_paused`] with the child's own volumes (see [`child_volumes`]).
/// vhost-user cannot serve a private copy-on-write mapping, so a child
/// with volumes gets a shared copy of the snapshot's RAM on tmpfs (zero
/// pages skipped): its restore costs that copy (docs/volumes.md).
pub async fn restore_paused_with(
    paths: &Paths,
    src: &Source,
    id: &str,
    lifetime: Lifetime,
    volumes: &[Volume],
    timings: &mut ChildTimings,
) -> Result<Vm> {
    let t0 = Instant::now();
    if volumes.len() != src.config.machine.volumes as usize {
        return Err(SnapshotError::BadSpec(format!(
            "snapshot has {} volume devices, {} volumes given",
            src.config.machine.volumes,
            volumes.len()
        ))
        .into());
    }
    let mut ram_dir = RamDir(None);
    let mut vmstate = src.vmstate();
    let memory = if volumes.is_empty() {
        Memory::Private(src.memory())
    } else {
        let dir = shared_ram_dir(id);
        forkd_vmm::private::create_dir_all(&dir)?;
        ram_dir.0 = Some(dir.clone());
        let (from, to) = (src.memory(), dir.join(MEMORY));
        let size = src.config.machine.mem_mib << 20;
        let dst = to.clone();
        tokio::task::spawn_blocking(move || forkd_vmm::volume::copy_ram(&from, &dst, size))
            .await??;
        // The jailed QEMU sees this directory, not the snapshot's: the
        // (small) device state goes beside the RAM, readable by the jail's
        // group through the directory it is given (0710).
        let state = dir.join(VMSTATE);
        std::fs::copy(src.vmstate(), &state)?;
        forkd_vmm::set_owner(&state, 0, forkd_vmm::JailConfig::get()?.gid, 0o640)?;
        vmstate = state;
        Memory::Shared(to)
    };
    // A networked snapshot's child gets its own namespace; Vm::start owns
    // it from here (torn down if the start fails, else with the VM).
    let nic = if src.config.machine.net {
        let n = forkd_vmm::net::create_child(&paths.home, id).await?;
        Some(Nic {
            netns: n.netns.clone(),
            child: Some(n),
        })
    } else {
        None
    };
    let spec = StartSpec {
        id: id.to_string(),
        machine: src.config.machine.clone(),
        memory,
        boot: Boot::Incoming,
        disk: DiskBase::Snapshot {
            path: src.rootfs(),
            size: src.rootfs_size,
        },
        lifetime,
        nic,
        volumes: volumes.to_vec(),
    };
    let narrow = volumes.is_empty().then(|| {
        (
            src.memory(),
            forkd_fs::readahead_lock_path(&paths.mount_dir()),
        )
    });
    let vm = Vm::start(VmDir::new(paths.vm_dir(id)), spec, async |vm: &mut Vm| {
        timings.process_ms = ms(t0.elapsed());
        if let Some((memory, lock)) = narrow.clone() {
            let pid = vm.pid();
            // Blocking: a lock another restore may hold, stats over FUSE.
            let _ =
                tokio::task::spawn_blocking(move || narrow_memory_readahead(pid, &memory, &lock))
                    .await;
        }
        vm.load_state(&vmstate)
            .await
            .map_err(|e| e.context(format!("QEMU log:\n{}", vm.dir.qemu_log_tail(10))))?;
        timings.restored_ms = ms(t0.elapsed());
        Ok(())
    })
    .await;
    drop(ram_dir);
    vm
}

/// Gives QEMU's open `memory.bin` (a private mapping of the snapshot's on
/// the mount) a chunk-sized readahead window before the first fault, so a
/// fault reads its neighbourhood, not the mount's 1 MiB: a lazy snapshot's
/// child fetches less from the hub before it answers, and a first restore
/// records a working set of what the guest touched. A failure costs only
/// that (logged).
fn narrow_memory_readahead(pid: u32, memory: &std::path::Path, lock: &std::path::Path) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let kib = forkd_vmm::readahead::MEMORY_READAHEAD_KIB;
    if let Err(e) = forkd_vmm::readahead::narrow(pid, memory, kib, lock) {
        let msg = format!(
            "{}: readahead left at the mount's ({e}); a child's page faults read up to 1 MiB around each page (more fetched from a hub, larger working sets)",
            memory.display()
        );
        // A missing capability is the same for every restore: once.
        let denied = e.kind() == std::io::ErrorKind::PermissionDenied;
        if denied && WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::debug!("{msg}");
        } else {
            tracing::warn!("{msg}");
        }
    }
}

/// Writes `policy` into a networked child's namespace unless it is the
/// one already there (a pooled child prepared with the default): the write
/// runs `nft`, the largest cost of a networked hand-out. A no-op without a
/// network. Safe on a paused child only: its guest sends nothing meanwhile.
pub async fn set_egress(vm: &mut Vm, policy: &forkd_net::EgressPolicy) -> Result<()> {
    let Some(net) = &vm.record.net else {
        return Ok(());
    };
    if vm.egress.as_ref() == Some(policy) {
        return Ok(());
    }
    forkd_vmm::net::apply_policy(net, policy).await?;
    vm.egress = Some(policy.clone());
    Ok(())
}

/// How much of its identity a child already has when it is handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Identity {
    /// None yet: a child restored on demand, or parked without a warm-up
    /// run. The hand-out gives it everything.
    Bare,
    /// Given while it was parked ([`give_identity`]): hostname, entropy,
    /// reseeded interpreter, resolv.conf. Its clock stood still while it
    /// was paused, so the hand-out sets the clock (and mixes in fresh
    /// entropy, one ioctl) and nothing else.
    Given,
}

/// Gives a running child its identity (fresh entropy, its hostname, a
/// reseeded interpreter and, when networked, resolv.conf) and the host's
/// clock. Used on a child being parked, which is then paused again: every
/// pooled child gets its own entropy, so no two are alike, and the costly
/// parts (the interpreter reseed runs Python) leave the hand-out.
pub async fn give_identity(vm: &Vm, hostname: &str) -> Result<()> {
    give_identity_with(vm, hostname, None).await
}

/// [`give_identity`], installing the CA certificates `ca` too.
async fn give_identity_with(vm: &Vm, hostname: &str, ca: Option<&CaBundle>) -> Result<()> {
    let nameservers = vm.record.net.is_some().then(forkd_vmm::net::nameservers);
    let pem = ca.map(CaBundle::pem);
    let r = vm
        .agent
        .identity_with(Some(hostname), nameservers, pem.as_deref(), READY_TIMEOUT)
        .await?;
    check_ca_installed(ca, r.ca_certs_installed)
}

/// Refuses a hand-out whose CAs the guest did not install: an agent older
/// than the `ca_certs` field ignores it.
fn check_ca_installed(ca: Option<&CaBundle>, installed: usize) -> Result<()> {
    match ca {
        Some(b) if installed != b.len() => Err(anyhow!(
            "the guest installed {installed} of {} CA certificates: its agent predates `ca_certs`; take the snapshot again from an image built with this forkd",
            b.len()
        )),
        _ => Ok(()),
    }
}

/// Resumes a restored child and completes its identity (see [`Identity`]):
/// all of it for a [`Identity::Bare`] child (fresh entropy, the host's
/// wall clock, its hostname, a reseeded interpreter), only the clock for an
/// [`Identity::Given`] one. Returns once the agent has answered. `t0` is
/// when this child's start began.
///
/// A networked child gets its egress `policy` (None: the configured
/// default) before its vCPUs run, and its resolv.conf with the identity.
/// Every child gets the configured CA certificates and `ca` (a spawn's)
/// with the identity or the clock ([`crate::ca::for_hand_out`]): a pooled
/// child gets them now, not when it was parked.
pub async fn hand_out(
    vm: &mut Vm,
    hostname: &str,
    identity: Identity,
    policy: Option<&forkd_net::EgressPolicy>,
    ca: Option<&CaBundle>,
    t0: Instant,
    timings: &mut ChildTimings,
) -> Result<()> {
    let ca = crate::ca::for_hand_out(ca);
    if vm.record.net.is_some() {
        let default = forkd_vmm::net::default_egress();
        set_egress(vm, policy.unwrap_or(&default)).await?;
    }
    vm.resume()
        .await
        .map_err(|e| e.context(format!("QEMU log:\n{}", vm.dir.qemu_log_tail(10))))?;
    timings.resumed_ms = ms(t0.elapsed());
    let pem = ca.as_ref().map(CaBundle::pem);
    let answered = match identity {
        Identity::Bare => give_identity_with(vm, hostname, ca.as_ref()).await,
        Identity::Given => match vm.agent.sync_clock(pem.as_deref(), READY_TIMEOUT).await {
            Ok(r) => check_ca_installed(ca.as_ref(), r.ca_certs_installed),
            Err(e) => Err(anyhow::Error::from(e)),
        },
    };
    answered.map_err(|e| {
        e.context(format!(
            "child {} did not become ready; console tail:\n{}",
            vm.id,
            vm.dir.console_tail(20)
        ))
    })?;
    timings.ready_ms = ms(t0.elapsed());
    Ok(())
}
