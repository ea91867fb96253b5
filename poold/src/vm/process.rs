//! Process identity that survives pid reuse: a pid plus its start time
//! (field 22 of /proc/<pid>/stat), so a record can prove whether the process
//! it names is still the same one.

use serde::{Deserialize, Serialize};

/// A specific process instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcId {
    pub pid: u32,
    /// Clock ticks after boot at which the process started.
    pub start_time: u64,
}

impl ProcId {
    /// The identity of a running process, if it exists.
    pub fn of(pid: u32) -> Option<ProcId> {
        start_time(pid).map(|start_time| ProcId { pid, start_time })
    }

    /// This process.
    pub fn current() -> ProcId {
        ProcId::of(std::process::id()).expect("/proc/self/stat is readable")
    }

    /// True if this exact process is still running (not a zombie).
    pub fn is_alive(&self) -> bool {
        start_time(self.pid) == Some(self.start_time) && !is_zombie(self.pid)
    }
}

fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may contain spaces; fields after it start past the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    Some(rest.split_whitespace().map(String::from).collect())
}

fn start_time(pid: u32) -> Option<u64> {
    // `rest` starts at field 3 (state), so field 22 is index 19.
    stat_fields(pid)?.get(19)?.parse().ok()
}

fn is_zombie(pid: u32) -> bool {
    stat_fields(pid).and_then(|f| f.first().cloned()).as_deref() == Some("Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_is_alive_and_stale_is_not() {
        let me = ProcId::current();
        assert!(me.is_alive());
        let stale = ProcId {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!stale.is_alive());
    }
}
