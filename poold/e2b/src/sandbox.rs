//! The E2B sandbox plane (`E2B_SANDBOX_URL`): one listener for every
//! sandbox's envd (port 49983) and code interpreter (49999). A request is
//! routed by `E2b-Sandbox-Id`, or, when a client leaves it out (e2b 2.7.0's
//! `Sandbox.connect`), by its `X-Access-Token`; `E2b-Sandbox-Port` picks
//! the service (envd by default). The token must match the sandbox's.
//!
//! envd here: `GET /health`, `GET`/`POST /files`, and the Connect services
//! `process.Process/*` ([`super::process`]) and `filesystem.Filesystem/*`
//! (stat, list, make dir, remove, move). Processes run as root in `/root`
//! (the guest agent's user); asking for another user is refused.

use crate::connect;
use crate::error::{Code, E2bError, E2bResult, RpcError, RpcResult};
use crate::guest::{resolve_path, HOME, USER};
use crate::process::{self, StartRequest};
use crate::state::{E2b, E2bSandbox, Guest, ENVD_PORT, INTERPRETER_PORT};
use axum::body::Body;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use base64::Engine;
use forkd_edge::transfers::Transfers;
use forkd_node::limits::MAX_FILE_BYTES;
use forkd_node::{ExecSpec, FileStat};
use rootfs_init::protocol::{DirEntry, FileKind};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

/// How long after a `Start` call's deadline (`Connect-Timeout-Ms`) its
/// process is killed.
pub const DEADLINE_GRACE_MS: u64 = 500;
/// Most entries one `ListDir` answers (all depths together).
pub const MAX_LIST_ENTRIES: usize = 10_000;

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

/// The sandbox and port a request is for, after the token check.
fn route(e: &E2b, h: &HeaderMap) -> Result<(E2bSandbox, u16), E2bError> {
    let port = match h.get("e2b-sandbox-port") {
        None => ENVD_PORT,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| E2bError::bad_request("E2b-Sandbox-Port must be a port number"))?,
    };
    let token = h.get("x-access-token").map(|v| v.as_bytes());
    let unauthorized = || {
        E2bError::unauthorized(
            "missing or wrong X-Access-Token: use the envdAccessToken the create (or connect) answered",
        )
    };
    let sb = match h.get("e2b-sandbox-id") {
        Some(id) => {
            let id = id.to_str().unwrap_or("");
            let sb = e.sandbox(id).ok_or_else(|| {
                E2bError::sandbox_gone(format!(
                    "sandbox {id:?} not found: killed, expired, or never created"
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

async fn handle(State(e): State<Arc<E2b>>, req: Request) -> Response {
    let (sb, port) = match route(&e, req.headers()) {
        Ok(x) => x,
        Err(r) => return r.into_response(),
    };
    let g = Guest {
        node: &e.node,
        sb: &sb,
    };
    match port {
        ENVD_PORT => envd(g, req).await,
        INTERPRETER_PORT => crate::interpreter::handle(g, req).await,
        p => E2bError::sandbox_gone(
            format!("port {p} is not served: poold serves envd ({ENVD_PORT}) and the code interpreter ({INTERPRETER_PORT})"),
        )
        .into_response(),
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

/// The user a request asks for (`Authorization: Basic base64(user:)`):
/// none or root; poold's agent runs everything as root.
fn check_user(h: &HeaderMap) -> RpcResult<()> {
    let Some(v) = h.get(header::AUTHORIZATION) else {
        return Ok(());
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
    check_username(&user)
}

fn check_username(user: &str) -> RpcResult<()> {
    if user.is_empty() || user == USER {
        Ok(())
    } else {
        Err(RpcError::new(
            Code::PermissionDenied,
            format!("user {user:?}: poold's sandboxes run commands as {USER:?} only; leave user unset or pass user=\"root\""),
        ))
    }
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
    if let Err(e) = check_user(req.headers()) {
        return fail(e);
    }
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
    let out = if process {
        process_rpc(g, method, msg, timeout, keepalive).await
    } else {
        fs_rpc(g, method, msg).await.map(|v| connect::unary_ok(&v))
    };
    out.unwrap_or_else(fail)
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
            let spec = process::exec_spec(&req, HOME, kill_after)?;
            let (p, rx) =
                g.sb.session
                    .processes
                    .start(g.node, g.id(), spec, req.process, req.tag)
                    .await?;
            Ok(stream_response(process::event_stream(
                p.pid, rx, keepalive, deadline,
            )))
        }
        "Connect" => {
            let s: Selector = connect::parse(msg)?;
            let p = g.sb.session.processes.find(&s.process)?;
            let rx = p.subscribe()?;
            Ok(stream_response(process::event_stream(
                p.pid, rx, keepalive, deadline,
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
            if r.input.get("pty").is_some() {
                return Err(RpcError::unimplemented("pty input"));
            }
            let data = match r.input.get("stdin").and_then(Value::as_str) {
                Some(b) => base64::engine::general_purpose::STANDARD
                    .decode(b)
                    .map_err(|e| RpcError::invalid(format!("input.stdin is not base64: {e}")))?,
                None => Vec::new(),
            };
            process::input(&p, &data, false).await?;
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

/// Go's `fs.FileMode` string (`-rw-r--r--`, `drwxr-xr-x`).
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn file_type(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

fn mtime(unix: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_secs(unix.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

fn owner(id: u32) -> String {
    if id == 0 {
        "root".into()
    } else {
        id.to_string()
    }
}

/// `EntryInfo` of a stat.
fn stat_entry(st: &FileStat) -> Value {
    let name = st.path.rsplit('/').next().unwrap_or("").to_string();
    let mut v = json!({
        "name": if name.is_empty() { "/".to_string() } else { name },
        "type": file_type(st.kind),
        "path": st.path,
        "size": st.size.to_string(),
        "mode": st.mode,
        "permissions": permissions(st.kind, st.mode),
        "owner": owner(st.uid),
        "group": owner(st.gid),
        "modifiedTime": mtime(st.mtime_unix),
    });
    if let Some(t) = &st.symlink_target {
        v["symlinkTarget"] = json!(t);
    }
    v
}

/// `EntryInfo` of a listing entry (listings carry no owner).
fn dir_entry(dir: &str, e: &DirEntry) -> Value {
    let path = format!("{}/{}", dir.trim_end_matches('/'), e.name);
    json!({
        "name": e.name,
        "type": file_type(e.kind),
        "path": path,
        "size": e.size.to_string(),
        "mode": e.mode,
        "permissions": permissions(e.kind, e.mode),
        "modifiedTime": mtime(e.mtime_unix),
    })
}

#[derive(Deserialize)]
struct PathReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

async fn fs_rpc(g: Guest<'_>, method: &str, msg: &[u8]) -> RpcResult<Value> {
    let (node, id) = (g.node, g.id());
    match method {
        "Stat" => {
            let r: PathReq = connect::parse(msg)?;
            let p = resolve_path(&r.path, HOME)?;
            let st = node.stat(id, &p).await?;
            Ok(json!({"entry": stat_entry(&st)}))
        }
        "ListDir" => {
            let r: PathReq = connect::parse(msg)?;
            let p = resolve_path(&r.path, HOME)?;
            let depth = r.depth.unwrap_or(1).clamp(1, 64);
            Ok(json!({"entries": list_dir(g, &p, depth).await?}))
        }
        "MakeDir" => {
            let r: PathReq = connect::parse(msg)?;
            let p = resolve_path(&r.path, HOME)?;
            if node.stat(id, &p).await.is_ok() {
                return Err(RpcError::new(Code::AlreadyExists, format!("{p} exists")));
            }
            let st = node.mkdir(id, &p, true).await?;
            Ok(json!({"entry": stat_entry(&st)}))
        }
        "Remove" => {
            let r: PathReq = connect::parse(msg)?;
            let p = resolve_path(&r.path, HOME)?;
            node.remove(id, &p, true).await?;
            Ok(json!({}))
        }
        "Move" => {
            #[derive(Deserialize)]
            struct Req {
                source: String,
                destination: String,
            }
            let r: Req = connect::parse(msg)?;
            let (src, dst) = (
                resolve_path(&r.source, HOME)?,
                resolve_path(&r.destination, HOME)?,
            );
            rename(g, &src, &dst).await?;
            let st = node.stat(id, &dst).await?;
            Ok(json!({"entry": stat_entry(&st)}))
        }
        other => Err(RpcError::unimplemented(&format!(
            "filesystem.Filesystem/{other}"
        ))),
    }
}

/// Lists `dir` down to `depth` levels, at most [`MAX_LIST_ENTRIES`].
async fn list_dir(g: Guest<'_>, dir: &str, depth: u32) -> RpcResult<Vec<Value>> {
    let mut out = Vec::new();
    let mut level = vec![dir.to_string()];
    for _ in 0..depth {
        let mut next = Vec::new();
        for d in &level {
            let l = g.node.list_dir(g.id(), d).await?;
            for e in &l.entries {
                if out.len() == MAX_LIST_ENTRIES {
                    return Err(RpcError::new(
                        Code::ResourceExhausted,
                        format!("{dir} has over {MAX_LIST_ENTRIES} entries at depth {depth}; list with a smaller depth"),
                    ));
                }
                let v = dir_entry(d, e);
                if e.kind == FileKind::Dir {
                    next.push(v["path"].as_str().unwrap_or_default().to_string());
                }
                out.push(v);
            }
        }
        level = next;
    }
    Ok(out)
}

/// Renames `src` to `dst` with the guest's `mv -T` (rename(2), or a copy
/// across filesystems; never moves into `dst` when it is a directory).
async fn rename(g: Guest<'_>, src: &str, dst: &str) -> RpcResult<()> {
    g.node.stat(g.id(), src).await?;
    let spec = ExecSpec {
        argv: Some(vec![
            "mv".into(),
            "-T".into(),
            "--".into(),
            src.into(),
            dst.into(),
        ]),
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

fn file_query(req: &Request) -> E2bResult<FileQuery> {
    let q = req.uri().query().unwrap_or("");
    let fq = parse_file_query(q);
    let user_err = |e: RpcError| E2bError::unauthorized(e.message);
    check_username(fq.username.as_deref().unwrap_or("")).map_err(user_err)?;
    check_user(req.headers()).map_err(user_err)?;
    Ok(fq)
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

/// A guest path of `/files`, resolved and validated (400 when it is not
/// one the agent would accept).
fn file_path(p: &str) -> E2bResult<String> {
    resolve_path(p, HOME).map_err(|e| E2bError::bad_request(e.message))
}

/// `GET /files?path=`: the file's bytes.
async fn read_file(g: Guest<'_>, req: Request) -> E2bResult<Response> {
    let q = file_query(&req)?;
    let path = file_path(q.path.as_deref().unwrap_or(""))?;
    let r = g.node.read_file(g.id(), &path, 0, None).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        r.bytes,
    )
        .into_response())
}

/// Most files in one multipart upload.
pub const MAX_UPLOAD_FILES: usize = 1000;

/// `POST /files`: multipart (each part's file name is its destination when
/// no `path` is given) or a raw body to `path`. The whole body is bounded
/// by the route's body limit.
async fn write_files(g: Guest<'_>, req: Request) -> E2bResult<Response> {
    let q = file_query(&req)?;
    let multipart = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"multipart/form-data"));
    if req
        .headers()
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() != b"identity")
    {
        return Err(E2bError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "compressed uploads are not accepted; send the file uncompressed",
        ));
    }
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
            files.push((file_path(&dest)?, data));
        }
    } else {
        let p = q
            .path
            .as_deref()
            .ok_or_else(|| E2bError::bad_request("path query required for a raw upload"))?;
        let p = file_path(p)?;
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
    let mut out = Vec::new();
    for (path, data) in files {
        g.node.write_file(g.id(), &path, &data, None, false).await?;
        let name = path.rsplit('/').next().unwrap_or("").to_string();
        out.push(json!({"name": name, "type": "file", "path": path}));
    }
    Ok(Json(out).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_like_envd() {
        assert_eq!(resolve_path("", HOME).unwrap(), "/root");
        assert_eq!(resolve_path("a.txt", HOME).unwrap(), "/root/a.txt");
        assert_eq!(resolve_path("~/x", HOME).unwrap(), "/root/x");
        assert_eq!(resolve_path("/tmp/x", HOME).unwrap(), "/tmp/x");
        assert!(resolve_path("/a\0b", HOME).is_err());
    }

    #[test]
    fn permissions_like_go() {
        assert_eq!(permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
    }

    #[test]
    fn users() {
        let mut h = HeaderMap::new();
        assert!(check_user(&h).is_ok());
        let b = base64::engine::general_purpose::STANDARD.encode("root:");
        h.insert(header::AUTHORIZATION, format!("Basic {b}").parse().unwrap());
        assert!(check_user(&h).is_ok());
        let b = base64::engine::general_purpose::STANDARD.encode("user:");
        h.insert(header::AUTHORIZATION, format!("Basic {b}").parse().unwrap());
        assert_eq!(check_user(&h).unwrap_err().code, Code::PermissionDenied);
    }

    #[test]
    fn entries() {
        let st = FileStat {
            path: "/root/a.txt".into(),
            kind: FileKind::File,
            size: 256,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_unix: 0,
            symlink_target: None,
        };
        let v = stat_entry(&st);
        assert_eq!(v["name"], "a.txt");
        assert_eq!(v["size"], "256");
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["modifiedTime"], "1970-01-01T00:00:00Z");
    }
}
