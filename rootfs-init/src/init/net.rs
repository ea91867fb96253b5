//! Minimal network setup with ioctls (images need not ship iproute2):
//! loopback always, and eth0 when the host gave an address on the command line.

use anyhow::{bail, Context, Result};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned immediately.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        bail!("socket: {}", std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req
}

fn ioctl(sock: &OwnedFd, op: libc::c_ulong, req: &mut libc::ifreq, what: &str) -> Result<()> {
    // SAFETY: `req` is a valid ifreq for the interface ioctls used here.
    if unsafe { libc::ioctl(sock.as_raw_fd(), op, req as *mut libc::ifreq) } < 0 {
        bail!("{what}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sets IFF_UP on `name`.
pub fn link_up(name: &str) -> Result<()> {
    let sock = socket()?;
    let mut req = ifreq(name);
    ioctl(
        &sock,
        libc::SIOCGIFFLAGS,
        &mut req,
        &format!("get flags of {name}"),
    )?;
    // SAFETY: the union member written by SIOCGIFFLAGS.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    ioctl(
        &sock,
        libc::SIOCSIFFLAGS,
        &mut req,
        &format!("bring {name} up"),
    )
}

fn sockaddr(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size on Linux.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// Parses `a.b.c.d/prefix`.
pub fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8)> {
    let (a, p) = s.split_once('/').unwrap_or((s, "24"));
    let addr: Ipv4Addr = a.parse().with_context(|| format!("bad address {a:?}"))?;
    let prefix: u8 = p
        .parse()
        .ok()
        .filter(|p| *p <= 32)
        .with_context(|| format!("bad prefix {p:?}"))?;
    Ok((addr, prefix))
}

/// Assigns `cidr` to `name`, brings it up and adds a default route via `gw`.
pub fn configure(name: &str, cidr: &str, gw: Option<&str>) -> Result<()> {
    let (addr, prefix) = parse_cidr(cidr)?;
    let sock = socket()?;
    let mut req = ifreq(name);
    req.ifr_ifru.ifru_addr = sockaddr(addr);
    ioctl(
        &sock,
        libc::SIOCSIFADDR,
        &mut req,
        &format!("set address of {name}"),
    )?;
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    let mut req = ifreq(name);
    req.ifr_ifru.ifru_netmask = sockaddr(Ipv4Addr::from(mask));
    ioctl(
        &sock,
        libc::SIOCSIFNETMASK,
        &mut req,
        &format!("set netmask of {name}"),
    )?;
    link_up(name)?;
    if let Some(gw) = gw {
        add_default_route(
            &sock,
            gw.parse().with_context(|| format!("bad gateway {gw:?}"))?,
        )?;
    }
    Ok(())
}

fn add_default_route(sock: &OwnedFd, gw: Ipv4Addr) -> Result<()> {
    // SAFETY: rtentry is plain old data; all-zero is valid.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr(gw);
    rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    // SAFETY: SIOCADDRT takes a valid rtentry.
    if unsafe {
        libc::ioctl(
            sock.as_raw_fd(),
            libc::SIOCADDRT,
            &mut rt as *mut libc::rtentry,
        )
    } < 0
    {
        bail!(
            "add default route via {gw}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}
