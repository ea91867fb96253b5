//! Sandbox URLs: any guest port by name (E2B's `get_host(port)`).
//!
//! The SDK's `get_host(port)` is `<port>-<sandbox id>.<domain>`, where
//! `domain` is what create and connect answered ([`crate::E2bConfig::domain`]).
//! A request to the sandbox plane whose `Host` names a sandbox that way
//! goes to that guest port: envd's and the code interpreter's ports as if
//! the headers had named them (their token checks apply), any other port
//! proxied through the agent's tunnel to the guest's loopback, HTTP and
//! upgrades (WebSocket) alike, streamed both ways.
//!
//! Invariants:
//! - As in E2B, the ports of a sandbox created through E2B are public by
//!   default: the URL is enough. One created with `allowPublicTraffic:
//!   false`, and every sandbox spawned otherwise (`/v1`), answers only
//!   requests carrying its token (`e2b-traffic-access-token`, compared in
//!   constant time); others get 403.
//! - Credentials never reach the guest: both token headers are stripped.
//! - The guest's server sees the client's `Host`, or the sandbox's
//!   `maskRequestHost` with `${PORT}` replaced.
//! - A port among the sandbox's `httpsPorts` is spoken to over TLS
//!   (any certificate accepted: [`crate::guest_tls`]); the client still
//!   sees the plane's own scheme, as in E2B.
//! - Nothing listening there is a 502 naming the port, as a closed port
//!   is for E2B; a sandbox that is gone is the plane's usual 502.
//! - At most [`MAX_CONNECTIONS`] connections per sandbox are open through
//!   its URLs at once (each tunnel may hold a window of the guest's bytes
//!   on the host); past that a request gets 503 until one closes.

use crate::error::E2bError;
use crate::state::E2b;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use forkd_node::error::GuestErrorKind;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Most connections open at once to one sandbox's ports by URL.
pub const MAX_CONNECTIONS: usize = 256;

/// A sandbox's connection slots for its ports by URL.
pub struct Slots(Arc<Semaphore>);

impl Default for Slots {
    fn default() -> Slots {
        Slots(Arc::new(Semaphore::new(MAX_CONNECTIONS)))
    }
}

/// What `maskRequestHost` writes for the port.
pub const PORT_PLACEHOLDER: &str = "${PORT}";
/// The header E2B's clients send a sandbox's traffic token in.
pub const TRAFFIC_TOKEN: &str = "e2b-traffic-access-token";

/// The sandbox's credentials: never forwarded into the guest (hop-by-hop
/// headers never are either: [`forkd_edge::relay`]).
const CREDENTIALS: [&str; 3] = ["x-access-token", TRAFFIC_TOKEN, "x-api-key"];

/// The guest port and sandbox id a request's `Host` names under `domain`
/// (shared with the gateway's E2B plane: `forkd_edge::hosts`).
pub use forkd_edge::hosts::sandbox_address as addressed;

/// Serves a request for guest port `port` of sandbox `id`.
pub async fn handle(e: &E2b, id: &str, port: u16, req: Request) -> Response {
    serve(e, id, port, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn serve(e: &E2b, id: &str, port: u16, req: Request) -> Result<Response, E2bError> {
    let sb = e.sandbox(id).ok_or_else(|| {
        E2bError::sandbox_gone(format!(
            "sandbox {id:?} was not found: killed, paused, expired, or never created"
        ))
    })?;
    let access = &sb.rec.port_access;
    if !access.public {
        let token = req.headers().get(TRAFFIC_TOKEN).map(|v| v.as_bytes());
        if !token.is_some_and(|t| sb.rec.access_token.matches(t)) {
            return Err(E2bError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "sandbox {id}'s ports are not public (created with allowPublicTraffic: false, or not through E2B): send its trafficAccessToken in the {TRAFFIC_TOKEN} header"
                ),
            ));
        }
    }
    let slot = sb.session.port_slots.0.clone().try_acquire_owned().map_err(|_| {
        E2bError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("sandbox {id} has {MAX_CONNECTIONS} connections open to its ports already; close some and retry"),
        )
    })?;
    let tunnel = e.node.open_tunnel(id, port).await.map_err(|err| match err {
        forkd_node::Error::Guest(g) if matches!(g.kind, GuestErrorKind::NotFound) => {
            E2bError::sandbox_gone(format!(
                "nothing listens on port {port} in sandbox {id}: start a server there (on 0.0.0.0 or 127.0.0.1) first"
            ))
        }
        other => E2bError::sandbox_gone(format!(
            "port {port} of sandbox {id} cannot be reached: {other}"
        )),
    })?;
    let host = match &access.mask_host {
        Some(m) => HeaderValue::from_str(&m.replace(PORT_PLACEHOLDER, &port.to_string())).ok(),
        None => req.headers().get(header::HOST).cloned(),
    };
    let host = host.unwrap_or_else(|| HeaderValue::from_static("localhost"));
    let what = format!("port {port} of sandbox {id}");
    if access.https_ports.binary_search(&port).is_err() {
        return forward(tunnel, req, host, &what, Some(slot)).await;
    }
    let name = host.to_str().unwrap_or("localhost");
    let handshake = crate::guest_tls::connect(tunnel, name);
    let tls = match tokio::time::timeout(TLS_HANDSHAKE, handshake).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(err)) => return Err(no_tls(&what, &err.to_string())),
        Err(_) => return Err(no_tls(&what, "no answer within 30 s")),
    };
    forward(tls, req, host, &what, Some(slot)).await
}

/// How long a guest server on one of the `httpsPorts` has to finish its
/// TLS handshake.
const TLS_HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(30);

fn no_tls(what: &str, why: &str) -> E2bError {
    E2bError::sandbox_gone(format!(
        "{what} is one of the sandbox's httpsPorts, but no TLS handshake was possible there ({why}): serve HTTPS on it, or create the sandbox without it in httpsPorts"
    ))
}

/// One HTTP/1.1 exchange with a guest server over tunnel `t`, the guest
/// seeing `host` and neither token header; an upgrade (WebSocket) the
/// guest accepts is then copied both ways until either side closes
/// ([`forkd_edge::relay`]). `what` names the server in errors; `slot` is
/// held until the connection (or its upgraded stream) ends.
pub(crate) async fn forward<T>(
    t: T,
    req: Request,
    host: HeaderValue,
    what: &str,
    slot: Option<OwnedSemaphorePermit>,
) -> Result<Response, E2bError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    forkd_edge::relay::exchange(t, req, host, &CREDENTIALS, what, slot)
        .await
        .map_err(|e| {
            let status = match e {
                forkd_edge::relay::RelayError::NoAnswer(_) => StatusCode::GATEWAY_TIMEOUT,
                forkd_edge::relay::RelayError::Http(_) => StatusCode::BAD_GATEWAY,
            };
            E2bError::new(status, format!("{what} did not answer: {e}"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderMap;

    fn host(h: &str) -> HeaderMap {
        let mut m = HeaderMap::new();
        m.insert(header::HOST, HeaderValue::from_str(h).unwrap());
        m
    }

    #[test]
    fn a_host_names_a_port_and_a_sandbox_under_the_domain() {
        let d = "localhost:3001";
        assert_eq!(
            addressed(d, &host("8080-sb-00ab.localhost:3001")),
            Some((8080, "sb-00ab".into()))
        );
        assert_eq!(
            addressed("sbx.example.com", &host("49999-SB-1.Sbx.Example.com.")),
            Some((49999, "sb-1".into()))
        );
        for other in [
            "localhost:3001",
            "127.0.0.1:3001",
            "8080-sb-1.evil.example",
            "8080-sb-1.x.localhost",
            "sb-1.localhost",
            "0-sb-1.localhost",
            "70000-sb-1.localhost",
            "-sb-1.localhost",
            "8080-.localhost",
            "80a-sb-1.localhost",
        ] {
            assert_eq!(addressed(d, &host(other)), None, "{other}");
        }
        assert_eq!(addressed(d, &HeaderMap::new()), None);
    }

    #[test]
    fn a_sandbox_has_a_bounded_number_of_port_connections() {
        let s = Slots::default();
        let held: Vec<_> = (0..MAX_CONNECTIONS)
            .map(|_| s.0.clone().try_acquire_owned().unwrap())
            .collect();
        assert!(s.0.clone().try_acquire_owned().is_err());
        drop(held);
        assert!(s.0.clone().try_acquire_owned().is_ok());
    }
}
