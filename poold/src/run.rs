//! The composition: the node core (`forkd_node`) with its front-ends,
//! forkd's `/v1` REST API (`forkd_rest`) and the E2B API (`forkd_e2b`),
//! behind the shared HTTP edge (`forkd_edge`: listeners, TLS, bearer auth,
//! the Host check, audit, bounded transfers), plus the web console's static
//! pages (`forkd_console`), served beside `/v1`.

use crate::config::Config;
use anyhow::Result;
use forkd_edge::{audit, hosts, listen, tls, transfers};
use forkd_node::Node;
use forkd_snapshot::Paths;

/// Which `Host` values the REST listener answers: any on a unix socket (no
/// browser reaches it), else localhost, IPs and `allowed_hosts`.
fn host_policy(cfg: &Config) -> hosts::HostPolicy {
    if cfg.unix.is_some() {
        hosts::HostPolicy {
            any: true,
            ..Default::default()
        }
    } else {
        hosts::HostPolicy::tcp(&cfg.allowed_hosts)
    }
}

/// The bearer token, when `token_file` sets one; refuses a non-loopback
/// listener without one.
fn token(cfg: &Config) -> Result<Option<String>> {
    let token = match &cfg.token_file {
        Some(f) => {
            let t = forkd_hub::auth::read_token_file(f)?;
            forkd_hub::auth::check_token(&t)?;
            Some(t)
        }
        None => None,
    };
    cfg.e2b.validate(token.is_some())?;
    if token.is_none() && cfg.unix.is_none() && !cfg.bind_addr()?.ip().is_loopback() {
        anyhow::bail!(
            "refusing to listen on non-loopback address {} without a token: set token_file (--token-file) or bind 127.0.0.1",
            cfg.bind
        );
    }
    Ok(token)
}

/// Pulls `[hub]`'s `tags` (a hub that fails is logged, not fatal: the
/// node serves what it has) and attaches the hub, so tags this node lacks
/// are pulled on demand and the snapshots it makes are pushed.
async fn attach_hub(
    node: &std::sync::Arc<Node>,
    paths: &Paths,
    h: &forkd_hub::lazy::HubConfig,
) -> Result<()> {
    let (p, c) = (paths.clone(), h.clone());
    let pulled =
        tokio::task::spawn_blocking(move || forkd_hub::lazy::pull_configured(&p, &c)).await?;
    for (tag, r) in pulled {
        match r {
            Ok(r) => tracing::info!("pulled {tag} from {}: {}", h.url, r.summary()),
            Err(e) => tracing::warn!("pulling {tag} from {} at start failed: {e:#}", h.url),
        }
    }
    node.attach_hub(std::sync::Arc::new(crate::hub::PooldHub::new(
        paths.clone(),
        h.clone(),
    )))?;
    Ok(())
}

/// Runs poold until SIGINT/SIGTERM: opens the node (which re-adopts what
/// a previous poold left), binds the E2B listeners, starts the node's
/// background work, binds the `/v1` listener and prints where it listens
/// (its line first: scripts and tests read it), then serves. Sandboxes
/// keep running after it exits; the next start re-adopts them.
pub async fn run(paths: Paths, cfg: Config) -> Result<()> {
    cfg.validate()?;
    let token = token(&cfg)?;
    let audit_path = cfg
        .audit_log
        .clone()
        .unwrap_or_else(|| paths.poold_dir().join("audit.jsonl"));
    let node = Node::open(paths.clone(), cfg.node()).await?;
    if let Some(h) = &cfg.hub {
        attach_hub(&node, &paths, h).await?;
    }
    let audit = audit::Audit::new(audit::AuditLog::open(&audit_path)?, node.metrics_registry())?;
    let transfers = transfers::Transfers::new(cfg.transfer_concurrency);
    let e2b = forkd_e2b::bind(
        &node,
        &cfg.e2b,
        token.clone(),
        hosts::HostPolicy::tcp(&cfg.allowed_hosts),
        transfers.clone(),
    )
    .await?;
    node.start_background();
    let e2b_planes = e2b.as_ref().map(forkd_e2b::Bound::planes).transpose()?;
    let rest = forkd_rest::server::app(
        node,
        forkd_rest::server::Options {
            token,
            hosts: host_policy(&cfg),
            audit,
            transfers,
            pages: forkd_console::router(),
            e2b: e2b_planes,
        },
    );
    let listener = match &cfg.unix {
        Some(path) => listen::Listener::bind_unix(path)?,
        None => {
            // Certificate problems fail the start before the port is taken.
            let tls = match (&cfg.tls_cert, &cfg.tls_key) {
                (Some(c), Some(k)) => Some(tls::server_config(c, k)?),
                _ => None,
            };
            listen::Listener::bind_tcp(cfg.bind_addr()?, tls).await?
        }
    };
    let url = listener.url();
    tracing::info!("poold listening on {url}");
    println!("poold listening on {url}");
    if let Some(b) = &e2b {
        println!("{}", b.banner());
    }
    match e2b {
        Some(b) => tokio::try_join!(listener.serve(rest), b.serve()).map(|_| ()),
        None => listener.serve(rest).await,
    }
}
