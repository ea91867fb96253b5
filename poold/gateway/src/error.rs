//! The gateway's own errors and their one mapping to HTTP (poold's
//! `{"error": "..."}` shape, so clients handle both alike). A node's error
//! replies never come through here: they pass through as the node sent them.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("{field}: {why}")]
    BadRequest { field: &'static str, why: String },
    #[error("request body over {limit} bytes; the gateway reads at most that much of a spawn or snapshot request")]
    BodyTooLarge { limit: usize },
    #[error("no healthy node holds snapshot {tag:?}{down}; create or pull it on a node, or wait for its node to return")]
    NoNodeHolds { tag: String, down: DownList },
    #[error("no healthy node{down}; check `GET /v1/nodes` and the nodes' poold logs")]
    NoHealthyNode { down: DownList },
    #[error("sandbox {id} lives on node {node}, which is unreachable ({why}); it answers again when the node returns")]
    SandboxNodeDown {
        id: String,
        node: String,
        why: String,
    },
    #[error("no healthy node knows sandbox {id}{down}")]
    SandboxNotFound { id: String, down: DownList },
    #[error("node {node} did not answer: {why}")]
    NodeUnreachable { node: String, why: String },
    #[error("node {node} may have made it ({why}); it was not placed elsewhere, so nothing is made twice. List sandboxes to find it before asking again")]
    MaybeMade { node: String, why: String },
    #[error("{what} is not routed by the gateway yet: {hint}")]
    NotRouted {
        what: &'static str,
        hint: &'static str,
    },
}

/// The nodes that are down, as a suffix for messages (empty when none).
#[derive(Debug, Default)]
pub struct DownList(pub Vec<String>);

impl std::fmt::Display for DownList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            Ok(())
        } else {
            write!(f, " (unreachable now: {})", self.0.join(", "))
        }
    }
}

impl GatewayError {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            GatewayError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            GatewayError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::NoNodeHolds { .. } | GatewayError::SandboxNotFound { .. } => {
                StatusCode::NOT_FOUND
            }
            GatewayError::NoHealthyNode { .. } => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::SandboxNodeDown { .. } => StatusCode::GONE,
            GatewayError::NodeUnreachable { .. } | GatewayError::MaybeMade { .. } => {
                StatusCode::BAD_GATEWAY
            }
            GatewayError::NotRouted { .. } => StatusCode::NOT_IMPLEMENTED,
        }
    }
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.to_string() });
        (self.status(), axum::Json(body)).into_response()
    }
}
