//! What runs in a sandbox: commands (collected, streamed, or on a
//! terminal), evaluations in the warm interpreter, files, the console.
//! Every call goes to the sandbox's guest agent (docs/agent-protocol.md),
//! whose failures arrive as [`Error::Guest`] (with the agent's kind),
//! [`Error::GuestTimeout`] or [`Error::GuestUnreachable`].
//!
//! Invariants:
//! - a sandbox's create-time envs (`SandboxRecord::envs`) are set for
//!   every command it runs, under each call's own (a call's value for the
//!   same name wins); evaluations run in the warm interpreter, whose
//!   environment was fixed when the snapshot was taken, so they get none;
//! - no request moves more than [`MAX_FILE_BYTES`] of file content;
//! - a streamed process is reached only through its [`Process`]: its
//!   events, and a [`ProcessControl`] for input, signals and resizes.

use crate::error::{Error, Result};
use crate::limits::{LOG_TAIL_BYTES, MAX_FILE_BYTES};
use crate::node::Node;
use crate::sandbox::Sandbox;
use bytes::Bytes;
use forkd_vmm::AgentClient;
pub use rootfs_init::protocol::metadata::Metadata;
pub use rootfs_init::protocol::EntryInfo;
use rootfs_init::protocol::Reply;
pub use rootfs_init::protocol::{
    EvalResult, ExecResult, ExecSpec, FileStat, ListResult, PingResult, PtySize, WriteHow,
};
use std::time::Duration;

/// A command's collected output.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    /// How it ended.
    pub result: ExecResult,
    pub stdout: Bytes,
    pub stderr: Bytes,
}

/// Part of a file, and the whole file's size.
#[derive(Debug, Clone)]
pub struct FileRead {
    /// The whole file's size.
    pub size: u64,
    /// The bytes read.
    pub bytes: Bytes,
}

/// A guest path a caller names must be absolute and free of NUL.
pub fn check_path(p: &str) -> Result<()> {
    if !p.starts_with('/') || p.contains('\0') {
        return Err(Error::invalid(
            "path",
            format!("path {p:?} must be absolute (start with '/') and contain no NUL"),
        ));
    }
    Ok(())
}

/// `spec` with the sandbox's create-time envs under its own.
fn with_envs(sb: &Sandbox, mut spec: ExecSpec) -> ExecSpec {
    let mut env = sb.record().envs;
    if !env.is_empty() {
        env.extend(std::mem::take(&mut spec.env));
        spec.env = env;
    }
    spec
}

/// The agent's version, uptime and warm interpreter, within 5 s.
pub(crate) async fn ping(n: &Node, id: &str) -> Result<PingResult> {
    let sb = n.sandbox(id)?;
    Ok(sb.agent().ping(Duration::from_secs(5)).await?)
}

/// Runs a command to its end and collects its output.
pub(crate) async fn exec(n: &Node, id: &str, spec: ExecSpec, stdin: &[u8]) -> Result<ExecOutput> {
    let sb = n.sandbox(id)?;
    let out = sb.agent().exec(with_envs(&sb, spec), stdin).await?;
    Ok(ExecOutput {
        result: out.result,
        stdout: out.stdout,
        stderr: out.stderr,
    })
}

/// Starts a command whose events stream as they come.
pub(crate) fn exec_stream(n: &Node, id: &str, spec: ExecSpec, stdin: &[u8]) -> Result<Process> {
    let sb = n.sandbox(id)?;
    Process::start(sb.agent().clone(), with_envs(&sb, spec), stdin)
}

/// [`exec_stream`] as `spec.user` (when set), after checking the agent
/// supports users: an older agent would run the command as root.
pub(crate) async fn exec_stream_as(
    n: &Node,
    id: &str,
    spec: ExecSpec,
    stdin: &[u8],
) -> Result<Process> {
    let sb = n.sandbox(id)?;
    let spec = with_envs(&sb, spec);
    let agent = sb.agent().clone();
    let (target, events) = agent.exec_stream_as(spec, stdin).await?;
    Ok(Process {
        control: ProcessControl { agent, target },
        events,
    })
}

/// A TCP connection to `port` on the guest's loopback, over the agent
/// channel (the agent's `not_found` when nothing listens there).
pub(crate) async fn open_tunnel(n: &Node, id: &str, port: u16) -> Result<forkd_vmm::Tunnel> {
    let sb = n.sandbox(id)?;
    Ok(sb.agent().open_tunnel(port).await?)
}

/// Watches directory `path` (and, `recursive`, its tree) in the guest
/// until the returned watch is stopped or dropped.
pub(crate) async fn watch_dir(
    n: &Node,
    id: &str,
    path: &str,
    recursive: bool,
    user: Option<&str>,
) -> Result<forkd_vmm::Watch> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    Ok(sb.agent().watch(path, user, recursive).await?)
}

/// Evaluates `code` in the warm interpreter (`timeout_ms`: the agent's
/// deadline; 5 minutes when `None`).
pub(crate) async fn eval(
    n: &Node,
    id: &str,
    code: &str,
    timeout_ms: Option<u64>,
) -> Result<EvalResult> {
    let sb = n.sandbox(id)?;
    Ok(sb.agent().eval(code, timeout_ms).await?)
}

/// Reads `len` bytes of `path` from `offset`; without `len`, the rest of
/// the file, which must fit in [`MAX_FILE_BYTES`] ([`Error::TooLarge`]).
pub(crate) async fn read_file(
    n: &Node,
    id: &str,
    path: &str,
    offset: u64,
    len: Option<u64>,
    user: Option<&str>,
) -> Result<FileRead> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    let max = MAX_FILE_BYTES as u64;
    let (r, bytes) = sb
        .agent()
        .read_file_as(path, offset, Some(len.unwrap_or(max).min(max)), user)
        .await?;
    if len.is_none() && r.size > offset + r.len {
        return Err(Error::TooLarge {
            what: path.to_string(),
            size: r.size,
            limit: max,
        });
    }
    Ok(FileRead {
        size: r.size,
        bytes,
    })
}

/// How a file is written ([`crate::Node::write_file_as`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteAs<'a> {
    /// Atomically, appended, or in place (as E2B's envd writes).
    pub how: WriteHow,
    /// Permission bits of a new file, or to set on an existing one.
    pub mode: Option<u32>,
    /// The guest account that owns what the write makes and whose home a
    /// relative path is under (None: root).
    pub user: Option<&'a str>,
    /// The file's whole metadata set after the write (None: as it was);
    /// refused by a guest agent that predates metadata.
    pub metadata: Option<&'a Metadata>,
}

/// Writes `data` to `path` as `as_` says, creating its parents; its stat
/// after.
pub(crate) async fn write_file(
    n: &Node,
    id: &str,
    path: &str,
    data: &[u8],
    as_: WriteAs<'_>,
) -> Result<FileStat> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    let WriteAs {
        how,
        mode,
        user,
        metadata,
    } = as_;
    Ok(sb
        .agent()
        .write_file_as(path, data, mode, how, user, metadata)
        .await?)
}

/// Removes a file or an empty directory; a whole tree when `recursive`.
pub(crate) async fn remove(
    n: &Node,
    id: &str,
    path: &str,
    recursive: bool,
    user: Option<&str>,
) -> Result<()> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    Ok(sb.agent().remove_as(path, recursive, user).await?)
}

/// The entries of a directory.
pub(crate) async fn list_dir(n: &Node, id: &str, path: &str) -> Result<ListResult> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    Ok(sb.agent().list(path).await?)
}

/// A path's stat.
pub(crate) async fn stat(n: &Node, id: &str, path: &str) -> Result<FileStat> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    Ok(sb.agent().stat(path).await?)
}

/// Makes a directory (and its missing parents when `parents`); its stat.
pub(crate) async fn mkdir(
    n: &Node,
    id: &str,
    path: &str,
    parents: bool,
    user: Option<&str>,
) -> Result<FileStat> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    Ok(sb.agent().mkdir_as(path, parents, user).await?)
}

/// Everything about a path (owner names, symlink target), as `user` sees
/// relative paths.
pub(crate) async fn entry(n: &Node, id: &str, path: &str, user: Option<&str>) -> Result<EntryInfo> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    Ok(sb.agent().entry(path, user).await?)
}

/// [`entry`] of everything under a directory, `depth` levels down.
pub(crate) async fn list_entries(
    n: &Node,
    id: &str,
    path: &str,
    depth: u32,
    user: Option<&str>,
) -> Result<Vec<EntryInfo>> {
    check_path(path)?;
    let sb = n.sandbox(id)?;
    Ok(sb.agent().list_entries(path, depth, user).await?)
}

/// The guest console since the sandbox started: its last [`LOG_TAIL_BYTES`].
pub(crate) fn logs(n: &Node, id: &str) -> Result<Vec<u8>> {
    let sb = n.sandbox(id)?;
    Ok(tail_bytes(&sb.console(), LOG_TAIL_BYTES))
}

/// The last `max` bytes of a file (empty if it cannot be read).
fn tail_bytes(path: &std::path::Path, max: u64) -> Vec<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut out = Vec::new();
    let _ = f.take(max).read_to_end(&mut out);
    out
}

/// The default terminal program: a login shell, bash where the image has it.
const DEFAULT_SHELL: &str = "if [ -x /bin/bash ]; then exec /bin/bash -l; else exec /bin/sh -l; fi";

/// A terminal session asked for.
#[derive(Debug, Clone, Default)]
pub struct PtyRequest {
    /// A shell command (`/bin/sh -c`); default a login shell.
    pub cmd: Option<String>,
    /// Working directory, an absolute guest path.
    pub cwd: Option<String>,
    /// Terminal rows, 1..=4096 (default 24).
    pub rows: Option<u16>,
    /// Terminal columns, 1..=4096 (default 80).
    pub cols: Option<u16>,
}

/// A terminal session checked and ready to start (see [`pty`]).
pub struct PendingPty {
    agent: AgentClient,
    spec: ExecSpec,
}

impl PendingPty {
    /// Starts the session's process.
    pub fn start(self) -> Result<Process> {
        Process::start(self.agent, self.spec, &[])
    }
}

/// Checks a terminal session for sandbox `id`; it starts when the caller
/// is ready for its events ([`PendingPty::start`]).
pub(crate) fn pty(n: &Node, id: &str, req: PtyRequest) -> Result<PendingPty> {
    let sb = n.sandbox(id)?;
    let size = PtySize {
        rows: req.rows.unwrap_or(24),
        cols: req.cols.unwrap_or(80),
    };
    size.validate().map_err(|e| Error::invalid("rows", e))?;
    if req.cwd.as_deref().is_some_and(|c| !c.starts_with('/')) {
        return Err(Error::invalid("cwd", "cwd must be an absolute guest path"));
    }
    let spec = ExecSpec {
        shell: Some(req.cmd.unwrap_or_else(|| DEFAULT_SHELL.into())),
        cwd: req.cwd,
        pty: Some(size),
        stream: true,
        stdin_open: true,
        ..Default::default()
    };
    Ok(PendingPty {
        agent: sb.agent().clone(),
        spec: with_envs(&sb, spec),
    })
}

/// One event of a streamed process.
#[derive(Debug)]
pub enum ExecEvent {
    /// It started, with this pid in the guest.
    Started { pid: u32 },
    /// Output on stdout (on a terminal: all output).
    Stdout(Bytes),
    /// Output on stderr.
    Stderr(Bytes),
    /// It ended. The last event.
    Exited(ExecResult),
    /// It could not be followed to its end. The last event.
    Failed(Error),
}

/// A streamed process: its events, and its [`ProcessControl`].
pub struct Process {
    control: ProcessControl,
    events: forkd_vmm::Events,
}

/// Input, signals and resizes for a streamed process; cheap to clone.
#[derive(Clone)]
pub struct ProcessControl {
    agent: AgentClient,
    target: u64,
}

impl Process {
    fn start(agent: AgentClient, spec: ExecSpec, stdin: &[u8]) -> Result<Process> {
        let (target, events) = agent.exec_stream(spec, stdin)?;
        Ok(Process {
            control: ProcessControl { agent, target },
            events,
        })
    }

    /// The process's control.
    pub fn control(&self) -> ProcessControl {
        self.control.clone()
    }

    /// The next event; `None` once the agent's channel closed without an
    /// end (the sandbox is gone).
    pub async fn next(&mut self) -> Option<ExecEvent> {
        let (reply, payload) = self.events.recv().await?;
        Some(match reply {
            Reply::Started { pid } => ExecEvent::Started { pid },
            Reply::Stdout => ExecEvent::Stdout(payload),
            Reply::Stderr => ExecEvent::Stderr(payload),
            Reply::Ok { result } => {
                ExecEvent::Exited(serde_json::from_value(result).unwrap_or_default())
            }
            Reply::Error { error } => ExecEvent::Failed(Error::Guest(error)),
            Reply::Watch { .. } => {
                ExecEvent::Failed(Error::Guest(rootfs_init::protocol::AgentError::new(
                    rootfs_init::protocol::ErrorKind::Internal,
                    "the agent sent watch events for a process",
                )))
            }
        })
    }
}

impl ProcessControl {
    /// Writes `data` to its stdin, then closes it when `eof`.
    pub async fn stdin(&self, data: &[u8], eof: bool) -> Result<()> {
        Ok(self.agent.stdin(self.target, data, eof).await?)
    }

    /// Sends `signal` to its process group.
    pub async fn signal(&self, signal: i32) -> Result<()> {
        Ok(self.agent.signal(self.target, signal).await?)
    }

    /// Changes its terminal's size.
    pub async fn resize(&self, size: PtySize) -> Result<()> {
        Ok(self.agent.resize(self.target, size).await?)
    }
}
