//! Tunnels: a TCP connection to a port on the guest's loopback, carried
//! over the agent channel ([`AgentClient::open_tunnel`]).
//!
//! Invariants: a tunnel holds at most its window of the guest's bytes
//! unread, and a guest that sends more gets the tunnel failed; the reader
//! task never waits for a tunnel's consumer (it only queues and wakes);
//! we send at most a window of bytes the agent has not acknowledged.

use super::{AgentClient, CallError, Route};
use bytes::Bytes;
use rootfs_init::protocol::{
    AgentError, ErrorKind, Op, Reply, TunnelResult, FEATURE_TUNNEL, TUNNEL_CHUNK,
};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskCx, Poll, Waker};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

impl AgentClient {
    /// Opens a TCP connection to `port` on the guest's loopback, carried
    /// over this channel (no guest network needed); the returned
    /// [`Tunnel`] reads what the guest side sends and writes to it. Fails
    /// with `not_found` when nothing listens there.
    pub async fn open_tunnel(&self, port: u16) -> Result<Tunnel, CallError> {
        self.open_tunnel_with(port, TUNNEL_WINDOW).await
    }

    /// [`Self::open_tunnel`] with a window of `window` bytes each way (the
    /// most of the guest's bytes held unread, and of ours unwritten).
    pub async fn open_tunnel_with(&self, port: u16, window: u32) -> Result<Tunnel, CallError> {
        self.require(FEATURE_TUNNEL).await?;
        let (opened_tx, opened_rx) = tokio::sync::oneshot::channel();
        let shared = Arc::new(TunnelShared {
            window: window as usize,
            state: Mutex::new(TunnelState {
                write_credit: window as usize,
                opened: Some(opened_tx),
                ..Default::default()
            }),
        });
        let op = Op::TunnelOpen { port, window };
        let id = self.send_routed(op, &[], Some(Route::Tunnel(shared.clone())))?;
        let tunnel = Tunnel {
            client: self.clone(),
            id,
            shared,
            cur: Bytes::new(),
            write_closed: false,
        };
        match tokio::time::timeout(Duration::from_secs(30), opened_rx).await {
            Ok(Ok(Ok(()))) => Ok(tunnel),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(CallError::Channel("connection closed".into())),
            Err(_) => Err(CallError::Timeout(Duration::from_secs(30))),
        }
    }
}

/// Window of a tunnel opened with [`AgentClient::open_tunnel`], each way.
pub const TUNNEL_WINDOW: u32 = 256 << 10;

/// What the reader task and a [`Tunnel`] share.
pub(super) struct TunnelShared {
    window: usize,
    state: Mutex<TunnelState>,
}

#[derive(Default)]
struct TunnelState {
    /// Told once the agent answers the open (`started` or an error).
    opened: Option<tokio::sync::oneshot::Sender<Result<(), CallError>>>,
    /// The guest's bytes not yet read, and their total.
    incoming: VecDeque<Bytes>,
    incoming_bytes: usize,
    /// The guest side sent its end of stream.
    read_eof: bool,
    /// Bytes we may still send before a `tunnel_data` is answered.
    write_credit: usize,
    /// A write failed in the guest (the connection's write side is gone).
    write_error: Option<String>,
    /// The tunnel ended: Ok (closed cleanly) or why not.
    done: Option<Result<TunnelResult, String>>,
    /// Request ids of our `tunnel_data` not answered yet (their routes
    /// are forgotten with the tunnel).
    writes: Vec<u64>,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
}

impl TunnelState {
    fn wake(&mut self) {
        for w in [self.read_waker.take(), self.write_waker.take()]
            .into_iter()
            .flatten()
        {
            w.wake();
        }
    }
}

impl TunnelShared {
    /// Takes one frame of the tunnel's `tunnel_open`; true when it was the last.
    pub(super) fn deliver(&self, body: Reply, payload: Bytes) -> bool {
        let mut st = self.state.lock().unwrap();
        match body {
            Reply::Started { .. } => {
                if let Some(tx) = st.opened.take() {
                    let _ = tx.send(Ok(()));
                }
                false
            }
            Reply::Stdout if payload.is_empty() => {
                st.read_eof = true;
                st.wake();
                false
            }
            Reply::Stdout => {
                if st.incoming_bytes + payload.len() > self.window {
                    let why = format!(
                        "the guest sent more than the tunnel's window of {} bytes unacknowledged; \
                         the tunnel was failed",
                        self.window
                    );
                    drop(st);
                    self.fail(CallError::Agent(AgentError::new(ErrorKind::Internal, why)));
                    return true;
                }
                st.incoming_bytes += payload.len();
                st.incoming.push_back(payload);
                st.wake();
                false
            }
            Reply::Ok { result } => {
                let r = serde_json::from_value(result).unwrap_or_default();
                if let Some(tx) = st.opened.take() {
                    let _ = tx.send(Err(CallError::Channel(
                        "tunnel closed before it opened".into(),
                    )));
                }
                st.done = Some(Ok(r));
                st.wake();
                true
            }
            Reply::Error { error } => {
                drop(st);
                self.fail(CallError::Agent(error));
                true
            }
            Reply::Stderr | Reply::Watch { .. } => false,
        }
    }

    /// Remembers a `tunnel_data` in flight (written before its reply can
    /// arrive: the route exists before the frame is sent, the id only after).
    pub(super) fn note_write(&self, op: u64) {
        let mut st = self.state.lock().unwrap();
        st.writes.push(op);
    }

    /// Ends the tunnel with `e` (its open fails with it if still pending).
    pub(super) fn fail(&self, e: CallError) {
        let mut st = self.state.lock().unwrap();
        let msg = e.to_string();
        if let Some(tx) = st.opened.take() {
            let _ = tx.send(Err(e));
        }
        if st.done.is_none() {
            st.done = Some(Err(msg));
        }
        st.wake();
    }

    pub(super) fn credit(&self, op: u64, n: usize) {
        let mut st = self.state.lock().unwrap();
        st.writes.retain(|w| *w != op);
        st.write_credit += n;
        if let Some(w) = st.write_waker.take() {
            w.wake();
        }
    }

    pub(super) fn write_failed(&self, op: u64, e: AgentError) {
        let mut st = self.state.lock().unwrap();
        st.writes.retain(|w| *w != op);
        st.write_error.get_or_insert(e.to_string());
        st.wake();
    }
}

/// A TCP connection to a port in the guest, carried over the agent
/// channel ([`AgentClient::open_tunnel`]): `AsyncRead` gives what the
/// guest side sends (0 at its end of stream), `AsyncWrite` sends to it,
/// `shutdown` closes our write side (the guest side reads its end of
/// stream). Dropping it closes the connection at once in both directions.
///
/// Backpressure: a write waits while a window of bytes is unanswered by
/// the guest; the guest sends at most a window ahead of what was read.
pub struct Tunnel {
    client: AgentClient,
    id: u64,
    shared: Arc<TunnelShared>,
    /// The chunk being read.
    cur: Bytes,
    write_closed: bool,
}

impl Tunnel {
    /// The request id of its `tunnel_open`.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes received from the guest and not read yet (at most the window).
    pub fn buffered(&self) -> usize {
        self.shared.state.lock().unwrap().incoming_bytes + self.cur.len()
    }

    /// How the tunnel ended, once it has: Ok with the byte counts when
    /// both sides closed cleanly (or it was aborted), Err with why not.
    pub fn outcome(&self) -> Option<Result<TunnelResult, String>> {
        self.shared.state.lock().unwrap().done.clone()
    }
}

fn broken(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, msg)
}

impl AsyncRead for Tunnel {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskCx<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.cur.is_empty() {
            let mut st = self.shared.state.lock().unwrap();
            match st.incoming.pop_front() {
                Some(chunk) => {
                    st.incoming_bytes -= chunk.len();
                    drop(st);
                    // Consumed: the guest may send this much more.
                    let ack = Op::TunnelAck {
                        target: self.id,
                        bytes: chunk.len() as u32,
                    };
                    let _ = self.client.send_routed(ack, &[], None);
                    self.cur = chunk;
                }
                None if st.read_eof => return Poll::Ready(Ok(())),
                None => match &st.done {
                    Some(Ok(_)) => return Poll::Ready(Ok(())),
                    Some(Err(e)) => {
                        return Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionReset,
                            e.clone(),
                        )))
                    }
                    None => {
                        st.read_waker = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                },
            }
        }
        let n = self.cur.len().min(buf.remaining());
        let chunk = self.cur.split_to(n);
        buf.put_slice(&chunk);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Tunnel {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskCx<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.write_closed {
            return Poll::Ready(Err(broken("the tunnel's write side is shut down".into())));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = {
            let mut st = self.shared.state.lock().unwrap();
            if let Some(e) = &st.write_error {
                return Poll::Ready(Err(broken(e.clone())));
            }
            if let Some(done) = &st.done {
                let why = match done {
                    Ok(_) => "the tunnel is closed".to_string(),
                    Err(e) => e.clone(),
                };
                return Poll::Ready(Err(broken(why)));
            }
            if st.write_credit == 0 {
                st.write_waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let n = buf.len().min(st.write_credit).min(TUNNEL_CHUNK);
            st.write_credit -= n;
            n
        };
        let op = Op::TunnelData {
            target: self.id,
            eof: false,
        };
        let route = Route::TunnelWrite(self.shared.clone(), n);
        match self.client.send_routed(op, &buf[..n], Some(route)) {
            Ok(id) => {
                self.shared.note_write(id);
                Poll::Ready(Ok(n))
            }
            Err(e) => Poll::Ready(Err(broken(e.to_string()))),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut TaskCx<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut TaskCx<'_>) -> Poll<std::io::Result<()>> {
        if !self.write_closed {
            self.write_closed = true;
            let op = Op::TunnelData {
                target: self.id,
                eof: true,
            };
            let route = Route::TunnelWrite(self.shared.clone(), 0);
            match self.client.send_routed(op, &[], Some(route)) {
                Ok(id) => self.shared.note_write(id),
                Err(e) => return Poll::Ready(Err(broken(e.to_string()))),
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        let (done, writes) = {
            let mut st = self.shared.state.lock().unwrap();
            (st.done.is_some(), std::mem::take(&mut st.writes))
        };
        if !done {
            let _ = self
                .client
                .send_routed(Op::TunnelClose { target: self.id }, &[], None);
        }
        // Replies to our writes still in flight answer nobody now.
        for w in writes {
            self.client.forget(w);
        }
        self.client.forget(self.id);
    }
}
