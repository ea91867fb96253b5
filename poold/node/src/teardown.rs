//! How VMs end: a sandbox destroyed, a child that never became a sandbox
//! discarded, a pooled child dropped, a VM nobody can reach forgotten.
//!
//! Invariant: every way a VM ends removes its cgroups ([`remove_cgroups`])
//! and its record from the durable state, so nothing of it is left for a
//! restart to trip over.

use crate::node::Node;
use crate::pool::PooledVm;
use forkd_vmm::{Vm, VmDir};
use std::sync::Arc;

/// Destroys sandbox `id`: kills QEMU, removes its directory, cgroups and
/// record. Returns false when there is no such sandbox (one still being
/// handed out is not one yet: it is listed only once its spawn recorded it).
pub(crate) async fn destroy(n: &Arc<Node>, id: &str) -> bool {
    let Some(sb) = n.sandboxes.remove(id) else {
        return false;
    };
    sb.destroy().await;
    remove_cgroups(n, id);
    let id = id.to_string();
    if let Err(e) = n
        .state
        .commit(move |s| {
            s.sandboxes.remove(&id);
        })
        .await
    {
        tracing::error!("{e:#}");
    }
    n.metrics.sandboxes.set(n.sandboxes.len() as i64);
    true
}

/// Destroys pooled children in the background and forgets their records.
pub(crate) fn discard_pooled(n: &Arc<Node>, vms: Vec<PooledVm>) {
    if vms.is_empty() {
        return;
    }
    let n = n.clone();
    tokio::spawn(async move {
        let ids: Vec<String> = vms.iter().map(|v| v.record.vm_id.clone()).collect();
        futures::future::join_all(vms.into_iter().map(|v| destroy_pooled(&n, v))).await;
        if let Err(e) = n
            .state
            .commit(|s| {
                ids.iter().for_each(|id| {
                    s.pooled.remove(id);
                })
            })
            .await
        {
            tracing::error!("{e:#}");
        }
        n.update_pool_gauges();
    });
}

/// Removes the pool records of children taken by a spawn that failed
/// (they were destroyed, or became sandboxes that were).
pub(crate) async fn forget_pooled(n: &Node, ids: Vec<String>) {
    if ids.is_empty() {
        return;
    }
    if let Err(e) = n
        .state
        .commit(move |s| {
            for id in &ids {
                s.pooled.remove(id);
            }
        })
        .await
    {
        tracing::error!("{e:#}");
    }
}

/// Destroys a child that never became a sandbox, with its cgroups.
pub(crate) async fn discard(n: &Node, vm: Vm) {
    let id = vm.id.clone();
    vm.destroy().await;
    remove_cgroups(n, &id);
}

/// Destroys a pooled child, with the cgroups it joined when parked.
pub(crate) async fn destroy_pooled(n: &Node, v: PooledVm) {
    v.vm.destroy().await;
    remove_cgroups(n, &v.record.vm_id);
}

/// Removes a VM the node cannot use: kills its QEMU if it still runs (a VM
/// nobody can reach must not keep running), then its directory.
pub(crate) async fn forget_vm(n: &Node, id: &str) {
    let dir = VmDir::new(n.paths.vm_dir(id));
    if let Ok(r) = dir.read_record() {
        forkd_vmm::kill_proc(&r.qemu).await;
        if let Some(net) = r.net {
            forkd_vmm::net::teardown(net).await;
        }
    }
    remove_cgroups(n, id);
    let _ = std::fs::remove_dir_all(&dir.path);
}

/// Removes VM `id`'s cgroups, if it has any (its processes are gone):
/// every way a VM ends goes through here, whatever its limits were.
pub(crate) fn remove_cgroups(n: &Node, id: &str) {
    if let Some(h) = &n.cgroups {
        h.remove(id);
    }
}
