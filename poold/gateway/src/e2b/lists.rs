//! E2B's lists through the gateway: every node's whole list (its pages
//! followed), merged, and paged here as poold pages them
//! ([`forkd_edge::paging`]).

use std::collections::HashSet;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use forkd_edge::paging::{self, MAX_PAGE};
use serde_json::Value;

use super::{e2b_error, E2bFront, F};
use crate::error::GatewayError;
use crate::nodes::{Bound, Node};
use crate::proxy::{read_reply, with_unreachable};

/// Pages read from one node for a merged list.
const MAX_PAGES: usize = 100;

/// A list query: E2B's paging keys, and the rest (filters) as sent.
#[derive(Debug, PartialEq)]
struct Paging {
    limit: usize,
    next: Option<String>,
    filters: Vec<String>,
}

/// The query's paging and filters; Err: what is wrong with it.
fn parse_query(query: Option<&str>) -> Result<Paging, String> {
    let mut p = Paging {
        limit: MAX_PAGE,
        next: None,
        filters: Vec::new(),
    };
    for kv in query.unwrap_or("").split('&').filter(|s| !s.is_empty()) {
        match kv.split_once('=').unwrap_or((kv, "")) {
            ("limit", v) => p.limit = paging::parse_limit(v)?,
            ("nextToken" | "next_token", v) => p.next = Some(v.to_string()),
            _ => p.filters.push(kv.to_string()),
        }
    }
    Ok(p)
}

/// `GET /sandboxes`, `GET /v2/sandboxes`: merged in poold's order (start
/// time, then id).
pub(super) async fn sandboxes(State(f): F, req: Request) -> Response {
    let p = match parse_query(req.uri().query()) {
        Ok(p) => p,
        Err(why) => return e2b_error(StatusCode::BAD_REQUEST, why),
    };
    let (mut all, missing) = match gather(&f, req.uri().path(), &p.filters, req.headers()).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let key = |v: &Value| {
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        (s("startedAt"), s("sandboxID"))
    };
    all.sort_by_key(key);
    with_unreachable(page(&all, "sandboxID", &p, "sandbox"), &missing)
}

/// `GET /snapshots`: every node's, a snapshot held by several once,
/// merged in poold's order (newest first by `createdAt`, then by id), so
/// pages hold still whatever order the nodes answer in.
pub(super) async fn snapshots(State(f): F, req: Request) -> Response {
    let p = match parse_query(req.uri().query()) {
        Ok(p) => p,
        Err(why) => return e2b_error(StatusCode::BAD_REQUEST, why),
    };
    let (mut all, missing) = match gather(&f, req.uri().path(), &p.filters, req.headers()).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    all.sort_by_cached_key(snapshot_order);
    let mut seen = HashSet::new();
    let all: Vec<Value> = all
        .into_iter()
        .filter(|s| {
            seen.insert(
                s.get("snapshotID")
                    .cloned()
                    .unwrap_or(Value::Null)
                    .to_string(),
            )
        })
        .collect();
    with_unreachable(page(&all, "snapshotID", &p, "snapshot"), &missing)
}

/// poold's order of snapshots: newest first (RFC 3339 UTC, so the text
/// orders as the time does; none last), then by id.
fn snapshot_order(v: &Value) -> (std::cmp::Reverse<String>, String) {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    (std::cmp::Reverse(s("createdAt")), s("snapshotID"))
}

/// The page of `all` that `p` asks for; items are named by their `id` key.
fn page<'a>(all: &'a [Value], id: &str, p: &Paging, what: &str) -> Response {
    let name = |v: &'a Value| v.get(id).and_then(Value::as_str).unwrap_or("");
    let start = match paging::start_after(all.iter().map(name), p.next.as_deref(), what) {
        Ok(i) => i,
        Err(why) => return e2b_error(StatusCode::BAD_REQUEST, why),
    };
    let page: Vec<&Value> = all.iter().skip(start).take(p.limit).collect();
    let more_after = (all.len() > start + p.limit)
        .then(|| page.last().map(|l| name(l)))
        .flatten();
    paging::reply(&page, more_after)
}

/// Every E2B node's whole list at `path` with the client's filters, and
/// the names of the nodes that could not be asked. A node's refusal (a
/// bad filter) is the client's answer.
async fn gather(
    f: &E2bFront,
    path: &str,
    filters: &[String],
    h: &HeaderMap,
) -> Result<(Vec<Value>, Vec<String>), Response> {
    let nodes = f.nodes();
    let lists = nodes.iter().map(|n| whole_list(f, n, path, filters, h));
    let mut all = Vec::new();
    let mut missing = f.reg.down().0;
    for (r, n) in futures::future::join_all(lists)
        .await
        .into_iter()
        .zip(&nodes)
    {
        match r {
            Ok(items) => all.extend(items),
            Err(Listing::Unreachable(e)) => {
                tracing::warn!(node = %n.name, error = %e, "E2B list: node left out");
                missing.push(n.name.clone());
            }
            Err(Listing::Refused(r)) => return Err(r),
        }
    }
    Ok((all, missing))
}

/// Why a node's list is not in a merged one.
enum Listing {
    Unreachable(GatewayError),
    Refused(Response),
}

/// One node's whole list, its pages followed (at most [`MAX_PAGES`]).
async fn whole_list(
    f: &E2bFront,
    node: &Node,
    path: &str,
    filters: &[String],
    h: &HeaderMap,
) -> Result<Vec<Value>, Listing> {
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let mut q: Vec<String> = filters.to_vec();
        q.push(format!("limit={MAX_PAGE}"));
        if let Some(t) = &token {
            q.push(format!("nextToken={t}"));
        }
        let pq = format!("{path}?{}", q.join("&"));
        let Some(rb) = f.to_node(node, Bound::Whole, Method::GET, &pq, h) else {
            return Ok(out);
        };
        let r = read_reply(node, rb.send().await)
            .await
            .map_err(Listing::Unreachable)?;
        if !r.status.is_success() {
            return Err(Listing::Refused(r.into_response()));
        }
        let items: Vec<Value> = serde_json::from_slice(&r.body).map_err(|e| {
            Listing::Unreachable(GatewayError::NodeUnreachable {
                node: node.name.clone(),
                why: format!("its E2B list is not a list: {e}"),
            })
        })?;
        out.extend(items);
        match r.headers.get("x-next-token").and_then(|v| v.to_str().ok()) {
            Some(t) => token = Some(t.to_string()),
            None => return Ok(out),
        }
    }
    tracing::warn!(node = %node.name, "E2B list: over {MAX_PAGES} pages; the rest left out");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_split_into_paging_and_filters() {
        let p = parse_query(Some("limit=2&nextToken=sb-1&metadata=a%3Db&state=running")).unwrap();
        assert_eq!(p.limit, 2);
        assert_eq!(p.next.as_deref(), Some("sb-1"));
        assert_eq!(p.filters, ["metadata=a%3Db", "state=running"]);
        assert_eq!(
            parse_query(Some("next_token=x")).unwrap().next.as_deref(),
            Some("x")
        );
        assert!(parse_query(Some("limit=0")).is_err() && parse_query(Some("limit=101")).is_err());
        assert_eq!(parse_query(None).unwrap().limit, MAX_PAGE);
    }

    /// Nodes answering in any order give one order: newest first, then
    /// by id, an older node's snapshots (no `createdAt`) last.
    #[test]
    fn snapshots_merge_in_poolds_order() {
        let snap = |id: &str, at: Option<&str>| match at {
            Some(t) => serde_json::json!({"snapshotID": id, "createdAt": t}),
            None => serde_json::json!({"snapshotID": id}),
        };
        let mut all = [
            snap("old", None),
            snap("b", Some("2026-11-28T10:00:00Z")),
            snap("c", Some("2026-11-28T11:00:00Z")),
            snap("a", Some("2026-11-28T10:00:00Z")),
        ];
        all.sort_by_key(snapshot_order);
        let ids: Vec<&str> = all
            .iter()
            .map(|v| v["snapshotID"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["c", "a", "b", "old"]);
    }

    #[test]
    fn pages_follow_the_merged_order() {
        let all: Vec<Value> = ["a", "b", "c"]
            .iter()
            .map(|i| serde_json::json!({"sandboxID": i}))
            .collect();
        let p = |next: Option<&str>| Paging {
            limit: 2,
            next: next.map(str::to_string),
            filters: vec![],
        };
        let r = page(&all, "sandboxID", &p(None), "sandbox");
        assert_eq!(r.headers()["x-next-token"], "b");
        let r = page(&all, "sandboxID", &p(Some("b")), "sandbox");
        assert!(r.headers().get("x-next-token").is_none());
        let r = page(&all, "sandboxID", &p(Some("zz")), "sandbox");
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    }
}
