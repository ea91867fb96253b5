//! E2B snapshots on forkd's branches: `sbx.create_snapshot()`,
//! `Sandbox.list_snapshots()`, `Sandbox.delete_snapshot(id)`, and
//! `Sandbox.create(snapshot_id)` (a create from a template, which is a
//! snapshot tag here).
//!
//! | route | what |
//! |---|---|
//! | `POST /sandboxes/{id}/snapshots` | branch the sandbox into snapshot `name` (default `e2b-snap-<hex>`); it runs on |
//! | `GET /snapshots` | the snapshots branched from sandboxes (not `fork`'s), newest first; `sandboxID`, `name`, `limit`, `nextToken` |
//! | `DELETE /templates/{id}` | delete a snapshot (404 when there is none) |
//!
//! Invariants:
//! - A snapshot's id is its tag: what `Sandbox.create` takes as template.
//! - A snapshot holds memory and disk together; a filesystem-only one
//!   (`mode="filesystem"`, `memory: false`) is refused with 400, as E2B
//!   answers where the feature is off, never taken as a full one.
//! - A `name` already taken is refused (409) rather than moved: a tag other
//!   sandboxes or pools spawn from never changes under them.
//! - `fork`'s own snapshots (`e2b-fork-*`) are reclaimed by the node and
//!   are not listed.

use crate::control::bad;
use crate::error::{E2bError, E2bResult};
use crate::state::E2b;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use forkd_api::{BranchBody, SnapshotInfo};
use forkd_edge::paging::{self, MAX_PAGE};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// Tags of snapshots `create_snapshot` names itself.
pub const SNAPSHOT_PREFIX: &str = "e2b-snap-";
/// Tags of `fork`'s snapshots (reclaimed by the node, never listed).
pub const FORK_PREFIX: &str = "e2b-fork-";

type R<T> = E2bResult<T>;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    #[serde(default)]
    name: Option<String>,
    /// false: filesystem only.
    #[serde(default)]
    memory: Option<bool>,
}

fn snapshot_json(tag: &str) -> Value {
    json!({"snapshotID": tag, "names": [tag]})
}

/// A snapshot as `GET /snapshots` lists it: with forkd's `createdAt`
/// (RFC 3339), which SDKs ignore and the gateway merges nodes' lists by.
fn listed_json(s: &SnapshotInfo) -> Value {
    let mut v = snapshot_json(&s.tag);
    // RFC 3339 ends at year 9999: a record past it (a corrupt one) is
    // listed without the time rather than breaking the list.
    if s.created_at_unix < LAST_RFC3339_SECOND {
        v["createdAt"] = json!(crate::control::rfc3339(s.created_at_unix));
    }
    v
}

/// 10000-01-01T00:00:00Z as Unix seconds.
const LAST_RFC3339_SECOND: u64 = 253_402_300_800;

/// `POST /sandboxes/{id}/snapshots`.
pub async fn create(
    State(e): State<Arc<E2b>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> R<(StatusCode, Json<Value>)> {
    let b: SnapshotBody = if body.iter().all(u8::is_ascii_whitespace) {
        SnapshotBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|err| bad(format!("bad snapshot body: {err}")))?
    };
    if b.memory == Some(false) {
        return Err(bad(
            "filesystem-only snapshots are not supported: poold's snapshots hold memory and disk together; leave mode unset (or \"full\")",
        ));
    }
    e.sandbox_or_404(&id)?;
    let tag = match b.name.filter(|n| !n.is_empty()) {
        Some(n) => {
            forkd_node::error::check_tag(&n).map_err(E2bError::from)?;
            if n.starts_with(FORK_PREFIX) {
                return Err(bad(format!(
                    "snapshot names starting with {FORK_PREFIX:?} are fork's own; pick another"
                )));
            }
            if e.node.snapshot_details(&n).await.is_ok() {
                return Err(E2bError::new(
                    StatusCode::CONFLICT,
                    format!("a snapshot named {n:?} exists: delete it first (Sandbox.delete_snapshot) or pick another name"),
                ));
            }
            n
        }
        None => format!("{SNAPSHOT_PREFIX}{}", forkd_snapshot::random_hex(8)),
    };
    let body = BranchBody {
        tag: Some(tag.clone()),
        ..Default::default()
    };
    e.node.branch(&id, body).await?;
    Ok((StatusCode::CREATED, Json(snapshot_json(&tag))))
}

/// What `GET /snapshots` filters on.
#[derive(Debug, Default, PartialEq)]
struct Query {
    sandbox: Option<String>,
    name: Option<String>,
    limit: usize,
    next: Option<String>,
}

fn parse_query(q: Option<&str>) -> R<Query> {
    let mut out = Query {
        limit: MAX_PAGE,
        ..Default::default()
    };
    for (k, v) in form_urlencoded::parse(q.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "sandboxID" => out.sandbox = Some(v.into_owned()),
            "name" => out.name = Some(v.into_owned()),
            "limit" => out.limit = paging::parse_limit(&v).map_err(bad)?,
            "nextToken" => out.next = Some(v.into_owned()),
            _ => {}
        }
    }
    Ok(out)
}

/// The snapshots `GET /snapshots` shows, in its order: branched from a
/// sandbox, not fork's nor a pause's (`ws-<sandbox>-s<N>`, the node's
/// workspace state tags), matching the query's sandbox and name; newest
/// first, then by tag.
fn listed(mut all: Vec<SnapshotInfo>, q: &Query) -> Vec<SnapshotInfo> {
    all.retain(|s| {
        let from = s.branched_from.as_deref();
        from.is_some_and(|f| !f.starts_with("compact:") && !s.tag.starts_with(&format!("ws-{f}-s")))
            && !s.tag.starts_with(FORK_PREFIX)
            && q.sandbox.as_deref().is_none_or(|id| from == Some(id))
            && q.name.as_deref().is_none_or(|n| s.tag == n)
    });
    all.sort_by(|a, b| {
        b.created_at_unix
            .cmp(&a.created_at_unix)
            .then_with(|| a.tag.cmp(&b.tag))
    });
    all
}

/// `GET /snapshots`: `x-next-token` names the last tag of a full page.
pub async fn list(State(e): State<Arc<E2b>>, RawQuery(q): RawQuery) -> R<Response> {
    let q = parse_query(q.as_deref())?;
    let all = listed(e.node.snapshots().await?, &q);
    let start = paging::start_after(
        all.iter().map(|s| s.tag.as_str()),
        q.next.as_deref(),
        "snapshot",
    )
    .map_err(bad)?;
    let rest = &all[start.min(all.len())..];
    let page: Vec<Value> = rest.iter().take(q.limit).map(listed_json).collect();
    let more_after = (rest.len() > q.limit).then(|| rest[q.limit - 1].tag.as_str());
    Ok(paging::reply(page, more_after))
}

/// `DELETE /templates/{id}`: deletes the snapshot (its children and pool
/// rules are the node's: one still in use is refused with the reason).
pub async fn delete(State(e): State<Arc<E2b>>, Path(id): Path<String>) -> R<StatusCode> {
    e.node.delete_snapshot(&id, false, false).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(tag: &str, from: Option<&str>, at: u64) -> SnapshotInfo {
        let mut s: SnapshotInfo = serde_json::from_value(json!({
            "tag": tag, "dir": "/d", "created_at_unix": at, "status": "ready", "bootable": true,
        }))
        .unwrap();
        s.branched_from = from.map(String::from);
        s
    }

    /// A time RFC 3339 cannot write (a corrupt record) leaves the list
    /// whole, that snapshot without `createdAt`.
    #[test]
    fn listed_times_are_rfc3339_or_left_out() {
        let v = listed_json(&snap("a", Some("sb-a"), 1_764_324_000));
        assert_eq!(v["createdAt"], "2025-11-28T10:00:00Z");
        for far in [LAST_RFC3339_SECOND, u64::MAX] {
            let v = listed_json(&snap("b", Some("sb-a"), far));
            assert!(v.get("createdAt").is_none(), "{v}");
        }
    }

    #[test]
    fn only_branches_of_sandboxes_newest_first() {
        let all = vec![
            snap("base", None, 1),
            snap("e2b-snap-1", Some("sb-a"), 5),
            snap("mine", Some("sb-b"), 7),
            snap("e2b-fork-1", Some("sb-a"), 9),
            snap("c", Some("compact:base"), 9),
            // A pause's state.
            snap("ws-sb-b-s1", Some("sb-b"), 9),
        ];
        let tags = |q: &Query| -> Vec<String> {
            listed(all.clone(), q).into_iter().map(|s| s.tag).collect()
        };
        let q = parse_query(None).unwrap();
        assert_eq!(tags(&q), ["mine", "e2b-snap-1"]);
        let q = parse_query(Some("sandboxID=sb-a")).unwrap();
        assert_eq!(tags(&q), ["e2b-snap-1"]);
        let q = parse_query(Some("name=mine&limit=1")).unwrap();
        assert_eq!((tags(&q), q.limit), (vec!["mine".to_string()], 1));
        assert!(parse_query(Some("limit=0")).is_err());
    }
}
