//! Writing into an image root without ever leaving it.
//!
//! An image's source (a tarball, a directory) is untrusted input: it may
//! hold symlinks to host paths (`etc -> /etc`), `..` names, absolute names
//! and hard links to host files. poold builds images as root, so a write
//! that follows such a link lands on the host. Invariants:
//! - [`unpack_tar`] checks every entry before it is written: its name is
//!   relative and has no `..`; a hard link's target too; no existing
//!   ancestor of it resolves outside the root (a symlink unpacked earlier).
//!   The first bad entry fails the build with an error naming it; nothing
//!   is written outside the root. (The `tar` crate checks the same again
//!   with `canonicalize` before each write.)
//! - Symlinks are stored as symlinks, whatever they point at: inside the
//!   guest they resolve against the guest's root.
//! - [`write_file`] and [`ensure_dir`] (forkd's own files, added after the
//!   source) never follow a symlink: a symlinked directory on the way is
//!   an error naming it, a symlink where the file goes is replaced.
//! - Nobody but poold (root) writes in the build's staging directory, so
//!   checking a path and then writing it is not racy.

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// A tarball's compression, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    None,
    Gzip,
    Zstd,
    Xz,
    Bzip2,
}

fn sniff(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
        Compression::Xz
    } else if head.starts_with(b"BZh") {
        Compression::Bzip2
    } else {
        Compression::None
    }
}

/// Opens `path` as a (decompressed) tar stream.
fn open_tar(path: &Path) -> Result<Box<dyn Read>> {
    use std::io::{BufRead, BufReader};
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let kind = sniff(r.fill_buf()?);
    Ok(match kind {
        Compression::None => Box::new(r),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(r)),
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::with_buffer(r)?),
        Compression::Xz => Box::new(liblzma::bufread::XzDecoder::new_multi_decoder(r)),
        Compression::Bzip2 => Box::new(bzip2::bufread::MultiBzDecoder::new(r)),
    })
}

/// A member name as a relative path of plain components, or why not.
fn relative_name(name: &Path) -> std::result::Result<PathBuf, &'static str> {
    let mut out = PathBuf::new();
    for c in name.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err("has an absolute path (image tarballs hold paths relative to the root: make them with `tar -C ROOT -cf image.tar .`)")
            }
            Component::ParentDir => return Err("has a '..' component"),
        }
    }
    Ok(out)
}

/// Fails when an existing ancestor of `rel` (inside `root`) resolves
/// outside `root`, naming the symlink that leads there.
fn check_ancestors(root: &Path, rel: &Path) -> Result<(), String> {
    let mut cur = root.to_path_buf();
    let parent = rel.parent().unwrap_or(Path::new(""));
    for c in parent.components() {
        cur.push(c);
        let Ok(m) = std::fs::symlink_metadata(&cur) else {
            return Ok(()); // the rest will be created, as directories
        };
        if m.file_type().is_symlink() {
            let target = std::fs::read_link(&cur).unwrap_or_default();
            let inside = cur.canonicalize().ok().is_some_and(|c| c.starts_with(root));
            if !inside {
                let shown = cur.strip_prefix(root).unwrap_or(&cur);
                return Err(format!(
                    "would be written through the symlink {} -> {}, which leads outside the image root",
                    shown.display(),
                    target.display()
                ));
            }
        } else if !m.is_dir() {
            return Ok(()); // the write fails on its own (not a directory)
        }
    }
    Ok(())
}

/// Unpacks the tarball at `tar` (plain, gzip, zstd, xz or bzip2) into
/// `root`, keeping owners, modes, symlinks, hard links and device nodes,
/// and refusing any entry that would write outside `root` (module doc).
pub fn unpack_tar(tar: &Path, root: &Path) -> Result<()> {
    let root = root
        .canonicalize()
        .with_context(|| format!("resolving {}", root.display()))?;
    let mut a = tar::Archive::new(open_tar(tar)?);
    a.set_preserve_permissions(true);
    a.set_preserve_ownerships(true);
    a.set_preserve_mtime(true);
    a.set_unpack_xattrs(false);
    a.set_overwrite(true);
    let entries = a
        .entries()
        .with_context(|| format!("reading {}", tar.display()))?;
    for e in entries {
        let mut e = e.with_context(|| format!("reading {}", tar.display()))?;
        let name = e.path().map(|p| p.into_owned()).unwrap_or_default();
        let shown = name.display().to_string();
        let refuse = |why: &str| {
            anyhow::anyhow!(
                "{}: entry {shown:?} {why}; refusing the tarball",
                tar.display()
            )
        };
        let rel = relative_name(&name).map_err(refuse)?;
        if rel.as_os_str().is_empty() {
            continue; // "./": the root itself
        }
        let kind = e.header().entry_type();
        if kind.is_hard_link() {
            let target = e.link_name()?.map(|p| p.into_owned()).unwrap_or_default();
            let t = relative_name(&target).map_err(|why| {
                refuse(&format!(
                    "is a hard link to {} which {why}",
                    target.display()
                ))
            })?;
            check_ancestors(&root, &t.join("x")).map_err(|why| {
                refuse(&format!(
                    "is a hard link to {}, which {why}",
                    target.display()
                ))
            })?;
        }
        check_ancestors(&root, &rel).map_err(|why| refuse(&why))?;
        e.unpack_in(&root)
            .with_context(|| format!("{}: unpacking entry {shown:?}", tar.display()))?;
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            // The tar crate writes these as empty files (inside the root,
            // checked): replace each with the node it stands for.
            make_node(&root.join(&rel), &e)
                .with_context(|| format!("{}: creating node {shown:?}", tar.display()))?;
        }
    }
    Ok(())
}

/// Replaces the placeholder file at `path` with the device node or FIFO
/// the entry describes, with its owner and mode.
fn make_node<R: Read>(path: &Path, e: &tar::Entry<'_, R>) -> Result<()> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let h = e.header();
    let kind = h.entry_type();
    let sflag = if kind.is_character_special() {
        SFlag::S_IFCHR
    } else if kind.is_block_special() {
        SFlag::S_IFBLK
    } else {
        SFlag::S_IFIFO
    };
    let dev = makedev(
        h.device_major()?.unwrap_or(0).into(),
        h.device_minor()?.unwrap_or(0).into(),
    );
    let mode = h.mode()? & 0o7777;
    std::fs::remove_file(path)?;
    mknod(path, sflag, Mode::from_bits_truncate(mode), dev)?;
    std::os::unix::fs::lchown(path, Some(h.uid()? as u32), Some(h.gid()? as u32))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    Ok(())
}

/// Makes sure `rel` (relative to `root`) is a directory, creating missing
/// ones (mode 0755); a symlink or a file on the way is an error naming it.
pub fn ensure_dir(root: &Path, rel: &Path) -> Result<PathBuf> {
    let mut cur = root.to_path_buf();
    for c in rel.components() {
        let Component::Normal(c) = c else {
            bail!("{}: not a plain relative path", rel.display());
        };
        cur.push(c);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => bail!(
                "the image root's {} is a symlink (to {}); forkd writes its own files under it \
                 and never follows symlinks inside an image root: make it a directory in the source",
                cur.strip_prefix(root).unwrap_or(&cur).display(),
                std::fs::read_link(&cur).unwrap_or_default().display()
            ),
            Ok(_) => bail!(
                "the image root's {} is not a directory; forkd needs a directory there",
                cur.strip_prefix(root).unwrap_or(&cur).display()
            ),
            Err(_) => std::fs::DirBuilder::new()
                .mode(0o755)
                .create(&cur)
                .and_then(|()| {
                    // Explicit, not the umask's: the guest's directories.
                    std::fs::set_permissions(&cur, PermissionsExt::from_mode(0o755))
                })
                .with_context(|| format!("creating {}", cur.display()))?,
        }
    }
    Ok(cur)
}

/// Writes `data` to `rel` inside `root` (mode `mode`), never following a
/// symlink: its directories must be real ones ([`ensure_dir`]), and a
/// symlink where the file goes is replaced by the file.
pub fn write_file(root: &Path, rel: &Path, data: &[u8], mode: u32) -> Result<()> {
    use std::io::Write;
    let dir = ensure_dir(root, rel.parent().unwrap_or(Path::new("")))?;
    let name = rel.file_name().context("a file path without a name")?;
    let path = dir.join(name);
    if std::fs::symlink_metadata(&path).is_ok_and(|m| !m.is_dir()) {
        std::fs::remove_file(&path).with_context(|| format!("replacing {}", path.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.set_permissions(PermissionsExt::from_mode(mode))?;
    f.write_all(data)?;
    Ok(())
}

/// True when `rel` exists inside `root` without a symlink on the way or at
/// the end.
pub fn exists_plain(root: &Path, rel: &Path) -> bool {
    let mut cur = root.to_path_buf();
    for c in rel.components() {
        cur.push(c);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if !m.file_type().is_symlink() => {}
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names() {
        assert_eq!(
            relative_name(Path::new("./etc/passwd")).unwrap(),
            PathBuf::from("etc/passwd")
        );
        assert!(relative_name(Path::new("/etc/passwd")).is_err());
        assert!(relative_name(Path::new("a/../../x")).is_err());
        assert_eq!(sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(sniff(b"BZh9"), Compression::Bzip2);
        assert_eq!(sniff(b"etc/\0\0"), Compression::None);
    }
}
