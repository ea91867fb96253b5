//! The audit log: one JSON line per HTTP request, rejected ones (421, 401)
//! included, appended to a file (`$FORKD_HOME/poold/audit.jsonl` by default).
//!
//! Invariant: every request that reached poold gets exactly one line, also
//! when its client went away before the answer (status 499): work a
//! request started may still have run. The same layer counts requests by
//! status (`forkd_http_requests_total`).

use super::auth::AuthOutcome;
use anyhow::{Context, Result};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use serde::Serialize;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One audited request.
#[derive(Debug, Serialize)]
pub struct Entry<'a> {
    pub ts_unix_ms: u64,
    pub method: &'a str,
    pub path: &'a str,
    /// The query string, when the request had one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query: Option<&'a str>,
    /// The HTTP status; 499 when the client closed the connection first.
    pub status: u16,
    /// Client address, or `unix` for the unix socket.
    pub remote: &'a str,
    /// The `Host` header as sent (a 421 names a host poold refused).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<&'a str>,
    /// `ok`, `none` (auth off), `missing` or `bad`.
    pub auth: &'a str,
    pub duration_ms: u64,
}

/// An append-only JSON-lines file.
pub struct AuditLog {
    file: Mutex<std::fs::File>,
}

impl AuditLog {
    pub fn open(path: &Path) -> Result<AuditLog> {
        if let Some(d) = path.parent() {
            forkd_vmm::private::create_dir_all(d)?;
        }
        // Who asked for what: root's only (an older, wider file is narrowed).
        let file = forkd_vmm::private::open_append(path)
            .with_context(|| format!("opening audit log {}", path.display()))?;
        Ok(AuditLog {
            file: Mutex::new(file),
        })
    }

    /// Appends one line. A failing write is logged, never fatal to the
    /// request.
    pub fn record(&self, e: &Entry<'_>) {
        let mut line = serde_json::to_vec(e).expect("audit entries serialize");
        line.push(b'\n');
        if let Err(err) = self.file.lock().unwrap().write_all(&line) {
            tracing::error!("writing the audit log: {err}");
        }
    }
}

/// The audit layer's state: the log, and the request counter it keeps in
/// the node's metrics registry.
pub struct Audit {
    log: AuditLog,
    requests: prometheus::IntCounterVec,
}

impl Audit {
    /// Audits into `log`, counting requests in `registry`.
    pub fn new(log: AuditLog, registry: &prometheus::Registry) -> Result<Arc<Audit>> {
        let requests = prometheus::IntCounterVec::new(
            prometheus::Opts::new("forkd_http_requests_total", "HTTP requests by status"),
            &["status"],
        )?;
        registry
            .register(Box::new(requests.clone()))
            .context("registering forkd_http_requests_total")?;
        Ok(Arc::new(Audit { log, requests }))
    }
}

/// What the audit line of one request needs; written when the response is
/// ready, or on drop with status 499 when the client went away first (axum
/// drops the handler's future then).
struct AuditLine {
    a: Arc<Audit>,
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
        self.a.log.record(&Entry {
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

/// The middleware: the outermost layer, so refusals (421, 401) are
/// audited too.
pub async fn layer(State(a): State<Arc<Audit>>, req: Request, next: Next) -> Response {
    let mut line = AuditLine {
        a: a.clone(),
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
    let auth = r.extensions().get::<AuthOutcome>().map_or("none", |o| o.0);
    line.write(r.status().as_u16(), auth);
    a.requests.with_label_values(&[r.status().as_str()]).inc();
    r
}
