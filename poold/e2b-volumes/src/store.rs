//! E2B volumes: named folders a sandbox mounts at create
//! (`volumeMounts`), kept on this host as poold's own volumes are
//! (docs/volumes.md): host folders over virtio-fs, inside `volume_roots`.
//!
//! Layout, under the first of `volume_roots`: `e2b-volumes/` (mode 0700,
//! so no host user reaches what guests leave there, set-id files
//! included), in it per volume `<name>/data` (mode 0777: the folder
//! sandboxes mount and the content API serves, [`crate::files`])
//! and `<name>/token` (the content API's bearer token). A volume's id is
//! its name (E2B's names are `[a-zA-Z0-9_-]`, safe as a path component).
//!
//! Invariants:
//! - a volume exists exactly when its `data` folder does; a create makes
//!   the name's folder, then the token, then `data`, under one lock, so a
//!   create cut off half way is finished by the next create of that name,
//!   never answered as an existing volume, and two creates of one name
//!   never both succeed;
//! - the store's names resolve from the store's descriptor with
//!   `RESOLVE_BENEATH` and no symlinks ([`crate::fs`]), and a token
//!   is read only from a regular file: whoever can write the store (a
//!   guest given a volume root itself through `/v1`) cannot point the
//!   content API elsewhere on the host, or hang it. A mount is handed to
//!   the node by path (its checks keep it under `volume_roots`), so such a
//!   guest could swap which folder under them a mount gets: never give a
//!   guest the volume root itself;
//! - a mount goes where the template's snapshot has a volume (a restored
//!   machine gets no new devices); anywhere else is a 400 naming where it
//!   can go.

use crate::error::{Error, Result};
use crate::fs::{names, open_beneath, owned, remove_tree};
use axum::http::StatusCode;
use forkd_api::VolumeSpec;
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::{fchmod, mkdirat, Mode, SFlag};
use serde::Deserialize;
use serde_json::{json, Value};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Mutex;

/// Longest volume name.
pub const MAX_NAME: usize = 128;
/// Most volumes one sandbox mounts (poold's own limit on volumes).
pub const MAX_MOUNTS: usize = 8;
/// A token's length (hex digits); a token file holding anything else is
/// not a token.
const TOKEN_LEN: usize = 32;

/// Where E2B volumes live; `dir` is None when poold has no `volume_roots`.
pub struct Volumes {
    dir: Option<PathBuf>,
    /// Held by creates and deletes.
    turn: Mutex<()>,
}

/// One `volumeMounts` entry.
#[derive(Debug, Deserialize)]
pub struct Mount {
    /// The volume's name (its id).
    pub name: String,
    /// Where the guest mounts it (absolute).
    pub path: String,
}

fn not_found(id: &str) -> Error {
    Error::not_found(format!("volume {id:?} not found"))
}

fn failed(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{what}: {e}"))
}

/// Checks a volume name (E2B's rule, and a bound).
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::bad_request(format!(
            "volume name {name:?}: use 1-{MAX_NAME} letters, digits, '_' and '-'"
        )))
    }
}

fn mkdir_mode(dir: &OwnedFd, name: &str, mode: u32) -> Result<(), Errno> {
    match mkdirat(Some(dir.as_raw_fd()), name, Mode::from_bits_truncate(mode)) {
        Ok(()) => {
            // The umask (poold's is 077) must not narrow it.
            let fd = open_beneath(dir, name, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
            fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(mode))
        }
        Err(e) => Err(e),
    }
}

impl Volumes {
    /// The volumes of a poold whose `volume_roots` are `roots`; sweeps
    /// what deletes cut off left behind.
    pub fn new(roots: &[PathBuf]) -> Volumes {
        let v = Volumes {
            dir: roots.first().map(|r| r.join("e2b-volumes")),
            turn: Mutex::new(()),
        };
        if let Ok(store) = v.store_if_there() {
            for n in names(&store, usize::MAX).unwrap_or_default() {
                if n.to_bytes().starts_with(b".") {
                    let _ = remove_tree(&store, &n);
                }
            }
        }
        v
    }

    fn dir(&self) -> Result<&PathBuf> {
        self.dir.as_ref().ok_or_else(|| {
            Error::bad_request(
                "this poold has no volume_roots configured, so it keeps no volumes; add volume_roots = [\"/srv/forkd-volumes\"] to its config (docs/volumes.md)",
            )
        })
    }

    /// The store, opened (not through a symlink).
    fn store_if_there(&self) -> Result<OwnedFd> {
        let dir = self.dir()?;
        nix::fcntl::open(
            dir.as_path(),
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map(owned)
        .map_err(|e| failed(&format!("opening {}", dir.display()), e))
    }

    /// The store, made (mode 0700) when missing.
    fn store(&self) -> Result<OwnedFd> {
        let dir = self.dir()?;
        let mut b = std::fs::DirBuilder::new();
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        match b.create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(failed(&format!("making {}", dir.display()), e)),
        }
        self.store_if_there()
    }

    /// Volume `id`'s folder, opened (`O_PATH`), if it exists.
    pub fn data_fd(&self, id: &str) -> Result<OwnedFd> {
        check_name(id).map_err(|_| not_found(id))?;
        let store = self.store_if_there().map_err(|_| not_found(id))?;
        open_beneath(
            &store,
            &format!("{id}/data"),
            OFlag::O_PATH | OFlag::O_DIRECTORY,
        )
        .map_err(|_| not_found(id))
    }

    /// Volume `id`'s token, if it exists and has a well-formed one (a
    /// volume without one is not listed or served).
    pub fn token(&self, id: &str) -> Result<String> {
        self.data_fd(id)?;
        let store = self.store_if_there()?;
        read_token(&store, id).ok_or_else(|| not_found(id))
    }

    /// `POST /volumes`: makes volume `name`; a 400 when it exists.
    pub fn create(&self, name: &str) -> Result<Value> {
        check_name(name)?;
        let _turn = self.turn.lock().unwrap();
        let store = self.store()?;
        match mkdir_mode(&store, name, 0o700) {
            Ok(()) => {}
            Err(Errno::EEXIST) => {
                if self.data_fd(name).is_ok() {
                    return Err(Error::bad_request(format!(
                        "volume {name:?} exists: pick another name, or delete it first"
                    )));
                }
                // A create cut off half way: finish it.
            }
            Err(e) => return Err(failed(&format!("making volume {name:?}"), e)),
        }
        let base = open_beneath(&store, name, OFlag::O_PATH | OFlag::O_DIRECTORY)
            .map_err(|e| failed(&format!("opening volume {name:?}"), e))?;
        let token = match read_token(&store, name) {
            Some(t) => t,
            None => write_token(&base).map_err(|e| failed("writing the volume's token", e))?,
        };
        match mkdir_mode(&base, "data", 0o777) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(failed(&format!("making volume {name:?}"), e)),
        }
        // Not a folder of its own (something else made `data`): no volume.
        self.data_fd(name).map_err(|_| {
            failed(
                &format!("making volume {name:?}"),
                "its data is not a folder",
            )
        })?;
        Ok(volume_json(name, &token))
    }

    /// `GET /volumes/{id}`.
    pub fn get(&self, id: &str) -> Result<Value> {
        Ok(volume_json(id, &self.token(id)?))
    }

    /// `GET /volumes`: every volume, by name.
    pub fn list(&self) -> Result<Value> {
        let Ok(store) = self.store_if_there() else {
            return Ok(json!([]));
        };
        let mut out: Vec<String> = names(&store, usize::MAX)
            .map_err(|e| failed("listing e2b-volumes", e))?
            .into_iter()
            .filter_map(|n| n.into_string().ok())
            .filter(|n| self.token(n).is_ok())
            .collect();
        out.sort();
        Ok(json!(out
            .iter()
            .map(|n| json!({"volumeID": n, "name": n}))
            .collect::<Vec<_>>()))
    }

    /// `DELETE /volumes/{id}`: its files go; sandboxes mounting it see
    /// them gone, as with E2B.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let doomed = {
            let _turn = self.turn.lock().unwrap();
            self.data_fd(id)?;
            let store = self.store_if_there()?;
            // Renamed out of the way first (a name `check_name` refuses):
            // the volume is gone at once, even if the removal is cut off
            // (the next start sweeps it).
            let doomed = format!(".{id}.deleting-{:08x}", rand::random::<u32>());
            nix::fcntl::renameat(
                Some(store.as_raw_fd()),
                id,
                Some(store.as_raw_fd()),
                doomed.as_str(),
            )
            .map_err(|e| failed("deleting the volume", e))?;
            (store, doomed)
        };
        tokio::task::spawn_blocking(move || {
            let (store, doomed) = doomed;
            remove_tree(&store, &CString::new(doomed).expect("no NUL in the name"))
        })
        .await
        .map_err(|e| failed("deleting the volume's files", e))?
        .map_err(|e| failed("deleting the volume's files (the volume is gone; what is left is swept at the next start)", e))
    }

    /// The E2B volumes among a sandbox's mounted folders, as E2B lists
    /// them (`[{name, path}]`); other folders (poold's own volumes) are
    /// not E2B's to show.
    pub fn mounted(&self, vols: &[forkd_node::Volume]) -> Vec<Value> {
        let Some(dir) = self.dir.as_ref() else {
            return Vec::new();
        };
        // Spawned folders are canonical (node::volumes::confine).
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
        vols.iter()
            .filter_map(|v| {
                let rest = v.host_path.strip_prefix(&dir).ok()?;
                let mut parts = rest.iter();
                let (name, data) = (parts.next()?.to_str()?, parts.next()?);
                (data == "data" && parts.next().is_none())
                    .then(|| json!({"name": name, "path": v.guest_path}))
            })
            .collect()
    }

    /// A create's `volumeMounts` as the spawn's volumes: each a volume
    /// that exists, at an absolute, normalised path, no path twice.
    pub fn mounts(&self, mounts: &[Mount]) -> Result<Vec<VolumeSpec>> {
        if mounts.len() > MAX_MOUNTS {
            return Err(Error::bad_request(format!(
                "volumeMounts: {} mounts, at most {MAX_MOUNTS}",
                mounts.len()
            )));
        }
        let mut out: Vec<VolumeSpec> = Vec::new();
        for m in mounts {
            let bad = |why: &str| {
                Error::bad_request(format!("volumeMounts: {} at {:?}: {why}", m.name, m.path))
            };
            if !m.path.starts_with('/') || normalised(&m.path) != m.path {
                return Err(bad(
                    "give an absolute path without '.', '..', '//' or a trailing '/'",
                ));
            }
            if out.iter().any(|v| v.guest_path == m.path) {
                return Err(bad("that path is mounted twice"));
            }
            self.data_fd(&m.name).map_err(|e| bad(&e.message))?;
            let data = self.dir()?.join(&m.name).join("data");
            out.push(VolumeSpec {
                host_path: data.display().to_string(),
                guest_path: m.path.clone(),
                read_only: false,
            });
        }
        Ok(out)
    }
}

/// `p` as `filepath.Clean` would leave it, for the paths that matter: a
/// path with empty, `.` or `..` components, or a trailing `/`, differs.
fn normalised(p: &str) -> String {
    let parts: Vec<&str> = p.split('/').skip(1).collect();
    if parts
        .iter()
        .any(|c| c.is_empty() || *c == "." || *c == "..")
    {
        return String::new();
    }
    format!("/{}", parts.join("/"))
}

/// Volume `name`'s token, when its file holds a well-formed one.
fn read_token(store: &OwnedFd, name: &str) -> Option<String> {
    // Looked at first: a FIFO planted there must not block the check.
    let p = open_beneath(store, &format!("{name}/token"), OFlag::O_PATH).ok()?;
    let st = nix::sys::stat::fstat(p.as_raw_fd()).ok()?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return None;
    }
    let fd = nix::fcntl::open(
        format!("/proc/self/fd/{}", p.as_raw_fd()).as_str(),
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map(owned)
    .ok()?;
    let mut t = String::new();
    std::fs::File::from(fd)
        .take(TOKEN_LEN as u64 + 1)
        .read_to_string(&mut t)
        .ok()?;
    (t.len() == TOKEN_LEN && t.bytes().all(|b| b.is_ascii_hexdigit())).then_some(t)
}

/// A new token in `base`/token, written to a fresh file renamed into place.
fn write_token(base: &OwnedFd) -> Result<String, Errno> {
    let token = format!("{:032x}", rand::random::<u128>());
    let tmp = format!(".token.{:08x}", rand::random::<u32>());
    let fd = nix::fcntl::openat(
        Some(base.as_raw_fd()),
        tmp.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map(owned)?;
    let mut f = std::fs::File::from(fd);
    let written = f.write_all(token.as_bytes()).and_then(|()| f.sync_all());
    if let Err(e) = written {
        let _ = nix::unistd::unlinkat(
            Some(base.as_raw_fd()),
            tmp.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
        return Err(Errno::from_raw(e.raw_os_error().unwrap_or(libc_eio())));
    }
    nix::fcntl::renameat(
        Some(base.as_raw_fd()),
        tmp.as_str(),
        Some(base.as_raw_fd()),
        "token",
    )?;
    Ok(token)
}

fn libc_eio() -> i32 {
    Errno::EIO as i32
}

fn volume_json(name: &str, token: &str) -> Value {
    json!({"volumeID": name, "name": name, "token": token})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, Volumes) {
        let d = tempfile::tempdir().unwrap();
        let v = Volumes::new(&[d.path().to_path_buf()]);
        (d, v)
    }

    #[tokio::test]
    async fn a_volume_is_made_once_listed_and_deleted() {
        let (_d, v) = store();
        let made = v.create("data-1").unwrap();
        assert_eq!(made["volumeID"], "data-1");
        assert_eq!(made["token"].as_str().unwrap().len(), 32);
        assert_eq!(
            v.create("data-1").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(v.get("data-1").unwrap()["token"], made["token"]);
        v.create("a").unwrap();
        assert_eq!(
            v.list().unwrap(),
            json!([{"volumeID":"a","name":"a"},{"volumeID":"data-1","name":"data-1"}])
        );
        v.delete("data-1").await.unwrap();
        assert_eq!(v.get("data-1").unwrap_err().status, StatusCode::NOT_FOUND);
        assert_eq!(v.list().unwrap().as_array().unwrap().len(), 1);
    }

    /// A create cut off before `data` is not a volume, and the next
    /// create of the name finishes it.
    #[test]
    fn a_half_made_volume_is_finished_not_reported() {
        let (d, v) = store();
        std::fs::create_dir_all(d.path().join("e2b-volumes/half")).unwrap();
        assert_eq!(v.get("half").unwrap_err().status, StatusCode::NOT_FOUND);
        assert_eq!(v.list().unwrap(), json!([]));
        assert!(v.create("half").is_ok());
    }

    /// Whoever can write the store cannot make a volume of a folder
    /// elsewhere, or of one with a token they chose to be empty.
    #[test]
    fn the_store_is_read_without_following_links() {
        use std::os::unix::fs::PermissionsExt;
        let (d, v) = store();
        v.create("real").unwrap();
        let st = d.path().join("e2b-volumes");
        let mode =
            |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&st), 0o700);
        assert_eq!(mode(&st.join("real/data")), 0o777);
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir(outside.path().join("data")).unwrap();
        std::fs::write(outside.path().join("token"), "0".repeat(32)).unwrap();
        std::os::unix::fs::symlink(outside.path(), st.join("linked")).unwrap();
        std::fs::create_dir(st.join("inner")).unwrap();
        std::os::unix::fs::symlink("/", st.join("inner/data")).unwrap();
        std::fs::write(st.join("inner/token"), "0".repeat(32)).unwrap();
        std::fs::create_dir_all(st.join("empty/data")).unwrap();
        std::fs::write(st.join("empty/token"), "").unwrap();
        for id in ["linked", "inner", "empty"] {
            assert_eq!(
                v.token(id).unwrap_err().status,
                StatusCode::NOT_FOUND,
                "{id}"
            );
        }
        assert!(v
            .mounts(&[Mount {
                name: "inner".into(),
                path: "/x".into()
            }])
            .is_err());
        assert_eq!(
            v.list().unwrap(),
            json!([{"volumeID":"real","name":"real"}])
        );
    }

    /// A FIFO as a token answers at once (not a volume), never blocks.
    #[test]
    fn a_fifo_token_is_no_token() {
        let (d, v) = store();
        v.create("f").unwrap();
        let t = d.path().join("e2b-volumes/f/token");
        std::fs::remove_file(&t).unwrap();
        nix::unistd::mkfifo(&t, Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(v.token("f").unwrap_err().status, StatusCode::NOT_FOUND);
    }

    #[test]
    fn names_and_mounts_are_checked() {
        let (_d, v) = store();
        for bad in ["", "a/b", "..", "a b", &"x".repeat(MAX_NAME + 1)] {
            assert!(v.create(bad).is_err(), "{bad:?}");
        }
        assert_eq!(v.get("../etc").unwrap_err().status, StatusCode::NOT_FOUND);
        v.create("vol").unwrap();
        let m = |name: &str, path: &str| Mount {
            name: name.into(),
            path: path.into(),
        };
        let ok = v.mounts(&[m("vol", "/mnt/data")]).unwrap();
        assert!(ok[0].host_path.ends_with("e2b-volumes/vol/data"));
        for (mounts, why) in [
            (vec![m("vol", "mnt")], "absolute"),
            (vec![m("vol", "/mnt/../etc")], "absolute"),
            (vec![m("vol", "/mnt/")], "absolute"),
            (vec![m("vol", "/a"), m("vol", "/a")], "twice"),
            (vec![m("nope", "/a")], "not found"),
        ] {
            let e = v.mounts(&mounts).unwrap_err();
            assert!(e.message.contains(why), "{}", e.message);
        }
        let none = Volumes::new(&[]);
        assert!(none
            .create("x")
            .unwrap_err()
            .message
            .contains("volume_roots"));
        assert_eq!(none.list().unwrap(), json!([]));
    }
}
