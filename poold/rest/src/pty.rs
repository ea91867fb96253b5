//! `GET /v1/sandboxes/:id/pty`: an interactive terminal session over a
//! WebSocket (docs/api.md, "Terminal sessions").
//!
//! The query picks the program and the terminal: `cmd` (a shell command;
//! default a login shell), `cwd`, `rows`, `cols` (default 24x80). Then:
//!
//! - server → client: a text `{"type":"started","pid"}`; binary frames
//!   with the terminal's output; finally a text `{"type":"exit",
//!   "exit_code","signal","duration_ms"}` (or `{"type":"error","error"}`)
//!   and a close;
//! - client → server: binary frames are typed into the terminal; text
//!   frames are JSON control messages: `{"type":"resize","rows","cols"}`,
//!   `{"type":"signal","signal"}`, `{"type":"input","data"}`.
//!
//! Browsers authenticate with subprotocols (`forkd.pty` and the token's
//! `forkd.bearer.<hex>`, checked by `forkd_edge::auth`); the answer names
//! [`PTY_PROTOCOL`] only.
//!
//! The process runs until it exits; a client that goes away kills its
//! process group. Input is forwarded one message at a time (each waits for
//! the agent's acknowledgement, so a fast typist cannot queue without
//! bound); a message is at most [`MAX_MESSAGE`] bytes.

use super::error::ApiResult;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::response::Response;
use forkd_node::{ExecEvent, Node, PendingPty, ProcessControl, PtyRequest, PtySize};
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;

/// Largest WebSocket message accepted from a client.
pub const MAX_MESSAGE: usize = 1 << 20;

/// The subprotocol this route answers with when a client offers it. A
/// browser that passes its token as a subprotocol
/// (`forkd_edge::auth::BEARER_PROTOCOL`) offers this one beside it: a
/// browser fails a connection whose offered protocols get no answer, and
/// the token must never be the answer.
pub const PTY_PROTOCOL: &str = "forkd.pty";

/// The session's program and terminal (the query string).
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PtyQuery {
    /// A shell command (`/bin/sh -c`); default a login shell (bash if the image has it).
    #[serde(default)]
    cmd: Option<String>,
    /// Working directory, an absolute guest path.
    #[serde(default)]
    cwd: Option<String>,
    /// Terminal rows, 1..=4096 (default 24).
    #[serde(default)]
    rows: Option<u16>,
    /// Terminal columns, 1..=4096 (default 80).
    #[serde(default)]
    cols: Option<u16>,
}

/// A control message from the client (a text frame).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum Control {
    Resize { rows: u16, cols: u16 },
    Signal { signal: i32 },
    Input { data: String },
}

/// Upgrades to a WebSocket carrying one terminal session (module doc).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/pty", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)"), PtyQuery),
    responses(
        (status = 101, description = "A WebSocket: binary frames carry the terminal's output (server to client) and typed input (client to server); text frames are JSON: `{\"type\":\"started\",\"pid\"}`, finally `{\"type\":\"exit\",\"exit_code\",\"signal\",\"duration_ms\"}` or `{\"type\":\"error\",\"error\"}` from the server; `{\"type\":\"resize\",\"rows\",\"cols\"}`, `{\"type\":\"signal\",\"signal\"}`, `{\"type\":\"input\",\"data\"}` from the client"),
        (status = 400, description = "A bad terminal size or cwd, or not a WebSocket upgrade", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
    ))]
pub async fn pty(
    State(d): State<Arc<Node>>,
    Path(id): Path<String>,
    Query(q): Query<PtyQuery>,
    ws: WebSocketUpgrade,
) -> ApiResult<Response> {
    let pty = d.pty(
        &id,
        PtyRequest {
            cmd: q.cmd,
            cwd: q.cwd,
            rows: q.rows,
            cols: q.cols,
        },
    )?;
    Ok(ws
        .protocols([PTY_PROTOCOL])
        .max_message_size(MAX_MESSAGE)
        .on_upgrade(move |socket| session(pty, socket)))
}

fn text(v: serde_json::Value) -> Message {
    Message::Text(v.to_string().into())
}

/// Carries one terminal session until the process exits or the client
/// leaves.
async fn session(pty: PendingPty, socket: WebSocket) {
    let (mut tx, mut rx) = socket.split();
    let mut process = match pty.start() {
        Ok(p) => p,
        Err(e) => {
            let _ = tx
                .send(text(json!({"type": "error", "error": e.to_string()})))
                .await;
            let _ = tx.close().await;
            return;
        }
    };
    let control = process.control();
    loop {
        tokio::select! {
            ev = process.next() => {
                let exited = matches!(ev, Some(ExecEvent::Exited(_)));
                let (msg, last) = match ev {
                    Some(ExecEvent::Started { pid }) => (text(json!({"type": "started", "pid": pid})), false),
                    Some(ExecEvent::Stdout(payload) | ExecEvent::Stderr(payload)) => (Message::Binary(payload), false),
                    Some(ExecEvent::Exited(r)) => {
                        (text(json!({"type": "exit", "exit_code": r.status_code(),
                                     "signal": r.signal, "duration_ms": r.duration_ms})), true)
                    }
                    Some(ExecEvent::Failed(e)) => (text(json!({"type": "error", "error": e.to_string()})), true),
                    None => (text(json!({"type": "error", "error": "the agent channel closed"})), true),
                };
                if tx.send(msg).await.is_err() {
                    hang_up(&control).await;
                    return;
                }
                if last {
                    // An error (the client fell too far behind, the channel
                    // broke) may leave the process running: it goes too.
                    if !exited {
                        hang_up(&control).await;
                    }
                    let _ = tx.close().await;
                    return;
                }
            }
            msg = rx.next() => {
                let done = match msg {
                    Some(Ok(Message::Binary(b))) => input(&control, &b).await,
                    Some(Ok(Message::Text(t))) => match serde_json::from_str::<Control>(t.as_str()) {
                        Ok(c) => apply(&control, c).await,
                        Err(e) => Err(format!("a text frame must be a control message ({{\"type\":\"resize\"|\"signal\"|\"input\",...}}): {e}; send input as binary frames")),
                    },
                    Some(Ok(_)) => Ok(()),
                    Some(Err(_)) | None => {
                        hang_up(&control).await;
                        return;
                    }
                };
                if let Err(e) = done {
                    // Said to the client; the session goes on.
                    if tx.send(text(json!({"type": "warning", "error": e}))).await.is_err() {
                        hang_up(&control).await;
                        return;
                    }
                }
            }
        }
    }
}

async fn input(p: &ProcessControl, data: &[u8]) -> Result<(), String> {
    p.stdin(data, false).await.map_err(|e| e.to_string())
}

async fn apply(p: &ProcessControl, c: Control) -> Result<(), String> {
    let r = match c {
        Control::Resize { rows, cols } => p.resize(PtySize { rows, cols }).await,
        Control::Signal { signal } => p.signal(signal).await,
        Control::Input { data } => p.stdin(data.as_bytes(), false).await,
    };
    r.map_err(|e| e.to_string())
}

/// The client left: the session's processes go with it.
async fn hang_up(p: &ProcessControl) {
    let _ = p.signal(libc::SIGKILL).await;
}
