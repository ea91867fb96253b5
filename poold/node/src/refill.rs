//! Warm pools as the node runs them (docs/design.md, "Spawn"): sizing a
//! pool, and the refill loop that restores children paused, warms and
//! parks them (paged out where the pool says so, `parking`). The
//! bookkeeping rules (what fits, generations, residency) are `pool`'s.

use crate::config::PoolSpec;
use crate::error::{check_tag, Error, Result};
use crate::node::Node;
use crate::parking::{page_out_parked, start_page_ins};
use crate::pool::{PoolStatus, PooledVm, RefillTicket, Residency};
use crate::spawn::{child_volumes, confine, source};
use crate::state::PooledRecord;
use crate::teardown::{discard, discard_pooled};
use forkd_snapshot::restore::{restore_paused_with, ChildTimings, Source};
use forkd_snapshot::unix_now;
use forkd_vmm::{Lifetime, Vm};
use std::sync::Arc;
use std::time::Duration;

/// Sets `tag`'s pool (persisted; pools set so override the config's),
/// discarding the children that no longer fit. Refused: a bad spec,
/// `page_out` without swap, a snapshot that does not exist, pools that
/// would hold more than `max_sandboxes` children together.
pub(crate) async fn set_pool(n: &Arc<Node>, tag: &str, spec: PoolSpec) -> Result<PoolStatus> {
    check_tag(tag)?;
    spec.validate()
        .map_err(|e| Error::invalid("pool", format!("{e:#}")))?;
    if spec.page_out && forkd_vmm::swap_total_kib() == 0 {
        return Err(Error::invalid(
            "page_out",
            "page_out needs swap on this host and it has none (SwapTotal is 0): add a swap device (zram keeps it in compressed RAM; docs/poold.md, \"Parking children in swap\") or leave page_out off",
        ));
    }
    // A pool for a snapshot that does not exist would only log refill errors.
    crate::snapshots::resolve(n, tag).await?;
    // Paused children cost memory too: all pools together stay within
    // max_sandboxes.
    let others: usize = n
        .pools
        .status()
        .iter()
        .filter(|p| p.tag != tag)
        .map(|p| p.max_ready)
        .sum();
    if others + spec.max() > n.cfg.max_sandboxes {
        return Err(Error::invalid(
            "max_ready",
            format!(
                "pools would keep up to {} children ready, over max_sandboxes ({}); shrink another pool or raise max_sandboxes",
                others + spec.max(),
                n.cfg.max_sandboxes
            ),
        ));
    }
    let (t, saved) = (tag.to_string(), spec.clone());
    n.state
        .commit(move |s| {
            s.pools.insert(t, saved);
        })
        .await?;
    let extra = n.pools.set(tag, Some(spec));
    discard_pooled(n, extra);
    n.refill_wake.notify_one();
    Ok(n.pools.status_of(tag))
}

/// Deletes `tag`'s pool: its ready children are destroyed. Recorded as an
/// empty pool, so a pool from the config file stays deleted across
/// restarts too.
pub(crate) async fn delete_pool(n: &Arc<Node>, tag: &str) -> Result<()> {
    check_tag(tag)?;
    let off = PoolSpec {
        min_ready: 0,
        max_ready: Some(0),
        warm: false,
        warm_eval: None,
        page_out: false,
        keep_resident: None,
        network: None,
    };
    let t = tag.to_string();
    n.state
        .commit(move |s| {
            s.pools.insert(t, off);
        })
        .await?;
    let extra = n.pools.set(tag, None);
    discard_pooled(n, extra);
    Ok(())
}

/// Refills pools until the node is dropped: wakes on a notification (and
/// every second), asks the pools for tickets within `refill_concurrency`,
/// restores each child paused and parks it ([`refill_one`]).
pub(crate) async fn refill_loop(n: Arc<Node>) {
    loop {
        // Also after a restart, a failed page-in, a larger keep_resident.
        start_page_ins(&n);
        let budget = n.refill_slots.available_permits();
        for ticket in n.pools.plan_refills(budget) {
            let Ok(permit) = n.refill_slots.clone().try_acquire_owned() else {
                n.pools.finish_refill(&ticket, None);
                continue;
            };
            let n = n.clone();
            tokio::spawn(async move {
                let res = match refill_source(&n, &ticket.tag).await {
                    Ok(Ok(src)) => refill_one(&n, &ticket, src).await,
                    Ok(Err(why)) => {
                        drop(permit);
                        tracing::debug!("pool {} waits: {why}", ticket.tag);
                        n.pools.hold_back(&ticket, why);
                        n.update_pool_gauges();
                        return;
                    }
                    Err(e) => Err(e),
                };
                let vm = match res {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::warn!("refilling pool {}: {e:#}", ticket.tag);
                        crate::mount_watch::suspect(&n, &format!("{e:#}"));
                        // Back off so a broken snapshot does not spin.
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        None
                    }
                };
                drop(permit);
                if let Some(extra) = n.pools.finish_refill(&ticket, vm) {
                    discard_pooled(&n, vec![extra]);
                }
                n.update_pool_gauges();
                n.refill_wake.notify_one();
            });
        }
        n.update_pool_gauges();
        tokio::select! {
            _ = n.refill_wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// What a refill of pool `tag` restores from, or (inner `Err`) why the
/// pool must wait: a child of a lazy snapshot parked before the snapshot's
/// working set is here would fault that set over the network when handed
/// out, so a pool refills only from snapshots whose working set is local
/// (docs/hub.md, "Lazy pulls"). Asking forkd-fs also starts the prefetch.
async fn refill_source(
    n: &Arc<Node>,
    tag: &str,
) -> anyhow::Result<std::result::Result<Source, String>> {
    let src = source(n, tag).await?;
    let (mount, s2) = (n.mount.clone(), src.clone());
    let local = tokio::task::spawn_blocking(move || s2.working_set_local(&mount))
        .await?
        .map_err(|e| e.context("asking forkd-fs whether the working set is local"))?;
    Ok(if local {
        Ok(src)
    } else {
        Err(format!(
            "snapshot {} is lazy and its working set is still being fetched from its hub",
            src.id
        ))
    })
}

/// Restores one paused child of `src` for a pool, warms it once, records
/// it.
async fn refill_one(n: &Arc<Node>, t: &RefillTicket, src: Source) -> anyhow::Result<PooledVm> {
    n.check_headroom(&format!("refilling pool {}", t.tag))?;
    let volumes = child_volumes(n, &src, &[])?;
    let id = n.new_id();
    let mut timings = ChildTimings::default();
    let mut vm = restore_paused_with(
        &n.paths,
        &src,
        &id,
        Lifetime::Detached,
        &volumes,
        &mut timings,
    )
    .await?;
    // Into its cgroups now, with the default limits: the hand-out then
    // only adjusts values (see `confine`), and the warm-up's memory is
    // charged to the child.
    let defaults = n.default_limits();
    if let Err(e) = confine(n, &vm, &defaults) {
        discard(n, vm).await;
        return Err(e);
    }
    if t.warm {
        if let Err(e) = warm_once(&vm, &id, t.warm_eval.as_deref()).await {
            discard(n, vm).await;
            return Err(e);
        }
    }
    // The pool's egress policy (its `network`, else the config's default)
    // is written while the child waits (paused, so it sends nothing): a
    // hand-out asking for the same skips the write. Domain names in it
    // are resolved now, not at hand-out.
    let policy = n.pools.spec(&t.tag).and_then(|s| s.network);
    let policy = policy.unwrap_or_else(forkd_vmm::net::default_egress);
    if let Err(e) = forkd_snapshot::restore::set_egress(&mut vm, &policy).await {
        discard(n, vm).await;
        return Err(e);
    }
    // The first `keep_resident` ready children stay resident: they go
    // first, and are what a refill replaces.
    let paged_out = t.page_out
        && n.pools.kept_resident(&t.tag) >= t.keep_resident
        && page_out_parked(n, &vm, &t.tag).await;
    let record = PooledRecord {
        vm_id: id.clone(),
        tag: t.tag.clone(),
        snapshot_id: src.id.to_string(),
        created_at_unix: unix_now(),
        identified: t.warm,
    };
    let r2 = record.clone();
    if let Err(e) = n
        .state
        .commit(move |s| {
            s.pooled.insert(r2.vm_id.clone(), r2);
        })
        .await
    {
        discard(n, vm).await;
        return Err(e);
    }
    Ok(PooledVm {
        vm,
        record,
        residency: if paged_out {
            Residency::PagedOut
        } else {
            Residency::Resident
        },
    })
}

/// Runs the child briefly and pauses it again: it gets its identity (all
/// but the clock, which the hand-out sets), and the code paths of its first
/// real request are translated, so neither costs the spawn.
async fn warm_once(vm: &Vm, hostname: &str, warm_eval: Option<&str>) -> anyhow::Result<()> {
    vm.resume().await?;
    forkd_snapshot::restore::give_identity(vm, hostname).await?;
    let p = vm.agent.ping(Duration::from_secs(30)).await?;
    if p.warm_ready {
        // The eval path too (the pipe to the warm interpreter and its loop):
        // by default a no-op expression, so nothing of the child's state
        // changes; the pool's `warm_eval` when it names a first request.
        let r = vm
            .agent
            .eval(warm_eval.unwrap_or("None"), Some(30_000))
            .await?;
        if let Some(e) = r.error {
            tracing::warn!("pool warm_eval failed in {hostname} (the child is parked anyway): {e}");
        }
    }
    vm.pause().await
}
