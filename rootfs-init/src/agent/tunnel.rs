//! TCP tunnels over the agent channel: `tunnel_open` connects to a port on
//! the guest's loopback and carries the connection's bytes both ways
//! (docs/agent-protocol.md, "tunnels"), so the host reaches a server in
//! the guest (E2B's `get_host(port)`, the code interpreter on 49999, a
//! browser's CDP endpoint) without a guest network.
//!
//! Flow control, both ways bounded by the window the host gives at open:
//! - guest → host: the agent sends at most `credit` bytes (`stdout`
//!   events); `tunnel_ack` from the host, sent as it consumes them, returns
//!   credit. A host that stops reading stops the socket being read, and
//!   TCP pushes back on the guest's server.
//! - host → guest: each `tunnel_data` is answered `ok` once its bytes are
//!   written to the socket; the host keeps at most a window unanswered. The
//!   agent queues `tunnel_data` in channel order (ops are dispatched
//!   concurrently, so order is kept by queueing in [`Tunnels::data`],
//!   called where frames are decoded) and refuses more than two windows
//!   queued: a host bug, answered with an error, never buffered.
//!
//! Invariant: a tunnel ends with exactly one final reply to its
//! `tunnel_open` id, after every byte the guest side sent.

use super::server::Outbox;
use crate::protocol::{
    AgentError, ErrorKind, Reply, TunnelResult, MAX_TUNNEL_WINDOW, TUNNEL_CHUNK,
};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};

/// How long connecting to the guest port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What the host sent for a tunnel, in channel order.
enum ToGuest {
    /// Bytes of `tunnel_data` request `op`, then shut the write side when `eof`.
    Data { op: u64, bytes: Bytes, eof: bool },
    /// `tunnel_close`: drop the connection.
    Abort,
}

struct Shared {
    /// Bytes the agent may still send to the host.
    credit: AtomicU64,
    credit_changed: Notify,
    to_guest: mpsc::UnboundedSender<ToGuest>,
    /// Bytes of `tunnel_data` queued, not yet written.
    queued: AtomicUsize,
    window: usize,
    aborted: AtomicBool,
}

/// Open tunnels by the request id of their `tunnel_open`.
#[derive(Default)]
pub struct Tunnels {
    open: Mutex<HashMap<u64, Arc<Shared>>>,
}

impl Tunnels {
    /// Queues a `tunnel_data` (request `op`) for tunnel `target`, in
    /// channel order. Its `ok` is sent once the bytes are written.
    pub fn data(&self, target: u64, op: u64, bytes: Bytes, eof: bool) -> Result<(), AgentError> {
        let t = self.get(target)?;
        let queued = t.queued.fetch_add(bytes.len(), Ordering::AcqRel) + bytes.len();
        if queued > 2 * t.window {
            t.queued.fetch_sub(bytes.len(), Ordering::AcqRel);
            return Err(AgentError::new(
                ErrorKind::BadRequest,
                format!(
                    "tunnel {target}: {queued} bytes queued, over twice its window of {}; \
                     wait for tunnel_data replies before sending more",
                    t.window
                ),
            ));
        }
        t.to_guest
            .send(ToGuest::Data { op, bytes, eof })
            .map_err(|_| closed(target))
    }

    /// `tunnel_ack`: the host consumed `bytes`; that much more may be sent.
    /// Unknown targets are ignored (the tunnel ended meanwhile).
    pub fn ack(&self, target: u64, bytes: u32) {
        if let Ok(t) = self.get(target) {
            t.credit.fetch_add(bytes as u64, Ordering::AcqRel);
            t.credit_changed.notify_one();
        }
    }

    /// `tunnel_close`: aborts tunnel `target`.
    pub fn close(&self, target: u64) -> Result<(), AgentError> {
        let t = self.get(target)?;
        t.aborted.store(true, Ordering::Release);
        t.credit_changed.notify_one();
        let _ = t.to_guest.send(ToGuest::Abort);
        Ok(())
    }

    /// Aborts every tunnel: the host went away (a poold restart), and
    /// nobody will ever close them.
    pub fn abort_all(&self) {
        for t in self.open.lock().unwrap().values() {
            t.aborted.store(true, Ordering::Release);
            t.credit_changed.notify_one();
            let _ = t.to_guest.send(ToGuest::Abort);
        }
    }

    fn get(&self, target: u64) -> Result<Arc<Shared>, AgentError> {
        self.open
            .lock()
            .unwrap()
            .get(&target)
            .cloned()
            .ok_or_else(|| closed(target))
    }

    /// Serves `tunnel_open` request `id` until the tunnel ends; sends every
    /// reply, the final one included.
    pub async fn open(self: Arc<Self>, id: u64, port: u16, window: u32, outbox: Outbox) {
        let reply = match self.run(id, port, window, &outbox).await {
            Ok(r) => Reply::Ok {
                result: serde_json::to_value(r).expect("results serialise"),
            },
            Err(error) => Reply::Error { error },
        };
        self.open.lock().unwrap().remove(&id);
        outbox.send(id, reply, Bytes::new()).await;
    }

    async fn run(
        &self,
        id: u64,
        port: u16,
        window: u32,
        outbox: &Outbox,
    ) -> Result<TunnelResult, AgentError> {
        if port == 0 || !(1..=MAX_TUNNEL_WINDOW).contains(&window) {
            return Err(AgentError::new(
                ErrorKind::BadRequest,
                format!("tunnel to port {port} with window {window}: the port must be 1..=65535 and the window 1..={MAX_TUNNEL_WINDOW}"),
            ));
        }
        let sock = connect(port).await?;
        let _ = sock.set_nodelay(true);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            credit: AtomicU64::new(window as u64),
            credit_changed: Notify::new(),
            to_guest: tx,
            queued: AtomicUsize::new(0),
            window: window as usize,
            aborted: AtomicBool::new(false),
        });
        self.open.lock().unwrap().insert(id, shared.clone());
        outbox
            .send(id, Reply::Started { pid: 0 }, Bytes::new())
            .await;

        let (mut rd, mut wr) = sock.into_split();
        let reader = {
            let shared = shared.clone();
            let outbox = outbox.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; TUNNEL_CHUNK];
                let mut sent = 0u64;
                loop {
                    let credit = wait_credit(&shared).await;
                    if credit == 0 {
                        return Ok(sent); // aborted
                    }
                    let want = (credit as usize).min(TUNNEL_CHUNK);
                    let n = rd.read(&mut buf[..want]).await?;
                    shared.credit.fetch_sub(n as u64, Ordering::AcqRel);
                    // A zero-length event is the guest side's end of stream.
                    outbox
                        .send(id, Reply::Stdout, Bytes::copy_from_slice(&buf[..n]))
                        .await;
                    if n == 0 {
                        return Ok::<u64, std::io::Error>(sent);
                    }
                    sent += n as u64;
                }
            })
        };

        let mut bytes_in = 0u64;
        let mut aborted = false;
        let mut write_err: Option<std::io::Error> = None;
        while let Some(msg) = rx.recv().await {
            match msg {
                ToGuest::Abort => {
                    aborted = true;
                    break;
                }
                ToGuest::Data { op, bytes, eof } => {
                    shared.queued.fetch_sub(bytes.len(), Ordering::AcqRel);
                    let res = match &write_err {
                        Some(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
                        None => {
                            async {
                                wr.write_all(&bytes).await?;
                                if eof {
                                    wr.shutdown().await?;
                                }
                                Ok(())
                            }
                            .await
                        }
                    };
                    bytes_in += bytes.len() as u64;
                    let reply = match res {
                        Ok(()) => Reply::Ok {
                            result: serde_json::json!({}),
                        },
                        Err(e) => {
                            let error = AgentError::io(&format!("tunnel to port {port}"), &e);
                            write_err.get_or_insert(e);
                            Reply::Error { error }
                        }
                    };
                    outbox.send(op, reply, Bytes::new()).await;
                    if eof && write_err.is_none() {
                        break;
                    }
                }
            }
        }
        if aborted {
            reader.abort();
            return Ok(TunnelResult {
                bytes_in,
                bytes_out: 0,
                aborted: true,
            });
        }
        // The host closed its side (or the channel went): the guest side
        // may still send; wait for its end of stream, or an abort.
        let abort_wait = async {
            while let Some(msg) = rx.recv().await {
                match msg {
                    ToGuest::Abort => return,
                    ToGuest::Data { op, bytes, .. } => {
                        shared.queued.fetch_sub(bytes.len(), Ordering::AcqRel);
                        let error = AgentError::new(
                            ErrorKind::BadRequest,
                            format!("tunnel {id}: data after its end of stream"),
                        );
                        outbox.send(op, Reply::Error { error }, Bytes::new()).await;
                    }
                }
            }
            std::future::pending::<()>().await
        };
        let mut reader = reader;
        tokio::select! {
            r = &mut reader => match r {
                Ok(Ok(bytes_out)) => Ok(TunnelResult { bytes_in, bytes_out, aborted: false }),
                Ok(Err(e)) => Err(AgentError::io(&format!("tunnel to port {port}"), &e)),
                Err(e) => Err(AgentError::new(ErrorKind::Internal, format!("tunnel reader: {e}"))),
            },
            () = abort_wait => {
                reader.abort();
                Ok(TunnelResult { bytes_in, bytes_out: 0, aborted: true })
            }
        }
    }
}

/// Waits until there is credit (returns it) or the tunnel is aborted (0).
async fn wait_credit(s: &Shared) -> u64 {
    loop {
        let notified = s.credit_changed.notified();
        if s.aborted.load(Ordering::Acquire) {
            return 0;
        }
        let c = s.credit.load(Ordering::Acquire);
        if c > 0 {
            return c;
        }
        notified.await;
    }
}

/// Connects to `port` on 127.0.0.1, else on ::1 (a server bound to one
/// loopback address only).
async fn connect(port: u16) -> Result<TcpStream, AgentError> {
    let mut last = None;
    for addr in ["127.0.0.1", "::1"] {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((addr, port))).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = Some(e),
            Err(_) => {
                return Err(AgentError::new(
                    ErrorKind::Timeout,
                    format!("connecting to port {port} in the guest took over {CONNECT_TIMEOUT:?}"),
                ))
            }
        }
    }
    let e = last.expect("one attempt was made");
    if e.kind() == std::io::ErrorKind::ConnectionRefused {
        return Err(AgentError::new(
            ErrorKind::NotFound,
            format!("nothing listens on port {port} in the guest (127.0.0.1 or ::1)"),
        ));
    }
    Err(AgentError::io(&format!("connecting to port {port}"), &e))
}

fn closed(target: u64) -> AgentError {
    AgentError::new(
        ErrorKind::NotFound,
        format!("no open tunnel with request id {target}"),
    )
}
