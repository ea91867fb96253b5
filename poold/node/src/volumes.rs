//! Host folders an API caller names (docs/volumes.md): the one place
//! `volumes` of `POST /v1/snapshots` and `POST /v1/sandboxes` are checked.
//!
//! A host path must resolve (symlinks and `..` followed) to a directory
//! inside one of the configured `volume_roots`; with none configured, no
//! volume is accepted. A child's final volumes are checked again before it
//! starts, recorded ones included: a snapshot pulled from a hub carries
//! the host paths of the host that took it.

use crate::error::{Error, Result};
use forkd_api::VolumeSpec;
use forkd_vmm::Volume;
use std::path::{Path, PathBuf};

/// An [`Error::Invalid`] of the `volumes` field.
fn invalid(reason: impl Into<String>) -> Error {
    Error::invalid("volumes", reason)
}

/// Checks `specs` and returns them as volumes with canonical host paths.
pub fn accept(roots: &[PathBuf], specs: &[VolumeSpec]) -> Result<Vec<Volume>> {
    let vols = specs
        .iter()
        .map(|s| {
            let v = Volume {
                host_path: PathBuf::from(&s.host_path),
                guest_path: s.guest_path.clone(),
                read_only: s.read_only,
            };
            v.check_guest_path()
                .map_err(|e| invalid(format!("volumes: {e:#}")))?;
            confine(roots, &v)
        })
        .collect::<Result<Vec<_>>>()?;
    forkd_vmm::volume::check_list(&vols).map_err(|e| invalid(format!("volumes: {e:#}")))?;
    Ok(vols)
}

/// `v` with its host path resolved, if that is a directory inside one of
/// `roots`; an [`Error::Invalid`] naming what to fix otherwise.
pub fn confine(roots: &[PathBuf], v: &Volume) -> Result<Volume> {
    if roots.is_empty() {
        return Err(invalid(
            "volumes: this poold has no volume_roots configured, so it mounts no host folders; add volume_roots = [\"/srv/forkd-volumes\"] to its config (or --volume-root)",
        ));
    }
    let real = v
        .canonical()
        .map_err(|e| invalid(format!("volumes: {e:#}")))?;
    if !inside_roots(roots, &real.host_path) {
        return Err(invalid(format!(
            "volumes: host path {} is outside volume_roots ({}); poold mounts only folders under them",
            v.host_path.display(),
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(real)
}

/// Whether the canonical path `p` lies inside one of `roots` (each
/// resolved itself).
fn inside_roots(roots: &[PathBuf], p: &Path) -> bool {
    roots
        .iter()
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .any(|r| p.starts_with(&r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(h: &Path, g: &str) -> VolumeSpec {
        VolumeSpec {
            host_path: h.display().to_string(),
            guest_path: g.into(),
            read_only: false,
        }
    }

    #[test]
    fn host_paths_stay_inside_the_roots() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        let outside = t.path().join("outside");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
        let roots = vec![root.clone()];
        let ok = accept(&roots, &[spec(&root.join("a"), "/data")]).unwrap();
        assert_eq!(
            ok[0].host_path,
            std::fs::canonicalize(root.join("a")).unwrap()
        );
        for bad in [
            root.join("a/../../outside"),
            root.join("escape"),
            outside.clone(),
            root.join("missing"),
        ] {
            let e = accept(&roots, &[spec(&bad, "/data")]).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Invalid {
                        field: "volumes",
                        ..
                    }
                ),
                "{bad:?}"
            );
        }
        let e = accept(&[], &[spec(&root.join("a"), "/data")]).unwrap_err();
        assert!(e.to_string().contains("volume_roots"), "{e}");
        let e = accept(&roots, &[spec(&root.join("a"), "/etc")]).unwrap_err();
        assert!(e.to_string().contains("system directory"), "{e}");
        let e = accept(
            &roots,
            &[spec(&root.join("a"), "/d"), spec(&root.join("a"), "/d/x")],
        )
        .unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
    }
}
