//! Bearer-token auth: with a token configured, every request must carry
//! `Authorization: Bearer <token>` (compared in constant time); the
//! outcome rides on the response for the audit line.

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

/// What the auth layer decided, for the audit line: `ok`, `none` (auth
/// off), `missing` or `bad`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthOutcome(pub &'static str);

/// The middleware; its state is the token (None: auth off). A refusal is
/// 401 with `{"error": "missing or wrong bearer token"}`.
pub async fn bearer(
    State(token): State<Arc<Option<String>>>,
    mut req: Request,
    next: Next,
) -> Response {
    let outcome = match token.as_ref() {
        None => "none",
        Some(want) => {
            let got = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            if forkd_hub::auth::bearer_matches(got, want) {
                "ok"
            } else if got.is_none() {
                "missing"
            } else {
                "bad"
            }
        }
    };
    req.extensions_mut().insert(AuthOutcome(outcome));
    if matches!(outcome, "missing" | "bad") {
        let mut r = (
            StatusCode::UNAUTHORIZED,
            Json(serde_json::json!({"error": "missing or wrong bearer token"})),
        )
            .into_response();
        r.extensions_mut().insert(AuthOutcome(outcome));
        return r;
    }
    let mut r = next.run(req).await;
    r.extensions_mut().insert(AuthOutcome(outcome));
    r
}
