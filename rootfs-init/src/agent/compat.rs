//! forkd's one-JSON-line TCP protocol on :8888 (forkd v0.5.3 compatibility):
//! one request line per connection, one reply line, then close; except the
//! `stream` action (forkd's later addition), which keeps the connection for
//! a streaming, optionally terminal, session (see [`stream`]).

use super::config::Lang;
use super::exec;
use super::server::{Agent, Outbox};
use crate::protocol::{EvalResult, ExecSpec, FrameDecoder, PtySize, Reply, ReplyHeader};
use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpListener;

/// Longest request line accepted.
const MAX_LINE: u64 = 4 << 20;

/// Accepts connections forever; each is served on its own task.
pub async fn serve(agent: Arc<Agent>, port: u16) {
    let listener = match bind(port).await {
        Some(l) => l,
        None => return,
    };
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            continue;
        };
        let agent = agent.clone();
        tokio::spawn(async move {
            let (rd, mut wr) = sock.into_split();
            let mut line = Vec::new();
            let mut rd = BufReader::new(rd).take(MAX_LINE);
            if rd.read_until(b'\n', &mut line).await.is_err() {
                return;
            }
            if let Ok(req) = serde_json::from_slice::<Value>(&line) {
                if req.get("action").and_then(Value::as_str) == Some("stream") {
                    return stream(&agent, &req, rd.into_inner(), wr).await;
                }
            }
            let reply = handle_line(&agent, &line).await;
            let mut out = serde_json::to_vec(&reply).unwrap_or_default();
            out.push(b'\n');
            let _ = wr.write_all(&out).await;
            let _ = wr.shutdown().await;
        });
    }
}

/// forkd retries the bind 30 times, 200 ms apart.
async fn bind(port: u16) -> Option<TcpListener> {
    for _ in 0..30 {
        if let Ok(l) = TcpListener::bind(("0.0.0.0", port)).await {
            return Some(l);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("forkd-agent: could not bind :{port}; forkd line protocol disabled");
    None
}

/// Turns one request line into one reply object.
pub async fn handle_line(agent: &Agent, line: &[u8]) -> Value {
    let req: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => return error_reply(format!("JSONDecodeError: {e}")),
    };
    match req.get("action").and_then(Value::as_str) {
        Some("ping") => {
            let p = agent.ping();
            json!({
                "pong": true,
                "numpy_version": p.numpy_version.unwrap_or_else(|| "not-installed".into()),
                "pid": std::process::id(),
                "agent_lang": agent.interp.lang().as_str(),
                "warmup_ready": p.warm_ready,
            })
        }
        Some("exec") => compat_exec(agent, &req).await,
        Some("eval") => {
            let code = req.get("code").and_then(Value::as_str).unwrap_or_default();
            match agent.interp.eval(code, Some(Duration::from_secs(30))).await {
                Ok(r) if agent.interp.lang() == Lang::Node => node_eval_reply(r),
                Ok(r) => match r.error {
                    None => {
                        json!({"result": r.result.unwrap_or_else(|| "None".into()), "exit_code": 0})
                    }
                    Some(e) => json!({"error": e, "traceback": r.traceback, "exit_code": 1}),
                },
                Err(e) => error_reply(e.to_string()),
            }
        }
        Some(other) => json!({"error": format!("unknown action: {other}"), "exit_code": 1}),
        None => error_reply("KeyError: 'action'".into()),
    }
}

async fn compat_exec(agent: &Agent, req: &Value) -> Value {
    let args: Option<Vec<String>> = req
        .get("args")
        .and_then(|a| serde_json::from_value(a.clone()).ok());
    let timeout = req.get("timeout").and_then(Value::as_f64).unwrap_or(30.0);
    let spec = ExecSpec {
        argv: args,
        timeout_ms: Some((timeout * 1000.0) as u64),
        ..Default::default()
    };
    let (outbox, _rx) = Outbox::new();
    match exec::run(0, spec, Bytes::new(), None, outbox, agent.exec.clone()).await {
        Ok(f) if f.result.timed_out => error_reply(format!(
            "TimeoutExpired: Command timed out after {timeout} seconds"
        )),
        Ok(f) => json!({
            "stdout": String::from_utf8_lossy(&f.stdout),
            "stderr": String::from_utf8_lossy(&f.stderr),
            "exit_code": f.result.status_code(),
        }),
        Err(e) => error_reply(e.to_string()),
    }
}

/// forkd's Node-mode eval reply: the value as JSON text (`null` when it
/// has no JSON form, as forkd's bridge gives for `undefined`), or the error
/// with its `stack`.
fn node_eval_reply(r: EvalResult) -> Value {
    match r.error {
        None => json!({
            "result_json": r.result_json.unwrap_or_else(|| "null".into()),
            "exit_code": 0,
        }),
        Some(e) => json!({"error": e, "stack": r.traceback, "exit_code": 1}),
    }
}

fn error_reply(msg: String) -> Value {
    json!({"error": msg, "traceback": "", "exit_code": 1})
}

/// Request ids of `stream` sessions in the exec registry: far above the
/// host's (which stay below 2^62), so the two never collide.
static STREAM_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1 << 63);

/// Most client lines queued while the process is busy.
const STREAM_INPUT_QUEUE: usize = 16;

/// forkd's `stream` action: `{"action":"stream","args":[...],"cwd"?,"pty"?}`
/// (ours: `"rows"`, `"cols"` for the terminal). The connection stays open:
///
/// - agent → client: `{"stream":"started","pid","pty"}`, then `{"out": text}`
///   as output arrives (stdout and stderr; a terminal's output), finally
///   `{"exit_code"}` (or `{"error","exit_code":1}`), then close;
/// - client → agent, one JSON object a line: `{"in": text}` is written to
///   the process's stdin (typed, with `pty`); `{"action":"stop"}` kills its
///   process group; ours: `{"resize":[rows, cols]}` with `pty`. The end of
///   the client's input closes the process's stdin.
async fn stream<R: AsyncBufRead + Unpin + Send + 'static>(
    agent: &Arc<Agent>,
    req: &Value,
    rd: R,
    mut wr: OwnedWriteHalf,
) {
    let args: Option<Vec<String>> = req
        .get("args")
        .and_then(|a| serde_json::from_value(a.clone()).ok())
        .filter(|a: &Vec<String>| !a.is_empty());
    let Some(args) = args else {
        let _ = send(
            &mut wr,
            &error_reply("stream needs args: a non-empty list of strings".into()),
        )
        .await;
        return;
    };
    let pty = req.get("pty").and_then(Value::as_bool).unwrap_or(false);
    let cell = |k: &str, d: u16| {
        req.get(k)
            .and_then(Value::as_u64)
            .and_then(|v| u16::try_from(v).ok())
            .unwrap_or(d)
    };
    let size = PtySize {
        rows: cell("rows", 24),
        cols: cell("cols", 80),
    };
    let spec = ExecSpec {
        argv: Some(args),
        cwd: req.get("cwd").and_then(Value::as_str).map(String::from),
        stream: true,
        stdin_open: true,
        pty: pty.then_some(size),
        ..Default::default()
    };
    let id = STREAM_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let queue = agent.exec.reserve(id, true);
    let (outbox, mut frames) = Outbox::new();
    let mut run = tokio::spawn(exec::run(
        id,
        spec,
        Bytes::new(),
        queue,
        outbox,
        agent.exec.clone(),
    ));
    let mut lines = read_lines(rd);
    let mut input_open = true;
    let mut frames_open = true;
    let result = loop {
        tokio::select! {
            f = frames.recv(), if frames_open => {
                let Some(f) = f else {
                    frames_open = false;
                    continue;
                };
                if let Some(line) = stream_line(&f.head, &f.payload, pty) {
                    if send(&mut wr, &line).await.is_err() {
                        let _ = agent.exec.signal(id, libc::SIGKILL);
                    }
                }
            }
            line = lines.recv(), if input_open => match line {
                Some(v) => stream_input(agent, id, &v).await,
                None => {
                    input_open = false;
                    let _ = agent.exec.stdin(id, Bytes::new(), true).await;
                }
            },
            r = &mut run => break r,
        }
    };
    // What the readers queued before the process ended.
    while let Ok(f) = frames.try_recv() {
        if let Some(line) = stream_line(&f.head, &f.payload, pty) {
            let _ = send(&mut wr, &line).await;
        }
    }
    let last = match result {
        Ok(Ok(f)) => json!({"exit_code": f.result.status_code()}),
        Ok(Err(e)) => error_reply(e.to_string()),
        Err(e) => error_reply(format!("the stream task failed: {e}")),
    };
    let _ = send(&mut wr, &last).await;
    let _ = wr.shutdown().await;
}

/// The client's lines, parsed, on a bounded queue (a line longer than
/// `MAX_LINE` or not JSON ends the input).
fn read_lines<R: AsyncBufRead + Unpin + Send + 'static>(
    mut rd: R,
) -> tokio::sync::mpsc::Receiver<Value> {
    let (tx, rx) = tokio::sync::mpsc::channel(STREAM_INPUT_QUEUE);
    tokio::spawn(async move {
        loop {
            let mut line = Vec::new();
            match (&mut rd).take(MAX_LINE).read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let Ok(v) = serde_json::from_slice::<Value>(&line) else {
                return;
            };
            if tx.send(v).await.is_err() {
                return;
            }
        }
    });
    rx
}

/// Acts on one client line of a stream.
async fn stream_input(agent: &Agent, id: u64, v: &Value) {
    if let Some(text) = v.get("in").and_then(Value::as_str) {
        let _ = agent
            .exec
            .stdin(id, Bytes::copy_from_slice(text.as_bytes()), false)
            .await;
    } else if v.get("action").and_then(Value::as_str) == Some("stop") {
        let _ = agent.exec.signal(id, libc::SIGKILL);
    } else if let Some([rows, cols]) = v
        .get("resize")
        .and_then(|r| serde_json::from_value::<[u16; 2]>(r.clone()).ok())
    {
        let _ = agent.exec.resize(id, PtySize { rows, cols });
    }
}

/// The line a streaming exec's frame becomes, if any.
fn stream_line(head: &[u8], payload: &[u8], pty: bool) -> Option<Value> {
    let mut d = FrameDecoder::new();
    d.extend(head);
    d.extend(payload);
    let frame = d.next_frame().ok()??;
    let h: ReplyHeader = serde_json::from_slice(&frame.header).ok()?;
    match h.body {
        Reply::Started { pid } => Some(json!({"stream": "started", "pid": pid, "pty": pty})),
        Reply::Stdout | Reply::Stderr => {
            Some(json!({"out": String::from_utf8_lossy(&frame.payload)}))
        }
        _ => None,
    }
}

async fn send(wr: &mut OwnedWriteHalf, v: &Value) -> std::io::Result<()> {
    let mut out = serde_json::to_vec(v).unwrap_or_default();
    out.push(b'\n');
    wr.write_all(&out).await
}
