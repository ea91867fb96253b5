//! Request dispatch: decode frames, run each request on its own task, send
//! replies and stream events through one outbox per channel.

use super::{
    ca, eval::Interpreter, exec, exec::ExecRegistry, files, identity, tunnel, users, watch,
};
use crate::protocol::{
    encode_reply_head, metadata, AgentError, ErrorKind, EvalSpec, ExecList, ExecSpec, Frame,
    FrameDecoder, IdentityResult, IdentitySpec, Op, PingResult, Reply, ReplyHeader, RequestHeader,
    WriteHow, FEATURES, MAX_BUFFERED_OUTPUT_LIMIT, PROTOCOL_VERSION,
};
use bytes::{Bytes, BytesMut};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// One encoded frame waiting to be written: its head (magic, lengths,
/// header), then its payload, kept apart so a file read of tens of MiB is
/// not copied once more in a small guest's memory.
pub struct OutFrame {
    /// Magic, lengths and the JSON header, encoded.
    pub head: Bytes,
    /// The frame's payload, written as is.
    pub payload: Bytes,
}

impl OutFrame {
    /// Writes the frame to `w`.
    pub async fn write_to<W: AsyncWrite + Unpin>(&self, w: &mut W) -> std::io::Result<()> {
        w.write_all(&self.head).await?;
        if !self.payload.is_empty() {
            w.write_all(&self.payload).await?;
        }
        Ok(())
    }
}

/// Where replies for one channel go. Cheap to clone.
#[derive(Clone)]
pub struct Outbox {
    tx: mpsc::Sender<OutFrame>,
}

impl Outbox {
    /// A new outbox and the receiver its writer task drains.
    pub fn new() -> (Outbox, mpsc::Receiver<OutFrame>) {
        let (tx, rx) = mpsc::channel(256);
        (Outbox { tx }, rx)
    }

    /// Queues a reply or event; silently dropped if the channel is gone.
    pub async fn send(&self, id: u64, body: Reply, payload: Bytes) {
        let mut head = BytesMut::new();
        let keep = encode_reply_head(&ReplyHeader { id, body }, payload.len(), &mut head);
        let frame = OutFrame {
            head: head.freeze(),
            payload: if keep { payload } else { Bytes::new() },
        };
        let _ = self.tx.send(frame).await;
    }

    /// Resolves once the channel's writer is gone (the host went away).
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    async fn ok<T: serde::Serialize>(&self, id: u64, result: &T, payload: Bytes) {
        let result = serde_json::to_value(result).expect("results serialise");
        self.send(id, Reply::Ok { result }, payload).await;
    }

    async fn err(&self, id: u64, error: AgentError) {
        self.send(id, Reply::Error { error }, Bytes::new()).await;
    }
}

/// State shared by every request.
pub struct Agent {
    /// When the agent started (for `uptime_ms`).
    pub started: Instant,
    /// Running execs, for `stdin`, `signal` and cleanup.
    pub exec: Arc<ExecRegistry>,
    /// The warm interpreter (Python, or Node in Node mode) behind `eval`.
    pub interp: Interpreter,
    /// Open TCP tunnels.
    pub tunnels: Arc<tunnel::Tunnels>,
    /// Running directory watches.
    pub watches: Arc<watch::Watches>,
}

impl Agent {
    /// The shared state around `interp`, with no exec running.
    pub fn new(interp: Interpreter) -> Arc<Agent> {
        Arc::new(Agent {
            started: Instant::now(),
            exec: Arc::new(ExecRegistry::default()),
            interp,
            tunnels: Arc::default(),
            watches: Arc::default(),
        })
    }

    /// Decodes every complete frame in `dec` and starts its request.
    pub fn pump(self: &Arc<Self>, dec: &mut FrameDecoder, outbox: &Outbox) {
        loop {
            match dec.next_frame() {
                Ok(Some(frame)) => self.start(frame, outbox.clone()),
                Ok(None) => return,
                Err(e) => {
                    eprintln!("forkd-agent: {e}");
                    let ob = outbox.clone();
                    tokio::spawn(async move {
                        ob.err(0, AgentError::new(ErrorKind::BadRequest, e.to_string()))
                            .await
                    });
                }
            }
        }
    }

    /// Decodes a request and runs it on its own task. Execs are registered
    /// here, in channel order, so a `stdin` or `signal` op sent after an
    /// exec always finds it.
    fn start(self: &Arc<Self>, frame: Frame, outbox: Outbox) {
        let agent = self.clone();
        let req: RequestHeader = match serde_json::from_slice(&frame.header) {
            Ok(r) => r,
            Err(e) => {
                let id = serde_json::from_slice::<serde_json::Value>(&frame.header)
                    .ok()
                    .and_then(|v| v.get("id").and_then(|i| i.as_u64()))
                    .unwrap_or(0);
                let msg = format!("malformed request: {e}");
                tokio::spawn(async move {
                    outbox
                        .err(id, AgentError::new(ErrorKind::BadRequest, msg))
                        .await
                });
                return;
            }
        };
        // Ops whose effect must keep channel order act here, before the
        // next frame is decoded; the rest run on their own tasks.
        let done = |r: Result<(), AgentError>| {
            let id = req.id;
            let outbox = outbox.clone();
            tokio::spawn(async move {
                match r {
                    Ok(()) => outbox.ok(id, &serde_json::json!({}), Bytes::new()).await,
                    Err(e) => outbox.err(id, e).await,
                }
            });
        };
        match &req.op {
            Op::TunnelData { target, eof } => {
                // Its `ok` comes from the tunnel once the bytes are written.
                let r = self.tunnels.data(*target, req.id, frame.payload, *eof);
                if r.is_err() {
                    done(r);
                }
                return;
            }
            Op::TunnelAck { target, bytes } => return self.tunnels.ack(*target, *bytes),
            Op::TunnelClose { target } => return done(self.tunnels.close(*target)),
            Op::Unwatch { target } => return done(self.watches.unwatch(*target)),
            Op::Watch {
                path,
                user,
                recursive,
            } => {
                let stop = match self.watches.reserve(req.id) {
                    Ok(stop) => stop,
                    Err(e) => return done(Err(e)),
                };
                let (path, user, recursive) = (path.clone(), user.clone(), *recursive);
                let watches = self.watches.clone();
                tokio::spawn(async move {
                    watches
                        .run(req.id, path, user, recursive, stop, outbox)
                        .await
                });
                return;
            }
            _ => {}
        }
        let queue = match &req.op {
            Op::Exec(spec) => self.exec.reserve(
                req.id,
                spec.stream && (spec.stdin_open || spec.pty.is_some()),
            ),
            _ => None,
        };
        tokio::spawn(async move { agent.handle(req, frame.payload, queue, outbox).await });
    }

    async fn handle(
        self: Arc<Self>,
        req: RequestHeader,
        payload: Bytes,
        queue: Option<exec::StdinQueue>,
        outbox: Outbox,
    ) {
        let id = req.id;
        match req.op {
            Op::Ping => outbox.ok(id, &self.ping(), Bytes::new()).await,
            Op::Exec(spec) => self.exec(id, spec, payload, queue, &outbox).await,
            Op::Stdin { target, eof } => match self.exec.stdin(target, payload, eof).await {
                Ok(()) => outbox.ok(id, &serde_json::json!({}), Bytes::new()).await,
                Err(e) => outbox.err(id, e).await,
            },
            Op::Resize { target, size } => match self.exec.resize(target, size) {
                Ok(()) => outbox.ok(id, &serde_json::json!({}), Bytes::new()).await,
                Err(e) => outbox.err(id, e).await,
            },
            Op::Signal { target, signal } => match self.exec.signal(target, signal) {
                Ok(()) => outbox.ok(id, &serde_json::json!({}), Bytes::new()).await,
                Err(e) => outbox.err(id, e).await,
            },
            Op::Eval(spec) => self.eval(id, spec, &outbox).await,
            Op::Identity(spec) => match self.identity(spec, &payload).await {
                Ok(r) => outbox.ok(id, &r, Bytes::new()).await,
                Err(e) => outbox.err(id, e).await,
            },
            Op::Shutdown { reboot } => {
                outbox.ok(id, &serde_json::json!({}), Bytes::new()).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                request_power_off(reboot);
            }
            Op::TunnelOpen { port, window } => {
                self.tunnels.clone().open(id, port, window, outbox).await
            }
            Op::Attach { pid } => {
                // On success the exec's events (and final reply) follow.
                if let Err(e) = self.exec.attach(pid, &outbox, id).await {
                    outbox.err(id, e).await
                }
            }
            Op::ListExecs => {
                let list = ExecList {
                    execs: self.exec.list(),
                };
                outbox.ok(id, &list, Bytes::new()).await
            }
            op => file_op(id, op, payload, &outbox).await,
        }
    }

    /// The reply to `ping`.
    pub fn ping(&self) -> PingResult {
        let st = self.interp.status();
        PingResult {
            agent_version: crate::VERSION.to_string(),
            protocol: PROTOCOL_VERSION,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            hostname: identity::hostname(),
            warm_ready: st.ready,
            warm_error: st.error,
            warm_pid: st.pid,
            python_version: st.python_version,
            numpy_version: st.numpy_version,
            agent_lang: Some(self.interp.lang().as_str().to_string()),
            node_version: st.node_version,
            features: FEATURES.iter().map(|f| f.to_string()).collect(),
        }
    }

    async fn exec(
        &self,
        id: u64,
        spec: ExecSpec,
        stdin: Bytes,
        queue: Option<exec::StdinQueue>,
        outbox: &Outbox,
    ) {
        if !spec.stream && spec.output_limit.unwrap_or(0) > MAX_BUFFERED_OUTPUT_LIMIT {
            self.exec.remove(id);
            let msg = format!(
                "output_limit above {MAX_BUFFERED_OUTPUT_LIMIT} bytes needs a streaming exec"
            );
            return outbox
                .err(id, AgentError::new(ErrorKind::BadRequest, msg))
                .await;
        }
        match exec::run(id, spec, stdin, queue, outbox.clone(), self.exec.clone()).await {
            Ok(f) => {
                for (ob, follower) in &f.followers {
                    ob.ok(*follower, &f.result, Bytes::new()).await;
                }
                let mut payload = f.stdout;
                payload.extend_from_slice(&f.stderr);
                outbox.ok(id, &f.result, payload.into()).await
            }
            Err(e) => outbox.err(id, e).await,
        }
    }

    async fn eval(&self, id: u64, spec: EvalSpec, outbox: &Outbox) {
        let timeout = spec.timeout_ms.map(Duration::from_millis);
        match self.interp.eval(&spec.code, timeout).await {
            Ok(r) => outbox.ok(id, &r, Bytes::new()).await,
            Err(e) => outbox.err(id, e).await,
        }
    }

    async fn identity(
        &self,
        spec: IdentitySpec,
        entropy: &[u8],
    ) -> Result<IdentityResult, AgentError> {
        identity::add_entropy(entropy)?;
        let clock_skew_ms = spec.unix_time_ns.map(identity::set_clock).transpose()?;
        if let Some(h) = &spec.hostname {
            identity::set_hostname(h)?;
        }
        let resolv_conf_written = match &spec.nameservers {
            Some(ns) => {
                identity::write_resolv_conf(ns)?;
                true
            }
            None => false,
        };
        let ca_certs_installed = match &spec.ca_certs {
            Some(pem) => {
                let pem = pem.clone();
                let n = tokio::task::spawn_blocking(move || ca::install(&pem))
                    .await
                    .map_err(|e| {
                        AgentError::new(ErrorKind::Internal, format!("installing CAs: {e}"))
                    })??;
                self.interp.set_env(&ca::env()).await?;
                n
            }
            None => 0,
        };
        let mut reseeded = false;
        if spec.reseed_interpreter && self.interp.status().ready {
            self.interp.reseed(entropy).await?;
            reseeded = true;
        }
        Ok(IdentityResult {
            clock_skew_ms,
            hostname: identity::hostname(),
            entropy_bytes: entropy.len(),
            interpreter_reseeded: reseeded,
            resolv_conf_written,
            ca_certs_installed,
        })
    }
}

/// A file op's path and the owner of what it creates, for its `user`
/// (none: the path must be absolute and root owns what is made).
fn as_user(path: &str, user: Option<&str>) -> Result<(String, files::Owner), AgentError> {
    let u = users::lookup_opt(user)?;
    let path = users::resolve_path(path, u.as_ref())?;
    Ok((path, u.map(|u| (u.uid, u.gid))))
}

async fn file_op(id: u64, op: Op, payload: Bytes, outbox: &Outbox) {
    let res = files::blocking(move || match op {
        Op::ReadFile {
            path,
            user,
            offset,
            len,
        } => {
            let (path, _) = as_user(&path, user.as_deref())?;
            files::read(&path, offset, len).map(|(r, d)| (json(&r), Bytes::from(d)))
        }
        Op::WriteFile {
            path,
            user,
            mode,
            append,
            in_place,
            create_parents,
            metadata,
        } => {
            if let Some(m) = &metadata {
                metadata::validate(m).map_err(|e| AgentError::new(ErrorKind::BadRequest, e))?;
            }
            let (path, owner) = as_user(&path, user.as_deref())?;
            let how = match (append, in_place) {
                (true, _) => WriteHow::Append,
                (false, true) => WriteHow::InPlace,
                (false, false) => WriteHow::Atomic,
            };
            files::write(
                &path,
                &payload,
                mode,
                how,
                create_parents,
                owner,
                metadata.as_ref(),
            )
            .map(|s| (json(&s), Bytes::new()))
        }
        Op::ListDir { path } => files::list(&path).map(|l| (json(&l), Bytes::new())),
        Op::Stat { path } => files::stat(&path).map(|s| (json(&s), Bytes::new())),
        Op::Entry { path, user } => {
            let (path, _) = as_user(&path, user.as_deref())?;
            files::entry(&path, &users::Names::load()).map(|e| (json(&e), Bytes::new()))
        }
        Op::ListEntries { path, depth, user } => {
            let (path, _) = as_user(&path, user.as_deref())?;
            files::list_entries(&path, depth, &users::Names::load())
                .map(|l| (json(&l), Bytes::new()))
        }
        Op::Mkdir {
            path,
            user,
            mode,
            parents,
        } => {
            let (path, owner) = as_user(&path, user.as_deref())?;
            files::mkdir(&path, mode, parents, owner).map(|s| (json(&s), Bytes::new()))
        }
        Op::Remove {
            path,
            user,
            recursive,
        } => {
            let (path, _) = as_user(&path, user.as_deref())?;
            files::remove(&path, recursive).map(|_| (json(&()), Bytes::new()))
        }
        other => Err(AgentError::new(
            ErrorKind::Unsupported,
            format!("unexpected op {other:?}"),
        )),
    })
    .await;
    match res {
        Ok((result, payload)) => outbox.send(id, Reply::Ok { result }, payload).await,
        Err(e) => outbox.err(id, e).await,
    }
}

fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).expect("results serialise")
}

/// Asks PID 1 to power off (SIGUSR2) or reboot (SIGTERM), the convention
/// forkd-init shares with busybox init.
fn request_power_off(reboot: bool) {
    use nix::sys::signal::{kill, Signal};
    let sig = if reboot {
        Signal::SIGTERM
    } else {
        Signal::SIGUSR2
    };
    if kill(nix::unistd::Pid::from_raw(1), sig).is_err() {
        std::process::exit(0);
    }
}

/// Serves one byte-stream connection (a unix socket in tests, or any
/// transport without reconnects) until the peer closes it.
pub async fn serve_stream<S>(agent: Arc<Agent>, stream: S)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (outbox, mut rx) = Outbox::new();
    let writer = tokio::spawn(async move {
        while let Some(f) = rx.recv().await {
            if f.write_to(&mut wr).await.is_err() {
                return;
            }
        }
    });
    let mut dec = FrameDecoder::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match rd.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                dec.extend(&buf[..n]);
                agent.pump(&mut dec, &outbox);
            }
        }
    }
    drop(outbox);
    writer.abort();
}
