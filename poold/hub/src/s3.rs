//! A hub on S3-compatible object storage (`s3://bucket/prefix`), through the
//! `object_store` crate.
//!
//! Credentials and endpoint come from the usual environment variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` for non-AWS
//! services; an `http://` endpoint is allowed without `AWS_ALLOW_HTTP`).
//! Every object is one PUT, so readers see it whole or not at all; push
//! writes snapshot records and tags last.
//!
//! Have/want: a few keys are HEADed concurrently; a large chunk batch lists
//! the fan-out directories it touches instead (one LIST per 1000 objects
//! rather than one request per chunk).

use super::layout::Key;
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};
use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

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
}

impl S3Hub {
    /// Opens `bucket` with objects under `prefix`.
    pub fn open(bucket: &str, prefix: &str) -> Result<S3Hub> {
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_retry(RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: 4,
                retry_timeout: Duration::from_secs(60),
            });
        let endpoint = std::env::var("AWS_ENDPOINT_URL")
            .or_else(|_| std::env::var("AWS_ENDPOINT"))
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
        })
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
        Ok(Some(b))
    }

    /// Stores an object with one PUT.
    pub async fn put(&self, key: &Key, data: Bytes) -> Result<()> {
        let p = self.obj(&key.path());
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
