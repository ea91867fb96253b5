//! Snapshots as the node sees them: listed (with the ones being written),
//! created from an image, deleted with forkd's dependents rules
//! (refuse, cascade, force), inspected, compacted.
//!
//! Invariants:
//! - a tag is written by one operation at a time (`Node::claim_tag`), and
//!   is listed `writing` until that operation is done;
//! - a snapshot is deleted only after its pools stopped refilling, their
//!   restores in flight ended and their parked children are gone (they
//!   map its files); on failure the pools are set back;
//! - a workspace's recorded state is never deleted under it.

use crate::error::{check_tag, Error, Kind, Result};
use crate::node::Node;
use crate::teardown::destroy_pooled;
use forkd_api::{CreateSnapshotBody, SnapshotInfo};
use forkd_layers::{SnapshotRecord, StoreView};
use forkd_snapshot::create::{create as create_snapshot, CreateSpec, ImageSource};
use forkd_snapshot::delete::Dependents;
use forkd_snapshot::info::{FileDetail, Link};
use forkd_vmm::Lifetime;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// The files a restorable snapshot must have.
const REQUIRED: [&str; 3] = ["memory.bin", "vmstate", "rootfs.img"];

/// forkd's `SnapshotInfo` for a committed snapshot.
pub(crate) fn info_of(
    mount: &std::path::Path,
    view: &StoreView,
    tag: &str,
    rec: &SnapshotRecord,
) -> SnapshotInfo {
    let missing: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|f| !rec.files.contains_key(*f))
        .collect();
    let lin = |k: &str| rec.lineage.get(k);
    SnapshotInfo {
        tag: tag.to_string(),
        dir: mount
            .join("by-id")
            .join(rec.id.to_string())
            .display()
            .to_string(),
        created_at_unix: rec.created_at_unix,
        branched_from: lin("branched_from")
            .and_then(Value::as_str)
            .map(String::from),
        pause_ms: lin("pause_ms").and_then(Value::as_f64).map(whole_ms),
        diff_ms: lin("diff_ms").and_then(Value::as_f64).map(whole_ms),
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

/// A duration in ms as the API reports it: whole ms, rounded up, so a
/// pause that happened never reads 0 (forkd's fields are integers).
pub(crate) fn whole_ms(ms: f64) -> u64 {
    ms.max(0.0).ceil() as u64
}

/// Every tagged snapshot, plus `status: writing` entries for creates and
/// branches in flight.
pub(crate) async fn list(n: &Arc<Node>) -> Result<Vec<SnapshotInfo>> {
    let mount = n.mount.clone();
    let mut out = n
        .read(move |v| {
            let mut out = Vec::new();
            for (tag, id) in v.tags()? {
                if let Some(rec) = v.snapshot(&id)? {
                    out.push(info_of(&mount, v, &tag, &rec));
                }
            }
            Ok(out)
        })
        .await?;
    for tag in n.writing() {
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
    Ok(out)
}

/// A `SnapshotInfo` with only the tag set (for snapshots still being written).
pub(crate) fn empty_info(tag: &str) -> SnapshotInfo {
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

/// Resolves a tag through the read view; [`Error::NotFound`] when unknown.
pub(crate) async fn resolve(n: &Arc<Node>, tag: &str) -> Result<SnapshotRecord> {
    check_tag(tag)?;
    let t = tag.to_string();
    n.read(move |v| Ok(v.resolve(&t)?))
        .await?
        .ok_or_else(|| Error::not_found(Kind::Snapshot, tag))
}

/// Every tag and the snapshot it names (none in flight).
pub(crate) async fn tags(n: &Arc<Node>) -> Result<Vec<(String, forkd_layers::SnapshotId)>> {
    let writing = n.writing();
    let all = n.read(|v| Ok(v.tags()?)).await?;
    Ok(all
        .into_iter()
        .filter(|(t, _)| !writing.contains(t))
        .collect())
}

/// Whether a tag exists, through the read view.
pub(crate) async fn tag_exists(n: &Arc<Node>, tag: &str) -> Result<bool> {
    let t = tag.to_string();
    n.read(move |v| Ok(v.tag(&t)?.is_some())).await
}

/// [`info_of`] on a blocking thread.
pub(crate) async fn info_of_async(
    n: &Arc<Node>,
    tag: &str,
    rec: &SnapshotRecord,
) -> Result<SnapshotInfo> {
    let (mount, tag, rec) = (n.mount.clone(), tag.to_string(), rec.clone());
    n.read(move |v| Ok(info_of(&mount, v, &tag, &rec))).await
}

/// A path a caller named: it must exist and lie inside the data dir or a
/// configured `allowed_paths` entry, after resolving symlinks and `..`.
fn allowed_path(n: &Node, what: &'static str, p: &str) -> Result<PathBuf> {
    let real = std::fs::canonicalize(p)
        .map_err(|e| Error::invalid(what, format!("{what} path {p:?}: {e}")))?;
    let roots = std::iter::once(n.paths.home.clone()).chain(n.cfg.allowed_paths.iter().cloned());
    let inside = roots
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .any(|r| real.starts_with(&r));
    if !inside {
        return Err(Error::invalid(
            what,
            format!(
                "{what} path {p:?} is outside the data dir and allowed_paths; poold reads only files it is configured to"
            ),
        ));
    }
    if !real.is_file() {
        return Err(Error::invalid(
            what,
            format!("{what} path {p:?} is not a file"),
        ));
    }
    Ok(real)
}

/// Boots a parent from an image (or rootfs), warms it up, snapshots it as
/// `b.tag`. An image not built or a spec no VM can be is
/// [`Error::Invalid`]; a failed boot is internal, with the console tail.
pub(crate) async fn create(n: &Arc<Node>, b: CreateSnapshotBody) -> Result<SnapshotInfo> {
    check_tag(&b.tag)?;
    let _slot = n.snapshot_slots.clone().try_acquire_owned().map_err(|_| {
        Error::AtCapacity(format!(
            "{} snapshot creations are in flight (snapshot_concurrency); retry later",
            n.cfg.snapshot_concurrency
        ))
    })?;
    n.check_headroom("snapshot create")?;
    if b.boot_wait_secs.is_some_and(|s| s > 60) {
        return Err(Error::invalid(
            "boot_wait_secs",
            "boot_wait_secs must be ≤ 60",
        ));
    }
    if b.tap.is_some() {
        return Err(Error::invalid(
            "tap",
            "tap: forkd makes each child's tap itself; ask for a networked snapshot with \"net\": true",
        ));
    }
    let image = match (&b.image, &b.rootfs, &b.kernel) {
        (Some(name), None, None) => ImageSource::Named(name.clone()),
        (None, Some(rootfs), kernel) => ImageSource::Files {
            rootfs: allowed_path(n, "rootfs", rootfs)?,
            kernel: kernel
                .as_deref()
                .map(|k| allowed_path(n, "kernel", k))
                .transpose()?,
        },
        (Some(_), _, _) => {
            return Err(Error::invalid(
                "image",
                "give either image or rootfs (+ kernel), not both",
            ))
        }
        (None, None, _) => {
            return Err(Error::invalid(
                "image",
                "missing image (a name from `forkd image ls`) or rootfs path",
            ))
        }
    };
    let volumes = crate::volumes::accept(&n.cfg.volume_roots, &b.volumes)?;
    let ca = b
        .ca_certs
        .as_deref()
        .map(|t| forkd_snapshot::ca::CaBundle::parse(t, "ca_certs"))
        .transpose()
        .map_err(|e| Error::invalid("ca_certs", e.to_string()))?;
    if tag_exists(n, &b.tag).await? {
        return Err(Error::invalid(
            "tag",
            format!("snapshot {:?} already exists; DELETE first", b.tag),
        ));
    }
    let _claim = n
        .claim_tag(&b.tag)
        .ok_or_else(|| Error::Conflict(format!("snapshot {:?} is being written", b.tag)))?;
    let net = match &image {
        ImageSource::Named(name) => {
            forkd_snapshot::create::default_net(name, b.net == Some(true), b.net == Some(false))
        }
        ImageSource::Files { .. } => b.net == Some(true),
    };
    let spec = CreateSpec {
        tag: b.tag.clone(),
        net,
        image,
        mem_mib: b.mem_mib.unwrap_or(512),
        vcpus: b.vcpus.unwrap_or(1),
        accel: n.accel,
        warmup_cmd: b.warmup.clone(),
        eval_warmup: b.eval_warmup.clone(),
        replace_tag: false,
        lifetime: Lifetime::Ephemeral,
        verbose: false,
        volumes,
        ca,
    };
    let made = create_snapshot(&n.paths, spec).await?;
    info_of_async(n, &b.tag, &made.record).await
}

/// Deletes snapshot `tag` with forkd's rules: refused while it has
/// dependents, unless `cascade` (delete them too, leaves first) or `force`
/// (keep them, orphaned).
pub(crate) async fn delete(n: &Arc<Node>, tag: &str, cascade: bool, force: bool) -> Result<()> {
    check_tag(tag)?;
    if cascade && force {
        return Err(Error::invalid("cascade", "use cascade or force, not both"));
    }
    let deps = Dependents::from_flags(cascade, force);
    let rec = resolve(n, tag).await?;
    delete_record(n, rec, tag, deps).await
}

/// Deletes exactly snapshot `id` (with every tag naming it, wherever
/// they moved since it was chosen), never another one its tags name now:
/// the store deletes it by id. Refused without touching any pool while a
/// sandbox spawned from it lives ([`Error::Conflict`]); `Ok(false)` when
/// it is gone already.
pub(crate) async fn delete_exact(n: &Arc<Node>, id: forkd_layers::SnapshotId) -> Result<bool> {
    let Some(rec) = n.read(move |v| Ok(v.snapshot(&id)?)).await? else {
        return Ok(false);
    };
    let key = id.to_string();
    let live = n
        .list()
        .into_iter()
        .filter(|s| s.snapshot_id == key)
        .count();
    if live > 0 {
        return Err(Error::Conflict(format!(
            "{live} sandbox(es) spawned from snapshot {key} still run"
        )));
    }
    delete_record(n, rec, &key, Dependents::Refuse).await?;
    Ok(true)
}

/// Deletes snapshot `rec` (named `tag`) and, with cascade, its dependents:
/// refuses dependents first, then stops refilling the pools of every tag
/// about to go, waits for their restores in flight, destroys their parked
/// children, and deletes from the store. On failure the pools are restored.
pub(crate) async fn delete_record(
    n: &Arc<Node>,
    rec: SnapshotRecord,
    tag: &str,
    deps: Dependents,
) -> Result<()> {
    let cascade = deps == Dependents::Cascade;
    let tag = tag.to_string();
    // Everything about to go: its ids and tags. Dependents are refused
    // before any pool is touched.
    let (ids, tags, dependents) = n
        .read(move |v| {
            let mut ids = vec![rec.id];
            if cascade {
                let mut i = 0;
                while i < ids.len() {
                    ids.extend(v.dependents(&ids[i])?);
                    i += 1;
                }
            }
            let mut tags = Vec::new();
            for id in &ids {
                tags.extend(v.tags_of(id)?);
            }
            let deps: Vec<String> = v
                .dependents(&rec.id)?
                .iter()
                .map(|c| forkd_snapshot::info::label(v, c))
                .collect();
            Ok((ids, tags, deps))
        })
        .await?;
    if deps == Dependents::Refuse && !dependents.is_empty() {
        return Err(Error::Conflict(format!(
            "snapshot {tag} has dependent snapshots: {}; delete them first, or use cascade (delete them too) or force (keep them, orphaned)",
            dependents.join(", ")
        )));
    }
    n.state
        .read(|s| crate::workspace::record::refuse_deleting_states(s.workspaces.values(), &tags))?;
    // Pooled children map the snapshots: stop refilling their pools, wait
    // for restores in flight, and destroy every ready child of them.
    let id_strings: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let saved: Vec<_> = tags.iter().map(|t| (t.clone(), n.pools.spec(t))).collect();
    let mut doomed = Vec::new();
    for t in &tags {
        doomed.extend(n.pools.set(t, None));
    }
    n.pools
        .wait_refills_done(&tags, std::time::Duration::from_secs(60))
        .await;
    doomed.extend(n.pools.drain_snapshots(&id_strings));
    let vm_ids: Vec<String> = doomed.iter().map(|v| v.record.vm_id.clone()).collect();
    futures::future::join_all(doomed.into_iter().map(|v| destroy_pooled(n, v))).await;
    n.state
        .commit(move |s| {
            for id in &vm_ids {
                s.pooled.remove(id);
            }
        })
        .await?;
    let p = n.paths.clone();
    let t = tag.clone();
    let result = forkd_snapshot::store::with_rw(&n.paths, move |store| {
        forkd_snapshot::delete::delete(&p, store, &t, deps)
    })
    .await;
    match result {
        Ok(_) => {
            n.gc_wake.notify_one();
            // The pools of deleted tags go with them.
            n.state
                .commit(move |s| {
                    for t in &tags {
                        s.pools.remove(t);
                    }
                })
                .await?;
            Ok(())
        }
        Err(e) => {
            for (t, spec) in saved {
                n.pools.set(&t, spec);
            }
            n.refill_wake.notify_one();
            Err(e.into())
        }
    }
}

/// What the node knows of one snapshot: forkd's fields (sizes, parent,
/// chain depth, dependents, ancestors) and ours (the chain with each
/// link's unique bytes, files, config, lineage).
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotDetails {
    pub tag: String,
    /// Its directory on the forkd-fs mount.
    pub dir: PathBuf,
    pub created_at_unix: u64,
    pub memory_logical_bytes: u64,
    /// `memory.bin` less its zero pages.
    pub memory_physical_bytes: u64,
    pub vmstate_bytes: u64,
    pub parent_tag: Option<String>,
    pub parent_content_hash: Option<String>,
    pub chain_depth: usize,
    pub dependents: Vec<String>,
    /// Tags (else ids) of its ancestors, root first.
    pub ancestors: Vec<String>,
    pub id: String,
    /// Its ancestors and itself, with the bytes each link alone stores.
    pub chain: Vec<Link>,
    pub stored_unique_bytes: u64,
    pub files: BTreeMap<String, FileDetail>,
    pub config: Value,
    pub lineage: BTreeMap<String, Value>,
}

/// [`SnapshotDetails`] of `tag`.
pub(crate) async fn details(n: &Arc<Node>, tag: &str) -> Result<SnapshotDetails> {
    let rec = resolve(n, tag).await?;
    let (mount, tag) = (n.mount.clone(), tag.to_string());
    n.read(move |v| {
        let det = forkd_snapshot::info::detail(v, &rec)?;
        let mem = rec.files.get("memory.bin");
        let mem_zero = det.files.get("memory.bin").map_or(0, |f| f.zero_bytes);
        let ancestors: Vec<String> = det
            .ancestors
            .iter()
            .map(|l| l.tags.first().cloned().unwrap_or_else(|| l.id.clone()))
            .collect();
        let mut chain = det.ancestors.clone();
        chain.push(det.this.clone());
        Ok(SnapshotDetails {
            tag,
            dir: mount.join("by-id").join(rec.id.to_string()),
            created_at_unix: rec.created_at_unix,
            memory_logical_bytes: mem.map_or(0, |f| f.size),
            memory_physical_bytes: mem.map_or(0, |f| f.size.saturating_sub(mem_zero)),
            vmstate_bytes: rec.files.get("vmstate").map_or(0, |f| f.size),
            parent_tag: rec.parent.map(|p| forkd_snapshot::info::label(v, &p)),
            parent_content_hash: rec.parent.map(|p| p.to_string()),
            chain_depth: det.chain_depth,
            dependents: det.dependents,
            ancestors,
            id: det.id,
            chain,
            stored_unique_bytes: det.this.unique_stored_bytes,
            files: det.files,
            config: det.config,
            lineage: det.lineage,
        })
    })
    .await
}

/// A standalone copy `to` of chain head `tag`. It moves no data: every
/// manifest is already flattened, so the copy is a new record naming the
/// same manifests, without a parent.
pub(crate) async fn compact(n: &Arc<Node>, tag: &str, to: &str) -> Result<SnapshotInfo> {
    check_tag(tag)?;
    check_tag(to)?;
    if to == tag {
        return Err(Error::invalid(
            "to",
            "to must differ from the snapshot's tag",
        ));
    }
    let rec = resolve(n, tag).await?;
    let _claim = n
        .claim_tag(to)
        .ok_or_else(|| Error::Conflict(format!("snapshot {to:?} is being written")))?;
    let (to2, from) = (to.to_string(), tag.to_string());
    let new = forkd_snapshot::store::with_rw(&n.paths, move |store| {
        if store.tag(&to2)?.is_some() {
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
            tag: Some(to2),
            replace_tag: false,
        })?))
    })
    .await?
    .ok_or_else(|| Error::Conflict(format!("snapshot {to:?} already exists")))?;
    info_of_async(n, to, &new).await
}

/// The number of tagged snapshots (the `forkd_snapshots_total` gauge).
pub(crate) async fn count(n: &Arc<Node>) -> Result<usize> {
    n.read(|v| Ok(v.tags()?.len())).await
}
