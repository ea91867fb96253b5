//! Giving a forked child its own identity. Every child resumes with the
//! parent's CRNG state, clock and hostname; before it is handed out the host
//! sends fresh entropy and its wall clock.

use crate::protocol::{AgentError, ErrorKind};
use std::os::fd::AsRawFd;

// From <linux/random.h>.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Mixes `entropy` into the kernel's input pool (crediting it) and forces the
/// CRNG to reseed at once, so `/dev/urandom` and `getrandom` diverge from the
/// parent's output immediately rather than at the next periodic reseed.
pub fn add_entropy(entropy: &[u8]) -> Result<(), AgentError> {
    if entropy.is_empty() {
        return Ok(());
    }
    let words = entropy.len().div_ceil(4);
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = vec![0u32; 2 + words];
    info[0] = (entropy.len() * 8) as u32;
    info[1] = entropy.len() as u32;
    let bytes: &mut [u8] = bytemuck_u32(&mut info[2..]);
    bytes[..entropy.len()].copy_from_slice(entropy);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| AgentError::io("/dev/urandom", &e))?;
    // SAFETY: `info` is a valid rand_pool_info of the advertised size.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) };
    if rc != 0 {
        return Err(ioctl_err("RNDADDENTROPY"));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) };
    if rc != 0 {
        return Err(ioctl_err("RNDRESEEDCRNG"));
    }
    Ok(())
}

fn bytemuck_u32(words: &mut [u32]) -> &mut [u8] {
    // SAFETY: u8 has no alignment requirement and every bit pattern is valid.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 4) }
}

fn ioctl_err(what: &str) -> AgentError {
    AgentError::new(
        ErrorKind::Io,
        format!(
            "{what} on /dev/urandom: {}",
            std::io::Error::last_os_error()
        ),
    )
}

/// Sets CLOCK_REALTIME to the host's time; returns guest-minus-host skew in ms
/// measured just before the change.
pub fn set_clock(unix_time_ns: u64) -> Result<i64, AgentError> {
    use nix::time::{clock_gettime, clock_settime, ClockId};
    let now = clock_gettime(ClockId::CLOCK_REALTIME)
        .map_err(|e| AgentError::new(ErrorKind::Io, format!("clock_gettime: {e}")))?;
    let now_ns = now.tv_sec() as i128 * 1_000_000_000 + now.tv_nsec() as i128;
    let skew_ms = ((now_ns - unix_time_ns as i128) / 1_000_000) as i64;
    let ts = nix::sys::time::TimeSpec::new(
        (unix_time_ns / 1_000_000_000) as libc::time_t,
        (unix_time_ns % 1_000_000_000) as libc::c_long,
    );
    clock_settime(ClockId::CLOCK_REALTIME, ts)
        .map_err(|e| AgentError::new(ErrorKind::Io, format!("clock_settime: {e}")))?;
    Ok(skew_ms)
}

/// Sets the kernel hostname after checking it is a valid DNS label sequence.
pub fn set_hostname(name: &str) -> Result<(), AgentError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .split('.')
            .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    if !ok {
        return Err(AgentError::new(
            ErrorKind::BadRequest,
            format!("bad hostname {name:?}: 1-64 chars of letters, digits, '-' and '.'"),
        ));
    }
    nix::unistd::sethostname(name)
        .map_err(|e| AgentError::new(ErrorKind::Io, format!("sethostname: {e}")))
}

/// The current hostname.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default()
}

/// Most nameservers resolv.conf honours (glibc's MAXNS).
pub const MAX_NAMESERVERS: usize = 3;

/// Replaces `/etc/resolv.conf` with `nameservers` (written to a temporary
/// file, then renamed, so a reader never sees half a file). A symlinked
/// resolv.conf is replaced by a file.
pub fn write_resolv_conf(nameservers: &[std::net::Ipv4Addr]) -> Result<(), AgentError> {
    write_resolv_conf_at(std::path::Path::new("/etc/resolv.conf"), nameservers)
}

fn write_resolv_conf_at(
    path: &std::path::Path,
    nameservers: &[std::net::Ipv4Addr],
) -> Result<(), AgentError> {
    if nameservers.len() > MAX_NAMESERVERS {
        return Err(AgentError::new(
            ErrorKind::BadRequest,
            format!(
                "{} nameservers given; resolv.conf holds at most {MAX_NAMESERVERS}",
                nameservers.len()
            ),
        ));
    }
    let mut text = String::from("# written by forkd-agent at hand-out\n");
    for ns in nameservers {
        text.push_str(&format!("nameserver {ns}\n"));
    }
    text.push_str("options timeout:2 attempts:2\n");
    let tmp = path.with_extension("forkd-tmp");
    std::fs::write(&tmp, text).map_err(|e| AgentError::io(&tmp.to_string_lossy(), &e))?;
    std::fs::rename(&tmp, path).map_err(|e| AgentError::io(&path.to_string_lossy(), &e))
}

#[cfg(test)]
mod resolv_tests {
    use super::*;

    #[test]
    fn resolv_conf_is_written_whole_and_bounded() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("resolv.conf");
        std::os::unix::fs::symlink("/nonexistent", &p).unwrap();
        write_resolv_conf_at(&p, &["192.0.2.53".parse().unwrap()]).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.contains("nameserver 192.0.2.53\n"), "{text}");
        assert!(!p.symlink_metadata().unwrap().file_type().is_symlink());
        let four = ["192.0.2.1".parse().unwrap(); 4];
        assert!(write_resolv_conf_at(&p, &four).is_err());
    }
}
