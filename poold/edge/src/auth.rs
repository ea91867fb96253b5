//! Bearer-token auth: with a token configured, every request must carry
//! `Authorization: Bearer <token>` (compared in constant time); the
//! outcome rides on the response for the audit line.
//!
//! A browser cannot set headers on a WebSocket, so a WebSocket upgrade
//! may instead offer the token as a subprotocol:
//! `Sec-WebSocket-Protocol: <app protocol>, forkd.bearer.<hex of the token>`
//! (JavaScript: `new WebSocket(url, ["forkd.pty", "forkd.bearer." + hex])`).
//! Only upgrades are read this way, and only when no `Authorization`
//! header is sent; the route answers with its app protocol, never echoing
//! the token (docs/console.md, "Auth"). Hex, because a subprotocol may
//! hold only HTTP token characters and a token may hold `/`, `+`, `=`.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

/// The subprotocol prefix that carries a token on a WebSocket upgrade.
pub const BEARER_PROTOCOL: &str = "forkd.bearer.";

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
            let got = credential(req.headers());
            if forkd_hub::auth::bearer_matches(got.as_deref(), want) {
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

/// The request's credential as an `Authorization` value: the header, or
/// on a WebSocket upgrade without one, the token of a
/// [`BEARER_PROTOCOL`] subprotocol (`Bearer <token>`; an undecodable one
/// yields a value that matches no token, so it counts as `bad`).
fn credential(h: &HeaderMap) -> Option<String> {
    if let Some(v) = h.get(header::AUTHORIZATION) {
        return Some(v.to_str().unwrap_or("").to_string());
    }
    let upgrade = h
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if !upgrade {
        return None;
    }
    let offered = h
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .find_map(|p| p.strip_prefix(BEARER_PROTOCOL))?;
    Some(match unhex(offered) {
        Some(t) => format!("Bearer {t}"),
        None => String::new(),
    })
}

/// Lower- or upper-case hex to the ASCII string it encodes.
fn unhex(s: &str) -> Option<String> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let bytes = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const TOKEN: &str = "Zq3v9LkP0xW7rT2m/B8nC4dF6gH1jK5s=";

    fn hex(s: &str) -> String {
        s.bytes().map(|b| format!("{b:02x}")).collect()
    }

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(k.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_header_wins() {
        let h = headers(&[
            (header::AUTHORIZATION, "Bearer x"),
            (header::UPGRADE, "websocket"),
            (
                header::SEC_WEBSOCKET_PROTOCOL,
                &format!("forkd.pty, forkd.bearer.{}", hex(TOKEN)),
            ),
        ]);
        assert_eq!(credential(&h).as_deref(), Some("Bearer x"));
    }

    #[test]
    fn a_websocket_may_carry_the_token_as_a_subprotocol() {
        let p = format!("forkd.pty, forkd.bearer.{}", hex(TOKEN));
        let h = headers(&[
            (header::UPGRADE, "WebSocket"),
            (header::SEC_WEBSOCKET_PROTOCOL, &p),
        ]);
        let got = credential(&h);
        assert!(forkd_hub::auth::bearer_matches(got.as_deref(), TOKEN));
        // Two header lines, as some clients send them.
        let h = headers(&[
            (header::UPGRADE, "websocket"),
            (header::SEC_WEBSOCKET_PROTOCOL, "forkd.pty"),
            (
                header::SEC_WEBSOCKET_PROTOCOL,
                &format!("forkd.bearer.{}", hex(TOKEN)),
            ),
        ]);
        assert!(forkd_hub::auth::bearer_matches(
            credential(&h).as_deref(),
            TOKEN
        ));
    }

    #[test]
    fn only_upgrades_read_subprotocols() {
        let h = headers(&[(
            header::SEC_WEBSOCKET_PROTOCOL,
            &format!("forkd.bearer.{}", hex(TOKEN)),
        )]);
        assert_eq!(credential(&h), None);
    }

    #[test]
    fn a_bad_subprotocol_token_is_bad_not_missing() {
        for bad in ["forkd.bearer.zz", "forkd.bearer.abc", "forkd.bearer.ff"] {
            let h = headers(&[
                (header::UPGRADE, "websocket"),
                (header::SEC_WEBSOCKET_PROTOCOL, bad),
            ]);
            let got = credential(&h);
            assert!(got.is_some(), "{bad}");
            assert!(!forkd_hub::auth::bearer_matches(got.as_deref(), TOKEN));
        }
        let wrong = format!("forkd.bearer.{}", hex("Zq3v9LkP0xW7rT2m/B8nC4dF6gH1jK5t="));
        let h = headers(&[
            (header::UPGRADE, "websocket"),
            (header::SEC_WEBSOCKET_PROTOCOL, &wrong),
        ]);
        assert!(!forkd_hub::auth::bearer_matches(
            credential(&h).as_deref(),
            TOKEN
        ));
    }
}
