//! Messages carried in frame headers (JSON) between the host and forkd-agent.
//!
//! Every request carries an `id` chosen by the host; every reply and stream
//! event carries the id of the request it belongs to, so many requests can be in
//! flight on one channel. Bulk data (stdin, stdout, file contents, entropy)
//! travels in the frame payload, never inside the JSON.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Version of this protocol, reported by `ping`. Bump on incompatible changes.
/// 2 added users, `entry`/`list_entries`, tunnels, `attach` and `list_execs`
/// (each also named in [`PingResult::features`]); a version-1 host never
/// sends them, and a version-2 host checks the features before it does.
pub const PROTOCOL_VERSION: u32 = 2;

/// [`PingResult::features`]: `user` on exec and the file ops, `entry` and
/// `list_entries`. An agent without it would ignore `user` and run as root,
/// so a host must not send `user` to it.
pub const FEATURE_USERS: &str = "users";
/// [`PingResult::features`]: `tunnel_open`, `tunnel_data`, `tunnel_ack`, `tunnel_close`.
pub const FEATURE_TUNNEL: &str = "tunnel";
/// [`PingResult::features`]: `attach` and `list_execs`.
pub const FEATURE_ATTACH: &str = "attach";
/// [`PingResult::features`]: `watch` and `unwatch`.
pub const FEATURE_WATCH: &str = "watch";
/// [`PingResult::features`]: `metadata` on `write_file` and in
/// [`EntryInfo`] ([`super::metadata`]). An agent without it would ignore
/// the field, so a host must not send metadata to it.
pub const FEATURE_METADATA: &str = "metadata";
/// Every feature this protocol version defines, as an agent of it reports them.
pub const FEATURES: &[&str] = &[
    FEATURE_USERS,
    FEATURE_TUNNEL,
    FEATURE_ATTACH,
    FEATURE_WATCH,
    FEATURE_METADATA,
];

/// Name of the virtio-serial port the agent listens on.
pub const AGENT_PORT_NAME: &str = "org.forkd.agent";

/// Header of every host→agent frame.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RequestHeader {
    /// Chosen by the host, unique among its requests in flight; replies carry it back.
    pub id: u64,
    /// The operation and its arguments (flattened: `"op"` plus its fields).
    #[serde(flatten)]
    pub op: Op,
}

/// What the host asks the agent to do. The frame payload's meaning depends on
/// the op (documented per variant).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Liveness and status. Reply: [`PingResult`].
    Ping,
    /// Run a process. Payload: stdin bytes (closed after them unless
    /// `stdin_open` is set on a streaming exec). Reply: [`ExecResult`]; for a
    /// non-streaming exec the reply payload is stdout followed by stderr.
    Exec(ExecSpec),
    /// More stdin for a running streaming exec `target`. Payload: the bytes.
    Stdin {
        /// Request id of the streaming exec.
        target: u64,
        /// Close the process's stdin after these bytes.
        #[serde(default)]
        eof: bool,
    },
    /// Change the terminal size of running PTY exec `target` (its
    /// foreground process group gets SIGWINCH).
    Resize {
        /// Request id of the PTY exec.
        target: u64,
        /// The new size.
        #[serde(flatten)]
        size: PtySize,
    },
    /// Send `signal` to the process group of running exec `target`.
    Signal {
        /// Request id of the running exec.
        target: u64,
        /// Signal number (e.g. 15 for SIGTERM).
        signal: i32,
    },
    /// Evaluate Python in the warm interpreter. Reply: [`EvalResult`].
    Eval(EvalSpec),
    /// Read up to `len` bytes at `offset`. Reply: [`ReadResult`], payload = bytes.
    ReadFile {
        /// Guest path: absolute, or relative to `user`'s home when `user` is set.
        path: String,
        /// Resolve a relative path (or `~/...`) against this user's home.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Where to start reading.
        #[serde(default)]
        offset: u64,
        /// Most bytes to read; None: to the end (within the frame limit).
        #[serde(default)]
        len: Option<u64>,
    },
    /// Write the payload to `path`: atomically (temp file + rename) unless
    /// `append`. Reply: [`FileStat`] of the result.
    WriteFile {
        /// Guest path: absolute, or relative to `user`'s home when `user` is set.
        path: String,
        /// Owner of what the write creates (the file when it is new or
        /// replaced, missing parent directories): a user name or uid. None:
        /// root, as before. Also resolves a relative path against the home.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Permission bits for a new file (default 0o644).
        #[serde(default)]
        mode: Option<u32>,
        /// Append to the file instead of replacing it.
        #[serde(default)]
        append: bool,
        /// Replace the contents in place (truncate and write, as E2B's
        /// envd does: a watcher sees a write of the file itself, hard
        /// links see the new contents) instead of atomically. An agent
        /// before this field writes atomically.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        in_place: bool,
        /// Create missing parent directories.
        #[serde(default)]
        create_parents: bool,
        /// Replace the file's metadata with this set (empty: clear it), as
        /// E2B's envd does on every upload; None leaves it as it is.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        metadata: Option<super::metadata::Metadata>,
    },
    /// Directory listing. Reply: [`ListResult`].
    ListDir {
        /// Absolute guest path of the directory.
        path: String,
    },
    /// Metadata (does not follow a final symlink). Reply: [`FileStat`].
    Stat {
        /// Absolute guest path.
        path: String,
    },
    /// Everything a file manager (or E2B's envd) reports about one path:
    /// owner and group names, nanosecond mtime, the resolved target of a
    /// symlink and its kind. Reply: [`EntryInfo`].
    Entry {
        /// Guest path: absolute, or relative to `user`'s home when `user` is set.
        path: String,
        /// Resolve a relative path against this user's home.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
    },
    /// [`EntryInfo`] of every entry of a directory, down to `depth` levels
    /// (1: the directory's own entries). Reply: [`EntryList`].
    ListEntries {
        /// Guest path of the directory: absolute, or relative to `user`'s home.
        path: String,
        /// Levels to descend, 1..=[`MAX_LIST_DEPTH`] (default 1).
        #[serde(default = "one")]
        depth: u32,
        /// Resolve a relative path against this user's home.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
    },
    /// Create a directory (`parents` = `mkdir -p`). Reply: [`FileStat`].
    Mkdir {
        /// Guest path: absolute, or relative to `user`'s home when `user` is set.
        path: String,
        /// Owner of the directories created (a user name or uid); None: root.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Permission bits (default 0o755).
        #[serde(default)]
        mode: Option<u32>,
        /// Create missing parents; an existing directory is not an error.
        #[serde(default)]
        parents: bool,
    },
    /// Remove a file, symlink or empty directory (`recursive` removes trees).
    Remove {
        /// Guest path: absolute, or relative to `user`'s home when `user` is set.
        path: String,
        /// Resolve a relative path against this user's home.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Remove a directory with everything in it.
        #[serde(default)]
        recursive: bool,
    },
    /// Give a freshly forked child its own identity. Payload: entropy bytes
    /// from the host. Reply: [`IdentityResult`].
    Identity(IdentitySpec),
    /// Stop everything and power the VM off (or reboot).
    Shutdown {
        /// Reboot instead of powering off.
        #[serde(default)]
        reboot: bool,
    },
    /// Open a TCP connection to `port` on the guest's loopback and carry
    /// its bytes over this channel (docs/agent-protocol.md, "tunnels").
    /// Replies: `started` (pid 0) once connected; `stdout` events with the
    /// bytes the guest side sends (a zero-length one: its end of stream);
    /// a final `ok` ([`TunnelResult`]) once both directions are closed, or
    /// `error`.
    TunnelOpen {
        /// The guest port (127.0.0.1, else ::1).
        port: u16,
        /// Bytes the agent may send before the host acknowledges them
        /// (`tunnel_ack`), 1..=[`MAX_TUNNEL_WINDOW`].
        window: u32,
    },
    /// Bytes for tunnel `target` (the payload), then its write side closed
    /// when `eof`. Reply: `ok` once the bytes are written to the socket
    /// (the host keeps at most a window of bytes unanswered).
    TunnelData {
        /// Request id of the `tunnel_open`.
        target: u64,
        /// Shut the connection's write side down after these bytes.
        #[serde(default)]
        eof: bool,
    },
    /// The host has consumed `bytes` of tunnel `target`'s data: the agent
    /// may send that many more. The one op without a reply.
    TunnelAck {
        /// Request id of the `tunnel_open`.
        target: u64,
        /// Bytes consumed since the last ack.
        bytes: u32,
    },
    /// Abort tunnel `target`: the connection is closed in both directions
    /// at once (its final reply still goes to the `tunnel_open` id).
    /// Reply: `ok`.
    TunnelClose {
        /// Request id of the `tunnel_open`.
        target: u64,
    },
    /// Follow a running streaming exec from this request too (a host that
    /// reconnected, a second viewer of a terminal): `started` with its pid,
    /// then its output events and its final reply. This request's id is
    /// then also a `target` for `stdin`, `resize` and `signal`.
    Attach {
        /// Pid of the exec's process (from `started` or `list_execs`).
        pid: u32,
    },
    /// The running execs. Reply: [`ExecList`].
    ListExecs,
    /// Watch a directory (`recursive`: and every directory under it, as
    /// they appear) with inotify (docs/agent-protocol.md, "watch").
    /// Replies: `started` (pid 0) once the watches are in place, then
    /// `watch` events, then a final `ok` ([`WatchResult`]) after `unwatch`,
    /// or when the directory itself is removed; `error` if it cannot start.
    Watch {
        /// Guest path of the directory: absolute, or relative to `user`'s home.
        path: String,
        /// Resolve a relative path against this user's home.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Watch every directory under `path` too.
        #[serde(default)]
        recursive: bool,
    },
    /// End watch `target` (its final `ok` goes to the `watch` id).
    /// Reply: `ok`, or `not_found` for a watch that is not running.
    Unwatch {
        /// Request id of the `watch`.
        target: u64,
    },
}

fn one() -> u32 {
    1
}

/// Deepest `list_entries`.
pub const MAX_LIST_DEPTH: u32 = 16;
/// Most entries one `list_entries` returns.
pub const MAX_LIST_ENTRIES: usize = 10_000;
/// Largest tunnel window.
pub const MAX_TUNNEL_WINDOW: u32 = 4 << 20;
/// Largest `stdout` event of a tunnel, and of one `tunnel_data` payload.
pub const TUNNEL_CHUNK: usize = 64 * 1024;
/// Most watches one agent runs at once (each is an inotify instance; the
/// kernel's default per-user limit is 128).
pub const MAX_WATCHES: usize = 32;
/// Most directories one recursive watch covers.
pub const MAX_WATCHED_DIRS: usize = 8192;
/// Most events in one `watch` frame.
pub const WATCH_BATCH: usize = 64;

/// How a file write puts its bytes in place (`write_file`'s `append` and
/// `in_place`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WriteHow {
    /// A new file renamed over the old one: readers see the old contents
    /// or the new, never a part.
    #[default]
    Atomic,
    /// Added at the end of the file.
    Append,
    /// The file truncated and written (E2B's envd).
    InPlace,
}

/// A process to run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ExecSpec {
    /// argv; exactly one of `argv` and `shell` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// A command for `/bin/sh -c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    /// Extra environment (added to the agent's base environment).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Start from an empty environment instead of the base one.
    #[serde(default)]
    pub clear_env: bool,
    /// Working directory (absolute); default `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Kill the whole process group after this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Cap on bytes kept per output stream; the rest is discarded and the
    /// result says it was truncated. Default [`DEFAULT_OUTPUT_LIMIT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_limit: Option<u64>,
    /// Deliver output as `stdout`/`stderr` events while the process runs.
    #[serde(default)]
    pub stream: bool,
    /// Streaming only: keep stdin open for later `stdin` ops.
    #[serde(default)]
    pub stdin_open: bool,
    /// Streaming only: run the process on a new pseudo-terminal of this
    /// size, its controlling terminal in a new session. Its output (stdout
    /// and stderr alike) arrives as `stdout` events; `stdin` ops are typed
    /// into it (stdin stays open); `resize` changes its size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// Run as this user (a name from the guest's /etc/passwd, or a uid):
    /// its uid, primary gid and supplementary groups; HOME, USER and
    /// LOGNAME from its entry (the request's `env` still wins); `cwd`
    /// defaults to its home. None: root, as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct PtySize {
    /// Rows, 1..=[`MAX_PTY_CELLS`].
    pub rows: u16,
    /// Columns, 1..=[`MAX_PTY_CELLS`].
    pub cols: u16,
}

/// Largest number of rows or columns a pseudo-terminal may have.
pub const MAX_PTY_CELLS: u16 = 4096;

impl PtySize {
    /// Refuses a zero or absurd size.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_PTY_CELLS).contains(&self.rows) || !(1..=MAX_PTY_CELLS).contains(&self.cols) {
            return Err(format!(
                "terminal size {}x{} (rows x cols): each must be in 1..={MAX_PTY_CELLS}",
                self.rows, self.cols
            ));
        }
        Ok(())
    }
}

/// Default per-stream output cap for exec.
pub const DEFAULT_OUTPUT_LIMIT: u64 = 8 << 20;
/// Largest output cap a caller may ask for in a non-streaming exec (the reply
/// payload carries both streams).
pub const MAX_BUFFERED_OUTPUT_LIMIT: u64 = 15 << 20;

/// Python to evaluate in the persistent warm interpreter.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EvalSpec {
    /// Python source: statements and/or a final expression.
    pub code: String,
    /// Give up after this many ms; the interpreter is then restarted and its state lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// Identity for a forked child.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct IdentitySpec {
    /// Host wall clock, nanoseconds since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unix_time_ns: Option<u64>,
    /// New hostname for the child (set with sethostname).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Reseed the warm interpreter's `random` (and numpy's global RNG).
    #[serde(default)]
    pub reseed_interpreter: bool,
    /// Nameservers for `/etc/resolv.conf` (a networked child's DNS, from the
    /// host's upstream resolvers); the file is replaced when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nameservers: Option<Vec<std::net::Ipv4Addr>>,
    /// Extra CA certificates the guest trusts from now on: PEM text of
    /// `CERTIFICATE` blocks only (the host has parsed each one), at most
    /// [`MAX_CA_CERTS_BYTES`]. Added to the system store and named by the
    /// variables Python, requests, pip and Node read, for every later exec
    /// (docs/agent-protocol.md, "identity").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_certs: Option<String>,
}

/// Largest `ca_certs` an `identity` request may carry (a host's whole CA
/// bundle is ~220 KiB); it travels in the frame header.
pub const MAX_CA_CERTS_BYTES: usize = 512 << 10;

/// Header of every agent→host frame.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReplyHeader {
    /// Id of the request this frame answers.
    pub id: u64,
    /// The reply or event (flattened: `"type"` plus its fields).
    #[serde(flatten)]
    pub body: Reply,
}

/// A reply or a stream event for request `id`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    /// Final success; `result` is the op's result type as JSON.
    Ok {
        /// The op's result, as JSON.
        #[serde(default)]
        result: serde_json::Value,
    },
    /// Final failure.
    Error {
        /// Why it failed.
        error: AgentError,
    },
    /// Streaming exec started.
    Started {
        /// Pid of the process in the guest.
        pid: u32,
    },
    /// Streaming exec output; payload is the chunk.
    Stdout,
    /// Streaming exec error output; payload is the chunk.
    Stderr,
    /// Events of a running `watch`, in the order they happened.
    Watch {
        /// At most [`WATCH_BATCH`].
        events: Vec<WatchEvent>,
        /// Events were lost before these: the kernel's queue overflowed
        /// (`IN_Q_OVERFLOW`), or a new directory of a recursive watch
        /// could not be watched.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        lost: bool,
    },
}

impl Reply {
    /// True when no more frames follow for this request.
    pub fn is_final(&self) -> bool {
        matches!(self, Reply::Ok { .. } | Reply::Error { .. })
    }
}

/// A failed request, with a kind a program can branch on and a message a
/// person can act on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct AgentError {
    /// What went wrong, for programs.
    pub kind: ErrorKind,
    /// What went wrong, for people (names the path or exec where there is one).
    pub message: String,
}

impl AgentError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        AgentError {
            kind,
            message: message.into(),
        }
    }

    /// Maps an I/O error on `path` to a kind and a message naming the path.
    pub fn io(path: &str, err: &std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        let kind = match err.kind() {
            K::NotFound => ErrorKind::NotFound,
            K::PermissionDenied => ErrorKind::PermissionDenied,
            K::AlreadyExists => ErrorKind::AlreadyExists,
            K::NotADirectory => ErrorKind::NotADirectory,
            K::IsADirectory => ErrorKind::IsADirectory,
            K::DirectoryNotEmpty => ErrorKind::DirectoryNotEmpty,
            K::InvalidInput => ErrorKind::BadRequest,
            _ => ErrorKind::Io,
        };
        AgentError::new(kind, format!("{path}: {err}"))
    }
}

/// Class of an [`AgentError`], stable on the wire (snake_case).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request is malformed or its arguments invalid.
    BadRequest,
    /// The path (or exec target) does not exist.
    NotFound,
    /// The guest refused access (EACCES/EPERM).
    PermissionDenied,
    /// The path exists already.
    AlreadyExists,
    /// A path component is not a directory.
    NotADirectory,
    /// A directory where a file was wanted.
    IsADirectory,
    /// The directory to remove is not empty (and not `recursive`).
    DirectoryNotEmpty,
    /// The operation ran out of time.
    Timeout,
    /// Any other I/O error.
    Io,
    /// Not possible yet (the warm interpreter is down, the exec has not started); retry.
    NotReady,
    /// The agent does not know this op.
    Unsupported,
    /// A bug or broken state in the agent.
    Internal,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = serde_json::to_value(self).map_err(|_| std::fmt::Error)?;
        f.write_str(v.as_str().unwrap_or("error"))
    }
}

/// Reply to `ping`: the agent's version, uptime and warm interpreter.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PingResult {
    /// forkd-agent's version (its crate version).
    pub agent_version: String,
    /// The [`PROTOCOL_VERSION`] the agent speaks.
    pub protocol: u32,
    /// Time since the agent started, ms.
    pub uptime_ms: u64,
    /// The guest's hostname now.
    pub hostname: String,
    /// The warm interpreter has started and finished its warm-up imports.
    pub warm_ready: bool,
    /// Why the warm interpreter is not available, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_error: Option<String>,
    /// Pid of the warm interpreter's process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_pid: Option<u32>,
    /// Python version of the warm interpreter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python_version: Option<String>,
    /// numpy version, when the image has numpy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numpy_version: Option<String>,
    /// The warm interpreter's language, forkd's `agent_lang` (`"python"`
    /// or `"node"`); absent from older agents, which are Python.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_lang: Option<String>,
    /// Node's version, when the warm interpreter is Node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_version: Option<String>,
    /// What this agent understands beyond version 1 ([`FEATURES`]); empty
    /// from older agents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

impl PingResult {
    /// Whether the agent reported `feature`.
    pub fn has(&self, feature: &str) -> bool {
        self.features.iter().any(|f| f == feature)
    }
}

/// Reply to `exec`: how the process ended and how much output there is.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ExecResult {
    /// Pid of the process in the guest.
    pub pid: u32,
    /// Exit status when the process exited normally.
    pub exit_code: Option<i32>,
    /// Signal number when the process was killed by a signal.
    pub signal: Option<i32>,
    /// The timeout elapsed and the process group was killed.
    pub timed_out: bool,
    /// From spawn to exit, ms.
    pub duration_ms: u64,
    /// Non-streaming exec: the reply payload is `stdout_len` bytes of stdout
    /// followed by `stderr_len` bytes of stderr. Streaming: bytes delivered.
    pub stdout_len: u64,
    /// Bytes of stderr in the payload (or delivered, streaming).
    pub stderr_len: u64,
    /// Stdout went over `output_limit`; the rest was discarded.
    pub stdout_truncated: bool,
    /// Stderr went over `output_limit`; the rest was discarded.
    pub stderr_truncated: bool,
}

impl ExecResult {
    /// Shell-style status: the exit code, or 128 + signal.
    pub fn status_code(&self) -> i32 {
        match (self.exit_code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => -1,
        }
    }
}

/// Reply to `eval`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EvalResult {
    /// `repr()` of the value of the last expression, if the code ended in one
    /// (Node: `util.inspect()` of the completion value).
    pub result: Option<String>,
    /// Node only: `JSON.stringify()` of the completion value, when it has a
    /// JSON form (forkd's Node-mode `result_json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_json: Option<String>,
    /// `"<Type>: <message>"` when the code raised.
    pub error: Option<String>,
    /// Python's formatted traceback when the code raised.
    pub traceback: Option<String>,
    /// What the code printed.
    pub stdout: String,
    /// What the code wrote to stderr.
    pub stderr: String,
    /// Evaluation time in the interpreter, ms.
    pub duration_ms: u64,
}

/// Reply to `read_file`; the payload holds the bytes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ReadResult {
    /// Size of the whole file.
    pub size: u64,
    /// Offset of the first byte in the payload.
    pub offset: u64,
    /// Bytes in the payload.
    pub len: u64,
}

/// What a path is (not following a final symlink).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// Anything else (device, FIFO, socket).
    Other,
}

/// Metadata of a guest path (`stat`, and the result of writes and mkdir).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileStat {
    /// The path as asked.
    pub path: String,
    /// File, directory, symlink or other.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (e.g. 0o644).
    pub mode: u32,
    /// Owner uid in the guest.
    pub uid: u32,
    /// Group gid in the guest.
    pub gid: u32,
    /// Last modification, seconds since the Unix epoch.
    pub mtime_unix: i64,
    /// Where a symlink points; None for anything else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DirEntry {
    /// Name within the directory.
    pub name: String,
    /// File, directory, symlink or other.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (e.g. 0o644).
    pub mode: u32,
    /// Last modification, seconds since the Unix epoch.
    pub mtime_unix: i64,
}

/// Reply to `list_dir`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ListResult {
    /// The directory's entries, without `.` and `..`.
    pub entries: Vec<DirEntry>,
}

/// One path as `entry` and `list_entries` report it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EntryInfo {
    /// Last path component.
    pub name: String,
    /// The absolute path (a relative request resolved against the home).
    pub path: String,
    /// What the path itself is (a symlink is `symlink`).
    pub kind: FileKind,
    /// What a symlink leads to, after every link is followed; for anything
    /// else its own kind. None: a dangling link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_kind: Option<FileKind>,
    /// Size in bytes (of the link itself for a symlink).
    pub size: u64,
    /// The whole `st_mode`: file type and permission bits (`lstat`).
    pub st_mode: u32,
    /// Permission bits of what a symlink leads to (its own otherwise); 0
    /// for a dangling link.
    pub target_mode: u32,
    /// Owner uid.
    pub uid: u32,
    /// Group gid.
    pub gid: u32,
    /// The owner's name from /etc/passwd, else the uid in decimal.
    pub owner: String,
    /// The group's name from /etc/group, else the gid in decimal.
    pub group: String,
    /// Last modification, seconds since the Unix epoch.
    pub mtime_unix: i64,
    /// Nanoseconds past `mtime_unix`.
    pub mtime_nsec: u32,
    /// A symlink's text as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// A symlink's target as an absolute path with every link followed
    /// (what E2B's envd reports); the path itself when it cannot be
    /// resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_resolved: Option<String>,
    /// Its metadata ([`super::metadata`]; a symlink's is its target's),
    /// read best-effort: a key or value that is not UTF-8 is left out.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub metadata: super::metadata::Metadata,
}

impl EntryInfo {
    /// `st_mode` as Go's `FileMode.String()` writes it, which is what E2B's
    /// envd reports as `permissions`: a type letter (`d` directory, `L`
    /// symlink, `D` device, `c` character device after `D`, `p` pipe,
    /// `S` socket, `u`/`g`/`t` for setuid/setgid/sticky) or `-`, then
    /// `rwxrwxrwx`.
    pub fn permissions(&self) -> String {
        let m = self.st_mode;
        let mut out = String::new();
        match m & libc_mode::S_IFMT {
            libc_mode::S_IFDIR => out.push('d'),
            libc_mode::S_IFLNK => out.push('L'),
            libc_mode::S_IFBLK => out.push('D'),
            libc_mode::S_IFCHR => out.push_str("Dc"),
            libc_mode::S_IFIFO => out.push('p'),
            libc_mode::S_IFSOCK => out.push('S'),
            _ => {}
        }
        if m & 0o4000 != 0 {
            out.push('u');
        }
        if m & 0o2000 != 0 {
            out.push('g');
        }
        if m & 0o1000 != 0 {
            out.push('t');
        }
        if out.is_empty() {
            out.push('-');
        }
        for (i, c) in "rwxrwxrwx".chars().enumerate() {
            out.push(if m & (1 << (8 - i)) != 0 { c } else { '-' });
        }
        out
    }
}

/// File type bits of `st_mode` (Linux values, the same on every arch).
mod libc_mode {
    pub const S_IFMT: u32 = 0o170000;
    pub const S_IFSOCK: u32 = 0o140000;
    pub const S_IFLNK: u32 = 0o120000;
    pub const S_IFBLK: u32 = 0o060000;
    pub const S_IFDIR: u32 = 0o040000;
    pub const S_IFCHR: u32 = 0o020000;
    pub const S_IFIFO: u32 = 0o010000;
}

/// Reply to `list_entries`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EntryList {
    /// Every entry found, depth first, each directory's entries by name.
    pub entries: Vec<EntryInfo>,
}

/// Final reply of a tunnel.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TunnelResult {
    /// Bytes the host sent into the connection.
    pub bytes_in: u64,
    /// Bytes the guest side sent back.
    pub bytes_out: u64,
    /// The host aborted it (`tunnel_close`).
    #[serde(default)]
    pub aborted: bool,
}

/// One running exec, as `list_execs` reports it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ExecInfo {
    /// Request id of the exec (a `target` for `stdin`, `resize`, `signal`).
    pub id: u64,
    /// Pid of its process (0 while it is starting).
    pub pid: u32,
    /// Its argv (a shell command as `/bin/sh -c CMD`).
    pub argv: Vec<String>,
    /// Streaming: `attach` can follow it.
    pub stream: bool,
    /// Its terminal's size when it runs on one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// The user it runs as, when one was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Its working directory.
    pub cwd: String,
}

/// Reply to `list_execs`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ExecList {
    /// The running execs, by request id.
    pub execs: Vec<ExecInfo>,
}

/// What happened to an entry under a watched directory, in envd's terms
/// (fsnotify's mapping of inotify's events).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum WatchKind {
    /// Created, or moved in (`IN_CREATE`, `IN_MOVED_TO`).
    Create,
    /// Its contents changed (`IN_MODIFY`).
    Write,
    /// Removed (`IN_DELETE`, `IN_DELETE_SELF`).
    Remove,
    /// Moved away (`IN_MOVED_FROM`, `IN_MOVE_SELF`).
    Rename,
    /// Its metadata changed (`IN_ATTRIB`).
    Chmod,
}

/// One event of a watch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WatchEvent {
    /// The entry's path relative to the watched directory (`""`: the
    /// directory itself).
    pub name: String,
    /// What happened.
    pub kind: WatchKind,
}

/// Final reply to `watch`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct WatchResult {
    /// Events delivered.
    pub events: u64,
    /// The watched directory was removed or moved away, which ended the watch.
    #[serde(default)]
    pub gone: bool,
}

/// Reply to `identity`: what the child now is.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct IdentityResult {
    /// Guest clock minus host clock before the clock was set, in ms.
    pub clock_skew_ms: Option<i64>,
    /// The hostname now set.
    pub hostname: String,
    /// Entropy bytes credited to the guest kernel's pool.
    pub entropy_bytes: usize,
    /// Whether the warm interpreter's RNGs were reseeded.
    pub interpreter_reseeded: bool,
    /// Whether `/etc/resolv.conf` was written.
    #[serde(default)]
    pub resolv_conf_written: bool,
    /// How many of the request's `ca_certs` the guest now trusts (0 from
    /// an agent that predates them: the host then refuses the hand-out).
    #[serde(default)]
    pub ca_certs_installed: usize,
}

/// Checks a guest path given by the host: absolute, no NUL, bounded length.
/// The guest is the sandbox, so `..` is allowed; shape is what is checked.
pub fn validate_guest_path(path: &str) -> Result<(), AgentError> {
    let bad = |why: &str| {
        Err(AgentError::new(
            ErrorKind::BadRequest,
            format!("bad path {path:?}: {why}"),
        ))
    };
    if path.is_empty() {
        return bad("empty");
    }
    if !path.starts_with('/') {
        return bad("must be absolute (start with '/')");
    }
    if path.contains('\0') {
        return bad("contains a NUL byte");
    }
    if path.len() > 4096 {
        return bad("longer than 4096 bytes");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_json_shape_is_flat() {
        let h = RequestHeader {
            id: 3,
            op: Op::Stat { path: "/x".into() },
        };
        let v = serde_json::to_value(&h).unwrap();
        assert_eq!(v, serde_json::json!({"id":3,"op":"stat","path":"/x"}));
        let back: RequestHeader = serde_json::from_value(v).unwrap();
        assert_eq!(back, h);
    }

    #[test]
    fn reply_json_shape() {
        let h = ReplyHeader {
            id: 9,
            body: Reply::Error {
                error: AgentError::new(ErrorKind::NotFound, "/x: gone"),
            },
        };
        let v = serde_json::to_value(&h).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id":9,"type":"error","error":{"kind":"not_found","message":"/x: gone"}})
        );
        assert_eq!(ErrorKind::NotFound.to_string(), "not_found");
    }

    #[test]
    fn permissions_read_as_envd_writes_them() {
        let e = |st_mode: u32| EntryInfo {
            name: "x".into(),
            path: "/x".into(),
            kind: FileKind::File,
            target_kind: Some(FileKind::File),
            size: 0,
            st_mode,
            target_mode: st_mode & 0o7777,
            uid: 0,
            gid: 0,
            owner: "root".into(),
            group: "root".into(),
            mtime_unix: 0,
            mtime_nsec: 0,
            symlink_target: None,
            symlink_resolved: None,
            metadata: Default::default(),
        };
        assert_eq!(e(0o100644).permissions(), "-rw-r--r--");
        assert_eq!(e(0o040755).permissions(), "drwxr-xr-x");
        assert_eq!(e(0o120777).permissions(), "Lrwxrwxrwx");
        assert_eq!(e(0o104755).permissions(), "urwxr-xr-x");
        assert_eq!(e(0o041777).permissions(), "dtrwxrwxrwx");
        assert_eq!(e(0o020620).permissions(), "Dcrw--w----");
        assert_eq!(e(0o010600).permissions(), "prw-------");
    }

    /// A version-1 request still parses (no `user`), and a `user` a
    /// version-1 agent would ignore is only sent when set.
    #[test]
    fn user_fields_are_optional_on_the_wire() {
        let old: RequestHeader =
            serde_json::from_value(serde_json::json!({"id":1,"op":"write_file","path":"/x"}))
                .unwrap();
        assert!(matches!(old.op, Op::WriteFile { user: None, .. }));
        let v = serde_json::to_value(RequestHeader {
            id: 2,
            op: Op::Exec(ExecSpec {
                shell: Some("true".into()),
                ..Default::default()
            }),
        })
        .unwrap();
        assert!(v.get("user").is_none(), "{v}");
        let p: PingResult = serde_json::from_value(serde_json::json!({
            "agent_version":"0","protocol":1,"uptime_ms":0,"hostname":"h","warm_ready":false}))
        .unwrap();
        assert!(!p.has(FEATURE_USERS));
    }

    #[test]
    fn path_rules() {
        assert!(validate_guest_path("/tmp/x").is_ok());
        assert!(validate_guest_path("tmp/x").is_err());
        assert!(validate_guest_path("").is_err());
        assert!(validate_guest_path("/a\0b").is_err());
    }
}
