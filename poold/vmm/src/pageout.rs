//! Moving a parked VM's memory to swap (pools with `page_out`,
//! docs/poold.md).
//!
//! The kernel does the work: `process_madvise(MADV_PAGEOUT)` over every
//! private mapping of the QEMU process reclaims the pages that process alone
//! maps. Its anonymous memory — TCG's translated code, QEMU's heap, the
//! guest pages the child wrote since its restore — goes to swap; page cache
//! shared with siblings (memory.bin, QEMU's binary) stays, since other
//! processes map it. Nothing changes what the process sees: a page it
//! touches again is read back from swap, so a hand-out pays those reads.
//!
//! Invariants:
//! - the target is named by a pidfd opened *before* its identity is
//!   checked against the VM record, so a recycled pid is never advised;
//! - without swap the kernel keeps anonymous pages where they are: paging
//!   out is then a no-op, never an error (callers check [`swap_total_kib`]
//!   to tell the operator).

use crate::process::ProcId;
use anyhow::{bail, Context, Result};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Total swap of this host, KiB (`SwapTotal` in /proc/meminfo); 0 without swap.
pub fn swap_total_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .map(|t| meminfo_field(&t, "SwapTotal").unwrap_or(0))
        .unwrap_or(0)
}

/// The `Name:  N kB` field `name` of a /proc/meminfo or smaps_rollup
/// text, KiB.
pub fn meminfo_field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == name).then(|| v.split_whitespace().next()?.parse().ok())?
    })
}

/// A process's resident and swapped memory, KiB (`/proc/<pid>/smaps_rollup`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemUse {
    /// Proportional set size: resident pages, shared ones divided.
    pub pss_kib: u64,
    /// Resident anonymous pages (this process's share).
    pub pss_anon_kib: u64,
    /// Pages of this process in swap (its share).
    pub swap_pss_kib: u64,
}

/// Reads `pid`'s [`MemUse`].
pub fn mem_use(pid: u32) -> Result<MemUse> {
    let p = format!("/proc/{pid}/smaps_rollup");
    let t = std::fs::read_to_string(&p).with_context(|| format!("reading {p}"))?;
    Ok(MemUse {
        pss_kib: meminfo_field(&t, "Pss").unwrap_or(0),
        pss_anon_kib: meminfo_field(&t, "Pss_Anon").unwrap_or(0),
        swap_pss_kib: meminfo_field(&t, "SwapPss").unwrap_or(0),
    })
}

/// Asks the kernel to page out what process `proc` alone holds. Returns the
/// bytes of address space advised. Errors: the process is gone or is not
/// `proc` any more, or this kernel lacks `process_madvise` (Linux < 5.10)
/// or refuses it (CAP_SYS_NICE and ptrace access are needed).
pub fn page_out(proc: &ProcId) -> Result<u64> {
    let pidfd = pidfd_open(proc.pid)?;
    // The pidfd pins the process; only now is its identity worth checking.
    if !proc.is_alive() {
        bail!("process {} has exited", proc.pid);
    }
    let maps_path = format!("/proc/{}/maps", proc.pid);
    let maps =
        std::fs::read_to_string(&maps_path).with_context(|| format!("reading {maps_path}"))?;
    let mut advised = 0u64;
    for (start, len) in private_ranges(&maps) {
        let iov = libc::iovec {
            iov_base: start as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: the iovec names ranges of *another* process's address
        // space; the kernel only reads the iovec array from ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_process_madvise,
                std::os::fd::AsRawFd::as_raw_fd(&pidfd),
                &iov as *const libc::iovec,
                1usize,
                libc::MADV_PAGEOUT,
                0u32,
            )
        };
        if r >= 0 {
            advised += r as u64;
            continue;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            // A mapping the kernel will not page out (locked, PFN-mapped)
            // or one unmapped since the maps were read: skip it.
            Some(libc::EINVAL) | Some(libc::ENOMEM) => {}
            Some(libc::ESRCH) => bail!("process {} has exited", proc.pid),
            _ => {
                return Err(std::io::Error::last_os_error()).with_context(|| {
                    format!(
                        "process_madvise(MADV_PAGEOUT) on QEMU pid {} (needs Linux 5.10+ and CAP_SYS_NICE)",
                        proc.pid
                    )
                })
            }
        }
    }
    Ok(advised)
}

fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    // SAFETY: a plain syscall; a non-negative result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("pidfd_open({pid})"));
    }
    // SAFETY: fd was just returned by the kernel and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// The private mappings in a `/proc/<pid>/maps` text, as (start, length):
/// those hold the pages a process can own. The kernel's own mappings
/// (vdso, vvar, vsyscall) are left out.
fn private_ranges(maps: &str) -> Vec<(usize, usize)> {
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            let name = f.nth(3).unwrap_or("");
            if !perms.ends_with('p') || name.starts_with("[v") {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            );
            (b > a).then_some((a, b - a))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_ranges_keep_private_mappings_only() {
        let maps = "\
55d0c0000000-55d0c0100000 r-xp 00000000 fe:01 123  /usr/bin/qemu-system-x86_64
7f0000000000-7f0040000000 rwxp 00000000 00:00 0
7f1000000000-7f1020000000 rw-s 00000000 00:2f 7   /dev/shm/x
7ffd1000000-7ffd1002000 r--p 00000000 00:00 0   [vvar]
7ffd1002000-7ffd1004000 r-xp 00000000 00:00 0   [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]
";
        assert_eq!(
            private_ranges(maps),
            vec![(0x55d0c0000000, 0x100000), (0x7f0000000000, 0x40000000)]
        );
    }

    #[test]
    fn meminfo_fields_parse() {
        let t = "SwapCached:            0 kB\nSwapTotal:       4194300 kB\nSwapFree: 1 kB\n";
        assert_eq!(meminfo_field(t, "SwapTotal"), Some(4194300));
        assert_eq!(meminfo_field(t, "Swap"), None);
    }

    #[test]
    fn a_child_process_pages_out_what_it_wrote() {
        // A child writes 8 MiB and waits; paging it out succeeds whether or
        // not this host has swap (without swap nothing moves).
        let mut child = std::process::Command::new("python3")
            .args(["-c", "import sys; b = bytearray(8 << 20); b[::4096] = b'x' * 2048; sys.stdout.write('ok\\n'); sys.stdout.flush(); sys.stdin.read()"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        let id = ProcId::of(child.id()).unwrap();
        let advised = page_out(&id).unwrap();
        assert!(advised >= 8 << 20, "advised {advised} bytes");
        if swap_total_kib() > 0 {
            let m = mem_use(child.id()).unwrap();
            assert!(m.swap_pss_kib >= 4 << 10, "{m:?}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(page_out(&id).is_err(), "a dead process must not be advised");
    }
}
