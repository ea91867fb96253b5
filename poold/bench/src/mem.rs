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
    /// Pages in swap, this process's share (SwapPss), KiB.
    pub swap_pss_kib: u64,
}

/// One line of `/proc/<pid>/smaps`.
enum SmapsLine<'a> {
    /// A mapping's header (`start-end perms offset dev inode [path]`).
    Mapping,
    /// A `Name:  N kB` field of the current mapping.
    Field(&'a str, u64),
    /// Anything else (flags, non-kB fields).
    Other,
}

fn smaps_line(line: &str) -> SmapsLine<'_> {
    let first = line.split_whitespace().next().unwrap_or("");
    if first.contains('-') && !first.ends_with(':') {
        return SmapsLine::Mapping;
    }
    let Some((k, v)) = line.split_once(':') else {
        return SmapsLine::Other;
    };
    match v
        .trim()
        .strip_suffix(" kB")
        .and_then(|n| n.trim().parse::<u64>().ok())
    {
        Some(n) => SmapsLine::Field(k, n),
        None => SmapsLine::Other,
    }
}

/// Reads `/proc/<pid>/smaps`; `file` picks the mappings counted apart.
pub fn proc_mem(pid: u32, file: &Path) -> Option<ProcMem> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let needle = file.to_string_lossy();
    let mut m = ProcMem::default();
    let mut inside = false;
    for line in text.lines() {
        let (k, n) = match smaps_line(line) {
            SmapsLine::Mapping => {
                inside = line.ends_with(needle.as_ref());
                continue;
            }
            SmapsLine::Field(k, n) => (k, n),
            SmapsLine::Other => continue,
        };
        match k {
            "Pss" => {
                m.pss_kib += n;
                if inside {
                    m.file_pss_kib += n;
                }
            }
            "Rss" if inside => m.file_rss_kib += n,
            "SwapPss" => m.swap_pss_kib += n,
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
    /// Σ each QEMU's pages in swap (SwapPss): not resident, so outside
    /// `private_mib`; what it costs depends on the swap (see [`compressed_ratio`]).
    pub swapped_mib: f64,
    /// The RAM those swapped pages hold when swap is compressed RAM (zram,
    /// zswap), by the ratio at the time of measuring; None otherwise.
    pub compressed_mib: Option<f64>,
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
                c.swapped_mib += m.swap_pss_kib as f64 / 1024.0;
            }
        }
        c.shared_cache_mib = resident_bytes(memory).unwrap_or(0) as f64 / (1u64 << 20) as f64;
        c.compressed_mib = compressed_ratio().map(|r| r * c.swapped_mib);
        c
    }

    /// Host MiB per child: private part plus an equal share of the cache.
    pub fn per_child_mib(&self) -> f64 {
        (self.private_mib + self.shared_cache_mib) / self.children.max(1) as f64
    }
}

/// RAM per byte swapped, when swapped pages are kept compressed in RAM:
/// - zram as the only swap: Σ `mem_used_total` / Σ `orig_data_size` of the
///   devices' `mm_stat`;
/// - zswap (in front of any swap): its pool (`Zswap` of /proc/meminfo)
///   over all swap in use.
///
/// None with no swap in use, or with swap on disk (no RAM, slower reads).
/// Zero-filled pages cost zram nothing and count in neither figure, so this
/// errs high.
pub fn compressed_ratio() -> Option<f64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |name| forkd_vmm::meminfo_field(&meminfo, name);
    let swapped = kib("SwapTotal")?.saturating_sub(kib("SwapFree")?);
    let zswap_on = zswap_param("enabled") == "Y";
    match kib("Zswap") {
        // zswap's pool over everything swapped: pages it did not keep went
        // to the device and cost no RAM.
        Some(pool) if zswap_on && swapped > 0 => Some(pool as f64 / swapped as f64),
        _ => zram_ratio(),
    }
}

/// The host's swap in a few words (`zram0 (lzo-rle)`, `zswap (deflate) over
/// /var/swap`), for a report; None without swap.
pub fn swap_kind() -> Option<String> {
    let devs: Vec<String> = swap_devices()
        .into_iter()
        .map(|d| match zram_name(&d) {
            Some(n) => {
                let algo = std::fs::read_to_string(format!("/sys/block/{n}/comp_algorithm"))
                    .unwrap_or_default();
                let chosen = algo
                    .split_whitespace()
                    .find_map(|a| a.strip_prefix('[')?.strip_suffix(']'))
                    .unwrap_or("?");
                format!("{n} ({chosen})")
            }
            None => d,
        })
        .collect();
    if devs.is_empty() {
        return None;
    }
    Some(if zswap_param("enabled") == "Y" {
        format!(
            "zswap ({}) over {}",
            zswap_param("compressor"),
            devs.join(", ")
        )
    } else {
        devs.join(", ")
    })
}

/// The active swap devices and files (/proc/swaps, first column).
fn swap_devices() -> Vec<String> {
    std::fs::read_to_string("/proc/swaps")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|l| Some(l.split_whitespace().next()?.to_string()))
        .collect()
}

/// `zram0` for `/dev/zram0`; None for any other swap.
fn zram_name(dev: &str) -> Option<&str> {
    dev.strip_prefix("/dev/").filter(|n| n.starts_with("zram"))
}

/// A zswap module parameter (`enabled`, `compressor`); empty without zswap.
fn zswap_param(name: &str) -> String {
    std::fs::read_to_string(format!("/sys/module/zswap/parameters/{name}"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn zram_ratio() -> Option<f64> {
    let (mut used, mut orig) = (0u64, 0u64);
    for dev in swap_devices() {
        let name = zram_name(&dev)?;
        let stat = std::fs::read_to_string(format!("/sys/block/{name}/mm_stat")).ok()?;
        let f: Vec<u64> = stat
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        // mm_stat: orig_data_size compr_data_size mem_used_total ...
        orig += *f.first()?;
        used += *f.get(2)?;
    }
    (orig > 0).then(|| used as f64 / orig as f64)
}

/// Where one process's memory goes, by PSS, MiB: a QEMU child split into
/// the parts a change could shrink.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct MemBreakdown {
    /// The whole process.
    pub total_mib: f64,
    /// Guest RAM pages written since the restore (private copies of
    /// memory.bin's pages).
    pub guest_private_mib: f64,
    /// Guest RAM read from memory.bin's page cache (this process's share).
    pub guest_shared_mib: f64,
    /// TCG's translated code (the executable anonymous mapping); 0 under KVM.
    pub tcg_code_mib: f64,
    /// QEMU's malloc heap (`[heap]`; thread arenas count as other anonymous).
    pub heap_mib: f64,
    /// Every other anonymous mapping (thread stacks and arenas, device
    /// buffers, relocated library data).
    pub other_anon_mib: f64,
    /// File-backed mappings of QEMU and its libraries (this process's share).
    pub binaries_mib: f64,
}

/// Splits process `pid`'s PSS (see [`MemBreakdown`]); `memory` is the
/// snapshot's memory file it maps.
pub fn breakdown(pid: u32, memory: &Path) -> Option<MemBreakdown> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    Some(breakdown_of(&text, memory))
}

fn breakdown_of(text: &str, memory: &Path) -> MemBreakdown {
    let needle = memory.to_string_lossy();
    let mut b = MemBreakdown::default();
    // (kind of the current mapping, its Pss, its Anonymous)
    let mut cur: Option<(Kind, u64, u64)> = None;
    let flush = |c: Option<(Kind, u64, u64)>, b: &mut MemBreakdown| {
        let Some((kind, pss, anon)) = c else { return };
        let mib = |k: u64| k as f64 / 1024.0;
        b.total_mib += mib(pss);
        match kind {
            Kind::Guest => {
                b.guest_private_mib += mib(anon);
                b.guest_shared_mib += mib(pss.saturating_sub(anon));
            }
            Kind::TcgCode => b.tcg_code_mib += mib(pss),
            Kind::Heap => b.heap_mib += mib(pss),
            Kind::File => {
                b.other_anon_mib += mib(anon);
                b.binaries_mib += mib(pss.saturating_sub(anon));
            }
            Kind::Anon => b.other_anon_mib += mib(pss),
        }
    };
    for line in text.lines() {
        match smaps_line(line) {
            SmapsLine::Mapping => {
                flush(cur.take(), &mut b);
                let mut f = line.split_whitespace().skip(1);
                let perms = f.next().unwrap_or("");
                let name = f.nth(3).unwrap_or("");
                let kind = if line.ends_with(needle.as_ref()) {
                    Kind::Guest
                } else if name == "[heap]" {
                    Kind::Heap
                } else if name.starts_with('/') {
                    Kind::File
                } else if perms.contains('x') {
                    Kind::TcgCode
                } else {
                    Kind::Anon
                };
                cur = Some((kind, 0, 0));
            }
            SmapsLine::Field(k, n) => {
                if let Some(c) = cur.as_mut() {
                    match k {
                        "Pss" => c.1 = n,
                        "Anonymous" => c.2 = n,
                        _ => {}
                    }
                }
            }
            SmapsLine::Other => {}
        }
    }
    flush(cur.take(), &mut b);
    b
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Guest,
    TcgCode,
    Heap,
    File,
    Anon,
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0000000-55d0c0100000 r-xp 00000000 fe:01 123  /usr/bin/qemu-system-x86_64
Rss:                1024 kB
Pss:                 512 kB
Anonymous:             0 kB
55d0c2000000-55d0c2400000 rw-p 00000000 00:00 0   [heap]
Rss:                4096 kB
Pss:                4096 kB
Anonymous:          4096 kB
7f0000000000-7f0040000000 rwxp 00000000 00:00 0
Rss:               10240 kB
Pss:               10240 kB
Anonymous:         10240 kB
7f1000000000-7f1020000000 rw-p 00000000 00:2f 7   /mnt/by-id/abc/memory.bin
Rss:               52000 kB
Pss:                3072 kB
Anonymous:          2048 kB
7f2000000000-7f2000100000 rw-p 00000000 00:00 0
Rss:                1024 kB
Pss:                1024 kB
Anonymous:          1024 kB
";

    #[test]
    fn breakdown_sorts_each_mapping_into_its_part() {
        let b = breakdown_of(SMAPS, Path::new("/mnt/by-id/abc/memory.bin"));
        assert_eq!(
            b.total_mib,
            (512 + 4096 + 10240 + 3072 + 1024) as f64 / 1024.0
        );
        assert_eq!(b.binaries_mib, 0.5);
        assert_eq!(b.heap_mib, 4.0);
        assert_eq!(b.tcg_code_mib, 10.0);
        assert_eq!(b.guest_private_mib, 2.0);
        assert_eq!(b.guest_shared_mib, 1.0);
        assert_eq!(b.other_anon_mib, 1.0);
    }
}
