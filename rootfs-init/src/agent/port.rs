//! The guest end of the agent's virtio-serial port.
//!
//! A read of 0 bytes means the host side is not connected (no client on the
//! host's unix socket); the port stays open and the host may connect again.
//!
//! Invariant: readiness comes from an epoll registration that is replaced
//! after every hang-up. While the host is away the port polls as hung up
//! (`EPOLLHUP`), and tokio keeps a hang-up as readiness for good: it never
//! clears its "closed" bits. Left registered, the port would look readable
//! and writable forever once the host came back, and every read would
//! return EAGAIN at once: a busy loop (a whole host core per sandbox after
//! each poold restart, before this). So a read or write that would block
//! on a registration that saw a hang-up registers the port afresh.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::unix::AsyncFd;

/// Finds `/dev/vportNpM` whose port name is `name`, via sysfs.
pub fn find(name: &str) -> io::Result<PathBuf> {
    for ent in fs::read_dir("/sys/class/virtio-ports")? {
        let ent = ent?;
        let port_name = fs::read_to_string(ent.path().join("name")).unwrap_or_default();
        if port_name.trim() == name {
            return Ok(PathBuf::from("/dev").join(ent.file_name()));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no virtio-serial port named {name} (is virtio_console loaded?)"),
    ))
}

/// Non-blocking, async access to a port device.
pub struct Port {
    /// The open port: every read and write goes here.
    file: OwnedFd,
    /// The current readiness registration, on a duplicate of `file`.
    ready: Mutex<Arc<AsyncFd<OwnedFd>>>,
}

/// How long a writer waits before looking again while the host is away.
const HOST_AWAY_POLL: Duration = Duration::from_millis(20);

impl Port {
    /// Opens the port device at `path` non-blocking.
    pub fn open(path: &std::path::Path) -> io::Result<Port> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)?;
        let file = OwnedFd::from(f);
        let ready = Mutex::new(Arc::new(register(&file)?));
        Ok(Port { file, ready })
    }

    fn current(&self) -> Arc<AsyncFd<OwnedFd>> {
        self.ready.lock().unwrap().clone()
    }

    /// Replaces registration `seen` with a fresh one, unless another task
    /// has replaced it already.
    fn reregister(&self, seen: &Arc<AsyncFd<OwnedFd>>) -> io::Result<()> {
        let mut cur = self.ready.lock().unwrap();
        if Arc::ptr_eq(&cur, seen) {
            *cur = Arc::new(register(&self.file)?);
        }
        Ok(())
    }

    /// Reads some bytes; `Ok(0)` means the host is not connected.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let reg = self.current();
            let mut guard = reg.readable().await?;
            match nix::unistd::read(self.file.as_raw_fd(), buf).map_err(io::Error::from) {
                Ok(0) => {
                    guard.clear_ready();
                    return Ok(0);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if guard.ready().is_read_closed() {
                        // A stale hang-up: the host is back (a read would
                        // return 0 otherwise) but has nothing to say.
                        drop(guard);
                        self.reregister(&reg)?;
                    } else {
                        guard.clear_ready();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => return r,
            }
        }
    }

    /// Writes all of `data`, waiting while the host is disconnected.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let reg = self.current();
            let mut guard = reg.writable().await?;
            match nix::unistd::write(&self.file, data).map_err(io::Error::from) {
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if guard.ready().is_write_closed() {
                        // The host is away (or was): look again shortly
                        // through a fresh registration.
                        drop(guard);
                        tokio::time::sleep(HOST_AWAY_POLL).await;
                        self.reregister(&reg)?;
                    } else {
                        guard.clear_ready();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Registers a duplicate of `file` with the reactor (a registration owns
/// its fd, and closing that fd is what removes it from epoll).
fn register(file: &OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    let dup = file.try_clone()?;
    // SAFETY: the duplicate is moved into the AsyncFd and stays open and
    // unchanged for its whole lifetime.
    unsafe { AsyncFd::register(dup) }.map_err(|e| e.into_parts().1)
}
