//! Re-adopting everything after a restart (docs/design.md, "Faults: what
//! survives what"). The QEMU processes are not tied to poold's lifetime:
//! at start the node reads its state and takes back every VM whose QEMU
//! still runs.
//!
//! Invariants after [`adopt_all`]:
//! - every recorded sandbox whose QEMU runs is listed and runs (one a dead
//!   poold's branch left stopped is resumed);
//! - a pooled child is parked again only if it is still paused (never
//!   resumed); one that was being handed out has run, and is destroyed;
//! - VMs, networks and staging files nobody records are gone.

use crate::node::Node;
use crate::pool::{PooledVm, Residency};
use crate::sandbox::Sandbox;
use crate::spawn::publish_ports;
use crate::state::State;
use crate::teardown::{forget_vm, remove_cgroups};
use crate::token::AccessToken;
use forkd_vmm::{Lifetime, Vm, VmDir};
use std::sync::Arc;
use std::time::Duration;

/// Re-adopts every sandbox and pooled child of the saved state whose QEMU
/// still runs; forgets the dead; kills detached VMs an earlier poold started
/// but never recorded.
pub(crate) async fn adopt_all(n: &Arc<Node>, saved: State) -> anyhow::Result<()> {
    let mut alive_ids = std::collections::HashSet::new();
    let mut dead_sb = Vec::new();
    // Records changed here: a token minted, a pending egress written.
    let mut rewritten = Vec::new();
    // Reconnected all at once: one slow QEMU costs its own timeout, not
    // everyone's.
    let adopted = futures::future::join_all(saved.sandboxes.keys().map(|id| async move {
        let vm = Vm::adopt(VmDir::new(n.paths.vm_dir(id))).await;
        if let Ok(vm) = &vm {
            run_again(vm, id).await;
        }
        vm
    }))
    .await;
    for ((id, rec), vm) in saved.sandboxes.iter().zip(adopted) {
        let vm = match vm {
            Ok(vm) if rec.egress_pending => finish_egress(vm, rec).await,
            other => other,
        };
        match vm {
            Ok(vm) => {
                let mut rec = rec.clone();
                rec.pid = vm.pid();
                // Written by `finish_egress` above.
                let changed = std::mem::take(&mut rec.egress_pending);
                if rec.access_token.is_empty() {
                    // Recorded before sandboxes had tokens.
                    rec.access_token = AccessToken::mint();
                    rewritten.push(rec.clone());
                } else if changed {
                    rewritten.push(rec.clone());
                }
                let ports = std::mem::take(&mut rec.ports);
                let sb = Arc::new(Sandbox::new(vm, rec));
                if let Err(e) = publish_ports(&sb, &ports).await {
                    tracing::warn!("sandbox {id}: publishing its ports again: {e:#}");
                }
                n.sandboxes.insert(sb);
                alive_ids.insert(id.clone());
            }
            Err(e) => {
                tracing::warn!("sandbox {id} cannot be re-adopted ({e:#}); removing it");
                forget_vm(n, id).await;
                dead_sb.push(id.clone());
            }
        }
    }
    let mut dead_pooled = Vec::new();
    let adopted = futures::future::join_all(
        saved
            .pooled
            .keys()
            .map(|id| Vm::adopt(VmDir::new(n.paths.vm_dir(id)))),
    )
    .await;
    for ((id, rec), vm) in saved.pooled.iter().zip(adopted) {
        let adopted = match vm {
            // Only a still-paused child may be parked again: one that was
            // being handed out when poold died has run, without its record.
            Ok(vm) => match vm.run_state().await {
                Ok(forkd_vmm::RunState::Paused) => Ok(vm),
                other => {
                    vm.destroy().await;
                    Err(anyhow::anyhow!("it is not paused ({other:?})"))
                }
            },
            Err(e) => Err(e),
        };
        match adopted {
            Ok(vm) => match n.pools.adopt(PooledVm {
                // Most of what it owns is in swap: it was paged out.
                residency: if forkd_vmm::mem_use(vm.pid())
                    .is_ok_and(|m| m.swap_pss_kib > m.pss_anon_kib)
                {
                    Residency::PagedOut
                } else {
                    Residency::Resident
                },
                vm,
                record: rec.clone(),
            }) {
                None => {
                    alive_ids.insert(id.clone());
                }
                Some(unwanted) => {
                    tracing::info!(
                        "pooled child {id}: its pool was deleted or shrunk; removing it"
                    );
                    unwanted.vm.destroy().await;
                    dead_pooled.push(id.clone());
                }
            },
            Err(e) => {
                tracing::warn!("pooled child {id} cannot be re-adopted ({e:#}); removing it");
                forget_vm(n, id).await;
                dead_pooled.push(id.clone());
            }
        }
    }
    kill_unrecorded(n, &alive_ids).await;
    // What a kill -9 mid-branch or mid-create left: the collector VM's
    // directory (an ephemeral VM of the dead poold) and staging files.
    let swept = forkd_vmm::sweep(&n.paths.vms_dir()).await;
    if !swept.is_empty() {
        tracing::warn!("removed VM directories of a dead poold: {swept:?}");
    }
    forkd_snapshot::staging::sweep(&n.paths.staging_dir());
    reconcile_networks(n).await;
    n.state
        .commit(move |s| {
            for id in dead_sb {
                s.sandboxes.remove(&id);
            }
            for id in dead_pooled {
                s.pooled.remove(&id);
            }
            for r in rewritten {
                s.sandboxes.insert(r.id.clone(), r);
            }
        })
        .await?;
    n.metrics.sandboxes.set(n.sandboxes.len() as i64);
    Ok(())
}

/// Writes the policy of a sandbox a dead poold was changing the egress of
/// (`crate::network`); one that cannot get it is killed (its network may
/// hold part of the old policy), so Err.
async fn finish_egress(mut vm: Vm, rec: &crate::state::SandboxRecord) -> anyhow::Result<Vm> {
    match crate::network::reapply(&mut vm, rec).await {
        Ok(()) => Ok(vm),
        Err(e) => {
            vm.destroy().await;
            Err(e.context("writing the egress policy a dead poold left half-written; killed it"))
        }
    }
}

/// A sandbox always runs while poold is away; one that is stopped was left
/// so by a poold that died mid-branch (its migration to the collector
/// stops the vCPUs, or waits at pre-switchover). Cancels that migration
/// (the collector is gone with its poold) and resumes the vCPUs.
async fn run_again(vm: &Vm, id: &str) {
    use forkd_vmm::RunState;
    let state = match vm.run_state().await {
        Ok(RunState::Running) => return,
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("sandbox {id}: reading its run state: {e:#}");
            return;
        }
    };
    if !matches!(
        state,
        RunState::Paused | RunState::Postmigrate | RunState::FinishMigrate
    ) {
        tracing::warn!("sandbox {id} is {state:?}, not stopped by a branch; leaving it");
        return;
    }
    tracing::warn!("sandbox {id} was left {state:?} (a branch poold did not finish); resuming it");
    if vm
        .qmp
        .query_migrate()
        .await
        .is_ok_and(|m| m.status.is_in_progress())
    {
        let _ = vm
            .qmp
            .execute("migrate_cancel", serde_json::json!({}))
            .await;
        for _ in 0..100 {
            match vm.qmp.query_migrate().await {
                Ok(m) if m.status.is_in_progress() => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                _ => break,
            }
        }
    }
    if let Err(e) = vm.resume().await {
        tracing::warn!("sandbox {id}: resuming it: {e:#}");
    }
}

/// Removes every child network (namespace, link, rule) of this data dir
/// that no live VM owns: what a kill -9 at any step left behind. A VM is
/// live when its record's QEMU runs, whoever started it (this poold's
/// sandboxes and pools, a `forkd run` of the same data dir).
async fn reconcile_networks(n: &Node) {
    let owned: Vec<forkd_net::ChildNet> = std::fs::read_dir(n.paths.vms_dir())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| VmDir::new(e.path()).read_record().ok())
        .filter(|r| r.qemu.is_alive())
        .filter_map(|r| r.net)
        .collect();
    match forkd_vmm::net::reconcile(&n.paths.home, owned).await {
        Ok(r) if r != forkd_net::Reconciled::default() => {
            tracing::warn!("removed leaked child networks: {r:?}")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("reconciling child networks: {e:#}"),
    }
}

/// Kills detached VMs whose owner is gone and that the state does not name.
async fn kill_unrecorded(n: &Node, known: &std::collections::HashSet<String>) {
    let Ok(rd) = std::fs::read_dir(n.paths.vms_dir()) else {
        return;
    };
    for ent in rd.flatten() {
        let name = ent.file_name().to_string_lossy().into_owned();
        if known.contains(&name) {
            continue;
        }
        let dir = VmDir::new(ent.path());
        let Ok(r) = dir.read_record() else { continue };
        if r.lifetime == Lifetime::Detached && !r.owner.is_alive() {
            tracing::warn!("killing unrecorded VM {name} (pid {})", r.qemu.pid);
            forkd_vmm::kill_proc(&r.qemu).await;
            if let Some(net) = r.net {
                forkd_vmm::net::teardown(net).await;
            }
            remove_cgroups(n, &name);
            let _ = std::fs::remove_dir_all(ent.path());
        }
    }
}
