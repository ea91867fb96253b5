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

#[cfg(test)]
mod tests {
    use super::*;

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
