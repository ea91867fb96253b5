//! The `forkd-fs mount` process: open the store, mount, serve FUSE requests
//! on a pool of threads and the control socket, unmount on SIGTERM/SIGINT.
//!
//! As root the mount is *held* (`holder`): `forkd-fs mount` keeps the
//! `/dev/fuse` connection and relays it to a `forkd-fs worker` process that
//! does the serving ([`serve_worker`]), restarted whenever it dies and
//! replaced on `forkd-fs upgrade` (SIGUSR2 to the holder), with every VM
//! mapping the mount left running. Without root the mount goes through
//! fusermount3 and one process serves it ([`serve`]).
//!
//! Shutdown: on SIGTERM/SIGINT the control socket is removed and the mount
//! unmounted; if files are still open (VMs map them) the mount is detached
//! lazily instead, and this process keeps serving those open files until
//! the last one is closed, then exits. Running VMs are never cut off by a
//! clean shutdown.

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use forkd_layers::StoreReader;
use fuser::{Config, MountOption, Session, SessionACL};
use nix::sys::signal::{SigSet, Signal};
use tracing::{info, warn};

use std::sync::Arc;

use crate::holder::{self, WorkerCommand};
use crate::journal::{Entry, Journal};
use crate::keeper;
use crate::mount::{self, State};
use crate::ops::{ForkdFs, KernelTuning};
use crate::shared::{Shared, WorkerOf};

/// Everything `forkd-fs mount` needs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where to mount.
    pub mountpoint: PathBuf,
    /// The layer store to serve (opened as a read-only secondary).
    pub store_dir: PathBuf,
    /// RocksDB secondary directory of this process's view of the store.
    pub secondary_dir: PathBuf,
    /// Unix socket the control requests are served on.
    pub control_socket: PathBuf,
    /// Decompressed-chunk cache, bytes.
    pub cache_bytes: usize,
    /// FUSE request threads.
    pub threads: usize,
    /// Kernel readahead for the mount, KiB (written to the mount's bdi).
    pub readahead_kib: u32,
    /// Largest FUSE read request, KiB (4..=1024). Smaller than the readahead
    /// window, one window becomes several requests served in parallel.
    pub max_read_kib: u32,
    /// The group that may read the mount (the VM jail's gid). With it,
    /// files are `0440 root:<gid>`, directories `0550`, and the mount has
    /// `allow_other` (jailed QEMUs are not root); without it only root
    /// reads the mount. The kernel enforces modes (`default_permissions`).
    pub gid: Option<u32>,
    /// Take SIGTERM/SIGINT/SIGHUP (blocked beforehand with
    /// [`block_signals`]) as the order to unmount. Off when a program serves
    /// a mount in-process (fs-bench) and unmounts it itself.
    pub handle_signals: bool,
    /// Lazy snapshots: how long a read retries a chunk, whether to fill.
    pub lazy: crate::lazy::LazyOptions,
}

/// Signals that end the process cleanly. Blocked in every thread (call
/// [`block_signals`] first thing in `main`, before any thread exists) and
/// taken by one `sigwait` thread.
fn shutdown_signals() -> SigSet {
    let mut s = SigSet::empty();
    s.add(Signal::SIGTERM);
    s.add(Signal::SIGINT);
    s.add(Signal::SIGHUP);
    s
}

/// The holder's signals: the shutdown ones, and SIGUSR2 (replace the
/// worker, an upgrade).
fn holder_signals() -> SigSet {
    let mut s = shutdown_signals();
    s.add(Signal::SIGUSR2);
    s
}

/// Blocks the shutdown signals (and SIGUSR2) in this thread and all
/// threads it spawns. A worker never unblocks them: stopping a mount is
/// the holder's business, a worker only dies by SIGKILL or with it.
pub fn block_signals() -> Result<()> {
    holder_signals()
        .thread_block()
        .context("blocking SIGTERM/SIGINT")
}

/// Binds the control socket, replacing a dead one but refusing one that
/// still answers. Returns the listener and the socket file's (dev, ino) so
/// only our own file is removed on exit.
fn bind_control(path: &Path) -> Result<(UnixListener, (u64, u64))> {
    if path.exists() {
        if let Ok(st) = mount::control_status(path, Duration::from_secs(2)) {
            if mount::is_detached(&st) {
                // Its mount was detached (`umount -l`) and serves only the
                // files still open; the path is the new mount's. It keeps
                // its listener, and removes only its own socket file.
                info!(
                    pid = st.pid,
                    "taking over {} from the detached mount it served",
                    path.display()
                );
                std::fs::remove_file(path)
                    .with_context(|| format!("removing {}", path.display()))?;
                return bind_fresh(path);
            }
            bail!(
                "another forkd-fs answers on {}; stop it first (`forkd-fs unmount MOUNTPOINT`)",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing the stale control socket {}", path.display()))?;
    }
    bind_fresh(path)
}

fn bind_fresh(path: &Path) -> Result<(UnixListener, (u64, u64))> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let l = UnixListener::bind(path)
        .with_context(|| format!("binding the control socket {}", path.display()))?;
    let md = std::fs::metadata(path)?;
    Ok((l, (md.dev(), md.ino())))
}

fn remove_own_socket(path: &Path, id: (u64, u64)) {
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if (md.dev(), md.ino()) == id {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Refuses a mount point that is served already; detaches a stale mount.
fn check_mountpoint(mp: &Path, control: &Path) -> Result<()> {
    match mount::state(mp, control)? {
        State::Free => Ok(()),
        State::Live(st) => bail!(
            "{} is already served by forkd-fs (pid {}); nothing to do",
            mp.display(),
            st.pid
        ),
        State::Silent => bail!(
            "{} is already a live forkd-fs mount (its control socket {} does not answer); \
             unmount it first",
            mp.display(),
            control.display()
        ),
        State::Stale { entry, hung } => mount::recover_stale(mp, &entry, hung),
        State::Foreign(e) => bail!(
            "{} already has a {} filesystem mounted; refusing to mount over it",
            mp.display(),
            e.fstype
        ),
    }
}

fn mount_config(threads: usize, gid: Option<u32>) -> Config {
    let mut c = session_config(threads, gid);
    c.clone_fd = true;
    c
}

/// What every session needs: the mount options (used only when fuser
/// mounts), who may use it, the request threads.
fn session_config(threads: usize, gid: Option<u32>) -> Config {
    let root = nix::unistd::geteuid().is_root();
    let mut c = Config::default();
    c.mount_options = vec![
        MountOption::RO,
        MountOption::FSName(mount::FSNAME.into()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
        // As root fuser mounts with mount(2) itself and ignores Subtype:
        // pass it as a kernel option so the type reads fuse.forkd-fs.
        if root {
            MountOption::CUSTOM(format!("subtype={}", mount::SUBTYPE))
        } else {
            MountOption::Subtype(mount::SUBTYPE.into())
        },
    ];
    // `allow_other` only for a reading group: jailed QEMUs run as uids of
    // their own. Without one only root (the owner) gets through at all.
    c.acl = if gid.is_some() {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    c.n_threads = Some(threads.max(1));
    // A worker's threads share its socket (a packet per read).
    c.clone_fd = false;
    c
}

/// Raises the mount's readahead window (the FUSE handshake caps it at the
/// kernel default, 128 KiB). Best effort.
///
/// Under the lock poold takes to narrow one file's window for a moment
/// (`forkd_vmm::readahead`), so neither puts back a window the other set.
fn set_readahead(mp: &Path, kib: u32) {
    let Ok(Some(entry)) = mount::mount_at(mp) else {
        return;
    };
    let _turn = mount::readahead_lock(mp)
        .map_err(|e| warn!("the mount's readahead lock: {e}; setting the window without it"))
        .ok();
    let p = format!("/sys/class/bdi/{}/read_ahead_kb", entry.dev);
    match std::fs::write(&p, kib.to_string()) {
        Ok(()) => info!(readahead_kib = kib, "set {p}"),
        Err(e) => warn!("could not set {p} to {kib}: {e} (readahead stays at the kernel default)"),
    }
}

/// The shutdown path for SIGTERM/SIGINT (see the module doc).
fn shutdown(shared: &Shared, mp: &Path, control: &Path, sock_id: (u64, u64)) {
    remove_own_socket(control, sock_id);
    match mount::sys_unmount(mp, false) {
        Ok(()) => info!("unmounted {}", mp.display()),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let open: u64 = shared.handles.counts().values().sum();
            warn!(
                open_handles = open,
                "{} is busy; detaching it and serving the open files until they are closed",
                mp.display()
            );
            if let Err(e) = mount::sys_unmount(mp, true) {
                warn!("lazy unmount of {} failed: {e}", mp.display());
            }
        }
        Err(e) => warn!("unmounting {} failed: {e}", mp.display()),
    }
}

/// Opens the store's read view for a serving process. `worker` is the
/// holder's pid and this worker's generation.
fn open_store(
    opts: &ServeOptions,
    mp: &Path,
    worker: Option<WorkerOf>,
) -> Result<(Arc<Shared>, StoreReader)> {
    std::fs::create_dir_all(&opts.secondary_dir)?;
    let reader = StoreReader::open_secondary_with_cache(
        &opts.store_dir,
        &opts.secondary_dir,
        opts.cache_bytes,
    )
    .with_context(|| format!("opening the store {} read-only", opts.store_dir.display()))?;
    let shared = Shared::new(
        reader.view(),
        opts.store_dir.clone(),
        mp.to_path_buf(),
        opts.gid,
        worker,
    );
    let lazy = crate::lazy::Lazy::start(reader.view(), opts.store_dir.clone(), opts.lazy)
        .context("starting the lazy-snapshot threads")?;
    let _ = shared.lazy.set(lazy);
    Ok((shared, reader))
}

fn tuning(opts: &ServeOptions) -> KernelTuning {
    KernelTuning {
        max_read: opts.max_read_kib.clamp(4, 1024) << 10,
        ..KernelTuning::default()
    }
}

/// A worker's tuning: reads of at most [`holder::MAX_READ_ANSWER`], so no
/// answer can be lost on the socket to its holder.
fn worker_tuning(opts: &ServeOptions) -> KernelTuning {
    let mut t = tuning(opts);
    if t.max_read > holder::MAX_READ_ANSWER {
        info!(
            asked_kib = t.max_read >> 10,
            "reads behind a holder are capped at {} KiB (larger answers may be lost on its socket)",
            holder::MAX_READ_ANSWER >> 10
        );
        t.max_read = holder::MAX_READ_ANSWER;
    }
    t
}

/// Holds the mount (as root; see the module doc): mounts `/dev/fuse`,
/// starts a worker (`binary worker ...`, a forkd-fs binary) and relays to
/// it, restarting it as long as the mount lives. `ready` runs once the
/// first worker serves.
pub fn hold(
    opts: &ServeOptions,
    binary: &Path,
    adopt: Option<&Path>,
    ready: impl FnOnce(&Path),
) -> Result<()> {
    // Adopting, the mount is there and waits for us: anything that looks
    // at it through the filesystem (a stat, a probe) would wait too
    // (keeper's invariants); the keeper gives its path as mounted.
    let mp = match adopt {
        Some(_) => opts.mountpoint.clone(),
        None => {
            std::fs::create_dir_all(&opts.mountpoint)
                .with_context(|| format!("creating mount point {}", opts.mountpoint.display()))?;
            let mp = opts.mountpoint.canonicalize()?;
            check_mountpoint(&mp, &opts.control_socket)?;
            mp
        }
    };
    // Each holder its own journal: a mount detached lazily keeps serving
    // its open files (and restarting its worker) beside the next one. An
    // adopting holder takes the dead one's over.
    let journal = mount::journal_path(&opts.control_socket, std::process::id());
    match adopt {
        Some(old) => std::fs::rename(old, &journal)
            .with_context(|| format!("taking over the dead holder's journal {}", old.display()))?,
        None => Journal::create(&journal)?,
    }
    mount::remove_dead_journals(&opts.control_socket);
    let m = match adopt {
        Some(_) => adopted_connection()?,
        None => holder::mount(&mp, opts.gid)?,
    };
    let dev = mount::mount_at(&mp)?.map(|e| e.dev);
    let cmd = WorkerCommand {
        binary: binary.to_path_buf(),
        args: worker_args(opts, &mp, &journal, dev.as_deref()),
    };
    let keep = keeper::bind(&mp)?;
    // Removed at the end only while it is still ours: a mount detached
    // (`umount -l`) outlives the next one's holder binding the same path.
    let keep_id = std::fs::symlink_metadata(keeper::keep_path(&mp))
        .map(|md| (md.dev(), md.ino()))
        .unwrap_or_default();
    let info = keeper::Info {
        holder_pid: std::process::id(),
        journal: journal.clone(),
        dev: dev.clone(),
    };
    let worker_pid: holder::WorkerPid = Default::default();
    if opts.handle_signals {
        let (mp2, wp) = (mp.clone(), worker_pid.clone());
        std::thread::Builder::new()
            .name("forkd-fs-signals".into())
            .spawn(move || holder_signal_loop(&mp2, &wp))?;
    }
    let control = opts.control_socket.clone();
    let (mp2, readahead_kib) = (mp.clone(), opts.readahead_kib);
    let res = holder::run(m, &cmd, worker_pid, Some((keep, info)), move || {
        wait_serving(&mp2, &control)?;
        // After the INIT answer, which caps it at what the kernel offered.
        set_readahead(&mp2, readahead_kib);
        info!(mountpoint = %mp2.display(), pid = std::process::id(), "holding the mount");
        ready(&mp2);
        Ok(())
    });
    match (&res, adopt) {
        (Err(e), None) => {
            warn!("{e:#}; detaching {}", mp.display());
            let _ = mount::sys_unmount(&mp, true);
        }
        // Not detached: once the keeper lets go too, the connection ends
        // and the mount is found dead (ENOTCONN, its device known), so the
        // VMs that mapped it are counted lost, not taken for a clean
        // unmount's.
        (Err(e), Some(_)) => warn!("{e:#}; the adoption of {} failed", mp.display()),
        (Ok(()), _) => {}
    }
    let _ = std::fs::remove_file(&journal);
    remove_own_socket(&keeper::keep_path(&mp), keep_id);
    res
}

/// The connection and arena a keeper handed an adopting holder
/// ([`keeper::ADOPT_DEV_FD`], [`keeper::ADOPT_ARENA_FD`]).
fn adopted_connection() -> Result<holder::Mounted> {
    use std::os::fd::FromRawFd;
    let take = |fd: i32| -> Result<std::os::fd::OwnedFd> {
        nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD)
            .with_context(|| format!("--adopt-journal needs the keeper's fd {fd}"))?;
        // Ours alone: not for the workers and helpers this holder starts.
        nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )?;
        // SAFETY: the keeper passed this fd for us alone.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    };
    let dev = take(keeper::ADOPT_DEV_FD)?;
    let st = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&dev))?;
    // /dev/fuse is the character device 10:229.
    if st.st_mode & libc::S_IFMT != libc::S_IFCHR || st.st_rdev != nix::sys::stat::makedev(10, 229)
    {
        bail!("fd {} is not a /dev/fuse connection", keeper::ADOPT_DEV_FD);
    }
    let arena = crate::arena::Arena::adopt(take(keeper::ADOPT_ARENA_FD)?)?;
    Ok(holder::Mounted { dev, arena })
}

/// The `forkd-fs worker` command line for a mount.
fn worker_args(
    opts: &ServeOptions,
    mp: &Path,
    journal: &Path,
    dev: Option<&str>,
) -> Vec<std::ffi::OsString> {
    let mut a: Vec<std::ffi::OsString> = vec!["worker".into(), mp.into()];
    let mut kv = |k: &str, v: std::ffi::OsString| {
        a.push(k.into());
        a.push(v);
    };
    kv("--store", opts.store_dir.clone().into());
    kv("--secondary-dir", opts.secondary_dir.clone().into());
    kv("--control", opts.control_socket.clone().into());
    kv("--journal", journal.into());
    kv("--cache-mib", (opts.cache_bytes >> 20).to_string().into());
    kv("--threads", opts.threads.to_string().into());
    kv("--max-read-kib", opts.max_read_kib.to_string().into());
    kv(
        "--remote-deadline-secs",
        opts.lazy.deadline.as_secs().to_string().into(),
    );

    if let Some(g) = opts.gid {
        kv("--gid", g.to_string().into());
    }
    if let Some(d) = dev {
        kv("--dev", d.into());
    }
    if !opts.lazy.fill {
        a.push("--no-fill".into());
    }
    a
}

/// Waits until the first worker answers on its control socket and through
/// the mount, or fails after a minute.
fn wait_serving(mp: &Path, control: &Path) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while mount::control_status(control, Duration::from_secs(1)).is_err() {
        if std::time::Instant::now() > deadline {
            bail!(
                "the forkd-fs worker did not answer on {} within 60 s",
                control.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::metadata(mp.join(crate::inode::BY_ID_NAME))
        .with_context(|| format!("checking the new mount at {}", mp.display()))?;
    Ok(())
}

/// SIGTERM/SIGINT/SIGHUP: unmount (lazily if busy; the worker serves the
/// open files until they close). SIGUSR2: replace the worker (it is
/// killed; the holder starts the binary on disk and replays its requests).
fn holder_signal_loop(mp: &Path, worker: &holder::WorkerPid) {
    loop {
        let Ok(sig) = holder_signals().wait() else {
            continue;
        };
        if sig == Signal::SIGUSR2 {
            if let Some(pid) = *worker.lock().unwrap() {
                info!("SIGUSR2: replacing worker pid {pid}");
                let _ =
                    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
            continue;
        }
        info!("{sig:?}: unmounting {}", mp.display());
        match mount::sys_unmount(mp, false) {
            Ok(()) => info!("unmounted {}", mp.display()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                warn!(
                    "{} is busy; detaching it, its open files are served until they are closed",
                    mp.display()
                );
                if let Err(e) = mount::sys_unmount(mp, true) {
                    warn!("lazy unmount of {} failed: {e}", mp.display());
                }
            }
            Err(e) => warn!("unmounting {} failed: {e}", mp.display()),
        }
    }
}

/// A worker: serves the holder's connection on fd [`holder::WORKER_FD`]
/// (see the module doc). Never touches the mount itself before it serves
/// (every access would wait on itself). Replays the mount's journal first.
pub fn serve_worker(
    opts: &ServeOptions,
    journal: &Path,
    generation: u64,
    dev: Option<String>,
) -> Result<()> {
    use std::os::fd::FromRawFd;
    // SAFETY: the holder passes the socket as this fd; nothing else owns it.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(holder::WORKER_FD) };
    holder::check_worker_fd(&fd)?;
    let mp = opts.mountpoint.clone();
    let holder_pid = nix::unistd::getppid().as_raw() as u32;
    let me = WorkerOf {
        holder_pid,
        generation,
        dev,
    };
    let (shared, _reader) = open_store(opts, &mp, Some(me))?;
    replay_journal(&shared, journal)?;
    let (listener, sock_id) = bind_control(&opts.control_socket)?;
    let fs = ForkdFs::new(shared.clone(), worker_tuning(opts));
    let acl = if opts.gid.is_some() {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    let session = Session::from_fd(fs, fd, acl, session_config(opts.threads, opts.gid))
        .context("the FUSE handshake with the holder")?;
    *shared.notifier.lock().unwrap() = Some(session.notifier());
    let sh = shared.clone();
    std::thread::Builder::new()
        .name("forkd-fs-control".into())
        .spawn(move || crate::control::serve(listener, sh))?;
    info!(
        generation,
        pid = std::process::id(),
        holder = holder_pid,
        "worker serving {}",
        mp.display()
    );
    let res = session.run();
    remove_own_socket(&opts.control_socket, sock_id);
    if let Err(e) = res {
        // The holder closed the connection: the mount ended.
        info!("worker {generation}: session ended ({e})");
    }
    Ok(())
}

/// Rebuilds what earlier workers handed out, then compacts the journal and
/// keeps it for this worker's own changes.
fn replay_journal(sh: &Shared, path: &Path) -> Result<()> {
    let entries = Journal::load(path)?;
    if entries.iter().any(|e| matches!(e, Entry::Snapshot { .. })) {
        sh.catchup.now().context("catching up with the store")?;
    }
    let mut lost = 0;
    for e in &entries {
        match e {
            Entry::Snapshot { ino, id } => match sh.view.snapshot(id) {
                Ok(Some(rec)) => sh.inodes.replay_snapshot(&rec, *ino),
                // Deleted since (the protocol saw no open file of it).
                _ => lost += 1,
            },
            Entry::Tag { ino, name } => sh.inodes.replay_tag(name, *ino),
            e => sh.handles.replay(e),
        }
    }
    if !entries.is_empty() {
        info!(
            entries = entries.len(),
            "replayed the mount journal ({lost} snapshots no longer in the store)"
        );
    }
    let mut now = sh.inodes.journal_entries();
    now.extend(sh.handles.journal_entries());
    let j = Arc::new(Journal::rewrite(path, &now)?);
    sh.inodes.set_journal(j.clone());
    sh.handles.set_journal(j);
    Ok(())
}

/// Mounts and serves until unmounted. `ready` runs once the mount answers
/// requests (the daemonizing parent waits for it).
pub fn serve(opts: &ServeOptions, ready: impl FnOnce(&Path)) -> Result<()> {
    std::fs::create_dir_all(&opts.mountpoint)
        .with_context(|| format!("creating mount point {}", opts.mountpoint.display()))?;
    let mp = opts.mountpoint.canonicalize()?;
    check_mountpoint(&mp, &opts.control_socket)?;

    let (shared, _reader) = open_store(opts, &mp, None)?;
    let (listener, sock_id) = bind_control(&opts.control_socket)?;
    let fs = ForkdFs::new(shared.clone(), tuning(opts));
    let session = Session::new(fs, &mp, &mount_config(opts.threads, opts.gid)).with_context(|| {
        format!(
            "mounting FUSE at {} (needs /dev/fuse, and root or fusermount3)",
            mp.display()
        )
    });
    let session = match session {
        Ok(s) => s,
        Err(e) => {
            remove_own_socket(&opts.control_socket, sock_id);
            return Err(e);
        }
    };
    *shared.notifier.lock().unwrap() = Some(session.notifier());
    let runner = std::thread::Builder::new()
        .name("forkd-fs-session".into())
        .spawn(move || session.run())?;

    let sh = shared.clone();
    std::thread::Builder::new()
        .name("forkd-fs-control".into())
        .spawn(move || crate::control::serve(listener, sh))?;

    if opts.handle_signals {
        let (sh, mp2, ctl) = (shared.clone(), mp.clone(), opts.control_socket.clone());
        std::thread::Builder::new()
            .name("forkd-fs-signals".into())
            .spawn(move || loop {
                if let Ok(sig) = shutdown_signals().wait() {
                    info!("{sig:?}: shutting down");
                    shutdown(&sh, &mp2, &ctl, sock_id);
                }
            })?;
    }

    set_readahead(&mp, opts.readahead_kib);
    // A request through the kernel proves the session loop is serving.
    std::fs::metadata(mp.join(crate::inode::BY_ID_NAME))
        .with_context(|| format!("checking the new mount at {}", mp.display()))?;
    info!(
        mountpoint = %mp.display(),
        store = %opts.store_dir.display(),
        control = %opts.control_socket.display(),
        pid = std::process::id(),
        "serving"
    );
    ready(&mp);

    let res = runner.join();
    remove_own_socket(&opts.control_socket, sock_id);
    match res {
        Ok(Ok(())) => {
            info!("mount {} ended; exiting", mp.display());
            Ok(())
        }
        Ok(Err(e)) => Err(anyhow::Error::new(e).context("FUSE session failed")),
        Err(_) => bail!("FUSE session thread panicked"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(max_read_kib: u32) -> ServeOptions {
        ServeOptions {
            mountpoint: "/m".into(),
            store_dir: "/s".into(),
            secondary_dir: "/s2".into(),
            control_socket: "/c".into(),
            cache_bytes: 0,
            threads: 1,
            readahead_kib: 1024,
            max_read_kib,
            gid: None,
            handle_signals: false,
            lazy: Default::default(),
        }
    }

    /// The branch hang of issue 30: a 256 KiB answer on the worker socket
    /// can be lost under fragmentation, so a worker never asks for reads
    /// that large, whatever the mount was given.
    #[test]
    fn reads_behind_a_holder_fit_one_small_packet() {
        assert_eq!(worker_tuning(&opts(256)).max_read, 64 << 10);
        assert_eq!(worker_tuning(&opts(1024)).max_read, 64 << 10);
        assert_eq!(worker_tuning(&opts(32)).max_read, 32 << 10);
        // Serving in-process (no holder) keeps what was asked.
        assert_eq!(tuning(&opts(256)).max_read, 256 << 10);
    }
}
