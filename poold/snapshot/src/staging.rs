//! Scratch directories for snapshot builds (`$FORKD_HOME/staging/<name>`).
//!
//! A directory is removed when its [`Staging`] guard drops, on success and on
//! failure. If the process is killed instead, the directory's `owner.json`
//! names the process (pid + start time), and [`sweep`] removes it once that
//! process is provably gone.

use anyhow::{Context, Result};
use forkd_vmm::ProcId;
use std::path::{Path, PathBuf};

/// A staging directory that is removed on drop.
pub struct Staging {
    path: PathBuf,
}

impl Staging {
    /// Creates `staging_root/<prefix>-<random>` owned by this process.
    pub fn create(staging_root: &Path, prefix: &str) -> Result<Staging> {
        let path = staging_root.join(format!("{prefix}-{}", crate::util::random_hex(6)));
        forkd_vmm::private::create_dir_all(&path)
            .with_context(|| format!("creating staging dir {}", path.display()))?;
        forkd_vmm::private::write(
            &path.join("owner.json"),
            &serde_json::to_vec(&ProcId::current())?,
        )?;
        Ok(Staging { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A file inside it.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Removes staging directories whose owner process is gone. Returns how many.
pub fn sweep(staging_root: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(staging_root) else {
        return 0;
    };
    let mut n = 0;
    for ent in rd.flatten() {
        let owner = std::fs::read(ent.path().join("owner.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<ProcId>(&b).ok());
        // Image builds keep their own staging (without owner.json): leave it.
        if owner.is_some_and(|o| !o.is_alive()) && std::fs::remove_dir_all(ent.path()).is_ok() {
            n += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_on_drop_and_swept_when_owner_dead() {
        let root = tempfile::tempdir().unwrap();
        let s = Staging::create(root.path(), "t").unwrap();
        let p = s.path().to_path_buf();
        assert!(p.is_dir());
        assert_eq!(sweep(root.path()), 0, "a live owner's dir stays");
        drop(s);
        assert!(!p.exists());

        let dead = root.path().join("t-dead");
        std::fs::create_dir_all(&dead).unwrap();
        let mut me = ProcId::current();
        me.start_time += 1;
        std::fs::write(dead.join("owner.json"), serde_json::to_vec(&me).unwrap()).unwrap();
        assert_eq!(sweep(root.path()), 1);
        assert!(!dead.exists());
    }
}
