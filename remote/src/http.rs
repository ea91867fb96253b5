//! The client of an HTTP(S) hub served by `forkd hub serve`.
//!
//! Protocol (all under the hub URL, bearer token in `Authorization` when
//! the hub requires one):
//! - `GET /v1/objects/<object path>`: the object, or 404;
//! - `PUT /v1/objects/<object path>`: stores it; the server verifies it
//!   first (chunk hash, manifest hash and chunks, record's manifests and
//!   parent, tag's snapshot) and answers 409 with the reason otherwise;
//! - `POST /v1/has` `{"keys": [paths]}` → `{"have": [bool]}`: the batched
//!   have/want query, up to [`MAX_HAS_KEYS`] keys per request;
//! - `GET /v1/objects/<path>` with `Range: bytes=A-B`: 206 and exactly those
//!   bytes (a lazy read of one chunk of a pack);
//! - `GET /v1/list/<dir>` → `{"keys": [paths]}`: the objects directly in
//!   `index` or `snapshots` (at most [`MAX_LIST_KEYS`]).

use super::layout::Key;
use crate::Traffic;
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use reqwest::{header, Client, StatusCode, Url};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// Keys per `/v1/has` request.
pub const MAX_HAS_KEYS: usize = 8192;
/// Most names one `/v1/list` answer may hold.
pub const MAX_LIST_KEYS: usize = 100_000;

/// Answer of `GET /v1/list/<dir>`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ListResponse {
    /// Object paths relative to the hub root.
    pub keys: Vec<String>,
}

/// Body of `POST /v1/has`.
#[derive(Debug, Serialize, Deserialize)]
pub struct HasRequest {
    /// Object paths relative to the hub root.
    pub keys: Vec<String>,
}

/// Answer of `POST /v1/has`: one flag per requested key.
#[derive(Debug, Serialize, Deserialize)]
pub struct HasResponse {
    /// One flag per requested key, in order.
    pub have: Vec<bool>,
}

/// An HTTP hub.
#[derive(Clone)]
pub struct HttpHub {
    base: Url,
    client: Client,
    token: Option<String>,
    shown: String,
    traffic: Arc<Traffic>,
}

impl HttpHub {
    /// A client for the hub at `base` (`http://host:port` or `https://...`).
    pub fn new(base: &str, token: Option<String>) -> Result<HttpHub> {
        Self::with_timeouts(
            base,
            token,
            Duration::from_secs(10),
            Duration::from_secs(300),
        )
    }

    /// [`HttpHub::new`] with a connect timeout and a per-request timeout
    /// (lazy reads use short ones and retry themselves).
    pub fn with_timeouts(
        base: &str,
        token: Option<String>,
        connect: Duration,
        request: Duration,
    ) -> Result<HttpHub> {
        let shown = base.trim_end_matches('/').to_string();
        let mut base: Url = base
            .parse()
            .with_context(|| format!("invalid hub URL {base:?}"))?;
        if !base.path().ends_with('/') {
            base.set_path(&format!("{}/", base.path()));
        }
        crate::install_tls_provider();
        let client = Client::builder()
            .connect_timeout(connect)
            .timeout(request)
            .user_agent(concat!("forkd/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("building the HTTP client")?;
        Ok(HttpHub {
            base,
            client,
            token,
            shown,
            traffic: Arc::new(Traffic::default()),
        })
    }

    /// Requests and bytes so far.
    pub fn traffic(&self) -> &Arc<Traffic> {
        &self.traffic
    }

    /// The bearer token, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The hub URL as given.
    pub fn url_str(&self) -> &str {
        &self.shown
    }

    fn url(&self, rel: &str) -> Url {
        self.base.join(rel).expect("relative hub paths join")
    }

    fn auth(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// Fetches an object, refusing bodies over the kind's size limit.
    pub async fn get(&self, key: &Key) -> Result<Option<Bytes>> {
        let url = self.url(&format!("v1/objects/{}", key.path()));
        self.traffic.request(0);
        let mut resp = self
            .auth(self.client.get(url.clone()))
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        check(resp.status(), &url, &mut resp).await?;
        let what = format!("{key} from {url}");
        let buf = read_limited(&mut resp, key.max_len(), &what).await?;
        self.traffic.received(buf.len() as u64);
        Ok(Some(Bytes::from(buf)))
    }

    /// Fetches `len` bytes at `start` of an object (a `Range` request); the
    /// answer must be exactly those bytes.
    pub async fn get_range(&self, key: &Key, start: u64, len: u64) -> Result<Option<Bytes>> {
        let url = self.url(&format!("v1/objects/{}", key.path()));
        if len == 0 || len > key.max_len() {
            bail!("a read of {len} bytes of {key} is outside its kind's limits");
        }
        self.traffic.request(0);
        let mut resp = self
            .auth(self.client.get(url.clone()))
            .header(header::RANGE, format!("bytes={start}-{}", start + len - 1))
            .send()
            .await
            .with_context(|| format!("GET {url} (bytes {start}+{len})"))?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        check(resp.status(), &url, &mut resp).await?;
        if resp.status() != StatusCode::PARTIAL_CONTENT {
            bail!(
                "{url} answered {} to a range request; the hub server is too old for lazy reads (upgrade `forkd hub serve`)",
                resp.status()
            );
        }
        let what = format!("bytes {start}+{len} of {key} from {url}");
        let buf = read_limited(&mut resp, len, &what).await?;
        self.traffic.received(buf.len() as u64);
        if buf.len() as u64 != len {
            bail!("{what}: the hub sent {} bytes", buf.len());
        }
        Ok(Some(Bytes::from(buf)))
    }

    /// The objects directly in `dir` (`index` or `snapshots`).
    pub async fn list(&self, dir: &str) -> Result<Vec<String>> {
        let url = self.url(&format!("v1/list/{dir}"));
        self.traffic.request(0);
        let mut resp = self
            .auth(self.client.get(url.clone()))
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        check(resp.status(), &url, &mut resp).await?;
        let what = format!("the answer of GET {url}");
        let body = read_limited(&mut resp, 200 * MAX_LIST_KEYS as u64, &what).await?;
        self.traffic.received(body.len() as u64);
        let l: ListResponse = serde_json::from_slice(&body)
            .with_context(|| format!("decoding the answer of GET {url}"))?;
        if l.keys.len() > MAX_LIST_KEYS {
            bail!("{url} listed over {MAX_LIST_KEYS} objects");
        }
        Ok(l.keys)
    }

    /// Stores an object; the server verifies it before accepting.
    pub async fn put(&self, key: &Key, data: Bytes) -> Result<()> {
        let url = self.url(&format!("v1/objects/{}", key.path()));
        self.traffic.request(data.len() as u64);
        let mut resp = self
            .auth(self.client.put(url.clone()))
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(data)
            .send()
            .await
            .with_context(|| format!("PUT {url}"))?;
        check(resp.status(), &url, &mut resp).await
    }

    /// Which of `keys` the hub has, [`MAX_HAS_KEYS`] per request.
    pub async fn has(&self, keys: &[Key]) -> Result<Vec<bool>> {
        let url = self.url("v1/has");
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(MAX_HAS_KEYS) {
            let body = HasRequest {
                keys: part.iter().map(Key::path).collect(),
            };
            self.traffic.request(0);
            let mut resp = self
                .auth(self.client.post(url.clone()))
                .json(&body)
                .send()
                .await
                .with_context(|| format!("POST {url}"))?;
            check(resp.status(), &url, &mut resp).await?;
            // `{"have":[...]}` with one `false,` at most per key, and room
            // for whitespace: a hub cannot make poold buffer more.
            let limit = 64 + 8 * part.len() as u64;
            let what = format!("the answer of POST {url}");
            let body = read_limited(&mut resp, limit, &what).await?;
            let have: HasResponse = serde_json::from_slice(&body)
                .with_context(|| format!("decoding the answer of POST {url}"))?;
            if have.have.len() != part.len() {
                bail!(
                    "hub {url} answered {} flags for {} keys",
                    have.have.len(),
                    part.len()
                );
            }
            out.extend(have.have);
        }
        Ok(out)
    }
}

/// Reads a response body of at most `limit` bytes, refusing a longer one
/// (announced or sent) before buffering past the limit.
async fn read_limited(resp: &mut reqwest::Response, limit: u64, what: &str) -> Result<Vec<u8>> {
    let over = || anyhow!("{what} is over the {limit}-byte limit; the hub is broken or hostile");
    if resp.content_length().is_some_and(|n| n > limit) {
        return Err(over());
    }
    let mut buf = Vec::new();
    while let Some(part) = resp.chunk().await.with_context(|| what.to_string())? {
        if (buf.len() + part.len()) as u64 > limit {
            return Err(over());
        }
        buf.extend_from_slice(&part);
    }
    Ok(buf)
}

/// Turns a non-success status into an error carrying the server's reason.
async fn check(status: StatusCode, url: &Url, resp: &mut reqwest::Response) -> Result<()> {
    if status.is_success() {
        return Ok(());
    }
    let mut body = Vec::new();
    while let Ok(Some(part)) = resp.chunk().await {
        body.extend_from_slice(&part);
        if body.len() > 4096 {
            break;
        }
    }
    let text = String::from_utf8_lossy(&body);
    let reason = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("error")?.as_str().map(str::to_string))
        .unwrap_or_else(|| text.trim().chars().take(300).collect());
    let hint = match status {
        StatusCode::UNAUTHORIZED => {
            " (the hub needs a bearer token: pass --token-file or set FORKD_HUB_TOKEN)"
        }
        StatusCode::FORBIDDEN => " (the hub refused: read-only, or the token is wrong)",
        _ => "",
    };
    Err(anyhow!("{url}: HTTP {status}: {reason}{hint}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hub whose `/v1/has` answer is far longer than any honest one is
    /// refused by size; the client used to buffer whatever came.
    #[tokio::test]
    async fn an_oversized_has_answer_is_refused() {
        let app = axum::Router::new().route(
            "/v1/has",
            axum::routing::post(|| async {
                let pad = " ".repeat(4 << 20);
                format!("{{\"have\":[true]{pad}}}")
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        let hub = HttpHub::new(&format!("http://{addr}"), None).unwrap();
        let e = hub.has(&[Key::tag("t").unwrap()]).await.unwrap_err();
        assert!(format!("{e:#}").contains("byte limit"), "{e:#}");
    }
}
