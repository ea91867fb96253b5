//! Host-side client for forkd-agent over the VM's agent unix socket.
//!
//! Requests are multiplexed by id: any number may be in flight, each reply
//! (and each stream event) is routed to the request that asked for it.
//!
//! Invariants:
//! - a request's route exists from before its frame is sent until its final
//!   frame (`ok` or `error`) arrives or its caller gives up (timeout), never
//!   longer: a late reply to a forgotten id is dropped;
//! - frames of one request reach its receiver in the order the agent sent
//!   them, whatever other requests interleave;
//! - when the connection closes, every route is dropped at once, so every
//!   waiter fails with [`CallError::Channel`] instead of hanging, and new
//!   requests fail the same way;
//! - the guest cannot grow poold's memory: frames for an unknown id are
//!   dropped, and a request whose unread frames exceed [`MAX_UNREAD_FRAMES`]
//!   or [`MAX_UNREAD_BYTES`] gets one final error and its route is removed;
//! - bytes that do not form a frame are skipped and decoding continues with
//!   what follows them (the decoder resynchronises on the frame magic);
//! - request ids start at a random point per connection, so a reply the
//!   agent still owed a previous connection (before a poold restart) never
//!   answers a request of this one;
//! - a tunnel ([`Tunnel`]) holds at most its window of the guest's bytes
//!   unread; a guest that sends more gets the tunnel failed, and the reader
//!   task never waits for a tunnel's consumer;
//! - what a protocol-1 agent would silently ignore (`user`) is only sent
//!   to an agent that reported the feature ([`AgentClient::require`]).

mod tunnel;
mod watch;

use tunnel::TunnelShared;
pub use tunnel::{Tunnel, TUNNEL_WINDOW};
pub use watch::{Watch, WatchUpdate};

use anyhow::{anyhow, Context, Result};
use bytes::{Bytes, BytesMut};
use rootfs_init::protocol::{
    encode_request, metadata::Metadata, AgentError, EntryInfo, EntryList, ErrorKind, EvalResult,
    EvalSpec, ExecInfo, ExecList, ExecResult, ExecSpec, FileStat, FrameDecoder, IdentityResult,
    IdentitySpec, ListResult, Op, PingResult, ReadResult, Reply, ReplyHeader, RequestHeader,
    WriteHow, FEATURE_ATTACH, FEATURE_METADATA, FEATURE_USERS,
};
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// One frame for a request: a reply or an event, with its payload.
pub type Event = (Reply, Bytes);

/// Most frames of one request queued unread before the request is failed.
pub const MAX_UNREAD_FRAMES: usize = 1024;
/// Most payload bytes of one request queued unread before it is failed.
pub const MAX_UNREAD_BYTES: usize = 64 << 20;

/// What is queued unread for one request.
#[derive(Default)]
struct Unread {
    frames: AtomicUsize,
    bytes: AtomicUsize,
}

enum Route {
    /// An ordinary request: its frames queue for [`Events`].
    Request {
        tx: mpsc::UnboundedSender<Event>,
        unread: Arc<Unread>,
    },
    /// A tunnel's `tunnel_open`: its data, end of stream and end.
    Tunnel(Arc<TunnelShared>),
    /// One `tunnel_data` of a tunnel, carrying this many bytes: its `ok`
    /// returns them as write credit.
    TunnelWrite(Arc<TunnelShared>, usize),
}

type Routes = Arc<Mutex<Option<HashMap<u64, Route>>>>;

/// The frames of one request, in the order the agent sent them; `None`
/// from [`Events::recv`] means the channel closed.
pub struct Events {
    rx: mpsc::UnboundedReceiver<Event>,
    unread: Arc<Unread>,
}

impl Events {
    /// The next frame of the request.
    pub async fn recv(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await?;
        self.unread.frames.fetch_sub(1, Ordering::Relaxed);
        self.unread.bytes.fetch_sub(ev.1.len(), Ordering::Relaxed);
        Some(ev)
    }
}

/// Why an agent call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The agent answered with an error.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The channel to the agent failed.
    #[error("agent channel: {0}")]
    Channel(String),
    /// The agent sent no reply within this long; the channel stays usable.
    #[error("no reply from the agent within {0:?}")]
    Timeout(Duration),
}

/// A connected agent channel. Cheap to clone.
#[derive(Clone)]
pub struct AgentClient {
    tx: mpsc::UnboundedSender<Bytes>,
    routes: Routes,
    next_id: Arc<AtomicU64>,
    /// What the agent reported in its last ping's `features` (None: no
    /// ping answered yet on this connection).
    features: Arc<Mutex<Option<Vec<String>>>>,
}

/// Output of a buffered exec.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    pub result: ExecResult,
    pub stdout: Bytes,
    pub stderr: Bytes,
}

impl AgentClient {
    /// Connects to the agent socket QEMU listens on.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<AgentClient> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("connecting to agent socket {}", path.display()))
                }
            }
        };
        Ok(AgentClient::over(stream))
    }

    /// A client on an already connected stream (the agent socket, or one
    /// end of a socket pair in tests). Starts its writer and reader tasks.
    fn over(stream: UnixStream) -> AgentClient {
        let (mut rd, mut wr) = stream.into_split();
        let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
        let routes: Routes = Arc::new(Mutex::new(Some(HashMap::new())));
        tokio::spawn(async move {
            while let Some(frame) = rx.recv().await {
                if wr.write_all(&frame).await.is_err() {
                    return;
                }
            }
        });
        let r = routes.clone();
        tokio::spawn(async move {
            let mut dec = FrameDecoder::new();
            let mut buf = vec![0u8; 256 * 1024];
            let mut garbage_logged = false;
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => dec.extend(&buf[..n]),
                }
                loop {
                    match dec.next_frame() {
                        Ok(Some(f)) => route(&r, &f.header, f.payload),
                        Ok(None) => break,
                        // The bad bytes are gone; what follows may be a frame.
                        Err(e) if !garbage_logged => {
                            garbage_logged = true;
                            tracing::warn!("agent channel: {e} (further garbage is not logged)");
                        }
                        Err(_) => {}
                    }
                }
            }
            // Closing the map drops every sender, failing all waiters.
            let gone = r.lock().unwrap().take();
            for route in gone.into_iter().flat_map(|m| m.into_values()) {
                if let Route::Tunnel(t) | Route::TunnelWrite(t, _) = route {
                    t.fail(CallError::Channel("connection closed".into()));
                }
            }
        });
        AgentClient {
            tx,
            routes,
            // Far from 0 and from u64::MAX: ids never wrap in practice.
            next_id: Arc::new(AtomicU64::new((rand::random::<u64>() >> 2) + 1)),
            features: Arc::default(),
        }
    }

    /// Encodes a request under a fresh id and registers `route` for it
    /// (none: nobody waits for a reply) before sending it.
    fn send_routed(&self, op: Op, payload: &[u8], route: Option<Route>) -> Result<u64, CallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut buf = BytesMut::new();
        encode_request(&RequestHeader { id, op }, payload, &mut buf).map_err(|e| {
            CallError::Agent(AgentError::new(
                ErrorKind::BadRequest,
                format!("request too large for the agent channel: {e}"),
            ))
        })?;
        if let Some(route) = route {
            match self.routes.lock().unwrap().as_mut() {
                Some(m) => m.insert(id, route),
                None => return Err(CallError::Channel("connection closed".into())),
            };
        }
        self.tx
            .send(buf.freeze())
            .map_err(|_| CallError::Channel("connection closed".into()))?;
        Ok(id)
    }

    /// Fails with `unsupported` unless the agent reported `feature` (one of
    /// `rootfs_init::protocol::FEATURES`); pings it once per connection to
    /// learn what it supports. A protocol-1 agent (an image's initramfs
    /// built before these features) reports none.
    pub async fn require(&self, feature: &str) -> Result<(), CallError> {
        if self.supports(feature).await? {
            return Ok(());
        }
        Err(CallError::Agent(AgentError::new(
            ErrorKind::Unsupported,
            format!(
                "the guest's forkd-agent does not support {feature:?} (it speaks an older \
                 protocol); rebuild the guest initramfs and take the snapshot again"
            ),
        )))
    }

    /// Whether the agent reported `feature` (see [`Self::require`]).
    pub async fn supports(&self, feature: &str) -> Result<bool, CallError> {
        let known = self.features.lock().unwrap().clone();
        let features = match known {
            Some(f) => f,
            None => self.ping(Duration::from_secs(30)).await?.features,
        };
        Ok(features.iter().any(|f| f == feature))
    }

    /// [`Self::require`] for [`FEATURE_USERS`] when a request names a user.
    async fn require_user(&self, user: Option<&str>) -> Result<(), CallError> {
        match user {
            Some(_) => self.require(FEATURE_USERS).await,
            None => Ok(()),
        }
    }

    /// Sends a request and returns the receiver of its frames.
    pub fn start(&self, op: Op, payload: &[u8]) -> Result<(u64, Events), CallError> {
        let (etx, erx) = mpsc::unbounded_channel();
        let unread = Arc::new(Unread::default());
        let route = Route::Request {
            tx: etx,
            unread: unread.clone(),
        };
        let id = self.send_routed(op, payload, Some(route))?;
        Ok((id, Events { rx: erx, unread }))
    }

    /// Writes raw bytes into the channel, bypassing framing. For tests and
    /// diagnostics (e.g. proving the agent survives garbage).
    pub fn send_raw(&self, bytes: &[u8]) -> Result<(), CallError> {
        self.tx
            .send(Bytes::copy_from_slice(bytes))
            .map_err(|_| CallError::Channel("connection closed".into()))
    }

    /// Sends a request and waits for its final reply.
    pub async fn call(
        &self,
        op: Op,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(serde_json::Value, Bytes), CallError> {
        let (id, mut rx) = self.start(op, payload)?;
        let wait = async {
            while let Some((reply, payload)) = rx.recv().await {
                match reply {
                    Reply::Ok { result } => return Ok((result, payload)),
                    Reply::Error { error } => return Err(CallError::Agent(error)),
                    _ => {}
                }
            }
            Err(CallError::Channel(
                "connection closed before the reply".into(),
            ))
        };
        let res = tokio::time::timeout(timeout, wait)
            .await
            .unwrap_or(Err(CallError::Timeout(timeout)));
        self.forget(id);
        res
    }

    async fn call_typed<T: DeserializeOwned>(
        &self,
        op: Op,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(T, Bytes), CallError> {
        let (v, p) = self.call(op, payload, timeout).await?;
        let t = serde_json::from_value(v)
            .map_err(|e| CallError::Channel(format!("unexpected reply: {e}")))?;
        Ok((t, p))
    }

    fn forget(&self, id: u64) {
        if let Some(m) = self.routes.lock().unwrap().as_mut() {
            m.remove(&id);
        }
    }

    /// One ping round trip, failing after `timeout`: the agent's version, uptime and warm-interpreter state.
    pub async fn ping(&self, timeout: Duration) -> Result<PingResult, CallError> {
        let p: PingResult = self.call_typed(Op::Ping, &[], timeout).await?.0;
        *self.features.lock().unwrap() = Some(p.features.clone());
        Ok(p)
    }

    /// Pings until the agent answers or `timeout` passes.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<PingResult> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self
                .ping(
                    left.min(Duration::from_secs(5))
                        .max(Duration::from_millis(1)),
                )
                .await
            {
                Ok(p) => return Ok(p),
                Err(e) if Instant::now() >= deadline => {
                    return Err(anyhow!("agent did not answer within {timeout:?}: {e}"))
                }
                Err(CallError::Channel(e)) => return Err(anyhow!("agent channel failed: {e}")),
                Err(_) => {}
            }
        }
    }

    /// Runs a process and collects its output. The call's own deadline is the
    /// exec timeout plus a margin. A `spec.user` needs an agent with
    /// [`FEATURE_USERS`] (checked first).
    pub async fn exec(&self, spec: ExecSpec, stdin: &[u8]) -> Result<ExecOutput, CallError> {
        self.require_user(spec.user.as_deref()).await?;
        let timeout = call_timeout(spec.timeout_ms);
        let (result, payload): (ExecResult, Bytes) =
            self.call_typed(Op::Exec(spec), stdin, timeout).await?;
        let split = (result.stdout_len as usize).min(payload.len());
        Ok(ExecOutput {
            stdout: payload.slice(..split),
            stderr: payload.slice(split..),
            result,
        })
    }

    /// Starts a streaming exec; frames arrive on the receiver (`started`,
    /// `stdout`, `stderr`, then a final `ok` with the [`ExecResult`]).
    /// A `spec.user` is refused unless this connection already knows the
    /// agent supports users (use [`Self::exec_stream_as`], which checks).
    pub fn exec_stream(
        &self,
        mut spec: ExecSpec,
        stdin: &[u8],
    ) -> Result<(u64, Events), CallError> {
        if spec.user.is_some() {
            let known = self.features.lock().unwrap().clone().unwrap_or_default();
            if !known.iter().any(|f| f == FEATURE_USERS) {
                return Err(CallError::Agent(AgentError::new(
                    ErrorKind::Unsupported,
                    "exec_stream with a user needs an agent known to support users: \
                     call exec_stream_as (or require(\"users\") first)",
                )));
            }
        }
        spec.stream = true;
        self.start(Op::Exec(spec), stdin)
    }

    /// [`Self::exec_stream`] that first checks the agent supports
    /// `spec.user` (when set): the way to run a streaming exec, or a
    /// terminal (`spec.pty`), as a user.
    pub async fn exec_stream_as(
        &self,
        spec: ExecSpec,
        stdin: &[u8],
    ) -> Result<(u64, Events), CallError> {
        self.require_user(spec.user.as_deref()).await?;
        self.exec_stream(spec, stdin)
    }

    /// Follows the running streaming exec whose process is `pid` (a
    /// terminal after a reconnect, a second viewer): `started`, then its
    /// events and final reply, as [`Self::exec_stream`] delivers them. The
    /// returned id is a `target` for [`Self::stdin`], [`Self::resize`] and
    /// [`Self::signal`] while the exec runs.
    pub async fn attach(&self, pid: u32) -> Result<(u64, Events), CallError> {
        self.require(FEATURE_ATTACH).await?;
        self.start(Op::Attach { pid }, &[])
    }

    /// The agent's running execs (ids, pids, argv, user, cwd, terminal).
    pub async fn list_execs(&self) -> Result<Vec<ExecInfo>, CallError> {
        self.require(FEATURE_ATTACH).await?;
        let (l, _): (ExecList, _) = self
            .call_typed(Op::ListExecs, &[], Duration::from_secs(30))
            .await?;
        Ok(l.execs)
    }

    /// Sends stdin to a running streaming exec.
    pub async fn stdin(&self, target: u64, data: &[u8], eof: bool) -> Result<(), CallError> {
        self.call(Op::Stdin { target, eof }, data, Duration::from_secs(30))
            .await
            .map(|_| ())
    }

    /// Changes the terminal size of the running PTY exec `target`.
    pub async fn resize(
        &self,
        target: u64,
        size: rootfs_init::protocol::PtySize,
    ) -> Result<(), CallError> {
        self.call(Op::Resize { target, size }, &[], Duration::from_secs(10))
            .await
            .map(|_| ())
    }

    /// Sends `signal` to the process group of the running exec `target`.
    pub async fn signal(&self, target: u64, signal: i32) -> Result<(), CallError> {
        self.call(Op::Signal { target, signal }, &[], Duration::from_secs(10))
            .await
            .map(|_| ())
    }

    /// Runs Python `code` in the guest's warm interpreter with the agent-side `timeout_ms`; the call itself waits that (5 min when `None`) plus a margin.
    pub async fn eval(&self, code: &str, timeout_ms: Option<u64>) -> Result<EvalResult, CallError> {
        let spec = EvalSpec {
            code: code.to_string(),
            timeout_ms,
        };
        Ok(self
            .call_typed(
                Op::Eval(spec),
                &[],
                call_timeout(timeout_ms.or(Some(300_000))),
            )
            .await?
            .0)
    }

    /// Reads `len` bytes of a guest file from `offset` (to the end when `None`).
    pub async fn read_file(
        &self,
        path: &str,
        offset: u64,
        len: Option<u64>,
    ) -> Result<(ReadResult, Bytes), CallError> {
        self.read_file_as(path, offset, len, None).await
    }

    /// [`Self::read_file`] where a relative `path` (or `~/...`) is under
    /// `user`'s home.
    pub async fn read_file_as(
        &self,
        path: &str,
        offset: u64,
        len: Option<u64>,
        user: Option<&str>,
    ) -> Result<(ReadResult, Bytes), CallError> {
        self.require_user(user).await?;
        let op = Op::ReadFile {
            path: path.into(),
            user: user.map(String::from),
            offset,
            len,
        };
        self.call_typed(op, &[], Duration::from_secs(120)).await
    }

    /// Writes a guest file (atomically unless `append`), creating its parents; returns its stat.
    pub async fn write_file(
        &self,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        append: bool,
    ) -> Result<FileStat, CallError> {
        let how = if append {
            WriteHow::Append
        } else {
            WriteHow::Atomic
        };
        self.write_file_as(path, data, mode, how, None, None).await
    }

    /// [`Self::write_file`] for `user`: the file and the parents it creates
    /// belong to that user (E2B's rule), and a relative `path` is under its
    /// home. `None`: root, as [`Self::write_file`]. `how`: atomically,
    /// appended, or in place (an agent that predates in-place writes
    /// writes atomically: the same bytes, only a watcher sees it differently).
    /// `metadata`: the file's whole metadata set after the write (None: as
    /// it was). An agent without metadata is refused a non-empty set, and
    /// an empty one is moot there: nothing could have set any.
    pub async fn write_file_as(
        &self,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        how: WriteHow,
        user: Option<&str>,
        metadata: Option<&Metadata>,
    ) -> Result<FileStat, CallError> {
        self.require_user(user).await?;
        let metadata = match metadata {
            Some(m) if !m.is_empty() => {
                self.require(FEATURE_METADATA).await?;
                Some(m.clone())
            }
            Some(m) if self.supports(FEATURE_METADATA).await? => Some(m.clone()),
            _ => None,
        };
        let op = Op::WriteFile {
            path: path.into(),
            user: user.map(String::from),
            mode,
            append: how == WriteHow::Append,
            in_place: how == WriteHow::InPlace,
            create_parents: true,
            metadata,
        };
        Ok(self.call_typed(op, data, Duration::from_secs(120)).await?.0)
    }

    /// Everything about one guest path: owner and group names, mode,
    /// nanosecond mtime, a symlink's text and fully resolved absolute
    /// target (what E2B's envd reports). A relative `path` is under
    /// `user`'s home.
    pub async fn entry(&self, path: &str, user: Option<&str>) -> Result<EntryInfo, CallError> {
        self.require(FEATURE_USERS).await?;
        let op = Op::Entry {
            path: path.into(),
            user: user.map(String::from),
        };
        Ok(self.call_typed(op, &[], Duration::from_secs(60)).await?.0)
    }

    /// [`Self::entry`] of everything under directory `path`, `depth`
    /// levels down (1: its own entries), depth first and by name.
    pub async fn list_entries(
        &self,
        path: &str,
        depth: u32,
        user: Option<&str>,
    ) -> Result<Vec<EntryInfo>, CallError> {
        self.require(FEATURE_USERS).await?;
        let op = Op::ListEntries {
            path: path.into(),
            depth,
            user: user.map(String::from),
        };
        let (l, _): (EntryList, _) = self.call_typed(op, &[], Duration::from_secs(120)).await?;
        Ok(l.entries)
    }

    /// Lists a guest directory.
    pub async fn list(&self, path: &str) -> Result<ListResult, CallError> {
        Ok(self
            .call_typed(
                Op::ListDir { path: path.into() },
                &[],
                Duration::from_secs(60),
            )
            .await?
            .0)
    }

    /// Stats a guest path.
    pub async fn stat(&self, path: &str) -> Result<FileStat, CallError> {
        Ok(self
            .call_typed(Op::Stat { path: path.into() }, &[], Duration::from_secs(60))
            .await?
            .0)
    }

    /// Creates a guest directory (and its missing parents when `parents`); returns its stat.
    pub async fn mkdir(&self, path: &str, parents: bool) -> Result<FileStat, CallError> {
        self.mkdir_as(path, parents, None).await
    }

    /// [`Self::mkdir`] for `user`: the directories it creates belong to
    /// that user, and a relative `path` is under its home.
    pub async fn mkdir_as(
        &self,
        path: &str,
        parents: bool,
        user: Option<&str>,
    ) -> Result<FileStat, CallError> {
        self.require_user(user).await?;
        let op = Op::Mkdir {
            path: path.into(),
            user: user.map(String::from),
            mode: None,
            parents,
        };
        Ok(self.call_typed(op, &[], Duration::from_secs(60)).await?.0)
    }

    /// Removes a guest file or empty directory; a whole tree when `recursive`.
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), CallError> {
        self.remove_as(path, recursive, None).await
    }

    /// [`Self::remove`] where a relative `path` is under `user`'s home.
    pub async fn remove_as(
        &self,
        path: &str,
        recursive: bool,
        user: Option<&str>,
    ) -> Result<(), CallError> {
        self.require_user(user).await?;
        let op = Op::Remove {
            path: path.into(),
            user: user.map(String::from),
            recursive,
        };
        self.call(op, &[], Duration::from_secs(120))
            .await
            .map(|_| ())
    }

    /// Gives a freshly forked child its identity: host entropy, host clock,
    /// hostname and a reseeded interpreter; also writes the guest's
    /// resolv.conf with `nameservers` when given (a networked child) and
    /// installs the extra CA certificates `ca_certs` (PEM) when given.
    ///
    /// `deadline` is the caller's: the reseed runs warm-up modules' hooks
    /// (a browser's takes seconds under TCG), so only the caller knows how
    /// long a child may take to become ready.
    pub async fn identity_with(
        &self,
        hostname: Option<&str>,
        nameservers: Option<Vec<std::net::Ipv4Addr>>,
        ca_certs: Option<&str>,
        deadline: Duration,
    ) -> Result<IdentityResult, CallError> {
        let mut entropy = [0u8; 64];
        rand::Rng::fill(&mut rand::rngs::OsRng, &mut entropy[..]);
        let spec = IdentitySpec {
            unix_time_ns: Some(unix_now_ns()),
            hostname: hostname.map(String::from),
            reseed_interpreter: true,
            nameservers,
            ca_certs: ca_certs.map(String::from),
        };
        Ok(self
            .call_typed(Op::Identity(spec), &entropy, deadline)
            .await?
            .0)
    }

    /// Sets the guest's clock to the host's and mixes in fresh entropy: all
    /// a child whose identity was given when it was parked needs at
    /// hand-out (its clock stood still while it was paused); with
    /// `ca_certs` (PEM), the extra CA certificates this hand-out asks for.
    /// `deadline` as for [`Self::identity_with`].
    pub async fn sync_clock(
        &self,
        ca_certs: Option<&str>,
        deadline: Duration,
    ) -> Result<IdentityResult, CallError> {
        let mut entropy = [0u8; 32];
        rand::Rng::fill(&mut rand::rngs::OsRng, &mut entropy[..]);
        let spec = IdentitySpec {
            unix_time_ns: Some(unix_now_ns()),
            hostname: None,
            reseed_interpreter: false,
            nameservers: None,
            ca_certs: ca_certs.map(String::from),
        };
        Ok(self
            .call_typed(Op::Identity(spec), &entropy, deadline)
            .await?
            .0)
    }

    /// Installs extra CA certificates (PEM) in the guest and nothing else
    /// (a snapshot's parent before its warm-up); returns how many it now
    /// trusts of them.
    pub async fn trust_ca(&self, ca_certs: &str) -> Result<usize, CallError> {
        let spec = IdentitySpec {
            ca_certs: Some(ca_certs.to_string()),
            ..Default::default()
        };
        Ok(self
            .call_typed::<IdentityResult>(Op::Identity(spec), &[], Duration::from_secs(30))
            .await?
            .0
            .ca_certs_installed)
    }

    /// Asks the guest to power off.
    pub async fn shutdown(&self) -> Result<(), CallError> {
        self.call(Op::Shutdown { reboot: false }, &[], Duration::from_secs(10))
            .await
            .map(|_| ())
    }
}

/// The host's wall clock, ns since the epoch.
fn unix_now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}

/// Routes one decoded frame to its waiter. A request over its unread
/// budget gets one final error instead and its route is removed.
fn route(routes: &Routes, header: &[u8], payload: Bytes) {
    let Ok(h) = serde_json::from_slice::<ReplyHeader>(header) else {
        return;
    };
    let mut guard = routes.lock().unwrap();
    let Some(map) = guard.as_mut() else { return };
    let Some(route) = map.get(&h.id) else { return };
    let (tx, unread) = match route {
        Route::Request { tx, unread } => (tx, unread),
        Route::Tunnel(t) => {
            if t.deliver(h.body, payload) {
                map.remove(&h.id);
            }
            return;
        }
        Route::TunnelWrite(t, n) => {
            match h.body {
                Reply::Ok { .. } => t.credit(h.id, *n),
                Reply::Error { error } => t.write_failed(h.id, error),
                _ => return,
            }
            map.remove(&h.id);
            return;
        }
    };
    let r = (tx, unread);
    let frames = r.1.frames.fetch_add(1, Ordering::Relaxed) + 1;
    let bytes = r.1.bytes.fetch_add(payload.len(), Ordering::Relaxed) + payload.len();
    if frames > MAX_UNREAD_FRAMES || bytes > MAX_UNREAD_BYTES {
        let error = AgentError::new(
            rootfs_init::protocol::ErrorKind::Internal,
            format!(
                "the guest sent this request more than {MAX_UNREAD_FRAMES} frames or \
                 {} MiB that were not read yet; the request was dropped",
                MAX_UNREAD_BYTES >> 20
            ),
        );
        let _ = r.0.send((Reply::Error { error }, Bytes::new()));
        map.remove(&h.id);
        return;
    }
    let last = h.body.is_final();
    let _ = r.0.send((h.body, payload));
    if last {
        map.remove(&h.id);
    }
}

/// The host-side deadline for a request whose guest-side timeout is `ms`.
fn call_timeout(ms: Option<u64>) -> Duration {
    match ms {
        Some(ms) => Duration::from_millis(ms) + Duration::from_secs(10),
        None => Duration::from_secs(24 * 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rootfs_init::protocol::{encode_reply, ErrorKind, Frame, TunnelResult, FEATURE_TUNNEL};

    /// A fake agent on the far end of a socket pair, speaking the frame
    /// protocol of `rootfs_init::protocol`.
    struct FakeAgent {
        stream: UnixStream,
        dec: FrameDecoder,
    }

    impl FakeAgent {
        async fn recv(&mut self) -> (RequestHeader, Bytes) {
            loop {
                if let Some(Frame { header, payload }) = self.dec.next_frame().unwrap() {
                    return (serde_json::from_slice(&header).unwrap(), payload);
                }
                let mut buf = [0u8; 4096];
                let n = self.stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "the client closed the channel");
                self.dec.extend(&buf[..n]);
            }
        }
        async fn send(&mut self, id: u64, body: Reply, payload: &[u8]) {
            let mut out = BytesMut::new();
            encode_reply(&ReplyHeader { id, body }, payload, &mut out);
            self.stream.write_all(&out).await.unwrap();
        }
    }

    fn pair() -> (AgentClient, FakeAgent) {
        let (a, b) = UnixStream::pair().unwrap();
        let fake = FakeAgent {
            stream: b,
            dec: FrameDecoder::new(),
        };
        (AgentClient::over(a), fake)
    }

    fn ok(v: impl serde::Serialize) -> Reply {
        Reply::Ok {
            result: serde_json::to_value(v).unwrap(),
        }
    }

    #[tokio::test]
    async fn replies_reach_their_own_request_in_any_order() {
        let (c, mut agent) = pair();
        let fake = async {
            let (a, pa) = agent.recv().await;
            let (b, pb) = agent.recv().await;
            let (ping, exec) = match (&a.op, &b.op) {
                (Op::Ping, Op::Exec(_)) => (a.id, (b.id, pb)),
                (Op::Exec(_), Op::Ping) => (b.id, (a.id, pa)),
                other => panic!("unexpected requests {other:?}"),
            };
            assert_eq!(&exec.1[..], b"in");
            // The exec's reply first: stdout then stderr in one payload.
            let r = ExecResult {
                exit_code: Some(3),
                stdout_len: 3,
                stderr_len: 3,
                ..Default::default()
            };
            agent.send(exec.0, ok(r), b"outerr").await;
            let p = PingResult {
                hostname: "sb-1".into(),
                ..Default::default()
            };
            agent.send(ping, ok(p), &[]).await;
            agent
        };
        let spec = ExecSpec {
            shell: Some("x".into()),
            ..Default::default()
        };
        let (p, x, _agent) =
            tokio::join!(c.ping(Duration::from_secs(5)), c.exec(spec, b"in"), fake);
        assert_eq!(p.unwrap().hostname, "sb-1");
        let x = x.unwrap();
        assert_eq!((&x.stdout[..], &x.stderr[..]), (&b"out"[..], &b"err"[..]));
        assert_eq!(x.result.status_code(), 3);
        assert!(c.routes.lock().unwrap().as_ref().unwrap().is_empty());
    }

    #[tokio::test]
    async fn stream_events_keep_their_order_between_other_replies() {
        let (c, mut agent) = pair();
        let (sid, mut rx) = c
            .exec_stream(
                ExecSpec {
                    shell: Some("x".into()),
                    ..Default::default()
                },
                &[],
            )
            .unwrap();
        let (h, _) = agent.recv().await;
        assert_eq!(h.id, sid);
        assert!(matches!(&h.op, Op::Exec(s) if s.stream));
        let fake = async {
            let (other, _) = agent.recv().await;
            agent.send(sid, Reply::Started { pid: 7 }, &[]).await;
            agent.send(sid, Reply::Stdout, b"a").await;
            agent.send(other.id, ok(PingResult::default()), &[]).await;
            agent.send(sid, Reply::Stderr, b"b").await;
            agent.send(sid, ok(ExecResult::default()), &[]).await;
            agent
        };
        let (p, _agent) = tokio::join!(c.ping(Duration::from_secs(5)), fake);
        p.unwrap();
        let mut got = Vec::new();
        while let Some((r, payload)) = rx.recv().await {
            let last = r.is_final();
            got.push((r, payload));
            if last {
                break;
            }
        }
        assert!(matches!(got[0].0, Reply::Started { pid: 7 }));
        assert_eq!((&got[1].0, &got[1].1[..]), (&Reply::Stdout, &b"a"[..]));
        assert_eq!((&got[2].0, &got[2].1[..]), (&Reply::Stderr, &b"b"[..]));
        assert!(matches!(got[3].0, Reply::Ok { .. }));
        // The final frame removed the route.
        assert!(c.routes.lock().unwrap().as_ref().unwrap().is_empty());
    }

    #[tokio::test]
    async fn agent_errors_timeouts_and_a_closed_channel() {
        let (c, mut agent) = pair();
        // An error reply is the agent's error, kind intact.
        let fake = async {
            let (h, _) = agent.recv().await;
            let e = AgentError::new(ErrorKind::NotFound, "/nope: no such file");
            agent.send(h.id, Reply::Error { error: e }, &[]).await;
            agent
        };
        let (r, mut agent) = tokio::join!(c.stat("/nope"), fake);
        match r {
            Err(CallError::Agent(e)) => assert_eq!(e.kind, ErrorKind::NotFound),
            other => panic!("{other:?}"),
        }
        // No answer in time: a timeout, and the route is forgotten, so a
        // late reply goes nowhere.
        let r = c.call(Op::Ping, &[], Duration::from_millis(50)).await;
        assert!(matches!(r, Err(CallError::Timeout(_))), "{r:?}");
        let (late, _) = agent.recv().await;
        agent.send(late.id, ok(PingResult::default()), &[]).await;
        assert!(c.routes.lock().unwrap().as_ref().unwrap().is_empty());
        // The agent goes away: the waiter fails, and so does the next call.
        let fake = async {
            let _ = agent.recv().await;
            drop(agent);
        };
        let (r, ()) = tokio::join!(c.ping(Duration::from_secs(5)), fake);
        assert!(matches!(r, Err(CallError::Channel(_))), "{r:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let r = c.ping(Duration::from_secs(5)).await;
        assert!(matches!(r, Err(CallError::Channel(_))), "{r:?}");
    }

    /// A hand-out's identity waits as long as its caller allows: a
    /// browser's reseed takes over 30 s on a busy TCG host, and the call
    /// used to give up at a fixed 30 s under poold's 60 s bound on a
    /// child's first answer.
    #[tokio::test(start_paused = true)]
    async fn an_identity_waits_for_the_callers_deadline() {
        let (c, mut agent) = pair();
        let fake = async {
            let (h, entropy) = agent.recv().await;
            assert!(
                matches!(&h.op, Op::Identity(s) if s.reseed_interpreter),
                "{h:?}"
            );
            assert_eq!(entropy.len(), 64);
            tokio::time::sleep(Duration::from_secs(45)).await;
            let r = IdentityResult {
                hostname: "slow".into(),
                interpreter_reseeded: true,
                ..Default::default()
            };
            agent.send(h.id, ok(r), &[]).await;
            agent
        };
        let call = c.identity_with(Some("slow"), None, None, Duration::from_secs(60));
        let (r, mut agent) = tokio::join!(call, fake);
        assert_eq!(r.unwrap().hostname, "slow");
        // And no longer than that.
        let call = c.sync_clock(None, Duration::from_secs(60));
        let (r, _) = tokio::join!(call, agent.recv());
        assert!(
            matches!(r, Err(CallError::Timeout(d)) if d == Duration::from_secs(60)),
            "{r:?}"
        );
    }

    /// Garbage in front of a reply is skipped and the reply still arrives:
    /// the reader used to stop decoding at the first bad byte and wait for
    /// more input, so the caller timed out.
    #[tokio::test]
    async fn garbage_before_a_frame_does_not_stall_the_channel() {
        let (c, mut agent) = pair();
        let fake = async {
            let (h, _) = agent.recv().await;
            let mut out = BytesMut::from(&b"not a frame at all"[..]);
            let p = PingResult {
                hostname: "after-garbage".into(),
                ..Default::default()
            };
            encode_reply(
                &ReplyHeader {
                    id: h.id,
                    body: ok(p),
                },
                &[],
                &mut out,
            );
            agent.stream.write_all(&out).await.unwrap();
            agent
        };
        let (p, _agent) = tokio::join!(c.ping(Duration::from_secs(5)), fake);
        assert_eq!(p.unwrap().hostname, "after-garbage");
    }

    /// Replies the agent still owed an earlier connection (ids 1, 2, ... of
    /// a poold before its restart) never answer a request of this one: ids
    /// used to restart at 1 on every connection.
    #[tokio::test]
    async fn a_reply_owed_to_an_earlier_connection_answers_nothing_here() {
        let (c, mut agent) = pair();
        let fake = async {
            let (h, _) = agent.recv().await;
            for stale in 1..=64 {
                let p = PingResult {
                    hostname: "stale".into(),
                    ..Default::default()
                };
                agent.send(stale, ok(p), &[]).await;
            }
            let p = PingResult {
                hostname: "fresh".into(),
                ..Default::default()
            };
            agent.send(h.id, ok(p), &[]).await;
            agent
        };
        let (p, _agent) = tokio::join!(c.ping(Duration::from_secs(5)), fake);
        assert_eq!(p.unwrap().hostname, "fresh");
    }

    /// Answers the ping `require` sends with `features`.
    async fn answer_ping(agent: &mut FakeAgent, features: &[&str]) {
        let (h, _) = agent.recv().await;
        assert!(matches!(h.op, Op::Ping), "{h:?}");
        let p = PingResult {
            features: features.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        };
        agent.send(h.id, ok(p), &[]).await;
    }

    /// An agent that does not report `users` (protocol 1) would run a
    /// user's exec as root: the client refuses it without sending it.
    #[tokio::test]
    async fn a_user_is_never_sent_to_an_agent_without_users() {
        let (c, mut agent) = pair();
        let spec = ExecSpec {
            shell: Some("id".into()),
            user: Some("user".into()),
            ..Default::default()
        };
        let fake = async {
            answer_ping(&mut agent, &[]).await;
            agent
        };
        let (r, mut agent) = tokio::join!(c.exec(spec.clone(), &[]), fake);
        match r {
            Err(CallError::Agent(e)) => {
                assert_eq!(e.kind, ErrorKind::Unsupported);
                assert!(e.message.contains("rebuild the guest initramfs"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        // The answer is remembered: no second ping, and exec_stream refuses too.
        assert!(c.exec_stream(spec.clone(), &[]).is_err());
        let w = c.write_file_as("a", b"x", None, WriteHow::Atomic, Some("user"), None);
        match w.await {
            Err(CallError::Agent(e)) => assert_eq!(e.kind, ErrorKind::Unsupported),
            other => panic!("{other:?}"),
        }
        // A root exec still goes out.
        let fake = async {
            let (h, _) = agent.recv().await;
            assert!(matches!(&h.op, Op::Exec(s) if s.user.is_none()), "{h:?}");
            agent.send(h.id, ok(ExecResult::default()), &[]).await;
        };
        let root = ExecSpec { user: None, ..spec };
        let (r, ()) = tokio::join!(c.exec(root, &[]), fake);
        r.unwrap();
    }

    async fn open(c: &AgentClient, agent: &mut FakeAgent, window: u32) -> (Tunnel, u64) {
        let fake = async {
            answer_ping(agent, &[FEATURE_TUNNEL]).await;
            let (h, _) = agent.recv().await;
            match h.op {
                Op::TunnelOpen { port, window: w } => assert_eq!((port, w), (8080, window)),
                other => panic!("{other:?}"),
            }
            agent.send(h.id, Reply::Started { pid: 0 }, &[]).await;
            h.id
        };
        let (t, id) = tokio::join!(c.open_tunnel_with(8080, window), fake);
        (t.unwrap(), id)
    }

    /// Bytes both ways, acknowledgements, both ends of stream and the
    /// final reply, against a fake agent that checks the frames.
    #[tokio::test]
    async fn a_tunnel_carries_bytes_both_ways_and_closes_cleanly() {
        let (c, mut agent) = pair();
        let (mut t, id) = open(&c, &mut agent, 1024).await;
        t.write_all(b"ping").await.unwrap();
        let (h, p) = agent.recv().await;
        assert!(matches!(h.op, Op::TunnelData { target, eof: false } if target == id));
        assert_eq!(&p[..], b"ping");
        agent.send(h.id, ok(serde_json::json!({})), &[]).await;
        agent.send(id, Reply::Stdout, b"pong").await;
        let mut buf = [0u8; 4];
        t.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong");
        let (h, _) = agent.recv().await;
        assert!(
            matches!(h.op, Op::TunnelAck { target, bytes: 4 } if target == id),
            "{h:?}"
        );
        agent.send(id, Reply::Stdout, b"").await;
        assert_eq!(
            t.read(&mut buf).await.unwrap(),
            0,
            "the guest's end of stream"
        );
        t.shutdown().await.unwrap();
        let (h, p) = agent.recv().await;
        assert!(matches!(h.op, Op::TunnelData { eof: true, .. }) && p.is_empty());
        let done = TunnelResult {
            bytes_in: 4,
            bytes_out: 4,
            aborted: false,
        };
        agent.send(id, ok(&done), &[]).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(t.outcome(), Some(Ok(done)));
        drop(t);
        assert!(c.routes.lock().unwrap().as_ref().unwrap().is_empty());
    }

    /// A write waits while a window of bytes is unanswered; each `ok`
    /// from the guest lets the next bytes go.
    #[tokio::test]
    async fn tunnel_writes_wait_for_the_guest_window() {
        let (c, mut agent) = pair();
        let (mut t, _) = open(&c, &mut agent, 8).await;
        let writer = tokio::spawn(async move {
            t.write_all(b"0123456789abcdefghij").await.unwrap();
            t
        });
        let mut got = Vec::new();
        while got.len() < 20 {
            let (h, p) = agent.recv().await;
            assert!(matches!(h.op, Op::TunnelData { eof: false, .. }), "{h:?}");
            assert!(
                p.len() <= 8,
                "{} bytes in one go over a window of 8",
                p.len()
            );
            got.extend_from_slice(&p);
            if p.len() == 8 {
                // The window is spent: nothing more until this is answered.
                let more = tokio::time::timeout(Duration::from_millis(50), agent.recv()).await;
                assert!(more.is_err(), "the client wrote past its window: {more:?}");
            }
            agent.send(h.id, ok(serde_json::json!({})), &[]).await;
        }
        assert_eq!(&got[..], b"0123456789abcdefghij");
        writer.await.unwrap();
    }

    /// A guest that ignores the window gets its tunnel failed; the client
    /// never holds more than the window of its bytes.
    #[tokio::test]
    async fn a_guest_that_ignores_the_window_loses_its_tunnel() {
        let (c, mut agent) = pair();
        let (mut t, id) = open(&c, &mut agent, 1000).await;
        for _ in 0..5 {
            agent.send(id, Reply::Stdout, &[7u8; 300]).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(t.buffered() <= 1000, "{}", t.buffered());
        let mut all = Vec::new();
        let e = t.read_to_end(&mut all).await.unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
        assert!(all.len() <= 1000);
        assert!(matches!(t.outcome(), Some(Err(_))));
        // Its route is gone: later frames for it are dropped, and the
        // channel serves other requests.
        agent.send(id, Reply::Stdout, &[7u8; 300]).await;
        let fake = async {
            loop {
                let (h, _) = agent.recv().await;
                if matches!(h.op, Op::Ping) {
                    return agent.send(h.id, ok(PingResult::default()), &[]).await;
                }
            }
        };
        let (p, ()) = tokio::join!(c.ping(Duration::from_secs(5)), fake);
        p.unwrap();
    }

    /// A guest that floods a request nobody reads gets that request failed
    /// once the unread budget is spent; poold's queue stays bounded.
    #[tokio::test]
    async fn a_flooded_request_is_failed_not_buffered_without_bound() {
        let (c, mut agent) = pair();
        let (sid, mut rx) = c
            .exec_stream(
                ExecSpec {
                    shell: Some("x".into()),
                    ..Default::default()
                },
                &[],
            )
            .unwrap();
        agent.recv().await;
        for _ in 0..MAX_UNREAD_FRAMES + 100 {
            agent.send(sid, Reply::Stdout, b"flood").await;
        }
        // A later request on the same channel still works.
        let fake = async {
            let (h, _) = agent.recv().await;
            agent.send(h.id, ok(PingResult::default()), &[]).await;
            agent
        };
        let (p, _agent) = tokio::join!(c.ping(Duration::from_secs(5)), fake);
        p.unwrap();
        let mut frames = 0;
        let last = loop {
            let (r, _) = rx.recv().await.expect("a final error");
            frames += 1;
            if r.is_final() {
                break r;
            }
        };
        assert!(frames <= MAX_UNREAD_FRAMES + 1, "{frames}");
        match last {
            Reply::Error { error } => assert!(error.message.contains("not read yet"), "{error:?}"),
            other => panic!("expected the flood error, got {other:?}"),
        }
        assert!(c.routes.lock().unwrap().as_ref().unwrap().is_empty());
    }
}
