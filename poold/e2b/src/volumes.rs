//! E2B volumes: named folders a sandbox mounts at create
//! (`volumeMounts`), kept on this host as poold's own volumes are
//! (docs/volumes.md): host folders over virtio-fs, inside `volume_roots`.
//!
//! Layout, under the first of `volume_roots`:
//! `e2b-volumes/<name>/data` is the folder sandboxes mount and the content
//! API serves ([`crate::volume_files`]); `e2b-volumes/<name>/token` is
//! the bearer token of that API. A volume's id is its name (E2B's names
//! are `[a-zA-Z0-9_-]`, safe as a path component).
//!
//! Invariants: a volume exists exactly when its `data` folder does; a
//! create made the name's folder first (`mkdir`, so two creates of one
//! name cannot both win), then the token, then `data`, so a create cut off
//! half way is finished by the next create of that name, never answered
//! as an existing volume. A mount goes where the template's snapshot has
//! a volume (a restored machine gets no new devices); anywhere else is a
//! 400 naming where it can go.

use crate::error::{E2bError, E2bResult};
use axum::http::StatusCode;
use forkd_api::VolumeSpec;
use serde::Deserialize;
use serde_json::{json, Value};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Longest volume name.
pub const MAX_NAME: usize = 128;
/// Most volumes one sandbox mounts (poold's own limit on volumes).
pub const MAX_MOUNTS: usize = 8;

/// Where E2B volumes live; None when poold has no `volume_roots`.
pub struct Volumes {
    dir: Option<PathBuf>,
}

/// One `volumeMounts` entry.
#[derive(Debug, Deserialize)]
pub struct Mount {
    pub name: String,
    pub path: String,
}

fn not_found(id: &str) -> E2bError {
    E2bError::not_found(format!("volume {id:?} not found"))
}

fn io_error(what: &str, e: std::io::Error) -> E2bError {
    E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{what}: {e}"))
}

/// Checks a volume name (E2B's rule, and a bound).
pub fn check_name(name: &str) -> E2bResult<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(E2bError::bad_request(format!(
            "volume name {name:?}: use 1-{MAX_NAME} letters, digits, '_' and '-'"
        )))
    }
}

impl Volumes {
    /// The volumes of a poold whose `volume_roots` are `roots`.
    pub fn new(roots: &[PathBuf]) -> Volumes {
        Volumes {
            dir: roots.first().map(|r| r.join("e2b-volumes")),
        }
    }

    fn dir(&self) -> E2bResult<&Path> {
        self.dir.as_deref().ok_or_else(|| {
            E2bError::bad_request(
                "this poold has no volume_roots configured, so it keeps no volumes; add volume_roots = [\"/srv/forkd-volumes\"] to its config (docs/volumes.md)",
            )
        })
    }

    /// The folder volume `id` mounts and serves, if it exists.
    pub fn data(&self, id: &str) -> E2bResult<PathBuf> {
        check_name(id).map_err(|_| not_found(id))?;
        let data = self.dir()?.join(id).join("data");
        if data.is_dir() {
            Ok(data)
        } else {
            Err(not_found(id))
        }
    }

    /// Volume `id`'s token, if it exists.
    pub fn token(&self, id: &str) -> E2bResult<String> {
        self.data(id)?;
        std::fs::read_to_string(self.dir()?.join(id).join("token"))
            .map(|t| t.trim().to_string())
            .map_err(|e| io_error(&format!("reading volume {id:?}'s token"), e))
    }

    /// `POST /volumes`: makes volume `name`; a 400 when it exists.
    pub fn create(&self, name: &str) -> E2bResult<Value> {
        check_name(name)?;
        let base = self.dir()?.join(name);
        std::fs::create_dir_all(self.dir()?).map_err(|e| io_error("making e2b-volumes", e))?;
        match std::fs::create_dir(&base) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                if base.join("data").is_dir() {
                    return Err(E2bError::bad_request(format!(
                        "volume {name:?} exists: pick another name, or delete it first"
                    )));
                }
                // A create cut off half way: finish it.
            }
            Err(e) => return Err(io_error(&format!("making volume {name:?}"), e)),
        }
        let token = write_token(&base).map_err(|e| io_error("writing the volume's token", e))?;
        std::fs::create_dir(base.join("data"))
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Ok(()),
                _ => Err(e),
            })
            .map_err(|e| io_error(&format!("making volume {name:?}"), e))?;
        Ok(volume_json(name, &token))
    }

    /// `GET /volumes/{id}`.
    pub fn get(&self, id: &str) -> E2bResult<Value> {
        Ok(volume_json(id, &self.token(id)?))
    }

    /// `GET /volumes`: every volume, by name.
    pub fn list(&self) -> E2bResult<Value> {
        let Some(dir) = &self.dir else {
            return Ok(json!([]));
        };
        let mut names: Vec<String> = match std::fs::read_dir(dir) {
            Ok(rd) => rd
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| check_name(n).is_ok() && dir.join(n).join("data").is_dir())
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io_error("listing e2b-volumes", e)),
        };
        names.sort();
        Ok(json!(names
            .iter()
            .map(|n| json!({"volumeID": n, "name": n}))
            .collect::<Vec<_>>()))
    }

    /// `DELETE /volumes/{id}`: its files go; sandboxes mounting it see
    /// them gone, as with E2B.
    pub async fn delete(&self, id: &str) -> E2bResult<()> {
        self.data(id)?;
        let base = self.dir()?.join(id);
        // Renamed out of the way first (a name `check_name` refuses): the
        // volume is gone at once, even if the removal is cut off.
        let doomed = base.with_file_name(format!(".{id}.deleting-{:08x}", rand::random::<u32>()));
        std::fs::rename(&base, &doomed).map_err(|e| io_error("deleting the volume", e))?;
        tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&doomed))
            .await
            .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
            .map_err(|e| io_error("deleting the volume's files", e))
    }

    /// A create's `volumeMounts` as the spawn's volumes: each a volume
    /// that exists, at an absolute, normalised path, no path twice.
    pub fn mounts(&self, mounts: &[Mount]) -> E2bResult<Vec<VolumeSpec>> {
        if mounts.len() > MAX_MOUNTS {
            return Err(E2bError::bad_request(format!(
                "volumeMounts: {} mounts, at most {MAX_MOUNTS}",
                mounts.len()
            )));
        }
        let mut out: Vec<VolumeSpec> = Vec::new();
        for m in mounts {
            let bad = |why: &str| {
                E2bError::bad_request(format!("volumeMounts: {} at {:?}: {why}", m.name, m.path))
            };
            if !m.path.starts_with('/') || normalised(&m.path) != m.path {
                return Err(bad(
                    "give an absolute path without '.', '..', '//' or a trailing '/'",
                ));
            }
            if out.iter().any(|v| v.guest_path == m.path) {
                return Err(bad("that path is mounted twice"));
            }
            let data = self.data(&m.name).map_err(|e| bad(&e.message))?;
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

fn write_token(base: &Path) -> std::io::Result<String> {
    let path = base.join("token");
    if let Ok(t) = std::fs::read_to_string(&path) {
        return Ok(t.trim().to_string());
    }
    let token = format!("{:032x}", rand::random::<u128>());
    let tmp = base.join(".token.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(token.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(token)
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
