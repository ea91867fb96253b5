//! The guest end of the agent's virtio-serial port.
//!
//! A read of 0 bytes means the host side is not connected (no client on the
//! host's unix socket); the port stays open and the host may connect again.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
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
    fd: AsyncFd<OwnedFd>,
}

impl Port {
    /// Opens the port device at `path` non-blocking.
    pub fn open(path: &std::path::Path) -> io::Result<Port> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)?;
        // SAFETY: the OwnedFd is moved into the AsyncFd and stays open and
        // unchanged for its whole lifetime.
        let fd = unsafe { AsyncFd::register(OwnedFd::from(f)) }.map_err(|e| e.into_parts().1)?;
        Ok(Port { fd })
    }

    /// Reads some bytes; `Ok(0)` means the host is not connected.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| {
                nix::unistd::read(fd.get_ref().as_raw_fd(), buf).map_err(io::Error::from)
            }) {
                Ok(Ok(0)) => {
                    guard.clear_ready();
                    return Ok(0);
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(r) => return r,
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data`, waiting while the host is disconnected.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from))
            {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }
}
