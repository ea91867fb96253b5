//! A hub on S3-compatible object storage (`s3://bucket/prefix`), through the
//! `object_store` crate.
//!
//! Credentials and endpoint come from the usual environment variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` for non-AWS
//! services; an `http://` endpoint is allowed without `AWS_ALLOW_HTTP`).
//! Every object is one PUT, so readers see it whole or not at all; push
//! writes snapshot records and tags last. A lazy read is one ranged GET.
//!
//! Have/want: a few keys are HEADed concurrently; a large chunk batch lists
//! the fan-out directories it touches instead (one LIST per 1000 objects
//! rather than one request per chunk).

use super::layout::Key;
use crate::{Credentials, Timeouts, Traffic};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

/// Above this many chunk keys, `has` lists fan-out directories.
const LIST_THRESHOLD: usize = 512;
/// Concurrent HEAD or LIST requests of one `has`.
const HAS_CONCURRENCY: usize = 16;

/// An S3 hub. Cheap to clone.
#[derive(Clone)]
pub struct S3Hub {
    store: Arc<AmazonS3>,
    /// Key prefix without leading or trailing slash ("" for the bucket root).
    prefix: String,
    url: String,
    /// The `AWS_*` settings it was built from (to hand to forkd-fs).
    env: BTreeMap<String, String>,
    traffic: Arc<Traffic>,
}

impl S3Hub {
    /// Opens `bucket` with objects under `prefix`, configured from the
    /// `AWS_*` environment.
    pub fn open(bucket: &str, prefix: &str) -> Result<S3Hub> {
        let env: BTreeMap<String, String> = std::env::vars()
            .filter(|(k, _)| k.starts_with("AWS_"))
            .collect();
        Self::open_with(bucket, prefix, &env, Timeouts::TRANSFER)
    }

    /// Opens `bucket` with the given `AWS_*` settings (what [`Credentials`]
    /// captured at pull time) instead of the environment.
    pub fn open_with(
        bucket: &str,
        prefix: &str,
        env: &BTreeMap<String, String>,
        t: Timeouts,
    ) -> Result<S3Hub> {
        crate::install_tls_provider();
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_retry(RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: t.retries,
                retry_timeout: t.retry_for,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(t.connect)
                    .with_timeout(t.request),
            );
        for (k, v) in env {
            if let Ok(key) = k.to_ascii_lowercase().parse() {
                b = b.with_config(key, v.clone());
            }
        }
        let endpoint = env
            .get("AWS_ENDPOINT_URL")
            .or_else(|| env.get("AWS_ENDPOINT"))
            .cloned()
            .unwrap_or_default();
        if endpoint.starts_with("http://") {
            b = b.with_allow_http(true);
        }
        let store = b.build().with_context(|| {
            format!("configuring S3 bucket {bucket:?} from the AWS_* environment")
        })?;
        let prefix = prefix.trim_matches('/').to_string();
        Ok(S3Hub {
            store: Arc::new(store),
            url: format!("s3://{bucket}/{prefix}"),
            prefix,
            env: env.clone(),
            traffic: Arc::new(Traffic::default()),
        })
    }

    /// The settings to reopen this hub elsewhere (forkd-fs's lazy reads).
    pub fn credentials(&self) -> Credentials {
        Credentials {
            token: None,
            env: self.env.clone(),
        }
    }

    /// Requests and bytes so far.
    pub fn traffic(&self) -> &Arc<Traffic> {
        &self.traffic
    }

    /// The hub URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn obj(&self, rel: &str) -> ObjPath {
        if self.prefix.is_empty() {
            ObjPath::from(rel)
        } else {
            ObjPath::from(format!("{}/{rel}", self.prefix))
        }
    }

    /// Fetches an object, checking its size before reading the body.
    pub async fn get(&self, key: &Key) -> Result<Option<Bytes>> {
        let p = self.obj(&key.path());
        self.traffic.request(0);
        let r = match self.store.get(&p).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("GET s3 object {p}")),
        };
        if r.meta.size > key.max_len() {
            bail!(
                "{key} (s3 object {p}) is {} bytes, over the {}-byte limit for its kind",
                r.meta.size,
                key.max_len()
            );
        }
        let b = r
            .bytes()
            .await
            .with_context(|| format!("reading s3 object {p}"))?;
        if b.len() as u64 > key.max_len() {
            bail!("{key} (s3 object {p}) is over the size limit for its kind");
        }
        self.traffic.received(b.len() as u64);
        Ok(Some(b))
    }

    /// Fetches `len` bytes at `start` of an object with one ranged GET; the
    /// answer must be exactly those bytes.
    pub async fn get_range(&self, key: &Key, start: u64, len: u64) -> Result<Option<Bytes>> {
        let p = self.obj(&key.path());
        if len == 0 || len > key.max_len() {
            bail!("a read of {len} bytes of {key} is outside its kind's limits");
        }
        self.traffic.request(0);
        let b = match self.store.get_range(&p, start..start + len).await {
            Ok(b) => b,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => {
                return Err(e).with_context(|| format!("GET s3 object {p} bytes {start}+{len}"))
            }
        };
        self.traffic.received(b.len() as u64);
        if b.len() as u64 != len {
            bail!(
                "s3 object {p}: asked for {len} bytes at {start}, got {}",
                b.len()
            );
        }
        Ok(Some(b))
    }

    /// The objects directly in `dir` (`index`, `snapshots`), as paths
    /// relative to the prefix.
    pub async fn list(&self, dir: &str) -> Result<Vec<String>> {
        let p = self.obj(dir);
        let metas: Vec<_> = self
            .store
            .list(Some(&p))
            .try_collect()
            .await
            .with_context(|| format!("LIST s3 prefix {p}"))?;
        // One request per 1000 objects listed.
        for _ in 0..metas.len().div_ceil(1000).max(1) {
            self.traffic.request(0);
        }
        let skip = if self.prefix.is_empty() {
            0
        } else {
            self.prefix.len() + 1
        };
        let mut out: Vec<String> = metas
            .into_iter()
            .filter_map(|m| m.location.as_ref().get(skip..).map(str::to_string))
            .filter(|name| name.rsplit_once('/').is_some_and(|(d, _)| d == dir))
            .collect();
        out.sort();
        Ok(out)
    }

    /// Deletes an object (absent is fine).
    pub async fn delete(&self, key: &Key) -> Result<()> {
        let p = self.obj(&key.path());
        self.traffic.request(0);
        match self.store.delete(&p).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e).with_context(|| format!("DELETE s3 object {p}")),
        }
    }

    /// Stores an object with one PUT.
    pub async fn put(&self, key: &Key, data: Bytes) -> Result<()> {
        let p = self.obj(&key.path());
        self.traffic.request(data.len() as u64);
        self.store
            .put(&p, PutPayload::from_bytes(data))
            .await
            .with_context(|| format!("PUT s3 object {p}"))?;
        Ok(())
    }

    /// Which of `keys` exist.
    pub async fn has(&self, keys: &[Key]) -> Result<Vec<bool>> {
        let chunks = keys.iter().filter(|k| matches!(k, Key::Chunk(_))).count();
        if chunks > LIST_THRESHOLD {
            let listed = self.list_fanouts(keys).await?;
            let mut out = Vec::with_capacity(keys.len());
            for k in keys {
                out.push(match k {
                    Key::Chunk(_) => listed.contains(&k.path()),
                    _ => self.head(k).await?,
                });
            }
            return Ok(out);
        }
        futures::stream::iter(keys)
            .map(|k| self.head(k))
            .buffered(HAS_CONCURRENCY)
            .try_collect()
            .await
    }

    async fn head(&self, key: &Key) -> Result<bool> {
        let p = self.obj(&key.path());
        self.traffic.request(0);
        match self.store.head(&p).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("HEAD s3 object {p}")),
        }
    }

    /// Paths (relative to the prefix) of every object in the fan-out
    /// directories the chunk keys fall in.
    async fn list_fanouts(&self, keys: &[Key]) -> Result<HashSet<String>> {
        let dirs: BTreeSet<String> = keys
            .iter()
            .filter(|k| matches!(k, Key::Chunk(_)))
            .map(|k| {
                let p = k.path();
                p[..p.rfind('/').unwrap()].to_string()
            })
            .collect();
        let skip = if self.prefix.is_empty() {
            0
        } else {
            self.prefix.len() + 1
        };
        let lists = futures::stream::iter(dirs)
            .map(|d| async move {
                let p = self.obj(&d);
                self.traffic.request(0);
                let metas: Vec<_> = self
                    .store
                    .list(Some(&p))
                    .try_collect()
                    .await
                    .with_context(|| format!("LIST s3 prefix {p}"))?;
                anyhow::Ok(metas)
            })
            .buffer_unordered(HAS_CONCURRENCY)
            .try_collect::<Vec<_>>()
            .await?;
        Ok(lists
            .into_iter()
            .flatten()
            .filter_map(|m| m.location.as_ref().get(skip..).map(str::to_string))
            .collect())
    }
}
