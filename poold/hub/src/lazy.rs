//! Lazy snapshots from the caller's side: what the CLI and poold call, each
//! in a line or two (docs/hub.md, "Lazy pulls").
//!
//! - [`HubConfig`]: a `[hub]` section for poold's config (`url`,
//!   `token_file`, `pull = "full" | "lazy"`, `tags`), and
//!   [`pull_configured`], which pulls those tags at start;
//! - [`start_filling`]: after a lazy pull, make sure forkd-fs runs on the
//!   data dir (it fetches what reads need and fills the rest);
//! - the read side (how much is local, whether a pool may refill) is the
//!   layer store's (`StoreView::residency`, `StoreView::working_set_local`)
//!   and forkd-fs's, which poold's refills ask (`Source::working_set_local`).

use crate::transfer::{pull, PullOptions, TransferReport};
use anyhow::{Context, Result};
use forkd_remote::{read_token, Hub};
use forkd_snapshot::Paths;
use serde::Deserialize;
use std::path::PathBuf;

/// How a pull moves chunks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
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
/// ```
#[derive(Debug, Clone, Deserialize)]
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
}

/// Pulls every tag of `cfg` into the data dir at `paths`, moving a local
/// tag that points elsewhere; one result per tag. Blocking (it takes the
/// store's write turn for each pull and runs it on this thread): call it
/// from `spawn_blocking`. A lazy pull returns once records and manifests
/// are in; forkd-fs (started here if needed) fills the rest.
pub fn pull_configured(paths: &Paths, cfg: &HubConfig) -> Vec<(String, Result<TransferReport>)> {
    let hub = match read_token(cfg.token_file.as_ref())
        .and_then(|t| Hub::open(&cfg.url, t))
        .with_context(|| format!("opening hub {}", cfg.url))
    {
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
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime for the pull")?;
    rt.block_on(pull(store.shared(), hub, tag, opts))
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
        assert!(toml::from_str::<HubConfig>(
            r#"url = "x"
pull = "sometimes""#
        )
        .is_err());
    }
}
