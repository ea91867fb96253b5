//! Bounded large requests: file transfers and big bodies.
//!
//! A request body is buffered whole before its handler runs, and a file
//! download is read whole from the agent before it is sent: up to
//! [`super::api::files::MAX_FILE_BYTES`] each. Without a bound, N clients
//! make poold hold N times that. So every request that may carry or return
//! a large body takes one of `transfer_concurrency` slots *before* its body
//! is read, and keeps it until its response body is sent (or dropped):
//!
//! - any `/files` request that moves content (`GET`/`PUT .../files`);
//! - any request declaring a body over [`SMALL_BODY`], or a body of
//!   unknown length (chunked).
//!
//! A request waits up to [`SLOT_WAIT`] for a slot, then gets 503. Small
//! requests (exec, eval, spawn: JSON under a MiB) never wait.

use super::error::ApiError;
use super::Daemon;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// Bodies up to this size need no slot.
pub const SMALL_BODY: u64 = 1 << 20;
/// How long a large request waits for a slot before its 503.
pub const SLOT_WAIT: Duration = Duration::from_secs(60);

/// The middleware (see the module doc).
pub async fn turn(State(d): State<Arc<Daemon>>, req: Request, next: Next) -> Response {
    if !is_large(&req) {
        return next.run(req).await;
    }
    let slot = tokio::time::timeout(SLOT_WAIT, d.transfer_slots.clone().acquire_owned()).await;
    let Ok(Ok(permit)) = slot else {
        return ApiError::unavailable(format!(
            "{} large transfers are in flight (transfer_concurrency) and none finished in {}s; retry later",
            d.cfg.transfer_concurrency,
            SLOT_WAIT.as_secs()
        ))
        .into_response();
    };
    let resp = next.run(req).await;
    // The slot goes with the response body: a download's bytes count until
    // they are sent.
    resp.map(|b| {
        Body::from_stream(b.into_data_stream().map(move |chunk| {
            let _held = &permit;
            chunk
        }))
    })
}

fn is_large(req: &Request) -> bool {
    let h = req.headers();
    let moves_file =
        req.uri().path().ends_with("/files") && matches!(*req.method(), Method::GET | Method::PUT);
    let declared = h
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let chunked = declared.is_none() && h.contains_key(header::TRANSFER_ENCODING);
    moves_file || chunked || declared.is_some_and(|n| n > SMALL_BODY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: Method, path: &str, headers: &[(&str, &str)]) -> Request {
        let mut b = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(Body::empty()).unwrap()
    }

    #[test]
    fn which_requests_need_a_slot() {
        let f = "/v1/sandboxes/x/files";
        assert!(is_large(&req(Method::PUT, f, &[])));
        assert!(is_large(&req(Method::GET, f, &[])));
        assert!(!is_large(&req(Method::DELETE, f, &[])));
        assert!(!is_large(&req(
            Method::GET,
            "/v1/sandboxes/x/files/list",
            &[]
        )));
        let e = "/v1/sandboxes/x/exec";
        assert!(!is_large(&req(
            Method::POST,
            e,
            &[("content-length", "300")]
        )));
        assert!(is_large(&req(
            Method::POST,
            e,
            &[("content-length", "2000000")]
        )));
        assert!(is_large(&req(
            Method::POST,
            e,
            &[("transfer-encoding", "chunked")]
        )));
    }
}
