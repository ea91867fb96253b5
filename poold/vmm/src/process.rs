//! Process identity that survives pid reuse: a pid plus its start time
//! (field 22 of /proc/<pid>/stat), so a record can prove whether the process
//! it names is still the same one.

use serde::{Deserialize, Serialize};

/// A specific process instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcId {
    /// The process id (may be reused once the process is gone).
    pub pid: u32,
    /// Clock ticks after boot at which the process started.
    pub start_time: u64,
}

impl ProcId {
    /// The identity of a running process, if it exists.
    pub fn of(pid: u32) -> Option<ProcId> {
        start_time(pid).map(|start_time| ProcId { pid, start_time })
    }

    /// This process.
    pub fn current() -> ProcId {
        ProcId::of(std::process::id()).expect("/proc/self/stat is readable")
    }

    /// True if this exact process is still running (not a zombie).
    pub fn is_alive(&self) -> bool {
        start_time(self.pid) == Some(self.start_time) && !is_zombie(self.pid)
    }
}

fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may contain spaces; fields after it start past the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    Some(rest.split_whitespace().map(String::from).collect())
}

fn start_time(pid: u32) -> Option<u64> {
    // `rest` starts at field 3 (state), so field 22 is index 19.
    stat_fields(pid)?.get(19)?.parse().ok()
}

fn is_zombie(pid: u32) -> bool {
    stat_fields(pid).and_then(|f| f.first().cloned()).as_deref() == Some("Z")
}

/// A process started through [`spawn`], watched with a pidfd so its exit can
/// be awaited from any runtime.
pub struct Spawned {
    child: std::process::Child,
    pidfd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl Spawned {
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit and reaps it.
    pub async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            let mut guard = self.pidfd.readable().await?;
            guard.clear_ready();
        }
    }

    /// Sends SIGKILL (no-op if it already exited).
    pub fn start_kill(&mut self) {
        let _ = self.child.kill();
    }
}

type SpawnJob = (
    std::process::Command,
    tokio::sync::oneshot::Sender<std::io::Result<std::process::Child>>,
);

/// Starts `cmd` from a dedicated thread that lives as long as this process.
///
/// Why: `PR_SET_PDEATHSIG` fires when the *thread* that forked the child
/// exits, not the process. Forking from a caller's thread (a test thread, a
/// runtime's blocking thread) would kill an ephemeral VM as soon as that
/// thread ends; forking from one immortal thread ties it to the process.
pub async fn spawn(cmd: std::process::Command) -> std::io::Result<Spawned> {
    use std::sync::{mpsc, Mutex, OnceLock};
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    let tx = SPAWNER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<SpawnJob>();
            std::thread::Builder::new()
                .name("forkd-spawner".into())
                .spawn(move || {
                    for (mut cmd, reply) in rx {
                        let _ = reply.send(cmd.spawn());
                    }
                })
                .expect("spawning the process-spawner thread");
            Mutex::new(tx)
        })
        .lock()
        .unwrap()
        .clone();
    let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
    tx.send((cmd, reply_tx))
        .map_err(|_| std::io::Error::other("process spawner thread is gone"))?;
    let child = reply_rx
        .await
        .map_err(|_| std::io::Error::other("process spawner thread dropped the request"))??;
    let pidfd = pidfd_open(child.id())?;
    // SAFETY: the OwnedFd is moved into the AsyncFd and owned by it until it
    // drops, so the descriptor stays open and unchanged while registered.
    let pidfd = unsafe { tokio::io::unix::AsyncFd::register(pidfd) }?;
    Ok(Spawned { child, pidfd })
}

fn pidfd_open(pid: u32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open returns a new fd or -1; the fd is owned at once.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Marks fds `first..=last` close-on-exec, between fork and exec (no
/// allocation, async-signal-safe calls only).
pub(crate) fn cloexec_range(first: u32, last: u32) {
    // SAFETY: close_range only changes flags of this process's fds.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first,
            last,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc != 0 {
        // Kernels before 5.11: one fcntl per possible fd.
        for fd in first..=last.min(4095) {
            // SAFETY: F_SETFD on an fd that may not exist fails with EBADF.
            unsafe { libc::fcntl(fd as i32, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
    }
}

/// `AUDIT_ARCH_*` of the target, as seccomp reports it.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;

/// Offsets in `struct seccomp_data`: `nr`, `arch`, and `args[2]`'s low
/// 32 bits (little-endian).
const SECCOMP_NR: u32 = 0;
const SECCOMP_ARCH: u32 = 4;
const SECCOMP_ARG2: u32 = 16 + 2 * 8;

/// A seccomp filter that answers `madvise(_, _, MADV_HUGEPAGE)` with
/// success and does nothing; every other call passes.
const NO_HUGEPAGE_ADVICE: [libc::sock_filter; 8] = {
    const fn stmt(code: u32, k: u32) -> libc::sock_filter {
        libc::sock_filter {
            code: code as u16,
            jt: 0,
            jf: 0,
            k,
        }
    }
    const fn jeq(k: u32, jt: u8, jf: u8) -> libc::sock_filter {
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt,
            jf,
            k,
        }
    }
    let load = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let ret = libc::BPF_RET | libc::BPF_K;
    [
        stmt(load, SECCOMP_ARCH),
        jeq(AUDIT_ARCH, 0, 5),
        stmt(load, SECCOMP_NR),
        jeq(libc::SYS_madvise as u32, 0, 3),
        stmt(load, SECCOMP_ARG2),
        jeq(libc::MADV_HUGEPAGE as u32, 0, 1),
        stmt(ret, libc::SECCOMP_RET_ERRNO), // errno 0: "done"
        stmt(ret, libc::SECCOMP_RET_ALLOW),
    ]
};

/// Makes `madvise(MADV_HUGEPAGE)` a no-op for this process and what it
/// execs, between fork and exec (one prctl on a constant program; the
/// caller has no_new_privs set, or is root).
///
/// Why (docs/BENCHMARKS.md, "Lazy snapshots"): QEMU advises huge pages on
/// all guest RAM, and a page fault in a file mapping so advised reads the
/// 2 MiB-aligned block around it, whatever the file's readahead: a
/// restored child's first touches of `memory.bin` read (and, from a lazy
/// snapshot, fetch from the hub) more than twice what the guest uses.
/// Under TCG the process has THP disabled anyway (`PR_SET_THP_DISABLE`),
/// so the advice buys nothing there.
pub(crate) fn refuse_hugepage_advice() -> std::io::Result<()> {
    let prog = libc::sock_fprog {
        len: NO_HUGEPAGE_ADVICE.len() as u16,
        filter: NO_HUGEPAGE_ADVICE.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: installs a filter from a valid, constant program; the kernel
    // copies it.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &prog as *const libc::sock_fprog,
            0,
            0,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Advises huge pages on a 4 MiB anonymous mapping and prints its
    /// `VmFlags` line from /proc/self/smaps.
    const ADVISE_AND_SHOW_FLAGS: &str = r#"
import ctypes, mmap
m = mmap.mmap(-1, 4 << 20)
m.madvise(mmap.MADV_HUGEPAGE)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
inside = False
for line in open("/proc/self/smaps").read().splitlines():
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= addr < hi
    elif inside and line.startswith("VmFlags"):
        print(line)
"#;

    /// The `VmFlags` of that mapping, in a process started with or without
    /// the filter.
    fn advised_flags(filtered: bool) -> String {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new("python3");
        cmd.args(["-c", ADVISE_AND_SHOW_FLAGS]);
        if filtered {
            // SAFETY: prctl calls only, between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    refuse_hugepage_advice()
                });
            }
        }
        let out = cmd.output().expect("python3");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[test]
    fn hugepage_advice_is_a_no_op_under_the_filter() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        if thp.is_err() {
            return; // no THP in this kernel: the advice means nothing anyway
        }
        assert!(advised_flags(false).contains(" hg"), "control: advice took");
        let flags = advised_flags(true);
        assert!(flags.starts_with("VmFlags"), "{flags}");
        assert!(!flags.contains(" hg"), "{flags}");
    }

    #[test]
    fn current_is_alive_and_stale_is_not() {
        let me = ProcId::current();
        assert!(me.is_alive());
        let stale = ProcId {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!stale.is_alive());
    }
}
