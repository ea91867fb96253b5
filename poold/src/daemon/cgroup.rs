//! Per-sandbox memory limits (`memory_limit_mib`) through cgroups, v2 (the
//! unified hierarchy most hosts run) or v1 (the memory controller of a
//! hybrid hierarchy). Each limited sandbox's QEMU moves into its own group,
//! `forkd/<sandbox-id>`, removed when the sandbox goes.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Which hierarchy holds the memory controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// cgroup v2 mounted at this path.
    V2(PathBuf),
    /// The v1 memory controller mounted at this path.
    V1(PathBuf),
}

impl Hierarchy {
    /// Finds the memory controller: v2 if `/sys/fs/cgroup` is unified and
    /// offers `memory`, else v1's `memory` mount.
    pub fn detect() -> Result<Hierarchy> {
        let root = Path::new("/sys/fs/cgroup");
        if let Ok(c) = std::fs::read_to_string(root.join("cgroup.controllers")) {
            if c.split_whitespace().any(|x| x == "memory") {
                return Ok(Hierarchy::V2(root.to_path_buf()));
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        for line in mounts.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() >= 4 && f[2] == "cgroup" && f[3].split(',').any(|o| o == "memory") {
                return Ok(Hierarchy::V1(PathBuf::from(f[1])));
            }
        }
        bail!("no cgroup memory controller found (neither cgroup v2 with `memory` nor a v1 memory mount); memory_limit_mib needs one")
    }

    fn parent(&self) -> PathBuf {
        match self {
            Hierarchy::V2(r) | Hierarchy::V1(r) => r.join("forkd"),
        }
    }

    /// The group of sandbox `id`.
    pub fn group(&self, id: &str) -> PathBuf {
        self.parent().join(id)
    }

    /// Creates `forkd/<id>` limited to `mib` MiB and moves `pid` into it.
    pub fn limit(&self, id: &str, pid: u32, mib: u64) -> Result<PathBuf> {
        let bytes = mib
            .checked_mul(1 << 20)
            .context("memory_limit_mib is too large")?;
        let parent = self.parent();
        std::fs::create_dir_all(&parent)
            .with_context(|| format!("creating cgroup {}", parent.display()))?;
        if let Hierarchy::V2(root) = self {
            // Children of a v2 group get a controller only when every
            // ancestor delegates it.
            enable_memory(root)?;
            enable_memory(&parent)?;
        }
        let g = self.group(id);
        std::fs::create_dir_all(&g).with_context(|| format!("creating cgroup {}", g.display()))?;
        let (limit_file, procs) = match self {
            Hierarchy::V2(_) => ("memory.max", "cgroup.procs"),
            Hierarchy::V1(_) => ("memory.limit_in_bytes", "cgroup.procs"),
        };
        write(&g.join(limit_file), &bytes.to_string())?;
        if let Hierarchy::V2(_) = self {
            // No swapping around the limit: a sandbox over it is OOM-killed.
            let _ = std::fs::write(g.join("memory.swap.max"), "0");
        }
        write(&g.join(procs), &pid.to_string())?;
        Ok(g)
    }

    /// Reads back a group's limit in bytes.
    pub fn read_limit(&self, id: &str) -> Result<u64> {
        let f = match self {
            Hierarchy::V2(_) => "memory.max",
            Hierarchy::V1(_) => "memory.limit_in_bytes",
        };
        let p = self.group(id).join(f);
        let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        s.trim()
            .parse()
            .with_context(|| format!("{} holds {s:?}", p.display()))
    }

    /// Removes the group of `id` (its processes must have exited).
    pub fn remove(&self, id: &str) {
        let g = self.group(id);
        for _ in 0..50 {
            match std::fs::remove_dir(&g) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                // EBUSY while the killed QEMU is still being torn down.
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
        tracing::warn!("could not remove cgroup {}", g.display());
    }
}

fn enable_memory(group: &Path) -> Result<()> {
    let f = group.join("cgroup.subtree_control");
    let cur = std::fs::read_to_string(&f).unwrap_or_default();
    if cur.split_whitespace().any(|c| c == "memory") {
        return Ok(());
    }
    write(&f, "+memory")
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).with_context(|| format!("writing {value:?} to {}", path.display()))
}
