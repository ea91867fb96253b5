//! Parked children's memory (docs/design.md, "Pools under TCG"): a pool
//! with `page_out` parks its children in swap, and the node reads the
//! oldest paged-out child back while fewer than `keep_resident` are
//! resident, so only bursts pay the reads at hand-out.

use crate::node::Node;
use forkd_vmm::Vm;
use std::sync::Arc;
use std::time::Instant;

/// Moves a paused child's memory to swap (its pool's `page_out`); true if
/// it did. A child that stays resident is still a good child, so failures
/// are logged.
pub(crate) async fn page_out_parked(n: &Node, vm: &Vm, tag: &str) -> bool {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if forkd_vmm::swap_total_kib() == 0 {
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "pool {tag} has page_out set but this host has no swap: its children stay resident (add swap, e.g. zram; docs/poold.md)"
            );
        }
        return false;
    }
    if let Some(h) = &n.cgroups {
        if let Err(e) = h.allow_swap(&vm.id) {
            tracing::warn!("pool {tag}: letting {} swap: {e:#}", vm.id);
        }
    }
    match vm.page_out().await {
        Ok(_) => {
            if let Ok(m) = forkd_vmm::mem_use(vm.pid()) {
                tracing::debug!(
                    "pool {tag}: parked {} paged out, {} KiB resident, {} KiB in swap",
                    vm.id,
                    m.pss_kib,
                    m.swap_pss_kib
                );
            }
            true
        }
        Err(e) => {
            tracing::warn!("pool {tag}: paging out {}: {e:#}", vm.id);
            false
        }
    }
}

/// Starts reading back from swap the paged-out children that pools keep
/// resident (see [`crate::pool::Pools::plan_page_ins`]), each started when
/// the last ends. A failure leaves the child paged out, still a good child,
/// and is retried from the refill loop a second later.
pub(crate) fn start_page_ins(n: &Arc<Node>) {
    for t in n.pools.plan_page_ins(|v| v.vm.record.qemu) {
        let n = n.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let qemu = t.what;
            let r = tokio::task::spawn_blocking(move || forkd_vmm::page_in(&qemu))
                .await
                .map_err(anyhow::Error::from)
                .and_then(|r| r);
            match &r {
                Ok(bytes) => tracing::debug!(
                    "pool {}: paged {} back in, {} KiB in {:.1} ms",
                    t.tag,
                    t.vm_id,
                    bytes >> 10,
                    t0.elapsed().as_secs_f64() * 1e3
                ),
                // Destroyed meanwhile (its pool drained): nothing to say.
                Err(_) if !qemu.is_alive() => {}
                Err(e) => warn_page_in_failed(&t.tag, &t.vm_id, e),
            }
            n.pools.finish_page_in(&t.tag, &t.vm_id, r.is_ok());
            n.update_pool_gauges();
            // The next one now, not at the next spawn: a pool emptied of
            // resident children by a burst refills them back to back.
            if r.is_ok() {
                start_page_ins(&n);
            }
        });
    }
}

/// Warns once per poold: a refusal (no ptrace access) would repeat every
/// second; later ones are debug lines.
fn warn_page_in_failed(tag: &str, vm_id: &str, e: &anyhow::Error) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::debug!("pool {tag}: paging {vm_id} back in: {e:#}");
    } else {
        tracing::warn!(
            "pool {tag}: paging {vm_id} back in: {e:#} (its hand-out reads it from swap; further failures are logged at debug level)"
        );
    }
}
