//! A small async QMP client: commands with ids, errors as values, and events
//! on a broadcast channel.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value>>>>>;

/// A connected QMP session (capabilities negotiated).
pub struct Qmp {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Pending,
    next_id: AtomicU64,
    events: broadcast::Sender<Value>,
}

impl Qmp {
    /// Connects, retrying until `deadline` while QEMU creates the socket.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Qmp> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("connecting to QMP at {}", path.display()))
                }
            }
        };
        let (rd, wr) = stream.into_split();
        let mut rd = BufReader::new(rd);
        let mut greeting = String::new();
        // QEMU greets at once; a socket that accepts but stays silent (another
        // QMP client is attached) must not hang the caller.
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(2));
        tokio::time::timeout(left, rd.read_line(&mut greeting))
            .await
            .map_err(|_| anyhow!("no QMP greeting from {} within {left:?}", path.display()))?
            .context("reading the QMP greeting")?;
        if !greeting.contains("QMP") {
            bail!("unexpected QMP greeting: {greeting:?}");
        }
        let pending: Pending = Arc::default();
        let (events, _) = broadcast::channel(64);
        tokio::spawn(read_loop(rd, pending.clone(), events.clone()));
        let qmp = Qmp {
            writer: tokio::sync::Mutex::new(wr),
            pending,
            next_id: AtomicU64::new(1),
            events,
        };
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    /// Subscribes to QMP events (e.g. STOP, RESUME, SHUTDOWN).
    pub fn events(&self) -> broadcast::Receiver<Value> {
        self.events.subscribe()
    }

    /// Runs a command and returns its `return` value; a QMP error is an `Err`
    /// carrying QEMU's description.
    pub async fn execute(&self, cmd: &str, args: Value) -> Result<Value> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let mut line = serde_json::to_vec(&json!({"execute": cmd, "arguments": args, "id": id}))?;
        line.push(b'\n');
        {
            let mut w = self.writer.lock().await;
            if let Err(e) = w.write_all(&line).await {
                self.pending.lock().unwrap().remove(&id);
                return Err(anyhow!("QMP {cmd}: {e} (QEMU exited?)"));
            }
        }
        rx.await
            .map_err(|_| anyhow!("QMP {cmd}: connection closed (QEMU exited?)"))?
            .with_context(|| format!("QMP {cmd}"))
    }

    /// Polls `query-migrate` until it completes, failing on `failed` or
    /// `cancelled` with QEMU's error description.
    pub async fn wait_migration(&self, timeout: Duration) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.execute("query-migrate", json!({})).await?;
            match st.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(st),
                Some("failed") | Some("cancelled") => {
                    let why = st
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no reason given");
                    bail!("migration failed: {why}");
                }
                _ if Instant::now() > deadline => {
                    bail!("migration did not complete within {timeout:?}: {st}")
                }
                _ => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
    }
}

async fn read_loop(
    mut rd: BufReader<tokio::net::unix::OwnedReadHalf>,
    pending: Pending,
    events: broadcast::Sender<Value>,
) {
    let mut line = String::new();
    loop {
        line.clear();
        match rd.read_line(&mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if v.get("event").is_some() {
            let _ = events.send(v);
            continue;
        }
        let Some(id) = v.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let Some(tx) = pending.lock().unwrap().remove(&id) else {
            continue;
        };
        let res = match (v.get("return"), v.get("error")) {
            (Some(r), _) => Ok(r.clone()),
            (_, Some(e)) => Err(anyhow!(
                "{}",
                e.get("desc")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown QMP error")
            )),
            _ => Err(anyhow!("malformed QMP reply: {v}")),
        };
        let _ = tx.send(res);
    }
    // Fail everything still waiting.
    pending.lock().unwrap().clear();
}
