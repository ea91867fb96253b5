//! Request and response bodies. forkd's field names and shapes (v0.5.3,
//! shared/forkd-compat.md) come first; fields of our own are additions a
//! forkd client ignores.

use serde::{Deserialize, Serialize};

/// forkd's `SnapshotInfo`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub tag: String,
    /// Where the snapshot's files are (the forkd-fs directory).
    pub dir: String,
    pub created_at_unix: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub branched_from: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff_physical_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff_logical_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// `writing`, `ready` or `failed`.
    pub status: String,
    pub bootable: bool,
    // Ours.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_tag: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// forkd's `SandboxInfo`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxInfo {
    pub id: String,
    pub snapshot_tag: String,
    pub netns: Option<String>,
    pub guest_addr: Option<String>,
    pub created_at_unix: u64,
    pub pid: Option<u32>,
    pub memory_limit_mib: Option<u64>,
    pub has_branched: bool,
    pub last_branch_memory_path: Option<String>,
    pub branch_count: u32,
    // Ours.
    pub snapshot_id: String,
    pub hostname: String,
    /// 0 when it never expires.
    pub expires_at_unix: u64,
    pub pool_hit: bool,
    /// Spawn request received → this sandbox's agent answered, ms.
    pub spawn_ms: u64,
    /// CPU quota in CPUs; absent when unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Most tasks its VM process may hold; absent when unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpawnBody {
    pub snapshot_tag: String,
    #[serde(default = "one")]
    pub n: usize,
    #[serde(default)]
    pub per_child_netns: bool,
    #[serde(default)]
    pub memory_limit_mib: Option<u64>,
    /// Ours: CPU quota in CPUs (0.5 = half a core), cgroup-enforced.
    #[serde(default, alias = "cpu_quota")]
    pub cpus: Option<f64>,
    /// Ours: most tasks (QEMU threads) the sandbox's VM process may hold.
    #[serde(default)]
    pub pids_max: Option<u64>,
    /// forkd: a throwaway snapshot after restore. Accepted; our pools warm
    /// children instead.
    #[serde(default)]
    pub prewarm: bool,
    /// forkd: memfd-backed children. Accepted; every child here is a
    /// copy-on-write mapping already.
    #[serde(default)]
    pub live_fork: bool,
    #[serde(default)]
    pub hugepages: bool,
    /// Ours: kill the sandboxes after this many seconds.
    #[serde(default)]
    pub ttl_secs: Option<u64>,
}

fn one() -> usize {
    1
}

/// `POST /v1/snapshots`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotBody {
    pub tag: String,
    /// Ours: an image name (`forkd image ls`).
    #[serde(default)]
    pub image: Option<String>,
    /// forkd: a kernel path (inside the data dir or `allowed_paths`).
    #[serde(default)]
    pub kernel: Option<String>,
    /// forkd: a root filesystem image path (same rule).
    #[serde(default)]
    pub rootfs: Option<String>,
    #[serde(default)]
    pub rw: bool,
    #[serde(default)]
    pub tap: Option<String>,
    #[serde(default)]
    pub boot_wait_secs: Option<u64>,
    #[serde(default)]
    pub mem_mib: Option<u64>,
    #[serde(default)]
    pub vcpus: Option<u32>,
    /// Shell command run before the snapshot.
    #[serde(default)]
    pub warmup: Option<String>,
    /// Python run in the warm interpreter before the snapshot.
    #[serde(default)]
    pub eval_warmup: Option<String>,
}

/// `POST /v1/sandboxes/:id/exec`: forkd's `args` + `timeout_secs`, and ours.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    #[serde(default)]
    pub args: Vec<String>,
    /// Ours: a shell command instead of `args`.
    #[serde(default)]
    pub cmd: Option<String>,
    #[serde(default = "thirty")]
    pub timeout_secs: f64,
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Ours: bytes for stdin (UTF-8 text).
    #[serde(default)]
    pub stdin: Option<String>,
}

fn thirty() -> f64 {
    30.0
}

/// forkd's exec reply, plus what we know beyond it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecReply {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration_ms: u64,
}

/// `POST /v1/sandboxes/:id/eval`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalBody {
    pub code: String,
    #[serde(default)]
    pub timeout_secs: Option<f64>,
}

/// forkd's eval reply (`result` or `error`, `exit_code`), plus ours.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalReply {
    pub result: Option<String>,
    pub error: Option<String>,
    pub exit_code: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceback: Option<String>,
    pub stdout: String,
    pub stderr: String,
}

/// One pool's sizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// Paused children kept ready.
    pub min_ready: usize,
    /// Upper bound on ready children (a refill never exceeds it).
    #[serde(default)]
    pub max_ready: Option<usize>,
    /// Resume each new child once for a cheap request and pause it again
    /// before parking it, so its first real request does not pay the
    /// (TCG) translation of the agent's hot paths.
    #[serde(default = "yes")]
    pub warm: bool,
}

fn yes() -> bool {
    true
}

impl PoolSpec {
    /// The effective upper bound.
    pub fn max(&self) -> usize {
        self.max_ready.unwrap_or(self.min_ready).max(self.min_ready)
    }

    /// Checks the numbers.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.min_ready > 1000 {
            anyhow::bail!("min_ready {} is over the cap of 1000", self.min_ready);
        }
        if let Some(m) = self.max_ready {
            if m < self.min_ready {
                anyhow::bail!("max_ready {m} is below min_ready {}", self.min_ready);
            }
            if m > 1000 {
                anyhow::bail!("max_ready {m} is over the cap of 1000");
            }
        }
        Ok(())
    }
}

/// What `GET /v1/pools` shows for one pool.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolStatus {
    pub tag: String,
    pub min_ready: usize,
    pub max_ready: usize,
    pub warm: bool,
    pub ready: usize,
    pub in_flight: usize,
    pub hits: u64,
    pub misses: u64,
}
