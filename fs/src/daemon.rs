//! The `forkd-fs mount` process: open the store, mount, serve FUSE requests
//! on a pool of threads and the control socket, unmount on SIGTERM/SIGINT.
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

use crate::mount::{self, State};
use crate::ops::{ForkdFs, KernelTuning};
use crate::shared::Shared;

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

/// Blocks the shutdown signals in this thread and all threads it spawns.
pub fn block_signals() -> Result<()> {
    shutdown_signals()
        .thread_block()
        .context("blocking SIGTERM/SIGINT")
}

/// Binds the control socket, replacing a dead one but refusing one that
/// still answers. Returns the listener and the socket file's (dev, ino) so
/// only our own file is removed on exit.
fn bind_control(path: &Path) -> Result<(UnixListener, (u64, u64))> {
    if path.exists() {
        if mount::control_status(path, Duration::from_secs(2)).is_ok() {
            bail!(
                "another forkd-fs answers on {}; stop it first (`forkd-fs unmount MOUNTPOINT`)",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing the stale control socket {}", path.display()))?;
    }
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
    c.clone_fd = true;
    c
}

/// Raises the mount's readahead window (the FUSE handshake caps it at the
/// kernel default, 128 KiB). Best effort.
fn set_readahead(mp: &Path, kib: u32) {
    let Ok(Some(entry)) = mount::mount_at(mp) else {
        return;
    };
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

/// Mounts and serves until unmounted. `ready` runs once the mount answers
/// requests (the daemonizing parent waits for it).
pub fn serve(opts: &ServeOptions, ready: impl FnOnce(&Path)) -> Result<()> {
    std::fs::create_dir_all(&opts.mountpoint)
        .with_context(|| format!("creating mount point {}", opts.mountpoint.display()))?;
    let mp = opts.mountpoint.canonicalize()?;
    check_mountpoint(&mp, &opts.control_socket)?;

    std::fs::create_dir_all(&opts.secondary_dir)?;
    let reader = StoreReader::open_secondary_with_cache(
        &opts.store_dir,
        &opts.secondary_dir,
        opts.cache_bytes,
    )
    .with_context(|| format!("opening the store {} read-only", opts.store_dir.display()))?;
    let shared = Shared::new(reader.view(), opts.store_dir.clone(), mp.clone(), opts.gid);

    let (listener, sock_id) = bind_control(&opts.control_socket)?;
    let tuning = KernelTuning {
        max_read: opts.max_read_kib.clamp(4, 1024) << 10,
        ..KernelTuning::default()
    };
    let fs = ForkdFs::new(shared.clone(), tuning);
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
