//! The E2B sandbox plane (`E2B_SANDBOX_URL`): one listener for every
//! sandbox's envd (port 49983) and code interpreter (49999). A request is
//! routed by `E2b-Sandbox-Id`, or, when a client leaves it out (e2b 2.7.0's
//! `Sandbox.connect`), by its `X-Access-Token`; `E2b-Sandbox-Port` picks
//! the service (envd by default). The token must match the sandbox's.
//!
//! envd here: `GET /health`, `GET`/`POST /files`, and the Connect services
//! `process.Process/*` ([`super::process`]) and `filesystem.Filesystem/*`
//! (stat, list, make dir, remove, move; watches in [`super::watch`]). Each request acts as a guest
//! account, E2B's `user` by default when the guest has it
//! ([`crate::guest`]): its commands run as it, in its home; the files and
//! directories it makes are its own; relative paths are under its home.

use crate::connect;
use crate::error::{Code, E2bError, E2bResult, RpcError, RpcResult};
use crate::guest::{self as accounts, Account, ROOT};
use crate::process::{self, StartRequest};
use crate::state::{E2b, E2bSandbox, Guest, ENVD_PORT, INTERPRETER_PORT};
use axum::body::Body;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use base64::Engine;
use forkd_edge::transfers::Transfers;
use forkd_node::error::GuestErrorKind;
use forkd_node::limits::MAX_FILE_BYTES;
use forkd_node::{EntryInfo, ExecSpec, Metadata, WriteAs, WriteHow};
use rootfs_init::protocol::{metadata, FileKind, MAX_LIST_DEPTH};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

/// How long after a `Start` call's deadline (`Connect-Timeout-Ms`) its
/// process is killed.
pub const DEADLINE_GRACE_MS: u64 = 500;
/// Most of the guest's `/etc/passwd` read to find accounts.
pub const MAX_PASSWD_BYTES: u64 = 1 << 20;

/// The sandbox plane: everything goes through [`handle`].
pub fn routes(e: Arc<E2b>, transfers: Arc<Transfers>) -> Router {
    Router::new()
        .fallback(handle)
        .layer(axum::extract::DefaultBodyLimit::max(
            MAX_FILE_BYTES + 64 * 1024,
        ))
        .layer(axum::middleware::from_fn_with_state(
            transfers,
            forkd_edge::transfers::turn,
        ))
        .with_state(e)
}

/// The sandbox and port a request is for, after the token check: those
/// its `Host` names (`addressed`, [`crate::ports`]), else its headers'.
fn route(
    e: &E2b,
    h: &HeaderMap,
    addressed: Option<(u16, String)>,
) -> Result<(E2bSandbox, u16), E2bError> {
    let (port, host_id) = match addressed {
        Some((port, id)) => (port, Some(id)),
        None => (header_port(h)?, None),
    };
    // The SDKs send the sandbox's token as X-Access-Token, or, on the code
    // interpreter's context calls, only as the traffic token (which
    // create answers with the same value).
    let token = h
        .get("x-access-token")
        .or_else(|| h.get("e2b-traffic-access-token"))
        .map(|v| v.as_bytes());
    let unauthorized = || {
        E2bError::unauthorized(
            "missing or wrong X-Access-Token: use the envdAccessToken the create (or connect) answered",
        )
    };
    let named = host_id.or_else(|| {
        h.get("e2b-sandbox-id")
            .map(|v| v.to_str().unwrap_or("").to_string())
    });
    let sb = match named.as_deref() {
        Some(id) => {
            let sb = e.sandbox(id).ok_or_else(|| {
                E2bError::sandbox_gone(format!(
                    "sandbox {id:?} was not found: killed, expired, or never created"
                ))
            })?;
            if !token.is_some_and(|t| sb.rec.access_token.matches(t)) {
                return Err(unauthorized());
            }
            sb
        }
        None => token.and_then(|t| e.by_token(t)).ok_or_else(unauthorized)?,
    };
    Ok((sb, port))
}

/// The service `E2b-Sandbox-Port` names; envd without it.
fn header_port(h: &HeaderMap) -> Result<u16, E2bError> {
    match h.get("e2b-sandbox-port") {
        None => Ok(ENVD_PORT),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| E2bError::bad_request("E2b-Sandbox-Port must be a port number")),
    }
}

/// A `/files` request by signed URL ([`crate::signed`]): no token header,
/// a `signature` in the query. None: not one.
fn signed_file_request(e: &E2b, req: &Request) -> Option<Result<E2bSandbox, E2bError>> {
    let h = req.headers();
    if req.uri().path() != "/files"
        || h.contains_key("x-access-token")
        || h.contains_key("e2b-traffic-access-token")
    {
        return None;
    }
    let write = req.method() == Method::POST;
    let claim = crate::signed::claim(write, req.uri().query().unwrap_or(""))?;
    Some(claim.and_then(|c| crate::signed::verify(e, &c, forkd_snapshot::unix_now())))
}

async fn handle(State(e): State<Arc<E2b>>, req: Request) -> Response {
    let addressed = crate::ports::addressed(&e.domain, req.headers());
    if let Some((port, id)) = &addressed {
        if *port != ENVD_PORT && *port != INTERPRETER_PORT {
            return crate::ports::handle(&e, id, *port, req).await;
        }
    }
    let routed = match signed_file_request(&e, &req) {
        Some(signed) => signed.map(|sb| (sb, ENVD_PORT)),
        None => route(&e, req.headers(), addressed),
    };
    let (sb, port) = match routed {
        Ok(x) => x,
        Err(r) => return r.into_response(),
    };
    let g = Guest {
        node: &e.node,
        sb: &sb,
    };
    match port {
        ENVD_PORT => {
            let op = EnvdOp::of(&req);
            let res = envd(g, req).await;
            if let Some(op) = op {
                op.log(&e, sb.id(), res.status());
            }
            res
        }
        INTERPRETER_PORT => crate::interpreter::handle(&e, g, req).await,
        p => E2bError::bad_request(format!(
            "E2b-Sandbox-Port {p}: this header names envd ({ENVD_PORT}) or the code interpreter ({INTERPRETER_PORT}); reach other ports by their sandbox URL, the SDK's get_host({p}) (docs/e2b.md, \"Ports\")"
        ))
        .into_response(),
    }
}

/// An envd request as envd's log names it (`crate::logs`); health checks
/// are not logged.
struct EnvdOp {
    method: String,
    message: String,
    path: Option<String>,
}

impl EnvdOp {
    fn of(req: &Request) -> Option<EnvdOp> {
        let p = req.uri().path();
        let method = format!("{} {p}", req.method());
        let (message, path) = match (req.method() == Method::POST, p) {
            (_, "/health") => return None,
            (true, "/files") => ("File write".to_string(), true),
            (false, "/files") => ("File read".to_string(), true),
            (_, procedure) => (
                crate::logs::procedure_message(procedure.trim_start_matches('/')),
                false,
            ),
        };
        let path = path
            .then(|| parse_file_query(req.uri().query().unwrap_or("")).path)
            .flatten();
        Some(EnvdOp {
            method,
            message,
            path,
        })
    }

    /// Logs it with how it was answered: an error status is an error.
    fn log(self, e: &E2b, id: &str, status: StatusCode) {
        let level = if status.is_client_error() || status.is_server_error() {
            crate::logs::Level::Error
        } else {
            crate::logs::Level::Info
        };
        let op = e.logs.operation();
        let code = status.as_u16().to_string();
        let mut fields = vec![
            ("method", self.method.as_str()),
            ("operation_id", op.as_str()),
        ];
        if level == crate::logs::Level::Error {
            fields.push(("error_code", code.as_str()));
        }
        if let Some(p) = &self.path {
            fields.push(("path", p.as_str()));
        }
        e.logs.record(id, level, &self.message, &fields);
    }
}

async fn envd(g: Guest<'_>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let (get, post) = (req.method() == Method::GET, req.method() == Method::POST);
    if get && path == "/health" {
        StatusCode::NO_CONTENT.into_response()
    } else if get && path == "/files" {
        read_file(g, req)
            .await
            .unwrap_or_else(IntoResponse::into_response)
    } else if post && path == "/files" {
        write_files(g, req)
            .await
            .unwrap_or_else(IntoResponse::into_response)
    } else if let Some(m) = path.strip_prefix("/process.Process/").filter(|_| post) {
        rpc(g, m, true, req).await
    } else if let Some(m) = path
        .strip_prefix("/filesystem.Filesystem/")
        .filter(|_| post)
    {
        rpc(g, m, false, req).await
    } else {
        E2bError::not_found(format!(
            "{} {path} is not an envd endpoint poold serves (docs/e2b.md)",
            req.method()
        ))
        .into_response()
    }
}

/// The user a request names (`Authorization: Basic base64("user:")`),
/// if any.
fn asked_user(h: &HeaderMap) -> RpcResult<Option<String>> {
    let Some(v) = h.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let user = v
        .to_str()
        .ok()
        .and_then(|s| s.strip_prefix("Basic "))
        .and_then(|b| {
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .ok()
        })
        .and_then(|b| String::from_utf8(b).ok())
        .map(|s| s.split(':').next().unwrap_or("").to_string())
        .ok_or_else(|| RpcError::invalid("Authorization must be Basic base64(\"user:\")"))?;
    Ok(Some(user).filter(|u| !u.is_empty()))
}

/// The account a request acts as: the one it names, else the sandbox's
/// default (see [`crate::guest`]). Reads the guest's `/etc/passwd` the
/// first time, and again for a name not seen yet.
async fn account(g: Guest<'_>, asked: Option<&str>) -> RpcResult<Account> {
    if asked == Some(ROOT) {
        return Ok(Account::root());
    }
    let cached = g.sb.session.accounts.lock().unwrap().clone();
    if let Some(a) = cached.as_ref().and_then(|c| accounts::pick(c, asked)) {
        return Ok(a);
    }
    // The guest writes this file: read at most MAX_PASSWD_BYTES of it, so
    // a request naming an unknown user costs a bounded read.
    let passwd = g
        .node
        .read_file(g.id(), "/etc/passwd", 0, Some(MAX_PASSWD_BYTES))
        .await?;
    let found = accounts::parse_passwd(&String::from_utf8_lossy(&passwd.bytes));
    let picked = accounts::pick(&found, asked);
    *g.sb.session.accounts.lock().unwrap() = Some(found);
    picked.ok_or_else(|| accounts::no_such_user(asked.unwrap_or_default()))
}

/// One Connect call: reads the body (one envelope for streams), dispatches.
async fn rpc(g: Guest<'_>, method: &str, process: bool, req: Request) -> Response {
    let streaming = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/connect+"));
    let fail = |e: RpcError| -> Response {
        if streaming {
            stream_response(futures::stream::iter([Ok(e.end_of_stream())]))
        } else {
            e.into_response()
        }
    };
    let who = match asked_user(req.headers()) {
        Ok(w) => w,
        Err(e) => return fail(e),
    };
    // The call's deadline (Connect-Timeout-Ms; none: unlimited). When it
    // passes, the stream ends with `deadline_exceeded` (what the SDK turns
    // into its TimeoutException; e2b 2.7.0 relies on it). A process `Start`
    // ran is killed a moment later, so its own end never races that error.
    let timeout = req
        .headers()
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis);
    let keepalive = req
        .headers()
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|s| (1..=3600).contains(s))
        .map_or(Duration::from_secs(50), Duration::from_secs);
    if process && method == "StreamInput" {
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        return match stream_input(g, req.into_body(), deadline).await {
            Ok(()) => stream_response(futures::stream::iter(
                connect::client_stream_ok(&json!({})).into_iter().map(Ok),
            )),
            Err(e) => fail(e),
        };
    }
    let body = match axum::body::to_bytes(req.into_body(), connect::MAX_REQUEST_BYTES + 5).await {
        Ok(b) => b,
        Err(e) => {
            return fail(RpcError::new(
                Code::ResourceExhausted,
                format!(
                    "request body over {} bytes or unreadable: {e}",
                    connect::MAX_REQUEST_BYTES
                ),
            ))
        }
    };
    let msg: &[u8] = if streaming {
        match connect::single_message(&body) {
            Ok(m) => m,
            Err(e) => return fail(e),
        }
    } else {
        &body
    };
    let who = who.as_deref();
    let out = if process {
        process_rpc(g, who, method, msg, timeout, keepalive).await
    } else if method == "WatchDir" {
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        match account(g, who).await {
            Ok(acct) => crate::watch::watch_dir(g, &acct, msg, keepalive, deadline)
                .await
                .map(stream_response),
            Err(e) => Err(e),
        }
    } else {
        fs_rpc(g, who, method, msg)
            .await
            .map(|v| connect::unary_ok(&v))
    };
    out.unwrap_or_else(fail)
}

/// `process.Process/StreamInput`, envd's client stream: a `start`
/// naming the process, then `data` messages whose input (`stdin`, or
/// `pty` for a terminal) is handed to the process in order as each one
/// arrives, and `keepalive`s; done when the client ends its stream.
async fn stream_input(
    g: Guest<'_>,
    body: Body,
    deadline: Option<tokio::time::Instant>,
) -> RpcResult<()> {
    use futures::StreamExt;
    #[derive(Deserialize)]
    struct Msg {
        #[serde(default)]
        start: Option<Selector>,
        #[serde(default)]
        data: Option<Value>,
    }
    let mut chunks = body.into_data_stream();
    let mut envelopes = connect::Envelopes::default();
    let mut target = None;
    loop {
        while let Some(m) = envelopes.next_message()? {
            let m: Msg = connect::parse(&m)?;
            if let Some(s) = m.start {
                target = Some(g.sb.session.processes.find(&s.process)?);
            } else if let Some(d) = m.data {
                let p = target.as_ref().ok_or_else(|| {
                    RpcError::invalid(
                        "StreamInput: the first message must be `start`, naming the process",
                    )
                })?;
                let input = d.get("input").unwrap_or(&Value::Null);
                process::input(p, &input_bytes(input)?, false).await?;
            }
            // Anything else is a keepalive.
        }
        let next = match deadline {
            Some(d) => tokio::time::timeout_at(d, chunks.next())
                .await
                .map_err(|_| {
                    RpcError::new(
                        Code::DeadlineExceeded,
                        "StreamInput: the call's deadline passed",
                    )
                })?,
            None => chunks.next().await,
        };
        match next {
            Some(Ok(chunk)) => envelopes.push(&chunk),
            Some(Err(e)) => {
                return Err(RpcError::invalid(format!(
                    "StreamInput: reading the request: {e}"
                )))
            }
            None if envelopes.has_partial() => {
                return Err(RpcError::invalid(
                    "StreamInput: the request ended inside a message",
                ))
            }
            None => return Ok(()),
        }
    }
}

/// The bytes of a `ProcessInput` (`{"stdin": b64}` or `{"pty": b64}`).
fn input_bytes(input: &Value) -> RpcResult<Vec<u8>> {
    let (key, text) = match (input.get("pty"), input.get("stdin")) {
        (Some(v), _) => ("pty", v),
        (None, Some(v)) => ("stdin", v),
        (None, None) => return Ok(Vec::new()),
    };
    match text.as_str() {
        Some(b) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .map_err(|e| RpcError::invalid(format!("input.{key} is not base64: {e}"))),
        None => Ok(Vec::new()),
    }
}

fn stream_response(
    s: impl futures::Stream<Item = Result<bytes::Bytes, std::convert::Infallible>> + Send + 'static,
) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(s),
    )
        .into_response()
}

#[derive(Deserialize)]
struct Selector {
    #[serde(default)]
    process: Value,
}

async fn process_rpc(
    g: Guest<'_>,
    who: Option<&str>,
    method: &str,
    msg: &[u8],
    timeout: Option<Duration>,
    keepalive: Duration,
) -> RpcResult<Response> {
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    match method {
        "Start" => {
            let req: StartRequest = connect::parse(msg)?;
            let kill_after = timeout.map(|t| t + Duration::from_millis(DEADLINE_GRACE_MS));
            let acct = account(g, who).await?;
            let mut spec = process::exec_spec(&req, &acct.home, kill_after)?;
            spec.user = acct.agent_user().map(String::from);
            let (p, rx) =
                g.sb.session
                    .processes
                    .start(g.node, g.id(), spec, req.process, req.tag)
                    .await?;
            Ok(stream_response(process::event_stream(
                p.pid, p.pty, rx, keepalive, deadline,
            )))
        }
        "Connect" => {
            let s: Selector = connect::parse(msg)?;
            let p = g.sb.session.processes.find(&s.process)?;
            let rx = p.subscribe()?;
            Ok(stream_response(process::event_stream(
                p.pid, p.pty, rx, keepalive, deadline,
            )))
        }
        "List" => Ok(connect::unary_ok(&process::list_json(
            &g.sb.session.processes,
        ))),
        "SendSignal" => {
            #[derive(Deserialize)]
            struct Req {
                #[serde(default)]
                process: Value,
                #[serde(default)]
                signal: Value,
            }
            let r: Req = connect::parse(msg)?;
            let p = g.sb.session.processes.find(&r.process)?;
            process::signal(&p, process::parse_signal(&r.signal)?).await?;
            Ok(connect::unary_ok(&json!({})))
        }
        "SendInput" => {
            #[derive(Deserialize)]
            struct Req {
                #[serde(default)]
                process: Value,
                #[serde(default)]
                input: Value,
            }
            let r: Req = connect::parse(msg)?;
            let p = g.sb.session.processes.find(&r.process)?;
            // A terminal's input (`pty`) is typed into it; `stdin` is the
            // pipe of a process without one.
            process::input(&p, &input_bytes(&r.input)?, false).await?;
            Ok(connect::unary_ok(&json!({})))
        }
        "Update" => {
            #[derive(Deserialize)]
            struct Req {
                #[serde(default)]
                process: Value,
                #[serde(default)]
                pty: Option<Value>,
            }
            let r: Req = connect::parse(msg)?;
            let p = g.sb.session.processes.find(&r.process)?;
            if let Some(pty) = &r.pty {
                process::resize(&p, process::pty_size(pty)?).await?;
            }
            Ok(connect::unary_ok(&json!({})))
        }
        "CloseStdin" => {
            let s: Selector = connect::parse(msg)?;
            let p = g.sb.session.processes.find(&s.process)?;
            process::input(&p, &[], true).await?;
            Ok(connect::unary_ok(&json!({})))
        }
        other => Err(RpcError::unimplemented(&format!("process.Process/{other}"))),
    }
}

fn file_type(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// RFC 3339 with nanoseconds, as envd's `modifiedTime`.
fn mtime(unix: i64, nsec: u32) -> String {
    let t = UNIX_EPOCH + Duration::new(unix.max(0) as u64, nsec.min(999_999_999));
    humantime::format_rfc3339_nanos(t).to_string()
}

/// envd's `EntryInfo` of the agent's entry. A symlink is flagged
/// (`isSymlink`, E2B SDK 2.63's field) and carries its target as an
/// absolute path with every link followed, as envd reports it.
fn entry_json(e: &EntryInfo) -> Value {
    let mut v = json!({
        "name": if e.name.is_empty() { "/".to_string() } else { e.name.clone() },
        "type": file_type(e.kind),
        "path": e.path,
        "size": e.size.to_string(),
        "mode": e.st_mode & 0o7777,
        "permissions": e.permissions(),
        "owner": e.owner,
        "group": e.group,
        "modifiedTime": mtime(e.mtime_unix, e.mtime_nsec),
    });
    if !e.metadata.is_empty() {
        v["metadata"] = json!(e.metadata);
    }
    if e.kind == FileKind::Symlink {
        v["isSymlink"] = json!(true);
        if let Some(t) = e.symlink_resolved.as_ref().or(e.symlink_target.as_ref()) {
            v["symlinkTarget"] = json!(t);
        }
    }
    v
}

#[derive(Deserialize)]
struct PathReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

async fn fs_rpc(g: Guest<'_>, who: Option<&str>, method: &str, msg: &[u8]) -> RpcResult<Value> {
    let (node, id) = (g.node, g.id());
    let acct = account(g, who).await?;
    let user = acct.agent_user();
    match method {
        "Stat" => {
            let r: PathReq = connect::parse(msg)?;
            let p = acct.resolve(&r.path)?;
            Ok(json!({"entry": entry_json(&node.entry(id, &p, user).await?)}))
        }
        "ListDir" => {
            let r: PathReq = connect::parse(msg)?;
            let p = acct.resolve(&r.path)?;
            let depth = r.depth.unwrap_or(1).clamp(1, MAX_LIST_DEPTH);
            let entries = node.list_entries(id, &p, depth, user).await?;
            Ok(json!({"entries": entries.iter().map(entry_json).collect::<Vec<_>>()}))
        }
        "MakeDir" => {
            let r: PathReq = connect::parse(msg)?;
            let p = acct.resolve(&r.path)?;
            if node.stat(id, &p).await.is_ok() {
                return Err(RpcError::new(Code::AlreadyExists, format!("{p} exists")));
            }
            node.mkdir_as(id, &p, true, user).await?;
            Ok(json!({"entry": entry_json(&node.entry(id, &p, user).await?)}))
        }
        "Remove" => {
            let r: PathReq = connect::parse(msg)?;
            let p = acct.resolve(&r.path)?;
            // envd removes with Go's os.RemoveAll: a missing path is done.
            match node.remove_as(id, &p, true, user).await {
                Err(forkd_node::Error::Guest(a)) if a.kind == GuestErrorKind::NotFound => {}
                r => r?,
            }
            Ok(json!({}))
        }
        "Move" => {
            #[derive(Deserialize)]
            struct Req {
                source: String,
                destination: String,
            }
            let r: Req = connect::parse(msg)?;
            let (src, dst) = (acct.resolve(&r.source)?, acct.resolve(&r.destination)?);
            rename(g, &acct, &src, &dst).await?;
            Ok(json!({"entry": entry_json(&node.entry(id, &dst, user).await?)}))
        }
        "CreateWatcher" => crate::watch::create(g, &acct, msg).await,
        "GetWatcherEvents" => crate::watch::events(g, msg),
        "RemoveWatcher" => crate::watch::remove(g, msg),
        other => Err(RpcError::unimplemented(&format!(
            "filesystem.Filesystem/{other}"
        ))),
    }
}

/// Renames `src` to `dst` with the guest's `mv -T` as the request's
/// account (rename(2), or a copy across filesystems; never moves into
/// `dst` when it is a directory).
async fn rename(g: Guest<'_>, acct: &Account, src: &str, dst: &str) -> RpcResult<()> {
    g.node.stat(g.id(), src).await?;
    let spec = ExecSpec {
        argv: Some(vec![
            "mv".into(),
            "-T".into(),
            "--".into(),
            src.into(),
            dst.into(),
        ]),
        user: acct.agent_user().map(String::from),
        timeout_ms: Some(120_000),
        ..Default::default()
    };
    let out = g.node.exec(g.id(), spec, &[]).await?;
    if out.result.exit_code == Some(0) {
        Ok(())
    } else {
        Err(RpcError::invalid(format!(
            "moving {src} to {dst}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[derive(Default)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

/// The query of a `/files` call and the account it acts as (`username`,
/// else the Basic user, else the default); an unknown account is a 401.
async fn file_account(
    g: Guest<'_>,
    query: &str,
    headers: &HeaderMap,
) -> E2bResult<(FileQuery, Account)> {
    let fq = parse_file_query(query);
    let header_user = asked_user(headers).map_err(|e| E2bError::unauthorized(e.message))?;
    let asked = fq
        .username
        .clone()
        .filter(|u| !u.is_empty())
        .or(header_user);
    let acct = account(g, asked.as_deref())
        .await
        .map_err(|e| E2bError::new(e.code.http_status(), e.message))?;
    Ok((fq, acct))
}

fn parse_file_query(q: &str) -> FileQuery {
    let mut fq = FileQuery::default();
    for (k, v) in form_urlencoded::parse(q.as_bytes()) {
        match k.as_ref() {
            "path" => fq.path = Some(v.into_owned()),
            "username" => fq.username = Some(v.into_owned()),
            _ => {}
        }
    }
    fq
}

/// A guest path of `/files`, resolved against the account's home and
/// validated (400 when it is not one the agent would accept).
fn file_path(acct: &Account, p: &str) -> E2bResult<String> {
    acct.resolve(p)
        .map_err(|e| E2bError::bad_request(e.message))
}

/// `GET /files?path=`: the file's bytes.
async fn read_file(g: Guest<'_>, req: Request) -> E2bResult<Response> {
    let (q, acct) = file_account(g, req.uri().query().unwrap_or(""), req.headers()).await?;
    let path = file_path(&acct, q.path.as_deref().unwrap_or(""))?;
    let r = g
        .node
        .read_file_as(g.id(), &path, 0, None, acct.agent_user())
        .await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        r.bytes,
    )
        .into_response())
}

/// An upload with its `Content-Encoding` undone: gzip (the SDK's
/// `gzip=True`) is inflated, at most [`MAX_FILE_BYTES`] in and out (a
/// bomb is a 413, not memory); any other coding is a 415. The body is
/// read before an error is answered, so the client sees the answer, not a
/// connection closed under its upload.
async fn decoded(req: Request) -> E2bResult<Request> {
    let coding = req
        .headers()
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase());
    let Some(coding) = coding.filter(|c| !c.is_empty() && c != "identity") else {
        return Ok(req);
    };
    let (mut parts, body) = req.into_parts();
    let too_large = || {
        E2bError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("one upload is at most {MAX_FILE_BYTES} bytes, compressed or not"),
        )
    };
    let raw = axum::body::to_bytes(body, MAX_FILE_BYTES)
        .await
        .map_err(|_| too_large())?;
    if coding != "gzip" {
        return Err(E2bError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "Content-Encoding {coding:?} is not accepted; send gzip or the file uncompressed"
            ),
        ));
    }
    let inflated = tokio::task::spawn_blocking(move || gunzip(&raw, MAX_FILE_BYTES))
        .await
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let inflated = match inflated {
        Ok(Some(b)) => b,
        Ok(None) => return Err(too_large()),
        Err(e) => {
            return Err(E2bError::bad_request(format!(
                "the body is not valid gzip ({e}); send it uncompressed or gzip it whole"
            )))
        }
    };
    parts.headers.remove(header::CONTENT_ENCODING);
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok(Request::from_parts(parts, Body::from(inflated)))
}

/// Inflates `gz`; `None` when it holds more than `limit` bytes.
fn gunzip(gz: &[u8], limit: usize) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(gz)
        .take(limit as u64 + 1)
        .read_to_end(&mut out)?;
    Ok((out.len() <= limit).then_some(out))
}

/// Most files in one multipart upload.
pub const MAX_UPLOAD_FILES: usize = 1000;

/// `POST /files`: multipart (each part's file name is its destination when
/// no `path` is given) or a raw body to `path`. The whole body is bounded
/// by the route's body limit.
async fn write_files(g: Guest<'_>, req: Request) -> E2bResult<Response> {
    let (q, acct) = file_account(g, req.uri().query().unwrap_or(""), req.headers()).await?;
    let metadata = upload_metadata(req.headers())?;
    let req = decoded(req).await?;
    let multipart = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"multipart/form-data"));
    let mut files: Vec<(String, bytes::Bytes)> = Vec::new();
    if multipart {
        let bad =
            |e: axum::extract::multipart::MultipartError| E2bError::bad_request(e.body_text());
        let mut mp = axum::extract::Multipart::from_request(req, &())
            .await
            .map_err(|e| E2bError::bad_request(e.body_text()))?;
        while let Some(field) = mp.next_field().await.map_err(bad)? {
            let name = field.file_name().map(str::to_string);
            let data = field.bytes().await.map_err(bad)?;
            let dest = match (&q.path, name) {
                (Some(p), _) => p.clone(),
                (None, Some(n)) => n,
                (None, None) => {
                    return Err(E2bError::bad_request(
                        "a part without a file name and no path query: say where to write it",
                    ))
                }
            };
            if files.len() == MAX_UPLOAD_FILES {
                return Err(E2bError::bad_request(format!(
                    "at most {MAX_UPLOAD_FILES} files per upload"
                )));
            }
            files.push((file_path(&acct, &dest)?, data));
        }
    } else {
        let p = q
            .path
            .as_deref()
            .ok_or_else(|| E2bError::bad_request("path query required for a raw upload"))?;
        let p = file_path(&acct, p)?;
        let b = axum::body::to_bytes(req.into_body(), MAX_FILE_BYTES)
            .await
            .map_err(|_| {
                E2bError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("one upload is at most {MAX_FILE_BYTES} bytes"),
                )
            })?;
        files.push((p, b));
    }
    if files.is_empty() {
        return Err(E2bError::bad_request("the upload held no file"));
    }
    let as_ = WriteAs {
        how: WriteHow::InPlace,
        user: acct.agent_user(),
        // envd replaces the set on every upload, an empty one too.
        metadata: Some(&metadata),
        ..Default::default()
    };
    let mut out = Vec::new();
    for (path, data) in files {
        g.node.write_file_as(g.id(), &path, &data, as_).await?;
        let name = path.rsplit('/').next().unwrap_or("").to_string();
        let mut info = json!({"name": name, "type": "file", "path": path});
        if !metadata.is_empty() {
            // What the file holds, as envd answers: a filesystem without
            // user xattrs keeps none.
            let kept = g.node.entry(g.id(), &path, as_.user).await?.metadata;
            if !kept.is_empty() {
                info["metadata"] = json!(kept);
            }
        }
        out.push(info);
    }
    Ok(Json(out).into_response())
}

/// The prefix of the headers an upload's metadata arrives in (envd's).
const METADATA_HEADER: &str = "x-metadata-";

/// An upload's `X-Metadata-<key>` headers as the set to store, keys
/// lowercased (as envd does; the first of repeated headers wins), checked
/// against what a file can hold.
fn upload_metadata(h: &HeaderMap) -> E2bResult<Metadata> {
    let mut m = Metadata::new();
    for (name, value) in h {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) else {
            continue;
        };
        let value = value.to_str().map_err(|_| {
            E2bError::bad_request(format!(
                "invalid metadata: the value of X-Metadata-{key} is not printable US-ASCII"
            ))
        })?;
        m.entry(key.to_ascii_lowercase())
            .or_insert_with(|| value.to_string());
    }
    metadata::validate(&m).map_err(|e| E2bError::bad_request(format!("invalid metadata: {e}")))?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_is_inflated_within_a_bound() {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(&vec![b'a'; 10_000]).unwrap();
        let gz = e.finish().unwrap();
        assert_eq!(gunzip(&gz, 10_000).unwrap(), Some(vec![b'a'; 10_000]));
        assert_eq!(gunzip(&gz, 9_999).unwrap(), None);
        assert!(gunzip(b"not gzip", 100).is_err());
    }

    #[test]
    fn the_user_a_request_names() {
        let mut h = HeaderMap::new();
        assert_eq!(asked_user(&h).unwrap(), None);
        let b = base64::engine::general_purpose::STANDARD.encode("root:");
        h.insert(header::AUTHORIZATION, format!("Basic {b}").parse().unwrap());
        assert_eq!(asked_user(&h).unwrap().as_deref(), Some("root"));
        let b = base64::engine::general_purpose::STANDARD.encode("user:");
        h.insert(header::AUTHORIZATION, format!("Basic {b}").parse().unwrap());
        assert_eq!(asked_user(&h).unwrap().as_deref(), Some("user"));
        let b = base64::engine::general_purpose::STANDARD.encode(":");
        h.insert(header::AUTHORIZATION, format!("Basic {b}").parse().unwrap());
        assert_eq!(asked_user(&h).unwrap(), None);
        h.insert(header::AUTHORIZATION, "Bearer x".parse().unwrap());
        assert_eq!(asked_user(&h).unwrap_err().code, Code::InvalidArgument);
    }

    fn entry(kind: FileKind, st_mode: u32) -> EntryInfo {
        EntryInfo {
            name: "a.txt".into(),
            path: "/home/user/a.txt".into(),
            kind,
            target_kind: Some(kind),
            size: 256,
            st_mode,
            target_mode: st_mode & 0o7777,
            uid: 1000,
            gid: 1000,
            owner: "user".into(),
            group: "user".into(),
            mtime_unix: 1,
            mtime_nsec: 5,
            symlink_target: None,
            symlink_resolved: None,
            metadata: Metadata::new(),
        }
    }

    /// `X-Metadata-*` headers as envd reads them: keys lowercased, the
    /// other headers ignored; what a file cannot hold is a 400.
    #[test]
    fn upload_metadata_from_headers() {
        let mut h = HeaderMap::new();
        h.insert("content-type", "application/octet-stream".parse().unwrap());
        assert!(upload_metadata(&h).unwrap().is_empty());
        h.insert("X-Metadata-Owner", "agent 7".parse().unwrap());
        h.insert("x-metadata-run", "r1".parse().unwrap());
        let m = upload_metadata(&h).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!((m["owner"].as_str(), m["run"].as_str()), ("agent 7", "r1"));
        h.insert("x-metadata-tab", "a\tb".parse().unwrap());
        let e = upload_metadata(&h).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("invalid metadata"), "{}", e.message);
        h.remove("x-metadata-tab");
        h.insert("x-metadata-big", "v".repeat(5000).parse().unwrap());
        assert_eq!(
            upload_metadata(&h).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn entries_as_envd_reports_them() {
        let v = entry_json(&entry(FileKind::File, 0o100644));
        assert_eq!(v["name"], "a.txt");
        assert_eq!(v["size"], "256");
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["mode"], 0o644);
        assert_eq!(v["permissions"], "-rw-r--r--");
        assert_eq!(v["owner"], "user");
        assert_eq!(v["group"], "user");
        assert_eq!(v["modifiedTime"], "1970-01-01T00:00:01.000000005Z");
        assert!(v.get("isSymlink").is_none());
        assert!(v.get("metadata").is_none(), "none set, none reported");
        let mut tagged = entry(FileKind::File, 0o100644);
        tagged.metadata.insert("owner".into(), "agent".into());
        assert_eq!(entry_json(&tagged)["metadata"], json!({"owner": "agent"}));

        let mut l = entry(FileKind::Symlink, 0o120777);
        l.symlink_target = Some("../x".into());
        l.symlink_resolved = Some("/home/x".into());
        let v = entry_json(&l);
        assert_eq!(v["isSymlink"], true);
        assert_eq!(v["symlinkTarget"], "/home/x");
        assert_eq!(v["permissions"], "Lrwxrwxrwx");
    }
}
