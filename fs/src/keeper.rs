//! Keeping a mount alive through its holder's death.
//!
//! The kernel keeps a FUSE connection while any process holds its
//! `/dev/fuse` fd. So a holder serves a duplicate of that fd, and of its
//! request arena (`arena`), to root on `<MOUNTPOINT>.keep` ([`serve`]); a
//! keeper (poold) takes them ([`fetch`]) and holds them. When the holder
//! dies, the mount stays and its callers wait; the keeper starts a new
//! holder with both ([`adopt`]), which replays every request the dead one
//! had read and not answered, starts a worker (which replays the dead
//! holder's journal: inode numbers, open handles) and serves on. VMs mapping
//! the mount never notice, as with a worker's death.
//!
//! Invariants:
//! - only root reaches the socket (0600, beside the mount point); it
//!   answers with the fds and nothing else, and reads nothing; a keeper
//!   believes only the holder itself, as root (`SO_PEERCRED`), and only
//!   the journal path of that holder;
//! - [`adopt`] never probes the mount through the filesystem: with no
//!   holder reading, such a probe waits, and a caller that took the wait
//!   for a hung daemon would abort the connection;
//! - a holder and its adopter never serve at once: a keeper adopts only
//!   once the holder's process is gone ([`holder_gone`]).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use nix::sys::socket::{self, ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr};
use serde::{Deserialize, Serialize};

use crate::mount::{self, MountConfig};

/// The fds a holder started with `--adopt-journal` finds: the connection
/// and the arena.
pub const ADOPT_DEV_FD: i32 = 3;
/// See [`ADOPT_DEV_FD`].
pub const ADOPT_ARENA_FD: i32 = 4;

/// What a holder says of itself with its fds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Info {
    /// The holder's pid.
    pub holder_pid: u32,
    /// Its journal (what its workers handed out), which an adopter takes
    /// over.
    pub journal: PathBuf,
    /// The mount's device (`major:minor`): a path mounted again since
    /// holds another connection, and the kept one is not adopted there.
    #[serde(default)]
    pub dev: Option<String>,
}

/// The keeper socket of a mount: `<MOUNTPOINT>.keep`.
pub fn keep_path(mountpoint: &Path) -> PathBuf {
    let mut s = mountpoint.as_os_str().to_owned();
    s.push(".keep");
    PathBuf::from(s)
}

/// Binds the keeper socket (0600), replacing a dead holder's.
pub fn bind(mountpoint: &Path) -> Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let p = keep_path(mountpoint);
    let _ = std::fs::remove_file(&p);
    let l = UnixListener::bind(&p).with_context(|| format!("binding {}", p.display()))?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Answers every connection with `info` and duplicates of `dev` and
/// `arena` (SCM_RIGHTS), until the listener fails.
pub fn serve(l: UnixListener, dev: &OwnedFd, arena: &OwnedFd, info: &Info) {
    let body = serde_json::to_vec(info).expect("Info serializes");
    for c in l.incoming() {
        let Ok(c) = c else { continue };
        let fds = [dev.as_raw_fd(), arena.as_raw_fd()];
        let cmsg = [ControlMessage::ScmRights(&fds)];
        let iov = [IoSlice::new(&body)];
        if let Err(e) =
            socket::sendmsg::<UnixAddr>(c.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
        {
            tracing::warn!("keeper socket: sending the mount's fds: {e}");
        }
    }
}

/// A mount's connection and arena, held for its holder.
#[derive(Debug)]
pub struct Kept {
    /// The holder's word on itself.
    pub info: Info,
    /// The `/dev/fuse` connection.
    pub dev: OwnedFd,
    /// The request arena's memfd.
    pub arena: OwnedFd,
}

/// Takes the fds of the holder of `mountpoint` from its keeper socket.
pub fn fetch(mountpoint: &Path) -> Result<Kept> {
    let p = keep_path(mountpoint);
    let c = UnixStream::connect(&p).with_context(|| format!("connecting to {}", p.display()))?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = vec![0u8; 64 << 10];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 2]);
    let (n, fds) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = socket::recvmsg::<UnixAddr>(
            c.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .with_context(|| format!("reading {}", p.display()))?;
        let mut fds: Vec<OwnedFd> = Vec::new();
        for cm in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(v) = cm {
                // SAFETY: fresh fds the kernel just gave us.
                fds.extend(v.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        (msg.bytes, fds)
    };
    let info: Info = serde_json::from_slice(&buf[..n])
        .with_context(|| format!("{} sent no holder description", p.display()))?;
    // Only the holder itself, as root, is believed: what it names is
    // renamed and served by root later.
    let peer = socket::getsockopt(&c, socket::sockopt::PeerCredentials)
        .with_context(|| format!("reading the peer of {}", p.display()))?;
    if peer.uid() != 0 || peer.pid() as u32 != info.holder_pid {
        bail!(
            "{} is served by pid {} (uid {}), not by the holder it names (pid {}) as root; remove it",
            p.display(),
            peer.pid(),
            peer.uid(),
            info.holder_pid
        );
    }
    let mut fds = fds.into_iter();
    match (fds.next(), fds.next()) {
        (Some(dev), Some(arena)) => Ok(Kept { info, dev, arena }),
        _ => bail!("{} sent no fds", p.display()),
    }
}

/// Whether process `pid` is gone (exited; a zombie counts as gone).
pub fn holder_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

/// Whether a `/dev/fuse` connection has ended: the kernel reports POLLERR
/// on it once it is aborted or its mount is gone.
fn ended(dev: &OwnedFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut p = [PollFd::new(dev.as_fd(), PollFlags::POLLIN)];
    poll(&mut p, PollTimeout::ZERO).is_ok()
        && p[0]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP))
}

/// Starts a holder for `cfg`'s mount that adopts `kept` (its holder must
/// be gone), and waits until its worker answers on the control socket.
pub fn adopt(cfg: &MountConfig, kept: &Kept) -> Result<()> {
    use std::os::unix::process::CommandExt;
    if !holder_gone(kept.info.holder_pid) {
        bail!(
            "the holder (pid {}) of {} still runs; nothing to adopt",
            kept.info.holder_pid,
            cfg.mountpoint.display()
        );
    }
    let control = cfg.control();
    if kept.info.journal != mount::journal_path(&control, kept.info.holder_pid) {
        bail!(
            "the kept holder names the journal {}, not its own; nothing to adopt",
            kept.info.journal.display()
        );
    }
    let mounted = mount::mount_at(&cfg.mountpoint)?.map(|e| e.dev);
    if kept.info.dev.is_none() || mounted != kept.info.dev {
        bail!(
            "{} no longer mounts the kept connection (device {:?}, kept {:?}); nothing to adopt",
            cfg.mountpoint.display(),
            mounted,
            kept.info.dev
        );
    }
    if ended(&kept.dev) {
        bail!(
            "the kept connection of {} has ended (aborted, or unmounted); nothing to adopt",
            cfg.mountpoint.display()
        );
    }
    let (mut cmd, bin) = mount::mount_command(cfg, &cfg.mountpoint, &control)?;
    cmd.arg("--adopt-journal").arg(&kept.info.journal);
    let (dev, arena) = (kept.dev.as_raw_fd(), kept.arena.as_raw_fd());
    // SAFETY: fcntl, dup2 and close are async-signal-safe. Both fds are
    // first copied above the targets (either may sit on 3 or 4, and dup2
    // onto itself would keep FD_CLOEXEC); dup2 then clears FD_CLOEXEC on
    // the targets, and the high copies go, so exactly these two reach the
    // new holder.
    unsafe {
        cmd.pre_exec(move || {
            let high = |fd: i32| {
                let h = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
                if h < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(h)
                }
            };
            let (d, a) = (high(dev)?, high(arena)?);
            for (from, to) in [(d, ADOPT_DEV_FD), (a, ADOPT_ARENA_FD)] {
                if libc::dup2(from, to) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(from);
            }
            Ok(())
        });
    }
    let out = cmd
        .output()
        .with_context(|| format!("starting {}", bin.display()))?;
    if !out.status.success() {
        return Err(anyhow!(
            "`{} mount --adopt-journal` failed ({}): {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match mount::control_status(&control, Duration::from_secs(2)) {
            Ok(st) if st.holder_pid.is_some_and(|p| p != kept.info.holder_pid) => return Ok(()),
            Ok(_) | Err(_) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Ok(_) => bail!(
                "the adopting holder did not take over {}",
                control.display()
            ),
            Err(e) => return Err(e.context("the adopting holder does not answer")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A keeper believes only the holder it was told of: a socket served
    /// by another process (here this test, naming pid 1) is refused.
    #[test]
    fn a_keeper_refuses_fds_from_anyone_but_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let mp = dir.path().join("mnt");
        let l = bind(&mp).unwrap();
        let null = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let (dev, arena) = (null(), null());
        let lie = Info {
            holder_pid: 1,
            journal: dir.path().join("mnt.journal.1"),
            dev: Some("0:1".into()),
        };
        std::thread::spawn(move || serve(l, &dev, &arena, &lie));
        let e = fetch(&mp).unwrap_err().to_string();
        assert!(e.contains("not by the holder it names (pid 1)"), "{e}");
    }
}
