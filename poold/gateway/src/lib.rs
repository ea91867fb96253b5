//! forkd-gateway: one endpoint in front of many poold nodes (docs/cluster.md).
//!
//! Clients (the forkd SDK, the `forkd` CLI with `FORKD_URL`, `forkd mcp`)
//! talk to the gateway exactly as to one poold's `/v1`. The gateway places
//! spawns where warm pools are ([`place`]), sends every per-sandbox call to
//! the node that holds the sandbox, and merges lists.
//!
//! ```text
//!  clients ──► gateway replica ─┬─► poold node a   (pools, sandboxes, forkd-fs)
//!              gateway replica ─┼─► poold node b
//!                (stateless)    └─► poold node c
//! ```
//!
//! Invariants:
//! - **Stateless.** Everything the gateway knows it learns from nodes: a
//!   health poll ([`nodes`]) and, for a sandbox it has not seen, asking every
//!   healthy node. A restarted or second replica routes exactly the same;
//!   the id cache only saves round trips.
//! - **A sandbox's calls go to its node, never elsewhere.** When that node
//!   is down the call fails with 410 naming the node; the gateway never
//!   guesses another node.
//! - **Bodies stream.** Per-sandbox requests and responses (exec streams,
//!   file transfers, logs) pass through chunk by chunk; only the bounded
//!   JSON of spawns and lists is read whole.
//! - **One error mapping.** Errors the gateway makes itself are
//!   [`GatewayError`], turned into HTTP in one place; a node's own error
//!   reply passes through unchanged, with its status.
//! - **No partial spawns.** A spawn of `n` either returns `n` sandboxes or
//!   none: shares that fail are placed again on other nodes once, and if that
//!   fails too, the sandboxes already made are killed before the error.
//! - **Nothing made twice.** A share is placed again only when it never
//!   reached its node or the node answered that it did not make it; one
//!   whose connection broke after sending may have been made there, so it
//!   ends the spawn (`proxy::Making`).

pub mod cli;
pub mod config;
pub mod e2b;
mod error;
pub mod metrics;
pub mod nodes;
pub mod place;
mod proxy;

pub use config::{Config, NodeSource};
pub use error::GatewayError;
pub use nodes::{Health, NodeView, Registry};
pub use proxy::router;

use std::sync::Arc;

/// Runs the gateway on `listener` (TCP, HTTPS when it has a TLS config:
/// poold's listener code, `forkd_edge::listen`) until SIGINT/SIGTERM: the
/// health poll in the background, the router in the foreground.
pub async fn serve(
    config: Config,
    listener: forkd_edge::listen::Listener,
    e2b: Option<E2bListeners>,
) -> anyhow::Result<()> {
    let registry = Arc::new(Registry::new(&config)?);
    tokio::spawn(nodes::poll_forever(registry.clone()));
    registry.poll_once().await;
    let app = router(registry.clone(), config.token.clone());
    let Some(l) = e2b else {
        return listener.serve(app).await;
    };
    let front = e2b::E2bFront::new(
        registry,
        l.domain,
        config.token.clone(),
        config.node_e2b_key.clone(),
    );
    let shutdown = forkd_edge::listen::shutdown_signal;
    let no_delay = forkd_edge::listen::no_delay;
    let api = axum::serve(no_delay(l.api), e2b::control_routes(front.clone()))
        .with_graceful_shutdown(shutdown());
    let plane = axum::serve(no_delay(l.sandboxes), e2b::plane_routes(front))
        .with_graceful_shutdown(shutdown());
    tokio::try_join!(
        listener.serve(app),
        async { api.await.map_err(anyhow::Error::from) },
        async { plane.await.map_err(anyhow::Error::from) },
    )?;
    Ok(())
}

/// The E2B planes' listeners, bound (so their addresses can be printed
/// first) and the domain sandbox URLs are answered under.
pub struct E2bListeners {
    pub api: tokio::net::TcpListener,
    pub sandboxes: tokio::net::TcpListener,
    /// `<port>-<id>.<domain>` reaches the sandbox plane; by default
    /// `localhost:<its port>`.
    pub domain: String,
}
