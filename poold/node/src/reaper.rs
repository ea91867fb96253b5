//! What the node does by itself: TTLs (set through [`set_ttl`], acted on
//! by the reaper), dead QEMUs and pooled children dropped, consoles kept
//! bounded, snapshots marked reclaimable deleted once unused
//! ([`mark_reclaimable`], [`reclaim_loop`]), and the store's GC after
//! snapshot deletes.

use crate::error::{check_tag, Error, Result};
use crate::limits::MAX_TTL_SECS;
use crate::node::Node;
use crate::state::SandboxRecord;
use crate::teardown::{destroy, discard_pooled};
use forkd_snapshot::unix_now;
use std::sync::Arc;
use std::time::Duration;

/// Sets when sandbox `id` is killed automatically: `ttl_secs` from now (0
/// clears it). Durable before it returns.
pub(crate) async fn set_ttl(n: &Node, id: &str, ttl_secs: u64) -> Result<SandboxRecord> {
    if ttl_secs > MAX_TTL_SECS {
        return Err(Error::invalid(
            "ttl_secs",
            format!("ttl_secs must be at most {MAX_TTL_SECS} (10 years); 0 clears the TTL"),
        ));
    }
    let sb = n.sandbox(id)?;
    let expires = if ttl_secs == 0 {
        0
    } else {
        unix_now().saturating_add(ttl_secs)
    };
    let rec = sb.set_expiry(expires);
    let id = rec.id.clone();
    n.state
        .commit(move |s| {
            // Only while it exists (a concurrent delete must not be
            // undone), and only its expiry (a concurrent egress update or
            // pause writes fields of its own).
            if let Some(r) = s.sandboxes.get_mut(&id) {
                r.expires_at_unix = expires;
            }
        })
        .await?;
    Ok(rec)
}

/// Marks snapshot `tag` for [`reclaim_loop`]; durable before it returns.
pub(crate) async fn mark_reclaimable(n: &Node, tag: &str) -> Result<()> {
    check_tag(tag)?;
    let (t, now) = (tag.to_string(), unix_now());
    n.state
        .commit(move |s| {
            s.reclaim.insert(t, now);
        })
        .await?;
    n.reclaim_wake.notify_one();
    Ok(())
}

/// How often marked snapshots are looked at without a wake-up (a sandbox
/// that ends does not wake the loop: its teardown knows nothing of this).
const RECLAIM_EVERY: Duration = Duration::from_secs(2);

/// Deletes the snapshots marked reclaimable once unused: no live sandbox
/// was spawned from the tag and no pool is set for it. A delete refused
/// (a snapshot branched from one of its children depends on it; a child
/// still maps it) is tried again later; a tag already gone is forgotten.
/// The delete wakes the store's GC, so the disk comes back too.
pub(crate) async fn reclaim_loop(n: Arc<Node>) {
    loop {
        reclaim_unused(&n).await;
        tokio::select! {
            _ = n.reclaim_wake.notified() => {}
            _ = tokio::time::sleep(RECLAIM_EVERY) => {}
        }
    }
}

async fn reclaim_unused(n: &Arc<Node>) {
    let marked: Vec<String> = n.state.read(|s| s.reclaim.keys().cloned().collect());
    if marked.is_empty() {
        return;
    }
    let in_use: std::collections::HashSet<String> = n
        .sandboxes
        .all()
        .iter()
        .map(|sb| sb.record().snapshot_tag)
        .collect();
    for tag in marked {
        if in_use.contains(&tag) || n.pools.spec(&tag).is_some() {
            continue;
        }
        match crate::snapshots::delete(n, &tag, false, false).await {
            Ok(()) => tracing::info!("snapshot {tag}: reclaimed (no sandbox of it is left)"),
            Err(Error::NotFound { .. }) => {}
            Err(e @ Error::Conflict(_)) => {
                tracing::debug!("snapshot {tag}: not reclaimed yet: {e}");
                continue;
            }
            Err(e) => {
                tracing::warn!("snapshot {tag}: reclaiming it: {e}");
                continue;
            }
        }
        let t = tag.clone();
        if let Err(e) = n
            .state
            .commit(move |s| {
                s.reclaim.remove(&t);
            })
            .await
        {
            tracing::warn!("snapshot {tag}: forgetting its reclaim mark: {e}");
        }
    }
}

/// Deletes coming in together are reclaimed by one GC this long after the
/// first.
const GC_DEBOUNCE: Duration = Duration::from_secs(2);

/// Runs a store GC at start (what deletes made while poold was away left)
/// and after snapshot deletes, so deleted snapshots free their disk without
/// anyone running `forkd store gc`. GC takes the store's write turn, so it
/// waits for a create in flight and a create waits for it.
pub(crate) async fn gc_loop(n: Arc<Node>) {
    loop {
        match forkd_snapshot::store::with_rw(&n.paths, |store| Ok(store.gc()?)).await {
            Ok(r) => {
                if r.bytes_reclaimed > 0 || r.manifests_removed > 0 {
                    tracing::info!(
                        "store GC: {} manifests and {} chunks removed, {} packs deleted, {} MiB reclaimed in {} ms",
                        r.manifests_removed,
                        r.chunks_removed,
                        r.packs_deleted,
                        r.bytes_reclaimed >> 20,
                        r.elapsed_ms
                    );
                }
                for p in r.problems {
                    tracing::warn!("store GC: {p} (run `forkd store verify`)");
                }
            }
            Err(e) => tracing::warn!("store GC: {e:#}"),
        }
        n.gc_wake.notified().await;
        tokio::time::sleep(GC_DEBOUNCE).await;
    }
}

/// An empty cgroup this old that no VM of ours claims is leaked.
const CGROUP_SWEEP_AGE: Duration = Duration::from_secs(60);

/// Every second: drops pooled children that died while parked, and ends
/// sandboxes whose QEMU exited (destroyed) or whose TTL passed (destroyed,
/// or, when a workspace keeps them, paused or killed with it:
/// `workspace::paused::end`). Every minute: removes leaked empty cgroups.
///
/// One loop, one set of sandboxes being ended: a sandbox is never ended
/// twice at once, whichever way it ends.
pub(crate) async fn reaper_loop(n: Arc<Node>) {
    let ending = Arc::new(std::sync::Mutex::new(
        std::collections::HashSet::<String>::new(),
    ));
    let mut tick = 0u64;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        tick += 1;
        if tick.is_multiple_of(60) {
            sweep_cgroups(&n).await;
        }
        let dead = n.pools.remove_dead();
        if !dead.is_empty() {
            tracing::warn!(
                "{} pooled children died while parked; refilling",
                dead.len()
            );
            discard_pooled(&n, dead);
            n.refill_wake.notify_one();
        }
        let now = unix_now();
        for sb in n.sandboxes.all() {
            let r = sb.record();
            rotate_console(&sb.console());
            let Some(end) = Ending::of(r.expires_at_unix, !sb.is_alive(), now, || kept(&n, &r))
            else {
                continue;
            };
            if !ending.lock().unwrap().insert(r.id.clone()) {
                continue;
            }
            // Each on its own task: one end that waits (a branch in
            // progress holds the VM lock until its QMP calls time out)
            // must not hold up every other.
            let (n, ending) = (n.clone(), ending.clone());
            tokio::spawn(async move {
                match end {
                    Ending::Destroy(why) => {
                        tracing::info!("sandbox {}: {why}", r.id);
                        destroy(&n, &r.id).await;
                    }
                    Ending::Kept => crate::workspace::paused::end(&n, &r).await,
                }
                ending.lock().unwrap().remove(&r.id);
            });
        }
    }
}

/// How the reaper ends a sandbox.
#[derive(Debug, PartialEq)]
enum Ending {
    /// Destroyed, for this reason.
    Destroy(&'static str),
    /// Its TTL passed and a workspace keeps it: paused or killed with it.
    Kept,
}

impl Ending {
    /// How a sandbox ends at `now`, if it does, given its TTL
    /// (`expires_at_unix`, 0: none) and whether its QEMU is `dead`: a dead
    /// one is destroyed whatever keeps it; a passed TTL ends it as `kept`
    /// ([`kept`]) says.
    fn of(
        expires_at_unix: u64,
        dead: bool,
        now: u64,
        kept: impl FnOnce() -> bool,
    ) -> Option<Ending> {
        let expired = expires_at_unix != 0 && expires_at_unix <= now;
        if dead {
            Some(Ending::Destroy(if expired {
                "TTL expired"
            } else {
                "QEMU exited"
            }))
        } else if !expired {
            None
        } else if kept() {
            Some(Ending::Kept)
        } else {
            Some(Ending::Destroy("TTL expired"))
        }
    }
}

/// Removes empty cgroups older than [`CGROUP_SWEEP_AGE`] that no live
/// sandbox or pooled child of this node claims (`Hierarchy::sweep_empty`):
/// a removal that gave up on a slow QEMU leaves one otherwise.
async fn sweep_cgroups(n: &Arc<Node>) {
    let Some(h) = n.cgroups.clone() else { return };
    let mut ours: std::collections::HashSet<String> = n
        .sandboxes
        .all()
        .iter()
        .map(|s| s.id().to_string())
        .collect();
    ours.extend(n.pools.vm_ids());
    let swept = tokio::task::spawn_blocking(move || {
        h.sweep_empty(CGROUP_SWEEP_AGE, |id| ours.contains(id))
    })
    .await
    .unwrap_or_default();
    if !swept.is_empty() {
        tracing::info!("removed {} leaked empty cgroups: {swept:?}", swept.len());
    }
}

/// Whether `r` is a paused sandbox's (its workspace keeps it) or pauses
/// at its TTL: `workspace::paused::end` ends those at their TTL.
pub(crate) fn kept(n: &Node, r: &SandboxRecord) -> bool {
    r.auto_pause
        || r.workspace.is_some()
            && n.state
                .read(|s| s.workspaces.get(&r.id).is_some_and(|w| w.keeps(&r.id)))
}

/// A console log is cut when it passes this size.
const CONSOLE_MAX_BYTES: u64 = 16 << 20;

/// Keeps a guest that floods its console from filling the disk: past
/// [`CONSOLE_MAX_BYTES`] the last MiB goes to `console.log.1` and the log
/// starts over (QEMU appends, so it keeps writing at the new end).
fn rotate_console(path: &std::path::Path) {
    let Ok(m) = std::fs::metadata(path) else {
        return;
    };
    if m.len() <= CONSOLE_MAX_BYTES {
        return;
    }
    use std::io::{Read, Seek, SeekFrom};
    let keep = 1u64 << 20;
    let mut tail = Vec::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = f.seek(SeekFrom::Start(m.len() - keep));
        let _ = f.take(keep).read_to_end(&mut tail);
    }
    let _ = forkd_vmm::private::write(&path.with_extension("log.1"), &tail);
    if let Ok(f) = std::fs::OpenOptions::new().write(true).open(path) {
        let _ = f.set_len(0);
    }
}

#[cfg(test)]
mod tests {
    use super::Ending;

    #[test]
    fn a_dead_qemu_is_destroyed_and_a_passed_ttl_ends_as_kept_says() {
        let kept = || true;
        let free = || false;
        // Alive, no TTL or a TTL to come: nothing.
        assert_eq!(Ending::of(0, false, 100, kept), None);
        assert_eq!(Ending::of(101, false, 100, free), None);
        // A passed TTL: paused or killed with its workspace when kept.
        assert_eq!(Ending::of(100, false, 100, kept), Some(Ending::Kept));
        assert_eq!(
            Ending::of(99, false, 100, free),
            Some(Ending::Destroy("TTL expired"))
        );
        // A dead QEMU: destroyed, kept or not, never paused.
        assert_eq!(
            Ending::of(0, true, 100, kept),
            Some(Ending::Destroy("QEMU exited"))
        );
        assert_eq!(
            Ending::of(99, true, 100, kept),
            Some(Ending::Destroy("TTL expired"))
        );
    }
}
