//! The E2B front-end's state: the node it adapts, the API key, and per
//! sandbox what ends with the process (its envd processes, its count of
//! executions). Everything else E2B knows of a sandbox is the node's record.

use crate::process;
use anyhow::{Context, Result};
use forkd_edge::hosts::HostPolicy;
use forkd_edge::transfers::Transfers;
use forkd_node::{Node, SandboxRecord};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use subtle::ConstantTimeEq;

/// The envd version poold's sandbox plane claims: it gates SDK features,
/// and 0.6.2 is the highest whose features poold serves (octet-stream
/// uploads, file metadata; not 0.6.3's entries in watch events).
pub const ENVD_VERSION: &str = "0.6.2";
/// envd's port, as the SDK names it in `E2b-Sandbox-Port`.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port.
pub const INTERPRETER_PORT: u16 = 49999;

/// What the E2B front-end keeps of a sandbox in memory: what ends with
/// the process (its streamed processes' events cannot outlive the agent
/// channels of this poold).
#[derive(Default)]
pub struct Session {
    /// Its processes started through envd's process service.
    pub processes: process::Table,
    /// Its polled directory watchers (`crate::watch`).
    pub watchers: crate::watch::Watchers,
    /// Code interpreter executions so far (`execution_count`).
    pub executions: AtomicU64,
    /// The guest's accounts, once read (`crate::guest`).
    pub accounts: Mutex<Option<crate::guest::Accounts>>,
    /// Metrics samples taken so far (`crate::metrics`).
    pub metrics: crate::metrics::Samples,
    /// Whether the guest serves the code interpreter itself, once known
    /// (`crate::interpreter`).
    pub guest_interpreter: std::sync::OnceLock<bool>,
    /// The guest's interpreter has the create-time envs.
    pub interpreter_envs: std::sync::OnceLock<()>,
    /// Connections open to its ports by URL (`crate::ports`).
    pub port_slots: crate::ports::Slots,
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
    pub(crate) hosts: HostPolicy,
    /// The large-request slots (shared with `/v1`).
    pub(crate) transfers: Arc<Transfers>,
    /// Sandbox URLs' domain (`E2bConfig::domain`), lowercase.
    pub(crate) domain: String,
    /// Every sandbox's log ([`crate::logs`]).
    pub logs: crate::logs::Logs,
    /// E2B volumes ([`forkd_e2b_volumes`]).
    pub volumes: Arc<forkd_e2b_volumes::Volumes>,
    /// Snapshots (by id) whose children have no code interpreter of their
    /// own (`crate::interpreter`); at most [`MAX_KNOWN_SNAPSHOTS`].
    no_interpreter: Mutex<std::collections::HashSet<String>>,
}

/// Most snapshots [`E2b::note_no_interpreter`] remembers (forgotten all at
/// once past that; the cost of forgetting is one tunnel attempt each).
pub const MAX_KNOWN_SNAPSHOTS: usize = 4096;

/// The host part of a `host[:port]` domain.
fn domain_host(domain: &str) -> &str {
    match domain.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => domain,
    }
}

impl E2b {
    /// The E2B side of `node`, reading the API key file if one is
    /// configured (else `token`, poold's bearer token, is the key).
    pub fn new(
        node: Arc<Node>,
        cfg: &crate::config::E2bConfig,
        token: Option<String>,
        hosts: HostPolicy,
        transfers: Arc<Transfers>,
        domain: String,
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
            volumes: Arc::new(forkd_e2b_volumes::Volumes::new(node.volume_roots())),
            node,
            api_key,
            sessions: RwLock::new(HashMap::new()),
            hosts: hosts.with_suffix(domain_host(&domain)),
            transfers,
            domain,
            logs: Default::default(),
            no_interpreter: Default::default(),
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

    /// [`Self::sandbox`], or the 404 E2B answers for an unknown sandbox.
    pub fn sandbox_or_404(&self, id: &str) -> crate::error::E2bResult<E2bSandbox> {
        self.sandbox(id).ok_or_else(|| {
            crate::error::E2bError::not_found(format!(
                "sandbox {id:?} not found (killed, expired, or never created)"
            ))
        })
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

    /// Whether children of snapshot `id` are known to have no code
    /// interpreter of their own.
    pub fn snapshot_lacks_interpreter(&self, id: &str) -> bool {
        self.no_interpreter.lock().unwrap().contains(id)
    }

    /// Notes that children of snapshot `id` have no code interpreter.
    pub fn note_no_interpreter(&self, id: &str) {
        let mut s = self.no_interpreter.lock().unwrap();
        if s.len() >= MAX_KNOWN_SNAPSHOTS {
            s.clear();
        }
        s.insert(id.to_string());
    }

    /// Forgets sandbox `id`'s session.
    pub fn forget(&self, id: &str) {
        self.sessions.write().unwrap().remove(id);
    }
}

/// One sandbox's guest, as a request reaches it: the node and the sandbox.
#[derive(Clone, Copy)]
pub struct Guest<'a> {
    /// The node, whose operations reach the guest.
    pub node: &'a Arc<Node>,
    /// The sandbox.
    pub sb: &'a E2bSandbox,
}

impl Guest<'_> {
    /// The sandbox's id.
    pub fn id(&self) -> &str {
        self.sb.id()
    }
}
