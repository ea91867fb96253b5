//! The E2B planes through the gateway (docs/cluster.md, "E2B through the
//! gateway"): the unmodified E2B SDK with `E2B_API_URL` and
//! `E2B_SANDBOX_URL` pointed here reaches every node.
//!
//! - **Control plane.** A create is placed like a `/v1` spawn of one child
//!   of the template's tag ([`crate::place`]) and sent to that node's E2B
//!   API; a node that fails it (unreachable, full, lost the tag) is left
//!   out and the create placed once more. Per-sandbox calls go to the
//!   sandbox's node (the id carries it). Lists are every node's, merged and
//!   paged here with E2B's `limit`/`nextToken`.
//! - **Sandbox plane.** A request names its sandbox by its host
//!   (`<port>-<id>.<domain>`: forwarded with the node's own domain in the
//!   host, so guest ports work too), by `E2b-Sandbox-Id`, or only by its
//!   access token or a signed URL (older SDKs): then each node is asked in
//!   turn until one does not refuse it (401), with the body held (bounded
//!   by [`MAX_ASKED_BODY`]), and the token's node remembered.
//! - **The domain.** Replies naming a sandbox's domain (create, connect,
//!   resume, fork) name the gateway's instead, so the SDK's
//!   `get_host(port)` comes back here.
//!
//! Invariants: bodies of per-sandbox calls stream both ways except where
//! said; every error the gateway makes is E2B's `{"code", "message"}`
//! (one mapping, [`e2b_error`]); a node's own reply passes through with
//! its status.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use axum::{middleware, Json, Router};
use serde_json::Value;

use crate::error::GatewayError;
use crate::nodes::{Bound, Node, Registry};
use crate::place::place;
use crate::proxy::{
    candidates, check_id, hop_by_hop, read_reply, stream_back, unreachable, MAX_JSON_BODY,
};

/// The most of a request body held to try it on several nodes (a sandbox
/// plane request that names no sandbox): RPC calls and small files.
pub const MAX_ASKED_BODY: usize = 1 << 20;
/// At most this many access token → node entries are remembered.
const TOKEN_CACHE_MAX: usize = 65_536;
/// Pages read from one node for a merged list (100 sandboxes each).
const MAX_LIST_PAGES: usize = 1000;
/// E2B's page size (and the most a page may hold).
const PAGE: usize = 100;

/// What the E2B front-end of the gateway knows.
pub struct E2bFront {
    reg: Arc<Registry>,
    /// The domain sandbox URLs are answered under (`<port>-<id>.<domain>`).
    domain: String,
    /// The key clients send as `X-API-KEY` (the gateway's token); None:
    /// any key (a loopback gateway without a token).
    key: Option<String>,
    /// Access token → node name, for requests naming no sandbox.
    tokens: Mutex<HashMap<String, String>>,
}

type F = State<Arc<E2bFront>>;

impl E2bFront {
    pub fn new(reg: Arc<Registry>, domain: String, key: Option<String>) -> Arc<E2bFront> {
        Arc::new(E2bFront {
            reg,
            domain,
            key,
            tokens: Mutex::new(HashMap::new()),
        })
    }

    /// The healthy nodes that serve E2B.
    fn nodes(&self) -> Vec<Arc<Node>> {
        self.reg
            .up_nodes()
            .into_iter()
            .filter(|n| n.e2b().is_some())
            .collect()
    }
}

/// An error as E2B's API answers one.
fn e2b_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"code": status.as_u16(), "message": message.into()});
    (status, Json(body)).into_response()
}

fn from_gateway(e: GatewayError) -> Response {
    e2b_error(e.status(), e.to_string())
}

type Reply = Result<Response, Response>;

// ---- the control plane ----

/// The control plane's routes, behind the API-key check.
pub fn control_routes(f: Arc<E2bFront>) -> Router {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", any(per_sandbox))
        .route("/sandboxes/{id}/{*rest}", any(per_sandbox))
        .route("/v2/sandboxes/{id}/{*rest}", any(per_sandbox))
        .route("/snapshots", axum::routing::get(list_snapshots))
        .route("/templates/{id}", axum::routing::delete(delete_template))
        .fallback(|req: Request| async move {
            e2b_error(
                StatusCode::NOT_FOUND,
                format!(
                    "{} {} is not part of the E2B API (docs/e2b.md lists what is)",
                    req.method(),
                    req.uri().path()
                ),
            )
        })
        .layer(middleware::from_fn_with_state(f.clone(), api_key))
        .with_state(f)
}

async fn api_key(State(f): F, req: Request, next: middleware::Next) -> Response {
    if let Some(key) = &f.key {
        let got = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
        let as_bearer = got.map(|g| format!("Bearer {g}"));
        if !forkd_hub::auth::bearer_matches(as_bearer.as_deref(), key) {
            return e2b_error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong X-API-KEY: set E2B_API_KEY to the gateway's token (docs/cluster.md)",
            );
        }
    }
    next.run(req).await
}

/// A control-plane request to `node`'s E2B API, with the key the node
/// takes (its `/v1` token, else what the client sent).
fn to_node(
    node: &Node,
    bound: Bound,
    method: Method,
    pq: &str,
    h: &HeaderMap,
) -> Option<reqwest::RequestBuilder> {
    let (api, _, _) = node.e2b()?;
    let mut rb = node.call_url(bound, method, &format!("{api}{pq}"));
    match node.token() {
        Some(t) => rb = rb.header("x-api-key", t),
        None => {
            if let Some(k) = h.get("x-api-key") {
                rb = rb.header("x-api-key", k);
            }
        }
    }
    if let Some(ct) = h.get(header::CONTENT_TYPE) {
        rb = rb.header(header::CONTENT_TYPE, ct);
    }
    Some(rb)
}

/// `POST /sandboxes`: placed by the template's tag, tried on a second
/// node when the first fails it.
async fn create(State(f): F, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_JSON_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return from_gateway(GatewayError::BodyTooLarge {
                limit: MAX_JSON_BODY,
            })
        }
    };
    let tag = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
        let t = v.get("templateID").or_else(|| v.get("template_id"))?;
        t.as_str().map(str::to_string)
    });
    let Some(tag) = tag else {
        return e2b_error(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object with templateID (the snapshot tag)",
        );
    };
    let nodes = f.nodes();
    let mut failed = HashSet::new();
    let mut last = None;
    for _round in 0..2 {
        let Some(plan) = place(1, &candidates(&nodes, &tag, &failed)) else {
            break;
        };
        let i = plan[0].0;
        let node = &nodes[i];
        let Some(rb) = to_node(
            node,
            Bound::Connect,
            Method::POST,
            parts.uri.path(),
            &parts.headers,
        ) else {
            failed.insert(i);
            continue;
        };
        let reply = match read_reply(node, rb.body(body.clone()).send().await).await {
            Ok(r) => r,
            Err(e) => {
                failed.insert(i);
                last = Some(from_gateway(e));
                continue;
            }
        };
        let again = reply.status.is_server_error()
            || matches!(
                reply.status,
                StatusCode::NOT_FOUND | StatusCode::CONFLICT | StatusCode::TOO_MANY_REQUESTS
            );
        if again {
            tracing::warn!(node = %node.name, status = %reply.status, "E2B create failed; placing it elsewhere");
            failed.insert(i);
            last = Some(relay_json(&f, reply.status, &reply.headers, &reply.body));
            continue;
        }
        if reply.status.is_success() {
            node.note_spawned(&tag, 1);
            if let Ok(v) = serde_json::from_slice::<Value>(&reply.body) {
                if let Some(id) = v.get("sandboxID").and_then(Value::as_str) {
                    f.reg.remember(id, &node.name);
                }
            }
        }
        return relay_json(&f, reply.status, &reply.headers, &reply.body);
    }
    last.unwrap_or_else(|| {
        from_gateway(GatewayError::NoNodeHolds {
            tag,
            down: f.reg.down(),
        })
    })
}

/// A node's whole JSON reply, with every sandbox's `domain` made the
/// gateway's (so `get_host(port)` comes here).
fn relay_json(f: &E2bFront, status: StatusCode, headers: &HeaderMap, body: &Bytes) -> Response {
    let body = match serde_json::from_slice::<Value>(body) {
        Ok(mut v) => {
            set_domain(&mut v, &f.domain);
            Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
        }
        Err(_) => body.clone(),
    };
    let mut r = (status, body).into_response();
    for (k, v) in headers {
        if k == header::CONTENT_TYPE || k.as_str() == "x-next-token" {
            r.headers_mut().insert(k.clone(), v.clone());
        }
    }
    r
}

/// Rewrites `domain` in a sandbox object or in each of a list of them.
fn set_domain(v: &mut Value, domain: &str) {
    match v {
        Value::Object(o) if o.contains_key("sandboxID") && o.contains_key("domain") => {
            o.insert("domain".into(), Value::String(domain.to_string()));
        }
        Value::Object(o) => o.values_mut().for_each(|x| set_domain(x, domain)),
        Value::Array(a) => a.iter_mut().for_each(|x| set_domain(x, domain)),
        _ => {}
    }
}

/// `/sandboxes/{id}/...`: the sandbox's node. Replies are small JSON
/// (info, connect, metrics, fork), read whole to name the gateway's domain.
async fn per_sandbox(State(f): F, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let id = path
        .trim_start_matches("/v2")
        .trim_start_matches("/sandboxes/")
        .split('/')
        .next()
        .unwrap_or("")
        .to_string();
    if let Err(e) = check_id(&id) {
        return from_gateway(e);
    }
    let node = match f.reg.locate(&id).await {
        Ok(n) => n,
        Err(e) => return from_gateway(e),
    };
    let (parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Some(rb) = to_node(
        &node,
        Bound::Connect,
        parts.method.clone(),
        pq,
        &parts.headers,
    ) else {
        return e2b_error(
            StatusCode::BAD_GATEWAY,
            format!("sandbox {id}'s node {} no longer serves E2B", node.name),
        );
    };
    let sent = rb
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await;
    match read_reply(&node, sent).await {
        Ok(r) => {
            if parts.method == Method::DELETE && path == format!("/sandboxes/{id}") {
                f.reg.forget(&id);
            }
            relay_json(&f, r.status, &r.headers, &r.body)
        }
        Err(e) => from_gateway(e),
    }
}

/// `GET /sandboxes`, `GET /v2/sandboxes`: every node's whole list (its
/// pages followed), merged in the nodes' order (start time, then id) and
/// paged here.
async fn list(State(f): F, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let mut limit = PAGE;
    let mut next = None;
    let mut rest: Vec<String> = Vec::new();
    for kv in req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|s| !s.is_empty())
    {
        match kv.split_once('=').unwrap_or((kv, "")) {
            ("limit", v) => match v.parse().ok().filter(|n| (1..=PAGE).contains(n)) {
                Some(n) => limit = n,
                None => {
                    return e2b_error(StatusCode::BAD_REQUEST, format!("limit must be 1-{PAGE}"))
                }
            },
            ("nextToken", v) => next = Some(v.to_string()),
            _ => rest.push(kv.to_string()),
        }
    }
    let nodes = f.nodes();
    let lists = nodes
        .iter()
        .map(|n| whole_list(n, &path, &rest, req.headers()));
    let mut all: Vec<Value> = Vec::new();
    for (r, n) in futures::future::join_all(lists)
        .await
        .into_iter()
        .zip(&nodes)
    {
        match r {
            Ok(items) => {
                for s in &items {
                    if let Some(id) = s.get("sandboxID").and_then(Value::as_str) {
                        f.reg.remember(id, &n.name);
                    }
                }
                all.extend(items)
            }
            Err(resp) => return resp,
        }
    }
    let key = |v: &Value| {
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        (s("startedAt"), s("sandboxID"))
    };
    all.sort_by_key(key);
    let start = match &next {
        None => 0,
        Some(t) => match all.iter().position(|v| key(v).1 == *t) {
            Some(i) => i + 1,
            None => {
                return e2b_error(
                    StatusCode::BAD_REQUEST,
                    "nextToken does not name a listed sandbox; list from the start",
                )
            }
        },
    };
    let page: Vec<Value> = all.iter().skip(start).take(limit).cloned().collect();
    let more = all.len() > start + limit;
    let mut r = Json(&page).into_response();
    if let (true, Some(last)) = (more, page.last()) {
        if let Ok(v) = HeaderValue::from_str(&key(last).1) {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    r
}

/// One node's whole list at `path` with the client's filters, its pages
/// followed; an error reply (a bad filter) is the client's answer.
async fn whole_list(
    node: &Node,
    path: &str,
    filters: &[String],
    h: &HeaderMap,
) -> Result<Vec<Value>, Response> {
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..MAX_LIST_PAGES {
        let mut q: Vec<String> = filters.to_vec();
        q.push(format!("limit={PAGE}"));
        if let Some(t) = &token {
            q.push(format!("nextToken={t}"));
        }
        let pq = format!("{path}?{}", q.join("&"));
        let Some(rb) = to_node(node, Bound::Whole, Method::GET, &pq, h) else {
            return Ok(out);
        };
        let r = read_reply(node, rb.send().await)
            .await
            .map_err(from_gateway)?;
        if !r.status.is_success() {
            return Err((r.status, r.headers, r.body).into_response());
        }
        let items: Vec<Value> = serde_json::from_slice(&r.body).map_err(|e| {
            from_gateway(GatewayError::NodeUnreachable {
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
    Ok(out)
}

/// `GET /snapshots`: every node's, merged (a snapshot on several nodes
/// once).
async fn list_snapshots(State(f): F, req: Request) -> Response {
    let pq = req
        .uri()
        .path_and_query()
        .map_or("/snapshots", |p| p.as_str())
        .to_string();
    let nodes = f.nodes();
    let asks = nodes.iter().map(|n| {
        let rb = to_node(n, Bound::Whole, Method::GET, &pq, req.headers());
        async move { read_reply(n, rb?.send().await).await.ok() }
    });
    let mut seen = HashSet::new();
    let mut all = Vec::new();
    for r in futures::future::join_all(asks).await.into_iter().flatten() {
        if !r.status.is_success() {
            return (r.status, r.headers, r.body).into_response();
        }
        let items: Vec<Value> = serde_json::from_slice(&r.body).unwrap_or_default();
        for s in items {
            if seen.insert(
                s.get("snapshotID")
                    .cloned()
                    .unwrap_or(Value::Null)
                    .to_string(),
            ) {
                all.push(s);
            }
        }
    }
    Json(all).into_response()
}

/// `DELETE /templates/{id}`: on every node; 404 only when no node had it.
async fn delete_template(State(f): F, req: Request) -> Response {
    let pq = req.uri().path().to_string();
    let nodes = f.nodes();
    let sends = nodes.iter().map(|n| {
        let rb = to_node(n, Bound::Whole, Method::DELETE, &pq, req.headers());
        async move { read_reply(n, rb?.send().await).await.ok() }
    });
    let mut not_found = None;
    let mut ok = None;
    for r in futures::future::join_all(sends).await.into_iter().flatten() {
        if r.status == StatusCode::NOT_FOUND {
            not_found.get_or_insert(r);
        } else if !r.status.is_success() {
            return (r.status, r.headers, r.body).into_response();
        } else {
            ok.get_or_insert(r);
        }
    }
    match ok.or(not_found) {
        Some(r) => (r.status, r.headers, r.body).into_response(),
        None => from_gateway(GatewayError::NoHealthyNode { down: f.reg.down() }),
    }
}

// ---- the sandbox plane ----

/// The sandbox plane: everything goes through [`plane`].
pub fn plane_routes(f: Arc<E2bFront>) -> Router {
    Router::new().fallback(plane).with_state(f)
}

/// `(port, id)` a host `<port>-<id>.<domain>` names, the id checked.
fn addressed(domain: &str, h: &HeaderMap) -> Option<(u16, String)> {
    let (port, id) = forkd_edge::hosts::sandbox_address(domain, h)?;
    check_id(&id).ok()?;
    Some((port, id))
}

async fn plane(State(f): F, req: Request) -> Response {
    let by_host = addressed(&f.domain, req.headers());
    let named = by_host.as_ref().map(|(_, id)| id.clone()).or_else(|| {
        let v = req.headers().get("e2b-sandbox-id")?;
        v.to_str().ok().map(str::to_string)
    });
    let Some(id) = named else {
        return ask_each(&f, req).await;
    };
    if let Err(e) = check_id(&id) {
        return from_gateway(e);
    }
    let node = match f.reg.locate(&id).await {
        Ok(n) => n,
        Err(e) => return from_gateway(e),
    };
    let Some((_, sandboxes, node_domain)) = node.e2b() else {
        return e2b_error(
            StatusCode::BAD_GATEWAY,
            format!("sandbox {id}'s node {} does not serve E2B", node.name),
        );
    };
    // The node routes a guest port by its own domain in the host.
    let host = by_host.map(|(port, id)| format!("{port}-{id}.{node_domain}"));
    send_plane(&node, &sandboxes, host.as_deref(), req)
        .await
        .unwrap_or_else(|e| e)
}

/// Sends a sandbox-plane request to `node`'s plane, both bodies streamed.
async fn send_plane(node: &Node, base: &str, host: Option<&str>, req: Request) -> Reply {
    let (parts, body) = req.into_parts();
    let rb = plane_request(node, base, host, &parts);
    let sent = rb
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await
        .map_err(|e| from_gateway(unreachable(node, &e)))?;
    Ok(stream_back(sent))
}

fn plane_request(
    node: &Node,
    base: &str,
    host: Option<&str>,
    parts: &axum::http::request::Parts,
) -> reqwest::RequestBuilder {
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut rb = node.call_url(Bound::Connect, parts.method.clone(), &format!("{base}{pq}"));
    for (k, v) in &parts.headers {
        if plane_passes(k) {
            rb = rb.header(k, v);
        }
    }
    if let Some(h) = host {
        rb = rb.header(header::HOST, h);
    }
    rb
}

/// Hop-by-hop headers stay on their hop; `Authorization` passes (envd
/// reads the guest user from it).
fn plane_passes(h: &HeaderName) -> bool {
    !hop_by_hop(h) && h != header::CONTENT_LENGTH
}

/// A request naming no sandbox (only its access token, or a signed URL):
/// the node that remembered its token, else each node in turn until one
/// does not answer 401, with the body held.
async fn ask_each(f: &E2bFront, req: Request) -> Response {
    let token = req
        .headers()
        .get("x-access-token")
        .or_else(|| req.headers().get("e2b-traffic-access-token"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_ASKED_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return e2b_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("a request over {MAX_ASKED_BODY} bytes through the gateway must name its sandbox: send E2b-Sandbox-Id or use the sandbox's URL (a newer E2B SDK does)"),
            )
        }
    };
    let mut nodes = f.nodes();
    let known = token
        .as_ref()
        .and_then(|t| f.tokens.lock().unwrap().get(t).cloned());
    if let Some(name) = known {
        nodes.sort_by_key(|n| n.name != name);
    }
    let mut last = None;
    for node in nodes {
        let Some((_, base, _)) = node.e2b() else {
            continue;
        };
        let sent = plane_request(&node, &base, None, &parts)
            .body(body.clone())
            .send()
            .await;
        match sent {
            Ok(r) if r.status() == StatusCode::UNAUTHORIZED => {
                last = Some(stream_back(r));
            }
            Ok(r) => {
                if let Some(t) = token {
                    let mut tokens = f.tokens.lock().unwrap();
                    if tokens.len() >= TOKEN_CACHE_MAX {
                        tokens.clear();
                    }
                    tokens.insert(t, node.name.clone());
                }
                return stream_back(r);
            }
            Err(e) => {
                tracing::warn!(node = %node.name, error = %crate::nodes::error_chain(&e), "E2B sandbox plane: node unreachable");
            }
        }
    }
    last.unwrap_or_else(|| {
        e2b_error(
            StatusCode::UNAUTHORIZED,
            "no node has a sandbox with this access token: use the envdAccessToken the create (or connect) answered",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_name_a_port_and_a_sandbox_under_the_gateways_domain() {
        let h = |host: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::HOST, HeaderValue::from_str(host).unwrap());
            m
        };
        let id = "sb-8abc00000000000000000000";
        assert_eq!(
            addressed(
                "gw.example:3001",
                &h(&format!("49983-{id}.gw.example:3001"))
            ),
            Some((49983, id.to_string()))
        );
        assert_eq!(
            addressed("gw.example", &h(&format!("8080-{id}.GW.example."))),
            Some((8080, id.to_string()))
        );
        assert_eq!(
            addressed("gw.example", &h(&format!("49983-{id}.other.example"))),
            None
        );
        assert_eq!(addressed("gw.example", &h("0-sb-1.gw.example")), None);
        assert_eq!(addressed("gw.example", &h("49983-../x.gw.example")), None);
        assert_eq!(addressed("gw.example", &h("gw.example")), None);
    }

    #[test]
    fn the_domain_of_every_sandbox_in_a_reply_is_the_gateways() {
        let mut v = serde_json::json!({"sandboxID": "sb-1", "domain": "localhost:3001", "x": 1});
        set_domain(&mut v, "gw:9");
        assert_eq!(v["domain"], "gw:9");
        let mut l = serde_json::json!([{"sandboxID": "a", "domain": "n"}, {"domain": "keep"}]);
        set_domain(&mut l, "gw:9");
        assert_eq!(l[0]["domain"], "gw:9");
        assert_eq!(l[1]["domain"], "keep");
    }
}
