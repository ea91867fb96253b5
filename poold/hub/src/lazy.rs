//! Lazy snapshots from the caller's side: what the CLI and poold call, each
//! in a line or two (docs/hub.md, "Lazy pulls").
//!
//! - [`HubConfig`]: a `[hub]` section for poold's config (`url`,
//!   `token_file`, `pull = "full" | "lazy"`, `tags`, `push`, `on_demand`),
//!   [`pull_configured`], which pulls those tags at start, and the calls a
//!   node makes of its hub while it runs: [`fetch_tag`] (a tag it lacks),
//!   [`push_tag`] (a snapshot it made) and [`unpublish_tag`] (one it
//!   deleted);
//! - [`start_filling`]: after a lazy pull, make sure forkd-fs runs on the
//!   data dir (it fetches what reads need and fills the rest);
//! - the read side (how much is local, whether a pool may refill) is the
//!   layer store's (`StoreView::residency`, `StoreView::working_set_local`)
//!   and forkd-fs's, which poold's refills ask (`Source::working_set_local`).

use crate::transfer::{pull, PullOptions, TransferReport};
use anyhow::{Context, Result};
use forkd_remote::layout::TagObject;
use forkd_remote::{read_token, Hub};
use forkd_snapshot::Paths;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// How a pull moves chunks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PullMode {
    /// Every chunk before the pull returns.
    #[default]
    Full,
    /// Records and manifests only; forkd-fs fetches chunks on demand and
    /// fills the rest in the background.
    Lazy,
}

/// A hub to pull snapshots from at start: poold's `[hub]` section.
///
/// ```toml
/// [hub]
/// url = "s3://bucket/forkd"      # or http(s)://..., file:///...
/// token_file = "/etc/forkd/hub-token"   # HTTP hubs; S3 uses AWS_* from poold's environment
/// pull = "lazy"                  # or "full" (default)
/// tags = ["py", "node"]
/// push = true                    # snapshots made here are pushed (cluster-wide tags)
/// on_demand = true               # a spawn or pool of a tag this node lacks pulls it (default)
/// ```
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HubConfig {
    /// The hub URL.
    pub url: String,
    /// Bearer token file of an HTTP hub (default: `$FORKD_HUB_TOKEN`).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// `full` (default) or `lazy`.
    #[serde(default)]
    pub pull: PullMode,
    /// Tags to pull at start (each also names the local tag).
    #[serde(default)]
    pub tags: Vec<String>,
    /// Refuse snapshots whose QEMU or machine differs from this host.
    #[serde(default)]
    pub strict: bool,
    /// Push every snapshot this node creates, branches or compacts, under
    /// its tag, and delete the hub's tag when the node deletes the
    /// snapshot it points at: tags become cluster-wide (docs/cluster.md).
    #[serde(default)]
    pub push: bool,
    /// A spawn or pool of a tag this node lacks pulls it from the hub first
    /// (in `pull` mode). Default on.
    #[serde(default = "yes")]
    pub on_demand: bool,
}

fn yes() -> bool {
    true
}

impl HubConfig {
    /// The hub, opened with the configured token. Each operation opens its
    /// own: a client's pooled connections belong to the runtime that made
    /// them, and every operation here runs on a runtime of its own.
    fn open(&self) -> Result<Hub> {
        read_token(self.token_file.as_ref())
            .and_then(|t| Hub::open(&self.url, t))
            .with_context(|| format!("opening hub {}", self.url))
    }
}

/// A current-thread runtime for one transfer on a blocking thread.
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime for a hub transfer")
}

/// Pulls `tag` from the hub of `cfg` into the data dir at `paths` when the
/// hub has it (lazily in `lazy` mode, then forkd-fs fills it); `Ok(None)`
/// when the hub has no such tag. Blocking, like [`pull_configured`].
pub fn fetch_tag(paths: &Paths, cfg: &HubConfig, tag: &str) -> Result<Option<TransferReport>> {
    let hub = cfg.open()?;
    let key = forkd_remote::Key::tag(tag)?;
    let rt = runtime()?;
    if rt.block_on(hub.get(&key))?.is_none() {
        return Ok(None);
    }
    let opts = PullOptions {
        strict: cfg.strict,
        quiet: true,
        lazy: cfg.pull == PullMode::Lazy,
        ..Default::default()
    };
    let store = forkd_snapshot::store::open_rw(paths)?;
    // forkd-fs (re)starts, if it must, beside the pull's requests.
    let mount = opts.lazy.then(|| {
        let p = paths.clone();
        std::thread::spawn(move || forkd_snapshot::ensure_mount(&p))
    });
    let pulled = rt.block_on(pull(store.shared(), &hub, tag, &opts));
    // The store's write turn is not held while the mount finishes.
    drop(store);
    let mounted = match mount {
        Some(m) => m
            .join()
            .map_err(|_| anyhow::anyhow!("the mount thread panicked"))?
            .map(drop),
        None => Ok(()),
    };
    // A failed pull is the error to report, whatever the mount did.
    let r = pulled?;
    mounted?;
    // The mount must see the new tag before the caller restores from it; a
    // lazy snapshot's working set starts arriving now too.
    start_filling(paths, opts.lazy.then_some(r.snapshot))?;
    Ok(Some(r))
}

/// Pushes local snapshot `tag` to the hub of `cfg` under the same tag
/// (only the chunks the hub lacks). Blocking. It reads through a view of
/// its own and takes no turn to write the store: snapshots, pulls and GC
/// go on while a push crosses a slow link.
pub fn push_tag(paths: &Paths, cfg: &HubConfig, tag: &str) -> Result<TransferReport> {
    // One push at a time in this process, as when pushes took the write
    // turn: in order, and one read view at a time.
    static PUSHES: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = PUSHES.lock().unwrap_or_else(|p| p.into_inner());
    let hub = cfg.open()?;
    let rt = runtime()?;
    let view = forkd_snapshot::store::open_view(paths)?;
    let opts = crate::transfer::PushOptions {
        quiet: true,
        ..Default::default()
    };
    rt.block_on(crate::transfer::push(view.view(), tag, &hub, &opts))
}

/// Deletes the hub's tag `tag` if it still names snapshot `id` (a tag
/// another node moved since is left alone); the snapshot's objects stay
/// for the hub's own GC. Its tombstone (`deleted/<tag>` naming `id`) is
/// written first, so a node that missed the delete drops its copy
/// ([`deleted_tags`]) even if this stops between the two. Whether it
/// deleted. Blocking.
pub fn unpublish_tag(cfg: &HubConfig, tag: &str, id: forkd_layers::SnapshotId) -> Result<bool> {
    let hub = cfg.open()?;
    let rt = runtime()?;
    // Not between a push's check of its tag and its publication.
    let _turn = rt.block_on(crate::transfer::PUBLISH_TURN.lock());
    let key = forkd_remote::Key::tag(tag)?;
    let Some(bytes) = rt.block_on(hub.get(&key))? else {
        return Ok(false);
    };
    if TagObject::decode(tag, &bytes)?.snapshot != id {
        return Ok(false);
    }
    let tombstone = TagObject { snapshot: id }.encode();
    rt.block_on(hub.put(&forkd_remote::Key::deleted(tag)?, tombstone))?;
    rt.block_on(hub.flush())?;
    rt.block_on(hub.delete(&key))?;
    Ok(true)
}

/// Which of `local` (tag, the snapshot it names here) were deleted on the
/// hub: the hub's tombstone of the tag names that very snapshot and its
/// tag does not (a tag published again, or moved, is not deleted). A
/// tag the hub never had is not either; one whose objects cannot be read
/// is logged and left for the next check. Blocking.
pub fn deleted_tags(
    cfg: &HubConfig,
    local: &[(String, forkd_layers::SnapshotId)],
) -> Result<Vec<(String, forkd_layers::SnapshotId)>> {
    let hub = cfg.open()?;
    let rt = runtime()?;
    let names = |key: forkd_remote::Key, tag: &str| -> Result<Option<forkd_layers::SnapshotId>> {
        Ok(match rt.block_on(hub.get(&key))? {
            Some(b) => Some(TagObject::decode(tag, &b)?.snapshot),
            None => None,
        })
    };
    let mut out = Vec::new();
    for (tag, id) in local {
        let gone = names(forkd_remote::Key::deleted(tag)?, tag).and_then(|t| {
            Ok(t == Some(*id) && names(forkd_remote::Key::tag(tag)?, tag)? != Some(*id))
        });
        match gone {
            Ok(true) => out.push((tag.clone(), *id)),
            Ok(false) => {}
            Err(e) => tracing::warn!("checking tag {tag:?} against hub {}: {e:#}", cfg.url),
        }
    }
    Ok(out)
}

/// Pulls every tag of `cfg` into the data dir at `paths`, moving a local
/// tag that points elsewhere; one result per tag. Blocking (it takes the
/// store's write turn for each pull and runs it on this thread): call it
/// from `spawn_blocking`. A lazy pull returns once records and manifests
/// are in; forkd-fs (started here if needed) fills the rest.
pub fn pull_configured(paths: &Paths, cfg: &HubConfig) -> Vec<(String, Result<TransferReport>)> {
    let hub = match cfg.open() {
        Ok(h) => h,
        Err(e) => {
            let msg = format!("{e:#}");
            return cfg
                .tags
                .iter()
                .map(|t| (t.clone(), Err(anyhow::anyhow!("{msg}"))))
                .collect();
        }
    };
    let mut out = Vec::new();
    for tag in &cfg.tags {
        let opts = PullOptions {
            force: true,
            strict: cfg.strict,
            quiet: true,
            lazy: cfg.pull == PullMode::Lazy,
            ..Default::default()
        };
        let r = pull_one(paths, &hub, tag, &opts);
        out.push((tag.clone(), r));
    }
    if cfg.pull == PullMode::Lazy && out.iter().any(|(_, r)| r.is_ok()) {
        if let Err(e) = start_filling(paths, None) {
            tracing::warn!("lazy pulls from {}: {e:#}", cfg.url);
        }
    }
    out
}

fn pull_one(paths: &Paths, hub: &Hub, tag: &str, opts: &PullOptions) -> Result<TransferReport> {
    let store = forkd_snapshot::store::open_rw(paths)?;
    runtime()?.block_on(pull(store.shared(), hub, tag, opts))
}

/// Makes sure forkd-fs serves the data dir, and sees the store's latest
/// commits: it fetches chunks of lazy snapshots when reads need them and
/// fills the rest in the background (docs/fs.md, "Lazy snapshots"). With
/// `head`, the working-set prefetch of that snapshot starts now (a child
/// usually follows a pull; its restore then finds the first chunks here or
/// on the way). Blocking.
pub fn start_filling(paths: &Paths, head: Option<forkd_layers::SnapshotId>) -> Result<()> {
    let cfg = forkd_snapshot::ensure_mount(paths)?;
    let mut c = forkd_fs::Client::connect(&cfg.control())?;
    c.refresh()?;
    if let Some(id) = head {
        // A hub that does not answer now is the next spawn's error to give.
        if let Err(e) = c.remote_ready(&id, std::time::Duration::ZERO) {
            tracing::warn!("prefetching the working set of {id}: {e:#}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deleted_tag_leaves_a_tombstone_naming_exactly_its_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let cfg: HubConfig =
            toml::from_str(&format!("url = \"file://{}\"", dir.path().display())).unwrap();
        let (hub, rt) = (cfg.open().unwrap(), runtime().unwrap());
        let (a, b) = (
            forkd_layers::SnapshotId::random(),
            forkd_layers::SnapshotId::random(),
        );
        let publish = |id| {
            let key = forkd_remote::Key::tag("t").unwrap();
            rt.block_on(hub.put(&key, TagObject { snapshot: id }.encode()))
                .unwrap()
        };
        publish(a);
        // A tag that names another snapshot is left alone.
        assert!(!unpublish_tag(&cfg, "t", b).unwrap());
        assert!(deleted_tags(&cfg, &[("t".into(), a)]).unwrap().is_empty());
        assert!(unpublish_tag(&cfg, "t", a).unwrap());
        let local = [
            ("t".to_string(), a),
            ("t".to_string(), b),
            ("never".to_string(), a),
        ];
        assert_eq!(deleted_tags(&cfg, &local).unwrap(), [("t".to_string(), a)]);
        // Published again: not deleted any more.
        publish(a);
        assert!(deleted_tags(&cfg, &[("t".into(), a)]).unwrap().is_empty());
    }

    /// A push reads through a view of its own: it neither waits for this
    /// process's writer (the old code took the write turn, so a push
    /// started during a long snapshot create waited for it, and blocked
    /// every create for its whole transfer), nor leaves its view behind.
    #[test]
    fn a_push_takes_no_turn_to_write_the_store() {
        let home = tempfile::tempdir().unwrap();
        let hub_dir = tempfile::tempdir().unwrap();
        let paths = Paths::new(home.path());
        let cfg: HubConfig =
            toml::from_str(&format!("url = \"file://{}\"", hub_dir.path().display())).unwrap();
        {
            let store = forkd_snapshot::store::open_rw(&paths).unwrap();
            let data = vec![7u8; 300_000];
            let ing = store
                .ingest_reader(&data[..], &forkd_layers::IngestOptions::default())
                .unwrap();
            let mut files = std::collections::BTreeMap::new();
            files.insert("memory.bin".to_string(), ing.file_ref());
            store
                .commit_snapshot(forkd_layers::NewSnapshot {
                    files,
                    tag: Some("t".into()),
                    ..Default::default()
                })
                .unwrap();
        }
        // This process's writer holds its turn throughout the push.
        let turn = forkd_snapshot::store::open_rw(&paths).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (p2, c2) = (paths.clone(), cfg.clone());
        std::thread::spawn(move || {
            let _ = tx.send(push_tag(&p2, &c2, "t").map(|r| r.snapshot));
        });
        let pushed = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the push waited for the write turn")
            .unwrap();
        assert_eq!(Some(pushed), turn.resolve("t").unwrap().map(|r| r.id));
        drop(turn);
        let hub = cfg.open().unwrap();
        let tag = runtime()
            .unwrap()
            .block_on(hub.get(&forkd_remote::Key::tag("t").unwrap()))
            .unwrap()
            .expect("the tag is on the hub");
        assert_eq!(TagObject::decode("t", &tag).unwrap().snapshot, pushed);
        let left: Vec<_> = std::fs::read_dir(paths.staging_dir())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "the push's view stayed: {left:?}");
    }

    #[test]
    fn config_parses() {
        let c: HubConfig = toml::from_str(
            r#"url = "s3://b/p"
pull = "lazy"
tags = ["py"]"#,
        )
        .unwrap();
        assert_eq!(c.pull, PullMode::Lazy);
        assert_eq!(c.tags, ["py"]);
        let c: HubConfig = toml::from_str(r#"url = "file:///h""#).unwrap();
        assert_eq!(c.pull, PullMode::Full);
        assert!(
            !c.push && c.on_demand,
            "push is asked for; on_demand is the default"
        );
        assert!(toml::from_str::<HubConfig>(
            r#"url = "x"
pull = "sometimes""#
        )
        .is_err());
    }
}
