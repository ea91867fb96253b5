//! forkd-console: the web console (docs/console.md), a front-end adapter
//! that serves three static files under `/console/` and nothing else. The
//! page's script talks to poold's `/v1` API from the browser with the
//! operator's bearer token, so the console has no data path of its own,
//! no state, and no way around `/v1`'s auth: the files themselves hold no
//! secret and load without a token.
//!
//! Invariants:
//! - The files are compiled in (`include_str!`): no build step, no file
//!   system access at run time, no CDN; the console works offline.
//! - Every answer carries [`SECURITY_HEADERS`]: a CSP allowing only this
//!   origin (no inline script or style, no framing), `nosniff`, no
//!   referrer. The page therefore keeps all script in `app.js` and all
//!   style in `style.css`.
//! - It imports no other front-end; poold merges [`router`] beside the
//!   REST routes, behind the same `Host` check and audit log (docs/design.md,
//!   "Crates").

use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// The page (its markup; no inline script or style).
const INDEX: &str = include_str!("../assets/index.html");
/// All of the page's behaviour.
const APP_JS: &str = include_str!("../assets/app.js");
/// All of the page's style.
const STYLE: &str = include_str!("../assets/style.css");

/// Where the console lives.
pub const PATH: &str = "/console/";

/// The headers on every console answer. `connect-src 'self'` covers the
/// page's `fetch`es to `/v1` and its terminal WebSocket (CSP 3 lets
/// `'self'` match `ws:`/`wss:` of the same host and port).
pub const SECURITY_HEADERS: [(&str, &str); 6] = [
    (
        "content-security-policy",
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cache-control", "no-cache"),
];

/// The console's routes: `/console` (redirects), `/console/`,
/// `/console/app.js`, `/console/style.css`. Generic over the state so it
/// merges into any router.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/console", get(|| async { Redirect::permanent(PATH) }))
        .route(
            PATH,
            get(|| async { file("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/console/app.js",
            get(|| async { file("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/console/style.css",
            get(|| async { file("text/css; charset=utf-8", STYLE) }),
        )
}

/// One static file with its type and [`SECURITY_HEADERS`].
fn file(content_type: &'static str, body: &'static str) -> Response {
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    for (k, v) in SECURITY_HEADERS {
        h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get(path: &str) -> Response {
        router::<()>()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn every_file_is_served_with_the_security_headers() {
        for (path, ty) in [
            ("/console/", "text/html"),
            ("/console/app.js", "text/javascript"),
            ("/console/style.css", "text/css"),
        ] {
            let r = get(path).await;
            assert_eq!(r.status(), StatusCode::OK, "{path}");
            let h = r.headers();
            assert!(h[header::CONTENT_TYPE].to_str().unwrap().starts_with(ty));
            assert!(h["content-security-policy"]
                .to_str()
                .unwrap()
                .starts_with("default-src 'self';"));
            assert_eq!(h["x-frame-options"], "DENY");
            assert_eq!(h["x-content-type-options"], "nosniff");
        }
        let r = get("/console").await;
        assert_eq!(r.status(), StatusCode::PERMANENT_REDIRECT);
        assert_eq!(r.headers()[header::LOCATION], "/console/");
        assert_eq!(get("/console/other").await.status(), StatusCode::NOT_FOUND);
    }

    /// The CSP forbids inline script and style: the page must have none,
    /// or it would silently not work.
    #[test]
    fn the_page_has_no_inline_script_or_style() {
        let lower = INDEX.to_ascii_lowercase();
        assert!(!lower.contains("<style"), "inline <style>");
        assert!(!lower.contains(" style="), "a style attribute");
        let handler = lower.split(" on").skip(1).any(|rest| {
            let name: String = rest.chars().take_while(char::is_ascii_alphabetic).collect();
            !name.is_empty() && rest[name.len()..].starts_with('=')
        });
        assert!(!handler, "an inline event handler");
        let scripts: Vec<&str> = lower.split("<script").skip(1).collect();
        assert_eq!(scripts.len(), 1, "one script, app.js");
        assert!(scripts[0].trim_start().starts_with("src=\"app.js\""));
        assert!(
            !APP_JS.contains("innerHTML"),
            "build DOM nodes, never markup strings"
        );
        assert!(!APP_JS.contains("eval("));
    }
}
