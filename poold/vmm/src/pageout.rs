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
//! [`page_in`] is the way back, ahead of a hand-out: it reads the pages
//! the process has in swap through `process_vm_readv`, which faults each
//! one into the process exactly as if the process had touched it (the
//! kernel maps it and, for zram, frees the compressed copy). `MADV_WILLNEED`
//! would only stage pages in the swap cache, unmapped, and keep both copies.
//!
//! Invariants:
//! - the target is named by a pidfd opened *before* its identity is
//!   checked against the VM record, so a recycled pid is never advised;
//! - a page-in only reads: the bytes land in a scratch buffer and are
//!   dropped, and only pages `/proc/<pid>/pagemap` shows in swap are read
//!   (reading the rest would fault in zero pages that were never touched,
//!   most of TCG's 1 GiB code buffer);
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
    let (pidfd, ranges) = pin_private_ranges(proc)?;
    let mut advised = 0u64;
    for (start, len) in ranges {
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

/// Reads back into memory what process `proc` has in swap, so its next
/// run does not wait for it. Returns the bytes brought back. Errors as for
/// [`page_out`]; also when ptrace access to the process is refused
/// (`process_vm_readv` needs it, as root has).
pub fn page_in(proc: &ProcId) -> Result<u64> {
    let (_pidfd, ranges) = pin_private_ranges(proc)?;
    let pagemap_path = format!("/proc/{}/pagemap", proc.pid);
    let pagemap =
        std::fs::File::open(&pagemap_path).with_context(|| format!("opening {pagemap_path}"))?;
    let mut scratch = vec![0u8; PAGE_IN_CHUNK];
    let mut read = 0u64;
    for (start, len) in ranges {
        for (a, n) in swapped_runs(&pagemap, start, len)? {
            read += read_remote(proc, a, n, &mut scratch)?;
        }
    }
    Ok(read)
}

/// The scratch buffer of [`page_in`]: how much one `process_vm_readv` reads.
const PAGE_IN_CHUNK: usize = 1 << 20;
const PAGE: usize = 4096;
/// `/proc/<pid>/pagemap` entries read at once (8 bytes each).
const PAGEMAP_BATCH: usize = 32 << 10;

/// The runs of pages of `[start, start + len)` that are in swap (pagemap
/// bit 62 set, bit 63 "present" clear), as (address, bytes).
fn swapped_runs(pagemap: &std::fs::File, start: usize, len: usize) -> Result<Vec<(usize, usize)>> {
    use std::os::unix::fs::FileExt;
    let pages = len / PAGE;
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut buf = vec![0u8; PAGEMAP_BATCH * 8];
    let mut i = 0;
    while i < pages {
        let n = (pages - i).min(PAGEMAP_BATCH);
        let off = ((start / PAGE + i) * 8) as u64;
        let got = pagemap
            .read_at(&mut buf[..n * 8], off)
            .context("reading pagemap")?;
        if got == 0 {
            break;
        }
        for (j, e) in buf[..got].chunks_exact(8).enumerate() {
            let e = u64::from_ne_bytes(e.try_into().expect("8 bytes"));
            if e & (1 << 62) != 0 && e & (1 << 63) == 0 {
                let addr = start + (i + j) * PAGE;
                match runs.last_mut() {
                    Some((a, l)) if *a + *l == addr => *l += PAGE,
                    _ => runs.push((addr, PAGE)),
                }
            }
        }
        i += got / 8;
    }
    Ok(runs)
}

/// Reads `[addr, addr + len)` of `proc` into `scratch`, a chunk at a time.
/// A range unmapped meanwhile (EFAULT) ends early; that is not an error.
fn read_remote(proc: &ProcId, addr: usize, len: usize, scratch: &mut [u8]) -> Result<u64> {
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(scratch.len());
        let local = libc::iovec {
            iov_base: scratch.as_mut_ptr() as *mut libc::c_void,
            iov_len: n,
        };
        let remote = libc::iovec {
            iov_base: (addr + done) as *mut libc::c_void,
            iov_len: n,
        };
        // SAFETY: `local` covers `n` bytes of `scratch`, which we own
        // mutably; `remote` names another process's memory, which the
        // kernel reads on our behalf.
        let r =
            unsafe { libc::process_vm_readv(proc.pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if r > 0 {
            done += r as usize;
            continue;
        }
        if r == 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EFAULT) => break,
            Some(libc::ESRCH) => bail!("process {} has exited", proc.pid),
            _ => {
                return Err(err).with_context(|| {
                    format!(
                        "process_vm_readv on QEMU pid {} (needs ptrace access: root, or CAP_SYS_PTRACE)",
                        proc.pid
                    )
                })
            }
        }
    }
    Ok(done as u64)
}

/// A pidfd on `proc`, opened before its identity is checked (the
/// invariant above), and its private mappings ([`private_ranges`]).
fn pin_private_ranges(proc: &ProcId) -> Result<(OwnedFd, Vec<(usize, usize)>)> {
    let pidfd = pidfd_open(proc.pid)?;
    if !proc.is_alive() {
        bail!("process {} has exited", proc.pid);
    }
    let maps_path = format!("/proc/{}/maps", proc.pid);
    let maps =
        std::fs::read_to_string(&maps_path).with_context(|| format!("reading {maps_path}"))?;
    Ok((pidfd, private_ranges(&maps)))
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
    fn swapped_runs_join_adjacent_swapped_pages() {
        const SWAPPED: u64 = 1 << 62;
        const PRESENT: u64 = 1 << 63;
        let entries = [SWAPPED, SWAPPED, PRESENT, 0, SWAPPED, SWAPPED | PRESENT];
        let f = tempfile_with(&entries.map(u64::to_ne_bytes).concat());
        assert_eq!(
            swapped_runs(&f, 0, entries.len() * PAGE).unwrap(),
            vec![(0, 2 * PAGE), (4 * PAGE, PAGE)]
        );
        // A range starting further in reads its own entries.
        assert_eq!(
            swapped_runs(&f, 3 * PAGE, 3 * PAGE).unwrap(),
            vec![(4 * PAGE, PAGE)]
        );
    }

    fn tempfile_with(bytes: &[u8]) -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, bytes).unwrap();
        f
    }

    #[test]
    fn meminfo_fields_parse() {
        let t = "SwapCached:            0 kB\nSwapTotal:       4194300 kB\nSwapFree: 1 kB\n";
        assert_eq!(meminfo_field(t, "SwapTotal"), Some(4194300));
        assert_eq!(meminfo_field(t, "Swap"), None);
    }

    #[test]
    fn a_child_process_pages_out_what_it_wrote_and_back_in() {
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
        // Paging in brings back what went to swap, and only that.
        let back = page_in(&id).unwrap();
        if swap_total_kib() > 0 {
            let m = mem_use(child.id()).unwrap();
            assert!(back >= 4 << 20, "read back {back} bytes");
            assert!(m.swap_pss_kib < 1 << 10, "{m:?}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(page_out(&id).is_err(), "a dead process must not be advised");
        assert!(page_in(&id).is_err(), "a dead process must not be read");
    }
}
