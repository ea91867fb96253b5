//! `[e2b]` of poold's config: where the E2B listeners bind and how API
//! keys are checked (docs/e2b.md).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;

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
    /// The domain sandbox URLs live under (E2B's `domain`): the SDK's
    /// `get_host(port)` is `<port>-<sandbox id>.<domain>`, a name the
    /// sandbox plane routes to that guest port. Unset:
    /// `localhost:<sandbox_bind's port>` (`*.localhost` is loopback to
    /// browsers and curl). Point a wildcard DNS name (or a TLS proxy) at
    /// the sandbox plane and name it here for other hosts.
    pub sandbox_domain: Option<String>,
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

    /// The domain sandbox URLs are answered under, for a sandbox plane
    /// bound to `plane_port`; checked: `host[:port]`, nothing else.
    pub fn domain(&self, plane_port: u16) -> Result<String> {
        let Some(d) = &self.sandbox_domain else {
            return Ok(format!("localhost:{plane_port}"));
        };
        forkd_edge::hosts::sandbox_domain(d)
            .map_err(|e| anyhow::anyhow!("bad e2b.sandbox_domain {e}"))
    }

    /// Checks the addresses and that a non-loopback one has a key.
    pub fn validate(&self, has_token: bool) -> Result<()> {
        self.domain(0)?;
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
