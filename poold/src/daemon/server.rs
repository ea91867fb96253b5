//! The HTTP server: a TCP listener (127.0.0.1:8889 by default; HTTPS with
//! `tls_cert`/`tls_key`, [`super::tls`]) or a unix socket, the `Host` check against DNS rebinding on every route
//! ([`super::hosts`]), bearer-token auth on everything but `/healthz`, an
//! audit line per request (the outermost layer, so 421s and 401s are logged
//! too), and errors always as `{"error": "..."}`.

use super::audit::Entry;
use super::Daemon;
use anyhow::{Context, Result};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// The whole application: routes, auth, error shaping, audit.
pub fn app(d: Arc<Daemon>) -> Router {
    let api = super::api::routes(d.clone()).layer(middleware::from_fn_with_state(d.clone(), auth));
    // No route of its own: every route is in `api::table` (documented).
    Router::new()
        .merge(super::api::public_routes(d.clone()))
        .merge(api)
        .layer(middleware::from_fn(json_errors))
        .layer(middleware::from_fn_with_state(
            Arc::new(host_policy(&d.cfg)),
            super::hosts::check_host,
        ))
        .layer(middleware::from_fn_with_state(d, audit))
}

/// Which `Host` values this listener answers: any on a unix socket (no
/// browser reaches it), else localhost, IPs and `allowed_hosts`.
fn host_policy(cfg: &super::config::Config) -> super::hosts::HostPolicy {
    if cfg.unix.is_some() {
        super::hosts::HostPolicy {
            any: true,
            names: Vec::new(),
        }
    } else {
        super::hosts::HostPolicy::tcp(&cfg.allowed_hosts)
    }
}

/// What the auth layer decided, for the audit line.
#[derive(Clone, Copy)]
struct AuthOutcome(&'static str);

async fn auth(State(d): State<Arc<Daemon>>, mut req: Request, next: Next) -> Response {
    let outcome = match &d.token {
        None => "none",
        Some(want) => {
            let got = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            if forkd_hub::auth::bearer_matches(got, want) {
                "ok"
            } else if got.is_none() {
                "missing"
            } else {
                "bad"
            }
        }
    };
    req.extensions_mut().insert(AuthOutcome(outcome));
    if matches!(outcome, "missing" | "bad") {
        let mut r = (
            StatusCode::UNAUTHORIZED,
            Json(serde_json::json!({"error": "missing or wrong bearer token"})),
        )
            .into_response();
        r.extensions_mut().insert(AuthOutcome(outcome));
        return r;
    }
    let mut r = next.run(req).await;
    r.extensions_mut().insert(AuthOutcome(outcome));
    r
}

/// Turns axum's plain-text rejections (bad JSON, unknown route, wrong
/// method) into forkd's `{"error": "..."}`, with 400 for unparseable bodies.
async fn json_errors(req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    let status = r.status();
    let is_json = r
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return r;
    }
    let (parts, body) = r.into_parts();
    let bytes = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let mut msg = String::from_utf8_lossy(&bytes).trim().to_string();
    if msg.is_empty() {
        msg = status
            .canonical_reason()
            .unwrap_or("error")
            .to_ascii_lowercase();
    }
    let status = if status == StatusCode::UNPROCESSABLE_ENTITY {
        StatusCode::BAD_REQUEST
    } else {
        status
    };
    let mut out = (status, Json(serde_json::json!({ "error": msg }))).into_response();
    for (k, v) in parts.headers.iter() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out.extensions_mut().extend(parts.extensions);
    out
}

/// What the audit line of one request needs; written when the response is
/// ready, or on drop with status 499 when the client went away first (axum
/// drops the handler's future then).
struct AuditLine {
    d: Arc<Daemon>,
    t0: Instant,
    method: String,
    path: String,
    query: Option<String>,
    host: Option<String>,
    remote: String,
    written: bool,
}

impl AuditLine {
    fn write(&mut self, status: u16, auth: &str) {
        self.written = true;
        self.d.audit.record(&Entry {
            ts_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |t| t.as_millis() as u64),
            method: &self.method,
            path: &self.path,
            query: self.query.as_deref(),
            status,
            remote: &self.remote,
            host: self.host.as_deref(),
            auth,
            duration_ms: self.t0.elapsed().as_millis() as u64,
        });
    }
}

impl Drop for AuditLine {
    fn drop(&mut self) {
        if !self.written {
            // nginx's "client closed request".
            self.write(499, "unknown");
        }
    }
}

async fn audit(State(d): State<Arc<Daemon>>, req: Request, next: Next) -> Response {
    let mut line = AuditLine {
        d: d.clone(),
        t0: Instant::now(),
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        query: req.uri().query().map(str::to_string),
        host: req
            .headers()
            .get(header::HOST)
            .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned()),
        remote: req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map_or_else(|| "unix".to_string(), |c| c.0.to_string()),
        written: false,
    };
    let r = next.run(req).await;
    let auth = r.extensions().get::<AuthOutcome>().map_or("none", |a| a.0);
    line.write(r.status().as_u16(), auth);
    d.metrics
        .requests
        .with_label_values(&[r.status().as_str()])
        .inc();
    r
}

/// Removes the socket a previous poold left at `path` (poold.lock already
/// ensures none serves this data dir); anything else there is refused, so
/// a mistyped `--unix` never deletes a file.
fn remove_stale_socket(path: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display())),
        Ok(_) => anyhow::bail!(
            "--unix {}: a file that is not a socket is there; pick another path",
            path.display()
        ),
        Err(_) => Ok(()),
    }
}

/// Serves until SIGINT/SIGTERM. `banner_after` is printed after the
/// listening line (the E2B listeners' addresses), so the first line of
/// stdout is always this listener's.
pub async fn serve(d: Arc<Daemon>, banner_after: Option<String>) -> Result<()> {
    let app = app(d.clone());
    match &d.cfg.unix {
        Some(path) => {
            remove_stale_socket(path)?;
            if let Some(dir) = path.parent() {
                forkd_vmm::private::create_dir_all(dir)?;
            }
            let l = tokio::net::UnixListener::bind(path)
                .with_context(|| format!("binding {}", path.display()))?;
            tracing::info!("poold listening on unix://{}", path.display());
            println!("poold listening on unix://{}", path.display());
            if let Some(b) = &banner_after {
                println!("{b}");
            }
            axum::serve(l, app)
                .with_graceful_shutdown(shutdown_signal())
                .await
                .context("serving")
        }
        None => {
            let addr = d.cfg.bind_addr()?;
            // Certificate problems fail the start before the port is taken.
            let tls = match (&d.cfg.tls_cert, &d.cfg.tls_key) {
                (Some(c), Some(k)) => Some(super::tls::server_config(c, k)?),
                _ => None,
            };
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr} (is another poold running?)"))?;
            let local = l.local_addr()?;
            let scheme = if tls.is_some() { "https" } else { "http" };
            tracing::info!("poold listening on {scheme}://{local}");
            println!("poold listening on {scheme}://{local}");
            if let Some(b) = &banner_after {
                println!("{b}");
            }
            let svc = app.into_make_service_with_connect_info::<SocketAddr>();
            match tls {
                // `tap_io` is a no-op whose wrapper gives the TLS listener
                // axum's `ConnectInfo<SocketAddr>` (the audit's `remote`).
                Some(cfg) => {
                    use axum::serve::ListenerExt;
                    let l = super::tls::TlsListener::new(l, cfg)?.tap_io(|_| {});
                    axum::serve(l, svc)
                        .with_graceful_shutdown(shutdown_signal())
                        .await
                        .context("serving")
                }
                None => axum::serve(l, svc)
                    .with_graceful_shutdown(shutdown_signal())
                    .await
                    .context("serving"),
            }
        }
    }
}

pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("poold stopping; sandboxes keep running and are re-adopted at the next start");
}
