//! Creating the files and directories that hold sandbox data: private to
//! root, whatever the umask (docs/security.md, "Other local users").
//!
//! A snapshot's memory, a child's disk, vmstate, poold's state and audit
//! log hold whatever ran in a sandbox or who asked for what. Invariants:
//! - every file poold creates for such data is created mode 0600 and every
//!   directory 0700, through these helpers (an explicit mode, not the
//!   umask's leftovers);
//! - files a jailed QEMU must open are then handed to its uid with
//!   [`crate::jail::own`] (0600 to the VM's uid, directories 0710 to the
//!   jail group), never widened to other users;
//! - a file that already existed with a wider mode (written by an older
//!   poold) is narrowed when poold opens it again ([`open_append`]).
//!
//! poold also runs with umask 077 ([`restrict_umask`]) so that files other
//! code creates (RocksDB, qemu-img, forkd-fs's socket and log) are private
//! too; explicit modes remain the rule.

use std::fs::{DirBuilder, File, OpenOptions, Permissions};
use std::io::{Result, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Mode of files holding sandbox or daemon data.
pub const FILE_MODE: u32 = 0o600;
/// Mode of directories holding them.
pub const DIR_MODE: u32 = 0o700;

/// Creates (or truncates) `path` for writing, mode 0600 (an existing file
/// is narrowed to 0600 too).
pub fn create(path: &Path) -> Result<File> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(FILE_MODE)
        .open(path)?;
    f.set_permissions(Permissions::from_mode(FILE_MODE))?;
    Ok(f)
}

/// Writes `data` to `path` (created or truncated, mode 0600).
pub fn write(path: &Path, data: &[u8]) -> Result<()> {
    create(path)?.write_all(data)
}

/// Opens `path` for appending, creating it mode 0600, and narrows an
/// existing file to 0600.
pub fn open_append(path: &Path) -> Result<File> {
    let f = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(FILE_MODE)
        .open(path)?;
    f.set_permissions(Permissions::from_mode(FILE_MODE))?;
    Ok(f)
}

/// `mkdir -p` with mode 0700 for every directory it creates (existing ones
/// are left as they are: their owner chose).
pub fn create_dir_all(path: &Path) -> Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
}

/// Sets the process umask to 077: belt and braces under the explicit modes.
pub fn restrict_umask() {
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn modes_are_private_whatever_the_umask() {
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o000));
        let t = tempfile::tempdir().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        let d = t.path().join("a/b");
        create_dir_all(&d).unwrap();
        assert_eq!(mode(&t.path().join("a")), 0o700);
        assert_eq!(mode(&d), 0o700);
        write(&d.join("f"), b"x").unwrap();
        assert_eq!(mode(&d.join("f")), 0o600);
        let wide = d.join("old");
        std::fs::write(&wide, b"x").unwrap();
        std::fs::set_permissions(&wide, Permissions::from_mode(0o644)).unwrap();
        open_append(&wide).unwrap();
        assert_eq!(mode(&wide), 0o600);
        nix::sys::stat::umask(old);
    }
}
