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
//!
//! Bounds, so a hostile server (a guest) cannot hold a slot for ever: an
//! upgrade must be answered within [`UPGRADE_ANSWER`]; an upgraded stream
//! ends after [`IDLE`] without a byte either way, and after [`LINGER`]
//! without one once a side has closed its half. A plain request waits as
//! long as its caller does (the caller leaving drops the exchange).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;

/// How long the server has to answer a request that asks to upgrade.
/// A WebSocket server answers its handshake at once; a caller should not
/// hold a slot on a server that never does.
pub const UPGRADE_ANSWER: Duration = Duration::from_secs(30);

/// An upgraded stream with no byte either way for this long is closed.
/// E2B's proxies close idle connections after about ten minutes too;
/// clients that keep a quiet stream open send pings (WebSocket clients do).
pub const IDLE: Duration = Duration::from_secs(600);

/// How long the other direction may stay quiet once one side has closed
/// its half of an upgraded stream.
pub const LINGER: Duration = Duration::from_secs(60);

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The connection failed, or the server's answer was not HTTP.
    #[error("{0}")]
    Http(#[from] hyper::Error),
    /// The server did not answer an upgrade in time ([`UPGRADE_ANSWER`]).
    #[error("no answer to the upgrade within {}s", .0.as_secs())]
    NoAnswer(Duration),
}

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
    req: Request,
    host: HeaderValue,
    credentials: &[&str],
    what: &str,
    slot: Option<OwnedSemaphorePermit>,
) -> Result<Response, RelayError>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    exchange_within(io, req, host, credentials, what, slot, UPGRADE_ANSWER).await
}

/// [`exchange`], an upgrade answered within `answer`: a relay in front
/// of another relay (the gateway's, before a node's) gives the one behind
/// it time to answer with its own error.
pub async fn exchange_within<T>(
    io: T,
    mut req: Request,
    host: HeaderValue,
    credentials: &[&str],
    what: &str,
    slot: Option<OwnedSemaphorePermit>,
    answer: Duration,
) -> Result<Response, RelayError>
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
    let sent = send.send_request(Request::from_parts(parts, body));
    let mut resp = match upgrade {
        Some(_) => tokio::time::timeout(answer, sent)
            .await
            .map_err(|_| RelayError::NoAnswer(answer))??,
        None => sent.await?,
    };
    let switched = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    let upgrade = upgrade.filter(|_| switched);
    if let (Some(_), Some(client_side)) = (&upgrade, client_side) {
        let server_side = hyper::upgrade::on(&mut resp);
        let label = what.to_string();
        tokio::spawn(async move {
            let _held = slot;
            match tokio::try_join!(client_side, server_side) {
                Ok((c, s)) => {
                    let (c, s) = (TokioIo::new(c), TokioIo::new(s));
                    if let Err(e) = pipe(c, s, IDLE, LINGER).await {
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

/// Copies `a` to `b` and `b` to `a` until both have closed, shutting
/// down each writer when its reader ends; Err(TimedOut) after `idle`
/// without a byte read either way, or, once one side has closed, after
/// `linger` without one.
async fn pipe<A, B>(a: A, b: B, idle: Duration, linger: Duration) -> std::io::Result<()>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let seen = Arc::new(Activity::new());
    let (ar, mut aw) = tokio::io::split(a);
    let (br, mut bw) = tokio::io::split(b);
    let mut ar = Watched(ar, seen.clone());
    let mut br = Watched(br, seen.clone());
    let ab = async {
        tokio::io::copy(&mut ar, &mut bw).await?;
        bw.shutdown().await
    };
    let ba = async {
        tokio::io::copy(&mut br, &mut aw).await?;
        aw.shutdown().await
    };
    tokio::pin!(ab, ba);
    let a_done = tokio::select! {
        r = &mut ab => { r?; true }
        r = &mut ba => { r?; false }
        _ = seen.quiet_for(idle) => return Err(timed_out("idle")),
    };
    let rest = async {
        match a_done {
            true => (&mut ba).await,
            false => (&mut ab).await,
        }
    };
    tokio::select! {
        r = rest => r,
        _ = seen.quiet_for(linger.min(idle)) => Err(timed_out("one side closed, the other went quiet")),
    }
}

fn timed_out(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, why.to_string())
}

/// When a read last ended (bytes or end of stream), in ms since `start`.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Resolves once no read has ended for `d`.
    async fn quiet_for(&self, d: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let due = self.start + last + d;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

/// A reader that records each read that ended (bytes, or end of stream).
struct Watched<R>(R, Arc<Activity>);

impl<R: AsyncRead + Unpin> AsyncRead for Watched<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.0).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = r {
            self.1.touch();
        }
        r
    }
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

    /// Both ends of a pipe under test, (the near side of `a`, of `b`),
    /// and the pipe's result with how long it ran.
    fn piped(
        idle_ms: u64,
        linger_ms: u64,
    ) -> (
        tokio::io::DuplexStream,
        tokio::io::DuplexStream,
        tokio::task::JoinHandle<(std::io::Result<()>, Duration)>,
    ) {
        let (a, a_far) = tokio::io::duplex(64);
        let (b, b_far) = tokio::io::duplex(64);
        let idle = Duration::from_millis(idle_ms);
        let linger = Duration::from_millis(linger_ms);
        let run = tokio::spawn(async move {
            let t0 = Instant::now();
            let r = pipe(a_far, b_far, idle, linger).await;
            (r, t0.elapsed())
        });
        (a, b, run)
    }

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[tokio::test]
    async fn a_quiet_stream_is_closed_after_the_idle_time() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut a, mut b, run) = piped(400, 100);
        // Writes closer together than the idle time keep it open.
        for _ in 0..3 {
            tokio::time::sleep(MS(250)).await;
            a.write_all(b"x").await.unwrap();
            assert_eq!(b.read_u8().await.unwrap(), b'x');
        }
        let (r, took) = run.await.unwrap();
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        assert!(took >= MS(750 + 400), "{took:?}");
        // Both sides see the end.
        assert_eq!(b.read(&mut [0u8; 1]).await.unwrap(), 0);
        assert_eq!(a.read(&mut [0u8; 1]).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_half_closed_stream_lingers_only_while_bytes_move() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, mut b, run) = piped(60_000, 400);
        let (mut a_read, mut a_write) = tokio::io::split(a);
        a_write.shutdown().await.unwrap(); // a closes its half; it still reads
                                           // b goes on talking, with pauses shorter than the linger...
        for _ in 0..4 {
            tokio::time::sleep(MS(250)).await;
            b.write_all(b"y").await.unwrap();
            assert_eq!(a_read.read_u8().await.unwrap(), b'y');
        }
        // ...then goes quiet, and the pipe ends long before the idle time.
        let (r, took) = run.await.unwrap();
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        assert!(took >= MS(1000 + 400), "{took:?}");
        assert!(took < MS(60_000), "{took:?}");
    }

    #[tokio::test]
    async fn a_stream_both_sides_close_ends_cleanly() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut a, mut b, run) = piped(60_000, 60_000);
        a.write_all(b"bye").await.unwrap();
        a.shutdown().await.unwrap();
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"bye");
        b.write_all(b"ok").await.unwrap();
        b.shutdown().await.unwrap();
        let mut got = Vec::new();
        a.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"ok");
        let (r, took) = run.await.unwrap();
        r.unwrap();
        assert!(took < MS(60_000), "{took:?}");
    }

    /// A server that takes the request and never answers the upgrade:
    /// the exchange gives up after its bound.
    #[tokio::test]
    async fn an_unanswered_upgrade_gives_up() {
        use tokio::io::AsyncReadExt;
        let (near, mut far) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let mut sink = Vec::new();
            let _ = far.read_to_end(&mut sink).await; // never answers
        });
        let req = Request::builder()
            .uri("/ws")
            .header(header::CONNECTION, "upgrade")
            .header(header::UPGRADE, "websocket")
            .body(Body::empty())
            .unwrap();
        let t0 = Instant::now();
        let host = HeaderValue::from_static("guest.test");
        let e = exchange_within(near, req, host, &[], "test", None, MS(300))
            .await
            .unwrap_err();
        assert!(matches!(e, RelayError::NoAnswer(_)), "{e}");
        assert!(t0.elapsed() >= MS(300));
        assert!(e.to_string().contains("no answer to the upgrade"), "{e}");
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
