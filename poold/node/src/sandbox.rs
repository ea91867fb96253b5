//! Live sandboxes: a handed-out child VM and its record, and the lifecycle
//! every child VM goes through ([`Phase`]).
//!
//! ```text
//!              refill_one                 spawn (pool hit)
//!  Restoring ─────────────▶ Pooled ───────────────────────┐
//!      │                      │                           ▼
//!      │ spawn (restore       │ drained, resized,     HandingOut ──▶ Running ◀──▶ Branching
//!      │ on demand)           │ died, tag moved           │             │
//!      └──────────────────────┼──────────────▶ HandingOut │             │
//!                             ▼                           ▼             ▼
//!                         Destroyed ◀─────────────────────┴─────────────┘
//! ```
//!
//! ([`Phase::transition`] holds the table; every phase but `Branching` and
//! `Destroyed` may also end in `Destroyed` when its step fails.)
//!
//! Where each phase lives:
//! - `Restoring`: inside `snapshot::restore::restore_paused`; the VM is
//!   paused, loading device state;
//! - `Pooled`: in a pool's ready queue (`pool::Pools`) and in the durable
//!   state's `pooled` map, paused; a warm pool's child already has its
//!   identity but for its clock (`restore::Identity`), a cold one none;
//! - `HandingOut`: owned by one `lifecycle::spawn` call, between leaving the
//!   pool's record (or finishing a restore) and its agent's first answer;
//! - `Running`, `Branching`, `Destroyed`: a [`Sandbox`], whose `phase`
//!   field is changed only through [`Sandbox::advance`], which checks the
//!   move. `Branching` is held only while the VM lock is held (by the
//!   branch), so a delete waits for the branch and then destroys.
//!
//! Before `Running` the phase is who owns the VM (an ownership move is the
//! transition, so it cannot be taken twice); from `Running` on it is a
//! checked field.

use crate::error::{Error, Kind};
use crate::state::SandboxRecord;
use forkd_vmm::{AgentClient, Vm, VmDir};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Where a child VM is in its life (see the module doc's diagram).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// QEMU started, device state loading; paused.
    Restoring,
    /// Parked paused in a pool (warm: with its identity but for its clock).
    Pooled,
    /// Being resumed and given its identity (or, warm, its clock).
    HandingOut,
    /// A sandbox: running, its agent answers.
    Running,
    /// Migrating to a collector for a branch; runs again afterwards.
    Branching,
    /// QEMU killed, directory removed. Final.
    Destroyed,
}

/// A move the lifecycle does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a child VM cannot go from {from:?} to {to:?}; this is a poold bug, please report it")]
pub struct InvalidTransition {
    /// The phase it was in.
    pub from: Phase,
    /// The phase asked for.
    pub to: Phase,
}

impl From<InvalidTransition> for Error {
    /// A bug: the lifecycle never asks for a move it does not allow.
    fn from(e: InvalidTransition) -> Error {
        Error::internal(e)
    }
}

impl Phase {
    /// `to` if the lifecycle allows moving there from `self`.
    pub fn transition(self, to: Phase) -> Result<Phase, InvalidTransition> {
        use Phase::*;
        let ok = matches!(
            (self, to),
            (Restoring, Pooled | HandingOut | Destroyed)
                | (Pooled, HandingOut | Destroyed)
                | (HandingOut, Running | Destroyed)
                | (Running, Branching | Destroyed)
                | (Branching, Running)
        );
        if ok {
            Ok(to)
        } else {
            Err(InvalidTransition { from: self, to })
        }
    }
}

/// One live sandbox. The agent client is cloned out of the VM so requests
/// (exec, eval, files) never wait on the VM lock, which only lifecycle
/// operations (branch, destroy) take. Its fields are private: the record
/// changes through the methods below, the phase only through
/// [`Phase::transition`].
pub struct Sandbox {
    id: String,
    record: Mutex<SandboxRecord>,
    agent: AgentClient,
    dir: VmDir,
    vm: tokio::sync::Mutex<Option<Vm>>,
    /// `Running`, `Branching` or `Destroyed`; see [`Sandbox::advance`].
    phase: Mutex<Phase>,
    /// Published ports' proxies; dropping one stops it.
    published: Mutex<Vec<forkd_net::proxy::Published>>,
    /// Branches captured but not yet committed: each still reads its
    /// frozen disk layer, so the disk chain is flattened only at zero.
    /// Changed under the `vm` lock.
    commits_in_flight: AtomicUsize,
}

impl Sandbox {
    /// A sandbox of a VM that was handed out (or re-adopted running):
    /// `Running`.
    pub fn new(vm: Vm, record: SandboxRecord) -> Sandbox {
        Sandbox {
            id: record.id.clone(),
            agent: vm.agent.clone(),
            dir: vm.dir.clone(),
            record: Mutex::new(record),
            vm: tokio::sync::Mutex::new(Some(vm)),
            phase: Mutex::new(Phase::Running),
            published: Mutex::new(Vec::new()),
            commits_in_flight: Default::default(),
        }
    }

    /// A `Running` sandbox without a VM, for tests of the lifecycle rules:
    /// its agent is whatever `agent` reaches.
    #[cfg(test)]
    pub fn without_vm(record: SandboxRecord, agent: AgentClient, dir: VmDir) -> Sandbox {
        Sandbox {
            id: record.id.clone(),
            agent,
            dir,
            record: Mutex::new(record),
            vm: tokio::sync::Mutex::new(None),
            phase: Mutex::new(Phase::Running),
            published: Mutex::new(Vec::new()),
            commits_in_flight: Default::default(),
        }
    }

    /// Its id (`sb-` + 24 hex digits).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Its record now.
    pub fn record(&self) -> SandboxRecord {
        self.record.lock().unwrap().clone()
    }

    /// Its guest agent.
    pub fn agent(&self) -> &AgentClient {
        &self.agent
    }

    /// Its console log.
    pub fn console(&self) -> std::path::PathBuf {
        self.dir.console()
    }

    /// Its QEMU's pid, if its record can be read.
    pub fn qemu_pid(&self) -> Option<u32> {
        self.dir.read_record().ok().map(|v| v.qemu.pid)
    }

    /// Whether its QEMU still runs.
    pub fn is_alive(&self) -> bool {
        self.dir.read_record().is_ok_and(|v| v.qemu.is_alive())
    }

    /// The sandbox's phase now.
    pub fn phase(&self) -> Phase {
        *self.phase.lock().unwrap()
    }

    /// Moves the sandbox to `to` if [`Phase::transition`] allows it.
    fn advance(&self, to: Phase) -> Result<Phase, InvalidTransition> {
        let mut p = self.phase.lock().unwrap();
        *p = p.transition(to)?;
        Ok(*p)
    }

    /// Sets when it is killed automatically (0: never); its record after.
    pub fn set_expiry(&self, expires_at_unix: u64) -> SandboxRecord {
        let mut r = self.record.lock().unwrap();
        r.expires_at_unix = expires_at_unix;
        r.clone()
    }

    /// Records the egress policy its network is getting (`pending`) or got.
    pub fn set_egress(&self, egress: forkd_net::EgressPolicy, pending: bool) -> SandboxRecord {
        let mut r = self.record.lock().unwrap();
        r.egress = Some(egress);
        r.egress_pending = pending;
        r.clone()
    }

    /// Its VM, locked for a change that must not overlap a branch or a
    /// destroy (a network update). A destroyed sandbox is
    /// [`Error::NotFound`].
    pub async fn lock_vm(&self) -> Result<tokio::sync::MappedMutexGuard<'_, Vm>, Error> {
        let vm = self.vm.lock().await;
        tokio::sync::MutexGuard::try_map(vm, Option::as_mut)
            .map_err(|_| Error::not_found(Kind::Sandbox, &self.id))
    }

    /// Makes it workspace `ws`'s when it is no workspace's yet (a pause
    /// adopting it); false when another one claimed it first.
    pub fn claim_for_workspace(&self, ws: &str) -> bool {
        let mut r = self.record.lock().unwrap();
        if r.workspace.is_some() {
            return false;
        }
        r.workspace = Some(ws.to_string());
        true
    }

    /// Undoes [`Self::claim_for_workspace`] (the adoption was not recorded).
    pub fn unclaim(&self, ws: &str) {
        let mut r = self.record.lock().unwrap();
        if r.workspace.as_deref() == Some(ws) {
            r.workspace = None;
        }
    }

    /// Keeps a published port's proxy running (and its host port in the
    /// record) for as long as the sandbox lives.
    pub fn publish(&self, p: forkd_net::proxy::Published) {
        self.record.lock().unwrap().ports.push(p.spec.clone());
        self.published.lock().unwrap().push(p);
    }

    /// Starts a branch: `Running` → `Branching` while the returned guard
    /// lives (then `Running` again), holding the VM lock throughout, so a
    /// destroy waits for it. A destroyed sandbox is [`Error::NotFound`].
    pub async fn begin_branch(&self) -> Result<Branching<'_>, Error> {
        let vm = self.vm.lock().await;
        let vm = tokio::sync::MutexGuard::try_map(vm, Option::as_mut)
            .map_err(|_| Error::not_found(Kind::Sandbox, &self.id))?;
        self.advance(Phase::Branching)?;
        Ok(Branching { sb: self, vm })
    }

    /// Ends a commit a [`Branching::captured`] started. When it was the
    /// last one in flight and the VM still runs, returns the VM (locked),
    /// whose disk chain no branch reads any more.
    pub async fn end_commit(&self) -> Option<tokio::sync::MappedMutexGuard<'_, Vm>> {
        let vm = self.vm.lock().await;
        if self.commits_in_flight.fetch_sub(1, Ordering::SeqCst) != 1 {
            return None;
        }
        tokio::sync::MutexGuard::try_map(vm, Option::as_mut).ok()
    }

    /// Kills QEMU and removes the VM directory: `Destroyed`. Idempotent.
    /// Waits for a branch in progress (it holds the VM lock) to finish
    /// first.
    pub async fn destroy(&self) {
        self.published.lock().unwrap().clear();
        let mut vm = self.vm.lock().await;
        if self.phase() != Phase::Destroyed {
            if let Err(e) = self.advance(Phase::Destroyed) {
                tracing::error!("sandbox {}: {e}", self.id);
            }
        }
        if let Some(vm) = vm.take() {
            vm.destroy().await;
        }
        drop(vm);
        let _ = std::fs::remove_dir_all(&self.dir.path);
    }
}

/// A sandbox being branched (see [`Sandbox::begin_branch`]): its VM,
/// locked, in `Branching`; `Running` again when dropped.
pub struct Branching<'a> {
    sb: &'a Sandbox,
    vm: tokio::sync::MappedMutexGuard<'a, Vm>,
}

impl Branching<'_> {
    /// The VM being branched.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The capture succeeded: the record counts the branch, and its commit
    /// is in flight until [`Sandbox::end_commit`].
    pub fn captured(&self) {
        self.sb.commits_in_flight.fetch_add(1, Ordering::SeqCst);
        self.sb.record.lock().unwrap().branch_count += 1;
    }
}

impl Drop for Branching<'_> {
    /// A capture leaves the child running, on success and on failure.
    fn drop(&mut self) {
        if let Err(e) = self.sb.advance(Phase::Running) {
            tracing::error!("sandbox {}: {e}", self.sb.id);
        }
    }
}

/// Every live sandbox by id.
#[derive(Default)]
pub struct Sandboxes {
    map: RwLock<HashMap<String, Arc<Sandbox>>>,
}

impl Sandboxes {
    pub fn get(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.map.read().unwrap().get(id).cloned()
    }

    pub fn insert(&self, sb: Arc<Sandbox>) {
        self.map.write().unwrap().insert(sb.id.clone(), sb);
    }

    /// The sandbox `id`, or [`Error::NotFound`].
    pub fn find(&self, id: &str) -> Result<Arc<Sandbox>, Error> {
        self.get(id)
            .ok_or_else(|| Error::not_found(Kind::Sandbox, id))
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.map.write().unwrap().remove(id)
    }

    pub fn len(&self) -> usize {
        self.map.read().unwrap().len()
    }

    /// All sandboxes, oldest first.
    pub fn all(&self) -> Vec<Arc<Sandbox>> {
        let mut v: Vec<_> = self.map.read().unwrap().values().cloned().collect();
        v.sort_by_key(|s| (s.record.lock().unwrap().created_at_unix, s.id.clone()));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::Phase::{self, *};

    const ALL: [Phase; 6] = [Restoring, Pooled, HandingOut, Running, Branching, Destroyed];

    /// The whole table: exactly these moves are allowed.
    #[test]
    fn transition_table() {
        let allowed = [
            (Restoring, Pooled),
            (Restoring, HandingOut),
            (Restoring, Destroyed),
            (Pooled, HandingOut),
            (Pooled, Destroyed),
            (HandingOut, Running),
            (HandingOut, Destroyed),
            (Running, Branching),
            (Running, Destroyed),
            (Branching, Running),
        ];
        for from in ALL {
            for to in ALL {
                let r = from.transition(to);
                if allowed.contains(&(from, to)) {
                    assert_eq!(r, Ok(to), "{from:?} -> {to:?}");
                } else {
                    let e = r.expect_err(&format!("{from:?} -> {to:?} must be refused"));
                    assert_eq!((e.from, e.to), (from, to));
                }
            }
        }
    }

    #[test]
    fn destroyed_is_final_and_nothing_skips_the_hand_out() {
        assert!(ALL.iter().all(|&to| Destroyed.transition(to).is_err()));
        assert!(Pooled.transition(Running).is_err());
        assert!(Restoring.transition(Running).is_err());
        // A branch never ends the sandbox by itself: it runs again first.
        assert!(Branching.transition(Destroyed).is_err());
        assert!(Running.transition(Running).is_err());
    }

    #[test]
    fn a_message_that_says_what_to_do() {
        let e = Running.transition(Pooled).unwrap_err();
        assert_eq!(
            e.to_string(),
            "a child VM cannot go from Running to Pooled; this is a poold bug, please report it"
        );
    }
}
