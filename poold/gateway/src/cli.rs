//! The `forkd-gateway` command line: flags, token files, listeners.
//!
//! It lives in the library, and the binary only calls [`main`], so the
//! async server stack's generic code is compiled once, here, and not a
//! second time in the binary's crate (release builds share no generic
//! instantiations across crates).

use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;

use crate::config::{parse_discover, NodeAddr};
use crate::{Config, NodeSource};

#[derive(Parser)]
#[command(
    name = "forkd-gateway",
    about = "One forkd /v1 endpoint in front of many poold nodes"
)]
struct Args {
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:7080", env = "FORKD_GATEWAY_BIND")]
    bind: std::net::SocketAddr,
    /// A node, `NAME=URL` or `URL` (repeat for each node).
    #[arg(long = "node", conflicts_with = "discover")]
    nodes: Vec<String>,
    /// Discover nodes from every address of a DNS name, `HOST:PORT`
    /// (a Kubernetes headless Service), re-read at each poll.
    #[arg(long)]
    discover: Option<String>,
    /// With --discover: the nodes serve https.
    #[arg(long)]
    https: bool,
    /// File whose first line is the bearer token clients must send;
    /// required unless the bind address is loopback.
    #[arg(long, env = "FORKD_GATEWAY_TOKEN_FILE")]
    token_file: Option<std::path::PathBuf>,
    /// PEM certificate (chain) to serve HTTPS with; needs --tls-key.
    #[arg(long, env = "FORKD_GATEWAY_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "FORKD_GATEWAY_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// File whose first line is the bearer token of the nodes' poold.
    #[arg(long, env = "FORKD_NODE_TOKEN_FILE")]
    node_token_file: Option<std::path::PathBuf>,
    /// File whose first line is the key of the nodes' E2B planes (their
    /// `e2b.api_key_file`); without it the gateway sends each node its
    /// bearer token as the E2B key, in clear (the planes are plain HTTP).
    #[arg(long, env = "FORKD_NODE_E2B_KEY_FILE")]
    node_e2b_key_file: Option<std::path::PathBuf>,
    /// PEM file of the CA that signed the nodes' TLS certificates.
    #[arg(long, env = "FORKD_NODE_CA_CERT")]
    node_ca_cert: Option<std::path::PathBuf>,
    /// Serve the E2B control plane (`E2B_API_URL`) here; needs
    /// --e2b-sandbox-bind. Its API key is the gateway's token.
    #[arg(long, requires = "e2b_sandbox_bind")]
    e2b_bind: Option<std::net::SocketAddr>,
    /// Serve the E2B sandbox plane (`E2B_SANDBOX_URL`) here.
    #[arg(long, requires = "e2b_bind")]
    e2b_sandbox_bind: Option<std::net::SocketAddr>,
    /// The domain sandbox URLs (`<port>-<id>.<domain>`) live under: a
    /// wildcard DNS name pointing at the sandbox plane. Default:
    /// `localhost:<sandbox plane port>`.
    #[arg(long, requires = "e2b_bind")]
    e2b_sandbox_domain: Option<String>,
    /// Milliseconds between health polls of the nodes.
    #[arg(long, default_value_t = 1000)]
    poll_ms: u64,
    /// Milliseconds a node may take to answer a poll or accept a request.
    #[arg(long, default_value_t = 3000)]
    node_timeout_ms: u64,
}

fn read_token(path: &std::path::Path) -> anyhow::Result<String> {
    let t = forkd_hub::auth::read_token_file(path)?;
    forkd_hub::auth::check_token(&t).with_context(|| format!("the token in {}", path.display()))?;
    Ok(t)
}

/// Runs the gateway until it fails: what `forkd-gateway` does.
#[tokio::main]
pub async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FORKD_GATEWAY_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let source = match (&a.discover, a.nodes.is_empty()) {
        (Some(d), _) => parse_discover(d, a.https).map_err(anyhow::Error::msg)?,
        (None, false) => NodeSource::Static(
            a.nodes
                .iter()
                .map(|n| NodeAddr::parse(n))
                .collect::<Result<_, _>>()
                .map_err(anyhow::Error::msg)?,
        ),
        (None, true) => {
            bail!("no nodes: give --node NAME=URL for each poold, or --discover HOST:PORT")
        }
    };
    let token = a.token_file.as_deref().map(read_token).transpose()?;
    if token.is_none() && !a.bind.ip().is_loopback() {
        bail!(
            "--bind {} is not loopback: give --token-file so only your clients can spawn",
            a.bind
        );
    }
    let config = Config {
        source,
        token,
        node_token: a.node_token_file.as_deref().map(read_token).transpose()?,
        node_e2b_key: a.node_e2b_key_file.as_deref().map(read_token).transpose()?,
        node_ca_cert: a
            .node_ca_cert
            .as_deref()
            .map(|p| std::fs::read(p).with_context(|| format!("reading {}", p.display())))
            .transpose()?,
        poll_interval: Duration::from_millis(a.poll_ms.max(100)),
        node_timeout: Duration::from_millis(a.node_timeout_ms.max(100)),
    };
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Some(forkd_edge::tls::server_config(cert, key)?),
        _ => None,
    };
    if tls.is_none() && !a.bind.ip().is_loopback() {
        tracing::warn!(
            bind = %a.bind,
            "serving plain HTTP on a non-loopback address: the bearer token crosses the network in clear; give --tls-cert/--tls-key or terminate TLS in front"
        );
    }
    let listener = forkd_edge::listen::Listener::bind_tcp(a.bind, tls).await?;
    let e2b = bind_e2b(&a, config.token.is_some()).await?;
    // The lines tests and scripts wait for, as poold prints its own.
    println!("forkd-gateway listening on {}", listener.url());
    if let Some(l) = &e2b {
        println!(
            "forkd-gateway E2B API on http://{} sandboxes on http://{}",
            l.api.local_addr()?,
            l.sandboxes.local_addr()?
        );
    }
    crate::serve(config, listener, e2b).await
}

/// Binds the E2B planes when asked (plain HTTP, as poold's: a non-loopback
/// address needs the token that is their API key).
async fn bind_e2b(a: &Args, has_token: bool) -> anyhow::Result<Option<crate::E2bListeners>> {
    let (Some(api), Some(sbx)) = (a.e2b_bind, a.e2b_sandbox_bind) else {
        return Ok(None);
    };
    let loopback = api.ip().is_loopback() && sbx.ip().is_loopback();
    if !has_token && !loopback {
        bail!("--e2b-bind/--e2b-sandbox-bind are not loopback: give --token-file, which is the E2B API key");
    }
    let bind = |addr: std::net::SocketAddr, what: &'static str| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the E2B {what} on {addr}"))
    };
    let api = bind(api, "API").await?;
    let sandboxes = bind(sbx, "sandbox plane").await?;
    let domain = match &a.e2b_sandbox_domain {
        Some(d) => forkd_edge::hosts::sandbox_domain(d)
            .map_err(|e| anyhow::anyhow!("bad --e2b-sandbox-domain {e}"))?,
        None => format!("localhost:{}", sandboxes.local_addr()?.port()),
    };
    Ok(Some(crate::E2bListeners {
        api,
        sandboxes,
        domain,
    }))
}
