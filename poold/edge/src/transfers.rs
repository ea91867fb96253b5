//! Bounded large requests: file transfers and big bodies.
//!
//! A request body is buffered whole before its handler runs, and a file
//! download is read whole from the agent before it is sent: up to
//! `forkd_node::limits::MAX_FILE_BYTES` each. Without a bound, N clients
//! make poold hold N times that. So every request that may carry or return
//! a large body takes one of `transfer_concurrency` slots *before* its body
//! is read, and keeps it until its response body is sent (or dropped):
//!
//! - any `/files` request that moves content (`GET`/`PUT .../files`);
//! - any request declaring a body over [`SMALL_BODY`], or a body of
//!   unknown length (chunked).
//!
//! A request waits up to [`SLOT_WAIT`] for a slot, then gets 503. Small
//! requests (exec, eval, spawn: JSON under a MiB) never wait. The slots
//! are shared by every listener that moves files (REST `/v1` and E2B's
//! sandbox plane), so the bound is the process's.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Bodies up to this size need no slot.
pub const SMALL_BODY: u64 = 1 << 20;
/// How long a large request waits for a slot before its 503.
pub const SLOT_WAIT: Duration = Duration::from_secs(60);

/// `transfer_concurrency` slots for large requests.
pub struct Transfers {
    slots: Arc<Semaphore>,
    concurrency: usize,
}

impl Transfers {
    /// `concurrency` large requests at once.
    pub fn new(concurrency: usize) -> Arc<Transfers> {
        Arc::new(Transfers {
            slots: Arc::new(Semaphore::new(concurrency)),
            concurrency,
        })
    }
}

/// The middleware (see the module doc). Its refusal is a 503 with
/// `{"error": "..."}`, on every listener.
pub async fn turn(State(t): State<Arc<Transfers>>, req: Request, next: Next) -> Response {
    if !is_large(&req) {
        return next.run(req).await;
    }
    let slot = tokio::time::timeout(SLOT_WAIT, t.slots.clone().acquire_owned()).await;
    let Ok(Ok(permit)) = slot else {
        let msg = format!(
            "{} large transfers are in flight (transfer_concurrency) and none finished in {}s; retry later",
            t.concurrency,
            SLOT_WAIT.as_secs()
        );
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "error": msg })),
        )
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
    // `/files`: a sandbox's (/v1) or envd's; `/file`: an E2B volume's.
    let path = req.uri().path();
    let moves_file = (path.ends_with("/files") || path.ends_with("/file"))
        && matches!(*req.method(), Method::GET | Method::PUT);
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
