//! MCP over streamable HTTP (`forkd mcp --http ADDR`), at `/mcp`.
//!
//! Who may call it, checked in this order on every request:
//! - the `Host` header must name loopback (`localhost`, `127.0.0.1`,
//!   `::1`), the address bound, or a name given with `--allow-host`; an
//!   `Origin` header, when a browser sends one, must be one given with
//!   `--allow-origin` (none by default). Both answer 403 otherwise: a web
//!   page cannot reach a local MCP server through DNS rebinding or a
//!   cross-site request (rmcp's checks, configured here);
//! - with a token, `Authorization: Bearer <token>` (401 otherwise).
//!
//! Listening on anything but loopback needs a token: the tools run code
//! in sandboxes, which is the same power as poold's own token.

use crate::tools::Forkd;
use anyhow::{bail, Context, Result};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use std::net::SocketAddr;
use std::sync::Arc;

/// How `forkd mcp --http` listens.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Address to listen on (port 0: any free port).
    pub bind: SocketAddr,
    /// Bearer token clients must send; required off loopback.
    pub token: Option<String>,
    /// `Host` names accepted besides loopback and the bound address.
    pub allow_hosts: Vec<String>,
    /// `Origin`s accepted (`scheme://host:port`); none by default.
    pub allow_origins: Vec<String>,
}

impl HttpOptions {
    /// The `Host` values rmcp accepts.
    fn hosts(&self) -> Vec<String> {
        let mut h: Vec<String> = ["localhost", "127.0.0.1", "::1"].map(String::from).into();
        if !self.bind.ip().is_unspecified() {
            h.push(self.bind.ip().to_string());
        }
        h.extend(self.allow_hosts.iter().cloned());
        h
    }
}

/// Serves MCP at `http://ADDR/mcp` until SIGINT/SIGTERM; calls `ready`
/// with the address bound once it listens.
pub async fn serve_http(
    client: forkd_api::Client,
    opts: HttpOptions,
    ready: impl FnOnce(SocketAddr),
) -> Result<()> {
    if !opts.bind.ip().is_loopback() && opts.token.is_none() {
        bail!(
            "refusing to serve MCP on {} without a token: anyone who reaches it runs code in your sandboxes; give --token-file, or bind 127.0.0.1",
            opts.bind
        );
    }
    let config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(opts.hosts())
        .with_allowed_origins(opts.allow_origins.clone())
        .enforce_origin_validation();
    let stop = config.cancellation_token.clone();
    let server = Forkd::new(client);
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let app = axum::Router::new().nest_service("/mcp", service).layer(
        axum::middleware::from_fn_with_state(Arc::new(opts.token.clone()), bearer),
    );
    let listener = tokio::net::TcpListener::bind(opts.bind)
        .await
        .with_context(|| format!("binding {}", opts.bind))?;
    ready(listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            stop.cancel();
        })
        .await
        .context("serving MCP over HTTP")
}

/// The bearer-token check (a no-op without a token).
async fn bearer(State(token): State<Arc<Option<String>>>, req: Request, next: Next) -> Response {
    if let Some(want) = token.as_deref() {
        let got = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !got.is_some_and(|g| constant_time_eq(g.as_bytes(), want.as_bytes())) {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                axum::Json(serde_json::json!({"error": "missing or wrong bearer token"})),
            )
                .into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(bind: &str, token: Option<&str>) -> HttpOptions {
        HttpOptions {
            bind: bind.parse().unwrap(),
            token: token.map(String::from),
            allow_hosts: vec!["mcp.internal".into()],
            allow_origins: vec![],
        }
    }

    #[tokio::test]
    async fn off_loopback_needs_a_token() {
        let c = forkd_api::Client::new("http://127.0.0.1:1", None).unwrap();
        let e = serve_http(c, opts("0.0.0.0:0", None), |_| {})
            .await
            .unwrap_err();
        assert!(format!("{e}").contains("--token-file"), "{e}");
    }

    #[test]
    fn hosts_are_loopback_the_bound_address_and_the_allowed_names() {
        let h = opts("10.1.2.3:0", Some("t")).hosts();
        assert_eq!(
            h,
            ["localhost", "127.0.0.1", "::1", "10.1.2.3", "mcp.internal"]
        );
        let h = opts("0.0.0.0:0", Some("t")).hosts();
        assert!(!h.iter().any(|x| x == "0.0.0.0"), "{h:?}");
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }
}
