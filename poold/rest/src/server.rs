//! forkd's `/v1` application: the routes ([`crate::table`]), bearer auth on
//! everything but `/healthz`, the `Host` check against DNS rebinding on
//! every route (`forkd_edge::hosts`), an audit line per
//! request (the outermost layer, so 421s and 401s are logged too), and
//! errors always as `{"error": "..."}`.

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use forkd_edge::audit::Audit;
use forkd_edge::hosts::HostPolicy;
use forkd_edge::transfers::Transfers;
use forkd_node::Node;
use std::sync::Arc;

/// What the `/v1` application needs besides the node.
pub struct Options {
    /// The bearer token; None: auth off.
    pub token: Option<String>,
    /// Which `Host` values it answers.
    pub hosts: HostPolicy,
    /// The audit log and request counter.
    pub audit: Arc<Audit>,
    /// The large-request slots (shared with the other listeners).
    pub transfers: Arc<Transfers>,
    /// Pages served beside the API without a token (the web console,
    /// `forkd_console::router`): behind the same `Host` check and audit
    /// log, outside the OpenAPI document (they are not API). Empty: none.
    pub pages: Router,
    /// Where this node's E2B planes listen, told in `GET /version` so a
    /// gateway can route E2B clients here; None: E2B is off.
    pub e2b: Option<forkd_api::E2bPlanes>,
}

/// The whole application: routes, auth, error shaping, host check, audit.
pub fn app(node: Arc<Node>, o: Options) -> Router {
    let api = super::routes(node.clone(), o.transfers).layer(middleware::from_fn_with_state(
        Arc::new(o.token),
        forkd_edge::auth::bearer,
    ));
    // No route of its own: every API route is in `table` (documented).
    Router::new()
        .merge(super::public_routes(node))
        .merge(o.pages)
        .merge(api)
        .layer(middleware::from_fn(json_errors))
        .layer(axum::Extension(E2bFront(o.e2b)))
        .layer(middleware::from_fn_with_state(
            Arc::new(o.hosts),
            forkd_edge::hosts::check_host,
        ))
        .layer(middleware::from_fn_with_state(
            o.audit,
            forkd_edge::audit::layer,
        ))
}

/// This node's E2B planes, for `GET /version`.
#[derive(Clone)]
pub(crate) struct E2bFront(pub(crate) Option<forkd_api::E2bPlanes>);

/// Turns axum's plain-text rejections (bad JSON, unknown route, wrong
/// method) into forkd's `{"error": "..."}`, with 400 for unparseable bodies.
async fn json_errors(req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    let status = r.status();
    let is_json = r
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return r;
    }
    let (parts, body) = r.into_parts();
    let bytes = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let mut msg = String::from_utf8_lossy(&bytes).trim().to_string();
    if msg.is_empty() {
        msg = status
            .canonical_reason()
            .unwrap_or("error")
            .to_ascii_lowercase();
    }
    let status = if status == StatusCode::UNPROCESSABLE_ENTITY {
        StatusCode::BAD_REQUEST
    } else {
        status
    };
    let mut out = (status, Json(serde_json::json!({ "error": msg }))).into_response();
    for (k, v) in parts.headers.iter() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out.extensions_mut().extend(parts.extensions);
    out
}
