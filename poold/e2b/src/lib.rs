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
//!   (else by the access token) and `E2b-Sandbox-Port`.
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
//!   request bodies, metadata and env sizes (`forkd_node::limits`).

pub mod connect;
pub mod control;
pub mod error;
pub mod interpreter;
pub mod process;
pub mod sandbox;

use forkd_edge::hosts::HostPolicy;
use forkd_edge::transfers::Transfers;
use anyhow::{bail, Context, Result};
use forkd_node::{Node, SandboxRecord};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use subtle::ConstantTimeEq;

/// The envd version poold's sandbox plane claims: it gates SDK features,
/// and 0.5.7 is the highest whose features poold serves (octet-stream
/// uploads; no file metadata, which 0.6.2 would turn on).
pub const ENVD_VERSION: &str = "0.5.7";
/// envd's port, as the SDK names it in `E2b-Sandbox-Port`.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port.
pub const INTERPRETER_PORT: u16 = 49999;

/// `[e2b]`: where the E2B listeners bind and how API keys are checked.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct E2bConfig {
    /// The control plane (`E2B_API_URL`), e.g. `127.0.0.1:3000`; unset: off.
    pub bind: Option<String>,
    /// The sandbox plane (`E2B_SANDBOX_URL`), e.g. `127.0.0.1:3001`.
    pub sandbox_bind: Option<String>,
    /// A file holding the API key clients send as `X-API-KEY`; unset:
    /// poold's bearer token is the key (and without one, any key is taken,
    /// which only a loopback bind allows).
    pub api_key_file: Option<PathBuf>,
}

impl E2bConfig {
    /// Both addresses, parsed, when the E2B endpoints are on.
    pub fn addrs(&self) -> Result<Option<(SocketAddr, SocketAddr)>> {
        let parse = |what: &str, s: &str| -> Result<SocketAddr> {
            s.parse()
                .with_context(|| format!("bad e2b.{what} address {s:?} (want IP:PORT)"))
        };
        match (&self.bind, &self.sandbox_bind) {
            (None, None) => Ok(None),
            (Some(a), Some(b)) => Ok(Some((parse("bind", a)?, parse("sandbox_bind", b)?))),
            _ => bail!(
                "the E2B endpoints need both listeners: set e2b.bind and e2b.sandbox_bind (--e2b-bind, --e2b-sandbox-bind), or neither"
            ),
        }
    }

    /// Checks the addresses and that a non-loopback one has a key.
    pub fn validate(&self, has_token: bool) -> Result<()> {
        if let Some((a, b)) = self.addrs()? {
            let loopback = a.ip().is_loopback() && b.ip().is_loopback();
            if !loopback && self.api_key_file.is_none() && !has_token {
                bail!(
                    "refusing to serve the E2B API on a non-loopback address without an API key: set e2b.api_key_file (--e2b-api-key-file) or token_file"
                );
            }
        }
        Ok(())
    }
}

/// What the E2B front-end keeps of a sandbox in memory: what ends with
/// the process (its streamed processes' events cannot outlive the agent
/// channels of this poold).
#[derive(Default)]
pub struct Session {
    /// Its processes started through envd's process service.
    pub processes: process::Table,
    /// Code interpreter executions so far (`execution_count`).
    pub executions: AtomicU64,
}

/// A live sandbox as the E2B endpoints see it: the node's record and this
/// process's session of it.
pub struct E2bSandbox {
    /// The node's record (id, token, metadata, envs, template alias).
    pub rec: SandboxRecord,
    /// Its session.
    pub session: Arc<Session>,
}

impl E2bSandbox {
    /// Its id (also the E2B `sandboxID`).
    pub fn id(&self) -> &str {
        &self.rec.id
    }

    /// The template it was created from: its alias, else its snapshot tag.
    pub fn template(&self) -> &str {
        self.rec.alias.as_deref().unwrap_or(&self.rec.snapshot_tag)
    }
}

/// The E2B side of poold: the node, the API key and the sessions.
pub struct E2b {
    /// The node.
    pub node: Arc<Node>,
    /// The key `X-API-KEY` must match; None: any key.
    api_key: Option<String>,
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    /// Which `Host` values both listeners answer.
    hosts: HostPolicy,
    /// The large-request slots (shared with `/v1`).
    transfers: Arc<Transfers>,
}

impl E2b {
    /// The E2B side of `node`, reading the API key file if one is
    /// configured (else `token`, poold's bearer token, is the key).
    pub fn new(
        node: Arc<Node>,
        cfg: &E2bConfig,
        token: Option<String>,
        hosts: HostPolicy,
        transfers: Arc<Transfers>,
    ) -> Result<Arc<E2b>> {
        let api_key = match &cfg.api_key_file {
            Some(f) => {
                let k = forkd_hub::auth::read_token_file(f)?;
                forkd_hub::auth::check_token(&k).context("e2b.api_key_file")?;
                Some(k)
            }
            None => token,
        };
        Ok(Arc::new(E2b {
            node,
            api_key,
            sessions: RwLock::new(HashMap::new()),
            hosts,
            transfers,
        }))
    }

    /// Whether `got` (the `X-API-KEY` header) is the key.
    pub fn key_ok(&self, got: Option<&[u8]>) -> bool {
        match (&self.api_key, got) {
            (None, _) => true,
            (Some(want), Some(got)) => bool::from(want.as_bytes().ct_eq(got)),
            (Some(_), None) => false,
        }
    }

    /// The live sandbox `id`; None when there is no such sandbox.
    pub fn sandbox(&self, id: &str) -> Option<E2bSandbox> {
        match self.node.get(id) {
            Ok(rec) => Some(self.with_session(rec)),
            Err(_) => {
                self.forget(id);
                None
            }
        }
    }

    /// The sandbox whose token is `token` (every one compared in constant
    /// time, so timing tells nothing about which one matched).
    pub fn by_token(&self, token: &[u8]) -> Option<E2bSandbox> {
        self.node
            .find_by_token(token)
            .map(|rec| self.with_session(rec))
    }

    /// `rec` with its session, made when it has none yet. Sessions of
    /// sandboxes that are gone are dropped as new ones are made, so they
    /// never outnumber live sandboxes by more than those gone since.
    fn with_session(&self, rec: SandboxRecord) -> E2bSandbox {
        if let Some(s) = self.sessions.read().unwrap().get(&rec.id) {
            return E2bSandbox {
                session: s.clone(),
                rec,
            };
        }
        let mut m = self.sessions.write().unwrap();
        if !m.contains_key(&rec.id) {
            m.retain(|id, _| self.node.get(id).is_ok());
        }
        let session = m.entry(rec.id.clone()).or_default().clone();
        E2bSandbox { session, rec }
    }

    /// Forgets sandbox `id`'s session.
    pub fn forget(&self, id: &str) {
        self.sessions.write().unwrap().remove(id);
    }
}

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
    let e = E2b::new(node.clone(), cfg, token, hosts, transfers)?;
    let control = tokio::net::TcpListener::bind(api)
        .await
        .with_context(|| format!("binding the E2B API on {api}"))?;
    let plane = tokio::net::TcpListener::bind(sbx)
        .await
        .with_context(|| format!("binding the E2B sandbox plane on {sbx}"))?;
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
        let a = axum::serve(self.control, control).with_graceful_shutdown(shutdown());
        let b = axum::serve(self.plane, plane).with_graceful_shutdown(shutdown());
        tokio::try_join!(async { a.await.context("serving the E2B API") }, async {
            b.await.context("serving the E2B sandbox plane")
        })?;
        Ok(())
    }
}
