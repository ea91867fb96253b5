//! Descriptor-relative file operations for E2B volumes, whose contents
//! guests wrote and so are hostile to the host ([`crate::store`],
//! [`crate::files`]).
//!
//! Invariants: nothing here resolves a path from `/`. Inside a volume,
//! paths resolve with `RESOLVE_IN_ROOT` (`..` and symlinks stay inside);
//! the store's own names resolve with `RESOLVE_BENEATH` and no symlinks
//! at all. Trees are walked and removed through directory descriptors,
//! never following a link, iteratively and at most [`MAX_TREE_DEPTH`]
//! deep, so a guest's million-level chain cannot exhaust poold's stack.

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use nix::unistd::{unlinkat, UnlinkatFlags};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Deepest tree removed.
pub const MAX_TREE_DEPTH: usize = 512;
/// Names read from a directory at a time while removing it.
const BATCH: usize = 256;

/// A descriptor nix just returned, owned.
pub fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: every caller passes a descriptor `open`/`openat2` has just
    // returned, which nothing else holds.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn open2(
    dir: &OwnedFd,
    rel: &str,
    flags: OFlag,
    mode: Mode,
    resolve: ResolveFlag,
) -> Result<OwnedFd, Errno> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .mode(mode)
        .resolve(resolve | ResolveFlag::RESOLVE_NO_MAGICLINKS | ResolveFlag::RESOLVE_NO_XDEV);
    openat2(dir.as_raw_fd(), rel, how).map(owned)
}

/// `rel` inside the volume `root`: `..` stops at the root and symlinks
/// resolve as if the root were `/`.
pub fn open_in(root: &OwnedFd, rel: &str, flags: OFlag, mode: Mode) -> Result<OwnedFd, Errno> {
    open2(root, rel, flags, mode, ResolveFlag::RESOLVE_IN_ROOT)
}

/// `rel` below `dir`, with no symlink anywhere on the way (`ELOOP`).
pub fn open_beneath(dir: &OwnedFd, rel: &str, flags: OFlag) -> Result<OwnedFd, Errno> {
    open2(
        dir,
        rel,
        flags,
        Mode::empty(),
        ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS,
    )
}

/// Up to `max` names of directory `dir` (not `.` and `..`), as raw bytes:
/// a guest's names need not be UTF-8.
pub fn names(dir: &OwnedFd, max: usize) -> Result<Vec<CString>, Errno> {
    let mut d = Dir::openat(
        Some(dir.as_raw_fd()),
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut out = Vec::new();
    for e in d.iter() {
        let e = e?;
        let n = e.file_name();
        if n.to_bytes() == b"." || n.to_bytes() == b".." {
            continue;
        }
        out.push(n.to_owned());
        if out.len() == max {
            break;
        }
    }
    Ok(out)
}

fn open_subdir(dir: &OwnedFd, name: &CString) -> Result<OwnedFd, Errno> {
    nix::fcntl::openat(
        Some(dir.as_raw_fd()),
        name.as_c_str(),
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map(owned)
}

/// Held by a tree removal, which may hold [`MAX_TREE_DEPTH`] descriptors:
/// one at a time, so removals cannot use up poold's descriptors.
static REMOVING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Removes `name` in `dir`: a file or link as it is, a directory with
/// everything in it. Deeper than [`MAX_TREE_DEPTH`] is `ELOOP`, with what
/// was removed so far gone.
pub fn remove_tree(dir: &OwnedFd, name: &CString) -> Result<(), Errno> {
    let _one = REMOVING.lock().unwrap_or_else(|p| p.into_inner());
    match unlinkat(
        Some(dir.as_raw_fd()),
        name.as_c_str(),
        UnlinkatFlags::NoRemoveDir,
    ) {
        Err(Errno::EISDIR) => {}
        r => return r,
    }
    // Open directories, each with its name in the one before (the first
    // in `dir`).
    let mut stack: Vec<(OwnedFd, CString)> = vec![(open_subdir(dir, name)?, name.clone())];
    while let Some((top, _)) = stack.last() {
        let batch = names(top, BATCH)?;
        if batch.is_empty() {
            let (_, done) = stack.pop().expect("the loop saw a top");
            let parent = stack.last().map(|(fd, _)| fd).unwrap_or(dir);
            unlinkat(
                Some(parent.as_raw_fd()),
                done.as_c_str(),
                UnlinkatFlags::RemoveDir,
            )?;
            continue;
        }
        let mut deeper = None;
        for n in batch {
            match unlinkat(
                Some(top.as_raw_fd()),
                n.as_c_str(),
                UnlinkatFlags::NoRemoveDir,
            ) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(Errno::EISDIR) => {
                    deeper = Some(n);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(n) = deeper {
            if stack.len() >= MAX_TREE_DEPTH {
                return Err(Errno::ELOOP);
            }
            let sub = open_subdir(top, &n)?;
            stack.push((sub, n));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_fd(p: &std::path::Path) -> OwnedFd {
        owned(nix::fcntl::open(p, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty()).unwrap())
    }

    /// Makes `d/d/d/...`, `depth` levels, in `dir`.
    fn chain(dir: &OwnedFd, depth: usize) {
        let mut cur = dir.try_clone().unwrap();
        for _ in 0..depth {
            nix::sys::stat::mkdirat(Some(cur.as_raw_fd()), "d", Mode::from_bits_truncate(0o755))
                .unwrap();
            let fd = nix::fcntl::openat(
                Some(cur.as_raw_fd()),
                "d",
                OFlag::O_PATH | OFlag::O_DIRECTORY,
                Mode::empty(),
            );
            cur = owned(fd.unwrap());
        }
    }

    /// A chain deeper than the stack a recursive removal would need, with
    /// a link out and a name that is not UTF-8, goes; the link's target
    /// stays.
    #[test]
    fn deep_trees_are_removed_without_following_links() {
        use std::os::unix::ffi::OsStrExt;
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), "k").unwrap();
        let top = d.path().join("t");
        std::fs::create_dir(&top).unwrap();
        let mut p = top.clone();
        chain(&dir_fd(&top), 300);
        p.push("d");
        std::os::unix::fs::symlink(outside.path(), p.join("out")).unwrap();
        std::fs::write(p.join(std::ffi::OsStr::from_bytes(b"\xff")), "x").unwrap();
        let root = dir_fd(d.path());
        remove_tree(&root, &CString::new("t").unwrap()).unwrap();
        assert!(!top.exists());
        assert!(outside.path().join("keep").exists());
    }

    /// Past the depth bound the removal stops with ELOOP (what it removed
    /// is gone), holding no more descriptors than the bound.
    #[test]
    fn a_tree_past_the_bound_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let root = dir_fd(d.path());
        chain(&root, MAX_TREE_DEPTH + 1);
        assert_eq!(
            remove_tree(&root, &CString::new("d").unwrap()).unwrap_err(),
            Errno::ELOOP
        );
    }

    #[test]
    fn beneath_refuses_every_symlink_and_in_root_confines() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("real")).unwrap();
        std::os::unix::fs::symlink("real", d.path().join("link")).unwrap();
        std::os::unix::fs::symlink("/etc", d.path().join("etc")).unwrap();
        let root = dir_fd(d.path());
        assert!(open_beneath(&root, "real", OFlag::O_PATH).is_ok());
        assert_eq!(
            open_beneath(&root, "link", OFlag::O_PATH).unwrap_err(),
            Errno::ELOOP
        );
        assert_eq!(
            open_beneath(&root, "../x", OFlag::O_PATH).unwrap_err(),
            Errno::EXDEV
        );
        // `etc` leads to the root's own `etc`, itself: a loop, not /etc.
        assert_eq!(
            open_in(&root, "etc/passwd", OFlag::O_RDONLY, Mode::empty()).unwrap_err(),
            Errno::ELOOP
        );
        assert_eq!(names(&root, 10).unwrap().len(), 3);
    }
}
