//! poold's `[hub]`: forkd-hub's transfers behind the node core's
//! [`SnapshotHub`] (docs/cluster.md, "Snapshots everywhere"). Every call
//! runs on a blocking thread with a runtime and a hub client of its own
//! (forkd-hub's `lazy` functions): transfers take the store's write turn,
//! which is a blocking lock.

use anyhow::Context;
use forkd_hub::lazy::{self, HubConfig};
use forkd_node::{HubFuture, SnapshotHub};
use forkd_snapshot::Paths;

/// The configured hub of one data dir.
pub struct PooldHub {
    paths: Paths,
    cfg: HubConfig,
}

impl PooldHub {
    pub fn new(paths: Paths, cfg: HubConfig) -> PooldHub {
        PooldHub { paths, cfg }
    }

    /// Runs `f` with the data dir and config on a blocking thread.
    fn blocking<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&Paths, &HubConfig) -> anyhow::Result<T> + Send + 'static,
    ) -> HubFuture<'_, T> {
        let (paths, cfg) = (self.paths.clone(), self.cfg.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || f(&paths, &cfg))
                .await
                .with_context(|| format!("the hub {what} task failed"))?
        })
    }
}

/// `url` without a `user:password@` part, for logs and `/version`.
fn without_userinfo(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            format!("{scheme}://{host}{path}")
        }
        None => url.to_string(),
    }
}

impl SnapshotHub for PooldHub {
    fn describe(&self) -> String {
        without_userinfo(&self.cfg.url)
    }

    fn on_demand(&self) -> bool {
        self.cfg.on_demand
    }

    fn pushes(&self) -> bool {
        self.cfg.push
    }

    fn fetch(&self, tag: String) -> HubFuture<'_, bool> {
        self.blocking("pull", move |p, c| {
            Ok(lazy::fetch_tag(p, c, &tag)?.is_some())
        })
    }

    fn push(&self, tag: String) -> HubFuture<'_, ()> {
        // Pushes run one at a time (`lazy::push_tag`); those waiting wait
        // here, not on a blocking thread restores need too.
        static QUEUE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let push = self.blocking("push", move |p, c| lazy::push_tag(p, c, &tag).map(|_| ()));
        Box::pin(async move {
            let _turn = QUEUE.lock().await;
            push.await
        })
    }

    fn unpublish(&self, tag: String, id: forkd_layers::SnapshotId) -> HubFuture<'_, bool> {
        self.blocking("tag delete", move |_, c| lazy::unpublish_tag(c, &tag, id))
    }

    fn deleted(
        &self,
        local: Vec<(String, forkd_layers::SnapshotId)>,
    ) -> HubFuture<'_, Vec<(String, forkd_layers::SnapshotId)>> {
        self.blocking("tombstone check", move |_, c| lazy::deleted_tags(c, &local))
    }
}

#[cfg(test)]
mod tests {
    use super::without_userinfo;

    #[test]
    fn a_hub_is_described_without_credentials() {
        assert_eq!(without_userinfo("s3://bucket/forkd"), "s3://bucket/forkd");
        assert_eq!(
            without_userinfo("https://u:secret@hub.example:443/x@y"),
            "https://hub.example:443/x@y"
        );
        assert_eq!(without_userinfo("file:///srv/hub"), "file:///srv/hub");
    }
}
