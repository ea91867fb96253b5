//! The E2B API, served natively so the unmodified E2B SDK (`e2b`,
//! `e2b-code-interpreter`) runs against poold with `E2B_API_URL` and
//! `E2B_SANDBOX_URL` pointed at it (docs/e2b.md).
//!
//! Two listeners, started by [`serve`] when `[e2b]` configures them:
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
//! - every sandbox reachable here has its own random 128-bit access token,
//!   compared in constant time; a request without the right one gets 401
//!   and learns nothing about other sandboxes;
//! - the rest of the daemon is touched only through `lifecycle::spawn`,
//!   `lifecycle::destroy`, `lifecycle::set_ttl`, the sandbox table and each
//!   sandbox's agent client; an E2B record whose sandbox is gone (deleted
//!   through `/v1`, expired) is dropped at its next lookup;
//! - what a client or guest can make poold hold is bounded: processes per
//!   sandbox ([`process::MAX_PROCESSES`]), output queued per subscriber,
//!   request bodies, metadata and env sizes.

pub mod connect;
pub mod control;
pub mod error;
pub mod interpreter;
pub mod process;
pub mod sandbox;

use super::Daemon;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
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

/// What E2B knows of a sandbox beyond poold's record.
pub struct E2bSandbox {
    /// poold's sandbox id (also the E2B `sandboxID`).
    pub id: String,
    /// `envdAccessToken`: 32 random hex digits.
    pub token: String,
    /// The template (snapshot tag) it was created from.
    pub template: String,
    /// The create request's metadata.
    pub metadata: BTreeMap<String, String>,
    /// Environment every process in the sandbox gets.
    pub env: BTreeMap<String, String>,
    /// Its processes started through envd's process service.
    pub processes: process::Table,
    /// Code interpreter executions so far (`execution_count`).
    pub executions: AtomicU64,
}

/// The E2B side of the daemon: the daemon and the E2B records.
pub struct E2b {
    /// The daemon.
    pub d: Arc<Daemon>,
    /// The key `X-API-KEY` must match; None: any key.
    api_key: Option<String>,
    records: RwLock<HashMap<String, Arc<E2bSandbox>>>,
}

impl E2b {
    /// The E2B side of `d`, reading the API key file if one is configured.
    pub fn new(d: Arc<Daemon>) -> Result<Arc<E2b>> {
        let api_key = match &d.cfg.e2b.api_key_file {
            Some(f) => {
                let k = forkd_hub::auth::read_token_file(f)?;
                forkd_hub::auth::check_token(&k).context("e2b.api_key_file")?;
                Some(k)
            }
            None => d.token.clone(),
        };
        Ok(Arc::new(E2b {
            d,
            api_key,
            records: RwLock::new(HashMap::new()),
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

    /// The E2B record of sandbox `id`, made (with a fresh token) when a
    /// live sandbox has none yet; None when the sandbox does not exist.
    pub fn record(&self, id: &str) -> Option<Arc<E2bSandbox>> {
        let Some(sb) = self.d.sandboxes.get(id) else {
            self.records.write().unwrap().remove(id);
            return None;
        };
        let mut m = self.records.write().unwrap();
        let rec = m.entry(id.to_string()).or_insert_with(|| {
            let template = sb.record().snapshot_tag;
            Arc::new(E2bSandbox::new(
                id,
                template,
                BTreeMap::new(),
                BTreeMap::new(),
            ))
        });
        Some(rec.clone())
    }

    /// The existing E2B record of `id` (none is made).
    pub fn existing(&self, id: &str) -> Option<Arc<E2bSandbox>> {
        if self.d.sandboxes.get(id).is_none() {
            self.records.write().unwrap().remove(id);
            return None;
        }
        self.records.read().unwrap().get(id).cloned()
    }

    /// Records a sandbox created through the E2B API, and drops the
    /// records of sandboxes that are gone (so records never outnumber live
    /// sandboxes by more than those gone since the last create).
    pub fn insert(&self, rec: Arc<E2bSandbox>) {
        let mut m = self.records.write().unwrap();
        m.retain(|id, _| self.d.sandboxes.get(id).is_some());
        m.insert(rec.id.clone(), rec);
    }

    /// Forgets sandbox `id`.
    pub fn forget(&self, id: &str) {
        self.records.write().unwrap().remove(id);
    }

    /// The sandbox whose token is `token` (every record compared in
    /// constant time, so timing tells nothing about which one matched).
    pub fn by_token(&self, token: &[u8]) -> Option<Arc<E2bSandbox>> {
        let m = self.records.read().unwrap();
        let mut found = None;
        for r in m.values() {
            if bool::from(r.token.as_bytes().ct_eq(token)) {
                found = Some(r.clone());
            }
        }
        drop(m);
        found.filter(|r| self.d.sandboxes.get(&r.id).is_some())
    }
}

impl E2bSandbox {
    /// A record with a fresh access token.
    pub fn new(
        id: &str,
        template: String,
        metadata: BTreeMap<String, String>,
        env: BTreeMap<String, String>,
    ) -> E2bSandbox {
        E2bSandbox {
            id: id.to_string(),
            token: forkd_snapshot::random_hex(16),
            template,
            metadata,
            env,
            processes: process::Table::default(),
            executions: AtomicU64::new(0),
        }
    }
}

/// The E2B listeners, bound and not yet serving.
pub struct Bound {
    e: Arc<E2b>,
    control: tokio::net::TcpListener,
    plane: tokio::net::TcpListener,
}

/// Binds both E2B listeners when `[e2b]` configures them.
pub async fn bind(d: &Arc<Daemon>) -> Result<Option<Bound>> {
    let Some((api, sbx)) = d.cfg.e2b.addrs()? else {
        return Ok(None);
    };
    let e = E2b::new(d.clone())?;
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
        let policy = Arc::new(super::hosts::HostPolicy::tcp(&self.e.d.cfg.allowed_hosts));
        let host_check = |r: axum::Router| {
            r.layer(axum::middleware::from_fn_with_state(
                policy.clone(),
                super::hosts::check_host,
            ))
        };
        let control = host_check(control::routes(self.e.clone()));
        let plane = host_check(sandbox::routes(self.e.clone()));
        tracing::info!("{}", self.banner());
        let a = axum::serve(self.control, control)
            .with_graceful_shutdown(super::server::shutdown_signal());
        let b =
            axum::serve(self.plane, plane).with_graceful_shutdown(super::server::shutdown_signal());
        tokio::try_join!(async { a.await.context("serving the E2B API") }, async {
            b.await.context("serving the E2B sandbox plane")
        })?;
        Ok(())
    }
}
