//! A small client of poold's REST API, for the CLI and benchmarks:
//! `$FORKD_URL` (default `http://127.0.0.1:8889`, `https://...` for a poold
//! with TLS, or `unix:///PATH`), `$FORKD_TOKEN`, and `$FORKD_CA_CERT` (a PEM
//! file of certificates to trust besides the system's, e.g. poold's own
//! self-signed one).

use anyhow::{anyhow, bail, Context, Result};
pub use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::time::Duration;

/// A `reqwest` client builder with rustls's ring provider installed as the
/// process's default (unless one already is): forkd builds reqwest without
/// a provider of its own (the workspace Cargo.toml says why), and building
/// a client with none installed panics. Every forkd HTTP client starts here
/// but the hub's (`forkd_remote::install_tls_provider`, below this crate).
pub fn http_builder() -> reqwest::ClientBuilder {
    // Err only means a provider is already installed: that one is used.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
}

/// Where poold listens unless `$FORKD_URL` says otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8889";

/// A connection to one poold.
#[derive(Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    /// From `$FORKD_URL` / `$FORKD_TOKEN`.
    pub fn from_env() -> Result<Client> {
        let url = std::env::var("FORKD_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| DEFAULT_URL.into());
        let token = std::env::var("FORKD_TOKEN")
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let ca = std::env::var_os("FORKD_CA_CERT")
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from);
        Client::with_ca(&url, token, ca.as_deref())
    }

    /// `url` is `http(s)://HOST:PORT` or `unix:///PATH` (a poold started
    /// with `--unix PATH`).
    pub fn new(url: &str, token: Option<String>) -> Result<Client> {
        Client::with_ca(url, token, None)
    }

    /// Like [`Client::new`], also trusting the PEM certificates in `ca`
    /// (for an `https://` poold whose certificate no system CA signed).
    pub fn with_ca(
        url: &str,
        token: Option<String>,
        ca: Option<&std::path::Path>,
    ) -> Result<Client> {
        let mut builder = http_builder().timeout(Duration::from_secs(3600));
        if let Some(ca) = ca {
            let pem = std::fs::read(ca)
                .with_context(|| format!("reading FORKD_CA_CERT {}", ca.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .with_context(|| format!("FORKD_CA_CERT {}: not PEM certificates", ca.display()))?;
            if certs.is_empty() {
                bail!("FORKD_CA_CERT {}: no CERTIFICATE block in it", ca.display());
            }
            builder = builder.tls_certs_merge(certs);
        }
        let (base, builder) = if let Some(path) = url.strip_prefix("unix://") {
            if !path.starts_with('/') {
                bail!("FORKD_URL {url:?}: a unix socket URL is unix:///absolute/path");
            }
            let sock = std::path::PathBuf::from(path);
            ("http://localhost".to_string(), builder.unix_socket(sock))
        } else if url.starts_with("http://") || url.starts_with("https://") {
            (url.trim_end_matches('/').to_string(), builder)
        } else {
            bail!("FORKD_URL {url:?} must start with http://, https:// or unix:///");
        };
        Ok(Client {
            base,
            token,
            http: builder.build()?,
        })
    }

    /// Sends a request and returns the status and the body.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(StatusCode, bytes::Bytes)> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.request(method.clone(), &url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.with_context(|| {
            format!("{method} {url}: is poold running? (start it with `poold`, or set FORKD_URL)")
        })?;
        let status = resp.status();
        let bytes = resp.bytes().await?;
        Ok((status, bytes))
    }

    /// Sends raw bytes (a file upload) and returns the status and the body.
    pub async fn send_bytes(
        &self,
        method: Method,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(StatusCode, bytes::Bytes)> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.request(method.clone(), &url).body(body);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("{method} {url}"))?;
        let status = resp.status();
        Ok((status, resp.bytes().await?))
    }

    /// Sends a request and decodes a 2xx JSON answer; an error answer
    /// becomes an error carrying poold's message.
    pub async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<T> {
        let (status, bytes) = self.send(method.clone(), path, body).await?;
        if !status.is_success() {
            return Err(api_error(status, &bytes));
        }
        let bytes = if bytes.is_empty() {
            bytes::Bytes::from_static(b"null")
        } else {
            bytes
        };
        serde_json::from_slice(&bytes)
            .with_context(|| format!("decoding the answer to {method} {path}"))
    }

    /// `GET path`, decoding the JSON answer (see [`Client::call`]).
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.call(Method::GET, path, None).await
    }

    /// `POST path` with a JSON body, decoding the JSON answer.
    pub async fn post<T: DeserializeOwned>(&self, path: &str, body: Value) -> Result<T> {
        self.call(Method::POST, path, Some(body)).await
    }

    /// `PUT path` with a JSON body, decoding the JSON answer.
    pub async fn put<T: DeserializeOwned>(&self, path: &str, body: Value) -> Result<T> {
        self.call(Method::PUT, path, Some(body)).await
    }

    /// `POST path` with a JSON body whose answer is NDJSON (one JSON value
    /// a line, e.g. `POST /v1/sandboxes/:id/exec/stream`); an error answer
    /// becomes an error carrying poold's message.
    pub async fn post_lines(&self, path: &str, body: Value) -> Result<JsonLines> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.post(&url).json(&body);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.with_context(|| {
            format!("POST {url}: is poold running? (start it with `poold`, or set FORKD_URL)")
        })?;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp.bytes().await.unwrap_or_default();
            return Err(api_error(status, &bytes));
        }
        Ok(JsonLines {
            resp,
            buf: Vec::new(),
        })
    }

    /// `DELETE path`; any 2xx answer is success and its body is ignored.
    pub async fn delete(&self, path: &str) -> Result<()> {
        self.call::<Value>(Method::DELETE, path, None)
            .await
            .map(|_| ())
    }
}

/// Longest NDJSON line [`JsonLines`] buffers: poold's lines carry one
/// agent frame's output each, far below this.
pub const MAX_LINE_BYTES: usize = 64 << 20;

/// An NDJSON answer, read one value at a time as it arrives.
pub struct JsonLines {
    resp: reqwest::Response,
    buf: Vec<u8>,
}

impl JsonLines {
    /// The next value; `None` once the answer has ended.
    pub async fn next(&mut self) -> Result<Option<Value>> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                if line.trim_ascii().is_empty() {
                    continue;
                }
                return serde_json::from_slice(&line)
                    .map(Some)
                    .context("decoding a line of poold's NDJSON answer");
            }
            if self.buf.len() > MAX_LINE_BYTES {
                bail!("poold sent an NDJSON line over {MAX_LINE_BYTES} bytes");
            }
            match self.resp.chunk().await.context("reading poold's answer")? {
                Some(c) => self.buf.extend_from_slice(&c),
                None if self.buf.trim_ascii().is_empty() => return Ok(None),
                None => {
                    let line = std::mem::take(&mut self.buf);
                    return serde_json::from_slice(&line)
                        .map(Some)
                        .context("decoding the last line of poold's NDJSON answer");
                }
            }
        }
    }
}

/// poold's `{"error": "..."}` as an error.
fn api_error(status: StatusCode, body: &[u8]) -> anyhow::Error {
    let msg = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(String::from))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    anyhow!("poold answered {}: {msg}", status.as_u16())
}
