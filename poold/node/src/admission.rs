//! Admission by host headroom.
//!
//! New work that makes the host hold more — a spawn, a pool refill, a
//! snapshot create, a branch — is refused (503, naming what is short and
//! the knob) while the host's available memory or the data dir's free disk
//! is under its floor (`min_free_memory_mib`, `min_free_disk_mib`). Work
//! already running is never touched: a sandbox that grows past the floor
//! keeps running, so the floor is a guard against starting what the host
//! cannot carry, not a quota (cgroup limits are the quota).
//!
//! Memory is `MemAvailable` (what the kernel can hand out without
//! swapping: free memory plus reclaimable page cache), disk is what
//! unprivileged writers may use on the data dir's filesystem.

use std::path::Path;

/// The host's headroom at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headroom {
    /// `MemAvailable` in MiB.
    pub memory_mib: u64,
    /// Free space on the data dir's filesystem, MiB.
    pub disk_mib: u64,
}

impl Headroom {
    /// Reads the headroom now. A figure the host does not report counts as
    /// plenty: admission never refuses on a reading it could not make.
    pub fn now(data_dir: &Path) -> Headroom {
        Headroom {
            memory_mib: mem_available_mib(
                &std::fs::read_to_string("/proc/meminfo").unwrap_or_default(),
            )
            .unwrap_or(u64::MAX),
            disk_mib: free_disk_mib(data_dir).unwrap_or(u64::MAX),
        }
    }

    /// Why `what` must not start under the floors, or `None` if it may.
    pub fn refusal(&self, what: &str, min_memory_mib: u64, min_disk_mib: u64) -> Option<String> {
        if self.memory_mib < min_memory_mib {
            return Some(format!(
                "{what} refused: the host has {} MiB of memory available, under the {min_memory_mib} MiB floor \
                 (min_free_memory_mib); delete sandboxes or shrink pools, or lower the floor",
                self.memory_mib
            ));
        }
        if self.disk_mib < min_disk_mib {
            return Some(format!(
                "{what} refused: the data dir's disk has {} MiB free, under the {min_disk_mib} MiB floor \
                 (min_free_disk_mib); delete snapshots (the store GC frees their chunks) or sandboxes, or lower the floor",
                self.disk_mib
            ));
        }
        None
    }
}

/// `MemAvailable` of a /proc/meminfo text, MiB.
fn mem_available_mib(meminfo: &str) -> Option<u64> {
    forkd_vmm::meminfo_field(meminfo, "MemAvailable").map(|kib| kib / 1024)
}

/// Space unprivileged writers may use on the filesystem of `path`, MiB.
fn free_disk_mib(path: &Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(path).ok()?;
    Some((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64) >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available() {
        let t = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2097152 kB\n";
        assert_eq!(mem_available_mib(t), Some(2048));
        assert_eq!(mem_available_mib("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn refuses_under_either_floor_and_names_the_knob() {
        let h = Headroom {
            memory_mib: 100,
            disk_mib: 5000,
        };
        assert_eq!(h.refusal("spawn", 64, 1024), None);
        let m = h.refusal("spawn", 256, 1024).unwrap();
        assert!(
            m.contains("100 MiB") && m.contains("min_free_memory_mib"),
            "{m}"
        );
        let m = h.refusal("branch", 64, 8000).unwrap();
        assert!(
            m.starts_with("branch refused") && m.contains("min_free_disk_mib"),
            "{m}"
        );
    }

    #[test]
    fn a_real_reading_is_plausible() {
        let h = Headroom::now(Path::new("/"));
        assert!(h.memory_mib > 0 && h.disk_mib > 0, "{h:?}");
    }
}
