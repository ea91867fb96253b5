//! One HTTP/1.1 exchange relayed over a byte stream a front-end opened
//! (an agent's tunnel to a guest port, TLS around one, a TCP connection to
//! a node's plane), upgrades (WebSocket) included: what the E2B sandbox
//! plane does for a guest port, and what the gateway's does for a node.
//!
//! Invariants: hop-by-hop headers (RFC 9110, 7.6.1) and the caller's
//! credentials never cross, either way; the other side sees the `Host` the caller
//! gives; an upgrade the other side accepts (101) is copied both ways
//! until either end closes, never buffered; what the caller holds for the
//! connection (a slot of a bounded count) is released when the
//! connection, or its upgraded stream, ends.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::OwnedSemaphorePermit;

/// Headers that describe one hop, not the message: never relayed.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
];

/// Relays `req` over `io` to the server there, which sees `host` and none
/// of `credentials` (header names); its answer, streamed. `what` names the
/// server in logs; `slot` is held until the connection (or its upgraded
/// stream) ends. Err: the server did not answer.
pub async fn exchange<T>(
    io: T,
    mut req: Request,
    host: HeaderValue,
    credentials: &[&str],
    what: &str,
    slot: Option<OwnedSemaphorePermit>,
) -> Result<Response, hyper::Error>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let slot = Arc::new(slot);
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    let label = what.to_string();
    let held = slot.clone();
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("{label}: {e}");
        }
        drop(held);
    });
    let upgrade = upgrade_of(req.headers());
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    strip(&mut parts.headers, credentials, upgrade.as_ref());
    parts.headers.insert(header::HOST, host);
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = path.parse().unwrap_or_else(|_| Uri::from_static("/"));
    let mut resp = send.send_request(Request::from_parts(parts, body)).await?;
    let switched = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    let upgrade = upgrade.filter(|_| switched);
    if let (Some(_), Some(client_side)) = (&upgrade, client_side) {
        let server_side = hyper::upgrade::on(&mut resp);
        let label = what.to_string();
        tokio::spawn(async move {
            let _held = slot;
            match tokio::try_join!(client_side, server_side) {
                Ok((c, s)) => {
                    let (mut c, mut s) = (TokioIo::new(c), TokioIo::new(s));
                    if let Err(e) = tokio::io::copy_bidirectional(&mut c, &mut s).await {
                        tracing::debug!("{label} upgraded stream: {e}");
                    }
                }
                Err(e) => tracing::debug!("{label} upgrade: {e}"),
            }
        });
    }
    let (mut parts, body) = resp.into_parts();
    strip(&mut parts.headers, credentials, upgrade.as_ref());
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// The protocol a request asks to switch to (`Connection: upgrade` and
/// `Upgrade: <protocol>`), if any.
pub fn upgrade_of(h: &HeaderMap) -> Option<HeaderValue> {
    let asks = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    asks.then(|| h.get(header::UPGRADE).cloned()).flatten()
}

/// Removes the hop-by-hop headers and `credentials`, keeping an upgrade's
/// two headers.
fn strip(h: &mut HeaderMap, credentials: &[&str], upgrade: Option<&HeaderValue>) {
    for name in HOP_BY_HOP.iter().chain(credentials) {
        h.remove(*name);
    }
    if let Some(u) = upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, u.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upgrades_keep_their_headers_and_nothing_else_hops() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("x-access-token", HeaderValue::from_static("secret"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-app", HeaderValue::from_static("kept"));
        let u = upgrade_of(&h);
        assert_eq!(u.as_ref().map(|v| v.as_bytes()), Some(&b"websocket"[..]));
        strip(&mut h, &["x-access-token"], u.as_ref());
        assert_eq!(h[header::CONNECTION], "upgrade");
        assert_eq!(h[header::UPGRADE], "websocket");
        assert!(h.get("x-access-token").is_none());
        assert!(h.get("keep-alive").is_none());
        assert_eq!(h["x-app"], "kept");
        // Without an upgrade, neither header survives.
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        assert_eq!(upgrade_of(&h), None);
        strip(&mut h, &[], None);
        assert!(h.is_empty());
    }

    /// A server that switches protocols gets the client's bytes, and the
    /// client its answer, through the relay.
    #[tokio::test]
    async fn an_accepted_upgrade_is_copied_both_ways() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (near, mut far) = tokio::io::duplex(4096);
        let server = tokio::spawn(async move {
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                head.push(far.read_u8().await.unwrap());
            }
            let head = String::from_utf8(head).unwrap();
            assert!(
                head.to_ascii_lowercase().contains("upgrade: echo"),
                "{head}"
            );
            assert!(head.contains("host: guest.test"), "{head}");
            assert!(!head.contains("secret"), "{head}");
            far.write_all(
                b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: echo\r\nx-secret: leaked\r\n\r\n",
            )
            .await
            .unwrap();
            let mut buf = [0u8; 5];
            far.read_exact(&mut buf).await.unwrap();
            far.write_all(&buf.to_ascii_uppercase()).await.unwrap();
        });
        let near = Arc::new(std::sync::Mutex::new(Some(near)));
        let app = axum::Router::new().route(
            "/ws",
            axum::routing::get(move |req: Request| {
                let io = near.lock().unwrap().take().expect("one request");
                async move {
                    let host = HeaderValue::from_static("guest.test");
                    exchange(io, req, host, &["x-secret"], "test", None)
                        .await
                        .unwrap()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: echo\r\nX-Secret: secret\r\n\r\n")
            .await
            .unwrap();
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            head.push(c.read_u8().await.unwrap());
        }
        let head = String::from_utf8_lossy(&head);
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        assert!(!head.contains("leaked"), "a credential came back: {head}");
        c.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"HELLO");
        server.await.unwrap();
    }
}
