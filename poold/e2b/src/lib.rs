//! forkd-e2b: the E2B API, served natively so the unmodified E2B SDK (`e2b`,
//! `e2b-code-interpreter`) runs against poold with `E2B_API_URL` and
//! `E2B_SANDBOX_URL` pointed at it (docs/e2b.md).
//!
//! Two listeners, bound by [`bind`] when `[e2b]` configures them and served
//! by [`Bound::serve`]; the node's errors become E2B's in one function,
//! [`error::from_node`]:
//! - the control plane ([`control`]): create (a template is a snapshot tag;
//!   a create is a pool hit when the pool has a child), kill, list, get,
//!   connect, set_timeout; `X-API-KEY` checked against the key file or
//!   poold's bearer token;
//! - the sandbox plane ([`sandbox`]): envd's Connect-RPC process service
//!   ([`process`]) and filesystem service plus `/files`, and the code
//!   interpreter's `/execute` ([`interpreter`]), routed by `E2b-Sandbox-Id`
//!   (else by the access token, or a signed URL's signature: [`signed`])
//!   and `E2b-Sandbox-Port`; pause and resume ([`pause`]) keep a
//!   sandbox's id and token.
//!
//! Invariants:
//! - every sandbox has its own random 128-bit access token, kept in the
//!   node's record with its metadata, create-time envs and template alias
//!   (`forkd_node::SandboxRecord`), so all of them survive a poold restart;
//!   tokens are compared in constant time, and a request without the right
//!   one gets 401 and learns nothing about other sandboxes;
//! - the node is reached only through its operations (`forkd_node::Node`);
//!   what lives here is what ends with the process: each sandbox's
//!   processes started through envd and its count of executions, dropped
//!   with the sandbox;
//! - what a client or guest can make poold hold is bounded: processes per
//!   sandbox ([`process::MAX_PROCESSES`]), output queued per subscriber,
//!   polled directory watchers and their queued events ([`watch`]),
//!   log entries per sandbox and sandboxes logged ([`logs`]), request
//!   bodies, metadata and env sizes (`forkd_node::limits`).

pub mod config;
pub mod connect;
pub mod control;
pub mod error;
pub mod guest;
mod guest_tls;
pub mod interpreter;
pub mod logs;
pub mod metrics;
pub mod network;
pub mod pause;
pub mod ports;
pub mod process;
pub mod sandbox;
pub mod signed;
pub mod snapshots;
pub mod state;
pub mod watch;

pub use config::E2bConfig;
pub use state::{E2b, E2bSandbox, Session, ENVD_PORT, ENVD_VERSION, INTERPRETER_PORT};

use anyhow::{Context, Result};
use forkd_edge::hosts::HostPolicy;
use forkd_edge::transfers::Transfers;
use forkd_node::Node;
use std::sync::Arc;

/// The E2B listeners, bound and not yet serving.
pub struct Bound {
    e: Arc<E2b>,
    control: tokio::net::TcpListener,
    plane: tokio::net::TcpListener,
}

/// Binds both E2B listeners when `[e2b]` configures them.
pub async fn bind(
    node: &Arc<Node>,
    cfg: &E2bConfig,
    token: Option<String>,
    hosts: HostPolicy,
    transfers: Arc<Transfers>,
) -> Result<Option<Bound>> {
    let Some((api, sbx)) = cfg.addrs()? else {
        return Ok(None);
    };
    let control = tokio::net::TcpListener::bind(api)
        .await
        .with_context(|| format!("binding the E2B API on {api}"))?;
    let plane = tokio::net::TcpListener::bind(sbx)
        .await
        .with_context(|| format!("binding the E2B sandbox plane on {sbx}"))?;
    let domain = cfg.domain(plane.local_addr()?.port())?;
    let e = E2b::new(node.clone(), cfg, token, hosts, transfers, domain)?;
    Ok(Some(Bound { e, control, plane }))
}

impl Bound {
    /// The line poold prints after its own: where each plane listens.
    pub fn banner(&self) -> String {
        let addr = |l: &tokio::net::TcpListener| {
            l.local_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string())
        };
        format!(
            "poold E2B API on http://{} sandboxes on http://{}",
            addr(&self.control),
            addr(&self.plane)
        )
    }

    /// Where the planes listen, for poold's `GET /version` (a gateway in
    /// front routes E2B clients by it).
    pub fn planes(&self) -> Result<forkd_api::E2bPlanes> {
        Ok(forkd_api::E2bPlanes {
            api_port: self.control.local_addr()?.port(),
            sandbox_port: self.plane.local_addr()?.port(),
            domain: self.e.domain.clone(),
        })
    }

    /// Serves both planes until SIGINT/SIGTERM.
    pub async fn serve(self) -> Result<()> {
        let policy = Arc::new(self.e.hosts.clone());
        let host_check = |r: axum::Router| {
            r.layer(axum::middleware::from_fn_with_state(
                policy.clone(),
                forkd_edge::hosts::check_host,
            ))
        };
        let control = host_check(control::routes(self.e.clone()));
        let plane = host_check(sandbox::routes(self.e.clone(), self.e.transfers.clone()));
        tracing::info!("{}", self.banner());
        let shutdown = forkd_edge::listen::shutdown_signal;
        let no_delay = forkd_edge::listen::no_delay;
        let a = axum::serve(no_delay(self.control), control).with_graceful_shutdown(shutdown());
        let b = axum::serve(no_delay(self.plane), plane).with_graceful_shutdown(shutdown());
        tokio::try_join!(async { a.await.context("serving the E2B API") }, async {
            b.await.context("serving the E2B sandbox plane")
        })?;
        Ok(())
    }
}
