//! The E2B control plane through the gateway: creates placed, per-sandbox
//! calls sent to the sandbox's node, template deletes on every node.

use std::collections::HashSet;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post};
use axum::{middleware, Router};
use serde_json::Value;

use super::{e2b_error, from_gateway, lists, E2bFront, F};
use crate::error::GatewayError;
use crate::nodes::{Bound, Node};
use crate::place::place;
use crate::proxy::{
    candidates, check_id, read_making, read_reply, worth_placing_elsewhere, Making, NodeReply,
    MAX_JSON_BODY,
};

/// The control plane's routes, behind the API-key check.
pub fn control_routes(f: Arc<E2bFront>) -> Router {
    Router::new()
        .route("/sandboxes", post(create).get(lists::sandboxes))
        .route("/v2/sandboxes", post(create).get(lists::sandboxes))
        .route("/sandboxes/{id}", any(per_sandbox))
        .route("/sandboxes/{id}/{*rest}", any(per_sandbox))
        .route("/v2/sandboxes/{id}/{*rest}", any(per_sandbox))
        .route("/snapshots", get(lists::snapshots))
        .route("/templates/{id}", delete(delete_template))
        .route("/volumes", any(no_volumes))
        .route("/volumes/{*rest}", any(no_volumes))
        .route("/volumecontent/{*rest}", any(no_volumes))
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

/// `X-API-KEY` must be the gateway's token when it has one (constant
/// time, as the bearer check).
async fn api_key(State(f): F, req: Request, next: middleware::Next) -> Response {
    if let Some(key) = &f.key {
        let got = req.headers().get("x-api-key").map(|v| v.as_bytes());
        if !got.is_some_and(|g| same(g, key.as_bytes())) {
            return e2b_error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong X-API-KEY: set E2B_API_KEY to the gateway's token (docs/cluster.md)",
            );
        }
    }
    next.run(req).await
}

fn same(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

/// Why the gateway serves no E2B volumes: each is a host folder of one
/// node, and a create through the gateway may land on any node.
const NO_VOLUMES: &str = "E2B volumes are host folders of one poold, and the gateway places a sandbox on any node: make volumes and the sandboxes that mount them against one poold's E2B API (docs/e2b.md, \"Volumes\")";

async fn no_volumes() -> Response {
    e2b_error(StatusCode::BAD_REQUEST, NO_VOLUMES)
}

/// Whether a create body asks for volume mounts.
fn mounts_volumes(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).is_ok_and(|v| {
        ["volumeMounts", "volume_mounts"].iter().any(|k| {
            v.get(k)
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
        })
    })
}

/// The template a create names (its snapshot tag).
fn template_of(body: &[u8]) -> Option<String> {
    let v = serde_json::from_slice::<Value>(body).ok()?;
    let t = v.get("templateID").or_else(|| v.get("template_id"))?;
    t.as_str().map(str::to_string)
}

/// `POST /sandboxes`: placed by the template's tag, tried on a second
/// node when the first fails it for a reason another may not have, never
/// when the first may have made it ([`Making::MaybeMade`]).
async fn create(State(f): F, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_JSON_BODY).await else {
        return from_gateway(GatewayError::BodyTooLarge {
            limit: MAX_JSON_BODY,
        });
    };
    let Some(tag) = template_of(&body) else {
        return e2b_error(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object with templateID (the snapshot tag)",
        );
    };
    if mounts_volumes(&body) {
        return e2b_error(StatusCode::BAD_REQUEST, NO_VOLUMES);
    }
    let nodes = f.nodes();
    let mut failed = HashSet::new();
    let mut last = None;
    for _round in 0..2 {
        let Some(plan) = place(1, &candidates(&nodes, &tag, &failed)) else {
            break;
        };
        let i = plan[0].0;
        let node = &nodes[i];
        failed.insert(i);
        let Some(rb) = f.to_node(
            node,
            Bound::Connect,
            Method::POST,
            parts.uri.path(),
            &parts.headers,
        ) else {
            continue;
        };
        match read_making(node, rb.body(body.clone()).send().await).await {
            Making::NotSent(e) => last = Some(from_gateway(e)),
            Making::MaybeMade(e) => return from_gateway(e),
            Making::Answered(reply) if worth_placing_elsewhere(reply.status) => {
                tracing::warn!(node = %node.name, status = %reply.status, "E2B create failed; placing it elsewhere");
                last = Some(reply.into_response());
            }
            Making::Answered(reply) => return created(&f, node, &tag, reply),
        }
    }
    last.unwrap_or_else(|| {
        from_gateway(GatewayError::NoNodeHolds {
            tag,
            down: f.reg.down(),
        })
    })
}

/// A node's answer to a create, counted and with the gateway's domain. A
/// success without a readable `sandboxID` is the /v1 spawn's case: the node
/// may have made one the client cannot name.
fn created(f: &E2bFront, node: &Node, tag: &str, reply: NodeReply) -> Response {
    if reply.status.is_success() {
        node.note_spawned(tag, 1);
        let id = serde_json::from_slice::<Value>(&reply.body)
            .ok()
            .and_then(|v| Some(v.get("sandboxID")?.as_str()?.to_string()));
        let Some(id) = id else {
            return from_gateway(GatewayError::MaybeMade {
                node: node.name.clone(),
                why: format!("it answered {} with no sandboxID in its body", reply.status),
            });
        };
        f.reg.remember(&id, &node.name);
    }
    f.relay_json(reply.status, &reply.headers, &reply.body)
}

/// The sandbox id of a control-plane path (`/sandboxes/{id}[/...]`,
/// `/v2/sandboxes/{id}/...`).
fn id_of(path: &str) -> &str {
    let rest = path.strip_prefix("/v2").unwrap_or(path);
    let rest = rest.strip_prefix("/sandboxes/").unwrap_or("");
    rest.split('/').next().unwrap_or("")
}

/// `/sandboxes/{id}/...`: the sandbox's node. Replies are small JSON
/// (info, connect, metrics, fork), read whole to name the gateway's domain.
async fn per_sandbox(State(f): F, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let id = id_of(&path).to_string();
    if let Err(e) = check_id(&id) {
        return from_gateway(e);
    }
    let node = match f.reg.locate(&id).await {
        Ok(n) => n,
        Err(e) => return from_gateway(e),
    };
    let (parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Some(rb) = f.to_node(
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
            f.relay_json(r.status, &r.headers, &r.body)
        }
        Err(e) => from_gateway(e),
    }
}

/// `DELETE /templates/{id}`: on every node; 404 only when no node had it.
async fn delete_template(State(f): F, req: Request) -> Response {
    let pq = req.uri().path().to_string();
    let nodes = f.nodes();
    let sends = nodes.iter().map(|n| {
        let rb = f.to_node(n, Bound::Whole, Method::DELETE, &pq, req.headers());
        async move { read_reply(n, rb?.send().await).await.ok() }
    });
    let mut not_found = None;
    let mut ok = None;
    for r in futures::future::join_all(sends).await.into_iter().flatten() {
        if r.status == StatusCode::NOT_FOUND {
            not_found.get_or_insert(r);
        } else if !r.status.is_success() {
            return r.into_response();
        } else {
            ok.get_or_insert(r);
        }
    }
    match ok.or(not_found) {
        Some(r) => r.into_response(),
        None => from_gateway(GatewayError::NoHealthyNode { down: f.reg.down() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_create_answered_without_a_sandbox_id_may_have_made_one() {
        use crate::config::{Config, NodeAddr};
        let cfg = Config::for_test(vec![NodeAddr {
            name: "n1".into(),
            url: "http://127.0.0.1:9".into(),
        }]);
        let reg = Arc::new(crate::Registry::new(&cfg).unwrap());
        let node = reg.nodes().remove(0);
        let f = E2bFront::new(reg, "localhost:1".into(), None, None);
        let reply = |body: &'static str| NodeReply {
            status: StatusCode::CREATED,
            headers: axum::http::HeaderMap::new(),
            body: axum::body::Bytes::from_static(body.as_bytes()),
        };
        let r = created(&f, &node, "py", reply("not json"));
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        assert!(String::from_utf8_lossy(&body).contains("may have made it"));
        let r = created(&f, &node, "py", reply(r#"{"sandboxID":"sb-1"}"#));
        assert_eq!(r.status(), StatusCode::CREATED);
    }

    /// A volume is one node's folder: a create through the gateway that
    /// mounts one is refused before it is placed.
    #[test]
    fn creates_mounting_volumes_are_refused() {
        assert!(mounts_volumes(
            br#"{"templateID":"t","volumeMounts":[{"name":"v","path":"/d"}]}"#
        ));
        assert!(!mounts_volumes(br#"{"templateID":"t","volumeMounts":[]}"#));
        assert!(!mounts_volumes(br#"{"templateID":"t"}"#));
    }

    #[test]
    fn control_paths_name_their_sandbox() {
        assert_eq!(id_of("/sandboxes/sb-1"), "sb-1");
        assert_eq!(id_of("/sandboxes/sb-1/connect"), "sb-1");
        assert_eq!(id_of("/v2/sandboxes/sb-2/connect"), "sb-2");
        assert_eq!(id_of("/other/sb-3"), "");
        assert_eq!(
            template_of(br#"{"templateID": "py"}"#).as_deref(),
            Some("py")
        );
        assert_eq!(
            template_of(br#"{"template_id": "py"}"#).as_deref(),
            Some("py")
        );
        assert_eq!(template_of(br#"{"templateID": 1}"#), None);
        assert_eq!(template_of(b"[]"), None);
    }
}
