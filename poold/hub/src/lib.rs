//! The snapshot hub: move snapshots between hosts, sending only the chunks
//! the other side lacks. See docs/hub.md.
//!
//! - [`layout`]: object names and formats, shared by every backend and packs;
//! - backends: [`file`] (`file:///dir`), [`http`] (client of
//!   `forkd hub serve`, whose server is [`server`]), [`s3`] (`s3://bucket/prefix`),
//!   and [`pack`] files, readable like a hub;
//! - [`transfer`]: push and pull (batched have/want, bounded parallelism,
//!   verification, resume); [`compat`]: the QEMU check before a pull;
//!   [`bench`]: `forkd hub bench`.

#![warn(missing_docs)]

pub mod auth;
pub mod bench;
mod compat;
mod file;
mod http;
mod layout;
pub mod pack;
mod s3;
pub mod server;
mod transfer;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use std::path::{Path, PathBuf};

pub use layout::Key;
pub use transfer::{pull, push, PullOptions, PushOptions, TransferReport};

/// Where snapshots are sent to or fetched from.
#[derive(Clone)]
pub enum Hub {
    /// A directory, `file:///abs/dir`.
    File(file::FileHub),
    /// A `forkd hub serve` server, `http(s)://host:port[/path]`.
    Http(http::HttpHub),
    /// An S3 bucket, `s3://bucket[/prefix]`.
    S3(s3::S3Hub),
    /// A pack file (read-only).
    Pack(pack::PackReader),
}

impl Hub {
    /// Opens a hub URL: `file:///abs/dir`, `http(s)://host:port[/path]` or
    /// `s3://bucket[/prefix]`. `token` is the bearer token for HTTP hubs.
    pub fn open(url: &str, token: Option<String>) -> Result<Hub> {
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                bail!("hub URL {url:?}: a file hub needs an absolute path, e.g. file:///srv/forkd-hub");
            }
            return Ok(Hub::File(file::FileHub::open(Path::new(path))?));
        }
        if url.starts_with("http://") || url.starts_with("https://") {
            return Ok(Hub::Http(http::HttpHub::new(url, token)?));
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                bail!("hub URL {url:?} names no bucket: use s3://BUCKET/PREFIX");
            }
            if prefix.split('/').any(|p| p == ".." || p == ".") {
                bail!("hub URL {url:?}: the prefix may not contain '.' or '..' components");
            }
            return Ok(Hub::S3(s3::S3Hub::open(bucket, prefix)?));
        }
        Err(anyhow!(
            "unknown hub {url:?}: use file:///DIR, http(s)://HOST:PORT or s3://BUCKET/PREFIX"
        ))
    }

    /// Opens a pack file as a read-only hub.
    pub fn open_pack(path: &Path) -> Result<Hub> {
        Ok(Hub::Pack(pack::PackReader::open(path)?))
    }

    /// A name for messages.
    pub fn describe(&self) -> String {
        match self {
            Hub::File(h) => format!("file://{}", h.root().display()),
            Hub::Http(h) => h.url_str().to_string(),
            Hub::S3(h) => h.url().to_string(),
            Hub::Pack(p) => format!("pack {}", p.path().display()),
        }
    }

    /// Default number of concurrent object transfers.
    pub fn default_jobs(&self) -> usize {
        match self {
            Hub::File(_) | Hub::Pack(_) => 4,
            Hub::Http(_) | Hub::S3(_) => 16,
        }
    }

    /// Fetches an object (`None` if absent); bounded by the kind's limit.
    pub async fn get(&self, key: &Key) -> Result<Option<Bytes>> {
        match self {
            Hub::File(h) => {
                let (h, k) = (h.clone(), key.clone());
                Ok(blocking(move || h.get(&k)).await?.map(Bytes::from))
            }
            Hub::Http(h) => h.get(key).await,
            Hub::S3(h) => h.get(key).await,
            Hub::Pack(p) => {
                let (p, k) = (p.clone(), key.clone());
                Ok(blocking(move || p.get(&k)).await?.map(Bytes::from))
            }
        }
    }

    /// Stores an object atomically.
    pub async fn put(&self, key: &Key, data: Bytes) -> Result<()> {
        match self {
            Hub::File(h) => {
                let (h, k) = (h.clone(), key.clone());
                blocking(move || h.put(&k, &data)).await
            }
            Hub::Http(h) => h.put(key, data).await,
            Hub::S3(h) => h.put(key, data).await,
            Hub::Pack(p) => bail!("pack {} is read-only", p.path().display()),
        }
    }

    /// For each key, whether the hub has it: one batched query.
    pub async fn has(&self, keys: &[Key]) -> Result<Vec<bool>> {
        match self {
            Hub::File(h) => {
                let (h, k) = (h.clone(), keys.to_vec());
                blocking(move || Ok(h.has(&k))).await
            }
            Hub::Http(h) => h.has(keys).await,
            Hub::S3(h) => h.has(keys).await,
            Hub::Pack(p) => Ok(p.has(keys)),
        }
    }

    /// Makes every object written so far durable (file hubs fsync the
    /// directories that gained names); push calls it before records.
    pub async fn flush(&self) -> Result<()> {
        match self {
            Hub::File(h) => {
                let h = h.clone();
                blocking(move || h.flush()).await
            }
            _ => Ok(()),
        }
    }
}

/// Runs blocking work off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .context("a blocking task panicked")?
}

/// Reads a bearer token: the first line of `file`, else `$FORKD_HUB_TOKEN`.
pub fn read_token(file: Option<&PathBuf>) -> Result<Option<String>> {
    if let Some(f) = file {
        return crate::auth::read_token_file(f).map(Some);
    }
    Ok(std::env::var("FORKD_HUB_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}
