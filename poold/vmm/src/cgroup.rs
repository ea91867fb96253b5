//! Per-sandbox quotas through cgroups: memory (`memory_limit_mib`), CPU
//! (`cpus`, a CFS quota in CPUs) and tasks (`pids_max`), on cgroup v2 (the
//! unified hierarchy most hosts run) or v1 (one mount per controller, as on
//! a hybrid host).
//!
//! Invariants: a limited sandbox's QEMU lives in `forkd/<sandbox-id>` of
//! every hierarchy whose controller it is limited by; the group is made,
//! limited and only then joined, and removed when the sandbox goes. The
//! `forkd` parent holds no process (cgroup v2's no-internal-process rule).
//!
//! Joining is the costly step: the kernel takes `cgroup_threadgroup_rwsem`
//! for writing, which waits for an RCU grace period (~15 ms on the 2-core
//! test host, v1 and v2 alike). [`Hierarchy::limit`] therefore joins only
//! groups a process is not in yet, so limiting a child again (a pooled child
//! joined when parked, then given the request's values when handed out)
//! only writes values.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The limits of one sandbox; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    /// Memory limit, MiB (memory.max, which QEMU's RAM counts against).
    pub memory_mib: Option<u64>,
    /// CPU time per wall time, in CPUs (0.5 = half a core).
    pub cpus: Option<f64>,
    /// Most tasks (QEMU's threads) the group may hold.
    pub pids_max: Option<u64>,
}

/// The CFS period: quota is `cpus` × this.
const CPU_PERIOD_US: u64 = 100_000;
/// Fewest tasks a sandbox may be limited to: QEMU needs a main thread, a
/// thread per vCPU, RCU and I/O workers.
pub const MIN_PIDS: u64 = 32;
/// Most CPUs a quota may name.
pub const MAX_CPUS: f64 = 1024.0;

impl Limits {
    /// True when nothing is limited, so no cgroup is needed.
    pub fn is_empty(&self) -> bool {
        self.memory_mib.is_none() && self.cpus.is_none() && self.pids_max.is_none()
    }

    /// Checks each value; the error names the field and its range.
    pub fn validate(&self) -> Result<()> {
        if self.memory_mib == Some(0) {
            bail!("memory_limit_mib must be ≥ 1");
        }
        if let Some(c) = self.cpus {
            if !(c.is_finite() && (0.01..=MAX_CPUS).contains(&c)) {
                bail!("cpus must be between 0.01 and {MAX_CPUS} (a CPU quota: 0.5 is half a core); got {c}");
            }
        }
        if let Some(p) = self.pids_max {
            if !(MIN_PIDS..=4_194_304).contains(&p) {
                bail!("pids_max must be between {MIN_PIDS} and 4194304 (QEMU itself needs a few dozen tasks); got {p}");
            }
        }
        Ok(())
    }

    /// Fills what is unset from `defaults`.
    pub fn or(self, defaults: Limits) -> Limits {
        Limits {
            memory_mib: self.memory_mib.or(defaults.memory_mib),
            cpus: self.cpus.or(defaults.cpus),
            pids_max: self.pids_max.or(defaults.pids_max),
        }
    }
}

/// A controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Controller {
    /// `memory`: caps the VM process's memory.
    Memory,
    /// `cpu`: the CFS quota.
    Cpu,
    /// `pids`: caps the number of tasks.
    Pids,
}

impl Controller {
    fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Cpu => "cpu",
            Controller::Pids => "pids",
        }
    }
}

/// Where the controllers are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// cgroup v2 mounted at `root`, offering `controllers`.
    V2 {
        /// The unified mount, normally `/sys/fs/cgroup`.
        root: PathBuf,
        /// Controllers listed in the root's `cgroup.controllers`.
        controllers: Vec<String>,
    },
    /// cgroup v1: each controller's own mount, when it has one.
    V1 {
        /// Mount of the v1 memory controller.
        memory: Option<PathBuf>,
        /// Mount of the v1 cpu controller.
        cpu: Option<PathBuf>,
        /// Mount of the v1 pids controller.
        pids: Option<PathBuf>,
    },
}

impl Hierarchy {
    /// Finds the controllers: v2 if `/sys/fs/cgroup` is unified and offers
    /// `memory`, else the v1 mounts of memory, cpu and pids.
    pub fn detect() -> Result<Hierarchy> {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        Self::detect_in(Path::new("/sys/fs/cgroup"), &mounts)
    }

    /// [`Hierarchy::detect`] with another cgroup2 root and mount table
    /// (`/proc/self/mounts` text); `forkd doctor`'s tests use fake ones.
    pub fn detect_in(root: &Path, mounts: &str) -> Result<Hierarchy> {
        if let Ok(c) = std::fs::read_to_string(root.join("cgroup.controllers")) {
            let controllers: Vec<String> = c.split_whitespace().map(String::from).collect();
            if controllers.iter().any(|x| x == "memory") {
                return Ok(Hierarchy::V2 {
                    root: root.to_path_buf(),
                    controllers,
                });
            }
        }
        let find = |ctl: &str| {
            mounts.lines().find_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                (f.len() >= 4 && f[2] == "cgroup" && f[3].split(',').any(|o| o == ctl))
                    .then(|| PathBuf::from(f[1]))
            })
        };
        let h = Hierarchy::V1 {
            memory: find("memory"),
            cpu: find("cpu"),
            pids: find("pids"),
        };
        if let Hierarchy::V1 {
            memory: None,
            cpu: None,
            pids: None,
        } = h
        {
            bail!("no cgroup controllers found (neither cgroup v2 with `memory` nor v1 memory/cpu/pids mounts); sandbox limits need them");
        }
        Ok(h)
    }

    /// Whether `c` can be limited on this host.
    pub fn supports(&self, c: Controller) -> bool {
        self.mount_of(c).is_some()
    }

    /// The hierarchy root holding controller `c`.
    fn mount_of(&self, c: Controller) -> Option<&Path> {
        match self {
            Hierarchy::V2 { root, controllers } => controllers
                .iter()
                .any(|x| x == c.name())
                .then_some(root.as_path()),
            Hierarchy::V1 { memory, cpu, pids } => match c {
                Controller::Memory => memory.as_deref(),
                Controller::Cpu => cpu.as_deref(),
                Controller::Pids => pids.as_deref(),
            },
        }
    }

    /// The first limit this host cannot enforce, as an error for the user.
    pub fn check(h: Option<&Hierarchy>, l: &Limits) -> Result<()> {
        for (set, c, field) in [
            (
                l.memory_mib.is_some(),
                Controller::Memory,
                "memory_limit_mib",
            ),
            (l.cpus.is_some(), Controller::Cpu, "cpus"),
            (l.pids_max.is_some(), Controller::Pids, "pids_max"),
        ] {
            if set && !h.is_some_and(|h| h.supports(c)) {
                bail!(
                    "{field} needs the cgroup {} controller, and this host has none (see `forkd doctor` or docs/security.md)",
                    c.name()
                );
            }
        }
        Ok(())
    }

    /// The group of sandbox `id` under controller `c`'s hierarchy.
    pub fn group(&self, c: Controller, id: &str) -> Option<PathBuf> {
        self.mount_of(c).map(|r| r.join("forkd").join(id))
    }

    /// Every distinct group directory sandbox `id` may have.
    fn groups(&self, id: &str) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = Vec::new();
        for c in [Controller::Memory, Controller::Cpu, Controller::Pids] {
            if let Some(g) = self.group(c, id) {
                if !v.contains(&g) {
                    v.push(g);
                }
            }
        }
        v
    }

    /// Creates `forkd/<id>` in each hierarchy a limit needs, sets the
    /// limits, then moves `pids` in (a VM's QEMU and its virtiofsd) unless
    /// they are there already.
    pub fn limit(&self, id: &str, pids: &[u32], l: &Limits) -> Result<()> {
        let mut joined: Vec<PathBuf> = Vec::new();
        for c in [Controller::Memory, Controller::Cpu, Controller::Pids] {
            let Some(values) = self.files_for(c, l)? else {
                continue;
            };
            let root = self.mount_of(c).context("controller vanished")?;
            let parent = root.join("forkd");
            std::fs::create_dir_all(&parent)
                .with_context(|| format!("creating cgroup {}", parent.display()))?;
            if let Hierarchy::V2 { .. } = self {
                // A v2 child gets a controller only when every ancestor
                // delegates it.
                enable(root, c.name())?;
                enable(&parent, c.name())?;
            }
            let g = parent.join(id);
            std::fs::create_dir_all(&g)
                .with_context(|| format!("creating cgroup {}", g.display()))?;
            for (file, value) in values {
                match write(&g.join(file), &value) {
                    // Absent without swap accounting; nothing to turn off.
                    Err(_) if file == "memory.swap.max" => {}
                    r => r?,
                }
            }
            if !joined.contains(&g) {
                joined.push(g);
            }
        }
        for g in joined {
            let members = std::fs::read_to_string(g.join("cgroup.procs")).unwrap_or_default();
            for pid in pids {
                let pid = pid.to_string();
                if !members.lines().any(|m| m == pid) {
                    write(&g.join("cgroup.procs"), &pid)?;
                }
            }
        }
        Ok(())
    }

    /// The files and values that set controller `c`'s limit, or None when
    /// `l` does not limit it.
    fn files_for(&self, c: Controller, l: &Limits) -> Result<Option<Vec<(&'static str, String)>>> {
        let v2 = matches!(self, Hierarchy::V2 { .. });
        Ok(match c {
            Controller::Memory => l.memory_mib.map(|mib| {
                let bytes = mib.saturating_mul(1 << 20).to_string();
                if v2 {
                    // No swapping around the limit: over it, the OOM killer.
                    vec![("memory.max", bytes), ("memory.swap.max", "0".into())]
                } else {
                    vec![("memory.limit_in_bytes", bytes)]
                }
            }),
            Controller::Cpu => l.cpus.map(|cpus| {
                let quota = ((cpus * CPU_PERIOD_US as f64) as u64).max(1000);
                if v2 {
                    vec![("cpu.max", format!("{quota} {CPU_PERIOD_US}"))]
                } else {
                    vec![
                        ("cpu.cfs_period_us", CPU_PERIOD_US.to_string()),
                        ("cpu.cfs_quota_us", quota.to_string()),
                    ]
                }
            }),
            Controller::Pids => l.pids_max.map(|p| vec![("pids.max", p.to_string())]),
        })
    }

    /// Lets sandbox `id` swap despite its memory limit (cgroup v2 sets
    /// `memory.swap.max` 0 with every limit): for a parked child paged out
    /// on purpose. The hand-out's [`Hierarchy::limit`] turns swapping off
    /// again; what is in swap then stays there until the child touches it.
    /// A no-op under v1 (forkd sets no memsw limit) or without a group.
    pub fn allow_swap(&self, id: &str) -> Result<()> {
        if !matches!(self, Hierarchy::V2 { .. }) {
            return Ok(());
        }
        match self.group(Controller::Memory, id) {
            Some(g) if g.join("memory.swap.max").exists() => {
                write(&g.join("memory.swap.max"), "max")
            }
            _ => Ok(()),
        }
    }

    /// Reads back the limits of sandbox `id` (unset when its group is absent).
    pub fn read_limits(&self, id: &str) -> Limits {
        let read = |c: Controller, f: &str| {
            let p = self.group(c, id)?.join(f);
            std::fs::read_to_string(p)
                .ok()
                .map(|s| s.trim().to_string())
        };
        let v2 = matches!(self, Hierarchy::V2 { .. });
        let memory_mib = read(
            Controller::Memory,
            if v2 {
                "memory.max"
            } else {
                "memory.limit_in_bytes"
            },
        )
        .and_then(|s| s.parse::<u64>().ok())
        .map(|b| b >> 20);
        let cpus = if v2 {
            read(Controller::Cpu, "cpu.max").and_then(|s| {
                let mut it = s.split_whitespace();
                let q: f64 = it.next()?.parse().ok()?;
                let p: f64 = it.next()?.parse().ok()?;
                Some(q / p)
            })
        } else {
            let q = read(Controller::Cpu, "cpu.cfs_quota_us").and_then(|s| s.parse::<f64>().ok());
            let p = read(Controller::Cpu, "cpu.cfs_period_us").and_then(|s| s.parse::<f64>().ok());
            q.zip(p).filter(|(q, _)| *q > 0.0).map(|(q, p)| q / p)
        };
        let pids_max = read(Controller::Pids, "pids.max").and_then(|s| s.parse().ok());
        Limits {
            memory_mib,
            cpus,
            pids_max,
        }
    }

    /// Removes the groups of `id` (their processes must have exited).
    pub fn remove(&self, id: &str) {
        for g in self.groups(id) {
            remove_group(&g);
        }
    }

    /// Removes every group under `forkd/` that holds no process, is older
    /// than `older_than` and whose id `keep` does not claim: groups a
    /// removal gave up on (a QEMU slower to exit than its retries), or that
    /// a process killed between making and joining a group left. A group
    /// is made and joined within one call, so an empty one that old is
    /// nobody's, whichever data dir made it. Returns the ids removed.
    pub fn sweep_empty(&self, older_than: Duration, keep: impl Fn(&str) -> bool) -> Vec<String> {
        let mut removed = Vec::new();
        for c in [Controller::Memory, Controller::Cpu, Controller::Pids] {
            let Some(parent) = self.mount_of(c).map(|r| r.join("forkd")) else {
                continue;
            };
            let Ok(rd) = std::fs::read_dir(&parent) else {
                continue;
            };
            for e in rd.flatten() {
                let id = e.file_name().to_string_lossy().into_owned();
                if keep(&id) || !e.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                if !is_stale_empty(&e.path(), older_than) {
                    continue;
                }
                // EBUSY: a process joined since; it is someone's.
                if std::fs::remove_dir(e.path()).is_ok() && !removed.contains(&id) {
                    removed.push(id);
                }
            }
        }
        removed
    }
}

/// Whether group `g` holds no process and was made over `older_than` ago.
fn is_stale_empty(g: &Path, older_than: Duration) -> bool {
    let empty = std::fs::read_to_string(g.join("cgroup.procs")).is_ok_and(|p| p.trim().is_empty());
    let old = std::fs::metadata(g)
        .and_then(|m| m.modified())
        .is_ok_and(|t| t.elapsed().is_ok_and(|a| a >= older_than));
    empty && old
}

fn remove_group(g: &Path) {
    for _ in 0..50 {
        match std::fs::remove_dir(g) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            // EBUSY while the killed QEMU is still being torn down.
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    tracing::warn!("could not remove cgroup {}", g.display());
}

fn enable(group: &Path, controller: &str) -> Result<()> {
    let f = group.join("cgroup.subtree_control");
    let cur = std::fs::read_to_string(&f).unwrap_or_default();
    if cur.split_whitespace().any(|c| c == controller) {
        return Ok(());
    }
    write(&f, &format!("+{controller}"))
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).with_context(|| format!("writing {value:?} to {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On this host's real hierarchy (root): an empty group of nobody is
    /// swept; one holding a process, one `keep` claims, and one younger
    /// than the age given are not.
    #[test]
    fn sweeps_only_old_empty_groups_of_nobody() {
        let Ok(h) = Hierarchy::detect() else { return };
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let Some(c) = [Controller::Pids, Controller::Memory, Controller::Cpu]
            .into_iter()
            .find(|&c| h.supports(c))
        else {
            return;
        };
        let tag = std::process::id();
        let id = |n: &str| format!("sweeptest-{tag}-{n}");
        let lim = Limits {
            pids_max: Some(64),
            memory_mib: Some(64),
            cpus: Some(1.0),
        };
        let lim = Limits {
            pids_max: lim.pids_max.filter(|_| c == Controller::Pids),
            memory_mib: lim.memory_mib.filter(|_| c == Controller::Memory),
            cpus: lim.cpus.filter(|_| c == Controller::Cpu),
        };
        let mut sleeper = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        for n in ["leaked", "busy", "kept"] {
            let pids = if n == "busy" {
                vec![sleeper.id()]
            } else {
                vec![]
            };
            h.limit(&id(n), &pids, &lim).unwrap();
        }
        let mine = |x: &str| x.starts_with(&format!("sweeptest-{tag}-"));
        let keep = |x: &str| !mine(x) || x == id("kept");
        assert!(
            h.sweep_empty(Duration::from_secs(3600), keep).is_empty(),
            "a group made just now is not old"
        );
        assert_eq!(h.sweep_empty(Duration::ZERO, keep), vec![id("leaked")]);
        assert!(!h.group(c, &id("leaked")).unwrap().exists());
        assert!(h.group(c, &id("busy")).unwrap().exists());
        assert!(h.group(c, &id("kept")).unwrap().exists());
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
        h.remove(&id("busy"));
        h.remove(&id("kept"));
        assert!(!h.group(c, &id("busy")).unwrap().exists());
    }

    #[test]
    fn detects_v1_controllers_from_mounts() {
        let t = tempfile::tempdir().unwrap();
        let mounts = "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n\
                      cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,memory 0 0\n\
                      cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n";
        let h = Hierarchy::detect_in(t.path(), mounts).unwrap();
        assert!(h.supports(Controller::Memory));
        assert!(h.supports(Controller::Cpu));
        assert!(!h.supports(Controller::Pids));
        assert_eq!(
            h.group(Controller::Cpu, "sb-1").unwrap(),
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/forkd/sb-1")
        );
        let e = Hierarchy::check(
            Some(&h),
            &Limits {
                pids_max: Some(100),
                ..Limits::default()
            },
        )
        .unwrap_err();
        assert!(format!("{e}").contains("pids_max"), "{e}");
    }

    #[test]
    fn detects_v2_and_limits_a_fake_tree() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(
            t.path().join("cgroup.controllers"),
            "cpuset cpu io memory pids",
        )
        .unwrap();
        let h = Hierarchy::detect_in(t.path(), "").unwrap();
        assert!(h.supports(Controller::Pids));
        let l = Limits {
            memory_mib: Some(256),
            cpus: Some(1.5),
            pids_max: Some(64),
        };
        h.limit("sb-x", &[4242], &l).unwrap();
        let g = t.path().join("forkd/sb-x");
        assert_eq!(
            std::fs::read_to_string(g.join("cpu.max")).unwrap(),
            "150000 100000"
        );
        assert_eq!(std::fs::read_to_string(g.join("pids.max")).unwrap(), "64");
        assert_eq!(
            std::fs::read_to_string(g.join("cgroup.procs")).unwrap(),
            "4242"
        );
        assert_eq!(
            std::fs::read_to_string(t.path().join("forkd/cgroup.subtree_control")).unwrap(),
            "+pids"
        );
        assert_eq!(h.read_limits("sb-x"), l);
        // Limiting it again (a pooled child at hand-out) writes the values
        // and joins only the pids not yet in the group: the kernel lists
        // members one per line, and a join would rewrite this fake file.
        std::fs::write(g.join("cgroup.procs"), "4242\n").unwrap();
        let l2 = Limits {
            pids_max: Some(128),
            ..l
        };
        h.limit("sb-x", &[4242], &l2).unwrap();
        assert_eq!(std::fs::read_to_string(g.join("pids.max")).unwrap(), "128");
        assert_eq!(
            std::fs::read_to_string(g.join("cgroup.procs")).unwrap(),
            "4242\n"
        );
        h.limit("sb-x", &[4242, 4343], &l2).unwrap();
        assert_eq!(
            std::fs::read_to_string(g.join("cgroup.procs")).unwrap(),
            "4343"
        );
        // A memory limit turns swap off; a parked child paged out on
        // purpose may swap until its hand-out limits it again.
        let swap = || std::fs::read_to_string(g.join("memory.swap.max")).unwrap();
        assert_eq!(swap(), "0");
        h.allow_swap("sb-x").unwrap();
        assert_eq!(swap(), "max");
        h.limit("sb-x", &[4242], &l2).unwrap();
        assert_eq!(swap(), "0");
        h.allow_swap("sb-none").unwrap();
    }

    #[test]
    fn validation_names_the_field() {
        let bad = [
            Limits {
                memory_mib: Some(0),
                ..Limits::default()
            },
            Limits {
                cpus: Some(0.0),
                ..Limits::default()
            },
            Limits {
                cpus: Some(f64::NAN),
                ..Limits::default()
            },
            Limits {
                pids_max: Some(5),
                ..Limits::default()
            },
        ];
        for (l, field) in bad
            .iter()
            .zip(["memory_limit_mib", "cpus", "cpus", "pids_max"])
        {
            let e = l.validate().unwrap_err();
            assert!(format!("{e}").contains(field), "{e}");
        }
        assert!(Limits {
            memory_mib: Some(1),
            cpus: Some(0.5),
            pids_max: Some(128)
        }
        .validate()
        .is_ok());
    }
}
