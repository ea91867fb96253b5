//! `/v1/snapshots`: list, create (a warm snapshot of an image), delete
//! (forkd's 409 / cascade / force rules), info and compact.

use crate::daemon::error::{check_tag, detached, ApiError, ApiResult};
use crate::daemon::Daemon;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_api::{CreateSnapshotBody, SnapshotInfo};
use forkd_layers::{SnapshotRecord, StoreView};
use forkd_snapshot::create::{create, CreateSpec, ImageSource};
use forkd_snapshot::delete::Dependents;
use forkd_vmm::Lifetime;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

type D = State<Arc<Daemon>>;

/// The files a restorable snapshot must have.
const REQUIRED: [&str; 3] = ["memory.bin", "vmstate", "rootfs.img"];

/// forkd's `SnapshotInfo` for a committed snapshot.
pub fn info_of(d: &Daemon, view: &StoreView, tag: &str, rec: &SnapshotRecord) -> SnapshotInfo {
    let missing: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|f| !rec.files.contains_key(*f))
        .collect();
    let lin = |k: &str| rec.lineage.get(k);
    SnapshotInfo {
        tag: tag.to_string(),
        dir: d
            .mount
            .join("by-id")
            .join(rec.id.to_string())
            .display()
            .to_string(),
        created_at_unix: rec.created_at_unix,
        branched_from: lin("branched_from")
            .and_then(Value::as_str)
            .map(String::from),
        pause_ms: lin("pause_ms").and_then(Value::as_f64),
        diff_ms: lin("diff_ms").and_then(Value::as_f64),
        diff_physical_bytes: lin("diff_physical_bytes").and_then(Value::as_u64),
        diff_logical_bytes: lin("diff_logical_bytes").and_then(Value::as_u64),
        warning: (!missing.is_empty())
            .then(|| format!("snapshot is not bootable: missing {}", missing.join(", "))),
        status: if missing.is_empty() {
            "ready"
        } else {
            "failed"
        }
        .into(),
        bootable: missing.is_empty(),
        id: Some(rec.id.to_string()),
        parent_tag: rec.parent.map(|p| forkd_snapshot::info::label(view, &p)),
        image: rec
            .config
            .get("image")
            .and_then(Value::as_str)
            .map(String::from),
    }
}

/// `GET /v1/snapshots`.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    responses((status = 200, description = "Tagged snapshots, plus `status: writing` entries for creates and branches in flight", body = Vec<SnapshotInfo>)))]
pub async fn list(State(d): D) -> ApiResult<Json<Vec<SnapshotInfo>>> {
    let d2 = d.clone();
    let mut out = d
        .read(move |v| {
            let mut out = Vec::new();
            for (tag, id) in v.tags()? {
                if let Some(rec) = v.snapshot(&id)? {
                    out.push(info_of(&d2, v, &tag, &rec));
                }
            }
            Ok(out)
        })
        .await
        .map_err(ApiError::from_anyhow)?;
    let writing: Vec<String> = d.writing.lock().unwrap().iter().cloned().collect();
    for tag in writing {
        // Stored but its branch or create not finished (its concurrency
        // slot still held): "ready" only once the work is done.
        if let Some(s) = out.iter_mut().find(|s| s.tag == tag) {
            s.status = "writing".into();
        } else {
            out.push(SnapshotInfo {
                dir: String::new(),
                created_at_unix: forkd_snapshot::unix_now(),
                status: "writing".into(),
                bootable: false,
                ..empty_info(&tag)
            });
        }
    }
    Ok(Json(out))
}

/// A `SnapshotInfo` with only the tag set (for snapshots still being written).
pub fn empty_info(tag: &str) -> SnapshotInfo {
    SnapshotInfo {
        tag: tag.to_string(),
        dir: String::new(),
        created_at_unix: 0,
        branched_from: None,
        pause_ms: None,
        diff_ms: None,
        diff_physical_bytes: None,
        diff_logical_bytes: None,
        warning: None,
        status: "ready".into(),
        bootable: true,
        id: None,
        parent_tag: None,
        image: None,
    }
}

/// Resolves a tag through the read view; 404 when unknown.
pub async fn resolve(d: &Arc<Daemon>, tag: &str) -> ApiResult<SnapshotRecord> {
    check_tag(tag)?;
    let t = tag.to_string();
    d.read(move |v| Ok(v.resolve(&t)?))
        .await
        .map_err(ApiError::from_anyhow)?
        .ok_or_else(|| ApiError::not_found(format!("snapshot {tag:?} not found")))
}

/// Whether a tag exists, through the read view.
pub async fn tag_exists(d: &Arc<Daemon>, tag: &str) -> ApiResult<bool> {
    let t = tag.to_string();
    d.read(move |v| Ok(v.tag(&t)?.is_some()))
        .await
        .map_err(ApiError::from_anyhow)
}

/// [`info_of`] on a blocking thread.
pub async fn info_of_async(
    d: &Arc<Daemon>,
    tag: &str,
    rec: &SnapshotRecord,
) -> ApiResult<SnapshotInfo> {
    let (d2, tag, rec) = (d.clone(), tag.to_string(), rec.clone());
    d.read(move |v| Ok(info_of(&d2, v, &tag, &rec)))
        .await
        .map_err(ApiError::from_anyhow)
}

/// A path an API caller named: it must exist and lie inside the data dir or
/// a configured `allowed_paths` entry, after resolving symlinks and `..`.
fn allowed_path(d: &Daemon, what: &str, p: &str) -> ApiResult<std::path::PathBuf> {
    let real = std::fs::canonicalize(p)
        .map_err(|e| ApiError::bad_request(format!("{what} path {p:?}: {e}")))?;
    let roots = std::iter::once(d.paths.home.clone()).chain(d.cfg.allowed_paths.iter().cloned());
    let inside = roots
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .any(|r| real.starts_with(&r));
    if !inside {
        return Err(ApiError::bad_request(format!(
            "{what} path {p:?} is outside the data dir and allowed_paths; poold reads only files it is configured to"
        )));
    }
    if !real.is_file() {
        return Err(ApiError::bad_request(format!(
            "{what} path {p:?} is not a file"
        )));
    }
    Ok(real)
}

/// `POST /v1/snapshots`: boots a parent, warms it up, snapshots it.
#[utoipa::path(post, path = "/v1/snapshots", tag = "snapshots",
    request_body = CreateSnapshotBody,
    responses(
        (status = 201, description = "The warm snapshot is in the store", body = SnapshotInfo),
        (status = 400, description = "A bad or existing tag, no image/rootfs or both, a path outside the data dir, an unknown image", body = forkd_api::ErrorBody),
        (status = 409, description = "The tag is being written", body = forkd_api::ErrorBody),
        (status = 503, description = "snapshot_concurrency creations in flight, or under the memory/disk floor", body = forkd_api::ErrorBody),
        (status = 500, description = "The boot or warm-up failed (the message has the console tail)", body = forkd_api::ErrorBody),
    ))]
pub async fn create_snapshot(
    State(d): D,
    Json(b): Json<CreateSnapshotBody>,
) -> ApiResult<(StatusCode, Json<SnapshotInfo>)> {
    detached(create_work(d, b)).await
}

async fn create_work(
    d: Arc<Daemon>,
    b: CreateSnapshotBody,
) -> ApiResult<(StatusCode, Json<SnapshotInfo>)> {
    check_tag(&b.tag)?;
    let _slot = d.snapshot_slots.clone().try_acquire_owned().map_err(|_| {
        ApiError::unavailable(format!(
            "{} snapshot creations are in flight (snapshot_concurrency); retry later",
            d.cfg.snapshot_concurrency
        ))
    })?;
    d.check_headroom("snapshot create")?;
    if b.boot_wait_secs.is_some_and(|s| s > 60) {
        return Err(ApiError::bad_request("boot_wait_secs must be ≤ 60"));
    }
    if b.tap.is_some() {
        return Err(ApiError::bad_request(
            "tap: forkd makes each child's tap itself; ask for a networked snapshot with \"net\": true",
        ));
    }
    let image = match (&b.image, &b.rootfs, &b.kernel) {
        (Some(name), None, None) => ImageSource::Named(name.clone()),
        (None, Some(rootfs), kernel) => ImageSource::Files {
            rootfs: allowed_path(&d, "rootfs", rootfs)?,
            kernel: kernel
                .as_deref()
                .map(|k| allowed_path(&d, "kernel", k))
                .transpose()?,
        },
        (Some(_), _, _) => {
            return Err(ApiError::bad_request(
                "give either image or rootfs (+ kernel), not both",
            ))
        }
        (None, None, _) => {
            return Err(ApiError::bad_request(
                "missing image (a name from `forkd image ls`) or rootfs path",
            ))
        }
    };
    let volumes = super::super::volumes::accept(&d.cfg.volume_roots, &b.volumes)?;
    let ca = b
        .ca_certs
        .as_deref()
        .map(|t| forkd_snapshot::ca::CaBundle::parse(t, "ca_certs"))
        .transpose()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    if tag_exists(&d, &b.tag).await? {
        return Err(ApiError::bad_request(format!(
            "snapshot {:?} already exists; DELETE first",
            b.tag
        )));
    }
    let _claim = d
        .claim_tag(&b.tag)
        .ok_or_else(|| ApiError::conflict(format!("snapshot {:?} is being written", b.tag)))?;
    let net = match &image {
        ImageSource::Named(n) => {
            forkd_snapshot::create::default_net(n, b.net == Some(true), b.net == Some(false))
        }
        ImageSource::Files { .. } => b.net == Some(true),
    };
    let spec = CreateSpec {
        tag: b.tag.clone(),
        net,
        image,
        mem_mib: b.mem_mib.unwrap_or(512),
        vcpus: b.vcpus.unwrap_or(1),
        accel: d.accel,
        warmup_cmd: b.warmup.clone(),
        eval_warmup: b.eval_warmup.clone(),
        replace_tag: false,
        lifetime: Lifetime::Ephemeral,
        verbose: false,
        volumes,
        ca,
    };
    // An image not built or a spec no VM can be is a 400 (typed errors,
    // mapped in `daemon::error`); anything else a 500.
    let made = create(&d.paths, spec)
        .await
        .map_err(ApiError::from_anyhow)?;
    let info = info_of_async(&d, &b.tag, &made.record).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// `DELETE /v1/snapshots/:tag`'s query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeleteQuery {
    /// Delete the snapshot's dependents too, leaves first.
    #[serde(default)]
    cascade: Option<String>,
    /// Delete only this one; its children become roots.
    #[serde(default)]
    force: Option<String>,
}

/// A query flag: present and not `false`/`0`.
fn flag(v: &Option<String>) -> bool {
    v.as_deref().is_some_and(|s| !matches!(s, "false" | "0"))
}

/// `DELETE /v1/snapshots/:tag?cascade=&force=`.
#[utoipa::path(delete, path = "/v1/snapshots/{tag}", tag = "snapshots",
    params(("tag" = String, Path, description = "Snapshot tag"), DeleteQuery),
    responses(
        (status = 204, description = "Deleted (its pool drained first)"),
        (status = 400, description = "A bad tag, or both flags", body = forkd_api::ErrorBody),
        (status = 404, description = "No such snapshot", body = forkd_api::ErrorBody),
        (status = 409, description = "It has dependents and no flag, or running sandboxes map it", body = forkd_api::ErrorBody),
    ))]
pub async fn delete_snapshot(
    State(d): D,
    Path(tag): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> ApiResult<StatusCode> {
    detached(delete_work(d, tag, q)).await
}

async fn delete_work(d: Arc<Daemon>, tag: String, q: DeleteQuery) -> ApiResult<StatusCode> {
    check_tag(&tag)?;
    let (cascade, force) = (flag(&q.cascade), flag(&q.force));
    if cascade && force {
        return Err(ApiError::bad_request("use cascade or force, not both"));
    }
    let deps = Dependents::from_flags(cascade, force);
    let rec = resolve(&d, &tag).await?;
    super::super::lifecycle::delete_snapshot(&d, rec, &tag, deps)
        .await
        .map(|()| StatusCode::NO_CONTENT)
}

/// `GET /v1/snapshots/:tag/info`: forkd's fields, plus the chain with the
/// bytes each link really stores.
#[utoipa::path(get, path = "/v1/snapshots/{tag}/info", tag = "snapshots", params(("tag" = String, Path, description = "Snapshot tag")),
    responses(
        (status = 200, description = "forkd's fields (sizes, parent, chain depth, dependents, ancestors) and ours (chain with each link's unique bytes, files, config, lineage)", body = Object),
        (status = 400, description = "A bad tag", body = forkd_api::ErrorBody),
        (status = 404, description = "No such snapshot", body = forkd_api::ErrorBody),
    ))]
pub async fn info(State(d): D, Path(tag): Path<String>) -> ApiResult<Json<Value>> {
    let rec = resolve(&d, &tag).await?;
    let mount = d.mount.clone();
    let v = d
        .read(move |v| {
            let det = forkd_snapshot::info::detail(v, &rec)?;
            let mem = rec.files.get("memory.bin");
            let mem_zero = det.files.get("memory.bin").map_or(0, |f| f.zero_bytes);
            let parent_tag = rec.parent.map(|p| forkd_snapshot::info::label(v, &p));
            let ancestors: Vec<String> = det
                .ancestors
                .iter()
                .map(|l| l.tags.first().cloned().unwrap_or_else(|| l.id.clone()))
                .collect();
            Ok(json!({
                "tag": tag,
                "dir": mount.join("by-id").join(rec.id.to_string()),
                "created_at_unix": rec.created_at_unix,
                "memory_logical_bytes": mem.map_or(0, |f| f.size),
                "memory_physical_bytes": mem.map_or(0, |f| f.size.saturating_sub(mem_zero)),
                "vmstate_bytes": rec.files.get("vmstate").map_or(0, |f| f.size),
                "parent_tag": parent_tag,
                "parent_content_hash": rec.parent.map(|p| p.to_string()),
                "chain_depth": det.chain_depth,
                "dependents": det.dependents,
                "ancestors": ancestors,
                "id": det.id,
                "chain": det.ancestors.iter().chain(std::iter::once(&det.this)).collect::<Vec<_>>(),
                "stored_unique_bytes": det.this.unique_stored_bytes,
                "files": det.files,
                "config": det.config,
                "lineage": det.lineage,
            }))
        })
        .await
        .map_err(ApiError::from_anyhow)?;
    Ok(Json(v))
}

/// `POST /v1/snapshots/:tag/compact`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactBody {
    /// Tag of the standalone copy.
    to: String,
}

/// `POST /v1/snapshots/:tag/compact {to}`: a standalone copy of a chain
/// head. Here it moves no data: every manifest is already flattened, so the
/// copy is a new record naming the same manifests, without a parent.
#[utoipa::path(post, path = "/v1/snapshots/{tag}/compact", tag = "snapshots", params(("tag" = String, Path, description = "Snapshot tag")),
    request_body = CompactBody,
    responses(
        (status = 200, description = "The parentless copy (`branched_from: compact:<tag>`)", body = SnapshotInfo),
        (status = 400, description = "Bad tags, or `to` equal to the tag", body = forkd_api::ErrorBody),
        (status = 404, description = "No such snapshot", body = forkd_api::ErrorBody),
        (status = 409, description = "`to` exists", body = forkd_api::ErrorBody),
    ))]
pub async fn compact(
    State(d): D,
    Path(tag): Path<String>,
    Json(b): Json<CompactBody>,
) -> ApiResult<Json<SnapshotInfo>> {
    detached(compact_work(d, tag, b)).await
}

async fn compact_work(
    d: Arc<Daemon>,
    tag: String,
    b: CompactBody,
) -> ApiResult<Json<SnapshotInfo>> {
    check_tag(&tag)?;
    check_tag(&b.to)?;
    if b.to == tag {
        return Err(ApiError::bad_request(
            "to must differ from the snapshot's tag",
        ));
    }
    let rec = resolve(&d, &tag).await?;
    let _claim = d
        .claim_tag(&b.to)
        .ok_or_else(|| ApiError::conflict(format!("snapshot {:?} is being written", b.to)))?;
    let to = b.to.clone();
    let from = tag.clone();
    let new = forkd_snapshot::store::with_rw(&d.paths, move |store| {
        if store.tag(&to)?.is_some() {
            return Ok(None);
        }
        let mut lineage: BTreeMap<String, Value> = rec.lineage.clone();
        lineage.insert("branched_from".into(), json!(format!("compact:{from}")));
        lineage.insert("compacted_from".into(), json!(rec.id.to_string()));
        Ok(Some(store.commit_snapshot(forkd_layers::NewSnapshot {
            parent: None,
            files: rec.files.clone(),
            config: rec.config.clone(),
            lineage,
            tag: Some(to),
            replace_tag: false,
        })?))
    })
    .await
    .map_err(ApiError::from_anyhow)?
    .ok_or_else(|| ApiError::conflict(format!("snapshot {:?} already exists", b.to)))?;
    let info = info_of_async(&d, &b.to, &new).await?;
    Ok(Json(info))
}
