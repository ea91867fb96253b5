//! `forkd-fs`: mount the layer store over FUSE (see docs/fs.md).

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use forkd_fs::control::{Client, Request, DEFAULT_FILE};
use forkd_fs::daemon::{self, ServeOptions};
use forkd_fs::lazy::LazyOptions;
use forkd_fs::{mount, prefetch, ranges};
use forkd_layers::SnapshotId;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "forkd-fs",
    version,
    about = "Serve forkd's layer store as a read-only FUSE filesystem"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Mount the store (long-lived). Without --foreground, returns once the
    /// mount is live and keeps serving in the background, logging to
    /// <CONTROL without extension>.log.
    Mount {
        mountpoint: PathBuf,
        /// The layer store directory.
        #[arg(long)]
        store: PathBuf,
        /// RocksDB secondary directory, private to this process
        /// [default: <MOUNTPOINT>.secondary].
        #[arg(long)]
        secondary_dir: Option<PathBuf>,
        /// Control socket [default: <MOUNTPOINT>.sock].
        #[arg(long)]
        control: Option<PathBuf>,
        /// Decompressed-chunk cache (the kernel page cache is the main cache).
        #[arg(long, default_value_t = 64)]
        cache_mib: usize,
        /// FUSE request threads.
        #[arg(long, default_value_t = 8)]
        threads: usize,
        /// Kernel readahead window of the mount, KiB.
        #[arg(long, env = "FORKD_FS_READAHEAD_KIB", default_value_t = 1024)]
        readahead_kib: u32,
        /// Largest FUSE read request, KiB (a readahead window is split into
        /// requests of this size, served in parallel).
        #[arg(long, default_value_t = 256)]
        max_read_kib: u32,
        /// The group that may read served files (the VM jail's gid): files
        /// are served 0440 root:GID, directories 0550, with allow_other.
        /// Without it only root reads the mount.
        #[arg(long)]
        gid: Option<u32>,
        /// How long a read of a lazy snapshot keeps retrying a chunk its hub
        /// does not deliver before it fails with EIO (the reading VM waits
        /// that long).
        #[arg(long, default_value_t = 120)]
        remote_deadline_secs: u64,
        /// Do not fill lazy snapshots in the background (fetch only what
        /// reads need).
        #[arg(long)]
        no_fill: bool,
        /// Stay in the foreground, logging to stderr.
        #[arg(long)]
        foreground: bool,
        /// Internal: print "ready" on stdout once live (daemonizing parent).
        #[arg(long, hide = true)]
        notify_ready: bool,
        /// Internal: adopt a dead holder's connection and arena (fds 3 and
        /// 4, from a keeper) and take over its journal at this path.
        #[arg(long, hide = true)]
        adopt_journal: Option<PathBuf>,
    },
    /// Internal: serve a held mount's connection (started by `mount`).
    #[command(hide = true)]
    Worker {
        mountpoint: PathBuf,
        #[arg(long)]
        store: PathBuf,
        #[arg(long)]
        secondary_dir: PathBuf,
        #[arg(long)]
        control: PathBuf,
        #[arg(long)]
        journal: PathBuf,
        #[arg(long, default_value_t = 64)]
        cache_mib: usize,
        #[arg(long, default_value_t = 8)]
        threads: usize,
        #[arg(long, default_value_t = 256)]
        max_read_kib: u32,
        #[arg(long)]
        gid: Option<u32>,
        #[arg(long)]
        generation: u64,
        /// The mount's device (`major:minor`), reported in `status`.
        #[arg(long)]
        dev: Option<String>,
        #[arg(long, default_value_t = 120)]
        remote_deadline_secs: u64,
        #[arg(long)]
        no_fill: bool,
    },
    /// Replace the process serving a mount with the forkd-fs binary now on
    /// disk, keeping the mount and every VM using it running.
    Upgrade {
        #[arg(long)]
        mount: PathBuf,
        #[arg(long)]
        control: Option<PathBuf>,
    },
    /// Unmount (the serving process then exits).
    Unmount {
        mountpoint: PathBuf,
        /// Detach even if files are open; they keep working until closed.
        #[arg(long)]
        lazy: bool,
    },
    /// Read ranges of a snapshot file through the mount so they land in the
    /// page cache. Ranges: --ranges FILE, else the list stored with the
    /// snapshot, else every data extent of the file.
    Prefetch {
        /// Snapshot id.
        id: String,
        #[arg(long)]
        mount: PathBuf,
        /// JSON [[offset, len], ...] (or {"ranges": [...]}).
        #[arg(long)]
        ranges: Option<PathBuf>,
        #[arg(long, default_value = DEFAULT_FILE)]
        file: String,
        /// Control socket [default: <MOUNT>.sock].
        #[arg(long)]
        control: Option<PathBuf>,
        /// Parallel readers.
        #[arg(long, default_value_t = 4)]
        threads: usize,
    },
    /// Print the mount's status (JSON).
    Status {
        #[arg(long)]
        mount: PathBuf,
        #[arg(long)]
        control: Option<PathBuf>,
    },
    /// Send one raw JSON request to the control socket and print the reply.
    Ctl {
        #[arg(long)]
        mount: PathBuf,
        #[arg(long)]
        control: Option<PathBuf>,
        /// e.g. '{"op":"in_use","id":"..."}'
        request: String,
    },
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FORKD_FS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,fuser=error"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

fn control_of(mount: &Path, explicit: Option<PathBuf>) -> PathBuf {
    explicit.unwrap_or_else(|| mount::default_control_socket(mount))
}

fn main() -> ExitCode {
    // Before any thread exists, so the signal thread alone receives them.
    if let Err(e) = daemon::block_signals() {
        eprintln!("forkd-fs: {e:#}");
        return ExitCode::FAILURE;
    }
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("forkd-fs: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Mount {
            mountpoint,
            store,
            secondary_dir,
            control,
            cache_mib,
            threads,
            readahead_kib,
            max_read_kib,
            gid,
            remote_deadline_secs,
            no_fill,
            foreground,
            notify_ready,
            adopt_journal,
        } => {
            let abs = |p: PathBuf| -> Result<PathBuf> {
                Ok(if p.is_absolute() {
                    p
                } else {
                    std::env::current_dir()?.join(p)
                })
            };
            let mountpoint = abs(mountpoint)?;
            let opts = ServeOptions {
                secondary_dir: abs(
                    secondary_dir.unwrap_or_else(|| mount::default_secondary_dir(&mountpoint))
                )?,
                control_socket: abs(control_of(&mountpoint, control))?,
                store_dir: abs(store)?,
                mountpoint,
                cache_bytes: cache_mib << 20,
                threads,
                readahead_kib,
                max_read_kib,
                gid,
                handle_signals: true,
                lazy: LazyOptions {
                    deadline: Duration::from_secs(remote_deadline_secs),
                    fill: !no_fill,
                },
            };
            if foreground {
                init_logging();
                let ready = |_: &Path| {
                    if notify_ready {
                        notify_parent();
                    }
                };
                if forkd_fs::holder::can_hold() {
                    // The path, not /proc/self/exe: an upgrade replaces the
                    // file there and the next worker runs the new one.
                    let me = std::env::current_exe().context("finding the forkd-fs binary")?;
                    daemon::hold(&opts, &me, adopt_journal.as_deref(), ready)
                } else {
                    daemon::serve(&opts, ready)
                }
            } else {
                daemonize(&opts, adopt_journal.as_deref())
            }
        }
        Cmd::Worker {
            mountpoint,
            store,
            secondary_dir,
            control,
            journal,
            cache_mib,
            threads,
            max_read_kib,
            gid,
            generation,
            dev,
            remote_deadline_secs,
            no_fill,
        } => {
            init_logging();
            let opts = ServeOptions {
                mountpoint,
                store_dir: store,
                secondary_dir,
                control_socket: control,
                cache_bytes: cache_mib << 20,
                threads,
                readahead_kib: 0,
                max_read_kib,
                gid,
                handle_signals: false,
                lazy: LazyOptions {
                    deadline: Duration::from_secs(remote_deadline_secs),
                    fill: !no_fill,
                },
            };
            daemon::serve_worker(&opts, &journal, generation, dev)
        }
        Cmd::Upgrade { mount, control } => upgrade(&control_of(&mount, control)),
        Cmd::Unmount { mountpoint, lazy } => {
            if lazy {
                mount::unmount_lazy(&mountpoint)
            } else {
                mount::unmount(&mountpoint)
            }
        }
        Cmd::Prefetch {
            id,
            mount,
            ranges,
            file,
            control,
            threads,
        } => prefetch_cmd(&id, &mount, ranges, &file, control, threads),
        Cmd::Status { mount, control } => {
            let st = Client::connect(&control_of(&mount, control))?.status()?;
            println!("{}", serde_json::to_string_pretty(&st)?);
            Ok(())
        }
        Cmd::Ctl {
            mount,
            control,
            request,
        } => {
            let req: Request = serde_json::from_str(&request).context("parsing the request")?;
            let v = Client::connect(&control_of(&mount, control))?.call(&req)?;
            println!("{v}");
            Ok(())
        }
    }
}

/// Asks a mount's holder for a new worker and waits until it serves.
fn upgrade(control: &Path) -> Result<()> {
    let before = Client::connect(control)?.status()?;
    let Some(holder) = before.holder_pid else {
        bail!(
            "the mount at {} has no holder (it was mounted without root, or by a forkd-fs              from before holders): unmount and mount it again to upgrade",
            before.mountpoint.display()
        );
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(holder as i32),
        nix::sys::signal::Signal::SIGUSR2,
    )
    .with_context(|| format!("signalling the holder (pid {holder})"))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        if let Ok(st) = Client::connect(control).and_then(|mut c| c.status()) {
            if st.generation > before.generation {
                println!(
                    "worker {} (pid {}) replaced by worker {} (pid {}); the mount stayed",
                    before.generation, before.pid, st.generation, st.pid
                );
                return Ok(());
            }
        }
    }
    bail!(
        "no new worker answered on {} within 60 s; see the mount's log {}",
        control.display(),
        mount::log_path(control).display()
    )
}

/// Tells the daemonizing parent the mount is live, then detaches stdout
/// (the parent is about to exit and close the pipe).
fn notify_parent() {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready {}", std::process::id());
    let _ = out.flush();
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        use std::os::unix::io::AsRawFd;
        // SAFETY: dup2 onto our own stdout fd.
        unsafe { libc::dup2(null.as_raw_fd(), 1) };
    }
}

/// How long the daemon may take to report the mount live.
const READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Re-executes this program in the foreground in a new session, logging to
/// the log file, and returns once it reports the mount live (or fails with
/// the tail of its log).
fn daemonize(opts: &ServeOptions, adopt_journal: Option<&Path>) -> Result<()> {
    let log_path = mount::log_path(&opts.control_socket);
    if let Some(d) = log_path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening the log file {}", log_path.display()))?;
    let log_start = log.metadata()?.len();
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("mount")
        .arg(&opts.mountpoint)
        .arg("--store")
        .arg(&opts.store_dir)
        .arg("--secondary-dir")
        .arg(&opts.secondary_dir)
        .arg("--control")
        .arg(&opts.control_socket)
        .arg("--cache-mib")
        .arg((opts.cache_bytes >> 20).to_string())
        .arg("--threads")
        .arg(opts.threads.to_string())
        .arg("--readahead-kib")
        .arg(opts.readahead_kib.to_string())
        .arg("--max-read-kib")
        .arg(opts.max_read_kib.to_string())
        .arg("--remote-deadline-secs")
        .arg(opts.lazy.deadline.as_secs().to_string())
        .args((!opts.lazy.fill).then_some("--no-fill"))
        .arg("--foreground")
        .arg("--notify-ready")
        .args(opts.gid.map(|g| format!("--gid={g}")))
        .args(adopt_journal.map(|j| format!("--adopt-journal={}", j.display())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log);
    // SAFETY: setsid, close_range and fcntl are async-signal-safe. setsid
    // detaches from our terminal and process group so the daemon outlives
    // the caller; the daemon keeps none of the caller's other fds (a lock
    // or a pipe the caller's caller waits on would otherwise stay held for
    // as long as the mount lives).
    unsafe {
        // Adopting, fds 3 and 4 are the keeper's (the connection and its
        // arena) and must reach the daemon.
        let first = if adopt_journal.is_some() { 5 } else { 3 };
        cmd.pre_exec(move || {
            libc::setsid();
            cloexec_from(first);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the forkd-fs daemon")?;
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = match rx.recv_timeout(READY_TIMEOUT) {
        Ok(line) => line,
        Err(_) => {
            let _ = child.kill();
            String::new()
        }
    };
    if line.starts_with("ready") {
        println!("{}", line.trim());
        return Ok(());
    }
    let status = child.wait()?;
    let mut tail = String::new();
    if let Ok(mut f) = std::fs::File::open(&log_path) {
        let _ = f.seek(SeekFrom::Start(log_start));
        let _ = f.read_to_string(&mut tail);
    }
    bail!(
        "the forkd-fs daemon exited ({status}) before the mount was live (or was killed after {}s without \
         reporting it live); its log ({}):\n{}",
        READY_TIMEOUT.as_secs(),
        log_path.display(),
        tail.trim()
    )
}

fn prefetch_cmd(
    id: &str,
    mount: &Path,
    ranges_file: Option<PathBuf>,
    file: &str,
    control: Option<PathBuf>,
    threads: usize,
) -> Result<()> {
    let sid: SnapshotId = id.parse().map_err(anyhow::Error::msg)?;
    let path = prefetch::file_path(mount, &sid, file);
    let (list, source) = match ranges_file {
        Some(f) => (ranges::read_file(&f)?, format!("{}", f.display())),
        None => {
            let stored = Client::connect(&control_of(mount, control))
                .and_then(|mut c| c.stored_ranges(&sid, file));
            match stored {
                Ok(Some(r)) => (r, "the list stored with the snapshot".to_string()),
                Ok(None) => (prefetch::default_ranges(&path)?, "data extents".to_string()),
                Err(e) => {
                    eprintln!("forkd-fs: no stored range list ({e:#}); reading every data extent");
                    (prefetch::default_ranges(&path)?, "data extents".to_string())
                }
            }
        }
    };
    let rep = prefetch::read_ranges(&path, &list, threads)?;
    println!(
        "prefetched {} bytes of {} in {} ms ({} ranges from {source})",
        rep.bytes,
        path.display(),
        rep.ms,
        list.len()
    );
    Ok(())
}

/// Marks every fd from `first` up close-on-exec. Runs between fork and
/// exec: async-signal-safe calls only, no allocation.
fn cloexec_from(first: u32) {
    // SAFETY: close_range only changes flags of this process's fds.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc != 0 {
        // Kernels before 5.11: one fcntl per possible fd.
        for fd in first as i32..4096 {
            // SAFETY: F_SETFD on an fd that may not exist fails with EBADF.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
    }
}
