//! The holder: keeps a forkd-fs mount, and every VM mapping its files,
//! alive across a crash or an upgrade of the process that serves it.
//!
//! A FUSE mount lives as long as someone holds its `/dev/fuse` connection.
//! When the serving process dies, the kernel aborts the connection and
//! every mapping of a file on it faults with SIGBUS/EIO: every QEMU child
//! would die at its next uncached page. So the connection is held by this
//! small process, which does nothing but relay bytes, and the real work
//! (the store, caches, the control socket) runs in a *worker* process it
//! starts and restarts.
//!
//! ```text
//!  kernel ──/dev/fuse── holder ──SOCK_SEQPACKET── worker (fuser Session::from_fd)
//! ```
//!
//! Invariants:
//! - Only the holder reads and writes `/dev/fuse`. A worker sees each
//!   request as one packet on its socket and answers with one packet, as
//!   it would on `/dev/fuse` (fuser cannot tell the difference).
//! - Every request that expects an answer is *pending* from the moment the
//!   holder reads it until its answer is written to the kernel. A worker
//!   that dies leaves its requests pending; its successor first gets the
//!   mount's INIT (its answer is dropped: the kernel was answered once),
//!   then every pending request, oldest first. The kernel of this host
//!   (6.1) cannot resend requests itself; this does it.
//! - An answer reaches the kernel at most once: the first for a request
//!   wins and ends its pending entry; any later one is dropped.
//! - A request is sent to a given worker at most once (`sent_to`), so a
//!   worker never sees duplicates (an `open` answered twice would leak a
//!   handle count).
//! - Notifications (the worker invalidating kernel caches) are written from
//!   their own thread: one can wait on a request in flight, whose answer
//!   must not queue behind it.
//! - What a worker handed out (inode numbers, file handles, the delete
//!   protocol's state) is journaled before the kernel learns it
//!   (`journal`); a new worker replays it.
//!
//! - Every request is read straight into a slot of the request arena
//!   (`arena`), shared memory a keeper holds with a duplicate of the
//!   connection (`keeper`): when the holder itself dies, a holder started
//!   by the keeper adopts both and replays what was pending. Without a
//!   keeper, the holder's death ends the mount. It holds no store, no
//!   cache and no parser beyond the FUSE headers.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::arena::{in_header, Arena};
use nix::sys::socket::{self, AddressFamily, MsgFlags, SockFlag, SockType};
use tracing::{error, info, warn};

/// Opcodes the holder must tell apart (linux/fuse.h).
const FUSE_FORGET: u32 = 2;
const FUSE_INIT: u32 = 26;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_BATCH_FORGET: u32 = 42;

/// The largest read a worker behind a holder answers. The worker socket is
/// `SOCK_SEQPACKET`: the kernel copies each packet's head into one
/// physically contiguous buffer (`unix_dgram_sendmsg`), so a 256 KiB
/// answer needs an order-6 allocation. When memory is fragmented that
/// fails: `writev` returns ENOBUFS, fuser logs "Failed to send FUSE reply"
/// and drops the answer, and the kernel waits for it forever with the page
/// it was to fill locked (a QEMU faulting it, or a branch migration reading
/// it, hangs for good: the branch hang of issue 30). Up to 64 KiB the head
/// is at most 16 KiB (order 2, which the allocator does not give up on) and
/// the rest fits the packet's page fragments.
pub const MAX_READ_ANSWER: u32 = 64 << 10;
/// Room for the largest answer a worker sends: a read of up to 1 MiB
/// (`--max-read-kib` is capped there) plus its header.
const ANSWER_BUF: usize = 2 << 20;
/// Socket buffers big enough for one answer packet each way.
const SOCKET_BUF: usize = 4 << 20;
/// How long a worker may take to exit once the mount has ended.
const WORKER_EXIT_GRACE: Duration = Duration::from_secs(5);
/// The fd a worker finds its socket on.
pub const WORKER_FD: i32 = 3;

/// How the holder starts a worker.
#[derive(Debug, Clone)]
pub struct WorkerCommand {
    /// The forkd-fs binary (the path, re-read at every start: an upgrade
    /// replaces the file, the next worker runs the new one).
    pub binary: PathBuf,
    /// Arguments after the binary (`worker ...`), without `--generation`.
    pub args: Vec<OsString>,
}

/// A request read from the kernel and not yet answered: its arena slot.
struct Pending {
    slot: usize,
    len: usize,
    /// The worker generation it was last sent to.
    sent_to: u64,
}

/// The current worker's socket, and who it is.
struct Tx {
    sock: Option<Arc<OwnedFd>>,
    generation: u64,
}

struct Relay {
    dev: OwnedFd,
    /// Where requests are read to, shared with a keeper (`arena`).
    arena: Arena,
    pending: Mutex<BTreeMap<u64, Pending>>,
    /// Held while sending to a worker: a request's send and a new worker's
    /// replay never interleave.
    tx: Mutex<Tx>,
    /// The INIT request, once read (replayed to every later worker).
    init: Mutex<Option<(u64, Arc<[u8]>)>>,
    notify: Mutex<mpsc::SyncSender<Vec<u8>>>,
    /// Set when the kernel ended the connection (unmounted).
    ended: AtomicBool,
    /// Workers started so far (the first is generation 1).
    generation: AtomicU64,
    /// The current worker's pid, while it runs (not yet reaped).
    worker_pid: WorkerPid,
}

/// The fuse_out_header's `unique` (0 for a notification).
fn out_unique(b: &[u8]) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(8..16)?.try_into().ok()?))
}

impl Relay {
    /// Kernel → worker, until the connection ends. Each request is read
    /// straight into an arena slot, so it outlives this process.
    fn read_kernel(self: &Arc<Self>) {
        loop {
            let slot = self.arena.take();
            let read = {
                // SAFETY: just taken; only this thread touches the slot
                // until it is pending or released.
                let buf = unsafe { self.arena.slot_mut(slot) };
                nix::unistd::read(self.dev.as_raw_fd(), buf)
            };
            let n = match read {
                Ok(n) => n,
                Err(e) => {
                    self.arena.release(slot);
                    match e {
                        nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN => continue,
                        // The request was interrupted before we read it.
                        nix::errno::Errno::ENOENT => continue,
                        nix::errno::Errno::ENODEV => break,
                        e => {
                            error!("reading /dev/fuse: {e}; ending the mount's relay");
                            break;
                        }
                    }
                }
            };
            if !self.take_request(slot, n) {
                self.arena.release(slot);
            }
        }
        self.ended.store(true, Ordering::SeqCst);
        // The worker reads EOF and exits; one that is hung is killed.
        if let Some(s) = self.tx.lock().unwrap().sock.take() {
            let _ = socket::shutdown(s.as_raw_fd(), socket::Shutdown::Both);
        }
        let deadline = Instant::now() + WORKER_EXIT_GRACE;
        while Instant::now() < deadline && self.worker_pid.lock().unwrap().is_some() {
            std::thread::sleep(Duration::from_millis(50));
        }
        // Still set: not yet reaped, so the pid is still that worker's.
        if let Some(pid) = *self.worker_pid.lock().unwrap() {
            warn!("worker pid {pid} did not exit after the mount ended; killing it");
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }

    /// Handles the `n`-byte request just read into `slot`: pending until
    /// answered (when it wants an answer), sent to the current worker.
    /// False when the slot can be released at once.
    fn take_request(&self, slot: usize, n: usize) -> bool {
        let req = self.arena.request(slot, n);
        let Some((len, opcode, unique)) = in_header(req) else {
            warn!("a {n}-byte FUSE request without a header; dropped");
            return false;
        };
        if len as usize != n {
            warn!("FUSE request {unique}: header says {len} bytes, read {n}; dropped");
            return false;
        }
        let answered = !matches!(opcode, FUSE_FORGET | FUSE_BATCH_FORGET | FUSE_INTERRUPT);
        if opcode == FUSE_INIT {
            self.arena.set_init(req);
            *self.init.lock().unwrap() = Some((unique, req.into()));
        }
        if answered {
            self.pending.lock().unwrap().insert(
                unique,
                Pending {
                    slot,
                    len: n,
                    sent_to: 0,
                },
            );
        }
        let tx = self.tx.lock().unwrap();
        let Some(sock) = &tx.sock else {
            return answered;
        };
        if answered {
            let mut p = self.pending.lock().unwrap();
            match p.get_mut(&unique) {
                Some(e) if e.sent_to != tx.generation => e.sent_to = tx.generation,
                // Answered already, or replayed to this worker.
                _ => return true,
            }
        }
        // A dead worker's socket fails; its successor gets the replay.
        let _ = send(sock, req);
        answered
    }

    /// Worker → kernel, until the worker's socket closes.
    fn read_worker(&self, sock: &OwnedFd, generation: u64) {
        let mut buf = vec![0u8; ANSWER_BUF];
        let init_unique = || self.init.lock().unwrap().as_ref().map(|(u, _)| *u);
        loop {
            let n = match socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                Ok(0) => break,
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    warn!("worker {generation}: reading its answers: {e}");
                    break;
                }
            };
            let answer = &buf[..n];
            let Some(unique) = out_unique(answer) else {
                warn!("worker {generation}: a {n}-byte answer without a header; dropped");
                continue;
            };
            if unique == 0 {
                let _ = self.notify.lock().unwrap().try_send(answer.to_vec());
                continue;
            }
            let Some(done) = self.pending.lock().unwrap().remove(&unique) else {
                if Some(unique) != init_unique() {
                    tracing::debug!(
                        "worker {generation}: answer to {unique} dropped (already answered)"
                    );
                }
                continue;
            };
            match nix::unistd::write(&self.dev, answer) {
                Ok(_) => {}
                // The request was interrupted and is gone.
                Err(nix::errno::Errno::ENOENT) => {}
                Err(e) => warn!("writing an answer to /dev/fuse: {e}"),
            }
            // Only now: a holder dying before this replays it once more.
            self.arena.release(done.slot);
        }
    }

    /// Makes `sock` the current worker's: sends it the INIT (if the kernel
    /// sent one) and every pending request, oldest first.
    fn attach(&self, sock: Arc<OwnedFd>, generation: u64) {
        let mut tx = self.tx.lock().unwrap();
        tx.generation = generation;
        tx.sock = Some(sock.clone());
        let init = self.init.lock().unwrap().clone();
        let mut p = self.pending.lock().unwrap();
        if let Some((u, bytes)) = &init {
            if !p.contains_key(u) {
                let _ = send(&sock, bytes);
            }
        }
        let mut replayed = 0;
        for e in p.values_mut() {
            e.sent_to = generation;
            let _ = send(&sock, self.arena.request(e.slot, e.len));
            replayed += 1;
        }
        if generation > 1 {
            info!("worker {generation}: replayed {replayed} unanswered requests");
        }
    }
}

fn send(sock: &OwnedFd, bytes: &[u8]) -> nix::Result<usize> {
    socket::send(sock.as_raw_fd(), bytes, MsgFlags::MSG_NOSIGNAL)
}

/// Writes notifications to the kernel, off the answer path.
fn notify_loop(dev: Arc<Relay>, rx: mpsc::Receiver<Vec<u8>>) {
    for n in rx {
        // ENOENT: the kernel had nothing cached.
        let _ = nix::unistd::write(&dev.dev, &n);
    }
}

/// A connected pair of packet sockets with room for an answer each way.
fn socket_pair() -> Result<(OwnedFd, OwnedFd)> {
    let (a, b) = socket::socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .context("creating the worker socket pair")?;
    for s in [&a, &b] {
        // SO_SNDBUFFORCE needs CAP_NET_ADMIN (the holder is root); the plain
        // option is capped at net.core.wmem_max.
        if socket::setsockopt(s, socket::sockopt::SndBufForce, &SOCKET_BUF).is_err() {
            socket::setsockopt(s, socket::sockopt::SndBuf, &SOCKET_BUF)
                .context("sizing the worker socket")?;
        }
    }
    Ok((a, b))
}

/// Starts worker `generation` with `theirs` as its fd [`WORKER_FD`].
fn spawn_worker(cmd: &WorkerCommand, theirs: &OwnedFd, generation: u64) -> Result<Child> {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(&cmd.binary);
    c.args(&cmd.args)
        .arg(format!("--generation={generation}"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    let fd = theirs.as_raw_fd();
    // SAFETY: dup2 and prctl are async-signal-safe. dup2 clears
    // FD_CLOEXEC on the copy, so only the socket survives the exec.
    unsafe {
        c.pre_exec(move || {
            if libc::dup2(fd, WORKER_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The worker must not outlive its holder.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    c.spawn()
        .with_context(|| format!("starting the forkd-fs worker {}", cmd.binary.display()))
}

/// A mounted connection, handed to [`run`].
pub struct Mounted {
    /// The `/dev/fuse` connection of the mount.
    pub dev: OwnedFd,
    /// Its request arena: new for a new mount, a dead holder's when
    /// adopting one (its pending requests are replayed).
    pub arena: Arena,
}

/// Shared with the signal thread: the current worker's pid, to kill it on
/// an upgrade request.
pub type WorkerPid = Arc<Mutex<Option<u32>>>;

/// Relays `m`'s connection to a worker, restarting it whenever it exits,
/// until the kernel ends the connection (the mount was unmounted and its
/// last file closed). `ready` runs once the first worker serves.
pub fn run(
    m: Mounted,
    cmd: &WorkerCommand,
    worker_pid: WorkerPid,
    keep: Option<(std::os::unix::net::UnixListener, crate::keeper::Info)>,
    ready: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let (keep, keep_info) = match keep {
        Some((l, i)) => (Some(l), i),
        None => (None, Default::default()),
    };
    let (ntx, nrx) = mpsc::sync_channel(1024);
    let (pending, init) = adopted(&m.arena);
    let relay = Arc::new(Relay {
        dev: m.dev,
        arena: m.arena,
        pending: Mutex::new(pending),
        tx: Mutex::new(Tx {
            sock: None,
            generation: 0,
        }),
        init: Mutex::new(init),
        notify: Mutex::new(ntx),
        ended: AtomicBool::new(false),
        generation: AtomicU64::new(0),
        worker_pid: worker_pid.clone(),
    });
    if let Some(l) = keep {
        let r = relay.clone();
        std::thread::Builder::new()
            .name("holder-keeper".into())
            .spawn(move || crate::keeper::serve(l, &r.dev, r.arena.fd(), &keep_info))?;
    }
    let r = relay.clone();
    std::thread::Builder::new()
        .name("holder-notify".into())
        .spawn(move || notify_loop(r, nrx))?;
    let r = relay.clone();
    let kernel = std::thread::Builder::new()
        .name("holder-kernel".into())
        .spawn(move || r.read_kernel())?;

    let mut ready = Some(ready);
    let mut quick_deaths = 0u32;
    while !relay.ended.load(Ordering::SeqCst) {
        let generation = relay.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let (ours, theirs) = socket_pair()?;
        let mut child = spawn_worker(cmd, &theirs, generation)?;
        drop(theirs);
        *worker_pid.lock().unwrap() = Some(child.id());
        let started = Instant::now();
        let ours = Arc::new(ours);
        relay.attach(ours.clone(), generation);
        let r = relay.clone();
        let s = ours.clone();
        let answers = std::thread::Builder::new()
            .name("holder-answers".into())
            .spawn(move || r.read_worker(&s, generation))?;
        if let Some(f) = ready.take() {
            if let Err(e) = f() {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        }
        let status = child.wait().context("waiting for the worker")?;
        *worker_pid.lock().unwrap() = None;
        let _ = answers.join();
        if relay.ended.load(Ordering::SeqCst) {
            info!("worker {generation} exited ({status}) after the mount ended");
            break;
        }
        warn!(
            "worker {generation} (pid {}) exited ({status}); starting another, the mount stays",
            child.id()
        );
        // A worker that cannot start at all must not spin.
        if started.elapsed() < Duration::from_secs(2) {
            quick_deaths += 1;
            std::thread::sleep(Duration::from_millis(100 * u64::from(quick_deaths.min(20))));
        } else {
            quick_deaths = 0;
        }
    }
    let _ = kernel.join();
    Ok(())
}

/// What an arena holds from a holder before: its pending requests (none
/// for a new arena) and the mount's INIT.
#[allow(clippy::type_complexity)]
fn adopted(arena: &Arena) -> (BTreeMap<u64, Pending>, Option<(u64, Arc<[u8]>)>) {
    let mut pending = BTreeMap::new();
    for (slot, (len, opcode, unique)) in arena.pending() {
        match opcode {
            // They want no answer, so nothing would ever free their slot;
            // a forget not passed on only keeps an inode cached.
            FUSE_FORGET | FUSE_BATCH_FORGET | FUSE_INTERRUPT => arena.release(slot),
            _ => {
                if opcode == FUSE_INIT && arena.init().is_none() {
                    // The holder died between reading INIT and keeping it.
                    arena.set_init(arena.request(slot, len as usize));
                }
                let p = Pending {
                    slot,
                    len: len as usize,
                    sent_to: 0,
                };
                pending.insert(unique, p);
            }
        }
    }
    let init = arena.init().map(|(u, b)| (u, Arc::<[u8]>::from(b)));
    if !pending.is_empty() {
        info!(
            "adopted {} unanswered requests from the holder before",
            pending.len()
        );
    }
    (pending, init)
}

/// Opens `/dev/fuse` and mounts it at `mp` as a read-only forkd-fs mount
/// (root only: an unprivileged mount goes through fusermount3, which keeps
/// the connection itself).
pub fn mount(mp: &Path, gid: Option<u32>) -> Result<Mounted> {
    use nix::fcntl::{open, OFlag};
    use nix::mount::MsFlags;
    let dev = open(
        "/dev/fuse",
        OFlag::O_RDWR | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .context("opening /dev/fuse (is the fuse module loaded?)")?;
    // SAFETY: a new fd that nothing else owns.
    let dev = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(dev) };
    let mut data = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,default_permissions",
        dev.as_raw_fd()
    );
    if gid.is_some() {
        data.push_str(",allow_other");
    }
    nix::mount::mount(
        Some(crate::mount::FSNAME),
        mp,
        Some(format!("fuse.{}", crate::mount::SUBTYPE).as_str()),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
        Some(data.as_str()),
    )
    .with_context(|| format!("mounting FUSE at {}", mp.display()))?;
    Ok(Mounted {
        dev,
        arena: Arena::create()?,
    })
}

/// Whether this process can hold a mount itself (mount(2) needs root).
pub fn can_hold() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Refuses a worker socket that is not one (a worker started by hand).
pub fn check_worker_fd(fd: &OwnedFd) -> Result<()> {
    match socket::getsockopt(fd, socket::sockopt::SockType) {
        Ok(SockType::SeqPacket) => Ok(()),
        _ => bail!(
            "fd {} is not a packet socket: `forkd-fs worker` is started by `forkd-fs mount`, not by hand",
            fd.as_raw_fd()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse() {
        let mut b = vec![0u8; 40];
        b[0..4].copy_from_slice(&40u32.to_ne_bytes());
        b[4..8].copy_from_slice(&FUSE_INIT.to_ne_bytes());
        b[8..16].copy_from_slice(&77u64.to_ne_bytes());
        assert_eq!(in_header(&b), Some((40, FUSE_INIT, 77)));
        assert_eq!(out_unique(&b[..16]), Some(77));
        assert_eq!(in_header(&b[..10]), None);
    }

    /// Reads a request into a fresh slot, as the kernel reader does.
    fn read_in(a: &Arena, unique: u64, opcode: u32) -> usize {
        let i = a.take();
        // SAFETY: just taken.
        let s = unsafe { a.slot_mut(i) };
        s[0..4].copy_from_slice(&64u32.to_ne_bytes());
        s[4..8].copy_from_slice(&opcode.to_ne_bytes());
        s[8..16].copy_from_slice(&unique.to_ne_bytes());
        i
    }

    #[test]
    fn an_adopter_replays_what_wants_an_answer_and_lets_go_of_forgets() {
        const LOOKUP: u32 = 1;
        let a = Arena::create().unwrap();
        // The holder died after reading INIT, before keeping a copy.
        read_in(&a, 1, FUSE_INIT);
        read_in(&a, 5, LOOKUP);
        let forget = read_in(&a, 6, FUSE_FORGET);
        read_in(&a, 7, FUSE_INTERRUPT);
        let (pending, init) = adopted(&a);
        assert_eq!(pending.keys().copied().collect::<Vec<_>>(), vec![1, 5]);
        assert_eq!(init.map(|(u, _)| u), Some(1), "INIT kept for later workers");
        let left: Vec<u64> = a.pending().iter().map(|(_, h)| h.2).collect();
        assert_eq!(left, vec![1, 5], "forgets and interrupts freed");
        assert!(
            a.take() == forget || a.take() == forget,
            "their slots reused"
        );
    }
}
