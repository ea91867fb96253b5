//! `/v1/sandboxes`: spawn, list, get, delete, and the agent calls forkd
//! has (ping, exec, eval), plus ours: streaming exec, console logs, TTL.

use super::error::{ApiError, ApiResult};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_api::{EvalBody, EvalReply, ExecBody, ExecReply, SandboxInfo, SpawnBody};
use forkd_node::error::GuestErrorKind;
use forkd_node::{Error, ExecEvent, ExecSpec, Node, SandboxRecord, SpawnRequest};
use serde_json::{json, Value};
use std::sync::Arc;

type D = State<Arc<Node>>;

/// forkd's `SandboxInfo` of a node's sandbox record.
pub fn info(r: SandboxRecord) -> SandboxInfo {
    let egress = r.effective_egress();
    SandboxInfo {
        id: r.id,
        snapshot_tag: r.snapshot_tag,
        netns: r.net.as_ref().map(|n| n.netns.clone()),
        guest_addr: r.net.as_ref().map(|n| n.guest_addr.to_string()),
        created_at_unix: r.created_at_unix,
        pid: Some(r.pid),
        memory_limit_mib: r.memory_limit_mib,
        has_branched: r.branch_count > 0,
        last_branch_memory_path: None,
        branch_count: r.branch_count,
        snapshot_id: r.snapshot_id,
        hostname: r.hostname,
        expires_at_unix: r.expires_at_unix,
        pool_hit: r.pool_hit,
        spawn_ms: r.spawn_ms,
        cpus: r.cpus,
        pids_max: r.pids_max,
        ports: r.ports,
        egress,
    }
}

/// `POST /v1/sandboxes`.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes",
    request_body = SpawnBody,
    responses(
        (status = 201, description = "Every child's agent answered", body = Vec<SandboxInfo>),
        (status = 400, description = "A bad tag, count, limit or network request", body = forkd_api::ErrorBody),
        (status = 404, description = "Unknown snapshot", body = forkd_api::ErrorBody),
        (status = 409, description = "The snapshot cannot be restored on this host", body = forkd_api::ErrorBody),
        (status = 503, description = "At max_sandboxes, or under the memory/disk floor", body = forkd_api::ErrorBody),
        (status = 500, description = "A restore failed; every child of the request is destroyed", body = forkd_api::ErrorBody),
    ))]
pub async fn spawn(
    State(d): D,
    Json(b): Json<SpawnBody>,
) -> ApiResult<(StatusCode, Json<Vec<SandboxInfo>>)> {
    // Translation only: the node validates (SpawnRequest::validate).
    let req = SpawnRequest {
        tag: b.snapshot_tag,
        n: b.n,
        memory_limit_mib: b.memory_limit_mib,
        cpus: b.cpus,
        pids_max: b.pids_max,
        ttl_secs: b.ttl_secs,
        per_child_netns: b.per_child_netns,
        live_fork: b.live_fork,
        net: b.net,
        network: b.network,
        ports: b.ports,
        volumes: b.volumes,
        ca_certs: b.ca_certs,
        ..Default::default()
    };
    let recs = d.spawn(req).await?;
    Ok((
        StatusCode::CREATED,
        Json(recs.into_iter().map(info).collect()),
    ))
}

/// `GET /v1/sandboxes`.
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    responses((status = 200, description = "Every sandbox", body = Vec<SandboxInfo>)))]
pub async fn list(State(d): D) -> Json<Vec<SandboxInfo>> {
    Json(d.list().into_iter().map(info).collect())
}

/// `GET /v1/sandboxes/:id`.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    responses(
        (status = 200, description = "The sandbox", body = SandboxInfo),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
    ))]
pub async fn get(State(d): D, Path(id): Path<String>) -> ApiResult<Json<SandboxInfo>> {
    Ok(Json(info(d.get(&id)?)))
}

/// `DELETE /v1/sandboxes/:id`.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    responses(
        (status = 204, description = "QEMU killed; its directory, cgroup and record gone"),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
    ))]
pub async fn delete(State(d): D, Path(id): Path<String>) -> ApiResult<StatusCode> {
    d.destroy(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sandboxes/:id/ping`: forkd's pong fields plus the agent's.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/ping", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    responses(
        (status = 200, description = "forkd's `pong, numpy_version, pid, agent_lang, warmup_ready` and the agent's own fields", body = Object),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
        (status = 500, description = "The agent did not answer", body = forkd_api::ErrorBody),
    ))]
pub async fn ping(State(d): D, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    // forkd answers 500 when the agent does not answer; its CLI reads that
    // as "not ready yet".
    let p = d.ping(&id).await.map_err(|e| match e {
        e @ Error::NotFound { .. } => ApiError::from(e),
        e => ApiError::internal(format!("the sandbox's agent did not answer: {e}")),
    })?;
    let mut v = serde_json::to_value(&p).map_err(ApiError::internal)?;
    let extra = json!({
        "pong": true,
        "numpy_version": p.numpy_version.clone().unwrap_or_else(|| "not-installed".into()),
        "pid": 1,
        // Agents before Node mode are Python.
        "agent_lang": p.agent_lang.as_deref().unwrap_or("python"),
        "warmup_ready": p.warm_ready,
    });
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    Ok(Json(v))
}

/// Builds the agent's exec spec from a request body.
fn exec_spec(b: &ExecBody) -> ApiResult<ExecSpec> {
    if !(b.timeout_secs > 0.0 && b.timeout_secs <= 86_400.0) {
        return Err(ApiError::bad_request("timeout_secs must be in (0, 86400]"));
    }
    let (argv, shell) = match (&b.cmd, b.args.is_empty()) {
        (Some(c), true) => (None, Some(c.clone())),
        (None, false) => (Some(b.args.clone()), None),
        (Some(_), false) => return Err(ApiError::bad_request("give args or cmd, not both")),
        (None, true) => return Err(ApiError::bad_request("args must be a non-empty list")),
    };
    Ok(ExecSpec {
        argv,
        shell,
        env: b.env.clone(),
        cwd: b.cwd.clone(),
        timeout_ms: Some((b.timeout_secs * 1000.0) as u64),
        ..Default::default()
    })
}

/// `POST /v1/sandboxes/:id/exec`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    request_body = ExecBody,
    responses(
        (status = 200, description = "The command ran (a timeout answers `timed_out: true`)", body = ExecReply),
        (status = 400, description = "Empty args, both args and cmd, a bad timeout", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
    ))]
pub async fn exec(
    State(d): D,
    Path(id): Path<String>,
    Json(b): Json<ExecBody>,
) -> ApiResult<Json<ExecReply>> {
    d.get(&id)?;
    let spec = exec_spec(&b)?;
    let stdin = b.stdin.clone().unwrap_or_default();
    let out = match d.exec(&id, spec, stdin.as_bytes()).await {
        Ok(o) => o,
        // As forkd: a command that cannot start is a failed command (200),
        // not a missing sandbox. Shell conventions: 127 not found, 126 not
        // executable.
        Err(Error::Guest(e))
            if matches!(
                e.kind,
                GuestErrorKind::NotFound | GuestErrorKind::PermissionDenied
            ) =>
        {
            let code = if e.kind == GuestErrorKind::NotFound {
                127
            } else {
                126
            };
            return Ok(Json(ExecReply {
                stdout: String::new(),
                stderr: format!("{}\n", e.message),
                exit_code: code,
                signal: None,
                timed_out: false,
                duration_ms: 0,
            }));
        }
        Err(e) => return Err(e.into()),
    };
    Ok(Json(ExecReply {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        exit_code: i64::from(out.result.status_code()),
        signal: out.result.signal,
        timed_out: out.result.timed_out,
        duration_ms: out.result.duration_ms,
    }))
}

/// `POST /v1/sandboxes/:id/exec/stream`: NDJSON, one object per line:
/// `{"type":"started","pid"}`, `{"type":"stdout"|"stderr","data"}` as
/// output arrives, then `{"type":"exit","exit_code","signal","timed_out",
/// "duration_ms"}` or `{"type":"error","error"}`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/stream", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    request_body = ExecBody,
    responses(
        (status = 200, description = "NDJSON, a line per event: `{\"type\":\"started\",\"pid\"}`, `{\"type\":\"stdout\"|\"stderr\",\"data\"}` as output arrives, then `{\"type\":\"exit\",\"exit_code\",\"signal\",\"timed_out\",\"duration_ms\"}` or `{\"type\":\"error\",\"error\"}`", body = String, content_type = "application/x-ndjson"),
        (status = 400, description = "As exec", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
    ))]
pub async fn exec_stream(
    State(d): D,
    Path(id): Path<String>,
    Json(b): Json<ExecBody>,
) -> ApiResult<Response> {
    d.get(&id)?;
    let spec = exec_spec(&b)?;
    let stdin = b.stdin.clone().unwrap_or_default();
    let process = d.exec_stream(&id, spec, stdin.as_bytes())?;
    let stream = futures::stream::unfold((process, false), |(mut p, done)| async move {
        if done {
            return None;
        }
        let (line, last) = match p.next().await {
            Some(ev) => stream_line(ev),
            None => (
                json!({"type": "error", "error": "the agent channel closed"}),
                true,
            ),
        };
        let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
        bytes.push(b'\n');
        Some((Ok::<_, std::convert::Infallible>(bytes), (p, last)))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response())
}

/// One NDJSON line for a streaming-exec event, and whether it is the last.
fn stream_line(ev: ExecEvent) -> (Value, bool) {
    match ev {
        ExecEvent::Started { pid } => (json!({"type": "started", "pid": pid}), false),
        ExecEvent::Stdout(b) => (
            json!({"type": "stdout", "data": String::from_utf8_lossy(&b)}),
            false,
        ),
        ExecEvent::Stderr(b) => (
            json!({"type": "stderr", "data": String::from_utf8_lossy(&b)}),
            false,
        ),
        ExecEvent::Exited(r) => (
            json!({"type": "exit", "exit_code": r.status_code(), "signal": r.signal,
                   "timed_out": r.timed_out, "duration_ms": r.duration_ms}),
            true,
        ),
        ExecEvent::Failed(e) => (json!({"type": "error", "error": e.to_string()}), true),
    }
}

/// `POST /v1/sandboxes/:id/eval`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/eval", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    request_body = EvalBody,
    responses(
        (status = 200, description = "Evaluated; a raised exception is `error`, `traceback`, `exit_code: 1`", body = EvalReply),
        (status = 400, description = "No code, code over the frame limit, a bad timeout", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
        (status = 409, description = "The image has no Python", body = forkd_api::ErrorBody),
        (status = 504, description = "The evaluation timed out", body = forkd_api::ErrorBody),
    ))]
pub async fn eval(
    State(d): D,
    Path(id): Path<String>,
    Json(b): Json<EvalBody>,
) -> ApiResult<Json<EvalReply>> {
    d.get(&id)?;
    let timeout_ms = match b.timeout_secs {
        Some(s) if !(s > 0.0 && s <= 86_400.0) => {
            return Err(ApiError::bad_request("timeout_secs must be in (0, 86400]"))
        }
        Some(s) => Some((s * 1000.0) as u64),
        None => Some(300_000),
    };
    let r = d.eval(&id, &b.code, timeout_ms).await?;
    Ok(Json(EvalReply {
        exit_code: if r.error.is_some() { 1 } else { 0 },
        result: r.result,
        result_json: r.result_json,
        error: r.error,
        traceback: r.traceback,
        stdout: r.stdout,
        stderr: r.stderr,
    }))
}

/// `GET /v1/sandboxes/:id/logs`: the guest console since the sandbox
/// started (text; its last MiB).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/logs", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    responses(
        (status = 200, description = "The guest console since the sandbox started (its last MiB)", body = String, content_type = "text/plain"),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
    ))]
pub async fn logs(State(d): D, Path(id): Path<String>) -> ApiResult<Response> {
    let text = d.logs(&id)?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

/// `POST /v1/sandboxes/:id/ttl`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TtlBody {
    /// Seconds from now; 0 clears the TTL.
    ttl_secs: u64,
}

/// `POST /v1/sandboxes/:id/ttl {ttl_secs}`: sets (or with 0 clears) when
/// the sandbox is killed automatically.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/ttl", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    request_body = TtlBody,
    responses(
        (status = 200, description = "The sandbox, with its new `expires_at_unix`", body = SandboxInfo),
        (status = 400, description = "ttl_secs over 10 years", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
    ))]
pub async fn set_ttl(
    State(d): D,
    Path(id): Path<String>,
    Json(b): Json<TtlBody>,
) -> ApiResult<Json<SandboxInfo>> {
    let rec = d.set_ttl(&id, b.ttl_secs).await?;
    Ok(Json(info(rec)))
}

/// `PUT /v1/sandboxes/:id/network {allow_out, deny_out}`: replaces a
/// running sandbox's egress policy (docs/network.md, "Changing a running
/// sandbox's policy"). `{}` gives what a spawn of its snapshot gets
/// (its pool's policy, else the config's).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", tag = "sandboxes", params(("id" = String, Path, description = "Sandbox id (`sb-` + 24 hex digits)")),
    request_body(content = forkd_api::EgressSchema, description = "The whole new policy: what it leaves out is cleared"),
    responses(
        (status = 200, description = "The sandbox, with its new `egress`", body = SandboxInfo),
        (status = 400, description = "A bad or unresolvable entry, too many entries; a sandbox without a network (its snapshot has none)", body = forkd_api::ErrorBody),
        (status = 404, description = "No such sandbox", body = forkd_api::ErrorBody),
        (status = 500, description = "The policy could not be written: the old one stays, or the sandbox was killed (the message says which)", body = forkd_api::ErrorBody),
    ))]
pub async fn set_network(
    State(d): D,
    Path(id): Path<String>,
    Json(policy): Json<forkd_net::EgressPolicy>,
) -> ApiResult<Json<SandboxInfo>> {
    let policy = (policy != forkd_net::EgressPolicy::default()).then_some(policy);
    let rec = d.set_egress(&id, policy).await?;
    Ok(Json(info(rec)))
}
