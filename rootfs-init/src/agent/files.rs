//! File operations: binary-safe read and atomic write, list, stat, mkdir -p,
//! remove, and the detailed `entry`/`list_entries`. Blocking filesystem
//! calls run on tokio's blocking pool.
//!
//! Ownership: the agent is root. A write or mkdir for a user ([`Owner`])
//! makes what it creates (the file, every missing parent) belong to that
//! user, as E2B's envd does; it checks no permissions (the user can `sudo`
//! in the guest anyway, which is the sandbox).

use super::users::Names;
use super::xattrs;
use crate::protocol::metadata::Metadata;
use crate::protocol::{
    validate_guest_path, AgentError, DirEntry, EntryInfo, EntryList, ErrorKind, FileKind, FileStat,
    ListResult, ReadResult, WriteHow, MAX_LIST_DEPTH, MAX_LIST_ENTRIES, MAX_PAYLOAD,
};
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Largest single read; bigger files are read in several requests.
pub const MAX_READ: u64 = MAX_PAYLOAD as u64;

/// Runs a blocking file operation off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, AgentError> + Send + 'static,
) -> Result<T, AgentError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(AgentError::new(
            ErrorKind::Internal,
            format!("file task failed: {e}"),
        ))
    })
}

/// Reads up to `len` bytes of `path` from `offset`; without `len`, the rest of the file if it fits one read.
pub fn read(
    path: &str,
    offset: u64,
    len: Option<u64>,
) -> Result<(ReadResult, Vec<u8>), AgentError> {
    validate_guest_path(path)?;
    let mut f = fs::File::open(path).map_err(|e| AgentError::io(path, &e))?;
    let meta = f.metadata().map_err(|e| AgentError::io(path, &e))?;
    if meta.is_dir() {
        return Err(AgentError::new(
            ErrorKind::IsADirectory,
            format!("{path}: is a directory"),
        ));
    }
    let size = meta.len();
    let want = len.unwrap_or(u64::MAX).min(MAX_READ);
    if len.is_none() && size.saturating_sub(offset) > MAX_READ {
        return Err(AgentError::new(
            ErrorKind::BadRequest,
            format!("{path}: {size} bytes is more than one read returns ({MAX_READ}); read it in ranges with offset/len"),
        ));
    }
    f.seek(SeekFrom::Start(offset))
        .map_err(|e| AgentError::io(path, &e))?;
    // Sized up front: growing by doubling would briefly need twice the
    // read in a guest that may have 128 MiB.
    let mut data = Vec::with_capacity(want.min(size.saturating_sub(offset)) as usize);
    f.take(want)
        .read_to_end(&mut data)
        .map_err(|e| AgentError::io(path, &e))?;
    let r = ReadResult {
        size,
        offset,
        len: data.len() as u64,
    };
    Ok((r, data))
}

/// Who owns what a write or mkdir creates: (uid, gid). None: root.
pub type Owner = Option<(u32, u32)>;

/// Writes `data` to `path`. Unless appending, the bytes go to a temporary file
/// in the same directory that is renamed over `path`, so a reader never sees a
/// partial file. With an `owner`, the file (replaced or created) and every
/// parent created belong to it. `metadata`, when given, becomes the file's
/// whole metadata set, written before the file is renamed into place.
pub fn write(
    path: &str,
    data: &[u8],
    mode: Option<u32>,
    how: WriteHow,
    create_parents: bool,
    owner: Owner,
    metadata: Option<&Metadata>,
) -> Result<FileStat, AgentError> {
    validate_guest_path(path)?;
    let p = Path::new(path);
    let parent = p.parent().unwrap_or(Path::new("/"));
    if create_parents {
        create_dirs(parent, 0o755, owner)
            .map_err(|e| AgentError::io(&parent.display().to_string(), &e))?;
    }
    match how {
        WriteHow::Atomic => write_atomic(p, data, mode, owner, metadata)?,
        WriteHow::Append | WriteHow::InPlace => {
            let append = how == WriteHow::Append;
            let mut f = fs::OpenOptions::new()
                .write(true)
                .append(append)
                .truncate(!append)
                .create(true)
                .mode(mode.unwrap_or(0o644))
                .open(p)
                .map_err(|e| AgentError::io(path, &e))?;
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::fchown(&f, Some(uid), Some(gid))
                    .map_err(|e| AgentError::io(path, &e))?;
            }
            if let (Some(m), false) = (mode, append) {
                // An existing file keeps its mode unless one is given.
                f.set_permissions(fs::Permissions::from_mode(m))
                    .map_err(|e| AgentError::io(path, &e))?;
            }
            f.write_all(data).map_err(|e| AgentError::io(path, &e))?;
            if let Some(m) = metadata {
                xattrs::replace(&f, m).map_err(|e| AgentError::io(path, &e))?;
            }
        }
    }
    stat(path)
}

/// `mkdir -p` of `dir` that gives every directory it creates `mode` and
/// `owner` (existing ones are left as they are).
fn create_dirs(dir: &Path, mode: u32, owner: Owner) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(d) = cur {
        if fs::symlink_metadata(d).is_ok() {
            break;
        }
        missing.push(d);
        cur = d.parent();
    }
    for d in missing.into_iter().rev() {
        let mut b = fs::DirBuilder::new();
        std::os::unix::fs::DirBuilderExt::mode(&mut b, mode);
        match b.create(d) {
            Ok(()) => {
                if let Some((uid, gid)) = owner {
                    std::os::unix::fs::chown(d, Some(uid), Some(gid))?;
                }
            }
            // Made by someone else meanwhile: theirs.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    // An existing non-directory in the way fails here, as create_dir_all would.
    if !fs::metadata(dir)?.is_dir() {
        return Err(std::io::Error::from(std::io::ErrorKind::NotADirectory));
    }
    Ok(())
}

fn write_atomic(
    p: &Path,
    data: &[u8],
    mode: Option<u32>,
    owner: Owner,
    metadata: Option<&Metadata>,
) -> Result<(), AgentError> {
    let path = p.display().to_string();
    if p.is_dir() {
        return Err(AgentError::new(
            ErrorKind::IsADirectory,
            format!("{path}: is a directory"),
        ));
    }
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = p.with_file_name(format!(".{name}.forkd-tmp-{}", std::process::id()));
    // Keep the old file's mode unless one is given.
    let mode = mode.or_else(|| {
        fs::metadata(p)
            .ok()
            .map(|m| m.permissions().mode() & 0o7777)
    });
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(data)?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&f, Some(uid), Some(gid))?;
        }
        // After the chown, which clears setuid/setgid bits.
        f.set_permissions(fs::Permissions::from_mode(mode.unwrap_or(0o644)))?;
        if let Some(m) = metadata {
            xattrs::replace(&f, m)?;
        }
        f.sync_data()?;
        fs::rename(&tmp, p)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(AgentError::io(&path, &e));
    }
    Ok(())
}

/// Stats `path` without following a final symlink.
pub fn stat(path: &str) -> Result<FileStat, AgentError> {
    validate_guest_path(path)?;
    let m = fs::symlink_metadata(path).map_err(|e| AgentError::io(path, &e))?;
    let kind = kind_of(&m.file_type());
    Ok(FileStat {
        path: path.to_string(),
        kind,
        size: m.len(),
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        mtime_unix: m.mtime(),
        symlink_target: (kind == FileKind::Symlink)
            .then(|| fs::read_link(path).ok().map(|t| t.display().to_string()))
            .flatten(),
    })
}

/// Lists the directory `path`.
pub fn list(path: &str) -> Result<ListResult, AgentError> {
    validate_guest_path(path)?;
    let rd = fs::read_dir(path).map_err(|e| AgentError::io(path, &e))?;
    let mut entries = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| AgentError::io(path, &e))?;
        let Ok(m) = ent.path().symlink_metadata() else {
            continue;
        };
        entries.push(DirEntry {
            name: ent.file_name().to_string_lossy().into_owned(),
            kind: kind_of(&m.file_type()),
            size: m.len(),
            mode: m.mode() & 0o7777,
            mtime_unix: m.mtime(),
        });
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(ListResult { entries })
}

/// Creates the directory `path` (mode default 0o755; `parents` as `mkdir -p`),
/// owned by `owner` (with the parents it creates).
pub fn mkdir(
    path: &str,
    mode: Option<u32>,
    parents: bool,
    owner: Owner,
) -> Result<FileStat, AgentError> {
    validate_guest_path(path)?;
    let mode = mode.unwrap_or(0o755);
    if parents {
        create_dirs(Path::new(path), mode, owner).map_err(|e| AgentError::io(path, &e))?;
    } else {
        let mut b = fs::DirBuilder::new();
        std::os::unix::fs::DirBuilderExt::mode(&mut b, mode);
        b.create(path).map_err(|e| AgentError::io(path, &e))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(path, Some(uid), Some(gid))
                .map_err(|e| AgentError::io(path, &e))?;
        }
    }
    stat(path)
}

/// What `entry` reports about `path` (not following a final symlink, but
/// reporting where it leads).
pub fn entry(path: &str, names: &Names) -> Result<EntryInfo, AgentError> {
    validate_guest_path(path)?;
    let m = fs::symlink_metadata(path).map_err(|e| AgentError::io(path, &e))?;
    Ok(entry_of(Path::new(path), &m, names))
}

fn entry_of(p: &Path, m: &fs::Metadata, names: &Names) -> EntryInfo {
    let kind = kind_of(&m.file_type());
    let (symlink_target, symlink_resolved, target) = if kind == FileKind::Symlink {
        let text = fs::read_link(p).ok().map(|t| t.display().to_string());
        // envd's rule: every link followed; the path itself when that fails.
        let resolved = fs::canonicalize(p)
            .map(|t| t.display().to_string())
            .unwrap_or_else(|_| p.display().to_string());
        (text, Some(resolved), fs::metadata(p).ok())
    } else {
        (None, None, Some(m.clone()))
    };
    EntryInfo {
        name: p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        path: p.display().to_string(),
        kind,
        target_kind: target.as_ref().map(|t| kind_of(&t.file_type())),
        size: m.len(),
        st_mode: m.mode(),
        target_mode: target.map(|t| t.mode() & 0o7777).unwrap_or(0),
        uid: m.uid(),
        gid: m.gid(),
        owner: names.user(m.uid()),
        group: names.group(m.gid()),
        mtime_unix: m.mtime(),
        mtime_nsec: m.mtime_nsec().clamp(0, 999_999_999) as u32,
        symlink_target,
        symlink_resolved,
        metadata: xattrs::read(p),
    }
}

/// The entries under directory `path`, `depth` levels down (1: its own),
/// depth first and by name; symlinked directories are reported, not entered.
pub fn list_entries(path: &str, depth: u32, names: &Names) -> Result<EntryList, AgentError> {
    validate_guest_path(path)?;
    if !(1..=MAX_LIST_DEPTH).contains(&depth) {
        return Err(AgentError::new(
            ErrorKind::BadRequest,
            format!("depth {depth}: must be in 1..={MAX_LIST_DEPTH}"),
        ));
    }
    let m = fs::metadata(path).map_err(|e| AgentError::io(path, &e))?;
    if !m.is_dir() {
        return Err(AgentError::new(
            ErrorKind::NotADirectory,
            format!("{path}: not a directory"),
        ));
    }
    let mut out = Vec::new();
    walk(Path::new(path), depth, names, &mut out)?;
    Ok(EntryList { entries: out })
}

fn walk(dir: &Path, depth: u32, names: &Names, out: &mut Vec<EntryInfo>) -> Result<(), AgentError> {
    let shown = dir.display().to_string();
    let mut children: Vec<_> = fs::read_dir(dir)
        .map_err(|e| AgentError::io(&shown, &e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    children.sort();
    for child in children {
        // Gone since the listing: skip it, as `ls` would.
        let Ok(m) = fs::symlink_metadata(&child) else {
            continue;
        };
        if out.len() >= MAX_LIST_ENTRIES {
            return Err(AgentError::new(
                ErrorKind::BadRequest,
                format!("{shown}: more than {MAX_LIST_ENTRIES} entries; list a smaller depth or a subdirectory"),
            ));
        }
        out.push(entry_of(&child, &m, names));
        if depth > 1 && m.is_dir() {
            walk(&child, depth - 1, names, out)?;
        }
    }
    Ok(())
}

/// Removes a file, symlink or empty directory; a whole tree when `recursive`.
pub fn remove(path: &str, recursive: bool) -> Result<(), AgentError> {
    validate_guest_path(path)?;
    if Path::new(path).parent().is_none() {
        return Err(AgentError::new(
            ErrorKind::BadRequest,
            "refusing to remove /",
        ));
    }
    let m = fs::symlink_metadata(path).map_err(|e| AgentError::io(path, &e))?;
    let r = if m.is_dir() {
        if recursive {
            fs::remove_dir_all(path)
        } else {
            fs::remove_dir(path)
        }
    } else {
        fs::remove_file(path)
    };
    r.map_err(|e| AgentError::io(path, &e))
}

fn kind_of(t: &fs::FileType) -> FileKind {
    if t.is_symlink() {
        FileKind::Symlink
    } else if t.is_dir() {
        FileKind::Dir
    } else if t.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_stat_list_remove() {
        let dir = tempfile::tempdir().unwrap();
        let p = format!("{}/a/b/f.bin", dir.path().display());
        let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        let st = write(&p, &data, Some(0o600), WriteHow::Atomic, true, None, None).unwrap();
        assert_eq!(
            (st.size, st.mode, st.kind),
            (100_000, 0o600, FileKind::File)
        );
        let (r, back) = read(&p, 0, None).unwrap();
        assert_eq!((r.size, back), (100_000, data.clone()));
        let (_, part) = read(&p, 10, Some(5)).unwrap();
        assert_eq!(part, &data[10..15]);
        write(&p, b"xyz", None, WriteHow::Append, false, None, None).unwrap();
        assert_eq!(stat(&p).unwrap().size, 100_003);
        let l = list(&format!("{}/a/b", dir.path().display())).unwrap();
        assert_eq!(l.entries.len(), 1, "no temp files left behind");
        let e = remove(&format!("{}/a", dir.path().display()), false).unwrap_err();
        assert_eq!(e.kind, ErrorKind::DirectoryNotEmpty);
        remove(&format!("{}/a", dir.path().display()), true).unwrap();
        assert_eq!(stat(&p).unwrap_err().kind, ErrorKind::NotFound);
    }

    /// In place (E2B's envd): the same inode gets the new bytes, so a hard
    /// link sees them, and the file keeps its mode unless one is given.
    #[test]
    fn an_in_place_write_truncates_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = format!("{}/f", dir.path().display());
        let link = format!("{}/link", dir.path().display());
        write(
            &p,
            b"old contents",
            Some(0o640),
            WriteHow::Atomic,
            false,
            None,
            None,
        )
        .unwrap();
        fs::hard_link(&p, &link).unwrap();
        let st = write(&p, b"new", None, WriteHow::InPlace, false, None, None).unwrap();
        assert_eq!((st.size, st.mode), (3, 0o640));
        assert_eq!(fs::read(&link).unwrap(), b"new");
        let st = write(
            &p,
            b"newer",
            Some(0o600),
            WriteHow::InPlace,
            false,
            None,
            None,
        )
        .unwrap();
        assert_eq!((st.size, st.mode), (5, 0o600));
        let fresh = format!("{}/sub/g", dir.path().display());
        let st = write(&fresh, b"x", None, WriteHow::InPlace, true, None, None).unwrap();
        assert_eq!((st.size, st.mode), (1, 0o644));
    }

    /// A write for a user makes the file and the parents it creates that
    /// user's; existing parents keep their owner. Needs root (the agent's
    /// own identity); skipped otherwise.
    #[test]
    fn writes_for_a_user_create_what_it_owns() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root to chown");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().display().to_string();
        let owner = Some((4242, 4343));
        let st = write(
            &format!("{base}/a/b/f"),
            b"x",
            None,
            WriteHow::Atomic,
            true,
            owner,
            None,
        )
        .unwrap();
        assert_eq!((st.uid, st.gid, st.mode), (4242, 4343, 0o644));
        for d in ["a", "a/b"] {
            let m = fs::metadata(format!("{base}/{d}")).unwrap();
            assert_eq!((m.uid(), m.gid()), (4242, 4343), "{d}");
        }
        assert_eq!(fs::metadata(&base).unwrap().uid(), 0);
        let st = write(
            &format!("{base}/a/log"),
            b"1",
            None,
            WriteHow::Append,
            false,
            owner,
            None,
        )
        .unwrap();
        assert_eq!(st.uid, 4242);
        let st = mkdir(&format!("{base}/m/n"), None, true, owner).unwrap();
        assert_eq!((st.uid, st.kind), (4242, FileKind::Dir));
        let st = mkdir(&format!("{base}/m/o"), Some(0o700), false, owner).unwrap();
        assert_eq!((st.uid, st.mode), (4242, 0o700));
    }

    /// Every way of writing replaces the whole set when metadata is
    /// given, keeps it when not, and `entry` reports it (a link's is its
    /// target's). Skipped where the test dir has no user xattrs.
    #[test]
    fn writes_replace_metadata_and_entries_report_it() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().display().to_string();
        let p = format!("{base}/f");
        let m = |pairs: &[(&str, &str)]| -> Metadata {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let names = Names::load();
        write(
            &p,
            b"1",
            None,
            WriteHow::InPlace,
            false,
            None,
            Some(&m(&[("a", "1")])),
        )
        .unwrap();
        if entry(&p, &names).unwrap().metadata.is_empty() {
            eprintln!("skipped: {base} keeps no user xattrs");
            return;
        }
        let two = m(&[("a", "2"), ("b", "x y")]);
        write(&p, b"2", None, WriteHow::Atomic, false, None, Some(&two)).unwrap();
        assert_eq!(entry(&p, &names).unwrap().metadata, two);
        write(&p, b"3", None, WriteHow::Append, false, None, None).unwrap();
        assert_eq!(
            entry(&p, &names).unwrap().metadata,
            two,
            "None keeps the set"
        );
        write(
            &p,
            b"4",
            None,
            WriteHow::InPlace,
            false,
            None,
            Some(&m(&[("c", "")])),
        )
        .unwrap();
        assert_eq!(entry(&p, &names).unwrap().metadata, m(&[("c", "")]));
        std::os::unix::fs::symlink(&p, format!("{base}/l")).unwrap();
        let link = entry(&format!("{base}/l"), &names).unwrap();
        assert_eq!(link.metadata, m(&[("c", "")]));
        write(
            &p,
            b"5",
            None,
            WriteHow::InPlace,
            false,
            None,
            Some(&Metadata::new()),
        )
        .unwrap();
        assert!(entry(&p, &names).unwrap().metadata.is_empty());
    }

    #[test]
    fn entries_report_owners_times_and_resolved_links() {
        let dir = tempfile::tempdir().unwrap();
        let base = fs::canonicalize(dir.path()).unwrap().display().to_string();
        fs::create_dir_all(format!("{base}/d/e")).unwrap();
        fs::write(format!("{base}/d/f.txt"), b"hello").unwrap();
        std::os::unix::fs::symlink("d/f.txt", format!("{base}/link")).unwrap();
        std::os::unix::fs::symlink("nowhere", format!("{base}/dangling")).unwrap();
        let names = Names::load();
        let e = entry(&format!("{base}/link"), &names).unwrap();
        assert_eq!(e.kind, FileKind::Symlink);
        assert_eq!(e.target_kind, Some(FileKind::File));
        assert_eq!(e.symlink_target.as_deref(), Some("d/f.txt"));
        assert_eq!(e.symlink_resolved, Some(format!("{base}/d/f.txt")));
        assert!(e.permissions().starts_with('L'), "{}", e.permissions());
        let d = entry(&format!("{base}/dangling"), &names).unwrap();
        assert_eq!((d.target_kind, d.target_mode), (None, 0));
        assert_eq!(d.symlink_resolved, Some(format!("{base}/dangling")));
        let f = entry(&format!("{base}/d/f.txt"), &names).unwrap();
        assert_eq!((f.size, f.name.as_str()), (5, "f.txt"));
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(f.uid, me);
        assert_eq!(f.owner, names.user(me));
        let l1 = list_entries(&base, 1, &names).unwrap();
        let n1: Vec<_> = l1.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(n1, ["d", "dangling", "link"]);
        let l2 = list_entries(&base, 2, &names).unwrap();
        let p2: Vec<_> = l2.entries.iter().map(|e| e.path.clone()).collect();
        assert_eq!(
            p2,
            [
                format!("{base}/d"),
                format!("{base}/d/e"),
                format!("{base}/d/f.txt"),
                format!("{base}/dangling"),
                format!("{base}/link")
            ]
        );
        assert_eq!(
            list_entries(&base, 0, &names).unwrap_err().kind,
            ErrorKind::BadRequest
        );
        assert_eq!(
            list_entries(&format!("{base}/link"), 1, &names)
                .unwrap_err()
                .kind,
            ErrorKind::NotADirectory
        );
    }

    #[test]
    fn bad_paths() {
        assert_eq!(
            read("relative", 0, None).unwrap_err().kind,
            ErrorKind::BadRequest
        );
        assert_eq!(remove("/", true).unwrap_err().kind, ErrorKind::BadRequest);
        assert_eq!(
            read("/nonexistent/x", 0, None).unwrap_err().kind,
            ErrorKind::NotFound
        );
    }
}
