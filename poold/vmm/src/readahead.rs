//! Narrowing the kernel readahead of one file a running process has open
//! (docs/design.md, "Spawn"; the figures: docs/BENCHMARKS.md, "Lazy
//! snapshots").
//!
//! A restored child's RAM is a private mapping of `memory.bin` on the
//! forkd-fs mount, and a page fault in it reads the readahead window
//! around the page (the mount's is 1 MiB, good for the rootfs and for
//! copies). For guest RAM most of that window is never touched: a child of
//! a lazy snapshot fetches it from the hub before its first answer, and
//! the working set recorded at a snapshot's first restore holds it. The
//! window a file gets is copied from its filesystem's at `open` (QEMU's
//! open: it takes a path, not a descriptor) and again at
//! `posix_fadvise(POSIX_FADV_NORMAL)`, so this takes QEMU's descriptor
//! (`pidfd_getfd`: the same open file), sets the mount's window to the
//! narrow one, advises it, and puts the mount's window back.
//!
//! Invariants: the mount's window is changed only under an exclusive lock
//! on `lock` (every process narrowing on that mount takes it, and so does
//! forkd-fs setting the window) and always put back before the lock is
//! released; a failure leaves the file with the mount's window, never the
//! mount with the narrow one (unless the process dies between the two
//! writes: then every later open of the mount reads narrower, which costs
//! speed only, until forkd-fs sets its window again at its next start).
//! A file another process opens on the mount in the microseconds the
//! narrow window is up keeps it for its life: speed only, too.

use std::fs::File;
use std::io::{Error, ErrorKind, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The readahead window a restored child's `memory.bin` gets, KiB: the
/// chunk-sized neighbourhood of a fault, not the mount's 1 MiB. Measured
/// on the python-numpy snapshot under TCG: a lazy first answer over a
/// 100 Mbit/s link in 2.0 s instead of 2.8 s (14.6 MiB fetched instead of
/// 24.2), a cold local first child ~5–14 % slower.
pub const MEMORY_READAHEAD_KIB: u32 = 32;

/// Gives the open file `file` of process `pid` a readahead window of
/// `kib` KiB, for the life of that open file. `lock` is a file beside the
/// mount that serializes the mount's window between processes (forkd-fs
/// takes it too: `forkd_fs::readahead_lock_path`). Needs ptrace access to
/// `pid` (CAP_SYS_PTRACE for a jailed QEMU: another uid, not dumpable) and
/// the `pidfd_getfd` system call; without them, an error that says so.
pub fn narrow(pid: u32, file: &Path, kib: u32, lock: &Path) -> Result<()> {
    let want = std::fs::metadata(file)?;
    let no_access = |e: Error| {
        match e.kind() {
        ErrorKind::PermissionDenied => Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "no access to process {pid}'s descriptors ({e}): give poold CAP_SYS_PTRACE and allow pidfd_getfd (poold/systemd/poold.service does)"
            ),
        ),
        _ => e,
    }
    };
    let theirs = find_fd(pid, want.dev(), want.ino()).map_err(no_access)?;
    let fd = steal_fd(pid, theirs).map_err(no_access)?;
    let knob = bdi_knob(want.dev());
    let guard = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock)?;
    nix::fcntl::Flock::lock(guard, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| Error::from(e))
        .and_then(|_locked| advise_with(&knob, kib, &fd))
}

/// Sets the mount's window to `kib`, advises `fd` (which copies it), and
/// puts the old window back, whatever the advice did.
fn advise_with(knob: &Path, kib: u32, fd: &OwnedFd) -> Result<()> {
    let old = std::fs::read_to_string(knob)?;
    std::fs::write(knob, kib.to_string())?;
    // SAFETY: a valid descriptor we own; the advice only changes its
    // readahead state.
    let rc = unsafe { libc::posix_fadvise(fd.as_raw_fd(), 0, 0, libc::POSIX_FADV_NORMAL) };
    let back = std::fs::write(knob, old.trim());
    if rc != 0 {
        return Err(Error::from_raw_os_error(rc));
    }
    back
}

/// The descriptor number under which `pid` has the file (`dev`, `ino`)
/// open.
fn find_fd(pid: u32, dev: u64, ino: u64) -> Result<i32> {
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let e = e?;
        let Ok(m) = std::fs::metadata(e.path()) else {
            continue;
        };
        if m.dev() == dev && m.ino() == ino {
            if let Some(n) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
                return Ok(n);
            }
        }
    }
    Err(Error::new(
        ErrorKind::NotFound,
        format!("process {pid} does not have the file open"),
    ))
}

/// A descriptor for process `pid`'s descriptor `fd`: the same open file.
fn steal_fd(pid: u32, fd: i32) -> Result<OwnedFd> {
    // SAFETY: plain syscalls on integers; each result is checked.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(Error::last_os_error());
    }
    // SAFETY: pidfd_open returned a new descriptor that we now own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: as above.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(Error::last_os_error());
    }
    // SAFETY: pidfd_getfd returned a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
}

/// The sysfs file holding the readahead window of the filesystem on
/// device `dev`.
fn bdi_knob(dev: u64) -> PathBuf {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    PathBuf::from(format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Write};

    /// Pages of `file` in the page cache (mincore on a mapping of ours).
    fn cached_pages(file: &File, len: usize) -> usize {
        // SAFETY: a read-only shared mapping of a file we hold open,
        // unmapped before returning; mincore writes one byte per page.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let mut v = vec![0u8; len.div_ceil(4096)];
            assert_eq!(libc::mincore(p, len, v.as_mut_ptr()), 0);
            libc::munmap(p, len);
            v.iter().filter(|b| **b & 1 == 1).count()
        }
    }

    /// How many pages one page fault in the middle of a cold file reads,
    /// in a process whose file was narrowed to `kib` (None: left alone).
    fn pages_one_fault_reads(kib: Option<u32>) -> usize {
        const LEN: usize = 8 << 20;
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, vec![0x5au8; LEN]).unwrap();
        let f = File::open(&path).unwrap();
        f.sync_all().unwrap();
        // SAFETY: advice on our own descriptor: drop its cached pages.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(cached_pages(&f, LEN), 0, "the file should start cold");
        // A process that opens the file, then faults one page of a
        // private mapping of it when told to.
        let script = r#"
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
print("open", flush=True)
sys.stdin.readline()
m[4 << 20]
print("touched", flush=True)
sys.stdin.readline()
"#;
        let mut child = std::process::Command::new("python3")
            .args(["-c", script, path.to_str().unwrap()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut stdin = child.stdin.take().unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "open");
        if let Some(kib) = kib {
            narrow(child.id(), &path, kib, &dir.path().join("ra.lock")).unwrap();
        }
        writeln!(stdin).unwrap();
        line.clear();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "touched");
        let n = cached_pages(&f, LEN);
        writeln!(stdin).unwrap();
        child.wait().unwrap();
        n
    }

    /// A fault in a narrowed file reads its narrow window; left alone, the
    /// filesystem's (this host's root disk: 128 KiB). The filesystem's own
    /// window is unchanged after.
    #[test]
    fn a_narrowed_file_reads_less_around_a_fault() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root (pidfd_getfd, the bdi's window)");
            return;
        }
        let probe = tempfile::tempfile_in("/var/tmp").unwrap();
        let knob = bdi_knob(probe.metadata().unwrap().dev());
        let before = std::fs::read_to_string(&knob).unwrap();
        let wide = pages_one_fault_reads(None);
        let narrow = pages_one_fault_reads(Some(0));
        assert!(narrow < wide, "narrowed {narrow} pages, left alone {wide}");
        assert!(narrow <= 4, "a fault with no readahead read {narrow} pages");
        assert_eq!(std::fs::read_to_string(&knob).unwrap(), before);
    }

    #[test]
    fn a_file_the_process_lacks_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("closed");
        std::fs::write(&path, b"x").unwrap();
        let lock = dir.path().join("ra.lock");
        let e = narrow(std::process::id(), &path, 32, &lock).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        assert!(e.to_string().contains("does not have the file open"), "{e}");
    }
}
