//! Finding, starting, recovering and unmounting forkd-fs mounts from other
//! processes (poold): [`ensure_mounted`] and [`unmount`].
//!
//! A mount is *live* when its control socket answers `status` for that
//! mount point. It is *stale* when the kernel still has a forkd-fs mount
//! there but no process serves it: `stat` fails with ENOTCONN (the daemon
//! died, e.g. `kill -9`, with nobody keeping its connection) or hangs (the
//! daemon is stuck, or its holder died and a keeper has not had a new one
//! adopt the connection yet; its FUSE connection is then aborted through
//! `/sys/fs/fuse/connections/<dev>/abort`). A stale
//! mount is detached lazily (`umount2(MNT_DETACH)`, or `fusermount3 -uz`)
//! and a fresh `forkd-fs mount` is started.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::control::{Client, Status};

/// Filesystem name in the mount table (`fsname=`).
pub const FSNAME: &str = "forkd-fs";
/// Filesystem subtype: mounts show as `fuse.forkd-fs`.
pub const SUBTYPE: &str = "forkd-fs";

/// How to reach (or start) the mount poold depends on.
#[derive(Debug, Clone, Default)]
pub struct MountConfig {
    /// Where the store is mounted.
    pub mountpoint: PathBuf,
    /// The layer store directory.
    pub store_dir: PathBuf,
    /// RocksDB secondary directory, private to the mount process; default
    /// [`default_secondary_dir`] (`<MOUNTPOINT>.secondary`).
    pub secondary_dir: Option<PathBuf>,
    /// Control socket; default [`default_control_socket`] (`<MOUNTPOINT>.sock`).
    pub control_socket: Option<PathBuf>,
    /// The `forkd-fs` binary; default: next to the current executable (or
    /// one level up from a cargo `deps/` dir), else `forkd-fs` on PATH.
    pub binary: Option<PathBuf>,
    /// The group that may read the mount (`forkd-fs mount --gid`): the VM
    /// jail's. None: root only. A live mount serving another group is
    /// remounted when unused, else refused.
    pub gid: Option<u32>,
    /// Do not fill lazy snapshots in the background (`--no-fill`): fetch
    /// only what reads need. Applies when this call starts the mount.
    pub no_fill: bool,
    /// How long a read of a lazy snapshot retries an unreachable hub
    /// (`--remote-deadline-secs`; default 120). Applies when this call
    /// starts the mount.
    pub remote_deadline_secs: Option<u64>,
}

impl MountConfig {
    /// A config with every default.
    pub fn new(mountpoint: impl Into<PathBuf>, store_dir: impl Into<PathBuf>) -> MountConfig {
        MountConfig {
            mountpoint: mountpoint.into(),
            store_dir: store_dir.into(),
            ..Default::default()
        }
    }

    /// The control socket in effect.
    pub fn control(&self) -> PathBuf {
        self.control_socket
            .clone()
            .unwrap_or_else(|| default_control_socket(&self.mountpoint))
    }
}

fn sibling(mountpoint: &Path, suffix: &str) -> PathBuf {
    let mut s = mountpoint.as_os_str().to_owned();
    while s.len() > 1 && s.to_string_lossy().ends_with('/') {
        s = std::ffi::OsString::from(s.to_string_lossy().trim_end_matches('/').to_string());
    }
    s.push(suffix);
    PathBuf::from(s)
}

/// `<MOUNTPOINT>.sock`: the default control socket, a sibling of the mount
/// point (never inside it).
pub fn default_control_socket(mountpoint: &Path) -> PathBuf {
    sibling(mountpoint, ".sock")
}

/// `<MOUNTPOINT>.readahead.lock`: whoever changes the mount's readahead
/// window holds it (forkd-fs setting it; poold narrowing one file's).
pub fn readahead_lock_path(mountpoint: &Path) -> PathBuf {
    sibling(mountpoint, ".readahead.lock")
}

/// Takes [`readahead_lock_path`] exclusively (blocking) until the result
/// is dropped.
pub fn readahead_lock(mountpoint: &Path) -> std::io::Result<nix::fcntl::Flock<std::fs::File>> {
    let f = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(readahead_lock_path(mountpoint))?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| std::io::Error::from(e))
}

/// `<MOUNTPOINT>.secondary`: the default RocksDB secondary directory.
pub fn default_secondary_dir(mountpoint: &Path) -> PathBuf {
    sibling(mountpoint, ".secondary")
}

/// The journal (`holder`, `journal`) of the mount held by process
/// `holder`: the control socket path with extension `.journal.<pid>`. One
/// per holder, so a mount detached lazily and still serving its open files
/// never shares one with the mount after it.
pub fn journal_path(control: &Path, holder: u32) -> PathBuf {
    control.with_extension(format!("journal.{holder}"))
}

/// Removes the journals of holders that are gone (killed: a holder that
/// ends removes its own).
pub fn remove_dead_journals(control: &Path) {
    let (Some(dir), Some(stem)) = (control.parent(), control.file_stem()) else {
        return;
    };
    let prefix = format!("{}.journal.", stem.to_string_lossy());
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(&prefix)
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        let gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            == Err(nix::errno::Errno::ESRCH);
        if gone {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Whether the mount a control socket answers for was detached (`umount
/// -l`): its device is no longer the one mounted at its mount point. It
/// serves the files still open until they close; the path is free for a
/// new mount. Unknown (no device reported, before holders did) is false.
pub fn is_detached(st: &Status) -> bool {
    let Some(dev) = &st.dev else {
        return false;
    };
    match mount_at(&st.mountpoint) {
        Ok(Some(e)) => &e.dev != dev,
        Ok(None) => true,
        Err(_) => false,
    }
}

/// The daemon's log file: the control socket path with extension `.log`.
pub fn log_path(control: &Path) -> PathBuf {
    control.with_extension("log")
}

fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        Ok(std::env::current_dir()?.join(p))
    }
}

/// One line of /proc/self/mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// `major:minor` of the mounted filesystem.
    pub dev: String,
    /// Where it is mounted.
    pub mountpoint: PathBuf,
    /// Filesystem type, e.g. `fuse.forkd-fs`.
    pub fstype: String,
    /// Mount source (the field after the type), `forkd-fs` for ours.
    pub source: String,
}

impl MountEntry {
    /// True for a forkd-fs FUSE mount.
    pub fn is_forkd_fs(&self) -> bool {
        self.fstype == format!("fuse.{SUBTYPE}") || (self.fstype == "fuse" && self.source == FSNAME)
    }
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            out.push(u8::from_str_radix(&s[i + 1..i + 4], 8).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(MountEntry {
                dev: f.get(2)?.to_string(),
                mountpoint: PathBuf::from(unescape(f.get(4)?)),
                fstype: r.first()?.to_string(),
                source: unescape(r.get(1).unwrap_or(&"")),
            })
        })
        .collect()
}

/// The top-most mount at `mountpoint` (exact path), if any.
pub fn mount_at(mountpoint: &Path) -> Result<Option<MountEntry>> {
    let text =
        std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    Ok(parse_mountinfo(&text)
        .into_iter()
        .rev()
        .find(|m| m.mountpoint == mountpoint))
}

/// `stat` of a path that may sit on a dead or hung FUSE mount.
#[derive(Debug, PartialEq, Eq)]
pub enum Probe {
    /// `stat` answered.
    Ok,
    /// ENOTCONN: nobody serves the mount any more.
    NotConnected,
    /// No answer within the timeout: the daemon is stuck.
    Hung,
    /// Any other error, as text.
    Other(String),
}

/// `statfs` of a mount point, on a helper thread so a hung FUSE daemon
/// cannot hang us. statfs always reaches the daemon (`stat` may be answered
/// from cached attributes for a while after the daemon died).
pub fn probe(path: &Path, timeout: Duration) -> Probe {
    let (tx, rx) = mpsc::channel();
    let p = path.to_path_buf();
    let _ = std::thread::Builder::new()
        .name("forkd-fs-probe".into())
        .spawn(move || {
            let _ = tx.send(nix::sys::statfs::statfs(&p));
        });
    match rx.recv_timeout(timeout) {
        Ok(Ok(_)) => Probe::Ok,
        Ok(Err(nix::errno::Errno::ENOTCONN)) => Probe::NotConnected,
        Ok(Err(e)) => Probe::Other(e.to_string()),
        Err(_) => Probe::Hung,
    }
}

/// `status` over the control socket, with a short timeout.
pub fn control_status(control: &Path, timeout: Duration) -> Result<Status> {
    Client::connect_timeout(control, timeout)?.status()
}

fn run_quiet(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed: {}",
            cmd.get_program(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Unmounts `mountpoint` (lazily with `lazy`: detached at once, freed when
/// the last user closes). Falls back to `fusermount3 -u` when not root.
pub fn sys_unmount(mountpoint: &Path, lazy: bool) -> std::io::Result<()> {
    let flags = if lazy {
        nix::mount::MntFlags::MNT_DETACH
    } else {
        nix::mount::MntFlags::empty()
    };
    match nix::mount::umount2(mountpoint, flags) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EPERM) => {
            let mut cmd = Command::new("fusermount3");
            cmd.arg(if lazy { "-uz" } else { "-u" }).arg(mountpoint);
            run_quiet(&mut cmd)
                .map_err(|e| std::io::Error::new(ErrorKind::PermissionDenied, e.to_string()))
        }
        Err(e) => Err(std::io::Error::from_raw_os_error(e as i32)),
    }
}

/// Aborts the FUSE connection of a mount (as root), failing every pending
/// and future request with ENOTCONN; used on a hung daemon.
pub fn abort_connection(entry: &MountEntry) -> Result<()> {
    let minor = entry
        .dev
        .split(':')
        .nth(1)
        .ok_or_else(|| anyhow!("bad device {} in mountinfo", entry.dev))?;
    let dir = Path::new("/sys/fs/fuse/connections");
    let p = dir.join(minor).join("abort");
    if !p.exists() {
        // fusectl is not always mounted (systemd usually does it).
        let _ = nix::mount::mount(
            Some("fusectl"),
            dir,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        );
    }
    std::fs::write(&p, b"1").with_context(|| format!("writing {}", p.display()))
}

/// Detaches a stale forkd-fs mount (aborting a hung connection first).
/// Running VMs that still map files of it get SIGBUS on their next fault in
/// of a page that was not cached: nothing can serve it any more.
pub fn recover_stale(mountpoint: &Path, entry: &MountEntry, hung: bool) -> Result<()> {
    if hung {
        if let Err(e) = abort_connection(entry) {
            // Detaching still frees the mount point; the hung connection
            // lingers until its daemon dies.
            tracing::warn!("could not abort the hung FUSE connection: {e:#}");
        }
    }
    sys_unmount(mountpoint, true).with_context(|| {
        format!(
            "detaching the stale forkd-fs mount at {}",
            mountpoint.display()
        )
    })?;
    tracing::warn!(mountpoint = %mountpoint.display(), hung, "detached a stale forkd-fs mount");
    Ok(())
}

/// What is at a mount point.
#[derive(Debug)]
pub enum State {
    /// No mount at that path.
    Free,
    /// A forkd-fs mount answering its control socket.
    Live(Box<Status>),
    /// A forkd-fs mount that serves files but whose control socket does not
    /// answer (another instance with a different `--control`, or starting).
    Silent,
    /// A forkd-fs mount nobody serves (or whose daemon hangs).
    Stale {
        /// The mount's line in mountinfo.
        entry: MountEntry,
        /// True when `statfs` did not answer (a hung daemon) rather than ENOTCONN.
        hung: bool,
    },
    /// Something else is mounted there.
    Foreign(MountEntry),
}

/// Classifies what is at `mountpoint` (absolute path).
pub fn state(mountpoint: &Path, control: &Path) -> Result<State> {
    let Some(entry) = mount_at(mountpoint)? else {
        return Ok(State::Free);
    };
    if !entry.is_forkd_fs() {
        return Ok(State::Foreign(entry));
    }
    if let Ok(st) = control_status(control, Duration::from_secs(2)) {
        let this_mount = st.dev.as_ref().is_none_or(|d| *d == entry.dev);
        if same_path(&st.mountpoint, mountpoint) && this_mount {
            return Ok(State::Live(Box::new(st)));
        }
    }
    Ok(match probe(mountpoint, Duration::from_secs(3)) {
        Probe::Ok => State::Silent,
        Probe::NotConnected => State::Stale { entry, hung: false },
        Probe::Hung => State::Stale { entry, hung: true },
        Probe::Other(_) => State::Stale { entry, hung: false },
    })
}

fn same_path(a: &Path, b: &Path) -> bool {
    a == b
        || a.canonicalize()
            .ok()
            .is_some_and(|a| Some(a) == b.canonicalize().ok())
}

/// The `forkd-fs` binary to start (see [`MountConfig::binary`]).
pub fn find_binary(explicit: Option<&Path>) -> PathBuf {
    if let Some(b) = explicit {
        return b.to_path_buf();
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            let mut dirs = vec![dir.to_path_buf()];
            if dir.file_name().is_some_and(|n| n == "deps") {
                dirs.extend(dir.parent().map(Path::to_path_buf));
            }
            for d in dirs {
                let c = d.join("forkd-fs");
                if c.is_file() {
                    return c;
                }
            }
        }
    }
    PathBuf::from("forkd-fs")
}

/// Makes sure a live forkd-fs serves `cfg.mountpoint`: returns at once if
/// its control socket answers; recovers a stale mount (daemon killed or
/// hung); otherwise starts `forkd-fs mount` (which returns once the mount
/// is live) and waits until it answers. Refuses to mount over a foreign
/// filesystem or a forkd-fs mount that serves files but no control socket.
pub fn ensure_mounted(cfg: &MountConfig) -> Result<()> {
    let mp = absolute(&cfg.mountpoint)?;
    let control = absolute(&cfg.control())?;
    // One caller at a time per mount point (threads of one process, or
    // poold and a CLI): two callers that both saw it free would each start
    // a daemon, and the loser's half-made mount could hide the winner's.
    let _lock = lock_mountpoint(&mp)?;
    ensure_mounted_locked(cfg, &mp, &control)
}

/// `<MOUNTPOINT>.lock`, held (flock) while a caller checks and starts the
/// mount. The kernel drops it when the holder dies, so a killed caller
/// never blocks the next.
fn lock_mountpoint(mp: &Path) -> Result<nix::fcntl::Flock<std::fs::File>> {
    let path = sibling(mp, ".lock");
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening the mount lock {}", path.display()))?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| anyhow!(e).context(format!("locking {}", path.display())))
}

fn ensure_mounted_locked(cfg: &MountConfig, mp: &Path, control: &Path) -> Result<()> {
    let (mp, control) = (mp.to_path_buf(), control.to_path_buf());
    match state(&mp, &control)? {
        State::Live(st) if st.gid == cfg.gid => return Ok(()),
        State::Live(st) => {
            // Served for another group (or by a forkd-fs from before
            // groups): remount with the right one if nothing is open.
            unmount(&mp).with_context(|| {
                format!(
                    "the forkd-fs mount at {} serves group {:?}, this caller needs {:?}; \
                     it must be remounted but is in use: stop the VMs using it, or unmount it",
                    mp.display(),
                    st.gid,
                    cfg.gid
                )
            })?;
            tracing::info!(mountpoint = %mp.display(), old = ?st.gid, new = ?cfg.gid, "remounting forkd-fs for another group");
        }
        State::Free => {}
        State::Stale { entry, hung } => {
            recover_stale(&mp, &entry, hung)?;
            if mount_at(&mp)?.is_some_and(|e| e.is_forkd_fs()) {
                // Stacked stale mounts (several kills in a row): peel them.
                return ensure_mounted_locked(cfg, &mp, &control);
            }
        }
        State::Silent => {
            // Perhaps starting: give it a moment.
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(st) = control_status(&control, Duration::from_secs(1)) {
                    if same_path(&st.mountpoint, &mp) {
                        return Ok(());
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            bail!(
                "a forkd-fs mount at {} serves files but its control socket {} does not answer; \
                 is another instance running with a different --control? Unmount it \
                 (`forkd-fs unmount {}`) and retry",
                mp.display(),
                control.display(),
                mp.display()
            );
        }
        State::Foreign(e) => bail!(
            "{} already has a {} filesystem mounted (source {}); refusing to mount forkd-fs over it",
            mp.display(),
            e.fstype,
            e.source
        ),
    }
    start(cfg, &mp, &control)
}

/// The `forkd-fs mount` command line for `cfg`'s mount at `mp` (a new
/// mount, or an adoption: `keeper::adopt` adds its own flag), and the
/// binary it runs.
pub(crate) fn mount_command(
    cfg: &MountConfig,
    mp: &Path,
    control: &Path,
) -> Result<(Command, PathBuf)> {
    let bin = find_binary(cfg.binary.as_deref());
    let mut cmd = Command::new(&bin);
    cmd.arg("mount")
        .arg(mp)
        .arg("--store")
        .arg(absolute(&cfg.store_dir)?)
        .arg("--control")
        .arg(control);
    if let Some(d) = &cfg.secondary_dir {
        cmd.arg("--secondary-dir").arg(absolute(d)?);
    }
    if let Some(g) = cfg.gid {
        cmd.arg("--gid").arg(g.to_string());
    }
    if cfg.no_fill {
        cmd.arg("--no-fill");
    }
    if let Some(d) = cfg.remote_deadline_secs {
        cmd.arg("--remote-deadline-secs").arg(d.to_string());
    }
    Ok((cmd, bin))
}

fn start(cfg: &MountConfig, mp: &Path, control: &Path) -> Result<()> {
    std::fs::create_dir_all(mp)
        .with_context(|| format!("creating mount point {}", mp.display()))?;
    let (mut cmd, bin) = mount_command(cfg, mp, control)?;
    let out = cmd.output().with_context(|| {
        format!(
            "starting {} (set MountConfig::binary, or put forkd-fs next to this program or on PATH)",
            bin.display()
        )
    })?;
    if !out.status.success() {
        // Lost a race with another caller starting the same mount?
        if let Ok(State::Live(_)) = state(mp, control) {
            return Ok(());
        }
        bail!(
            "`{} mount {}` failed ({}): {}",
            bin.display(),
            mp.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match control_status(control, Duration::from_secs(2)) {
            Ok(st) if same_path(&st.mountpoint, mp) => return Ok(()),
            Ok(st) => bail!(
                "{} answers for {}, not {}",
                control.display(),
                st.mountpoint.display(),
                mp.display()
            ),
            Err(e) if Instant::now() > deadline => {
                return Err(e.context(format!(
                    "forkd-fs started but does not answer on {}; see {}",
                    control.display(),
                    log_path(control).display()
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Unmounts a forkd-fs mount; its daemon then exits. Fails with EBUSY-style
/// advice while files are open (running VMs map them) — use
/// [`unmount_lazy`] to detach anyway. Unmounting a path with nothing
/// mounted succeeds. Waits (up to 10 s) for the daemon's control socket at
/// the default path to go quiet so a new mount can start right away.
pub fn unmount(mountpoint: &Path) -> Result<()> {
    unmount_with(mountpoint, false)
}

/// Detaches a forkd-fs mount now; processes that have its files open or
/// mapped keep them until they close, served by the old daemon, which then
/// exits.
pub fn unmount_lazy(mountpoint: &Path) -> Result<()> {
    unmount_with(mountpoint, true)
}

fn unmount_with(mountpoint: &Path, lazy: bool) -> Result<()> {
    let mp = absolute(mountpoint)?;
    let Some(entry) = mount_at(&mp)? else {
        return Ok(());
    };
    if !entry.is_forkd_fs() {
        bail!(
            "{} is a {} mount, not forkd-fs; not touching it",
            mp.display(),
            entry.fstype
        );
    }
    match sys_unmount(&mp, lazy) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => bail!(
            "{} is busy: files of it are open (running VMs map snapshot files); stop them, or \
             detach lazily (`forkd-fs unmount --lazy`)",
            mp.display()
        ),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(()),
        Err(e) => return Err(anyhow!(e).context(format!("unmounting {}", mp.display()))),
    }
    if !lazy {
        let control = default_control_socket(&mp);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match control_status(&control, Duration::from_millis(500)) {
                Ok(st) if same_path(&st.mountpoint, &mp) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => break,
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mountinfo() {
        let text = "36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    99 22 0:52 / /var/lib/forkd/my\\040mnt ro,nosuid,nodev,relatime - fuse.forkd-fs forkd-fs ro,user_id=0\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[1].dev, "0:52");
        assert_eq!(m[1].mountpoint, PathBuf::from("/var/lib/forkd/my mnt"));
        assert!(m[1].is_forkd_fs());
        assert!(!m[0].is_forkd_fs());
    }

    #[test]
    fn default_paths_are_siblings() {
        assert_eq!(
            default_control_socket(Path::new("/var/lib/forkd/mnt/")),
            PathBuf::from("/var/lib/forkd/mnt.sock")
        );
        assert_eq!(
            log_path(&default_control_socket(Path::new("/x/mnt"))),
            PathBuf::from("/x/mnt.log")
        );
    }
}
