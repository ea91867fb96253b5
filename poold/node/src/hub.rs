//! The node's hub, when it has one (docs/cluster.md, "Snapshots
//! everywhere"): where a tag this node lacks comes from, and where the
//! snapshots it makes go, so a tag made on one node spawns on every node.
//!
//! The node core knows no hub protocol: poold hands it a [`SnapshotHub`]
//! (forkd-hub's transfers behind poold's `[hub]` config) and the node
//! calls it at three points:
//! - a spawn or a pool of a tag the store lacks: [`ensure_local`] fetches
//!   it first (lazily, in `pull = "lazy"` mode: kilobytes), one fetch at a
//!   time, so concurrent spawns of a new tag pull it once;
//! - a snapshot created, branched into or compacted into here:
//!   [`publish`] pushes it in the background (the operation has answered;
//!   a failed push is logged and counted, and `forkd push` repeats it);
//! - a snapshot deleted here: [`unpublish`] deletes the hub's tag if it
//!   still names that snapshot, leaving a tombstone naming it;
//! - at attach and every [`RECONCILE_EVERY`]: [`reconcile`] deletes here
//!   the tags whose tombstones name the very snapshot they name here (a
//!   delete this node missed, down or partitioned). A local-only snapshot,
//!   or a tag published again since, is never named so.
//!
//! Hub credentials stay in poold's (and forkd-fs's) environment; no guest
//! sees them.

use crate::error::{check_tag, Error, Kind, Result};
use crate::node::Node;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// A boxed future of a hub call.
pub type HubFuture<'a, T> = Pin<Box<dyn Future<Output = anyhow::Result<T>> + Send + 'a>>;

/// What the node asks of its hub. Implementations do blocking transfers on
/// threads of their own.
pub trait SnapshotHub: Send + Sync + 'static {
    /// The hub, for logs and `/version` (no credentials).
    fn describe(&self) -> String;
    /// Whether a spawn or pool of a tag the node lacks fetches it.
    fn on_demand(&self) -> bool;
    /// Whether snapshots made here are pushed.
    fn pushes(&self) -> bool;
    /// Makes `tag` local (at least its records) if the hub has it:
    /// `Ok(false)` when the hub has no such tag.
    fn fetch(&self, tag: String) -> HubFuture<'_, bool>;
    /// Pushes local snapshot `tag` under the same tag.
    fn push(&self, tag: String) -> HubFuture<'_, ()>;
    /// Deletes the hub's `tag` if it names snapshot `id`, leaving a
    /// tombstone that names `id`.
    fn unpublish(&self, tag: String, id: forkd_layers::SnapshotId) -> HubFuture<'_, bool>;
    /// Which of `local` (tag, snapshot id here) the hub's tombstones say
    /// were deleted elsewhere.
    fn deleted(
        &self,
        local: Vec<(String, forkd_layers::SnapshotId)>,
    ) -> HubFuture<'_, Vec<(String, forkd_layers::SnapshotId)>>;
}

/// When the node's hub fetches on demand and `tag` is not in the store,
/// pulls it. [`Error::NotFound`] when neither has it; [`Error::Unavailable`]
/// when the hub cannot be asked (saying so, and what to do). Without such
/// a hub it does nothing: the caller's lookup reports a missing tag.
pub(crate) async fn ensure_local(n: &Arc<Node>, tag: &str) -> Result<()> {
    // Without a hub the operation's own lookup gives the 404; with one, a
    // ready pool child proves the tag without a store read (a pool hit
    // stays a few milliseconds).
    let Some(hub) = n.hub().filter(|h| h.on_demand()) else {
        return Ok(());
    };
    check_tag(tag)?;
    if n.pools.status_of(tag).ready > 0 || crate::snapshots::tag_exists(n, tag).await? {
        return Ok(());
    }
    // One fetch at a time: a burst of spawns of a new tag pulls it once
    // (each waiter finds it local after the first).
    let _one = n.hub_fetch.lock().await;
    if crate::snapshots::tag_exists(n, tag).await? {
        return Ok(());
    }
    let t0 = std::time::Instant::now();
    match hub.fetch(tag.to_string()).await {
        Ok(true) => {
            tracing::info!(
                tag,
                hub = %hub.describe(),
                ms = t0.elapsed().as_millis() as u64,
                "pulled a tag this node lacked"
            );
            Ok(())
        }
        Ok(false) => Err(Error::not_found(Kind::Snapshot, tag)),
        Err(e) => Err(Error::Unavailable(format!(
            "snapshot {tag:?} is not on this node and pulling it from hub {} failed: {e:#}; check the hub and its credentials, or pull it by hand (forkd pull)",
            hub.describe()
        ))),
    }
}

/// Pushes `tag` to the node's hub in the background, when it pushes.
pub(crate) fn publish(n: &Arc<Node>, tag: &str) {
    let Some(hub) = n.hub().filter(|h| h.pushes()) else {
        return;
    };
    let (n, tag) = (n.clone(), tag.to_string());
    tokio::spawn(async move {
        let t0 = std::time::Instant::now();
        let outcome = match hub.push(tag.clone()).await {
            Ok(()) => {
                tracing::info!(tag, hub = %hub.describe(), ms = t0.elapsed().as_millis() as u64, "pushed");
                "ok"
            }
            Err(e) => {
                tracing::warn!(
                    "pushing snapshot {tag:?} to hub {} failed: {e:#}; other nodes cannot spawn it until it is pushed (forkd push {tag} HUB)",
                    hub.describe()
                );
                "error"
            }
        };
        n.metrics.hub_pushes.with_label_values(&[outcome]).inc();
    });
}

/// Deletes the hub's `tag` if it still names `id`, when the node pushes.
/// The delete has happened here: a hub that fails is logged, not undone.
pub(crate) async fn unpublish(n: &Arc<Node>, tag: &str, id: forkd_layers::SnapshotId) {
    let Some(hub) = n.hub().filter(|h| h.pushes()) else {
        return;
    };
    match hub.unpublish(tag.to_string(), id).await {
        Ok(true) => tracing::info!(tag, hub = %hub.describe(), "deleted the hub's tag"),
        Ok(false) => {}
        Err(e) => tracing::warn!(
            "deleting tag {tag:?} on hub {} failed: {e:#}; other nodes may still pull it",
            hub.describe()
        ),
    }
}

/// How often a node with a pushing hub looks for deletes it missed.
pub const RECONCILE_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Deletes the local snapshots the hub's tombstones say were deleted
/// elsewhere (when the node pushes: a hub it only pulls from says nothing
/// of its deletes). A delete refused (a live child, a dependent) is logged
/// and tried again next time; a live child is checked before any pool is
/// touched, so a kept snapshot keeps its warm pool.
pub(crate) async fn reconcile(n: &Arc<Node>) {
    let Some(hub) = n.hub().filter(|h| h.pushes()) else {
        return;
    };
    let local = match crate::snapshots::tags(n).await {
        Ok(l) => l,
        Err(e) => return tracing::warn!("listing snapshots for the hub's tombstones: {e}"),
    };
    let gone = match hub.deleted(local).await {
        Ok(g) => g,
        Err(e) => {
            return tracing::warn!(
                "reading tombstones from hub {} failed: {e:#}; trying again in {}s",
                hub.describe(),
                RECONCILE_EVERY.as_secs()
            )
        }
    };
    for (tag, id) in gone {
        // By id: a tag moved here since it was read keeps its new snapshot.
        // Not unpublished: the hub's tag is gone or names another snapshot.
        match crate::snapshots::delete_exact(n, id).await {
            Ok(true) => tracing::info!(tag, %id, hub = %hub.describe(), "deleted a snapshot deleted elsewhere in the cluster"),
            Ok(false) => {}
            Err(e) => tracing::warn!(
                "snapshot {id} (tag {tag:?}) was deleted elsewhere in the cluster, but not here yet: {e}; trying again in {}s",
                RECONCILE_EVERY.as_secs()
            ),
        }
    }
}

/// [`reconcile`] now (a node back from being down) and every
/// [`RECONCILE_EVERY`] (one that was only cut off).
pub(crate) async fn reconcile_loop(n: Arc<Node>) {
    loop {
        reconcile(&n).await;
        tokio::time::sleep(RECONCILE_EVERY).await;
    }
}
