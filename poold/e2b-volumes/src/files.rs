//! E2B's volume content API (`/volumecontent/{id}/...`, the SDK's
//! `Volume` file calls, `E2B_VOLUME_API_URL`): files of a volume
//! ([`crate::store`]) read and written on the host, no sandbox needed.
//! Each request carries the volume's token (`Authorization: Bearer`),
//! checked before its body is read.
//!
//! Invariants: what sandboxes wrote into a volume is hostile to the host.
//! Every path resolves inside the volume's folder ([`crate::fs`]),
//! so neither `..` nor a symlink leaves it; nothing but a regular file or
//! a directory is ever opened for reading or changed (a device node or
//! FIFO a guest made is only looked at through `O_PATH`); a write goes to
//! a new file renamed into place, so it never opens what is there;
//! set-id and sticky bits are never set; a tree is removed through
//! directory descriptors, never following a link. Bodies are bounded by
//! [`MAX_FILE_BYTES`], listings by [`MAX_ENTRIES`] and [`MAX_DEPTH`].

use crate::error::{Error, Result};
use crate::fs::{self, names, open_in, owned};
use crate::store::Volumes;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use forkd_node::limits::MAX_FILE_BYTES;
use nix::errno::Errno;
use nix::fcntl::{renameat2, AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{fchmod, fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::unistd::{fchown, unlinkat, Gid, Uid, UnlinkatFlags};
use serde::Deserialize;
use serde_json::{json, Value};
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};
use subtle::ConstantTimeEq;

/// Deepest listing (E2B's limit).
pub const MAX_DEPTH: u32 = 10;
/// Most entries one listing answers.
pub const MAX_ENTRIES: usize = 10_000;
/// Mode of a file the API makes when none is given (E2B's).
const FILE_MODE: u32 = 0o666;
/// Mode of a directory the API makes when none is given (E2B's).
const DIR_MODE: u32 = 0o777;

type E = State<Arc<Volumes>>;

/// The content API's routes: the volume's token, not the API key, is
/// checked, before anything else.
pub fn routes(v: Arc<Volumes>) -> Router {
    Router::new()
        .route("/volumecontent/{id}/dir", get(list).post(make_dir))
        .route(
            "/volumecontent/{id}/path",
            get(info).patch(set_owner_mode).delete(remove),
        )
        .route("/volumecontent/{id}/file", get(read).put(write))
        .route_layer(middleware::from_fn_with_state(v.clone(), token_first))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_FILE_BYTES))
        .with_state(v)
}

/// Answers 401 unless the request's bearer token is its volume's; an
/// unknown volume is a 401 too, so names cannot be probed without a token.
async fn token_first(State(e): E, req: Request, next: Next) -> Response {
    let id = req
        .uri()
        .path()
        .strip_prefix("/volumecontent/")
        .and_then(|r| r.split('/').next())
        .unwrap_or("");
    let got = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let ok = match (e.token(id), got) {
        (Ok(want), Some(got)) => bool::from(want.as_bytes().ct_eq(got.as_bytes())),
        _ => false,
    };
    if !ok {
        return Error::unauthorized(
            "missing or wrong volume token, or no such volume: send Authorization: Bearer <the token Volume.create or Volume.connect answered>",
        )
        .into_response();
    }
    next.run(req).await
}

/// An errno as the API's status: what the caller can fix says so.
fn errno(what: &str, e: Errno) -> Error {
    let status = match e {
        Errno::ENOENT => StatusCode::NOT_FOUND,
        Errno::EEXIST | Errno::ENOTEMPTY => StatusCode::CONFLICT,
        Errno::ENOTDIR
        | Errno::EISDIR
        | Errno::ELOOP
        | Errno::EINVAL
        | Errno::EXDEV
        | Errno::ENAMETOOLONG => StatusCode::BAD_REQUEST,
        Errno::ENOSPC | Errno::EDQUOT => StatusCode::INSUFFICIENT_STORAGE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    Error::new(status, format!("{what}: {}", e.desc()))
}

/// A request's path inside the volume: relative to its root ("." for the
/// root itself). `..` is refused: it could not leave the root anyway, but
/// `mkdir -p` and the final open would read it differently.
fn rel(path: &str) -> Result<String> {
    if path.contains('\0') || path.len() > 4096 {
        return Err(Error::bad_request("path: at most 4096 bytes, no NUL byte"));
    }
    if path.split('/').any(|c| c == "..") {
        return Err(Error::bad_request(format!(
            "path {path:?}: no '..' (paths are from the volume's root)"
        )));
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

/// `rel`'s parent, opened, and its last component.
fn parent_of<'a>(root: &OwnedFd, rel: &'a str) -> Result<(OwnedFd, &'a str)> {
    let (dir, name) = rel.rsplit_once('/').unwrap_or((".", rel));
    if name == "." || name == ".." || rel == "." {
        return Err(Error::bad_request(format!(
            "{}: name a file or directory inside the volume",
            shown(rel)
        )));
    }
    let fd = open_in(root, dir, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty())
        .map_err(|e| errno(&shown(dir), e))?;
    Ok((fd, name))
}

/// Makes every missing directory of `rel` (as `mkdir -p`), each `mode`.
fn make_parents(root: &OwnedFd, rel: &str, mode: Mode) -> Result<()> {
    let mut cur = open_in(root, ".", OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty())
        .map_err(|e| errno("/", e))?;
    for comp in rel.split('/').filter(|c| !c.is_empty() && *c != ".") {
        match mkdirat(Some(cur.as_raw_fd()), comp, mode) {
            Ok(()) => {
                let fd = open_in(
                    &cur,
                    comp,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
                    Mode::empty(),
                )
                .map_err(|e| errno(comp, e))?;
                fchmod(fd.as_raw_fd(), mode).map_err(|e| errno(comp, e))?;
            }
            Err(Errno::EEXIST) => {}
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

/// With `force`, makes the missing parents of `rel` (E2B's 0777).
fn forced_parents(root: &OwnedFd, q: &Q, rel: &str) -> Result<()> {
    match rel.rsplit_once('/') {
        Some((parent, _)) if q.force => make_parents(root, parent, perm(None, DIR_MODE)),
        _ => Ok(()),
    }
}

fn kind(st: &FileStat) -> &'static str {
    match SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT {
        SFlag::S_IFREG => "file",
        SFlag::S_IFDIR => "directory",
        SFlag::S_IFLNK => "symlink",
        _ => "unknown",
    }
}

/// The last second RFC 3339 can write (9999-12-31T23:59:59Z): a guest can
/// set any mtime on some filesystems.
const MAX_TIME: i64 = 253_402_300_799;

fn time(sec: i64, nsec: i64) -> String {
    let t = UNIX_EPOCH
        + Duration::new(
            sec.clamp(0, MAX_TIME) as u64,
            nsec.clamp(0, 999_999_999) as u32,
        );
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
        "mode": st.st_mode & 0o777,
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
fn entry(root: &OwnedFd, rel: &str) -> Result<Value> {
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
    force: bool,
}

/// Parses a request's query; a malformed number is a 400.
fn query(raw: Option<&str>) -> Result<Q> {
    let mut q = Q::default();
    for (k, v) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        let num = |name: &str| -> Result<u32> {
            v.parse()
                .map_err(|_| Error::bad_request(format!("{name}={v:?}: give a whole number")))
        };
        match k.as_ref() {
            "path" => q.path = Some(v.to_string()),
            "depth" => q.depth = Some(num("depth")?),
            "uid" => q.uid = Some(num("uid")?),
            "gid" => q.gid = Some(num("gid")?),
            "mode" => q.mode = Some(num("mode")?),
            "force" => q.force = v == "true",
            _ => {}
        }
    }
    Ok(q)
}

fn path_of(q: &Q) -> Result<String> {
    rel(q
        .path
        .as_deref()
        .ok_or_else(|| Error::bad_request("the path query is required"))?)
}

/// Permission bits a caller may set: never set-id or sticky, which on a
/// host folder would hand out a host user's rights.
fn perm(mode: Option<u32>, default: u32) -> Mode {
    Mode::from_bits_truncate(mode.unwrap_or(default) & 0o777)
}

/// Runs blocking file work off the async threads, on the volume `id`'s
/// folder.
async fn on_volume<T: Send + 'static>(
    e: &Volumes,
    id: &str,
    f: impl FnOnce(OwnedFd) -> Result<T> + Send + 'static,
) -> Result<T> {
    let root = e.data_fd(id)?;
    tokio::task::spawn_blocking(move || f(root))
        .await
        .map_err(|e| Error::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
}

/// Sets owner and permission bits of the file `fd` is open on.
fn own(fd: &OwnedFd, uid: Option<u32>, gid: Option<u32>, mode: Mode) -> Result<()> {
    if uid.is_some() || gid.is_some() {
        fchown(
            fd.as_raw_fd(),
            uid.map(Uid::from_raw),
            gid.map(Gid::from_raw),
        )
        .map_err(|e| errno("setting the owner", e))?;
    }
    // After the chown, which clears set-id bits; always, so the umask
    // does not decide.
    fchmod(fd.as_raw_fd(), mode).map_err(|e| errno("setting the mode", e))
}

/// `GET .../dir?path&depth`: the entries under a directory, `depth`
/// levels (1-10), depth first, each directory's by name.
async fn list(State(e): E, Path(id): Path<String>, RawQuery(raw): RawQuery) -> Result<Json<Value>> {
    let q = query(raw.as_deref())?;
    let r = rel(q.path.as_deref().unwrap_or("/"))?;
    let depth = q.depth.unwrap_or(1);
    if !(1..=MAX_DEPTH).contains(&depth) {
        return Err(Error::bad_request(format!(
            "depth must be between 1 and {MAX_DEPTH}"
        )));
    }
    on_volume(&e, &id, move |root| {
        let dir = open_in(
            &root,
            &r,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY,
            Mode::empty(),
        )
        .map_err(|e| errno(&shown(&r), e))?;
        let mut out = Vec::new();
        walk(&dir, &r, depth, &mut out)?;
        Ok(Json(json!(out)))
    })
    .await
}

fn walk(dir: &OwnedFd, dir_rel: &str, depth: u32, out: &mut Vec<Value>) -> Result<()> {
    let too_many = || {
        Error::bad_request(format!(
            "{}: more than {MAX_ENTRIES} entries; list less deep or a smaller directory",
            shown(dir_rel)
        ))
    };
    let mut found =
        names(dir, MAX_ENTRIES - out.len() + 1).map_err(|e| errno(&shown(dir_rel), e))?;
    if out.len() + found.len() > MAX_ENTRIES {
        return Err(too_many());
    }
    found.sort();
    for name in found {
        if out.len() == MAX_ENTRIES {
            return Err(too_many());
        }
        // Gone meanwhile (a guest renaming as we list): left out.
        let Ok(st) = fstatat(
            Some(dir.as_raw_fd()),
            name.as_c_str(),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        ) else {
            continue;
        };
        let shown_name = name.to_string_lossy().into_owned();
        let child = if dir_rel == "." {
            shown_name
        } else {
            format!("{dir_rel}/{shown_name}")
        };
        let target = (kind(&st) == "symlink")
            .then(|| nix::fcntl::readlinkat(Some(dir.as_raw_fd()), name.as_c_str()).ok())
            .flatten()
            .map(|t| t.to_string_lossy().into_owned());
        out.push(stat_json(&child, &st, target));
        if depth > 1 && kind(&st) == "directory" {
            let sub = nix::fcntl::openat(
                Some(dir.as_raw_fd()),
                name.as_c_str(),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            );
            if let Ok(sub) = sub.map(owned) {
                walk(&sub, &child, depth - 1, out)?;
            }
        }
    }
    Ok(())
}

/// `POST .../dir?path&uid&gid&mode&force`: 201 with the directory;
/// `force` makes missing parents and takes an existing directory; else an
/// existing path is a 409.
async fn make_dir(
    State(e): E,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<impl IntoResponse> {
    let q = query(raw.as_deref())?;
    let r = path_of(&q)?;
    on_volume(&e, &id, move |root| {
        let mode = perm(q.mode, DIR_MODE);
        forced_parents(&root, &q, &r)?;
        let (parent, name) = parent_of(&root, &r)?;
        match mkdirat(Some(parent.as_raw_fd()), name, mode) {
            Ok(()) => {}
            Err(Errno::EEXIST) if q.force => {}
            Err(e) => return Err(errno(&shown(&r), e)),
        }
        let fd = open_in(
            &root,
            &r,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| errno(&shown(&r), e))?;
        own(&fd, q.uid, q.gid, mode)?;
        Ok((StatusCode::CREATED, Json(entry(&root, &r)?)))
    })
    .await
}

/// `GET .../path?path`: the entry (a symlink itself, with its target).
async fn info(State(e): E, Path(id): Path<String>, RawQuery(raw): RawQuery) -> Result<Json<Value>> {
    let q = query(raw.as_deref())?;
    let r = path_of(&q)?;
    on_volume(&e, &id, move |root| Ok(Json(entry(&root, &r)?))).await
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
    RawQuery(raw): RawQuery,
    Json(b): Json<OwnerMode>,
) -> Result<Json<Value>> {
    let q = query(raw.as_deref())?;
    let r = path_of(&q)?;
    on_volume(&e, &id, move |root| {
        let fd = regular_or_dir(&root, &r)?;
        let mode = match b.mode {
            Some(m) => perm(Some(m), 0),
            None => Mode::from_bits_truncate(
                fstat(fd.as_raw_fd())
                    .map_err(|e| errno(&shown(&r), e))?
                    .st_mode
                    & 0o777,
            ),
        };
        own(&fd, b.uid, b.gid, mode)?;
        Ok(Json(entry(&root, &r)?))
    })
    .await
}

/// `rel` opened for reading if it is a regular file or a directory:
/// looked at through `O_PATH` first and reopened through that descriptor,
/// so what is opened is what was checked.
fn regular_or_dir(root: &OwnedFd, rel: &str) -> Result<OwnedFd> {
    let p = open_in(root, rel, OFlag::O_PATH | OFlag::O_NOFOLLOW, Mode::empty())
        .map_err(|e| errno(&shown(rel), e))?;
    let st = fstat(p.as_raw_fd()).map_err(|e| errno(&shown(rel), e))?;
    if !matches!(kind(&st), "file" | "directory") {
        return Err(Error::bad_request(format!(
            "{} is a {}: only files and directories are read or changed here",
            shown(rel),
            kind(&st)
        )));
    }
    nix::fcntl::open(
        format!("/proc/self/fd/{}", p.as_raw_fd()).as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map(owned)
    .map_err(|e| errno(&shown(rel), e))
}

/// `DELETE .../path?path`: a file, or a directory with all in it.
async fn remove(
    State(e): E,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<StatusCode> {
    let q = query(raw.as_deref())?;
    let r = path_of(&q)?;
    on_volume(&e, &id, move |root| {
        if r == "." {
            return Err(Error::bad_request("the volume's root is not removed; delete the volume instead"));
        }
        let (parent, name) = parent_of(&root, &r)?;
        let name = CString::new(name).map_err(|_| Error::bad_request("path: no NUL byte"))?;
        fs::remove_tree(&parent, &name).map_err(|e| match e {
            Errno::ELOOP => Error::bad_request(format!(
                "{} is more than {} directories deep; what could be removed is gone, remove the rest from a sandbox",
                shown(&r),
                fs::MAX_TREE_DEPTH
            )),
            e => errno(&shown(&r), e),
        })?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

/// `GET .../file?path`: a regular file's bytes.
async fn read(
    State(e): E,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<impl IntoResponse> {
    let q = query(raw.as_deref())?;
    let r = path_of(&q)?;
    let bytes = on_volume(&e, &id, move |root| {
        let fd = regular_or_dir(&root, &r)?;
        let mut f = std::fs::File::from(fd);
        let m = f.metadata().map_err(|e| Error::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        if m.is_dir() {
            return Err(Error::bad_request(format!("{} is a directory: list it", shown(&r))));
        }
        if m.len() > MAX_FILE_BYTES as u64 {
            return Err(Error::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("{} is {} bytes, over the {MAX_FILE_BYTES} one read returns; read it in a sandbox that mounts the volume", shown(&r), m.len()),
            ));
        }
        let mut buf = Vec::with_capacity(m.len() as usize);
        std::io::Read::read_to_end(&mut std::io::Read::take(&mut f, MAX_FILE_BYTES as u64), &mut buf)
            .map_err(|e| Error::new(StatusCode::INTERNAL_SERVER_ERROR, format!("reading {}: {e}", shown(&r))))?;
        Ok(buf)
    })
    .await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes))
}

/// `PUT .../file?path&uid&gid&mode&force`: 201 with the file. The bytes
/// go to a new file, synced, then renamed to the path: over what is there
/// with `force` (which also makes missing parents), else only if nothing
/// is (409), as E2B. Whatever was there (a guest's device node too) is
/// replaced, never opened.
async fn write(
    State(e): E,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<impl IntoResponse> {
    let q = query(raw.as_deref())?;
    let r = path_of(&q)?;
    on_volume(&e, &id, move |root| {
        forced_parents(&root, &q, &r)?;
        let (parent, name) = parent_of(&root, &r)?;
        let tmp = format!(".fk-{:08x}", rand::random::<u32>());
        let mode = perm(q.mode, FILE_MODE);
        let fd = open_in(
            &parent,
            &tmp,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
            mode,
        )
        .map_err(|e| errno(&shown(&r), e))?;
        let written = (|| {
            let mut f = std::fs::File::from(fd);
            std::io::Write::write_all(&mut f, &body)
                .and_then(|()| f.sync_all())
                .map_err(|e| {
                    Error::new(
                        StatusCode::INSUFFICIENT_STORAGE,
                        format!("writing {}: {e}", shown(&r)),
                    )
                })?;
            own(&OwnedFd::from(f), q.uid, q.gid, mode)?;
            let how = if q.force {
                RenameFlags::empty()
            } else {
                RenameFlags::RENAME_NOREPLACE
            };
            renameat2(
                Some(parent.as_raw_fd()),
                tmp.as_str(),
                Some(parent.as_raw_fd()),
                name,
                how,
            )
            .map_err(|e| match e {
                Errno::EEXIST => Error::new(
                    StatusCode::CONFLICT,
                    format!("{} exists: write with force to replace it", shown(&r)),
                ),
                e => errno(&shown(&r), e),
            })
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
        assert!(rel("a/../b").is_err());
        assert!(time(i64::MAX, 0).starts_with("9999-12-31"));
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
    fn trees_are_listed_within_bounds_and_made_with_their_modes() {
        use std::os::unix::fs::PermissionsExt;
        let (d, r) = root();
        make_parents(&r, "a/b/c", perm(None, DIR_MODE)).unwrap();
        let m = std::fs::metadata(d.path().join("a/b"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(m & 0o7777, 0o777, "the umask does not narrow it");
        std::fs::write(d.path().join("a/b/c/f"), "x").unwrap();
        std::os::unix::fs::symlink("/", d.path().join("a/b/link")).unwrap();
        let mut out = Vec::new();
        walk(&r, ".", 4, &mut out).unwrap();
        let paths: Vec<_> = out
            .iter()
            .map(|v| v["path"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            paths,
            ["/a", "/a/b", "/a/b/c", "/a/b/c/f", "/a/b/link"],
            "a link is listed, not entered"
        );
        for i in 0..MAX_ENTRIES {
            std::fs::write(d.path().join(format!("many{i}")), "").unwrap();
        }
        let e = walk(&r, ".", 1, &mut Vec::new()).unwrap_err();
        assert!(e.message.contains("more than"), "{}", e.message);
        assert!(parent_of(&r, ".").is_err());
        assert_eq!(perm(Some(0o4777), 0), Mode::from_bits_truncate(0o777));
    }
}
