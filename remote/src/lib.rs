//! The snapshot hub's objects and the backends that hold them: what
//! `forkd push`/`pull` move and what forkd-fs's lazy reads fetch. See
//! docs/hub.md.
//!
//! - [`layout`]: object names and the small formats (chunk objects, tags,
//!   `layout.json`, locators); [`packs`]: layout 2, chunks packed into
//!   large objects with index objects, and how reads of them are planned;
//! - backends behind one [`Hub`]: a directory (`file://`), `forkd hub serve`
//!   (`http(s)://`), S3 (`s3://`), and pack files (read-only);
//! - [`Credentials`]: what a lazy snapshot needs to reach its hub again,
//!   kept root-only in the store directory, never in a snapshot, never on
//!   the mount children read.
//!
//! This crate knows nothing of push, pull or QEMU (forkd-hub does); it sits
//! under forkd-fs, which cannot depend on forkd-hub.

#![warn(missing_docs)]

mod file;
mod http;
pub mod layout;
pub mod packfile;
pub mod packs;
mod s3;

pub use file::FileHub;
pub use http::{HasRequest, HasResponse, HttpHub, ListResponse, MAX_HAS_KEYS, MAX_LIST_KEYS};
pub use layout::{Key, LAYOUT_CHUNKS, LAYOUT_PACKED};
pub use packfile::PackReader;
pub use s3::S3Hub;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use forkd_layers::ObjectId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Installs rustls's ring provider as the process's default unless one
/// already is. reqwest (ours and object_store's) is built without a provider
/// of its own (the workspace Cargo.toml says why) and panics building a
/// client when none is installed: hub clients call this first.
pub fn install_tls_provider() {
    // Err only means a provider is already installed: that one is used.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Where snapshots are sent to or fetched from.
#[derive(Clone)]
pub enum Hub {
    /// A directory, `file:///abs/dir`.
    File(FileHub),
    /// A `forkd hub serve` server, `http(s)://host:port[/path]`.
    Http(HttpHub),
    /// An S3 bucket, `s3://bucket[/prefix]`.
    S3(S3Hub),
    /// A pack file (read-only).
    Pack(PackReader),
}

/// How long requests may take, and how often the client library retries
/// by itself.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Connecting.
    pub connect: Duration,
    /// One whole request.
    pub request: Duration,
    /// Retries inside the S3 client.
    pub retries: usize,
    /// How long the S3 client keeps retrying one request.
    pub retry_for: Duration,
}

impl Timeouts {
    /// Push and pull: long requests, the client retries.
    pub const TRANSFER: Timeouts = Timeouts {
        connect: Duration::from_secs(10),
        request: Duration::from_secs(300),
        retries: 4,
        retry_for: Duration::from_secs(60),
    };
    /// Lazy reads (a vCPU waits on them): short requests, the caller retries
    /// with its own deadline and sees every failure.
    pub const LAZY: Timeouts = Timeouts {
        connect: Duration::from_secs(3),
        request: Duration::from_secs(30),
        retries: 0,
        retry_for: Duration::from_secs(5),
    };
}

/// Requests made and bytes moved through one hub handle.
#[derive(Debug, Default)]
pub struct Traffic {
    requests: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

/// A reading of [`Traffic`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrafficCounts {
    /// Requests sent (GET, ranged GET, PUT, HEAD, LIST pages, POST).
    pub requests: u64,
    /// Body bytes received.
    pub bytes_in: u64,
    /// Body bytes sent.
    pub bytes_out: u64,
}

impl Traffic {
    /// Counts one request sending `body` bytes.
    pub fn request(&self, body: u64) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes_out.fetch_add(body, Ordering::Relaxed);
    }

    /// Counts bytes received.
    pub fn received(&self, n: u64) {
        self.bytes_in.fetch_add(n, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn counts(&self) -> TrafficCounts {
        TrafficCounts {
            requests: self.requests.load(Ordering::Relaxed),
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
        }
    }
}

impl TrafficCounts {
    /// `self - earlier`, for one step of a longer run.
    pub fn since(&self, earlier: &TrafficCounts) -> TrafficCounts {
        TrafficCounts {
            requests: self.requests.saturating_sub(earlier.requests),
            bytes_in: self.bytes_in.saturating_sub(earlier.bytes_in),
            bytes_out: self.bytes_out.saturating_sub(earlier.bytes_out),
        }
    }
}

/// What it takes to open a hub again later, in another process: a bearer
/// token (HTTP hubs) or the `AWS_*` settings (S3 hubs). Saved root-only
/// (0600) next to the store by a lazy pull, read by forkd-fs; it never goes
/// into a snapshot, a hub or the mount.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    /// Bearer token of an HTTP hub.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// `AWS_*` settings of an S3 hub (keys, region, endpoint).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print secrets, only which settings there are.
        f.debug_struct("Credentials")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Credentials {
    /// Where the credentials of lazy source `source` of the store at
    /// `store_root` live.
    pub fn path(store_root: &Path, source: u32) -> PathBuf {
        store_root
            .join("remote")
            .join("credentials")
            .join(format!("{source}.json"))
    }

    /// Writes them atomically, readable by the owner only.
    pub fn save(&self, path: &Path) -> Result<()> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let dir = path.parent().expect("a credentials path has a parent");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        let tmp = dir.join(format!(".tmp-{}", random_hex(8)));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&serde_json::to_vec(self).expect("credentials serialize"))?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            anyhow!("writing {}: {e}", path.display())
        })
    }

    /// Reads them back; absent means none.
    pub fn load(path: &Path) -> Result<Credentials> {
        match std::fs::read(path) {
            Ok(b) => serde_json::from_slice(&b)
                .with_context(|| format!("{} is not a credentials file", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Credentials::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }
}

impl Hub {
    /// Opens a hub URL: `file:///abs/dir`, `http(s)://host:port[/path]` or
    /// `s3://bucket[/prefix]`. `token` is the bearer token for HTTP hubs; S3
    /// settings come from the `AWS_*` environment.
    pub fn open(url: &str, token: Option<String>) -> Result<Hub> {
        if url.starts_with("s3://") {
            let (bucket, prefix) = s3_parts(url)?;
            return Ok(Hub::S3(S3Hub::open(bucket, prefix)?));
        }
        let creds = Credentials {
            token,
            env: BTreeMap::new(),
        };
        Self::open_with(url, &creds, Timeouts::TRANSFER)
    }

    /// Opens a hub URL with saved [`Credentials`] and the given timeouts.
    pub fn open_with(url: &str, creds: &Credentials, t: Timeouts) -> Result<Hub> {
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                bail!("hub URL {url:?}: a file hub needs an absolute path, e.g. file:///srv/forkd-hub");
            }
            return Ok(Hub::File(FileHub::open(Path::new(path))?));
        }
        if url.starts_with("http://") || url.starts_with("https://") {
            return Ok(Hub::Http(HttpHub::with_timeouts(
                url,
                creds.token.clone(),
                t.connect,
                t.request,
            )?));
        }
        if url.starts_with("s3://") {
            let (bucket, prefix) = s3_parts(url)?;
            return Ok(Hub::S3(S3Hub::open_with(bucket, prefix, &creds.env, t)?));
        }
        Err(anyhow!(
            "unknown hub {url:?}: use file:///DIR, http(s)://HOST:PORT or s3://BUCKET/PREFIX"
        ))
    }

    /// Opens a pack file as a read-only hub.
    pub fn open_pack(path: &Path) -> Result<Hub> {
        Ok(Hub::Pack(PackReader::open(path)?))
    }

    /// A name for messages (and what a lazy source records: never holds a
    /// secret).
    pub fn describe(&self) -> String {
        match self {
            Hub::File(h) => format!("file://{}", h.root().display()),
            Hub::Http(h) => h.url_str().to_string(),
            Hub::S3(h) => h.url().to_string(),
            Hub::Pack(p) => format!("pack {}", p.path().display()),
        }
    }

    /// What it takes to open this hub again in another process.
    pub fn credentials(&self) -> Credentials {
        match self {
            Hub::Http(h) => Credentials {
                token: h.token().map(str::to_string),
                env: BTreeMap::new(),
            },
            Hub::S3(h) => h.credentials(),
            Hub::File(_) | Hub::Pack(_) => Credentials::default(),
        }
    }

    /// Default number of concurrent object transfers.
    pub fn default_jobs(&self) -> usize {
        match self {
            Hub::File(_) | Hub::Pack(_) => 4,
            Hub::Http(_) | Hub::S3(_) => 16,
        }
    }

    /// Requests and bytes so far through this handle (and its clones).
    /// File hubs and packs count nothing.
    pub fn traffic(&self) -> TrafficCounts {
        match self {
            Hub::Http(h) => h.traffic().counts(),
            Hub::S3(h) => h.traffic().counts(),
            Hub::File(_) | Hub::Pack(_) => TrafficCounts::default(),
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

    /// Fetches `len` bytes at `start` of an object with one ranged request
    /// (`None` if the object is absent). The answer is exactly `len` bytes.
    pub async fn get_range(&self, key: &Key, start: u64, len: u64) -> Result<Option<Bytes>> {
        match self {
            Hub::File(h) => {
                let (h, k) = (h.clone(), key.clone());
                Ok(blocking(move || h.get_range(&k, start, len))
                    .await?
                    .map(Bytes::from))
            }
            Hub::Http(h) => h.get_range(key, start, len).await,
            Hub::S3(h) => h.get_range(key, start, len).await,
            Hub::Pack(p) => {
                let (p, k) = (p.clone(), key.clone());
                Ok(blocking(move || p.get_range(&k, start, len))
                    .await?
                    .map(Bytes::from))
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

    /// The objects directly in `dir` (`index` or `snapshots`; `pending` and
    /// `wanted` on plain object stores), as parsed keys; names that are not valid
    /// object names are skipped.
    pub async fn list(&self, dir: &str) -> Result<Vec<Key>> {
        let markers = (dir == "pending" || dir == "wanted") && self.is_object_store();
        if dir != "index" && dir != "snapshots" && !markers {
            bail!("only index/ and snapshots/ are listed, not {dir:?}");
        }
        let names = match self {
            Hub::File(h) => {
                let (h, d) = (h.clone(), dir.to_string());
                blocking(move || h.list(&d)).await?
            }
            Hub::Http(h) => h.list(dir).await?,
            Hub::S3(h) => h.list(dir).await?,
            Hub::Pack(p) => p.list(dir),
        };
        Ok(names.iter().filter_map(|n| Key::parse(n).ok()).collect())
    }

    /// A plain object store (file or S3 hub): it takes any well-formed
    /// object, lists and deletes. An HTTP hub verifies what it stores, so a
    /// push to it never publishes ahead of its packs (no pending markers).
    pub fn is_object_store(&self) -> bool {
        matches!(self, Hub::File(_) | Hub::S3(_))
    }

    /// Whether a push has promised pack `pack` and may still deliver it: its
    /// pending marker is there and fresh (`layout`, "Pending packs"). What a
    /// reader asks when the pack is missing, to wait instead of refusing.
    pub async fn pack_pending(&self, pack: &ObjectId) -> Result<bool> {
        Ok(match self.get(&Key::Pending(*pack)).await? {
            Some(b) => layout::PendingObject::decode(pack, &b)?.is_fresh(),
            None => false,
        })
    }

    /// Removes an object (a migration's `--prune`, a pending marker); file
    /// and S3 hubs only.
    pub async fn delete(&self, key: &Key) -> Result<()> {
        match self {
            Hub::File(h) => {
                let (h, k) = (h.clone(), key.clone());
                blocking(move || h.delete(&k)).await
            }
            Hub::S3(h) => h.delete(key).await,
            Hub::Http(_) => bail!(
                "an HTTP hub cannot delete objects: migrate the directory it serves as a file:// hub on its host"
            ),
            Hub::Pack(p) => bail!("pack {} is read-only", p.path().display()),
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

    /// The hub's layout: `layout.json`'s, or [`LAYOUT_CHUNKS`] without one.
    /// A pack file holds layout-1 objects.
    pub async fn layout(&self) -> Result<u32> {
        if matches!(self, Hub::Pack(_)) {
            return Ok(LAYOUT_CHUNKS);
        }
        match self.get(&Key::Layout).await? {
            Some(b) => Ok(layout::LayoutObject::decode(&b)?.layout),
            None => Ok(LAYOUT_CHUNKS),
        }
    }
}

fn s3_parts(url: &str) -> Result<(&str, &str)> {
    let rest = url.strip_prefix("s3://").expect("an s3 url");
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        bail!("hub URL {url:?} names no bucket: use s3://BUCKET/PREFIX");
    }
    if prefix.split('/').any(|p| p == ".." || p == ".") {
        bail!("hub URL {url:?}: the prefix may not contain '.' or '..' components");
    }
    Ok((bucket, prefix))
}

/// Runs blocking work off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .context("a blocking task panicked")?
}

/// `n` random bytes as lowercase hex (temporary names).
pub fn random_hex(n: usize) -> String {
    let bytes: Vec<u8> = (0..n).map(|_| rand::random::<u8>()).collect();
    hex::encode(bytes)
}

/// Reads a bearer token: the first line of `file`, else `$FORKD_HUB_TOKEN`.
pub fn read_token(file: Option<&PathBuf>) -> Result<Option<String>> {
    if let Some(f) = file {
        let s = std::fs::read_to_string(f)
            .with_context(|| format!("reading token file {}", f.display()))?;
        let t = s.lines().next().unwrap_or("").trim().to_string();
        if t.is_empty() {
            bail!("token file {} is empty", f.display());
        }
        return Ok(Some(t));
    }
    Ok(std::env::var("FORKD_HUB_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_private_and_never_printed() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let c = Credentials {
            token: Some("s3cr3t-token-value".into()),
            env: [("AWS_SECRET_ACCESS_KEY".to_string(), "hush".to_string())].into(),
        };
        let p = Credentials::path(d.path(), 3);
        c.save(&p).unwrap();
        assert_eq!(Credentials::load(&p).unwrap(), c);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cr3t") && !shown.contains("hush"),
            "{shown}"
        );
        assert_eq!(
            Credentials::load(&d.path().join("none")).unwrap(),
            Credentials::default()
        );
    }
}
