//! The node's operations: everything a front-end (REST `/v1`, E2B, a
//! cluster gateway) can ask of a node, each a typed request and a typed
//! answer or one [`Error`]. This file is the list; each operation's rules
//! live in the module it delegates to.
//!
//! | operation | what |
//! |---|---|
//! | [`Node::open`], [`Node::start_background`] | adopt what a previous poold left, then refill, reap, GC and heal the mount |
//! | [`Node::health`], [`Node::mount_health`], [`Node::metrics_text`], [`Node::metrics_registry`] | what the node runs on, its mount, its metrics |
//! | [`Node::spawn`], [`Node::get`], [`Node::list`], [`Node::destroy`], [`Node::set_ttl`], [`Node::set_egress`] | sandboxes |
//! | [`Node::pause`], [`Node::resume`], [`Node::paused`], [`Node::paused_list`] | paused sandboxes |
//! | [`Node::find_by_token`], [`Node::snapshot_machine`] | what front-ends route and report by |
//! | [`Node::ping`], [`Node::exec`], [`Node::exec_stream`], [`Node::pty`], [`Node::eval`], [`Node::logs`] | what runs in a sandbox |
//! | [`Node::read_file`], [`Node::write_file`], [`Node::list_dir`], [`Node::stat`], [`Node::mkdir`], [`Node::remove`] | a sandbox's files |
//! | [`Node::branch`], [`Node::branch_to_spawn`] | a running sandbox into a new snapshot |
//! | [`Node::attach_hub`], [`Node::hub_description`] | the hub tags come from and snapshots go to (`hub`) |
//! | [`Node::pools`], [`Node::pool`], [`Node::set_pool`], [`Node::delete_pool`] | warm pools |
//! | [`Node::snapshots`], [`Node::snapshot_details`], [`Node::create_snapshot`], [`Node::delete_snapshot`], [`Node::compact_snapshot`] | snapshots |
//! | [`Node::create_workspace`], [`Node::suspend_workspace`], [`Node::resume_workspace`], [`Node::workspace`], [`Node::workspaces`], [`Node::delete_workspace`] | workspaces |
//!
//! Operations that start VMs, pause a sandbox or delete run to their end
//! even when the caller stops waiting (a front-end whose client went
//! away): they are spawned on a task of their own, so the node's state
//! stays consistent.

use crate::config::{Config, PoolSpec};
use crate::error::{check_tag, Error, Result};
use crate::guest::{
    EntryInfo, EvalResult, ExecOutput, ExecSpec, FileRead, FileStat, ListResult, PendingPty,
    PingResult, Process, PtyRequest, WriteAs, WriteHow,
};
use crate::mount_watch::{self, MountHealth};
use crate::node::Node;
use crate::pool::PoolStatus;
use crate::snapshots::SnapshotDetails;
use crate::spawn::SpawnRequest;
use crate::state::SandboxRecord;
use crate::workspace::paused::{self, PausedSandbox};
use crate::{adopt, branch, guest, hub, reaper, refill, snapshots, spawn, workspace};
use forkd_api::{BranchBody, CreateSnapshotBody, CreateWorkspaceBody, SnapshotInfo, WorkspaceInfo};
use forkd_snapshot::Paths;
use std::future::Future;
use std::sync::Arc;

/// Runs `work` on a task of its own and waits for it: work that starts
/// VMs, pauses a sandbox or deletes must not stop halfway when its caller
/// is dropped.
async fn detached<T: Send + 'static>(
    work: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    tokio::spawn(work)
        .await
        .map_err(|e| Error::internal(format!("request task failed: {e}")))?
}

/// What the node runs on: its version and what isolates its sandboxes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// poold's version.
    pub version: &'static str,
    /// The accelerator sandboxes run under (`kvm` or `tcg`).
    pub accelerator: &'static str,
    /// Whether each QEMU runs in the jail.
    pub jail: bool,
    /// What that means, in a sentence (docs/security.md).
    pub isolation: &'static str,
}

impl Node {
    /// Opens the node of data dir `paths`: checks the host, mounts the
    /// store, loads the saved state, re-adopts every sandbox and pooled
    /// child whose QEMU still runs, and finishes or undoes what a killed
    /// poold left half-done. Background tasks start with
    /// [`Node::start_background`].
    pub async fn open(paths: Paths, cfg: Config) -> anyhow::Result<Arc<Node>> {
        let (node, saved) = crate::node::build(paths, cfg).await?;
        let n = Arc::new(node);
        // Pools set through the API override the config file's.
        for (tag, spec) in n.cfg.pools.iter().chain(saved.pools.iter()) {
            n.pools.set(tag, (spec.max() > 0).then_some(spec.clone()));
        }
        forkd_vmm::net::configure(n.cfg.net.range, n.cfg.net.egress.clone());
        forkd_vmm::net::configure_internal(n.cfg.internal_ranges()?);
        forkd_snapshot::ca::configure(n.cfg.guest_ca()?);
        if let Err(e) = forkd_vmm::net::ensure_host().await {
            // Snapshots without a NIC still work; networked spawns will fail
            // with the same cause.
            tracing::warn!("child networking is unavailable: {e:#}");
        }
        adopt::adopt_all(&n, saved).await?;
        workspace::reconcile(&n).await?;
        Ok(n)
    }

    /// Starts the refill loop, the TTL reaper, the mount watch and (with
    /// `auto_gc`) the store GC. They run until the process ends.
    pub fn start_background(self: &Arc<Self>) {
        tokio::spawn(refill::refill_loop(self.clone()));
        tokio::spawn(reaper::reaper_loop(self.clone()));
        tokio::spawn(reaper::reclaim_loop(self.clone()));
        tokio::spawn(mount_watch::watch_loop(self.clone()));
        tokio::spawn(hub::reconcile_loop(self.clone()));
        if self.cfg.auto_gc {
            tokio::spawn(reaper::gc_loop(self.clone()));
        }
    }

    /// Attaches the hub this node pulls tags it lacks from and pushes the
    /// snapshots it makes to (poold's `[hub]`); once, before it serves.
    pub fn attach_hub(&self, hub: Arc<dyn hub::SnapshotHub>) -> Result<()> {
        self.set_hub(hub)
    }

    /// The hub, described (no credentials), if the node has one.
    pub fn hub_description(&self) -> Option<String> {
        self.hub().map(|h| h.describe())
    }

    /// The folders host volumes may lie in (config `volume_roots`).
    pub fn volume_roots(&self) -> &[std::path::PathBuf] {
        &self.cfg.volume_roots
    }

    /// This node's name in a cluster (`node_name`), if it has one.
    pub fn name(&self) -> Option<&str> {
        self.cfg.node_name.as_deref()
    }

    /// The version, and what isolates sandboxes on this host: the
    /// accelerator resolved at start and whether QEMUs are jailed, so a
    /// client can tell a KVM host from a weaker TCG one.
    pub fn health(&self) -> Health {
        use forkd_vmm::Accel;
        let jail = forkd_vmm::JailConfig::get().is_ok_and(|j| j.enabled);
        let isolation = match (self.accel, jail) {
            (Accel::Kvm, true) => "hardware virtualization (KVM) and a jailed QEMU per sandbox",
            (Accel::Kvm, false) => "hardware virtualization (KVM); the QEMU jail is off",
            (Accel::Tcg, true) => "software emulation (TCG): no hardware boundary, the jailed QEMU process is the only one; weaker than KVM, see docs/security.md",
            (Accel::Tcg, false) => "software emulation (TCG) with the QEMU jail off: a QEMU bug is host root; for debugging only",
        };
        Health {
            version: env!("CARGO_PKG_VERSION"),
            accelerator: self.accel.as_str(),
            jail,
            isolation,
        }
    }

    /// What the mount watch last found: whether the forkd-fs mount serves,
    /// and its last recovery (`mount_watch`).
    pub fn mount_health(&self) -> MountHealth {
        self.mount_health.lock().unwrap().clone()
    }

    /// The metrics in Prometheus' text format (0.0.4), the snapshot count
    /// read now.
    pub async fn metrics_text(self: &Arc<Self>) -> String {
        let count = snapshots::count(self).await.unwrap_or_default();
        self.metrics.snapshots.set(count as i64);
        self.metrics.render()
    }

    /// The registry the node's metrics live in, for a front-end to add its
    /// own (they are rendered with the node's).
    pub fn metrics_registry(&self) -> &prometheus::Registry {
        self.metrics.registry()
    }

    /// Spawns `req.n` sandboxes: pool hits first, restores for the rest;
    /// answers once every child's agent answered. All or nothing.
    pub async fn spawn(self: &Arc<Self>, req: SpawnRequest) -> Result<Vec<SandboxRecord>> {
        let n = self.clone();
        detached(async move {
            hub::ensure_local(&n, &req.tag).await?;
            spawn::spawn(&n, req, None, None).await
        })
        .await
    }

    /// Sandbox `id`'s record.
    pub fn get(&self, id: &str) -> Result<SandboxRecord> {
        Ok(self.sandbox(id)?.record())
    }

    /// Every sandbox's record, oldest first.
    pub fn list(&self) -> Vec<SandboxRecord> {
        self.sandboxes.all().iter().map(|s| s.record()).collect()
    }

    /// Destroys sandbox `id`: its QEMU, directory, cgroups and record; a
    /// paused (or once paused) sandbox's stored states too.
    pub async fn destroy(self: &Arc<Self>, id: &str) -> Result<()> {
        let (n, id) = (self.clone(), id.to_string());
        detached(async move {
            if paused::kill(&n, &id).await? {
                Ok(())
            } else {
                Err(Error::not_found(crate::error::Kind::Sandbox, id))
            }
        })
        .await
    }

    /// Pauses sandbox `id`: its memory and disk go to the store, its VM
    /// away; [`Self::resume`] brings it back with the same id and token.
    pub async fn pause(self: &Arc<Self>, id: &str) -> Result<()> {
        let (n, id) = (self.clone(), id.to_string());
        detached(async move { paused::pause(&n, &id).await }).await
    }

    /// Resumes paused sandbox `id` as itself, killed `ttl_secs` from now
    /// (0: never), or paused then if `auto_pause` (None: as it was).
    pub async fn resume(
        self: &Arc<Self>,
        id: &str,
        ttl_secs: u64,
        auto_pause: Option<bool>,
    ) -> Result<SandboxRecord> {
        let (n, id) = (self.clone(), id.to_string());
        detached(async move { paused::resume(&n, &id, ttl_secs, auto_pause).await }).await
    }

    /// Paused sandbox `id`; None when it is running or does not exist.
    pub fn paused(&self, id: &str) -> Option<PausedSandbox> {
        paused::get(self, id)
    }

    /// Every paused sandbox, oldest first.
    pub fn paused_list(&self) -> Vec<PausedSandbox> {
        paused::list(self)
    }

    /// Kills sandbox `id` automatically `ttl_secs` from now (0: never);
    /// durable before it answers.
    pub async fn set_ttl(&self, id: &str, ttl_secs: u64) -> Result<SandboxRecord> {
        reaper::set_ttl(self, id, ttl_secs).await
    }

    /// Replaces running sandbox `id`'s egress policy with `policy` (None:
    /// what a spawn of its snapshot gets, its pool's or the config's)
    /// (docs/network.md, "Changing a running sandbox's policy"); durable
    /// before it answers, kept by its pause and resume.
    pub async fn set_egress(
        self: &Arc<Self>,
        id: &str,
        policy: Option<forkd_net::EgressPolicy>,
    ) -> Result<SandboxRecord> {
        crate::network::set_egress(self, id, policy).await
    }

    /// The sandbox whose access token is `token` (every one compared in
    /// constant time, so timing tells nothing about which one matched).
    pub fn find_by_token(&self, token: &[u8]) -> Option<SandboxRecord> {
        let mut found = None;
        for sb in self.sandboxes.all() {
            let r = sb.record();
            if r.access_token.matches(token) {
                found = Some(r);
            }
        }
        found
    }

    /// The machine (vCPUs, memory, NIC) of snapshot `tag`'s children.
    pub async fn snapshot_machine(&self, tag: &str) -> Result<forkd_vmm::Machine> {
        Ok(spawn::source(self, tag).await?.config.machine)
    }

    /// Sandbox `id`'s agent: its version, uptime and warm interpreter.
    pub async fn ping(&self, id: &str) -> Result<PingResult> {
        guest::ping(self, id).await
    }

    /// Runs a command in sandbox `id` to its end (its create-time envs
    /// under `spec.env`).
    pub async fn exec(&self, id: &str, spec: ExecSpec, stdin: &[u8]) -> Result<ExecOutput> {
        guest::exec(self, id, spec, stdin).await
    }

    /// Starts a command in sandbox `id` whose output streams as it comes.
    pub fn exec_stream(&self, id: &str, spec: ExecSpec, stdin: &[u8]) -> Result<Process> {
        guest::exec_stream(self, id, spec, stdin)
    }

    /// Opens a TCP connection to `port` on sandbox `id`'s loopback, carried
    /// over the agent channel (no guest network needed); the agent's
    /// `not_found` when nothing listens there.
    pub async fn open_tunnel(&self, id: &str, port: u16) -> Result<forkd_vmm::Tunnel> {
        guest::open_tunnel(self, id, port).await
    }

    /// Watches directory `path` in sandbox `id` (`recursive`: every
    /// directory under it too) with the guest's inotify, as `user` for
    /// relative paths; events arrive until the watch is stopped or dropped.
    pub async fn watch_dir(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        user: Option<&str>,
    ) -> Result<forkd_vmm::Watch> {
        guest::watch_dir(self, id, path, recursive, user).await
    }

    /// [`Self::exec_stream`] as `spec.user` (a name or uid from the guest's
    /// /etc/passwd; `None`: root), refused by an agent without users.
    pub async fn exec_stream_as(&self, id: &str, spec: ExecSpec, stdin: &[u8]) -> Result<Process> {
        guest::exec_stream_as(self, id, spec, stdin).await
    }

    /// Checks a terminal session for sandbox `id`; it starts when the
    /// caller is ready for its events.
    pub fn pty(&self, id: &str, req: PtyRequest) -> Result<PendingPty> {
        guest::pty(self, id, req)
    }

    /// Evaluates `code` in sandbox `id`'s warm interpreter.
    pub async fn eval(&self, id: &str, code: &str, timeout_ms: Option<u64>) -> Result<EvalResult> {
        guest::eval(self, id, code, timeout_ms).await
    }

    /// Sandbox `id`'s console since it started (its last MiB).
    pub fn logs(&self, id: &str) -> Result<Vec<u8>> {
        guest::logs(self, id)
    }

    /// Reads `len` bytes of a guest file from `offset` (the rest of it,
    /// within `MAX_FILE_BYTES`, without `len`).
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        len: Option<u64>,
    ) -> Result<FileRead> {
        guest::read_file(self, id, path, offset, len, None).await
    }

    /// [`Self::read_file`] where a relative path is under `user`'s home
    /// (a name or uid from the guest's /etc/passwd; `None`: root).
    pub async fn read_file_as(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        len: Option<u64>,
        user: Option<&str>,
    ) -> Result<FileRead> {
        guest::read_file(self, id, path, offset, len, user).await
    }

    /// Writes a guest file (atomically unless `append`), making its parents.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        append: bool,
    ) -> Result<FileStat> {
        let how = if append {
            WriteHow::Append
        } else {
            WriteHow::Atomic
        };
        let as_ = WriteAs {
            mode,
            how,
            ..Default::default()
        };
        guest::write_file(self, id, path, data, as_).await
    }

    /// [`Self::write_file`] as a guest account: the file and the parents
    /// the write makes belong to it (E2B's rule), a relative path is under
    /// its home.
    /// `as_`: who writes, how, and the metadata the file ends with.
    pub async fn write_file_as(
        &self,
        id: &str,
        path: &str,
        data: &[u8],
        as_: WriteAs<'_>,
    ) -> Result<FileStat> {
        guest::write_file(self, id, path, data, as_).await
    }

    /// Lists a guest directory.
    pub async fn list_dir(&self, id: &str, path: &str) -> Result<ListResult> {
        guest::list_dir(self, id, path).await
    }

    /// Stats a guest path.
    pub async fn stat(&self, id: &str, path: &str) -> Result<FileStat> {
        guest::stat(self, id, path).await
    }

    /// Makes a guest directory (with its parents when `parents`).
    pub async fn mkdir(&self, id: &str, path: &str, parents: bool) -> Result<FileStat> {
        guest::mkdir(self, id, path, parents, None).await
    }

    /// [`Self::mkdir`] as `user`: the directories it makes are its own.
    pub async fn mkdir_as(
        &self,
        id: &str,
        path: &str,
        parents: bool,
        user: Option<&str>,
    ) -> Result<FileStat> {
        guest::mkdir(self, id, path, parents, user).await
    }

    /// Everything about a guest path: owner and group names, mode, mtime,
    /// a symlink's resolved target. A relative path is under `user`'s home.
    pub async fn entry(&self, id: &str, path: &str, user: Option<&str>) -> Result<EntryInfo> {
        guest::entry(self, id, path, user).await
    }

    /// [`Self::entry`] of everything under a directory, `depth` levels down.
    pub async fn list_entries(
        &self,
        id: &str,
        path: &str,
        depth: u32,
        user: Option<&str>,
    ) -> Result<Vec<EntryInfo>> {
        guest::list_entries(self, id, path, depth, user).await
    }

    /// Removes a guest file or empty directory (a tree when `recursive`).
    pub async fn remove(&self, id: &str, path: &str, recursive: bool) -> Result<()> {
        guest::remove(self, id, path, recursive, None).await
    }

    /// [`Self::remove`] where a relative path is under `user`'s home.
    pub async fn remove_as(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        user: Option<&str>,
    ) -> Result<()> {
        guest::remove(self, id, path, recursive, user).await
    }

    /// Branches sandbox `id` into a new snapshot, with forkd's request
    /// fields and rules; the stored branch is pushed to the node's hub
    /// when it pushes.
    pub async fn branch(self: &Arc<Self>, id: &str, b: BranchBody) -> Result<branch::Branched> {
        let (n, id) = (self.clone(), id.to_string());
        detached(async move { branch::branch(&n, &id, &b, None, true).await }).await
    }

    /// [`Node::branch`] for a snapshot made only to spawn from on this
    /// node (E2B's fork): never pushed to the hub.
    pub async fn branch_to_spawn(
        self: &Arc<Self>,
        id: &str,
        b: BranchBody,
    ) -> Result<branch::Branched> {
        let (n, id) = (self.clone(), id.to_string());
        detached(async move { branch::branch(&n, &id, &b, None, false).await }).await
    }

    /// Every pool's status.
    pub fn pools(&self) -> Vec<PoolStatus> {
        self.pools.status()
    }

    /// `tag`'s pool (zeros if it has none).
    pub fn pool(&self, tag: &str) -> Result<PoolStatus> {
        check_tag(tag)?;
        Ok(self.pools.status_of(tag))
    }

    /// Sizes `tag`'s pool (persisted); a tag this node lacks is pulled
    /// from its hub first (`hub`).
    pub async fn set_pool(self: &Arc<Self>, tag: &str, spec: PoolSpec) -> Result<PoolStatus> {
        if spec.max() > 0 {
            hub::ensure_local(self, tag).await?;
        }
        refill::set_pool(self, tag, spec).await
    }

    /// Deletes `tag`'s pool: its ready children are destroyed (persisted).
    pub async fn delete_pool(self: &Arc<Self>, tag: &str) -> Result<()> {
        refill::delete_pool(self, tag).await
    }

    /// Every tagged snapshot, and the ones being written.
    pub async fn snapshots(self: &Arc<Self>) -> Result<Vec<SnapshotInfo>> {
        snapshots::list(self).await
    }

    /// What the node knows of snapshot `tag`.
    pub async fn snapshot_details(self: &Arc<Self>, tag: &str) -> Result<SnapshotDetails> {
        snapshots::details(self, tag).await
    }

    /// Boots a parent from an image, warms it up, snapshots it.
    pub async fn create_snapshot(self: &Arc<Self>, b: CreateSnapshotBody) -> Result<SnapshotInfo> {
        let n = self.clone();
        detached(async move {
            let info = snapshots::create(&n, b).await?;
            hub::publish(&n, &info.tag);
            Ok(info)
        })
        .await
    }

    /// Deletes snapshot `tag` (forkd's rules for dependents: refused,
    /// `cascade`, or `force`).
    pub async fn delete_snapshot(
        self: &Arc<Self>,
        tag: &str,
        cascade: bool,
        force: bool,
    ) -> Result<()> {
        let (n, tag) = (self.clone(), tag.to_string());
        detached(async move {
            let id = snapshots::resolve(&n, &tag).await?.id;
            snapshots::delete(&n, &tag, cascade, force).await?;
            hub::unpublish(&n, &tag, id).await;
            Ok(())
        })
        .await
    }

    /// Marks snapshot `tag` to be deleted (with the store's GC after it)
    /// once no sandbox spawned from it lives and no pool is set for it:
    /// branches made only to spawn from, like the E2B fork's. Durable
    /// before it returns; the reaper acts on it within seconds.
    pub async fn reclaim_when_unused(&self, tag: &str) -> Result<()> {
        reaper::mark_reclaimable(self, tag).await
    }

    /// A parentless copy `to` of snapshot `tag`.
    pub async fn compact_snapshot(self: &Arc<Self>, tag: &str, to: &str) -> Result<SnapshotInfo> {
        let (n, tag, to) = (self.clone(), tag.to_string(), to.to_string());
        detached(async move {
            let info = snapshots::compact(&n, &tag, &to).await?;
            hub::publish(&n, &info.tag);
            Ok(info)
        })
        .await
    }

    /// Records a workspace and spawns its sandbox.
    pub async fn create_workspace(
        self: &Arc<Self>,
        b: CreateWorkspaceBody,
    ) -> Result<WorkspaceInfo> {
        let n = self.clone();
        let w = detached(async move { workspace::create(&n, b).await }).await?;
        Ok(workspace::info(self, w))
    }

    /// Stores workspace `name`'s sandbox as its next state and destroys it.
    pub async fn suspend_workspace(self: &Arc<Self>, name: &str) -> Result<WorkspaceInfo> {
        let (n, name) = (self.clone(), name.to_string());
        let w = detached(async move { workspace::suspend(&n, &name).await }).await?;
        Ok(workspace::info(self, w))
    }

    /// Spawns workspace `name`'s sandbox from its latest state.
    pub async fn resume_workspace(self: &Arc<Self>, name: &str) -> Result<WorkspaceInfo> {
        let (n, name) = (self.clone(), name.to_string());
        let w = detached(async move { workspace::resume(&n, &name).await }).await?;
        Ok(workspace::info(self, w))
    }

    /// Workspace `name`.
    pub fn workspace(&self, name: &str) -> Result<WorkspaceInfo> {
        Ok(workspace::info(self, workspace::get(self, name)?))
    }

    /// Every workspace, by name.
    pub fn workspaces(&self) -> Vec<WorkspaceInfo> {
        workspace::list(self)
            .into_iter()
            .map(|w| workspace::info(self, w))
            .collect()
    }

    /// Destroys workspace `name`'s sandbox and states, then its record.
    pub async fn delete_workspace(self: &Arc<Self>, name: &str) -> Result<()> {
        let (n, name) = (self.clone(), name.to_string());
        detached(async move { workspace::delete(&n, &name).await }).await
    }
}

/// The operations' rules without HTTP and without a VM: a node over a
/// temporary data dir (no QEMU, no mount), with sandboxes whose VM is gone
/// and whose agent is a socket nobody serves.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;
    use crate::sandbox::{Phase, Sandbox};
    use forkd_vmm::{AgentClient, VmDir};

    fn record(id: &str) -> SandboxRecord {
        SandboxRecord::example(id)
    }

    /// An agent client whose peer hangs up at once (a VM that died).
    async fn dead_agent(dir: &std::path::Path, name: &str) -> AgentClient {
        let sock = dir.join(format!("{name}.sock"));
        let l = tokio::net::UnixListener::bind(&sock).unwrap();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                drop(s);
            }
        });
        AgentClient::connect(&sock, std::time::Duration::from_secs(5))
            .await
            .unwrap()
    }

    /// A `Running` sandbox `id` in `n`'s table, without a VM.
    async fn insert(n: &Node, dir: &std::path::Path, id: &str) -> Arc<Sandbox> {
        let sb = Arc::new(Sandbox::without_vm(
            record(id),
            dead_agent(dir, id).await,
            VmDir::new(dir.join(id)),
        ));
        n.sandboxes.insert(sb.clone());
        sb
    }

    fn not_found(e: Error, kind: Kind) {
        assert!(
            matches!(&e, Error::NotFound { kind: k, .. } if *k == kind),
            "{e:?}"
        );
    }

    #[tokio::test]
    async fn spawn_refuses_bad_requests_naming_the_field_before_any_vm() {
        let t = tempfile::tempdir().unwrap();
        let n = crate::node::for_tests(t.path()).await;
        let bad = [
            (
                SpawnRequest {
                    tag: "../x".into(),
                    n: 1,
                    ..Default::default()
                },
                "tag",
            ),
            (
                SpawnRequest {
                    tag: "py".into(),
                    n: 0,
                    ..Default::default()
                },
                "n",
            ),
            (
                SpawnRequest {
                    tag: "py".into(),
                    n: 1,
                    ttl_secs: Some(crate::limits::MAX_TTL_SECS + 1),
                    ..Default::default()
                },
                "ttl_secs",
            ),
            (
                SpawnRequest {
                    tag: "py".into(),
                    n: 1,
                    envs: [("A B".to_string(), String::new())].into(),
                    ..Default::default()
                },
                "envs",
            ),
        ];
        for (req, field) in bad {
            match n.spawn(req).await {
                Err(Error::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        // A valid request for a snapshot that does not exist: not found,
        // and nothing reserved.
        let e = n
            .spawn(SpawnRequest {
                tag: "nope".into(),
                n: 1,
                ..Default::default()
            })
            .await
            .unwrap_err();
        not_found(e, Kind::Snapshot);
        assert!(n.list().is_empty());
    }

    #[tokio::test]
    async fn unknown_sandboxes_are_not_found_by_every_operation() {
        let t = tempfile::tempdir().unwrap();
        let n = crate::node::for_tests(t.path()).await;
        let id = "sb-000000000000000000000000";
        not_found(n.get(id).unwrap_err(), Kind::Sandbox);
        not_found(n.destroy(id).await.unwrap_err(), Kind::Sandbox);
        not_found(n.set_ttl(id, 60).await.unwrap_err(), Kind::Sandbox);
        not_found(n.ping(id).await.unwrap_err(), Kind::Sandbox);
        not_found(n.logs(id).unwrap_err(), Kind::Sandbox);
        not_found(
            n.exec(id, ExecSpec::default(), &[]).await.unwrap_err(),
            Kind::Sandbox,
        );
        not_found(
            n.branch(id, BranchBody::default()).await.unwrap_err(),
            Kind::Sandbox,
        );
        // A bad path is the caller's, before the lookup.
        assert!(matches!(
            n.read_file(id, "rel", 0, None).await.unwrap_err(),
            Error::Invalid { field: "path", .. }
        ));
        not_found(n.workspace("w").unwrap_err(), Kind::Workspace);
        not_found(n.snapshot_details("t").await.unwrap_err(), Kind::Snapshot);
    }

    /// A branch of a destroyed sandbox finds nothing: not in the table,
    /// and its handle (held by a branch that raced the destroy) refuses
    /// to enter `Branching`.
    #[tokio::test]
    async fn a_destroyed_sandbox_cannot_be_branched() {
        let t = tempfile::tempdir().unwrap();
        let n = crate::node::for_tests(t.path()).await;
        let id = "sb-000000000000000000000001";
        let sb = insert(&n, t.path(), id).await;
        assert_eq!(sb.phase(), Phase::Running);
        n.destroy(id).await.unwrap();
        assert_eq!(sb.phase(), Phase::Destroyed);
        not_found(
            n.branch(id, BranchBody::default()).await.unwrap_err(),
            Kind::Sandbox,
        );
        not_found(sb.begin_branch().await.err().unwrap(), Kind::Sandbox);
        // Destroy is idempotent on the handle and final in the table.
        sb.destroy().await;
        assert_eq!(sb.phase(), Phase::Destroyed);
        not_found(n.destroy(id).await.unwrap_err(), Kind::Sandbox);
    }

    /// A child being handed out is owned by its spawn and not yet a
    /// sandbox: a destroy of its id finds nothing and touches nothing; the
    /// hand-out may still fail into `Destroyed`, never into `Branching`.
    #[tokio::test]
    async fn a_destroy_during_hand_out_finds_nothing() {
        let t = tempfile::tempdir().unwrap();
        let n = crate::node::for_tests(t.path()).await;
        let live = insert(&n, t.path(), "sb-000000000000000000000002").await;
        let handing_out = "sb-000000000000000000000003";
        not_found(n.destroy(handing_out).await.unwrap_err(), Kind::Sandbox);
        assert_eq!(n.list().len(), 1);
        assert_eq!(live.phase(), Phase::Running);
        assert_eq!(
            Phase::HandingOut.transition(Phase::Destroyed),
            Ok(Phase::Destroyed)
        );
        assert!(Phase::HandingOut.transition(Phase::Branching).is_err());
        // Once its spawn recorded it, it is a sandbox like any other.
        insert(&n, t.path(), handing_out).await;
        n.destroy(handing_out).await.unwrap();
    }

    /// What fails in the guest has the guest's kind: a sandbox whose agent
    /// hung up is unreachable, not missing.
    #[tokio::test]
    async fn a_dead_agent_is_unreachable() {
        let t = tempfile::tempdir().unwrap();
        let n = crate::node::for_tests(t.path()).await;
        let id = "sb-000000000000000000000004";
        insert(&n, t.path(), id).await;
        // The client notices the hang-up as soon as its reader runs.
        let mut e = n.ping(id).await.unwrap_err();
        for _ in 0..100 {
            if matches!(e, Error::GuestUnreachable(_)) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            e = n.ping(id).await.unwrap_err();
        }
        assert!(matches!(e, Error::GuestUnreachable(_)), "{e:?}");
        let e = n.exec(id, ExecSpec::default(), &[]).await.unwrap_err();
        assert!(matches!(e, Error::GuestUnreachable(_)), "{e:?}");
    }

    /// Front-end state rides on the record: tokens find their sandbox in
    /// constant time, a guess finds none, a TTL change keeps the rest.
    #[tokio::test]
    async fn front_end_state_is_the_records() {
        let t = tempfile::tempdir().unwrap();
        let n = crate::node::for_tests(t.path()).await;
        let a = insert(&n, t.path(), "sb-00000000000000000000000a").await;
        let b = insert(&n, t.path(), "sb-00000000000000000000000b").await;
        let tok = b.record().access_token;
        assert_eq!(
            n.find_by_token(tok.as_str().as_bytes()).map(|r| r.id),
            Some(b.id().to_string())
        );
        assert!(n.find_by_token(b"guess").is_none());
        assert!(n.find_by_token(b"").is_none());
        let r = n.set_ttl(a.id(), 60).await.unwrap();
        assert!(r.expires_at_unix > 0);
        assert_eq!(r.metadata["run"], "r1");
        assert_eq!(r.alias.as_deref(), Some("code-interpreter-v1"));
        assert_eq!(n.get(a.id()).unwrap().envs["A"], "b");
        // A TTL over the cap is the caller's error.
        assert!(matches!(
            n.set_ttl(a.id(), crate::limits::MAX_TTL_SECS + 1)
                .await
                .unwrap_err(),
            Error::Invalid {
                field: "ttl_secs",
                ..
            }
        ));
    }
}
