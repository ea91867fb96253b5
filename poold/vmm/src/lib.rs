//! forkd's VM runner: start QEMU jailed in a VM directory, talk to it over
//! QMP and to its agent, limit it with cgroups, and tear it down.
//!
//! This crate knows QEMU, the guest's devices and the host's process and
//! cgroup machinery. It must not know snapshots, the layer store's layout,
//! pools or the daemon: callers (`forkd-snapshot`, `poold`) say what to run
//! and where; this crate runs it and cleans up after it.
//!
//! Each VM owns a directory (`$FORKD_HOME/run/vms/<id>/`) holding its
//! sockets, console log, disk overlay and a `vm.json` record naming the QEMU
//! process and the process that owns it. Records let a later run prove which
//! leftovers are dead and sweep them.

#![warn(missing_docs)]

mod accel;
mod agent;
mod cgroup;
mod disk;
mod jail;
mod migrate;
pub mod net;
mod pageout;
pub mod private;
mod process;
mod qemu;
mod qmp;
pub mod readahead;
pub mod volume;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use accel::{kvm_usable, kvm_usable_in, Accel, AccelChoice};
pub use agent::{
    AgentClient, CallError, Events, Tunnel, Watch, WatchUpdate, MAX_UNREAD_BYTES,
    MAX_UNREAD_FRAMES, TUNNEL_WINDOW,
};
pub use cgroup::{Controller, Hierarchy, Limits};
pub use disk::{create_overlay_on, OverlayView};
pub use jail::{backing_chain, own as set_owner, JailConfig};
pub use pageout::{mem_use, meminfo_field, page_in, swap_total_kib, MemUse};
pub use process::ProcId;
pub use qemu::{
    check_qemu, kernel_cmdline, parse_version as parse_qemu_version, qemu_binary, qemu_version,
    volume_tag, Boot, Device, Launch, Machine, Memory, Nic, MACHINE_TYPE,
};
pub use qmp::{MigrationStatus, Qmp, RunState};
pub use volume::Volume;

/// Who is responsible for a VM's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lifetime {
    /// Dies with the process that started it (a CLI run): QEMU gets
    /// PR_SET_PDEATHSIG, and the directory is swept once the owner is gone.
    Ephemeral,
    /// Outlives its owner (the daemon), which re-adopts it after a restart.
    Detached,
}

/// The persistent record of one VM (`vm.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    /// VM id; also the VM directory's name.
    pub id: String,
    /// The QEMU process, by pid and start time so a reused pid is not mistaken for it.
    pub qemu: ProcId,
    /// The process responsible for the VM (see [`Lifetime`]); sweeps check whether it is still alive.
    pub owner: ProcId,
    /// Whether the VM dies with its owner or is re-adopted.
    pub lifetime: Lifetime,
    /// When the VM was started, seconds since the Unix epoch.
    pub created_at_unix: u64,
    /// The uid QEMU runs as when jailed (see [`jail`]); None when unjailed.
    #[serde(default)]
    pub jail_uid: Option<u32>,
    /// The child's network namespace and addresses (docs/network.md);
    /// torn down with the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<forkd_net::ChildNet>,
    /// The virtiofsd of each volume ([`volume`]); each exits with its
    /// QEMU's connection, and is killed with the VM besides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_daemons: Vec<ProcId>,
    /// The host folders behind its volume devices (a branch's collector
    /// serves the same ones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
}

/// Files of one VM directory.
#[derive(Debug, Clone)]
pub struct VmDir {
    /// The directory, `$FORKD_HOME/run/vms/<id>/`.
    pub path: PathBuf,
}

impl VmDir {
    /// Wraps an existing or to-be-made VM directory; touches nothing.
    pub fn new(path: PathBuf) -> VmDir {
        VmDir { path }
    }
    /// The one directory the jailed QEMU may create files in: its sockets.
    /// Everything else in the VM directory is root's (see [`jail`]).
    pub fn sock_dir(&self) -> PathBuf {
        self.path.join("sock")
    }
    /// QEMU's QMP socket.
    pub fn qmp(&self) -> PathBuf {
        self.sock_dir().join("qmp.sock")
    }
    /// The virtio-serial socket the guest agent is reached through.
    pub fn agent(&self) -> PathBuf {
        self.sock_dir().join("agent.sock")
    }
    /// The socket a branch collector receives its migration on.
    pub fn migrate_sock(&self) -> PathBuf {
        self.sock_dir().join("migrate.sock")
    }
    /// The guest's serial console output.
    pub fn console(&self) -> PathBuf {
        self.path.join("console.log")
    }
    /// QEMU's own stderr and log.
    pub fn qemu_log(&self) -> PathBuf {
        self.path.join("qemu.log")
    }
    /// The VM's private qcow2 disk overlay.
    pub fn disk(&self) -> PathBuf {
        self.path.join("disk.qcow2")
    }
    /// The vhost-user socket of volume `i`.
    pub fn volume_socket(&self, i: usize) -> PathBuf {
        self.sock_dir().join(format!("vol{i}.sock"))
    }
    /// The log of volume `i`'s virtiofsd.
    pub fn volume_log(&self, i: usize) -> PathBuf {
        self.path.join(format!("virtiofsd-{i}.log"))
    }
    /// The persistent record, `vm.json`.
    pub fn record(&self) -> PathBuf {
        self.path.join("vm.json")
    }

    /// Who made this directory: written before anything else in it, so a
    /// directory whose maker died before `vm.json` existed can be swept.
    pub fn owner_file(&self) -> PathBuf {
        self.path.join("owner.json")
    }

    /// Makes the directory atomically with its owner file: it is made
    /// under a name that carries this process's identity, then renamed.
    /// There is no instant at which a kill -9 leaves a directory that
    /// [`sweep`] cannot attribute.
    fn create(&self) -> Result<()> {
        let me = ProcId::current();
        let (parent, name) = match (self.path.parent(), self.path.file_name()) {
            (Some(p), Some(n)) => (p, n.to_string_lossy()),
            _ => bail!("VM directory {} has no parent", self.path.display()),
        };
        private::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        let tmp = parent.join(format!(
            "{NEW_DIR_PREFIX}{}-{}-{name}",
            me.pid, me.start_time
        ));
        private::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        private::write(&tmp.join("owner.json"), &serde_json::to_vec(&me)?)?;
        if let Err(e) = std::fs::rename(&tmp, &self.path) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e)
                .with_context(|| format!("creating {} (is the id in use?)", self.path.display()));
        }
        Ok(())
    }

    /// Reads and parses `vm.json`.
    pub fn read_record(&self) -> Result<VmRecord> {
        let text = std::fs::read(self.record())
            .with_context(|| format!("reading {}", self.record().display()))?;
        serde_json::from_slice(&text)
            .with_context(|| format!("parsing {}", self.record().display()))
    }

    fn write_record(&self, r: &VmRecord) -> Result<()> {
        let tmp = self.path.join("vm.json.tmp");
        crate::private::write(&tmp, &serde_json::to_vec_pretty(r)?)?;
        std::fs::rename(&tmp, self.record())?;
        Ok(())
    }

    /// The last `lines` lines of the console log, for error messages.
    pub fn console_tail(&self, lines: usize) -> String {
        tail(&self.console(), lines)
    }

    /// The last `lines` lines of QEMU's own log, for error messages.
    pub fn qemu_log_tail(&self, lines: usize) -> String {
        tail(&self.qemu_log(), lines)
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The read-only base a VM's private qcow2 disk overlay sits on.
#[derive(Debug, Clone)]
pub enum DiskBase {
    /// A built image (raw ext4); checked to exist before the overlay is made.
    Image(PathBuf),
    /// A snapshot's `rootfs.img` on the forkd-fs mount, whose size is known
    /// from the snapshot record (no `stat` through FUSE on the hot path).
    Snapshot {
        /// `MOUNT/by-id/<snapshot-id>/rootfs.img`.
        path: PathBuf,
        /// Its size in bytes, from the snapshot record.
        size: u64,
    },
}

/// What to start: everything but the VM's file paths, which come from its
/// directory ([`VmDir`]).
#[derive(Debug, Clone)]
pub struct StartSpec {
    /// VM id; its directory's name and QEMU's `-name`.
    pub id: String,
    /// The guest hardware; a child's must equal its snapshot's.
    pub machine: Machine,
    /// How guest RAM is backed.
    pub memory: Memory,
    /// Cold boot or incoming migration.
    pub boot: Boot,
    /// What the disk overlay is created on.
    pub disk: DiskBase,
    /// Whether the VM dies with this process or outlives it.
    pub lifetime: Lifetime,
    /// The guest NIC's namespace (and child network, which the VM then
    /// owns); None for a machine without a NIC or a parent's isolated one.
    pub nic: Option<qemu::Nic>,
    /// The host folder behind each of `machine.volumes` devices, in order.
    pub volumes: Vec<Volume>,
}

/// Removes a VM directory, and tears down the child network it was given,
/// when dropped unless disarmed: a start that fails, panics or is cancelled
/// leaves neither behind. Once QEMU runs, its record owns the network and
/// [`Vm::destroy`] tears it down.
struct StartGuard<'a> {
    dir: Option<&'a Path>,
    net: Option<forkd_net::ChildNet>,
}

impl Drop for StartGuard<'_> {
    fn drop(&mut self) {
        if let Some(n) = self.net.take() {
            // forkd_net runs its netlink work on its own thread: safe here.
            if let Err(e) = forkd_net::teardown(&n) {
                tracing::warn!("tearing down network {}: {e}", n.netns);
            }
        }
        if let Some(p) = self.dir {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// A running VM with its control channels.
pub struct Vm {
    /// VM id; also its directory's name.
    pub id: String,
    /// Its directory: sockets, logs, disk overlay, record.
    pub dir: VmDir,
    /// Its persistent record, as written to `vm.json`.
    pub record: VmRecord,
    /// QMP connection to its QEMU.
    pub qmp: Qmp,
    /// Channel to its guest agent.
    pub agent: AgentClient,
    /// The egress policy last written into its child network, if known
    /// (None: the deny-all a network is created with, or unknown after an
    /// adoption), so a hand-out with the same policy skips the write.
    pub egress: Option<forkd_net::EgressPolicy>,
    child: Option<process::Spawned>,
    /// Threads waiting for the virtiofsd processes this process started.
    reapers: Vec<std::thread::JoinHandle<()>>,
}

impl Vm {
    /// The one way a VM is started: makes its directory `dir` and disk
    /// overlay, starts QEMU, then runs `init` on it (load a snapshot's
    /// state, wait for the agent, arm a migration). If anything fails, QEMU
    /// is destroyed and the directory removed: nothing of the VM is left.
    pub async fn start<F>(dir: VmDir, spec: StartSpec, init: F) -> Result<Vm>
    where
        F: AsyncFnOnce(&mut Vm) -> Result<()>,
    {
        let mut guard = StartGuard {
            dir: Some(&dir.path),
            net: spec.nic.as_ref().and_then(|n| n.child.clone()),
        };
        dir.create()?;
        match &spec.disk {
            DiskBase::Image(base) => disk::create_overlay(base, &dir.disk()).await?,
            DiskBase::Snapshot { path, size } => {
                disk::create_overlay_unchecked(path, *size, &dir.disk()).await?
            }
        }
        let launch = Launch {
            name: spec.id.clone(),
            machine: spec.machine,
            memory: spec.memory,
            boot: spec.boot,
            disk: dir.disk(),
            qmp_socket: dir.qmp(),
            agent_socket: dir.agent(),
            console_log: dir.console(),
            nic: spec.nic,
            volume_sockets: (0..spec.volumes.len())
                .map(|i| dir.volume_socket(i))
                .collect(),
        };
        if spec.volumes.len() != launch.machine.volumes as usize {
            bail!(
                "the machine has {} volume devices but {} volumes were given",
                launch.machine.volumes,
                spec.volumes.len()
            );
        }
        let mut vm =
            Vm::spawn_with(&spec.id, dir.clone(), &launch, spec.lifetime, &spec.volumes).await?;
        guard.net = None;
        if let Err(e) = init(&mut vm).await {
            vm.destroy().await;
            return Err(e);
        }
        guard.dir = None;
        Ok(vm)
    }

    /// Starts QEMU for `launch` in `dir` (which must exist and hold the disk
    /// overlay) and connects QMP and the agent socket. The guest may still be
    /// booting (or paused, for an incoming restore) when this returns.
    pub async fn spawn(id: &str, dir: VmDir, launch: &Launch, lifetime: Lifetime) -> Result<Vm> {
        Self::spawn_with(id, dir, launch, lifetime, &[]).await
    }

    /// [`Vm::spawn`] with the host folders behind `launch`'s volume
    /// devices: a virtiofsd is started for each before QEMU.
    pub async fn spawn_with(
        id: &str,
        dir: VmDir,
        launch: &Launch,
        lifetime: Lifetime,
        volumes: &[Volume],
    ) -> Result<Vm> {
        let jail_cfg = jail::JailConfig::get()?;
        let binary = jail::resolve_binary(&qemu::qemu_binary())?;
        crate::private::create_dir_all(&dir.sock_dir())?;
        for s in [&launch.qmp_socket, &launch.agent_socket] {
            crate::check_socket_path(s)?;
            let _ = std::fs::remove_file(s);
        }
        let log = crate::private::create(&dir.qemu_log())?;
        let mut cmd = std::process::Command::new(&binary);
        // argv[0] stays the plain name, as tools that find QEMUs expect.
        std::os::unix::process::CommandExt::arg0(&mut cmd, qemu::qemu_binary());
        cmd.args(launch.args())
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // The network namespace goes first, while the process still has
        // CAP_SYS_ADMIN and CAP_NET_ADMIN; the fd is closed once spawned.
        let _netns = enter_netns(&mut cmd, launch)?;
        // The jail goes next: PR_SET_PDEATHSIG is cleared by a uid change.
        let claim = if jail_cfg.enabled {
            Some(prepare_jail(&dir, launch, jail_cfg, &mut cmd, &binary)?)
        } else {
            None
        };
        let ephemeral = lifetime == Lifetime::Ephemeral;
        // Under TCG, QEMU's anonymous memory (translated code, heap, thread
        // arenas) gains nothing from transparent huge pages but rounds what
        // each paused child holds up to 2 MiB pieces: 2.4 MiB per pooled
        // child measured (docs/BENCHMARKS.md). Nor does QEMU's huge-page
        // advice on guest RAM, which only makes each fault on memory.bin
        // read a 2 MiB block (`process::refuse_hugepage_advice`). KVM keeps
        // both (guest RAM backed by huge pages is faster there).
        let no_thp = launch.machine.accel == Accel::Tcg;
        let mut backends = match start_backends(&dir, launch, volumes, &claim, ephemeral) {
            Ok(b) => b,
            Err(e) => {
                if let Some(c) = &claim {
                    c.release();
                }
                return Err(e);
            }
        };
        let kill_backends = |backends: &mut Vec<volume::Backend>| {
            for b in backends.iter_mut() {
                let _ = b.child.kill();
                let _ = b.child.wait();
            }
        };
        // SAFETY: setsid, prctl, close_range and fcntl are
        // async-signal-safe. This hook runs last, after the tap was put at
        // TAP_FD: QEMU keeps stdio and its tap and no other fd of poold's
        // (nor any poold inherited from whoever started it).
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(move || {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                if ephemeral && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if no_thp {
                    if libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    process::refuse_hugepage_advice()?;
                }
                process::cloexec_range(3, qemu::TAP_FD as u32 - 1);
                process::cloexec_range(qemu::TAP_FD as u32 + 1, u32::MAX);
                Ok(())
            });
        }
        let mut child = match process::spawn(cmd).await {
            Ok(c) => c,
            Err(e) => {
                kill_backends(&mut backends);
                if let Some(c) = &claim {
                    c.release();
                }
                return Err(e).with_context(|| {
                    format!(
                        "starting {} (is QEMU >= 10 installed? run scripts/setup.sh; \
                         a jail error names the path it could not set up)",
                        binary.display()
                    )
                });
            }
        };
        let pid = child.id();
        let record = VmRecord {
            id: id.to_string(),
            qemu: ProcId::of(pid).unwrap_or(ProcId { pid, start_time: 0 }),
            owner: ProcId::current(),
            lifetime,
            created_at_unix: crate::unix_now(),
            jail_uid: claim.as_ref().map(|c| c.uid),
            net: launch.nic.as_ref().and_then(|n| n.child.clone()),
            volume_daemons: backends
                .iter()
                .map(|b| {
                    let pid = b.child.id();
                    ProcId::of(pid).unwrap_or(ProcId { pid, start_time: 0 })
                })
                .collect(),
            volumes: volumes.to_vec(),
        };
        let connect = async {
            dir.write_record(&record)?;
            let qmp = Qmp::connect(&launch.qmp_socket, Duration::from_secs(10)).await?;
            let agent = AgentClient::connect(&launch.agent_socket, Duration::from_secs(10)).await?;
            Ok::<_, anyhow::Error>((qmp, agent))
        };
        let started = tokio::select! {
            r = connect => r,
            status = child.wait() => Err(anyhow!("QEMU exited during start-up ({})", status.map(|s| s.to_string()).unwrap_or_default())),
        };
        let (qmp, agent) = match started {
            Ok(c) => c,
            Err(e) => {
                // Killed and reaped (no zombie), its uid free again.
                child.start_kill();
                let _ = child.wait().await;
                kill_backends(&mut backends);
                if let Some(c) = &claim {
                    c.release();
                }
                let vlog = (0..volumes.len())
                    .map(|i| tail(&dir.volume_log(i), 5))
                    .collect::<Vec<_>>()
                    .join("\n");
                return Err(e.context(format!(
                    "QEMU log:\n{}{}",
                    tail(&dir.qemu_log(), 20),
                    if vlog.trim().is_empty() {
                        String::new()
                    } else {
                        format!("\nvirtiofsd log:\n{vlog}")
                    }
                )));
            }
        };
        // Each is reaped when it exits (with QEMU's connection): no zombie.
        let reapers = backends
            .into_iter()
            .map(|mut b| {
                std::thread::spawn(move || {
                    let _ = b.child.wait();
                })
            })
            .collect();
        Ok(Vm {
            id: id.to_string(),
            dir,
            record,
            qmp,
            agent,
            egress: None,
            child: Some(child),
            reapers,
        })
    }

    /// A QEMU that does not answer within this long is given up (and
    /// killed by poold): as long as a QMP command may take, since a loaded
    /// host (or a VM stalled for a moment) is no reason to kill a sandbox.
    pub const ADOPT_TIMEOUT: Duration = Duration::from_secs(30);

    /// Re-attaches to a VM started by an earlier process (after a daemon
    /// restart): reconnects QMP and the agent socket.
    /// The record then names this process as the owner.
    pub async fn adopt(dir: VmDir) -> Result<Vm> {
        let mut record = dir.read_record()?;
        if !record.qemu.is_alive() {
            bail!("VM {}: QEMU pid {} is gone", record.id, record.qemu.pid);
        }
        let qmp = Qmp::connect(&dir.qmp(), Self::ADOPT_TIMEOUT).await?;
        let agent = AgentClient::connect(&dir.agent(), Self::ADOPT_TIMEOUT).await?;
        record.owner = ProcId::current();
        dir.write_record(&record)?;
        Ok(Vm {
            id: record.id.clone(),
            dir,
            record,
            qmp,
            agent,
            egress: None,
            child: None,
            reapers: Vec::new(),
        })
    }

    /// Pid of its QEMU process.
    pub fn pid(&self) -> u32 {
        self.record.qemu.pid
    }

    /// Asks the kernel to move the memory this VM's QEMU alone holds to
    /// swap (a paused, parked child's: pools with `page_out`). Returns the
    /// bytes of address space advised.
    pub async fn page_out(&self) -> Result<u64> {
        let qemu = self.record.qemu;
        tokio::task::spawn_blocking(move || pageout::page_out(&qemu)).await?
    }

    /// Every host process serving this VM: its QEMU, then each volume's
    /// virtiofsd and the sandboxed child virtiofsd forks for itself (what
    /// a sandbox's cgroup must hold). Processes already gone are left out.
    pub fn pids(&self) -> Vec<u32> {
        let mut v = vec![self.record.qemu.pid];
        for d in self.record.volume_daemons.iter().filter(|d| d.is_alive()) {
            v.push(d.pid);
            let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", d.pid))
                .unwrap_or_default();
            v.extend(
                children
                    .split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
        v
    }

    /// Waits until the agent answers, failing early if QEMU dies; errors carry
    /// the console tail.
    pub async fn wait_agent(
        &mut self,
        timeout: Duration,
    ) -> Result<rootfs_init::protocol::PingResult> {
        let ready = self.agent.wait_ready(timeout);
        let res = match self.child.as_mut() {
            Some(child) => tokio::select! {
                r = ready => r,
                s = child.wait() => Err(anyhow!("QEMU exited ({})", s.map(|s| s.to_string()).unwrap_or_default())),
            },
            None => ready.await,
        };
        res.map_err(|e| {
            e.context(format!(
                "VM {} did not become ready; console tail:\n{}\nQEMU log:\n{}",
                self.id,
                self.dir.console_tail(25),
                tail(&self.dir.qemu_log(), 10)
            ))
        })
    }

    /// Stops QEMU at once (SIGKILL) and removes the VM directory.
    pub async fn destroy(mut self) {
        self.kill_now().await;
        for d in &self.record.volume_daemons {
            kill_backend(d).await;
        }
        // Reaped by their threads before this returns (a `forkd run` exits
        // right after): nothing is left for init to collect.
        let reapers = std::mem::take(&mut self.reapers);
        let _ = tokio::task::spawn_blocking(move || {
            for r in reapers {
                let _ = r.join();
            }
        })
        .await;
        if let Some(n) = self.record.net.take() {
            net::teardown(n).await;
        }
        let _ = std::fs::remove_dir_all(&self.dir.path);
        if let Some(uid) = self.record.jail_uid {
            jail::UidClaim::release_for(uid, &self.dir.path);
        }
    }

    /// Hands a file poold made for this VM (a disk overlay, a vmstate to
    /// write) to its jailed QEMU: owned by its uid, mode 0600. A no-op for
    /// an unjailed VM.
    pub fn give(&self, path: &Path) -> Result<()> {
        match self.record.jail_uid {
            Some(uid) => jail::own(path, uid, jail::JailConfig::get()?.gid, 0o600),
            None => Ok(()),
        }
    }

    /// Stops QEMU at once (SIGKILL) and waits for it; the VM directory stays.
    pub async fn kill_now(&mut self) {
        match self.child.as_mut() {
            Some(c) => {
                c.start_kill();
                let _ = c.wait().await;
            }
            None => kill_proc(&self.record.qemu).await,
        }
    }

    /// Waits for QEMU to exit by itself (e.g. after a guest power-off).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<()> {
        let wait = async {
            match self.child.as_mut() {
                Some(c) => {
                    let _ = c.wait().await;
                }
                None => {
                    while self.record.qemu.is_alive() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| anyhow!("VM {} did not exit within {timeout:?}", self.id))
    }
}

/// Claims a uid for the VM in `dir`, hands it the files it writes, and
/// makes `cmd` enter a jail holding exactly what `launch` needs (see
/// [`jail`] for the invariants). On failure the claim is released.
fn prepare_jail(
    dir: &VmDir,
    launch: &Launch,
    cfg: &jail::JailConfig,
    cmd: &mut std::process::Command,
    binary: &Path,
) -> Result<jail::UidClaim> {
    let claim = jail::UidClaim::acquire(cfg, &dir.path)?;
    let r = jail_spec(dir, launch, cfg, claim.uid).and_then(|spec| jail::apply(cmd, &spec, binary));
    if r.is_err() {
        claim.release();
    }
    r.map(|()| claim)
}

fn jail_spec(
    dir: &VmDir,
    launch: &Launch,
    cfg: &jail::JailConfig,
    uid: u32,
) -> Result<jail::JailSpec> {
    use jail::{own, Bind};
    let gid = cfg.gid;
    // Root's directory: QEMU may traverse it and use the files it owns.
    own(&dir.path, 0, gid, 0o710)?;
    own(&dir.sock_dir(), uid, gid, 0o700)?;
    create_file(&launch.console_log)?;
    own(&launch.console_log, uid, gid, 0o600)?;
    own(&launch.disk, uid, gid, 0o600)?;
    let mut binds = vec![Bind::rw(&dir.path)];
    for f in jail::backing_chain(&launch.disk)?.into_iter().skip(1) {
        if f.starts_with(&dir.path) {
            own(&f, uid, gid, 0o600)?;
        } else {
            jail::grant_group_read(&f, gid)?;
            binds.push(Bind::ro(f));
        }
    }
    match &launch.memory {
        Memory::Anonymous => {}
        Memory::Shared(p) => {
            // A parent's or collector's RAM, in a staging directory of root's.
            create_file(p)?;
            own(p, uid, gid, 0o600)?;
            let parent = p.parent().context("memory file without a directory")?;
            own(parent, 0, gid, 0o710)?;
            binds.push(Bind::rw(parent));
        }
        // A child's RAM and vmstate: the snapshot's directory on forkd-fs.
        Memory::Private(p) => binds.push(Bind::ro(
            p.parent().context("memory file without a directory")?,
        )),
    }
    if let Boot::Kernel { kernel, initrd, .. } = &launch.boot {
        for f in [kernel, initrd] {
            jail::grant_group_read(f, gid)?;
            binds.push(Bind::ro(f));
        }
    }
    let mut devices: Vec<PathBuf> = ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"]
        .iter()
        .map(PathBuf::from)
        .collect();
    let mut groups = Vec::new();
    if launch.machine.accel == accel::Accel::Kvm {
        use std::os::unix::fs::MetadataExt;
        let kvm = Path::new("/dev/kvm");
        let m = std::fs::metadata(kvm).context("KVM was chosen but /dev/kvm is missing")?;
        groups.push(m.gid());
        devices.push(kvm.to_path_buf());
    }
    // A networked QEMU gets its tap as an open descriptor: no /dev/net/tun.
    Ok(jail::JailSpec {
        uid,
        gid,
        groups,
        root: PathBuf::from("/run/forkd/jail-root"),
        binds: jail::minimize(binds),
        devices,
    })
}

/// Makes each volume's listening socket (owned by the VM's uid when
/// jailed) and starts its virtiofsd on it.
fn start_backends(
    dir: &VmDir,
    launch: &Launch,
    volumes: &[Volume],
    claim: &Option<jail::UidClaim>,
    ephemeral: bool,
) -> Result<Vec<volume::Backend>> {
    let owner = match claim {
        Some(c) => Some((c.uid, jail::JailConfig::get()?.gid)),
        None => None,
    };
    let mut started: Vec<volume::Backend> = Vec::new();
    let r = (|| {
        for (i, v) in volumes.iter().enumerate() {
            let sock = &launch.volume_sockets[i];
            let l = volume::listen(sock, owner)?;
            started.push(volume::start_backend(
                v,
                l,
                &dir.volume_log(i),
                &dir.path,
                ephemeral,
            )?);
        }
        Ok(())
    })();
    if let Err(e) = r {
        for b in started.iter_mut() {
            let _ = b.child.kill();
            let _ = b.child.wait();
        }
        return Err(e);
    }
    Ok(started)
}

/// Puts the QEMU of `launch` in a network namespace between fork and exec:
/// the child's namespace (holding the tap it gets as [`qemu::TAP_FD`]) for a
/// networked child, an isolated one holding only a tap for any other VM
/// with a NIC (a parent, a branch collector), a fresh empty one otherwise (QEMU never needs the host's
/// network: its sockets are unix sockets on the filesystem). Returns the
/// namespace's file, to keep open until the process is spawned.
fn enter_netns(cmd: &mut std::process::Command, launch: &Launch) -> Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    match (&launch.nic, launch.machine.net) {
        (nic, true) => {
            let ns = match nic {
                Some(nic) => forkd_net::netns_open(&nic.netns)
                    .with_context(|| format!("the network namespace of VM {}", launch.name))?,
                // A parent or a branch collector: its NIC needs a tap but no
                // network. The namespace's name is dropped at once; the open
                // file keeps it until QEMU is inside, and QEMU until it exits.
                None => {
                    let name = format!("{}{}", forkd_net::BOOT_NETNS_PREFIX, launch.name);
                    forkd_net::create_isolated(&name)?;
                    let ns = forkd_net::netns_open(&name);
                    let _ = forkd_net::delete_isolated(&name);
                    ns?
                }
            };
            let fd = ns.as_raw_fd();
            // SAFETY: open_tap_in makes only async-signal-safe system calls
            // on `fd`, which stays open in the parent until spawn returns.
            unsafe {
                cmd.pre_exec(move || forkd_net::open_tap_in(fd, qemu::TAP_FD));
            }
            Ok(Some(ns))
        }
        (_, false) => {
            // SAFETY: unshare is async-signal-safe.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::unshare(libc::CLONE_NEWNET) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            Ok(None)
        }
    }
}

/// Creates an empty file unless it exists (never following a symlink).
fn create_file(p: &Path) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(crate::private::FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(p)
        .map(drop)
        .with_context(|| format!("creating {}", p.display()))
}

/// SIGKILLs a process we did not spawn (after checking it is still the same
/// process) and waits for it to disappear.
pub async fn kill_proc(p: &ProcId) {
    if !p.is_alive() {
        return;
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p.pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    for _ in 0..500 {
        if !p.is_alive() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Kills a volume's virtiofsd: its sandboxed child first, which the
/// virtiofsd process reaps before it exits itself, then that process
/// (killing only the parent would leave the child to init).
async fn kill_backend(p: &ProcId) {
    if !p.is_alive() {
        return;
    }
    let children =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", p.pid)).unwrap_or_default();
    for c in children
        .split_whitespace()
        .filter_map(|c| c.parse::<i32>().ok())
    {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    for _ in 0..50 {
        if !p.is_alive() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    kill_proc(p).await;
}

/// A VM directory being made: `.new-PID-START-ID` (see `VmDir::create`).
const NEW_DIR_PREFIX: &str = ".new-";

/// Removes VM directories whose owner is provably gone: ephemeral VMs whose
/// owner process died (their QEMU is killed if it somehow survived),
/// directories whose maker died before their record was written, and
/// unattributable directories older than a minute. Detached VMs are left to
/// their daemon. Returns the names swept.
pub async fn sweep(vms_dir: &Path) -> Vec<String> {
    let mut swept = Vec::new();
    let Ok(rd) = std::fs::read_dir(vms_dir) else {
        return swept;
    };
    for ent in rd.flatten() {
        let dir = VmDir::new(ent.path());
        let name = ent.file_name().to_string_lossy().into_owned();
        let gone = match (dir.read_record(), maker(&dir, &name)) {
            (Ok(r), _) if r.lifetime == Lifetime::Ephemeral && !r.owner.is_alive() => {
                kill_proc(&r.qemu).await;
                for d in &r.volume_daemons {
                    kill_backend(d).await;
                }
                if let Some(n) = r.net {
                    net::teardown(n).await;
                }
                true
            }
            (Ok(_), _) => false,
            (Err(_), Some(maker)) if !maker.is_alive() => {
                // Killed between starting QEMU and writing vm.json: the
                // QEMU runs, and only its command line names the dir.
                kill_qemus_naming(&ent.path()).await;
                true
            }
            (Err(_), Some(_)) => false,
            (Err(_), None) => older_than(&ent.path(), Duration::from_secs(60)),
        };
        if !gone {
            continue;
        }
        if std::fs::remove_dir_all(ent.path()).is_ok() {
            swept.push(name);
        }
    }
    swept
}

/// SIGKILLs every QEMU whose command line names a path inside `dir`.
async fn kill_qemus_naming(dir: &Path) {
    let needle = format!("{}/", dir.display());
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        let backend_of_dir = cmd.starts_with("virtiofsd")
            && std::fs::read(e.path().join("environ")).is_ok_and(|env| {
                env.split(|b| *b == 0)
                    .any(|kv| kv == format!("FORKD_VM_DIR={}", dir.display()).as_bytes())
            });
        if (cmd.starts_with("qemu-system") && cmd.contains(&needle)) || backend_of_dir {
            if let Some(p) = ProcId::of(pid) {
                tracing::warn!(
                    "killing QEMU pid {pid} of {}: it was never recorded",
                    dir.display()
                );
                kill_proc(&p).await;
            }
        }
    }
}

/// The process that made a record-less VM directory: from its name while
/// it is being made, from its owner file after.
fn maker(dir: &VmDir, name: &str) -> Option<ProcId> {
    if let Some(rest) = name.strip_prefix(NEW_DIR_PREFIX) {
        let mut it = rest.splitn(3, '-');
        let pid = it.next()?.parse().ok()?;
        let start_time = it.next()?.parse().ok()?;
        return Some(ProcId { pid, start_time });
    }
    serde_json::from_slice(&std::fs::read(dir.owner_file()).ok()?).ok()
}

fn older_than(p: &Path, age: Duration) -> bool {
    std::fs::metadata(p)
        .and_then(|m| m.modified())
        .map(|t| t.elapsed().unwrap_or_default() > age)
        .unwrap_or(false)
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Checks that a unix socket path fits in `sun_path` (108 bytes with NUL).
pub fn check_socket_path(p: &Path) -> anyhow::Result<()> {
    let len = p.as_os_str().len();
    if len >= 108 {
        anyhow::bail!(
            "socket path {} is {len} bytes, over the 107-byte unix socket limit; use a shorter FORKD_HOME",
            p.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod sweep_tests {
    use super::*;

    fn dead() -> ProcId {
        ProcId {
            start_time: ProcId::current().start_time + 1,
            ..ProcId::current()
        }
    }

    /// A kill -9 between making a VM directory and writing its record left
    /// the directory for a minute (and a restart's sweep kept it).
    #[tokio::test]
    async fn record_less_dirs_go_when_their_maker_is_gone() {
        let vms = tempfile::tempdir().unwrap();
        let mine = VmDir::new(vms.path().join("mine"));
        mine.create().unwrap();
        assert!(mine.owner_file().exists());
        let orphan = VmDir::new(vms.path().join("orphan"));
        orphan.create().unwrap();
        std::fs::write(orphan.owner_file(), serde_json::to_vec(&dead()).unwrap()).unwrap();
        let d = dead();
        let half_made = format!("{NEW_DIR_PREFIX}{}-{}-x", d.pid, d.start_time);
        std::fs::create_dir(vms.path().join(&half_made)).unwrap();
        let me = ProcId::current();
        let being_made = format!("{NEW_DIR_PREFIX}{}-{}-y", me.pid, me.start_time);
        std::fs::create_dir(vms.path().join(&being_made)).unwrap();

        // A QEMU started in the orphan dir whose record was never written.
        let mut unrecorded = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "exec -a qemu-system-x86_64 tail -F /dev/null {}/console.log",
                orphan.path.display()
            ))
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let cmdline = format!("/proc/{}/cmdline", unrecorded.id());
        for _ in 0..500 {
            if std::fs::read(&cmdline).is_ok_and(|c| c.starts_with(b"qemu-system")) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        let mut swept = sweep(vms.path()).await;
        swept.sort();
        assert_eq!(swept, vec![half_made, "orphan".to_string()]);
        assert!(mine.path.exists());
        assert!(vms.path().join(being_made).exists());
        let status = unrecorded.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
    }
}
