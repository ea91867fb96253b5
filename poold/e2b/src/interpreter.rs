//! The code interpreter (port 49999).
//!
//! A guest that runs E2B's code interpreter itself (the `code-interpreter`
//! image: a Jupyter kernel per context, Python, JavaScript and bash, rich
//! results and charts, streaming output) gets every request proxied to its
//! loopback port 49999 through the agent channel's tunnel: one HTTP/1.1
//! exchange per tunnel, the answer streamed back as the guest sends it, the
//! sandbox's access token stripped (the guest never sees a credential).
//! Whether a sandbox has one is learned at its first request (a tunnel to a
//! port nothing listens on is refused) and kept with its session; that it
//! has none is also kept per snapshot, since its other children were forked
//! from the same processes: their first request then skips the tunnel,
//! which under TCG cost a fresh child's first `/execute` ~50 ms.
//!
//! Any other guest gets `POST /execute` served by its warm interpreter (the
//! agent's `eval`): the code runs in the persistent Python process the
//! snapshot warmed, so imports made before the snapshot (numpy in a
//! python-numpy snapshot) are already there.
//!
//! The answer is the code interpreter's NDJSON stream: `stdout`, `stderr`,
//! the main `result` (its `text` is the value's `repr()`), or an `error`
//! with name, value and traceback, then `number_of_executions` and
//! `end_of_execution`. The eval answers when the code finishes, so output
//! arrives in one piece rather than as it is printed. One context per
//! sandbox, the default: contexts, other languages and per-call env vars
//! are refused.

use crate::error::E2bError;
use crate::state::{E2b, Guest, INTERPRETER_PORT};
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use forkd_node::error::GuestErrorKind;
use forkd_node::{Error, EvalResult};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

/// The deadline of one execution (the code interpreter's default).
pub const TIMEOUT_MS: u64 = 300_000;
/// Largest code accepted.
pub const MAX_CODE_BYTES: usize = 1 << 20;

#[derive(Debug, Deserialize)]
struct ExecuteBody {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    E2bError::new(status, message).into_response()
}

/// Serves a request for port 49999: proxied to the guest's own code
/// interpreter when it has one, else from the warm interpreter.
pub async fn handle(e: &E2b, g: Guest<'_>, req: Request) -> Response {
    let session = &g.sb.session;
    if session.guest_interpreter.get().is_none()
        && e.snapshot_lacks_interpreter(&g.sb.rec.snapshot_id)
    {
        let _ = session.guest_interpreter.set(false);
    }
    if *session.guest_interpreter.get().unwrap_or(&true) {
        match g.node.open_tunnel(g.id(), INTERPRETER_PORT).await {
            Ok(t) => {
                let _ = g.sb.session.guest_interpreter.set(true);
                if let Err(e) = send_envs(g).await {
                    return e.into_response();
                }
                return proxy(t, req)
                    .await
                    .unwrap_or_else(IntoResponse::into_response);
            }
            // Nothing listens there (or the agent has no tunnels): this
            // guest has no interpreter of its own.
            Err(Error::Guest(a))
                if matches!(a.kind, GuestErrorKind::NotFound | GuestErrorKind::Unsupported)
                    && g.sb.session.guest_interpreter.get().is_none() =>
            {
                let _ = g.sb.session.guest_interpreter.set(false);
                e.note_no_interpreter(&g.sb.rec.snapshot_id);
            }
            Err(e) => {
                return E2bError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("the sandbox's code interpreter (guest port {INTERPRETER_PORT}) cannot be reached: {e}"),
                )
                .into_response()
            }
        }
    }
    warm(g, req).await
}

/// Hands the sandbox's create-time envs to the guest's interpreter once per
/// session (its `POST /forkd/envs` sets them in every context before the
/// next cell), so `run_code` sees them as E2B's does. Idempotent: a poold
/// restart sends them again.
async fn send_envs(g: Guest<'_>) -> Result<(), E2bError> {
    let envs = &g.sb.rec.envs;
    if envs.is_empty() || g.sb.session.interpreter_envs.get().is_some() {
        return Ok(());
    }
    let t = g
        .node
        .open_tunnel(g.id(), INTERPRETER_PORT)
        .await
        .map_err(E2bError::from)?;
    let body = json!({ "env_vars": envs }).to_string();
    let mut req = Request::new(Body::from(body));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = Uri::from_static("/forkd/envs");
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let resp = proxy(t, req).await?;
    if !resp.status().is_success() {
        return Err(E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "the sandbox's code interpreter refused its create-time envs ({})",
                resp.status()
            ),
        ));
    }
    let _ = g.sb.session.interpreter_envs.set(());
    Ok(())
}

/// One request to the guest's code interpreter over tunnel `t`.
async fn proxy(t: forkd_node::Tunnel, req: Request) -> Result<Response, E2bError> {
    let host = HeaderValue::from_static("localhost:49999");
    crate::ports::forward(t, req, host, "the sandbox's code interpreter", None).await
}

/// The warm interpreter's `/health` and `/execute`.
async fn warm(g: Guest<'_>, req: Request) -> Response {
    let (m, p) = (req.method().clone(), req.uri().path().to_string());
    if m == Method::GET && p == "/health" {
        StatusCode::NO_CONTENT.into_response()
    } else if m == Method::POST && p == "/execute" {
        execute(g, req).await
    } else {
        error(
            StatusCode::NOT_FOUND,
            format!("{m} {p}: poold's code interpreter serves POST /execute in the default context only (docs/e2b.md)"),
        )
    }
}

async fn execute(g: Guest<'_>, req: Request) -> Response {
    let body = match axum::body::to_bytes(req.into_body(), MAX_CODE_BYTES + 4096).await {
        Ok(b) => b,
        Err(_) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("code over {MAX_CODE_BYTES} bytes"),
            )
        }
    };
    let b: ExecuteBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad /execute body: {e}")),
    };
    if b.context_id.is_some() {
        return error(
            StatusCode::BAD_REQUEST,
            "contexts are not supported: poold runs code in the sandbox's one warm interpreter; leave context out",
        );
    }
    if b.language.as_deref().is_some_and(|l| l != "python") {
        return error(
            StatusCode::BAD_REQUEST,
            "only Python runs here (the sandbox's warm interpreter); leave language out",
        );
    }
    if b.env_vars.as_ref().is_some_and(|e| !e.is_empty()) {
        return error(
            StatusCode::BAD_REQUEST,
            "envs for run_code are not supported (the warm interpreter's environment is fixed); set os.environ in the code",
        );
    }
    // The answer starts now and its lines follow when the cell ends, as
    // E2B's server streams them: the SDKs' `timeoutMs` bounds the body,
    // not the wait for headers, so only a streamed answer lets it fire.
    // A client that gives up drops the stream; the cell runs to its end
    // in the guest (the warm interpreter has no interrupt), and the next
    // one waits for it. A sandbox that goes away mid-cell breaks the
    // answer off (no last chunk), as E2B's does: the SDK then asks whether
    // the sandbox runs and reports it killed.
    let (node, id, session) = (g.node.clone(), g.id().to_string(), g.sb.session.clone());
    let body = futures::stream::once(async move {
        let text = match node.eval(&id, &b.code, Some(TIMEOUT_MS)).await {
            Err(e @ (Error::GuestUnreachable(_) | Error::NotFound { .. })) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    e.to_string(),
                ))
            }
            Ok(r) => {
                let count = session.executions.fetch_add(1, Ordering::Relaxed) + 1;
                let mut out = String::new();
                for line in lines(&r, count, &now()) {
                    out.push_str(&line.to_string());
                    out.push('\n');
                }
                out
            }
            Err(e) => failed_line(&e).to_string() + "\n",
        };
        Ok(text)
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response()
}

/// The line a cell that could not run ends with (the answer's status is
/// sent by then): E2B's `error` line, named for what failed.
fn failed_line(e: &Error) -> Value {
    let name = match e {
        Error::Guest(a) if a.kind == GuestErrorKind::Timeout => "TimeoutError",
        _ => "ExecutionError",
    };
    json!({"type": "error", "name": name, "value": e.to_string(), "traceback": ""})
}

fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

/// The NDJSON lines of one evaluation.
fn lines(r: &EvalResult, count: u64, ts: &str) -> Vec<Value> {
    let mut v = Vec::new();
    if !r.stdout.is_empty() {
        v.push(json!({"type": "stdout", "text": r.stdout, "timestamp": ts}));
    }
    if !r.stderr.is_empty() {
        v.push(json!({"type": "stderr", "text": r.stderr, "timestamp": ts}));
    }
    if let Some(err) = &r.error {
        let (name, value) = err.split_once(": ").unwrap_or((err.as_str(), ""));
        v.push(json!({
            "type": "error",
            "name": name,
            "value": value,
            "traceback": r.traceback.clone().unwrap_or_default(),
        }));
    } else if let Some(text) = &r.result {
        let mut res = json!({"type": "result", "text": text, "is_main_result": true, "extra": {}});
        // A Node-mode image's value has a JSON form: E2B's `Result.json`.
        if let Some(j) = r
            .result_json
            .as_deref()
            .and_then(|j| serde_json::from_str::<Value>(j).ok())
        {
            res["json"] = j;
        }
        v.push(res);
    }
    v.push(json!({"type": "number_of_executions", "execution_count": count}));
    v.push(json!({"type": "end_of_execution"}));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines() {
        let r = EvalResult {
            result: Some("[0.0, 0.0]".into()),
            stdout: "hi\n".into(),
            ..Default::default()
        };
        let l = lines(&r, 3, "t");
        assert_eq!(
            l[0],
            json!({"type": "stdout", "text": "hi\n", "timestamp": "t"})
        );
        assert_eq!(l[1]["type"], "result");
        assert_eq!(l[1]["text"], "[0.0, 0.0]");
        assert_eq!(l[1]["is_main_result"], true);
        assert_eq!(l[2]["execution_count"], 3);
        assert_eq!(l[3]["type"], "end_of_execution");
        assert!(l[1].get("json").is_none());
        let r = EvalResult {
            result: Some("{ a: 1 }".into()),
            result_json: Some(r#"{"a":1}"#.into()),
            ..Default::default()
        };
        assert_eq!(lines(&r, 1, "t")[0]["json"], json!({"a": 1}));
    }

    #[test]
    fn error_lines() {
        let r = EvalResult {
            error: Some("ZeroDivisionError: division by zero".into()),
            traceback: Some("Traceback ...".into()),
            ..Default::default()
        };
        let l = lines(&r, 1, "t");
        assert_eq!(l[0]["type"], "error");
        assert_eq!(l[0]["name"], "ZeroDivisionError");
        assert_eq!(l[0]["value"], "division by zero");
        assert_eq!(l[0]["traceback"], "Traceback ...");
    }
}
