//! File operations: binary-safe read and atomic write, list, stat, mkdir -p,
//! remove. Blocking filesystem calls run on tokio's blocking pool.

use crate::protocol::{
    validate_guest_path, AgentError, DirEntry, ErrorKind, FileKind, FileStat, ListResult,
    ReadResult, MAX_PAYLOAD,
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

/// Writes `data` to `path`. Unless appending, the bytes go to a temporary file
/// in the same directory that is renamed over `path`, so a reader never sees a
/// partial file.
pub fn write(
    path: &str,
    data: &[u8],
    mode: Option<u32>,
    append: bool,
    create_parents: bool,
) -> Result<FileStat, AgentError> {
    validate_guest_path(path)?;
    let p = Path::new(path);
    let parent = p.parent().unwrap_or(Path::new("/"));
    if create_parents {
        fs::create_dir_all(parent)
            .map_err(|e| AgentError::io(&parent.display().to_string(), &e))?;
    }
    if append {
        let mut f = fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(mode.unwrap_or(0o644))
            .open(p)
            .map_err(|e| AgentError::io(path, &e))?;
        f.write_all(data).map_err(|e| AgentError::io(path, &e))?;
    } else {
        write_atomic(p, data, mode)?;
    }
    stat(path)
}

fn write_atomic(p: &Path, data: &[u8], mode: Option<u32>) -> Result<(), AgentError> {
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
        f.set_permissions(fs::Permissions::from_mode(mode.unwrap_or(0o644)))?;
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

/// Creates the directory `path` (mode default 0o755; `parents` as `mkdir -p`).
pub fn mkdir(path: &str, mode: Option<u32>, parents: bool) -> Result<FileStat, AgentError> {
    validate_guest_path(path)?;
    let mut b = fs::DirBuilder::new();
    b.recursive(parents);
    std::os::unix::fs::DirBuilderExt::mode(&mut b, mode.unwrap_or(0o755));
    b.create(path).map_err(|e| AgentError::io(path, &e))?;
    stat(path)
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
        let st = write(&p, &data, Some(0o600), false, true).unwrap();
        assert_eq!(
            (st.size, st.mode, st.kind),
            (100_000, 0o600, FileKind::File)
        );
        let (r, back) = read(&p, 0, None).unwrap();
        assert_eq!((r.size, back), (100_000, data.clone()));
        let (_, part) = read(&p, 10, Some(5)).unwrap();
        assert_eq!(part, &data[10..15]);
        write(&p, b"xyz", None, true, false).unwrap();
        assert_eq!(stat(&p).unwrap().size, 100_003);
        let l = list(&format!("{}/a/b", dir.path().display())).unwrap();
        assert_eq!(l.entries.len(), 1, "no temp files left behind");
        let e = remove(&format!("{}/a", dir.path().display()), false).unwrap_err();
        assert_eq!(e.kind, ErrorKind::DirectoryNotEmpty);
        remove(&format!("{}/a", dir.path().display()), true).unwrap();
        assert_eq!(stat(&p).unwrap_err().kind, ErrorKind::NotFound);
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
