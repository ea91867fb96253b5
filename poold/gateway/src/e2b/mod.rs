//! The E2B planes through the gateway (docs/cluster.md, "E2B through the
//! gateway"): the unmodified E2B SDK with `E2B_API_URL` and
//! `E2B_SANDBOX_URL` pointed here reaches every node.
//!
//! - **Control plane** ([`control`]). A create is placed like a `/v1`
//!   spawn of one child of the template's tag ([`crate::place`]) and sent
//!   to that node's E2B API; a node that fails it (unreachable, full, lost
//!   the tag) is left out and the create placed once more. Per-sandbox
//!   calls go to the sandbox's node (the id carries it).
//! - **Lists** ([`lists`]): every node's whole list, merged and paged here
//!   with E2B's `limit`/`nextToken`; nodes that could not be asked are
//!   named in `forkd-unreachable-nodes`, as on `/v1`.
//! - **Sandbox plane** ([`plane`]). A request names its sandbox by its
//!   host (`<port>-<id>.<domain>`: sent on with the node's own domain in
//!   the host, so guest ports work too) or by `E2b-Sandbox-Id`; one naming
//!   it only by its access token or a signed URL (older SDKs) is tried on
//!   each node until one does not refuse it.
//! - **The domain.** Replies naming a sandbox's domain (create, connect,
//!   resume, fork) name the gateway's instead, so the SDK's
//!   `get_host(port)` comes back here.
//!
//! Invariants:
//! - per-sandbox bodies stream both ways, except small JSON control replies
//!   (read whole to rewrite the domain) and plane requests naming no
//!   sandbox (held, at most [`MAX_ASKED_BODY`], to try them on each node;
//!   at most [`MAX_ASKING`] at once);
//! - the gateway's own errors are E2B's `{"code", "message"}` (one mapping,
//!   [`e2b_error`]); a node's reply passes with its status and content type;
//! - a node is sent the node E2B key (`--node-e2b-key-file`, else the
//!   node's `/v1` token), never the client's key.

mod control;
mod lists;
mod plane;

pub use control::control_routes;
pub use plane::plane_routes;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use crate::error::GatewayError;
use crate::nodes::{Bound, Node, Registry};

/// The most of a request body held to try it on several nodes (a sandbox
/// plane request that names no sandbox): RPC calls and small files.
pub const MAX_ASKED_BODY: usize = 1 << 20;
/// Plane requests naming no sandbox held at once (each up to
/// [`MAX_ASKED_BODY`]); more wait their turn.
pub const MAX_ASKING: usize = 32;
/// Most upgraded connections (WebSockets to guest ports) the gateway
/// relays at once; past that an upgrade gets 503 until one closes.
pub const MAX_UPGRADES: usize = 4096;

/// What the E2B front-end of the gateway knows.
pub struct E2bFront {
    reg: Arc<Registry>,
    /// The domain sandbox URLs are answered under (`<port>-<id>.<domain>`).
    domain: String,
    /// The key clients send as `X-API-KEY` (the gateway's token); None:
    /// any key (a loopback gateway without a token).
    key: Option<String>,
    /// The key nodes' E2B planes take; None: each node's `/v1` token.
    node_key: Option<String>,
    /// Access token → node name, for requests naming no sandbox.
    tokens: Mutex<HashMap<String, String>>,
    /// Turns for requests naming no sandbox ([`MAX_ASKING`]).
    asking: tokio::sync::Semaphore,
    /// Upgraded connections to guest ports relayed at once
    /// ([`MAX_UPGRADES`]).
    upgrades: Arc<tokio::sync::Semaphore>,
}

type F = State<Arc<E2bFront>>;

impl E2bFront {
    pub fn new(
        reg: Arc<Registry>,
        domain: String,
        key: Option<String>,
        node_key: Option<String>,
    ) -> Arc<E2bFront> {
        Arc::new(E2bFront {
            reg,
            domain,
            key,
            node_key,
            tokens: Mutex::new(HashMap::new()),
            asking: tokio::sync::Semaphore::new(MAX_ASKING),
            upgrades: Arc::new(tokio::sync::Semaphore::new(MAX_UPGRADES)),
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

    /// A control-plane request to `node`'s E2B API with the key it takes:
    /// the node key, else the node's token, else a placeholder (a node
    /// without a key takes any on loopback). The client's key never
    /// leaves the gateway. None: the node no longer serves E2B.
    fn to_node(
        &self,
        node: &Node,
        bound: Bound,
        method: Method,
        pq: &str,
        h: &HeaderMap,
    ) -> Option<reqwest::RequestBuilder> {
        let (api, _, _) = node.e2b()?;
        let key = self
            .node_key
            .as_deref()
            .or(node.token())
            .unwrap_or("forkd-gateway");
        let mut rb = node
            .call_url(bound, method, &format!("{api}{pq}"))
            .header("x-api-key", key);
        if let Some(ct) = h.get(header::CONTENT_TYPE) {
            rb = rb.header(header::CONTENT_TYPE, ct);
        }
        Some(rb)
    }

    /// A node's whole JSON reply, with every sandbox's `domain` made the
    /// gateway's (so `get_host(port)` comes here).
    fn relay_json(&self, status: StatusCode, headers: &HeaderMap, body: &Bytes) -> Response {
        let body = match serde_json::from_slice::<Value>(body) {
            Ok(mut v) => {
                set_domain(&mut v, &self.domain);
                Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
            }
            Err(_) => body.clone(),
        };
        let mut r = (status, body).into_response();
        if let Some(ct) = headers.get(header::CONTENT_TYPE) {
            r.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
        }
        r
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

#[cfg(test)]
mod tests {
    use super::*;

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
