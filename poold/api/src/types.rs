//! Request and response bodies. forkd's field names and shapes (v0.5.3,
//! shared/forkd-compat.md) come first; fields of our own are additions a
//! forkd client ignores.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Every error answer: `{"error": "<what was wrong>"}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// What was wrong, and what to do next.
    pub error: String,
}

/// forkd's `SnapshotInfo`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotInfo {
    /// Name the snapshot is addressed by in the API (`/v1/snapshots/:tag`).
    pub tag: String,
    /// Where the snapshot's files are (the forkd-fs directory).
    pub dir: String,
    /// When the snapshot was committed, seconds since the Unix epoch.
    pub created_at_unix: u64,
    /// Id of the sandbox it was branched from (`compact:<tag>` for a compaction); absent for a created snapshot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub branched_from: Option<String>,
    /// QEMU's STOP → RESUME time on the branched sandbox, whole ms rounded
    /// up (an integer, as forkd answers; the snapshot's lineage keeps the
    /// exact figure).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_ms: Option<u64>,
    /// Time to store the branch in the layer store, whole ms rounded up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff_ms: Option<u64>,
    /// Bytes the branch added to the store beyond what its parent already holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff_physical_bytes: Option<u64>,
    /// forkd's uncompressed size of the branch's changes, bytes; set only when a branch recorded it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff_logical_bytes: Option<u64>,
    /// Why the snapshot cannot boot (e.g. the files it lacks); absent when it can.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// `writing`, `ready` or `failed`.
    pub status: String,
    /// Whether every file a restore needs is present.
    pub bootable: bool,
    // Ours.
    /// Ours: the layer store's snapshot id (what `parent_content_hash` names).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Ours: tag (or id, when untagged) of the snapshot this one was branched from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_tag: Option<String>,
    /// Ours: the guest image it was booted from, when it came from one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// forkd's `SandboxInfo`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxInfo {
    /// Sandbox id, `sb-` + 24 hex digits; also its hostname and VM directory name.
    pub id: String,
    /// Tag of the snapshot it was restored from.
    pub snapshot_tag: String,
    /// forkd's per-child network namespace; always null (guests have no network device).
    pub netns: Option<String>,
    /// forkd's guest IP address; always null (guests are reached through the agent).
    pub guest_addr: Option<String>,
    /// When the sandbox was spawned, seconds since the Unix epoch.
    pub created_at_unix: u64,
    /// Pid of the sandbox's QEMU process on the host.
    pub pid: Option<u32>,
    /// Memory limit of its cgroup, MiB; absent when unlimited.
    pub memory_limit_mib: Option<u64>,
    /// Whether a snapshot has ever been branched from it (`branch_count > 0`).
    pub has_branched: bool,
    /// forkd's path of the last branch's memory file; always null (branches live in the layer store).
    pub last_branch_memory_path: Option<String>,
    /// How many snapshots have been branched from this sandbox.
    pub branch_count: u32,
    // Ours.
    /// Layer store id of the snapshot it was restored from (stable across re-tagging).
    pub snapshot_id: String,
    /// The guest's hostname: the sandbox id.
    pub hostname: String,
    /// 0 when it never expires.
    pub expires_at_unix: u64,
    /// Whether it was handed out from a pool (a hit) rather than restored on demand.
    pub pool_hit: bool,
    /// Spawn request received → this sandbox's agent answered, ms.
    pub spawn_ms: u64,
    /// CPU quota in CPUs; absent when unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Most tasks its VM process may hold; absent when unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
    /// Published ports (docs/network.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<PortSchema>)]
    pub ports: Vec<forkd_net::proxy::PortSpec>,
    /// The egress policy in force for a networked sandbox: its lists, the
    /// internal ranges it is denied unless `allow_out` names them, and the
    /// resolvers its DNS may reach (docs/network.md); absent without a
    /// network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<EffectivePolicySchema>)]
    pub egress: Option<forkd_net::EffectivePolicy>,
}

/// `POST /v1/sandboxes/:id/branch` (forkd's fields; every one has a default).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BranchBody {
    /// Tag of the new snapshot (default `branch-<id>-<unix>-<4 hex>`).
    #[serde(default)]
    pub tag: Option<String>,
    /// forkd: record the branch's uncompressed diff size.
    #[serde(default)]
    pub measure_diff: bool,
    /// forkd's legacy flag for `mode: diff`.
    #[serde(default)]
    pub diff: bool,
    /// forkd's legacy flag for `mode: live`.
    #[serde(default)]
    pub live: bool,
    /// `full` (default), `diff` or `live`.
    #[serde(default)]
    pub mode: Option<String>,
    /// false (live only): answer 202 once the sandbox runs again.
    #[serde(default)]
    pub wait: Option<bool>,
    /// The sandbox's snapshot, in diff mode (forkd's check).
    #[serde(default)]
    pub parent_tag: Option<String>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SpawnBody {
    /// Tag of the snapshot to restore the children from.
    pub snapshot_tag: String,
    /// How many sandboxes to spawn, 1..=1000.
    #[serde(default = "one")]
    pub n: usize,
    /// forkd: a network namespace per child. Refused (400): guests have no network device.
    #[serde(default)]
    pub per_child_netns: bool,
    /// Memory limit per child, MiB (cgroup-enforced); unset takes the config default.
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
    /// forkd: memfd-backed children. Accepted (every child here is a
    /// copy-on-write mapping already); refused on a chained snapshot, as
    /// forkd does.
    #[serde(default)]
    pub live_fork: bool,
    /// forkd: hugepage-backed guest RAM. Accepted; changes nothing here.
    #[serde(default)]
    pub hugepages: bool,
    /// Ours: kill the sandboxes after this many seconds.
    #[serde(default)]
    pub ttl_secs: Option<u64>,
    /// Ours: false gives a networked snapshot's children no way out
    /// (deny-all); true requires a networked snapshot.
    #[serde(default)]
    pub net: Option<bool>,
    /// Ours: the egress policy (docs/network.md); default: the config's.
    #[serde(default)]
    #[schema(value_type = Option<EgressSchema>)]
    pub network: Option<forkd_net::EgressPolicy>,
    /// Ours: guest ports to publish on the host.
    #[serde(default)]
    #[schema(value_type = Vec<PortSchema>)]
    pub ports: Vec<forkd_net::proxy::PortSpec>,
    /// Rebind the snapshot's volumes (docs/volumes.md): each entry names
    /// one of its guest paths and the host folder (and mode) these
    /// children get there instead.
    #[serde(default)]
    pub volumes: Vec<VolumeSpec>,
    /// Ours: extra CA certificates (PEM, at most 512 KiB) the children
    /// trust from their hand-out on, besides the config's `ca_certs_file`
    /// (docs/network.md).
    #[serde(default)]
    pub ca_certs: Option<String>,
}

/// A host folder mounted into a guest (forkd's `snapshot.json` shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeSpec {
    /// Host directory; must lie inside poold's `volume_roots`.
    pub host_path: String,
    /// Where the guest sees it (absolute).
    pub guest_path: String,
    /// The guest may only read it.
    #[serde(default)]
    pub read_only: bool,
}

fn one() -> usize {
    1
}

/// `POST /v1/snapshots`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotBody {
    /// Tag to store the new snapshot under; must not exist yet.
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
    /// forkd: a writable root filesystem. Accepted for compatibility.
    #[serde(default)]
    pub rw: bool,
    /// forkd: a host tap device for the guest. Refused (400): forkd makes each child's tap itself (`net`).
    #[serde(default)]
    pub tap: Option<String>,
    /// Give the guest a NIC (default: yes for python images); docs/network.md.
    #[serde(default)]
    pub net: Option<bool>,
    /// forkd: seconds to wait for the guest to boot, at most 60.
    #[serde(default)]
    pub boot_wait_secs: Option<u64>,
    /// Guest RAM, MiB (default 512).
    #[serde(default)]
    pub mem_mib: Option<u64>,
    /// Guest vCPUs (default 1).
    #[serde(default)]
    pub vcpus: Option<u32>,
    /// Shell command run before the snapshot.
    #[serde(default)]
    pub warmup: Option<String>,
    /// Python run in the warm interpreter before the snapshot.
    #[serde(default)]
    pub eval_warmup: Option<String>,
    /// Host folders the parent mounts; its children get them unless their
    /// spawn rebinds them (docs/volumes.md).
    #[serde(default)]
    pub volumes: Vec<VolumeSpec>,
    /// Ours: extra CA certificates (PEM) installed in the parent before
    /// its warm-up, so the warm-up and every child trust them.
    #[serde(default)]
    pub ca_certs: Option<String>,
}

/// `POST /v1/sandboxes/:id/exec`: forkd's `args` + `timeout_secs`, and ours.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// forkd: the program and its arguments, run without a shell; required unless `cmd`.
    #[serde(default)]
    pub args: Vec<String>,
    /// Ours: a shell command instead of `args`.
    #[serde(default)]
    pub cmd: Option<String>,
    /// Seconds before the process group is killed and the reply says `timed_out` (default 30).
    #[serde(default = "thirty")]
    pub timeout_secs: f64,
    /// Ours: environment variables added for the command.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Ours: working directory in the guest (absolute).
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
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ExecReply {
    /// The command's standard output (lossy UTF-8).
    pub stdout: String,
    /// The command's standard error (lossy UTF-8).
    pub stderr: String,
    /// The command's exit status; not meaningful when `signal` is set or `timed_out`.
    pub exit_code: i64,
    /// Ours: the signal that ended the command, if one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Ours: the timeout elapsed and the process group was killed.
    pub timed_out: bool,
    /// Ours: how long the command ran, ms.
    pub duration_ms: u64,
}

/// `POST /v1/sandboxes/:id/eval`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvalBody {
    /// Python source: statements and/or a final expression whose value is returned.
    pub code: String,
    /// Ours: seconds before the evaluation is abandoned (504).
    #[serde(default)]
    pub timeout_secs: Option<f64>,
}

/// forkd's eval reply (`result` or `error`, `exit_code`), plus ours.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EvalReply {
    /// `repr()` of the final expression's value; absent when there was none, it was `None`, or the code raised.
    pub result: Option<String>,
    /// The raised exception (`Type: message`); absent on success.
    pub error: Option<String>,
    /// 0 on success, 1 when the code raised.
    pub exit_code: i64,
    /// Ours: the Python traceback of the raised exception.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceback: Option<String>,
    /// Ours: what the code printed to standard output.
    pub stdout: String,
    /// Ours: what the code printed to standard error.
    pub stderr: String,
    /// The value as JSON text, from a Node-mode image's warm interpreter
    /// (forkd's agent sends it; forkd's `/v1` drops it, ours keeps it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_json: Option<String>,
}

/// One pool's sizing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
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
    /// Code the warm-up evaluates in each new child's warm interpreter
    /// instead of a no-op, before parking it: a child's first request then
    /// runs as fast as its later ones, since under TCG its QEMU has
    /// translated that code already (KVM translates nothing). It runs in
    /// the child's own interpreter, so what it defines stays defined; an
    /// error is logged and the child parked anyway. Needs `warm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_eval: Option<String>,
    /// Once a child is parked, ask the kernel to move the memory its QEMU
    /// alone holds (TCG's translated code, QEMU's heap, guest pages it
    /// wrote) to swap: a parked child then keeps a few MiB resident instead
    /// of ~30 under TCG, and its hand-out reads back what it touches (tens
    /// of milliseconds more). Needs swap on the host (zram keeps it in
    /// compressed RAM). Off by default.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub page_out: bool,
    /// With `page_out`: how many ready children stay resident, handed out
    /// first; refills park resident and paged-out children are read back
    /// while fewer are, so spawns one after another do not read from swap
    /// (default [`DEFAULT_KEEP_RESIDENT`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_resident: Option<usize>,
    /// The egress policy of this tag's children, pooled or restored, whose
    /// spawn names none (instead of the config's `net.egress`;
    /// docs/network.md): e.g. `{"allow_out": ["10.0.5.20"]}` to open one
    /// internal database to them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<EgressSchema>)]
    pub network: Option<forkd_net::EgressPolicy>,
}

/// Resident children of a `page_out` pool unless `keep_resident` says.
pub const DEFAULT_KEEP_RESIDENT: usize = 2;

fn yes() -> bool {
    true
}

/// Longest `warm_eval`: a representative request, not a program.
pub const MAX_WARM_EVAL_BYTES: usize = 64 << 10;

impl PoolSpec {
    /// The effective upper bound.
    pub fn max(&self) -> usize {
        self.max_ready.unwrap_or(self.min_ready).max(self.min_ready)
    }

    /// Ready children kept resident: all of them without `page_out`.
    pub fn keep_resident(&self) -> usize {
        match self.page_out {
            true => self.keep_resident.unwrap_or(DEFAULT_KEEP_RESIDENT),
            false => self.max(),
        }
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
        if self.keep_resident.is_some() && !self.page_out {
            anyhow::bail!(
                "keep_resident needs page_out: true (without it every child is resident)"
            );
        }
        if let Some(p) = &self.network {
            p.validate().map_err(|e| anyhow::anyhow!("network: {e}"))?;
        }
        if let Some(code) = &self.warm_eval {
            if !self.warm {
                anyhow::bail!("warm_eval needs warm: true (it runs in the warm-up before parking)");
            }
            if code.trim().is_empty() || code.len() > MAX_WARM_EVAL_BYTES {
                anyhow::bail!(
                    "warm_eval must be 1 to {MAX_WARM_EVAL_BYTES} bytes of code (got {}); give a representative request, e.g. \"numpy.zeros(5).tolist()\"",
                    code.len()
                );
            }
        }
        Ok(())
    }
}

/// What `GET /v1/pools` shows for one pool.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PoolStatus {
    /// Tag of the snapshot whose children the pool holds.
    pub tag: String,
    /// Paused children the pool refills to.
    pub min_ready: usize,
    /// Upper bound on ready children (the effective one, never below `min_ready`).
    pub max_ready: usize,
    /// Whether children are warmed (resumed once, paused again) before parking.
    pub warm: bool,
    /// The code that warm-up evaluates (absent: a no-op).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_eval: Option<String>,
    /// Whether parked children are paged out to swap.
    #[serde(default)]
    pub page_out: bool,
    /// Ready children kept resident (all of them without `page_out`).
    #[serde(default)]
    pub keep_resident: usize,
    /// Of the ready children, those resident now (not paged out).
    #[serde(default)]
    pub resident: usize,
    /// Children ready to hand out now.
    pub ready: usize,
    /// Children being restored for the pool now.
    pub in_flight: usize,
    /// Spawns served from the pool since poold started.
    pub hits: u64,
    /// Spawns that found the pool empty and restored on demand.
    pub misses: u64,
    /// Why the pool is not refilling now: its snapshot is lazy and the
    /// working set its children read first is still being fetched (absent
    /// when it refills).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
}

/// The OpenAPI shape of a published port (`forkd_net::proxy::PortSpec`
/// on the wire); documentation only.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct PortSchema {
    /// The port a server in the guest listens on.
    guest_port: u16,
    /// 0 or absent: any free port (the answer shows the one bound).
    host_port: Option<u16>,
    /// IPv4 address to publish on; default 127.0.0.1.
    host_addr: Option<String>,
}

/// The OpenAPI shape of an egress policy (`forkd_net::EgressPolicy` on
/// the wire; docs/network.md); documentation only.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct EgressSchema {
    /// Addresses, CIDRs or domain names the sandbox may reach.
    allow_out: Option<Vec<String>>,
    /// Addresses, CIDRs or domain names it may not reach.
    deny_out: Option<Vec<String>>,
}

/// The OpenAPI shape of the egress policy in force
/// (`forkd_net::EffectivePolicy` on the wire; docs/network.md);
/// documentation only.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct EffectivePolicySchema {
    /// Reachable first, internal ranges and the host's addresses included.
    allow_out: Vec<String>,
    /// Denied after the internal ranges.
    deny_out: Vec<String>,
    /// CIDRs denied unless `allow_out` names them: private, shared,
    /// link-local, loopback, reserved, and the operator's `net.internal_ranges`.
    internal_denied: Vec<String>,
    /// Resolvers reachable on port 53; empty when DNS is closed.
    dns: Vec<String>,
}

/// Where a node serves the E2B planes, in its `GET /version` (`"e2b"`), so
/// a gateway can route E2B clients to it (docs/cluster.md, "E2B through
/// the gateway"). Ports only: the gateway reaches them at the host it
/// reaches the node's `/v1` at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct E2bPlanes {
    /// The control plane's port (`E2B_API_URL`).
    pub api_port: u16,
    /// The sandbox plane's port (`E2B_SANDBOX_URL`).
    pub sandbox_port: u16,
    /// The domain its sandbox URLs live under (`<port>-<id>.<domain>`).
    pub domain: String,
}
