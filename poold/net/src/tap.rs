//! Persistent tap devices. A tap is created inside a child's namespace by
//! poold; QEMU gets an open descriptor to it, opened in the namespace just
//! before the jail drops privileges ([`open_tap_in`]).

use crate::{NetError, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
/// The flags every forkd tap is created and opened with (QEMU's own: a
/// tap without packet info, with virtio-net headers).
pub const TAP_FLAGS: libc::c_short =
    (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;

fn ifreq(name: &str, flags: libc::c_short) -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req
        .ifr_name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *d = s as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = flags;
    req
}

/// Creates the persistent tap `name` in the calling thread's namespace.
pub(crate) fn create_persistent(name: &str) -> Result<()> {
    let fd = open_tun().map_err(|e| NetError::io("opening /dev/net/tun", e))?;
    let mut req = ifreq(name, TAP_FLAGS);
    // SAFETY: TUNSETIFF and TUNSETPERSIST take an ifreq / an int, both valid.
    unsafe {
        if libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut req as *mut libc::ifreq) < 0 {
            return Err(NetError::io(
                format!("creating tap {name}"),
                std::io::Error::last_os_error(),
            ));
        }
        if libc::ioctl(fd.as_raw_fd(), TUNSETPERSIST, 1 as libc::c_ulong) < 0 {
            return Err(NetError::io(
                format!("making tap {name} persistent"),
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

fn open_tun() -> std::io::Result<OwnedFd> {
    // SAFETY: a plain open(2) of a constant path; the fd is owned at once.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// For the jail, between fork and exec: enters the namespace open at
/// `netns_fd`, attaches to its [`crate::TAP`] and places the tap descriptor
/// at `target_fd` (without close-on-exec) for QEMU's `-netdev tap,fd=N`.
/// Only async-signal-safe system calls; no allocation.
///
/// # Safety
/// Call only in a forked child before exec, with `netns_fd` open.
pub unsafe fn open_tap_in(netns_fd: libc::c_int, target_fd: libc::c_int) -> std::io::Result<()> {
    let check = |r: libc::c_int| {
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    };
    check(libc::setns(netns_fd, libc::CLONE_NEWNET))?;
    let fd = check(libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR))?;
    let mut req = ifreq(crate::TAP, TAP_FLAGS);
    check(libc::ioctl(fd, TUNSETIFF, &mut req as *mut libc::ifreq))?;
    if fd != target_fd {
        check(libc::dup2(fd, target_fd))?;
        libc::close(fd);
    }
    Ok(())
}
