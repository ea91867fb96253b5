//! The data dir: everything forkd keeps lives under one directory,
//! `$FORKD_HOME` (default `/var/lib/forkd`). Layout in docs/data-dir.md.

use std::path::PathBuf;

/// Default data dir for root.
pub const DEFAULT_HOME: &str = "/var/lib/forkd";

/// Paths inside one data dir.
#[derive(Debug, Clone)]
pub struct Paths {
    /// The data dir, `$FORKD_HOME`.
    pub home: PathBuf,
}

impl Paths {
    /// `$FORKD_HOME`, or the default.
    pub fn from_env() -> Paths {
        let home = std::env::var_os("FORKD_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_HOME));
        Paths { home }
    }

    /// The data dir at `home`.
    pub fn new(home: impl Into<PathBuf>) -> Paths {
        Paths { home: home.into() }
    }

    /// The kernel in use: `kernel/current` → `kernel/<release>`.
    pub fn kernel_dir(&self) -> PathBuf {
        self.home.join("kernel/current")
    }
    /// The guest kernel in use.
    pub fn vmlinuz(&self) -> PathBuf {
        self.kernel_dir().join("vmlinuz")
    }
    /// The initramfs in use (forkd-init).
    pub fn initramfs(&self) -> PathBuf {
        self.kernel_dir().join("initramfs.img")
    }
    /// Built guest images, one directory each.
    pub fn images_dir(&self) -> PathBuf {
        self.home.join("images")
    }
    /// Directory of one guest image (`rootfs.ext4`, `image.json`).
    pub fn image_dir(&self, name: &str) -> PathBuf {
        self.images_dir().join(name)
    }
    /// User recipes, next to the built-in ones in the repository.
    pub fn recipes_dir(&self) -> PathBuf {
        self.home.join("recipes")
    }
    /// The layer store.
    pub fn store_dir(&self) -> PathBuf {
        self.home.join("store")
    }
    /// Where forkd-fs mounts the store.
    pub fn mount_dir(&self) -> PathBuf {
        self.home.join("mnt")
    }
    /// Per-VM runtime directories.
    pub fn vms_dir(&self) -> PathBuf {
        self.home.join("run/vms")
    }
    /// Runtime directory of VM `id`.
    pub fn vm_dir(&self, id: &str) -> PathBuf {
        self.vms_dir().join(id)
    }
    /// Scratch space for snapshot builds (same filesystem as the store).
    pub fn staging_dir(&self) -> PathBuf {
        self.home.join("staging")
    }
    /// The daemon's own state.
    pub fn poold_dir(&self) -> PathBuf {
        self.home.join("poold")
    }
}

pub use forkd_vmm::check_socket_path;
