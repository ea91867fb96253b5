//! E2B's volume content API (`/volumecontent/{id}/...`, the SDK's
//! `Volume` file calls, `E2B_VOLUME_API_URL`): files of a volume
//! ([`crate::volumes`]) read and written on the host, no sandbox needed.
//! Each request carries the volume's token (`Authorization: Bearer`).
//!
//! Invariants: what sandboxes wrote into a volume is hostile to the host.
//! Every path is resolved with `openat2(RESOLVE_IN_ROOT)` against the
//! volume's folder, so neither `..` nor a symlink leaves it; nothing but a
//! regular file is ever opened for reading (a device node a guest made is
//! only looked at through `O_PATH`); a write goes to a new file renamed
//! into place, so it never opens what is there; set-id and sticky bits are
//! never set; a tree is removed through directory descriptors, never
//! following a link. Bodies are bounded by [`MAX_FILE_BYTES`].

use crate::error::{E2bError, E2bResult};
use crate::state::E2b;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use forkd_node::limits::MAX_FILE_BYTES;
use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{openat2, AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::unistd::{fchown, unlinkat, Gid, Uid, UnlinkatFlags};
use serde::Deserialize;
use serde_json::{json, Value};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};
use subtle::ConstantTimeEq;

/// Deepest listing.
pub const MAX_DEPTH: u32 = 16;
/// Most entries one listing answers.
pub const MAX_ENTRIES: usize = 10_000;

type E = State<Arc<E2b>>;

/// The content API's routes (the token, not the API key, is checked).
pub fn routes() -> Router<Arc<E2b>> {
    Router::new()
        .route("/volumecontent/{id}/dir", get(list).post(make_dir))
        .route(
            "/volumecontent/{id}/path",
            get(info).patch(set_owner_mode).delete(remove),
        )
        .route("/volumecontent/{id}/file", get(read).put(write))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_FILE_BYTES))
}

/// The volume's folder, once the request's token is its token.
fn open_volume(e: &E2b, id: &str, h: &HeaderMap) -> E2bResult<OwnedFd> {
    let want = e.volumes.token(id)?;
    let got = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !bool::from(want.as_bytes().ct_eq(got.as_bytes())) {
        return Err(E2bError::unauthorized(
            "missing or wrong volume token: send Authorization: Bearer <the token Volume.create or Volume.connect answered>",
        ));
    }
    let data = e.volumes.data(id)?;
    let fd = nix::fcntl::open(
        &data,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno("opening the volume", e))?;
    Ok(owned(fd))
}

/// An errno as the API's status: what the caller can fix says so.
fn errno(what: &str, e: Errno) -> E2bError {
    let status = match e {
        Errno::ENOENT => StatusCode::NOT_FOUND,
        Errno::EEXIST | Errno::ENOTEMPTY => StatusCode::CONFLICT,
        Errno::ENOTDIR | Errno::EISDIR | Errno::ELOOP | Errno::EINVAL | Errno::EXDEV => {
            StatusCode::BAD_REQUEST
        }
        Errno::ENOSPC | Errno::EDQUOT => StatusCode::INSUFFICIENT_STORAGE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    E2bError::new(status, format!("{what}: {}", e.desc()))
}

/// A request's path inside the volume: relative to its root ("." for the
/// root itself); `..` is harmless (it stops at the root).
fn rel(path: &str) -> E2bResult<String> {
    if path.contains('\0') || path.len() > 4096 {
        return Err(E2bError::bad_request(
            "path: at most 4096 bytes, no NUL byte",
        ));
    }
    let r = path.trim_start_matches('/').trim_end_matches('/');
    Ok(if r.is_empty() { ".".into() } else { r.into() })
}

/// The path as the API reports it: from the volume's root.
fn shown(rel: &str) -> String {
    if rel == "." {
        "/".into()
    } else {
        format!("/{rel}")
    }
}

/// A descriptor nix just returned, owned.
fn owned(fd: std::os::fd::RawFd) -> OwnedFd {
    // SAFETY: every caller passes a descriptor `open`/`openat2` has just
    // returned, which nothing else holds.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn open_in(root: &OwnedFd, rel: &str, flags: OFlag, mode: Mode) -> Result<OwnedFd, Errno> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .mode(mode)
        .resolve(
            ResolveFlag::RESOLVE_IN_ROOT
                | ResolveFlag::RESOLVE_NO_MAGICLINKS
                | ResolveFlag::RESOLVE_NO_XDEV,
        );
    let fd = openat2(root.as_raw_fd(), rel, how)?;
    Ok(owned(fd))
}

/// `rel`'s parent, opened, and its last component.
fn parent_of<'a>(root: &OwnedFd, rel: &'a str) -> E2bResult<(OwnedFd, &'a str)> {
    let (dir, name) = match rel.rsplit_once('/') {
        Some((d, n)) => (d, n),
        None => (".", rel),
    };
    if name == "." || name == ".." || rel == "." {
        return Err(E2bError::bad_request(format!(
            "{}: name a file or directory inside the volume",
            shown(rel)
        )));
    }
    let fd = open_in(root, dir, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty())
        .map_err(|e| errno(&shown(dir), e))?;
    Ok((fd, name))
}

/// Makes every missing directory of `rel` (as `mkdir -p`), each `mode`.
fn make_parents(root: &OwnedFd, rel: &str, mode: Mode) -> E2bResult<()> {
    let mut cur = open_in(root, ".", OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty())
        .map_err(|e| errno("/", e))?;
    for comp in rel.split('/').filter(|c| !c.is_empty() && *c != ".") {
        match mkdirat(Some(cur.as_raw_fd()), comp, mode) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(errno(&format!("making {comp}"), e)),
        }
        cur = open_in(
            &cur,
            comp,
            OFlag::O_PATH | OFlag::O_DIRECTORY,
            Mode::empty(),
        )
        .map_err(|e| errno(comp, e))?;
    }
    Ok(())
}

fn kind(st: &FileStat) -> &'static str {
    match SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT {
        SFlag::S_IFREG => "file",
        SFlag::S_IFDIR => "directory",
        SFlag::S_IFLNK => "symlink",
        _ => "unknown",
    }
}

fn time(sec: i64, nsec: i64) -> String {
    let t = UNIX_EPOCH + Duration::new(sec.max(0) as u64, nsec.clamp(0, 999_999_999) as u32);
    humantime::format_rfc3339_nanos(t).to_string()
}

/// E2B's `VolumeEntryStat`.
fn stat_json(rel: &str, st: &FileStat, target: Option<String>) -> Value {
    let name = rel.rsplit('/').next().unwrap_or("");
    let mut v = json!({
        "name": if rel == "." { "" } else { name },
        "type": kind(st),
        "path": shown(rel),
        "size": st.st_size,
        "mode": st.st_mode & 0o7777,
        "uid": st.st_uid,
        "gid": st.st_gid,
        "atime": time(st.st_atime, st.st_atime_nsec),
        "mtime": time(st.st_mtime, st.st_mtime_nsec),
        "ctime": time(st.st_ctime, st.st_ctime_nsec),
    });
    if let Some(t) = target {
        v["target"] = json!(t);
    }
    v
}

/// The entry at `rel`, not following a final symlink.
fn entry(root: &OwnedFd, rel: &str) -> E2bResult<Value> {
    let fd = open_in(root, rel, OFlag::O_PATH | OFlag::O_NOFOLLOW, Mode::empty())
        .map_err(|e| errno(&shown(rel), e))?;
    let st = fstat(fd.as_raw_fd()).map_err(|e| errno(&shown(rel), e))?;
    let target = (kind(&st) == "symlink")
        .then(|| nix::fcntl::readlinkat(Some(fd.as_raw_fd()), ""))
        .and_then(Result::ok)
        .map(|t| t.to_string_lossy().into_owned());
    Ok(stat_json(rel, &st, target))
}

/// The query fields the API has.
#[derive(Default)]
struct Q {
    path: Option<String>,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

/// Parses a request's query; a malformed number is a 400.
fn query(raw: Option<&str>) -> E2bResult<Q> {
    let mut q = Q::default();
    for (k, v) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        let num = |name: &str| -> E2bResult<u32> {
            v.parse()
                .map_err(|_| E2bError::bad_request(format!("{name}={v:?}: give a whole number")))
        };
        match k.as_ref() {
            "path" => q.path = Some(v.to_string()),
            "depth" => q.depth = Some(num("depth")?),
            "uid" => q.uid = Some(num("uid")?),
            "gid" => q.gid = Some(num("gid")?),
            "mode" => q.mode = Some(num("mode")?),
            "force" => q.force = Some(v == "true"),
            _ => {}
        }
    }
    Ok(q)
}

fn path_of(q: &Q) -> E2bResult<String> {
    rel(q
        .path
        .as_deref()
        .ok_or_else(|| E2bError::bad_request("the path query is required"))?)
}

/// Permission bits a caller may set: never set-id or sticky, which on a
/// host folder would hand out a host user's rights.
fn perm(mode: Option<u32>, default: u32) -> Mode {
    Mode::from_bits_truncate(mode.unwrap_or(default) & 0o777)
}

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> E2bResult<T> + Send + 'static,
) -> E2bResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
}

/// Sets owner and permission bits of the file `fd` is open on.
fn own(fd: &OwnedFd, uid: Option<u32>, gid: Option<u32>, mode: Option<Mode>) -> E2bResult<()> {
    if uid.is_some() || gid.is_some() {
        fchown(
            fd.as_raw_fd(),
            uid.map(Uid::from_raw),
            gid.map(Gid::from_raw),
        )
        .map_err(|e| errno("setting the owner", e))?;
    }
    if let Some(m) = mode {
        nix::sys::stat::fchmod(fd.as_raw_fd(), m).map_err(|e| errno("setting the mode", e))?;
    }
    Ok(())
}

/// `GET .../dir?path&depth`: the entries under a directory, `depth` levels.
async fn list(
    State(e): E,
    Path(id): Path<String>,
    h: HeaderMap,
    RawQuery(raw): RawQuery,
) -> E2bResult<Json<Value>> {
    let q = query(raw.as_deref())?;
    let root = open_volume(&e, &id, &h)?;
    let r = rel(q.path.as_deref().unwrap_or("/"))?;
    let depth = q.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
    blocking(move || {
        let mut out = Vec::new();
        walk(&root, &r, depth, &mut out)?;
        Ok(Json(json!(out)))
    })
    .await
}

fn walk(root: &OwnedFd, dir_rel: &str, depth: u32, out: &mut Vec<Value>) -> E2bResult<()> {
    let fd = open_in(
        root,
        dir_rel,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )
    .map_err(|e| errno(&shown(dir_rel), e))?;
    let raw = fd.as_raw_fd();
    let mut d = Dir::from_fd(nix::unistd::dup(raw).map_err(|e| errno("listing", e))?)
        .map_err(|e| errno("listing", e))?;
    let mut names: Vec<String> = d
        .iter()
        .filter_map(Result::ok)
        .filter_map(|en| en.file_name().to_str().ok().map(String::from))
        .filter(|n| n != "." && n != "..")
        .collect();
    names.sort();
    for name in names {
        if out.len() == MAX_ENTRIES {
            return Err(E2bError::bad_request(format!(
                "{}: more than {MAX_ENTRIES} entries; list less deep or a smaller directory",
                shown(dir_rel)
            )));
        }
        let Ok(st) = fstatat(Some(raw), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else {
            continue;
        };
        let child = if dir_rel == "." {
            name.clone()
        } else {
            format!("{dir_rel}/{name}")
        };
        let target = (kind(&st) == "symlink")
            .then(|| nix::fcntl::readlinkat(Some(raw), name.as_str()).ok())
            .flatten()
            .map(|t| t.to_string_lossy().into_owned());
        out.push(stat_json(&child, &st, target));
        if depth > 1 && kind(&st) == "directory" {
            walk(root, &child, depth - 1, out)?;
        }
    }
    Ok(())
}

/// `POST .../dir?path&uid&gid&mode&force`: 201 with the new directory;
/// `force` makes missing parents; an existing path is a 409.
async fn make_dir(
    State(e): E,
    Path(id): Path<String>,
    h: HeaderMap,
    RawQuery(raw): RawQuery,
) -> E2bResult<impl IntoResponse> {
    let q = query(raw.as_deref())?;
    let root = open_volume(&e, &id, &h)?;
    let r = path_of(&q)?;
    blocking(move || {
        let mode = perm(q.mode, 0o777);
        if q.force == Some(true) {
            if let Some((parent, _)) = r.rsplit_once('/') {
                make_parents(&root, parent, mode)?;
            }
        }
        let (parent, name) = parent_of(&root, &r)?;
        mkdirat(Some(parent.as_raw_fd()), name, mode).map_err(|e| errno(&shown(&r), e))?;
        let fd = open_in(
            &root,
            &r,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| errno(&shown(&r), e))?;
        own(&fd, q.uid, q.gid, q.mode.map(|_| mode))?;
        Ok((StatusCode::CREATED, Json(entry(&root, &r)?)))
    })
    .await
}

/// `GET .../path?path`: the entry (a symlink itself, with its target).
async fn info(
    State(e): E,
    Path(id): Path<String>,
    h: HeaderMap,
    RawQuery(raw): RawQuery,
) -> E2bResult<Json<Value>> {
    let q = query(raw.as_deref())?;
    let root = open_volume(&e, &id, &h)?;
    let r = path_of(&q)?;
    blocking(move || Ok(Json(entry(&root, &r)?))).await
}

#[derive(Deserialize)]
struct OwnerMode {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

/// `PATCH .../path?path {uid, gid, mode}`: of a file or directory (a
/// symlink is refused: what it names may be anything).
async fn set_owner_mode(
    State(e): E,
    Path(id): Path<String>,
    h: HeaderMap,
    RawQuery(raw): RawQuery,
    Json(b): Json<OwnerMode>,
) -> E2bResult<Json<Value>> {
    let q = query(raw.as_deref())?;
    let root = open_volume(&e, &id, &h)?;
    let r = path_of(&q)?;
    blocking(move || {
        let fd = regular_or_dir(&root, &r)?;
        own(&fd, b.uid, b.gid, b.mode.map(|m| perm(Some(m), 0)))?;
        Ok(Json(entry(&root, &r)?))
    })
    .await
}

/// `rel` opened for reading if it is a regular file or a directory:
/// looked at through `O_PATH` first and reopened through that descriptor,
/// so what is opened is what was checked.
fn regular_or_dir(root: &OwnedFd, rel: &str) -> E2bResult<OwnedFd> {
    let p = open_in(root, rel, OFlag::O_PATH | OFlag::O_NOFOLLOW, Mode::empty())
        .map_err(|e| errno(&shown(rel), e))?;
    let st = fstat(p.as_raw_fd()).map_err(|e| errno(&shown(rel), e))?;
    if !matches!(kind(&st), "file" | "directory") {
        return Err(E2bError::bad_request(format!(
            "{} is a {}: only files and directories are read or changed here",
            shown(rel),
            kind(&st)
        )));
    }
    let fd = nix::fcntl::open(
        format!("/proc/self/fd/{}", p.as_raw_fd()).as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno(&shown(rel), e))?;
    Ok(owned(fd))
}

/// `DELETE .../path?path`: a file, or a directory with all in it.
async fn remove(
    State(e): E,
    Path(id): Path<String>,
    h: HeaderMap,
    RawQuery(raw): RawQuery,
) -> E2bResult<StatusCode> {
    let q = query(raw.as_deref())?;
    let root = open_volume(&e, &id, &h)?;
    let r = path_of(&q)?;
    blocking(move || {
        if r == "." {
            return Err(E2bError::bad_request(
                "the volume's root is not removed; delete the volume instead",
            ));
        }
        let (parent, name) = parent_of(&root, &r)?;
        remove_tree(&parent, name).map_err(|e| errno(&shown(&r), e))?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

/// Removes `name` in `dir`: a file or link as is, a directory with
/// everything in it, through descriptors (no link is followed).
fn remove_tree(dir: &OwnedFd, name: &str) -> Result<(), Errno> {
    match unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir) {
        Err(Errno::EISDIR) => {}
        r => return r,
    }
    let sub = open_in(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )?;
    let mut d = Dir::from_fd(nix::unistd::dup(sub.as_raw_fd())?)?;
    let names: Vec<String> = d
        .iter()
        .filter_map(Result::ok)
        .filter_map(|en| en.file_name().to_str().ok().map(String::from))
        .filter(|n| n != "." && n != "..")
        .collect();
    for n in names {
        remove_tree(&sub, &n)?;
    }
    unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::RemoveDir)
}

/// `GET .../file?path`: a regular file's bytes.
async fn read(
    State(e): E,
    Path(id): Path<String>,
    h: HeaderMap,
    RawQuery(raw): RawQuery,
) -> E2bResult<impl IntoResponse> {
    let q = query(raw.as_deref())?;
    let root = open_volume(&e, &id, &h)?;
    let r = path_of(&q)?;
    let bytes = blocking(move || {
        let fd = regular_or_dir(&root, &r)?;
        let mut f = std::fs::File::from(fd);
        let size = f.metadata().map(|m| m.len()).unwrap_or(0);
        if f.metadata().is_ok_and(|m| m.is_dir()) {
            return Err(E2bError::bad_request(format!("{} is a directory: list it", shown(&r))));
        }
        if size > MAX_FILE_BYTES as u64 {
            return Err(E2bError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("{} is {size} bytes, over the {MAX_FILE_BYTES} one read returns; read it in a sandbox that mounts the volume", shown(&r)),
            ));
        }
        let mut buf = Vec::with_capacity(size as usize);
        std::io::Read::read_to_end(&mut std::io::Read::take(&mut f, MAX_FILE_BYTES as u64), &mut buf)
            .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("reading {}: {e}", shown(&r))))?;
        Ok(buf)
    })
    .await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes))
}

/// `PUT .../file?path&uid&gid&mode&force`: 201 with the file. The bytes
/// go to a new file that is renamed over the path, so whatever was there
/// (a guest's device node too) is replaced, never opened.
async fn write(
    State(e): E,
    Path(id): Path<String>,
    h: HeaderMap,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> E2bResult<impl IntoResponse> {
    let q = query(raw.as_deref())?;
    let root = open_volume(&e, &id, &h)?;
    let r = path_of(&q)?;
    blocking(move || {
        if q.force == Some(true) {
            if let Some((parent, _)) = r.rsplit_once('/') {
                make_parents(&root, parent, perm(None, 0o777))?;
            }
        }
        let (parent, name) = parent_of(&root, &r)?;
        let tmp = format!(".{name}.forkd-upload-{:08x}", rand::random::<u32>());
        let mode = perm(q.mode, 0o666);
        let fd = open_in(
            &parent,
            &tmp,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
            mode,
        )
        .map_err(|e| errno(&shown(&r), e))?;
        let written = (|| {
            let mut f = std::fs::File::from(fd);
            std::io::Write::write_all(&mut f, &body).map_err(|e| {
                E2bError::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    format!("writing {}: {e}", shown(&r)),
                )
            })?;
            let fd = OwnedFd::from(f);
            own(&fd, q.uid, q.gid, q.mode.map(|_| mode))?;
            nix::fcntl::renameat(
                Some(parent.as_raw_fd()),
                tmp.as_str(),
                Some(parent.as_raw_fd()),
                name,
            )
            .map_err(|e| errno(&shown(&r), e))
        })();
        if written.is_err() {
            let _ = unlinkat(
                Some(parent.as_raw_fd()),
                tmp.as_str(),
                UnlinkatFlags::NoRemoveDir,
            );
        }
        written?;
        Ok((StatusCode::CREATED, Json(entry(&root, &r)?)))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> (tempfile::TempDir, OwnedFd) {
        let d = tempfile::tempdir().unwrap();
        let fd =
            nix::fcntl::open(d.path(), OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        (d, owned(fd))
    }

    /// Neither `..` nor a symlink a guest left leads out of the volume.
    #[test]
    fn paths_stay_inside_the_volume() {
        let (d, r) = root();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("esc")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", d.path().join("pw")).unwrap();
        assert_eq!(
            open_in(&r, "esc/secret", OFlag::O_RDONLY, Mode::empty()).unwrap_err(),
            Errno::ENOENT
        );
        assert_eq!(
            open_in(&r, "../../../../etc/passwd", OFlag::O_RDONLY, Mode::empty()).unwrap_err(),
            Errno::ENOENT
        );
        let e = regular_or_dir(&r, "pw").unwrap_err();
        assert!(e.message.contains("symlink"), "{}", e.message);
        assert_eq!(entry(&r, "pw").unwrap()["target"], "/etc/passwd");
        assert_eq!(rel("/a/b/").unwrap(), "a/b");
        assert_eq!(rel("/").unwrap(), ".");
        assert!(rel("a\0b").is_err());
    }

    /// A guest's FIFO (or device node) is never opened for reading.
    #[test]
    fn only_files_and_directories_are_opened() {
        let (d, r) = root();
        nix::unistd::mkfifo(&d.path().join("fifo"), Mode::from_bits_truncate(0o644)).unwrap();
        let e = regular_or_dir(&r, "fifo").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(entry(&r, "fifo").unwrap()["type"], "unknown");
    }

    #[test]
    fn trees_are_made_and_removed_through_descriptors() {
        let (d, r) = root();
        make_parents(&r, "a/b/c", perm(None, 0o755)).unwrap();
        std::fs::write(d.path().join("a/b/c/f"), "x").unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), "k").unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("a/b/link")).unwrap();
        let mut out = Vec::new();
        walk(&r, ".", 4, &mut out).unwrap();
        let paths: Vec<_> = out
            .iter()
            .map(|v| v["path"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(paths, ["/a", "/a/b", "/a/b/c", "/a/b/c/f", "/a/b/link"]);
        let (parent, name) = parent_of(&r, "a").unwrap();
        remove_tree(&parent, name).unwrap();
        assert!(!d.path().join("a").exists());
        assert!(
            outside.path().join("keep").exists(),
            "a link is removed, not followed"
        );
        assert!(parent_of(&r, ".").is_err());
        assert_eq!(perm(Some(0o4777), 0), Mode::from_bits_truncate(0o777));
    }
}
