//! The audit log: one JSON line per HTTP request, rejected ones (421, 401)
//! included, appended to a file (`$FORKD_HOME/poold/audit.jsonl` by default).
//!
//! Invariant: every request that reached poold gets exactly one line, also
//! when its client went away before the answer (status 499): work a
//! request started may still have run.

use anyhow::{Context, Result};
use serde::Serialize;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

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
