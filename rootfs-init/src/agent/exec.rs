//! Running processes for `exec`: argv or shell, env, cwd, stdin, timeout that
//! kills the whole process group, per-stream output caps, and a streaming form,
//! optionally on a pseudo-terminal (`pty`: the process gets the terminal's
//! slave side as its controlling terminal in a new session; the agent reads
//! and writes the master side and can resize it).
//!
//! A spec with a `user` runs with that account's uid, gid and groups
//! ([`super::users`]), its HOME/USER/LOGNAME and its home as the default
//! cwd; without one, as root with HOME=/root, as always.
//!
//! A streaming exec's events go to every request following it: the exec
//! request itself and each `attach` since ([`Sinks`]); each is also a
//! `target` for `stdin`, `resize` and `signal` until the exec ends.

use super::server::Outbox;
use super::users::{self, User};
use crate::protocol::{
    AgentError, ErrorKind, ExecInfo, ExecResult, ExecSpec, PtySize, Reply, DEFAULT_OUTPUT_LIMIT,
};
use bytes::Bytes;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// How long output pipes may stay open after the main process exits (a
/// background child can hold them); after that the agent stops reading.
const PIPE_GRACE: Duration = Duration::from_secs(2);
/// Size of one stdout/stderr event in streaming mode.
const STREAM_CHUNK: usize = 64 * 1024;
/// Environment every exec starts from unless `clear_env` is set.
const BASE_ENV: &[(&str, &str)] = &[
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/root"),
    ("LANG", "C.UTF-8"),
    ("TERM", "xterm"),
];

/// Running execs by request id (and by the id of each `attach` following
/// one), so `signal`, `stdin`, `resize` and `attach` ops can reach them.
#[derive(Default)]
pub struct ExecRegistry {
    running: Mutex<HashMap<u64, Running>>,
}

/// The requests a streaming exec's events go to: (outbox, request id).
pub type Sinks = Arc<Mutex<Vec<(Outbox, u64)>>>;

#[derive(Clone)]
struct Running {
    pgid: i32,
    stdin: Option<mpsc::Sender<StdinChunk>>,
    /// The terminal's master side, for a PTY exec.
    pty: Option<Arc<OwnedFd>>,
    /// Where its events go (streaming execs; shared with attaches).
    sinks: Sinks,
    /// What `list_execs` says of it; None for an attach's alias entry.
    info: Option<ExecInfo>,
    /// The exec request this entry follows (itself for the exec's own).
    primary: u64,
}

enum StdinChunk {
    Data(Bytes),
    Eof,
}

/// Stdin sent by later `stdin` ops for a streaming exec, queued from the
/// moment the exec request was decoded (see [`ExecRegistry::reserve`]).
pub struct StdinQueue(mpsc::Receiver<StdinChunk>);

impl ExecRegistry {
    /// Sends `signal` to the process group of exec `target`.
    pub fn signal(&self, target: u64, signal: i32) -> Result<(), AgentError> {
        let pgid = self.lookup(target)?.0;
        if pgid <= 0 {
            return Err(AgentError::new(
                ErrorKind::NotReady,
                format!("exec {target} has not started its process yet; retry"),
            ));
        }
        let sig = nix::sys::signal::Signal::try_from(signal).map_err(|_| {
            AgentError::new(
                ErrorKind::BadRequest,
                format!("unknown signal number {signal}"),
            )
        })?;
        nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), sig).map_err(|e| {
            AgentError::new(
                ErrorKind::Io,
                format!("signal {signal} to exec {target}: {e}"),
            )
        })
    }

    /// Queues stdin bytes (and optionally EOF) for streaming exec `target`.
    pub async fn stdin(&self, target: u64, data: Bytes, eof: bool) -> Result<(), AgentError> {
        let tx = self.lookup(target)?.1.ok_or_else(|| {
            AgentError::new(
                ErrorKind::BadRequest,
                format!(
                    "exec {target} does not accept stdin (start it with stream and stdin_open)"
                ),
            )
        })?;
        let closed = || {
            AgentError::new(
                ErrorKind::BadRequest,
                format!("stdin of exec {target} is closed"),
            )
        };
        if !data.is_empty() {
            tx.send(StdinChunk::Data(data))
                .await
                .map_err(|_| closed())?;
        }
        if eof {
            tx.send(StdinChunk::Eof).await.map_err(|_| closed())?;
        }
        Ok(())
    }

    /// Changes the terminal size of PTY exec `target`.
    pub fn resize(&self, target: u64, size: PtySize) -> Result<(), AgentError> {
        size.validate()
            .map_err(|m| AgentError::new(ErrorKind::BadRequest, m))?;
        let (pgid, pty) = {
            let running = self.running.lock().unwrap();
            let r = running.get(&target).ok_or_else(|| {
                AgentError::new(
                    ErrorKind::NotFound,
                    format!("no running exec with request id {target}"),
                )
            })?;
            (r.pgid, r.pty.clone())
        };
        match pty {
            Some(m) => set_size(&m, size).map_err(|e| {
                AgentError::new(
                    ErrorKind::Io,
                    format!("resizing exec {target}'s terminal: {e}"),
                )
            }),
            None if pgid <= 0 => Err(AgentError::new(
                ErrorKind::NotReady,
                format!("exec {target} has not started its process yet; retry"),
            )),
            None => Err(AgentError::new(
                ErrorKind::BadRequest,
                format!("exec {target} has no terminal (start it with pty)"),
            )),
        }
    }

    fn lookup(&self, target: u64) -> Result<(i32, Option<mpsc::Sender<StdinChunk>>), AgentError> {
        let running = self.running.lock().unwrap();
        let r = running.get(&target).ok_or_else(|| {
            AgentError::new(
                ErrorKind::NotFound,
                format!("no running exec with request id {target}"),
            )
        })?;
        Ok((r.pgid, r.stdin.clone()))
    }

    /// Registers exec `id` as soon as its request is decoded, before any
    /// later request is: a `stdin` op that follows it on the channel then
    /// always finds it (requests run concurrently, so the process itself
    /// may start later). Returns the receiving end of its stdin queue.
    pub fn reserve(&self, id: u64, stdin_open: bool) -> Option<StdinQueue> {
        let (tx, rx) = if stdin_open {
            let (tx, rx) = mpsc::channel::<StdinChunk>(16);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        self.running.lock().unwrap().insert(
            id,
            Running {
                pgid: 0,
                stdin: tx,
                pty: None,
                sinks: Arc::default(),
                info: None,
                primary: id,
            },
        );
        rx.map(StdinQueue)
    }

    /// Records that exec `id`'s process runs; returns where its events go.
    fn started(&self, id: u64, pgid: i32, pty: Option<Arc<OwnedFd>>, info: ExecInfo) -> Sinks {
        let mut running = self.running.lock().unwrap();
        match running.get_mut(&id) {
            Some(r) => {
                r.pgid = pgid;
                r.pty = pty;
                r.info = Some(info);
                r.sinks.clone()
            }
            None => Arc::default(),
        }
    }

    /// Forgets exec `id` and every attach following it, once it has
    /// finished (its process group is gone).
    pub fn remove(&self, id: u64) {
        self.running.lock().unwrap().retain(|_, r| r.primary != id);
    }

    /// Makes request `new_id` follow the streaming exec whose process is
    /// `pid`: it gets `started`, then every later event and the final
    /// reply, and becomes a `target` for `stdin`, `resize` and `signal`.
    pub async fn attach(&self, pid: u32, outbox: &Outbox, new_id: u64) -> Result<(), AgentError> {
        let entry = {
            let running = self.running.lock().unwrap();
            running
                .values()
                .find(|r| r.pgid == pid as i32 && r.pgid > 0 && r.info.is_some())
                .cloned()
        };
        let Some(entry) = entry else {
            return Err(AgentError::new(
                ErrorKind::NotFound,
                format!("no running exec with pid {pid} (list_execs names them)"),
            ));
        };
        if !entry.info.as_ref().is_some_and(|i| i.stream) {
            return Err(AgentError::new(
                ErrorKind::BadRequest,
                format!("exec with pid {pid} is not streaming: there is nothing to attach to"),
            ));
        }
        // `started` first, then the events: the sink is added after it.
        outbox
            .send(new_id, Reply::Started { pid }, Bytes::new())
            .await;
        let mut running = self.running.lock().unwrap();
        // It may have ended while `started` was queued: then the attach
        // gets no more frames, and says so.
        if !running.contains_key(&entry.primary) {
            return Err(AgentError::new(
                ErrorKind::NotFound,
                format!("the exec with pid {pid} ended while attaching"),
            ));
        }
        entry.sinks.lock().unwrap().push((outbox.clone(), new_id));
        running.insert(
            new_id,
            Running {
                info: None,
                ..entry
            },
        );
        Ok(())
    }

    /// The running execs (not the attaches following them).
    pub fn list(&self) -> Vec<ExecInfo> {
        let running = self.running.lock().unwrap();
        let mut v: Vec<ExecInfo> = running
            .iter()
            .filter(|(id, r)| **id == r.primary)
            .filter_map(|(id, r)| {
                r.info.clone().map(|mut i| {
                    i.id = *id;
                    i.pid = r.pgid.max(0) as u32;
                    i
                })
            })
            .collect();
        v.sort_by_key(|i| i.id);
        v
    }

    /// The attaches following exec `id` (its sinks past the first).
    fn followers(&self, sinks: &Sinks, id: u64) -> Vec<(Outbox, u64)> {
        sinks
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, i)| *i != id)
            .cloned()
            .collect()
    }
}

/// Output kept for one stream.
#[derive(Default)]
struct Capture {
    data: Vec<u8>,
    total: u64,
    truncated: bool,
}

/// The outcome of a finished exec: the result and, for a non-streaming exec,
/// the captured output.
pub struct Finished {
    /// How the process ended.
    pub result: ExecResult,
    /// Captured stdout, at most `output_limit` bytes.
    pub stdout: Vec<u8>,
    /// Captured stderr, at most `output_limit` bytes.
    pub stderr: Vec<u8>,
    /// Attaches that followed the exec: each is owed the final reply too.
    pub followers: Vec<(Outbox, u64)>,
}

/// Runs `spec` for request `id`. In streaming mode `started` and output events
/// go to `outbox` as they happen; the caller sends the final reply.
/// The exec must have been [`ExecRegistry::reserve`]d; `queue` is what that
/// returned.
pub async fn run(
    id: u64,
    spec: ExecSpec,
    stdin: Bytes,
    queue: Option<StdinQueue>,
    outbox: Outbox,
    registry: Arc<ExecRegistry>,
) -> Result<Finished, AgentError> {
    // A terminal session is interactive: its output is not capped unless
    // asked (the outbox's bounded queue holds the process back instead).
    let default_limit = if spec.pty.is_some() {
        u64::MAX
    } else {
        DEFAULT_OUTPUT_LIMIT
    };
    let limit = spec.output_limit.unwrap_or(default_limit);
    let user = match users::lookup_opt(spec.user.as_deref()) {
        Ok(u) => u,
        Err(e) => {
            registry.remove(id);
            return Err(e);
        }
    };
    let (mut child, pty, info) = match spawn(&spec, user.as_ref()) {
        Ok(c) => c,
        Err(e) => {
            registry.remove(id);
            return Err(e);
        }
    };
    let pid = child.id().unwrap_or(0);
    let started = Instant::now();

    // A terminal's master side, as two files (one reads, one writes, so
    // neither waits for the other).
    let term = match &pty {
        Some(master) => match (pty_file(master), pty_file(master)) {
            (Ok(rd), Ok(wr)) => Some((rd, wr)),
            (Err(e), _) | (_, Err(e)) => {
                kill_group(pid);
                let _ = child.wait().await;
                registry.remove(id);
                return Err(AgentError::io("the terminal", &e));
            }
        },
        None => None,
    };
    let (term_rd, term_wr) = term.unzip();
    match term_wr {
        Some(wr) => feed_stdin(Some(wr), stdin, queue),
        None => feed_stdin(child.stdin.take(), stdin, queue),
    }
    let sinks = registry.started(id, pid as i32, pty.clone(), info);
    // `started` goes out before any output (the readers start after it).
    if spec.stream {
        outbox.send(id, Reply::Started { pid }, Bytes::new()).await;
        sinks.lock().unwrap().push((outbox.clone(), id));
    }

    let stream_to = spec.stream.then(|| sinks.clone());
    let (out, err) = match term_rd {
        // A terminal has one output: stdout and stderr alike.
        Some(rd) => {
            let out = spawn_reader(Some(rd), limit, stream_to.map(|s| (s, true)));
            let none: Option<tokio::fs::File> = None;
            (out, spawn_reader(none, limit, None))
        }
        None => {
            let out = spawn_reader(
                child.stdout.take(),
                limit,
                stream_to.clone().map(|s| (s, true)),
            );
            let err = spawn_reader(child.stderr.take(), limit, stream_to.map(|s| (s, false)));
            (out, err)
        }
    };

    let (status, timed_out) = wait_with_timeout(&mut child, pid, spec.timeout_ms).await;
    let (out, err) = drain(out, err).await;
    // After the output: an attach made until now gets all of it.
    registry.remove(id);
    let followers = registry.followers(&sinks, id);

    let status = status
        .map_err(|e| AgentError::new(ErrorKind::Io, format!("waiting for pid {pid}: {e}")))?;
    let result = ExecResult {
        pid,
        exit_code: status.code(),
        signal: status.signal(),
        timed_out,
        duration_ms: started.elapsed().as_millis() as u64,
        stdout_len: if spec.stream {
            out.total.min(limit)
        } else {
            out.data.len() as u64
        },
        stderr_len: if spec.stream {
            err.total.min(limit)
        } else {
            err.data.len() as u64
        },
        stdout_truncated: out.truncated,
        stderr_truncated: err.truncated,
    };
    Ok(Finished {
        result,
        stdout: out.data,
        stderr: err.data,
        followers,
    })
}

/// Builds and starts the process in its own session (so its process group
/// can be killed as a whole), as `user` when given; with `pty`, on a new
/// terminal whose master side is returned.
fn spawn(
    spec: &ExecSpec,
    user: Option<&User>,
) -> Result<(Child, Option<Arc<OwnedFd>>, ExecInfo), AgentError> {
    if let Some(size) = &spec.pty {
        if !spec.stream {
            return Err(AgentError::new(
                ErrorKind::BadRequest,
                "pty needs a streaming exec (stream: true)",
            ));
        }
        size.validate()
            .map_err(|m| AgentError::new(ErrorKind::BadRequest, m))?;
    }
    let argv = match (&spec.argv, &spec.shell) {
        (Some(argv), None) if !argv.is_empty() => argv.clone(),
        (None, Some(sh)) => vec!["/bin/sh".into(), "-c".into(), sh.clone()],
        (Some(_), None) => return Err(AgentError::new(ErrorKind::BadRequest, "argv is empty")),
        _ => {
            return Err(AgentError::new(
                ErrorKind::BadRequest,
                "set exactly one of argv and shell",
            ))
        }
    };
    let cwd = match (&spec.cwd, user) {
        (Some(c), u) => users::resolve_path(c, u)?,
        (None, Some(u)) => u.home.clone(),
        (None, None) => "/".into(),
    };
    let cwd = cwd.as_str();
    match std::fs::metadata(cwd) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(AgentError::new(
                ErrorKind::NotADirectory,
                format!("cwd {cwd}: not a directory"),
            ))
        }
        Err(e) => return Err(AgentError::io(&format!("cwd {cwd}"), &e)),
    }
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).current_dir(cwd);
    if spec.clear_env {
        cmd.env_clear();
    } else {
        // The base, then what the host installed since (CA bundles).
        cmd.env_clear()
            .envs(BASE_ENV.iter().copied())
            .envs(super::ca::env());
        if let Some(u) = user {
            cmd.env("HOME", &u.home)
                .env("USER", &u.name)
                .env("LOGNAME", &u.name);
        }
    }
    cmd.envs(&spec.env);
    let master = match spec.pty {
        Some(size) => {
            let (master, slave) =
                open_pty(size).map_err(|e| AgentError::io("opening a pseudo-terminal", &e))?;
            // The terminal belongs to whoever runs on it (as login does):
            // programs that check their tty's owner (ssh, sudo, mesg) work.
            if let Some(u) = user {
                std::os::unix::fs::fchown(&slave, Some(u.uid), None)
                    .map_err(|e| AgentError::io("the terminal", &e))?;
            }
            let io = |f: &OwnedFd| {
                f.try_clone()
                    .map(Stdio::from)
                    .map_err(|e| AgentError::io("the terminal", &e))
            };
            cmd.stdin(io(&slave)?)
                .stdout(io(&slave)?)
                .stderr(io(&slave)?);
            Some(Arc::new(master))
        }
        None => {
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            None
        }
    };
    let tty = master.is_some();
    let creds = user.map(|u| (u.uid, u.gid, u.groups.clone()));
    // SAFETY: setsid, ioctl, setgroups, setgid, setuid and sigprocmask are
    // async-signal-safe; `groups` was allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            // The terminal on stdin becomes the new session's controlling one.
            if tty && libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Groups first, while still root; the uid last.
            if let Some((uid, gid, groups)) = &creds {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(*gid) != 0
                    || libc::setuid(*uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            crate::unblock_all_signals()
        });
    }
    let child = cmd.spawn().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => AgentError::new(
            ErrorKind::NotFound,
            format!("command not found: {}", argv[0]),
        ),
        _ => AgentError::io(&argv[0], &e),
    })?;
    // The slave side's copies went with `cmd`: once the process and its
    // children close theirs, reading the master ends (EIO).
    drop(cmd);
    let info = ExecInfo {
        id: 0,
        pid: 0,
        argv,
        stream: spec.stream,
        pty: spec.pty,
        user: user.map(|u| u.name.clone()),
        cwd: cwd.to_string(),
    };
    Ok((child, master, info))
}

/// A new pseudo-terminal of `size`: (master, slave), both close-on-exec (so
/// no other exec inherits one and keeps the terminal open).
fn open_pty(size: PtySize) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use nix::fcntl::OFlag;
    use std::os::fd::{FromRawFd, IntoRawFd};
    use std::os::unix::fs::OpenOptionsExt;
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)?;
    nix::pty::grantpt(&master)?;
    nix::pty::unlockpt(&master)?;
    let name = nix::pty::ptsname_r(&master)?;
    // SAFETY: into_raw_fd hands over sole ownership of an open descriptor.
    let master = unsafe { OwnedFd::from_raw_fd(master.into_raw_fd()) };
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open(&name)?;
    set_size(&master, size)?;
    Ok((master, slave.into()))
}

/// Sets a terminal's size (TIOCSWINSZ on its master side); the kernel
/// sends SIGWINCH to its foreground process group.
fn set_size(master: &OwnedFd, size: PtySize) -> std::io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize from the pointer, which outlives the call.
    let r = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ as _, &ws) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// An async file on a copy of the terminal's master side (one for reading,
/// one for writing, so neither waits for the other).
fn pty_file(master: &OwnedFd) -> std::io::Result<tokio::fs::File> {
    Ok(tokio::fs::File::from_std(std::fs::File::from(
        master.try_clone()?,
    )))
}

/// Writes the initial stdin, then either closes it or keeps a channel open
/// for later `stdin` ops.
fn feed_stdin<W: AsyncWrite + Unpin + Send + 'static>(
    pipe: Option<W>,
    initial: Bytes,
    queue: Option<StdinQueue>,
) {
    let Some(mut pipe) = pipe else { return };
    tokio::spawn(async move {
        if !initial.is_empty()
            && (pipe.write_all(&initial).await.is_err() || pipe.flush().await.is_err())
        {
            return;
        }
        let Some(StdinQueue(mut rx)) = queue else {
            return;
        };
        while let Some(chunk) = rx.recv().await {
            match chunk {
                StdinChunk::Data(d) => {
                    if pipe.write_all(&d).await.is_err() || pipe.flush().await.is_err() {
                        return;
                    }
                }
                StdinChunk::Eof => return,
            }
        }
    });
}

type Reader = (tokio::task::JoinHandle<()>, Arc<Mutex<Capture>>);

/// Reads one output pipe into a capture, or streams it to the sinks when
/// `stream` is set (true: as stdout).
fn spawn_reader<R: AsyncRead + Unpin + Send + 'static>(
    pipe: Option<R>,
    limit: u64,
    stream: Option<(Sinks, bool)>,
) -> Reader {
    let cap = Arc::new(Mutex::new(Capture::default()));
    let c = cap.clone();
    let handle = tokio::spawn(async move {
        let Some(mut pipe) = pipe else { return };
        let mut buf = vec![0u8; STREAM_CHUNK];
        loop {
            let n = match pipe.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let keep = {
                let mut c = c.lock().unwrap();
                let room = limit.saturating_sub(c.total) as usize;
                let keep = n.min(room);
                c.total += n as u64;
                c.truncated |= keep < n;
                if stream.is_none() {
                    c.data.extend_from_slice(&buf[..keep]);
                }
                keep
            };
            if let (Some((sinks, is_stdout)), true) = (&stream, keep > 0) {
                let chunk = Bytes::copy_from_slice(&buf[..keep]);
                let to = sinks.lock().unwrap().clone();
                for (outbox, id) in to {
                    let ev = if *is_stdout {
                        Reply::Stdout
                    } else {
                        Reply::Stderr
                    };
                    outbox.send(id, ev, chunk.clone()).await;
                }
            }
        }
    });
    (handle, cap)
}

/// Waits for the process; on timeout kills its whole process group.
async fn wait_with_timeout(
    child: &mut Child,
    pid: u32,
    timeout_ms: Option<u64>,
) -> (std::io::Result<std::process::ExitStatus>, bool) {
    let Some(ms) = timeout_ms else {
        return (child.wait().await, false);
    };
    match tokio::time::timeout(Duration::from_millis(ms), child.wait()).await {
        Ok(status) => (status, false),
        Err(_) => {
            kill_group(pid);
            (child.wait().await, true)
        }
    }
}

/// SIGKILLs the process group led by `pid`.
pub fn kill_group(pid: u32) {
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Waits (bounded) for both pipes to reach EOF and returns what was captured.
async fn drain(out: Reader, err: Reader) -> (Capture, Capture) {
    let (oh, oc) = out;
    let (eh, ec) = err;
    let both = async {
        let _ = oh.await;
        let _ = eh.await;
    };
    let _ = tokio::time::timeout(PIPE_GRACE, both).await;
    let take = |c: Arc<Mutex<Capture>>| std::mem::take(&mut *c.lock().unwrap());
    (take(oc), take(ec))
}
