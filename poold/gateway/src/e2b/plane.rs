//! The E2B sandbox plane through the gateway: envd, the code interpreter
//! and guest ports of every node's sandboxes, behind one listener. An
//! upgrade to a guest port (a WebSocket) gets a connection of its own to
//! the node's plane, relayed both ways ([`forkd_edge::relay`]).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use axum::response::Response;
use axum::Router;

use super::{e2b_error, from_gateway, E2bFront, F, MAX_ASKED_BODY, MAX_UPGRADES};
use crate::nodes::{error_chain, Bound, Node};
use crate::proxy::{check_id, hop_by_hop, stream_back, unreachable};

/// At most this many access token → node entries are remembered.
const TOKEN_CACHE_MAX: usize = 65_536;
/// The longest access token remembered (poold's are 32 hex digits).
const MAX_TOKEN_LEN: usize = 64;
/// How long the body of a request naming no sandbox may take to arrive.
const ASKED_BODY_TIME: std::time::Duration = std::time::Duration::from_secs(30);

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
    let Some((_, base, node_domain)) = node.e2b() else {
        return e2b_error(
            StatusCode::BAD_GATEWAY,
            format!("sandbox {id}'s node {} does not serve E2B", node.name),
        );
    };
    // The node routes a guest port by its own domain in the host.
    let host = by_host.map(|(port, id)| format!("{port}-{id}.{node_domain}"));
    if let Some(h) = host.as_deref() {
        if forkd_edge::relay::upgrade_of(req.headers()).is_some() {
            return upgrade(&f, &node, &base, h, req).await;
        }
    }
    let (parts, body) = req.into_parts();
    let sent = plane_request(&node, &base, host.as_deref(), &parts)
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await;
    match sent {
        Ok(r) => stream_back(r),
        Err(e) => from_gateway(unreachable(&node, &e)),
    }
}

/// How long a node's plane has to answer an upgrade: more than its own
/// bound on the guest (TLS handshake, then the guest's answer, 30 s each),
/// so the client gets the node's error, not ours.
const UPGRADE_ANSWER: std::time::Duration = std::time::Duration::from_secs(75);

/// How long connecting to a node's plane for an upgrade may take.
const UPGRADE_CONNECT: std::time::Duration = std::time::Duration::from_secs(10);

/// An upgrade (WebSocket) to a guest port: relayed over a connection of
/// its own to the node's plane (`base`, plain HTTP), which relays it to
/// the guest, the upgraded stream copied both ways, never buffered.
async fn upgrade(f: &E2bFront, node: &Node, base: &str, host: &str, req: Request) -> Response {
    let Ok(slot) = f.upgrades.clone().try_acquire_owned() else {
        return e2b_error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the gateway relays {MAX_UPGRADES} upgraded connections already; close some and retry"),
        );
    };
    let addr = node.connect_addr(base);
    let (Some(addr), Ok(host)) = (addr, axum::http::HeaderValue::from_str(host)) else {
        return e2b_error(
            StatusCode::BAD_GATEWAY,
            format!(
                "node {}'s sandbox plane {base:?} is not an address to connect to",
                node.name
            ),
        );
    };
    let unreachable = |why: String| {
        e2b_error(
            StatusCode::BAD_GATEWAY,
            format!(
                "node {}'s sandbox plane did not take the upgrade: {why}",
                node.name
            ),
        )
    };
    let tcp =
        match tokio::time::timeout(UPGRADE_CONNECT, tokio::net::TcpStream::connect(&addr)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return unreachable(e.to_string()),
            Err(_) => {
                return unreachable(format!(
                    "no connection within {}s",
                    UPGRADE_CONNECT.as_secs()
                ))
            }
        };
    // Small frames (terminals, VNC) go out at once; a dead node is found.
    forkd_edge::listen::tune(&tcp);
    let what = format!("node {}'s sandbox plane", node.name);
    let relayed = forkd_edge::relay::exchange_within(
        tcp,
        req,
        host,
        &["x-api-key"],
        &what,
        Some(slot),
        UPGRADE_ANSWER,
    )
    .await;
    match relayed {
        Ok(r) => r,
        Err(e @ forkd_edge::relay::RelayError::NoAnswer(_)) => e2b_error(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "node {}'s sandbox plane did not answer the upgrade: {e}",
                node.name
            ),
        ),
        Err(e) => unreachable(e.to_string()),
    }
}

/// A sandbox-plane request to `node`'s plane at `base`, the client's
/// headers on it (but hop-by-hop ones), `host` as its host when given.
fn plane_request(
    node: &Node,
    base: &str,
    host: Option<&str>,
    parts: &Parts,
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

/// Hop-by-hop headers stay on their hop, and a client's API key at the
/// gateway; `Authorization` passes (envd reads the guest user from it).
fn plane_passes(h: &HeaderName) -> bool {
    !hop_by_hop(h) && h != header::CONTENT_LENGTH && h.as_str() != "x-api-key"
}

/// The access token a request carries, as the SDKs send it.
fn access_token(h: &HeaderMap) -> Option<String> {
    let v = h
        .get("x-access-token")
        .or_else(|| h.get("e2b-traffic-access-token"))?;
    v.to_str().ok().map(str::to_string)
}

/// A request naming no sandbox, only its access token (e2b 2.7.0's
/// `connect`) or a signed URL: the node that answered that token before,
/// else each node in turn until one does not answer 401, the body held.
/// Without either credential it is refused here.
async fn ask_each(f: &E2bFront, req: Request) -> Response {
    let token = access_token(req.headers());
    let signed = req.uri().query().is_some_and(|q| q.contains("signature="));
    if token.is_none() && !signed {
        return e2b_error(
            StatusCode::UNAUTHORIZED,
            "missing X-Access-Token: use the envdAccessToken the create (or connect) answered, and name the sandbox (E2b-Sandbox-Id or its sandbox URL)",
        );
    }
    let Ok(_turn) = f.asking.acquire().await else {
        return e2b_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the gateway is shutting down",
        );
    };
    let (parts, body) = req.into_parts();
    // A turn is not held for a client that sends slowly.
    let read = tokio::time::timeout(ASKED_BODY_TIME, axum::body::to_bytes(body, MAX_ASKED_BODY));
    let Ok(Ok(body)) = read.await else {
        return e2b_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a request over {MAX_ASKED_BODY} bytes (or sent over more than {}s) through the gateway must name its sandbox: send E2b-Sandbox-Id or use the sandbox's URL (newer E2B SDKs do)", ASKED_BODY_TIME.as_secs()),
        );
    };
    let mut nodes = f.nodes();
    if let Some(name) = token
        .as_ref()
        .and_then(|t| f.tokens.lock().unwrap().get(t).cloned())
    {
        nodes.sort_by_key(|n| n.name != name);
    }
    let mut last = None;
    for node in nodes {
        match try_node(&node, &parts, &body).await {
            Some(r) if r.status() == StatusCode::UNAUTHORIZED => last = Some(stream_back(r)),
            Some(r) => {
                if r.status().is_success() {
                    remember_token(f, token.as_deref(), &node.name);
                }
                return stream_back(r);
            }
            None => {}
        }
    }
    last.unwrap_or_else(|| {
        e2b_error(
            StatusCode::UNAUTHORIZED,
            "no node has a sandbox with this access token: use the envdAccessToken the create (or connect) answered",
        )
    })
}

/// Sends a held request to `node`'s plane; None when it could not.
async fn try_node(node: &Node, parts: &Parts, body: &Bytes) -> Option<reqwest::Response> {
    let (_, base, _) = node.e2b()?;
    let sent = plane_request(node, &base, None, parts)
        .body(body.clone())
        .send()
        .await;
    sent.map_err(|e| {
        tracing::warn!(node = %node.name, error = %error_chain(&e), "E2B sandbox plane: node unreachable")
    })
    .ok()
}

/// Remembers which node took `token` (only after a success, and only a
/// token shaped like poold's, so a client cannot fill the cache).
fn remember_token(f: &E2bFront, token: Option<&str>, node: &str) {
    let Some(t) =
        token.filter(|t| t.len() <= MAX_TOKEN_LEN && t.bytes().all(|b| b.is_ascii_alphanumeric()))
    else {
        return;
    };
    let mut tokens = f.tokens.lock().unwrap();
    if tokens.len() >= TOKEN_CACHE_MAX {
        tokens.clear();
    }
    tokens.insert(t.to_string(), node.to_string());
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

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
}
