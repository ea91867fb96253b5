//! DNS-rebinding protection: poold answers only requests whose `Host` names
//! it (docs/security.md, "DNS rebinding").
//!
//! A web page on `evil.example` can make the victim's browser resolve
//! `evil.example` to 127.0.0.1 and then read poold's answers as
//! same-origin. Such a request always carries `Host: evil.example`, so
//! poold refuses (421) every TCP request whose host is not one it is known
//! by. Invariants:
//! - Allowed over TCP: `localhost` (and `*.localhost`, which browsers
//!   resolve to loopback themselves), any IP literal (`127.0.0.1`,
//!   `[::1]`, the bind address, a LAN address: an IP has no DNS to rebind,
//!   and a page served from that IP is poold's own origin), and the names
//!   configured in `allowed_hosts`. The port is not compared: rebinding
//!   changes the address a name points at, not the port.
//! - Compared case-insensitively, a trailing dot ignored (`LOCALHOST.`).
//! - A request without a host (no `Host` header, no absolute URI) is
//!   refused too: every HTTP/1.1 client sends one.
//! - On the unix socket every host is accepted: no browser can reach it.
//! - It applies to every route, `/healthz` included: the check costs
//!   nothing, and "what a rebinding page may read" is simplest as "nothing".

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

/// Which hosts poold answers to.
#[derive(Debug, Clone, Default)]
pub struct HostPolicy {
    /// Accept any host (unix socket listeners).
    pub any: bool,
    /// Extra names (`allowed_hosts`), lowercased, without trailing dot.
    pub names: Vec<String>,
    /// Domains whose every subdomain is allowed (the E2B sandbox URLs'
    /// `<port>-<id>.<domain>`), lowercased, without trailing dot.
    pub suffixes: Vec<String>,
}

/// Why a host was refused, for the error body.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Unparseable(String),
    Unknown(String),
}

impl HostPolicy {
    /// A policy for a TCP listener with the configured extra names.
    pub fn tcp(names: &[String]) -> HostPolicy {
        HostPolicy {
            any: false,
            names: names.iter().map(|n| normalize(n)).collect(),
            suffixes: Vec::new(),
        }
    }

    /// This policy, also allowing every subdomain of `domain`.
    pub fn with_suffix(mut self, domain: &str) -> HostPolicy {
        self.suffixes.push(normalize(domain));
        self
    }

    /// Decides on the host a request names (`Host` header or the URI's
    /// authority).
    pub fn check(&self, host: Option<&str>) -> Result<(), Refusal> {
        if self.any {
            return Ok(());
        }
        let raw = host.ok_or(Refusal::Missing)?;
        let name = host_part(raw).ok_or_else(|| Refusal::Unparseable(raw.to_string()))?;
        let name = normalize(&name);
        let bare = name.trim_start_matches('[').trim_end_matches(']');
        if name == "localhost"
            || name.ends_with(".localhost")
            || bare.parse::<std::net::IpAddr>().is_ok()
            || self.names.contains(&name)
            || self.suffixes.iter().any(|s| {
                name.strip_suffix(s.as_str())
                    .is_some_and(|l| l.len() > 1 && l.ends_with('.'))
            })
        {
            Ok(())
        } else {
            Err(Refusal::Unknown(name))
        }
    }
}

fn normalize(name: &str) -> String {
    name.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// The host of a `host[:port]` value (IPv6 literals may keep their
/// brackets); None when it is not a valid authority or carries user info.
fn host_part(raw: &str) -> Option<String> {
    let a: axum::http::uri::Authority = raw.parse().ok()?;
    if a.as_str().contains('@') || a.host().is_empty() {
        return None;
    }
    Some(a.host().to_string())
}

/// The host a request names: its `Host` header, else (HTTP/2) the URI's
/// authority.
fn request_host(req: &Request) -> Option<String> {
    match req.headers().get(header::HOST) {
        Some(v) => Some(String::from_utf8_lossy(v.as_bytes()).into_owned()),
        None => req.uri().authority().map(|a| a.to_string()),
    }
}

/// The middleware: refuses with 421 and a JSON error that says what to
/// configure. It sits inside the audit layer, so refusals are audited.
pub async fn check_host(State(p): State<Arc<HostPolicy>>, req: Request, next: Next) -> Response {
    let host = request_host(&req);
    match p.check(host.as_deref()) {
        Ok(()) => next.run(req).await,
        Err(r) => {
            let msg = match r {
                Refusal::Missing => "request has no Host header; poold answers only requests that name it (DNS rebinding protection)".to_string(),
                Refusal::Unparseable(h) => format!("Host header {h:?} is not a valid host[:port]"),
                Refusal::Unknown(h) => format!(
                    "poold is not known as {h:?} (DNS rebinding protection: only localhost, IP addresses and configured names are answered); \
                     if clients reach poold by this name, allow it with --allow-host {h} or allowed_hosts = [\"{h}\"] in the config"
                ),
            };
            (
                StatusCode::MISDIRECTED_REQUEST,
                Json(serde_json::json!({ "error": msg })),
            )
                .into_response()
        }
    }
}

/// The guest port and sandbox id a request's `Host` names under an E2B
/// sandbox `domain` (`<port>-<id>.<domain>`, ports and case ignored);
/// None: it names none. poold's E2B plane and the gateway's read hosts
/// alike.
pub fn sandbox_address(domain: &str, headers: &axum::http::HeaderMap) -> Option<(u16, String)> {
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let host = strip_port(host.trim().trim_end_matches('.')).to_ascii_lowercase();
    let (label, rest) = host.split_once('.')?;
    if rest != strip_port(domain) {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    (!id.is_empty()).then(|| (port, id.to_string()))
}

/// `host` without a trailing `:port`.
fn strip_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

/// Checks an E2B sandbox domain (`e2b.sandbox_domain`, the gateway's
/// `--e2b-sandbox-domain`): `host[:port]`, lowercased, without a trailing
/// dot, nothing else.
pub fn sandbox_domain(d: &str) -> Result<String, String> {
    let d = d.trim().trim_end_matches('.').to_ascii_lowercase();
    let ok = d
        .parse::<axum::http::uri::Authority>()
        .is_ok_and(|a| a.as_str() == d && !d.contains('@') && !a.host().is_empty());
    if !ok || d.starts_with('.') || d.contains('/') {
        return Err(format!("{d:?}: want a DNS name with an optional port, e.g. sandboxes.example.com or localhost:3001"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::routing::get;
    use axum::Router;
    use tower::ServiceExt;

    #[test]
    fn allowed_and_refused_hosts() {
        let p = HostPolicy::tcp(&["Poold.Internal.".to_string()]);
        for ok in [
            "localhost",
            "localhost:8889",
            "LOCALHOST.",
            "app.localhost:1",
            "127.0.0.1",
            "127.0.0.1:8889",
            "[::1]",
            "[::1]:8889",
            "10.1.2.3:8889",
            "poold.internal",
            "poold.internal:8889",
        ] {
            assert_eq!(p.check(Some(ok)), Ok(()), "{ok}");
        }
        assert_eq!(
            p.check(Some("evil.example")),
            Err(Refusal::Unknown("evil.example".into()))
        );
        assert_eq!(
            p.check(Some("evil.example:8889")),
            Err(Refusal::Unknown("evil.example".into()))
        );
        // Look-alikes of allowed names.
        for bad in [
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "poold.internal.evil.example",
            "1.2.3.4.nip.io",
        ] {
            assert!(
                matches!(p.check(Some(bad)), Err(Refusal::Unknown(_))),
                "{bad}"
            );
        }
        for bad in ["user@localhost", "", "a b", "[::1"] {
            assert!(p.check(Some(bad)).is_err(), "{bad:?}");
        }
        assert_eq!(p.check(None), Err(Refusal::Missing));
        let unix = HostPolicy {
            any: true,
            names: vec![],
            suffixes: vec![],
        };
        let sbx = HostPolicy::tcp(&[]).with_suffix("Sbx.Example.");
        assert_eq!(sbx.check(Some("8080-sb-1.sbx.example:443")), Ok(()));
        for bad in ["sbx.example", "xsbx.example", "sbx.example.evil"] {
            assert!(sbx.check(Some(bad)).is_err(), "{bad}");
        }
        assert_eq!(unix.check(Some("evil.example")), Ok(()));
        assert_eq!(unix.check(None), Ok(()));
    }

    #[tokio::test]
    async fn middleware_answers_421_with_advice() {
        let app = Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .layer(axum::middleware::from_fn_with_state(
                Arc::new(HostPolicy::tcp(&[])),
                check_host,
            ));
        let req = |host: &str| {
            axum::http::Request::builder()
                .uri("/healthz")
                .header(header::HOST, host)
                .body(Body::empty())
                .unwrap()
        };
        let r = app.clone().oneshot(req("evil.example:8889")).await.unwrap();
        assert_eq!(r.status(), StatusCode::MISDIRECTED_REQUEST);
        let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let e = v["error"].as_str().unwrap();
        assert!(e.contains("--allow-host evil.example"), "{e}");
        let r = app.oneshot(req("127.0.0.1:8889")).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}
