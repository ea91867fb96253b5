//! The gateway's HTTP surface: forkd's `/v1`, routed to nodes
//! (docs/cluster.md, "what goes where").
//!
//! - `POST /v1/sandboxes`: placed by [`crate::place`], split over nodes.
//! - `/v1/sandboxes/{id}/...`: the sandbox's node, streamed both ways
//!   (the PTY WebSocket is relayed frame by frame).
//! - `GET /v1/sandboxes`, `/v1/snapshots`, `/v1/pools`: every healthy node,
//!   merged; a header `forkd-unreachable-nodes` names the ones left out.
//! - Snapshot deletes and pool settings: every healthy node.
//! - `GET /v1/nodes`: the gateway's own view of its nodes.
//! - `GET /metrics`: every healthy node's, merged ([`crate::metrics`]);
//!   `GET /version`: the gateway's own, with `"role": "gateway"`.
//! - `/console/`: the web console (forkd-console), as poold serves it; its
//!   calls come back here, so it shows the whole cluster.

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::ws::{self, WebSocket, WebSocketUpgrade};
use axum::extract::{OriginalUri, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{middleware, Json, Router};
use futures::{SinkExt, StreamExt};
use serde_json::Value;

use crate::error::GatewayError;
use crate::nodes::{error_chain, Bound, Node, Registry};
use crate::place::{place, Candidate};

/// The most of a request body the gateway reads whole (spawns, snapshot
/// creation); anything streamed to a sandbox is not bounded here.
pub(crate) const MAX_JSON_BODY: usize = 1 << 20;
/// Names the nodes a merged list or a fan-out could not reach.
const UNREACHABLE_HEADER: &str = "forkd-unreachable-nodes";

/// The most of a node's whole reply (a list, `/metrics`) the gateway
/// reads; a node that sends more is treated as unreachable.
const MAX_NODE_REPLY: usize = 64 << 20;
/// The PTY's WebSocket app protocol, answered to a browser that offers it
/// (docs/console.md, "Auth"; poold answers the same).
const PTY_PROTOCOL: &str = "forkd.pty";

#[derive(Clone)]
struct App {
    reg: Arc<Registry>,
}

type Reply = Result<Response, GatewayError>;

/// The gateway's routes; every one but `/healthz` and the console's
/// static files behind `token`, checked as poold checks it (the header, or
/// on a WebSocket upgrade the `forkd.bearer.<hex>` subprotocol a browser
/// sends: `forkd_edge::auth`).
pub fn router(reg: Arc<Registry>, token: Option<String>) -> Router {
    let app = App { reg };
    let not_routed = || {
        GatewayError::NotRouted {
        what: "this path",
        hint: "the gateway routes /v1/sandboxes, /v1/snapshots, /v1/pools and /v1/nodes; call a node's poold for the rest",
    }
    };
    Router::new()
        .route("/v1/nodes", get(nodes))
        .route("/v1/sandboxes", get(list_sandboxes).post(spawn))
        .route("/v1/sandboxes/{id}", any(per_sandbox))
        .route("/v1/sandboxes/{id}/pty", get(pty))
        .route("/v1/sandboxes/{id}/{*rest}", any(per_sandbox))
        .route("/v1/snapshots", get(list_snapshots).post(create_snapshot))
        .route(
            "/v1/snapshots/{tag}",
            get(one_snapshot).delete(on_every_holder),
        )
        .route("/v1/snapshots/{tag}/info", get(one_snapshot))
        .route("/v1/snapshots/{tag}/compact", post(on_every_holder))
        .route("/v1/pools", get(list_pools))
        .route(
            "/v1/pools/{tag}",
            get(one_pool).put(on_every_holder).delete(on_every_holder),
        )
        .route("/openapi.json", get(any_node))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route(
            "/v1/workspaces",
            any(|| async {
                GatewayError::NotRouted {
                    what: "workspaces",
                    hint: "a workspace lives on one node; call that node's poold directly",
                }
            }),
        )
        .fallback(move || async move { not_routed() })
        .layer(middleware::from_fn_with_state(
            Arc::new(token),
            forkd_edge::auth::bearer,
        ))
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(forkd_console::router())
        .with_state(app)
}

/// `GET /version`: the gateway's build and how many nodes it sees; the
/// console tells a gateway from a poold by `role`.
async fn version(State(app): State<App>) -> Json<Value> {
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "role": "gateway",
        "nodes": app.reg.nodes().len(),
        "nodes_up": app.reg.up_nodes().len(),
    }))
}

/// `GET /metrics`: the healthy nodes' metrics, one family each, every
/// sample labelled with its node.
async fn metrics(State(app): State<App>) -> Response {
    let nodes = app.reg.up_nodes();
    let (replies, mut missing) = gather(&app.reg, &nodes, "/metrics").await;
    let mut merged = crate::metrics::Merged::default();
    for (i, r) in replies {
        match std::str::from_utf8(&r.body) {
            Ok(text) if r.status.is_success() => merged.add(&nodes[i].name, text),
            _ => missing.push(nodes[i].name.clone()),
        }
    }
    let mut r = merged.render().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    with_unreachable(r, &missing)
}

async fn nodes(State(app): State<App>) -> Json<Vec<crate::NodeView>> {
    Json(app.reg.views())
}

// ---- spawning ----

/// How a node's share of a spawn went.
enum Share {
    Made(Vec<Value>),
    /// Ends the spawn, passed to the client as it is: the node refused the
    /// request itself (a 4xx that every node would give).
    Refused(Response),
    /// Ends the spawn too: the node may have made the share without
    /// answering (placed again, it could be made twice). Told to the
    /// client before any refusal of the same round, since only this one
    /// says sandboxes may exist that the gateway could not kill.
    MaybeMade(Response),
    /// Worth placing elsewhere: unreachable, out of capacity, lost the
    /// snapshot since the last poll.
    Failed(Response),
}

/// A node's reply, read whole.
pub(crate) struct NodeReply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl IntoResponse for NodeReply {
    fn into_response(self) -> Response {
        let mut r = (self.status, self.body).into_response();
        if let Some(ct) = self.headers.get(header::CONTENT_TYPE) {
            r.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
        }
        r
    }
}

async fn spawn(State(app): State<App>, req: Request) -> Reply {
    let body = read_object(req).await?;
    let tag = body
        .get("snapshot_tag")
        .and_then(Value::as_str)
        .ok_or(GatewayError::BadRequest {
            field: "snapshot_tag",
            why: "required: the tag of the snapshot to spawn from".into(),
        })?
        .to_string();
    let n = match body.get("n") {
        None => 1,
        Some(v) => {
            v.as_u64()
                .filter(|n| (1..=1000).contains(n))
                .ok_or(GatewayError::BadRequest {
                    field: "n",
                    why: format!("{v} is not an integer in 1..=1000"),
                })? as usize
        }
    };
    let nodes = app.reg.up_nodes();
    let mut failed: HashSet<usize> = HashSet::new();
    let mut made: Vec<(usize, Value)> = Vec::new();
    let mut todo = n;
    let mut last_failure: Option<Response> = None;
    // One placement, and one more for the shares that failed.
    for _round in 0..2 {
        let Some(plan) = place(todo, &candidates(&nodes, &tag, &failed)) else {
            break;
        };
        let shares = plan.iter().map(|&(i, k)| spawn_share(&nodes[i], &body, k));
        let results = futures::future::join_all(shares).await;
        todo = 0;
        // Every share's outcome first: a refusal must not leave a later
        // share's sandboxes out of what `undo` kills.
        let (mut refused, mut maybe_made) = (None, None);
        for (&(i, k), r) in plan.iter().zip(results) {
            match r {
                Share::Made(list) => {
                    nodes[i].note_spawned(&tag, list.len());
                    if list.len() != k {
                        // What it listed is killed with the rest; what it
                        // may have made besides, only the node knows.
                        let e = GatewayError::MaybeMade {
                            node: nodes[i].name.clone(),
                            why: format!("it answered {} sandboxes for the {k} asked", list.len()),
                        };
                        maybe_made.get_or_insert(e.into_response());
                    }
                    made.extend(list.into_iter().map(|s| (i, s)));
                }
                Share::Refused(resp) => {
                    refused.get_or_insert(resp);
                }
                Share::MaybeMade(resp) => {
                    maybe_made.get_or_insert(resp);
                }
                Share::Failed(resp) => {
                    failed.insert(i);
                    todo += k;
                    last_failure = Some(resp);
                }
            }
        }
        if let Some(resp) = maybe_made.or(refused) {
            undo(&nodes, &made).await;
            return Ok(resp);
        }
        if todo == 0 {
            break;
        }
    }
    if todo > 0 {
        undo(&nodes, &made).await;
        return match last_failure {
            Some(r) => Ok(r),
            None => Err(GatewayError::NoNodeHolds {
                tag,
                down: app.reg.down(),
            }),
        };
    }
    let list: Vec<Value> = made
        .into_iter()
        .map(|(i, s)| {
            if let Some(id) = s.get("id").and_then(Value::as_str) {
                app.reg.remember(id, &nodes[i].name);
            }
            s
        })
        .collect();
    Ok((StatusCode::CREATED, Json(list)).into_response())
}

pub(crate) fn candidates(
    nodes: &[Arc<Node>],
    tag: &str,
    failed: &HashSet<usize>,
) -> Vec<Candidate> {
    nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| !failed.contains(i))
        .map(|(i, n)| {
            let (ready, has_snapshot, load) = n.for_tag(tag);
            Candidate {
                node: i,
                ready,
                has_snapshot,
                load,
                from_hub: n.has_hub(),
            }
        })
        .collect()
}

/// Asks `node` for `k` of the children, with the client's body otherwise
/// unchanged (the node validates it as it always does).
async fn spawn_share(node: &Node, body: &serde_json::Map<String, Value>, k: usize) -> Share {
    let mut body = body.clone();
    body.insert("n".into(), Value::from(k));
    let sent = node
        .call(Bound::Connect, Method::POST, "/v1/sandboxes")
        .json(&body)
        .send()
        .await;
    let reply = match read_making(node, sent).await {
        Making::Answered(r) => r,
        Making::NotSent(e) => return Share::Failed(e.into_response()),
        Making::MaybeMade(e) => return Share::MaybeMade(e.into_response()),
    };
    if reply.status.is_success() {
        // The node says it made them: a reply we cannot read is not a
        // reason to make them again elsewhere.
        return match serde_json::from_slice::<Vec<Value>>(&reply.body) {
            Ok(list) => Share::Made(list),
            Err(e) => Share::MaybeMade(
                GatewayError::MaybeMade {
                    node: node.name.clone(),
                    why: format!(
                        "it answered {} with a body that is not a list of sandboxes ({e})",
                        reply.status
                    ),
                }
                .into_response(),
            ),
        };
    }
    if worth_placing_elsewhere(reply.status) {
        tracing::warn!(node = %node.name, status = %reply.status, "spawn share failed; placing it elsewhere");
        Share::Failed(reply.into_response())
    } else {
        Share::Refused(reply.into_response())
    }
}

/// Kills the sandboxes a failed spawn already made (no partial spawns).
async fn undo(nodes: &[Arc<Node>], made: &[(usize, Value)]) {
    let kills = made.iter().filter_map(|(i, s)| {
        let id = s.get("id")?.as_str()?.to_string();
        let node = nodes[*i].clone();
        Some(async move {
            let path = format!("/v1/sandboxes/{id}");
            match node.call(Bound::Whole, Method::DELETE, &path).send().await {
                Ok(r) if r.status().is_success() || r.status() == StatusCode::NOT_FOUND => {
                    // Taken back from what the spawn counted (the next
                    // poll would correct it; placements before it would
                    // not).
                    node.note_gone();
                }
                Ok(r) => {
                    tracing::warn!(node = %node.name, %id, status = %r.status(), "could not kill a sandbox of a failed spawn")
                }
                Err(e) => {
                    tracing::warn!(node = %node.name, %id, error = %error_chain(&e), "could not kill a sandbox of a failed spawn")
                }
            }
        })
    });
    futures::future::join_all(kills).await;
}

// ---- per-sandbox calls ----

/// A sandbox id as poold makes them (`sb-` + hex); anything else cannot
/// name a sandbox and is refused before any node is asked.
pub(crate) fn check_id(id: &str) -> Result<(), GatewayError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(GatewayError::BadRequest {
            field: "id",
            why: format!("{id:?} is not a sandbox id (sb- and 24 hex digits)"),
        })
    }
}

async fn per_sandbox(
    State(app): State<App>,
    Path(params): Path<Vec<(String, String)>>,
    req: Request,
) -> Reply {
    let id = params
        .iter()
        .find(|(k, _)| k == "id")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    check_id(&id)?;
    let node = app.reg.locate(&id).await?;
    let is_kill =
        req.method() == Method::DELETE && req.uri().path() == format!("/v1/sandboxes/{id}");
    let resp = forward(&node, req).await?;
    if is_kill && (resp.status().is_success() || resp.status() == StatusCode::NOT_FOUND) {
        app.reg.forget(&id);
    }
    Ok(resp)
}

/// Sends `req` to `node` and its reply back, both bodies streamed.
async fn forward(node: &Node, req: Request) -> Reply {
    let (parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let mut rb = node.call(Bound::Connect, parts.method.clone(), pq);
    for (k, v) in parts.headers.iter() {
        if passes(k) && k != header::CONTENT_LENGTH {
            rb = rb.header(k, v);
        }
    }
    let sent = rb
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await
        .map_err(|e| unreachable(node, &e))?;
    Ok(stream_back(sent))
}

pub(crate) fn stream_back(r: reqwest::Response) -> Response {
    let mut out = Response::builder().status(r.status());
    for (k, v) in r.headers() {
        if passes(k) {
            out = out.header(k, v);
        }
    }
    out.body(Body::from_stream(r.bytes_stream()))
        .unwrap_or_else(|e| (StatusCode::BAD_GATEWAY, e.to_string()).into_response())
}

/// Hop-by-hop headers stay on their hop; the client's token is the
/// gateway's, not the node's.
fn passes(h: &HeaderName) -> bool {
    !hop_by_hop(h) && h != header::AUTHORIZATION
}

/// Headers that belong to one hop (RFC 9110 §7.6.1), and `Host`, which
/// names the gateway.
pub(crate) fn hop_by_hop(h: &HeaderName) -> bool {
    matches!(
        h.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

pub(crate) fn unreachable(node: &Node, e: &reqwest::Error) -> GatewayError {
    GatewayError::NodeUnreachable {
        node: node.name.clone(),
        why: error_chain(e),
    }
}

/// The PTY's WebSocket, relayed frame by frame to the sandbox's node.
async fn pty(
    State(app): State<App>,
    Path(id): Path<String>,
    OriginalUri(uri): OriginalUri,
    ws: WebSocketUpgrade,
) -> Reply {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    check_id(&id)?;
    let node = app.reg.locate(&id).await?;
    let Some(hostport) = node.url.strip_prefix("http://") else {
        return Err(GatewayError::NotRouted {
            what: "a PTY on a node served over https",
            hint: "open the PTY on the node directly",
        });
    };
    let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut up = format!("ws://{hostport}{pq}")
        .into_client_request()
        .map_err(|e| unreachable_ws(&node, &e))?;
    if let Some(t) = node.token() {
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {t}")) {
            up.headers_mut().insert(header::AUTHORIZATION, v);
        }
    }
    let upstream = match tokio_tungstenite::connect_async(up).await {
        Ok((s, _)) => s,
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
            let (parts, body) = r.into_parts();
            return Ok((parts.status, body.unwrap_or_default()).into_response());
        }
        Err(e) => return Err(unreachable_ws(&node, &e)),
    };
    Ok(ws
        .protocols([PTY_PROTOCOL])
        .on_upgrade(move |client| relay(client, upstream)))
}

fn unreachable_ws(node: &Node, e: &dyn std::error::Error) -> GatewayError {
    GatewayError::NodeUnreachable {
        node: node.name.clone(),
        why: error_chain(e),
    }
}

type Upstream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Copies frames both ways until either side closes.
async fn relay(client: WebSocket, upstream: Upstream) {
    use tokio_tungstenite::tungstenite::Message as T;
    let (mut c_tx, mut c_rx) = client.split();
    let (mut u_tx, mut u_rx) = upstream.split();
    let up = async {
        while let Some(Ok(m)) = c_rx.next().await {
            let m = match m {
                ws::Message::Text(t) => T::text(t.as_str()),
                ws::Message::Binary(b) => T::binary(b),
                ws::Message::Ping(b) => T::Ping(b),
                ws::Message::Pong(b) => T::Pong(b),
                ws::Message::Close(_) => break,
            };
            if u_tx.send(m).await.is_err() {
                break;
            }
        }
        let _ = u_tx.close().await;
    };
    let down = async {
        while let Some(Ok(m)) = u_rx.next().await {
            let m = match m {
                T::Text(t) => ws::Message::text(t.as_str()),
                T::Binary(b) => ws::Message::binary(b),
                T::Ping(b) => ws::Message::Ping(b),
                T::Pong(b) => ws::Message::Pong(b),
                T::Close(_) | T::Frame(_) => break,
            };
            if c_tx.send(m).await.is_err() {
                break;
            }
        }
        let _ = c_tx.close().await;
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

// ---- lists and fan-outs ----

/// GETs `pq` from every healthy node: the successful JSON replies (with
/// the node's index) and the names of the nodes that did not answer.
async fn gather(
    reg: &Registry,
    nodes: &[Arc<Node>],
    pq: &str,
) -> (Vec<(usize, NodeReply)>, Vec<String>) {
    let asks = nodes.iter().map(|n| async move {
        let sent = n.call(Bound::Whole, Method::GET, pq).send().await;
        read_reply(n, sent).await
    });
    let mut ok = Vec::new();
    let mut missing = reg.down().0;
    for (i, r) in futures::future::join_all(asks)
        .await
        .into_iter()
        .enumerate()
    {
        match r {
            Ok(reply) => ok.push((i, reply)),
            Err(_) => missing.push(nodes[i].name.clone()),
        }
    }
    (ok, missing)
}

/// Reads a node's reply whole (bounded: only lists and small JSON replies
/// come this way).
pub(crate) async fn read_reply(
    node: &Node,
    sent: Result<reqwest::Response, reqwest::Error>,
) -> Result<NodeReply, GatewayError> {
    let mut r = sent.map_err(|e| unreachable(node, &e))?;
    let status = r.status();
    let headers = r.headers().clone();
    let mut body = Vec::new();
    while let Some(chunk) = r.chunk().await.map_err(|e| unreachable(node, &e))? {
        if body.len() + chunk.len() > MAX_NODE_REPLY {
            return Err(GatewayError::NodeUnreachable {
                node: node.name.clone(),
                why: format!("the reply is over {MAX_NODE_REPLY} bytes"),
            });
        }
        body.extend_from_slice(&chunk);
    }
    let body = Bytes::from(body);
    Ok(NodeReply {
        status,
        headers,
        body,
    })
}

/// A node's answer to a request that makes something (a spawn, an E2B
/// create), told apart by whether a failure may still have made it.
pub(crate) enum Making {
    /// The node answered, with any status.
    Answered(NodeReply),
    /// The request never reached the node (no connection): safe to place
    /// elsewhere.
    NotSent(GatewayError),
    /// The connection broke after the request was sent, or the reply was
    /// cut: the node may have made it, so placing it again could make it
    /// twice.
    MaybeMade(GatewayError),
}

/// Whether a node's refusal to make something may not be another node's:
/// it failed (5xx), lacks the snapshot (404), is busy with it (409) or out
/// of capacity (429). Any other 4xx is about the request, which every node
/// would refuse alike.
pub(crate) fn worth_placing_elsewhere(status: StatusCode) -> bool {
    status.is_server_error()
        || matches!(
            status,
            StatusCode::NOT_FOUND | StatusCode::CONFLICT | StatusCode::TOO_MANY_REQUESTS
        )
}

/// Reads the reply to a making request, as [`Making`].
pub(crate) async fn read_making(
    node: &Node,
    sent: Result<reqwest::Response, reqwest::Error>,
) -> Making {
    let maybe = |why: String| {
        Making::MaybeMade(GatewayError::MaybeMade {
            node: node.name.clone(),
            why,
        })
    };
    match sent {
        Err(e) if e.is_connect() || e.is_builder() => Making::NotSent(unreachable(node, &e)),
        Err(e) => maybe(format!(
            "the connection broke after the request was sent: {}",
            error_chain(&e)
        )),
        Ok(r) => match read_reply(node, Ok(r)).await {
            Ok(reply) => Making::Answered(reply),
            Err(GatewayError::NodeUnreachable { why, .. }) => {
                maybe(format!("reading its reply: {why}"))
            }
            Err(e) => maybe(e.to_string()),
        },
    }
}

pub(crate) fn with_unreachable(mut r: Response, missing: &[String]) -> Response {
    if !missing.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&missing.join(",")) {
            r.headers_mut().insert(UNREACHABLE_HEADER, v);
        }
    }
    r
}

/// The JSON arrays of the successful replies, each item with its node index.
fn items(replies: Vec<(usize, NodeReply)>) -> Vec<(usize, Value)> {
    replies
        .into_iter()
        .filter(|(_, r)| r.status.is_success())
        .filter_map(|(i, r)| Some((i, serde_json::from_slice::<Vec<Value>>(&r.body).ok()?)))
        .flat_map(|(i, list)| list.into_iter().map(move |v| (i, v)))
        .collect()
}

async fn list_sandboxes(State(app): State<App>, OriginalUri(uri): OriginalUri) -> Response {
    let nodes = app.reg.up_nodes();
    let pq = uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/v1/sandboxes");
    let (replies, missing) = gather(&app.reg, &nodes, pq).await;
    let mut all = items(replies);
    for (i, s) in &mut all {
        if let Some(id) = s.get("id").and_then(Value::as_str) {
            app.reg.remember(id, &nodes[*i].name);
        }
        // Which node holds it, for operators (the console's Node column).
        if let Some(o) = s.as_object_mut() {
            o.entry("node")
                .or_insert_with(|| Value::String(nodes[*i].name.clone()));
        }
    }
    all.sort_by_key(|(_, s)| {
        (
            s.get("created_at_unix")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            s.get("id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
        )
    });
    let list: Vec<Value> = all.into_iter().map(|(_, s)| s).collect();
    with_unreachable(Json(list).into_response(), &missing)
}

async fn list_snapshots(State(app): State<App>) -> Response {
    let nodes = app.reg.up_nodes();
    let (replies, missing) = gather(&app.reg, &nodes, "/v1/snapshots").await;
    let mut seen = HashSet::new();
    let list: Vec<Value> = items(replies)
        .into_iter()
        .map(|(_, s)| s)
        .filter(|s| {
            seen.insert(
                s.get("tag")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            )
        })
        .collect();
    with_unreachable(Json(list).into_response(), &missing)
}

/// Pools summed per tag over the nodes: what the cluster holds ready.
async fn list_pools(State(app): State<App>) -> Response {
    let nodes = app.reg.up_nodes();
    let (replies, missing) = gather(&app.reg, &nodes, "/v1/pools").await;
    let list = merge_pools(items(replies).into_iter().map(|(_, p)| p));
    with_unreachable(Json(list).into_response(), &missing)
}

async fn one_pool(
    State(app): State<App>,
    Path(tag): Path<String>,
    OriginalUri(uri): OriginalUri,
) -> Reply {
    let nodes = app.reg.up_nodes();
    let (replies, missing) = gather(&app.reg, &nodes, uri.path()).await;
    let found: Vec<Value> = replies
        .iter()
        .filter(|(_, r)| r.status.is_success())
        .filter_map(|(_, r)| serde_json::from_slice(&r.body).ok())
        .collect();
    if found.is_empty() {
        return match replies.into_iter().next() {
            Some((_, r)) => Ok(with_unreachable(r.into_response(), &missing)),
            None => Err(GatewayError::NoNodeHolds {
                tag,
                down: app.reg.down(),
            }),
        };
    }
    let merged = merge_pools(found.into_iter()).pop().unwrap_or(Value::Null);
    Ok(with_unreachable(Json(merged).into_response(), &missing))
}

/// Sums the counters of pools of the same tag; settings come from the
/// first node (they are set on every node alike through the gateway).
fn merge_pools(pools: impl Iterator<Item = Value>) -> Vec<Value> {
    const SUMMED: [&str; 8] = [
        "min_ready",
        "max_ready",
        "keep_resident",
        "resident",
        "ready",
        "in_flight",
        "hits",
        "misses",
    ];
    let mut out: Vec<Value> = Vec::new();
    for p in pools {
        let tag = p.get("tag").cloned();
        match out.iter_mut().find(|o| o.get("tag") == tag.as_ref()) {
            None => out.push(p),
            Some(o) => {
                for k in SUMMED {
                    let sum = o.get(k).and_then(Value::as_u64).unwrap_or(0)
                        + p.get(k).and_then(Value::as_u64).unwrap_or(0);
                    o[k] = Value::from(sum);
                }
            }
        }
    }
    out
}

/// One snapshot's record: from a node that holds it.
async fn one_snapshot(State(app): State<App>, Path(tag): Path<String>, req: Request) -> Reply {
    let holder = app
        .reg
        .up_nodes()
        .into_iter()
        .find(|n| n.for_tag(&tag).1)
        .ok_or_else(|| GatewayError::NoNodeHolds {
            tag,
            down: app.reg.down(),
        })?;
    forward(&holder, req).await
}

/// A new snapshot from an image, made on the least loaded healthy node.
async fn create_snapshot(State(app): State<App>, req: Request) -> Reply {
    let node = app
        .reg
        .up_nodes()
        .into_iter()
        .min_by_key(|n| n.load())
        .ok_or_else(|| GatewayError::NoHealthyNode {
            down: app.reg.down(),
        })?;
    forward(&node, req).await
}

/// The OpenAPI document (the same on every node).
async fn any_node(State(app): State<App>, req: Request) -> Reply {
    let node =
        app.reg
            .up_nodes()
            .into_iter()
            .next()
            .ok_or_else(|| GatewayError::NoHealthyNode {
                down: app.reg.down(),
            })?;
    forward(&node, req).await
}

/// Snapshot deletes and compactions, pool settings: sent to every healthy
/// node that holds the tag — and a pool setting also to every node with a
/// hub, which pulls the tag to fill its pool (a hub node whose hub lacks
/// the tag answers 404: that node is left out, not the request failed).
/// The first failure is the answer; else the first success (a pool's
/// summed status for pool settings).
async fn on_every_holder(State(app): State<App>, Path(tag): Path<String>, req: Request) -> Reply {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, MAX_JSON_BODY)
        .await
        .map_err(|_| GatewayError::BodyTooLarge {
            limit: MAX_JSON_BODY,
        })?;
    let pool_put = parts.method == Method::PUT && parts.uri.path().starts_with("/v1/pools/");
    let up = app.reg.up_nodes();
    let holders: Vec<Arc<Node>> = up.iter().filter(|n| n.for_tag(&tag).1).cloned().collect();
    let from_hub: Vec<Arc<Node>> = if pool_put {
        up.iter()
            .filter(|n| !n.for_tag(&tag).1 && n.has_hub())
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    let n_holders = holders.len();
    let holders: Vec<Arc<Node>> = holders.into_iter().chain(from_hub).collect();
    if holders.is_empty() {
        return Err(GatewayError::NoNodeHolds {
            tag,
            down: app.reg.down(),
        });
    }
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let sends = holders.iter().map(|n| {
        let mut rb = n.call(Bound::Whole, parts.method.clone(), pq);
        if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
            rb = rb.header(header::CONTENT_TYPE, ct);
        }
        let rb = rb.body(body.clone());
        async move { read_reply(n, rb.send().await).await }
    });
    let results = futures::future::join_all(sends).await;
    let mut first_ok = None;
    let mut hub_lacks = None;
    let mut pools = Vec::new();
    for (i, r) in results.into_iter().enumerate() {
        let r = r?;
        if i >= n_holders && r.status == StatusCode::NOT_FOUND {
            hub_lacks.get_or_insert(r);
            continue;
        }
        if !r.status.is_success() {
            return Ok(with_unreachable(r.into_response(), &app.reg.down().0));
        }
        if let Ok(v) = serde_json::from_slice::<Value>(&r.body) {
            if v.get("min_ready").is_some() {
                pools.push(v);
            }
        }
        first_ok.get_or_insert(r);
    }
    let missing = app.reg.down().0;
    if let (None, Some(r)) = (&first_ok, hub_lacks) {
        // No node holds it and no node's hub has it: the nodes' 404.
        return Ok(with_unreachable(r.into_response(), &missing));
    }
    if !pools.is_empty() {
        let merged = merge_pools(pools.into_iter()).pop().unwrap_or(Value::Null);
        return Ok(with_unreachable(Json(merged).into_response(), &missing));
    }
    let r = first_ok
        .map(IntoResponse::into_response)
        .unwrap_or_else(|| StatusCode::NO_CONTENT.into_response());
    Ok(with_unreachable(r, &missing))
}

/// A request body that must be one JSON object, read whole (bounded).
async fn read_object(req: Request) -> Result<serde_json::Map<String, Value>, GatewayError> {
    let bytes = axum::body::to_bytes(req.into_body(), MAX_JSON_BODY)
        .await
        .map_err(|_| GatewayError::BodyTooLarge {
            limit: MAX_JSON_BODY,
        })?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(GatewayError::BadRequest {
            field: "body",
            why: "must be a JSON object".into(),
        }),
        Err(e) => Err(GatewayError::BadRequest {
            field: "body",
            why: format!("not JSON: {e}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, NodeAddr};
    use crate::nodes::Registry;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn node_at(addr: std::net::SocketAddr) -> Arc<Node> {
        let cfg = Config::for_test(vec![NodeAddr {
            name: "n1".into(),
            url: format!("http://{addr}"),
        }]);
        Registry::new(&cfg).unwrap().nodes().remove(0)
    }

    /// A loopback node that reads one request, sends `reply` (if any) and
    /// closes the connection.
    async fn fake_node(reply: Option<&'static [u8]>) -> std::net::SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = c.read(&mut buf).await;
            if let Some(r) = reply {
                c.write_all(r).await.unwrap();
            }
            // Dropped: the connection closes.
        });
        addr
    }

    async fn making(addr: std::net::SocketAddr) -> Making {
        let node = node_at(addr);
        let sent = node
            .call(Bound::Connect, Method::POST, "/v1/sandboxes")
            .body("{}")
            .send()
            .await;
        read_making(&node, sent).await
    }

    /// A node with one ready child of `py` whose spawn answers
    /// `spawn_status` with `spawn_body`.
    async fn pool_node(spawn_status: u16, spawn_body: &'static str) -> NodeAddr {
        serve_node(pool_app(spawn_status, spawn_body)).await
    }

    async fn serve_node(app: Router) -> NodeAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        NodeAddr {
            name: format!("n{}", addr.port()),
            url: format!("http://{addr}"),
        }
    }

    fn pool_app(spawn_status: u16, spawn_body: &'static str) -> Router {
        let json = |b: &'static str| {
            move || async move { ([(header::CONTENT_TYPE, "application/json")], b) }
        };
        Router::new()
            .route("/v1/pools", get(json(r#"[{"tag":"py","ready":1}]"#)))
            .route("/v1/snapshots", get(json(r#"[{"tag":"py"}]"#)))
            .route(
                "/v1/sandboxes",
                get(json("[]")).post(move || async move {
                    (StatusCode::from_u16(spawn_status).unwrap(), spawn_body)
                }),
            )
            .route("/version", get(json("{}")))
    }

    /// A gateway in front of `reg`, asked to spawn two children of `py`.
    async fn spawn_two_through(reg: Arc<Registry>) -> reqwest::Response {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gw = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, router(reg, None)).await.unwrap() });
        forkd_api::http_builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap()
            .post(format!("http://{gw}/v1/sandboxes"))
            .json(&serde_json::json!({"snapshot_tag": "py", "n": 2}))
            .send()
            .await
            .unwrap()
    }

    /// A node that answers a spawn of two with one sandbox: the client
    /// hears that more may exist, and the one listed is killed (and taken
    /// off the node's count). Before, the client got one sandbox and a 201.
    #[tokio::test]
    async fn a_share_answered_short_is_undone_and_said() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let killed = Arc::new(AtomicUsize::new(0));
        let k = killed.clone();
        let app = pool_app(201, r#"[{"id":"sb-1"}]"#).route(
            "/v1/sandboxes/{id}",
            axum::routing::delete(move || {
                k.fetch_add(1, Ordering::SeqCst);
                async { StatusCode::NO_CONTENT }
            }),
        );
        let reg = Arc::new(Registry::new(&Config::for_test(vec![serve_node(app).await])).unwrap());
        reg.poll_once().await;
        let resp = spawn_two_through(reg.clone()).await;
        assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
        let text = resp.text().await.unwrap();
        assert!(text.contains("1 sandboxes for the 2 asked"), "{text}");
        assert_eq!(killed.load(Ordering::SeqCst), 1);
        assert_eq!(
            reg.up_nodes()[0].for_tag("py").2,
            0,
            "the count is taken back"
        );
    }

    #[tokio::test]
    async fn a_spawn_that_may_have_made_sandboxes_says_so_over_another_nodes_refusal() {
        // One share refused outright (400), the other answered 201 with a
        // body that is no list of sandboxes: it may have made them, and
        // that is what the client must hear, in either order of the shares.
        for refusing_first in [true, false] {
            let refusing = pool_node(400, r#"{"error":"no such image"}"#).await;
            let unreadable = pool_node(201, "not json").await;
            let nodes = if refusing_first {
                vec![refusing, unreadable]
            } else {
                vec![unreadable, refusing]
            };
            let reg = Arc::new(Registry::new(&Config::for_test(nodes)).unwrap());
            reg.poll_once().await;
            assert_eq!(reg.up_nodes().len(), 2);
            let resp = spawn_two_through(reg).await;
            assert_eq!(
                resp.status(),
                StatusCode::BAD_GATEWAY,
                "refusing first: {refusing_first}"
            );
            let text = resp.text().await.unwrap();
            assert!(text.contains("may have made it"), "{text}");
        }
    }

    #[tokio::test]
    async fn a_spawn_is_placed_again_only_when_it_never_reached_the_node() {
        // Nothing listens: the request never left, so another node may
        // take it.
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        assert!(matches!(making(addr).await, Making::NotSent(_)));
        // The node read the spawn and hung up: it may have made the
        // sandboxes, so the error says so and nothing is placed again.
        match making(fake_node(None).await).await {
            Making::MaybeMade(e) => {
                assert_eq!(e.status(), StatusCode::BAD_GATEWAY);
                assert!(e.to_string().contains("may have made it"), "{e}");
            }
            _ => panic!("a cut connection must be MaybeMade"),
        }
        // A reply cut short after its status: the same.
        let cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n[{\"id\"";
        assert!(matches!(
            making(fake_node(Some(cut)).await).await,
            Making::MaybeMade(_)
        ));
        // A whole answer, any status, is the node's.
        let whole = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n{}";
        match making(fake_node(Some(whole)).await).await {
            Making::Answered(r) => assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE),
            _ => panic!("a whole reply must be Answered"),
        }
    }
}
