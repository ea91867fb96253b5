//! forkd's one-JSON-line TCP protocol on :8888 (forkd v0.5.3 compatibility):
//! one request line per connection, one reply line, then close.

use super::config::Lang;
use super::exec;
use super::server::{Agent, Outbox};
use crate::protocol::{EvalResult, ExecSpec};
use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
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
