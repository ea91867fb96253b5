//! Host memory accounting for benchmarks: what N children really cost.
//!
//! A child's QEMU maps the snapshot's memory.bin privately; its clean pages
//! are page cache shared by every child. So the host cost of N children is
//! each QEMU's memory *excluding* that mapping (private pages, TCG buffers,
//! QEMU itself, by PSS) plus the page cache memory.bin holds, once.

use std::path::Path;

/// kB figures of one process: its whole PSS, and the PSS of mappings of one
/// file.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcMem {
    /// PSS of the whole process, KiB.
    pub pss_kib: u64,
    /// PSS of the mappings of the chosen file, KiB.
    pub file_pss_kib: u64,
    /// RSS of the mappings of the chosen file, KiB (counts shared pages once per process).
    pub file_rss_kib: u64,
}

/// Reads `/proc/<pid>/smaps`; `file` picks the mappings counted apart.
pub fn proc_mem(pid: u32, file: &Path) -> Option<ProcMem> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let needle = file.to_string_lossy();
    let mut m = ProcMem::default();
    let mut inside = false;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            inside = line.ends_with(needle.as_ref());
            continue;
        }
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let Some(n) = v
            .trim()
            .strip_suffix(" kB")
            .and_then(|n| n.trim().parse::<u64>().ok())
        else {
            continue;
        };
        match k {
            "Pss" => {
                m.pss_kib += n;
                if inside {
                    m.file_pss_kib += n;
                }
            }
            "Rss" if inside => m.file_rss_kib += n,
            _ => {}
        }
    }
    Some(m)
}

/// Bytes of `path` resident in the page cache (mincore over a mapping).
pub fn resident_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len() as usize;
    if len == 0 {
        return Ok(0);
    }
    let page = 4096usize;
    // SAFETY: a read-only shared mapping of a file held open; unmapped below
    // before the file is closed.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let mut vec = vec![0u8; len.div_ceil(page)];
        let rc = libc::mincore(p, len, vec.as_mut_ptr());
        let err = std::io::Error::last_os_error();
        libc::munmap(p, len);
        if rc != 0 {
            return Err(err);
        }
        Ok(vec.iter().filter(|b| **b & 1 == 1).count() as u64 * page as u64)
    }
}

/// The host memory N children of one snapshot use, in MiB per child.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChildrenMem {
    /// Number of children measured.
    pub children: usize,
    /// Σ each QEMU's PSS outside memory.bin.
    pub private_mib: f64,
    /// memory.bin in the page cache (shared by all).
    pub shared_cache_mib: f64,
    /// What naive per-process accounting would say: Σ RSS of memory.bin.
    pub mapped_mib: f64,
}

impl ChildrenMem {
    /// Measures children `pids` of a snapshot whose memory file is `memory`.
    pub fn measure(pids: &[u32], memory: &Path) -> ChildrenMem {
        let mut c = ChildrenMem {
            children: pids.len(),
            ..Default::default()
        };
        for &pid in pids {
            if let Some(m) = proc_mem(pid, memory) {
                c.private_mib += (m.pss_kib - m.file_pss_kib) as f64 / 1024.0;
                c.mapped_mib += m.file_rss_kib as f64 / 1024.0;
            }
        }
        c.shared_cache_mib = resident_bytes(memory).unwrap_or(0) as f64 / (1u64 << 20) as f64;
        c
    }

    /// Host MiB per child: private part plus an equal share of the cache.
    pub fn per_child_mib(&self) -> f64 {
        (self.private_mib + self.shared_cache_mib) / self.children.max(1) as f64
    }
}
