//! The E2B control plane (`E2B_API_URL`): sandboxes as the SDK's REST API
//! sees them. Answers `{"code": <status>, "message": "..."}` on errors,
//! with the statuses the SDK branches on (201 create, 204 kill and
//! timeout, 404 unknown sandbox, 401 bad key).
//!
//! | route | what |
//! |---|---|
//! | `POST /sandboxes`, `POST /v2/sandboxes` | create from a template (= snapshot tag) |
//! | `GET /sandboxes`, `GET /v2/sandboxes` | list, with `metadata`, `state`, `limit`, `nextToken` |
//! | `GET /sandboxes/{id}` | info |
//! | `DELETE /sandboxes/{id}` | kill |
//! | `POST /sandboxes/{id}/timeout` | set the TTL |
//! | `PUT /sandboxes/{id}/network` | replace a running sandbox's egress ([`crate::network`]) |
//! | `POST [/v2]/sandboxes/{id}/connect` | connect (extends the TTL, never shortens it); resumes a paused sandbox |
//! | `POST /sandboxes/{id}/fork` | branch the sandbox into a snapshot, spawn `count` children of it |
//! | `POST /sandboxes/{id}/pause`, `/resume` | pause to the store, resume as the same sandbox ([`crate::pause`]) |
//! | `POST /sandboxes/{id}/snapshots`, `GET /snapshots`, `DELETE /templates/{id}` | snapshots ([`crate::snapshots`]) |
//! | `GET /sandboxes/{id}/metrics` | CPU, memory, disk as the guest sees them ([`crate::metrics`]) |
//! | `POST /volumes`, `GET /volumes[/{id}]`, `DELETE /volumes/{id}` | E2B volumes ([`forkd_e2b_volumes`]) |
//! | `GET [/v2]/sandboxes/{id}/logs` | what envd and the control plane logged of it ([`crate::logs`]) |

use crate::error::{E2bError, E2bResult};
use crate::logs::{self, Level};
use crate::network::{egress_of, port_access_of};
use crate::state::{E2b, E2bSandbox, ENVD_VERSION};
use crate::{network, pause, snapshots};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use forkd_api::BranchBody;
use forkd_edge::paging;
use forkd_node::limits::{check_env, check_metadata, MAX_TTL_SECS};
use forkd_node::{SandboxRecord, SpawnRequest};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

type E = State<Arc<E2b>>;

/// The TTL of a sandbox whose create sets no `timeout` (E2B's default).
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;
pub use forkd_edge::paging::MAX_PAGE;

type R<T> = E2bResult<T>;

/// The control plane's routes, behind the API-key check.
pub fn routes(e: Arc<E2b>) -> Router {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/network", put(network::update))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/logs", get(logs_v1))
        .route("/v2/sandboxes/{id}/logs", get(logs_v2))
        .route("/volumes", post(volume_create).get(volume_list))
        .route("/volumes/{id}", get(volume_get).delete(volume_delete))
        .route("/snapshots", get(snapshots::list))
        .route("/templates/{id}", delete(snapshots::delete))
        .route("/sandboxes/{id}/pause", post(pause::pause))
        .route("/sandboxes/{id}/resume", post(pause::resume))
        .fallback(not_served)
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20))
        .layer(middleware::from_fn_with_state(e.clone(), api_key))
        .with_state(e.clone())
        // A volume's files take its token, not the API key.
        .merge(forkd_e2b_volumes::files::routes(e.volumes.clone()))
}

async fn api_key(State(e): E, req: Request, next: Next) -> Response {
    let got = req.headers().get("x-api-key").map(|v| v.as_bytes());
    if !e.key_ok(got) {
        let why = if got.is_none() {
            "missing X-API-KEY: set E2B_API_KEY to poold's E2B key (docs/e2b.md)"
        } else {
            "wrong X-API-KEY: E2B_API_KEY must be poold's E2B key (e2b.api_key_file, else its bearer token)"
        };
        return E2bError::unauthorized(why).into_response();
    }
    next.run(req).await
}

async fn not_served(req: Request) -> E2bError {
    E2bError::not_found(format!(
        "{} {} is not part of poold's E2B API (docs/e2b.md lists what is)",
        req.method(),
        req.uri().path()
    ))
}

/// `NewSandbox` as both SDK generations send it; other keys are ignored.
#[derive(Debug, Deserialize)]
struct NewSandbox {
    #[serde(rename = "templateID", alias = "template_id")]
    template_id: String,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default, rename = "envVars", alias = "env_vars")]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default, rename = "autoPause", alias = "auto_pause")]
    auto_pause: Option<bool>,
    /// false: a filesystem-only auto-pause (refused).
    #[serde(default, rename = "autoPauseMemory")]
    auto_pause_memory: Option<bool>,
    /// `{"enabled": bool}`: resume on traffic (refused when enabled).
    #[serde(default, rename = "autoResume")]
    auto_resume: Option<Value>,
    #[serde(default, rename = "volumeMounts", alias = "volume_mounts")]
    volume_mounts: Option<Vec<forkd_e2b_volumes::Mount>>,
    /// E2B's hosted MCP gateway settings (refused: poold does not run it).
    #[serde(default)]
    mcp: Option<Value>,
    /// false: the sandbox reaches nothing (E2B's deny-all).
    #[serde(default, alias = "allowInternetAccess")]
    allow_internet_access: Option<bool>,
    /// E2B's `{allowOut, denyOut, allowPublicTraffic, maskRequestHost}`.
    #[serde(default)]
    network: Option<Value>,
}

pub(crate) fn bad(m: impl Into<String>) -> E2bError {
    E2bError::bad_request(m)
}

/// A JSON body, where an empty one is the default (the SDK posts none for
/// a call without options).
pub(crate) fn body_or_default<T: serde::de::DeserializeOwned + Default>(
    body: &[u8],
    what: &str,
) -> R<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|err| bad(format!("bad {what} body: {err}")))
}

pub(crate) fn check_timeout(t: u64) -> R<u64> {
    if t == 0 || t > MAX_TTL_SECS {
        return Err(bad(format!(
            "timeout must be between 1 and {MAX_TTL_SECS} seconds"
        )));
    }
    Ok(t)
}

fn metadata_ok(m: &BTreeMap<String, String>) -> R<()> {
    check_metadata(m).map_err(bad)
}

/// `POST /sandboxes`, `POST /v2/sandboxes`: a sandbox of the template
/// (snapshot tag); a pool hit when the tag's pool has a child ready.
async fn create(State(e): E, Json(b): Json<NewSandbox>) -> R<(StatusCode, Json<Value>)> {
    let timeout = check_timeout(b.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS))?;
    let metadata = b.metadata.unwrap_or_default();
    metadata_ok(&metadata)?;
    let env = b.env_vars.unwrap_or_default();
    check_env(&env).map_err(|m| bad(format!("envVars: {m}")))?;
    if b.auto_pause_memory == Some(false) {
        return Err(bad(
            "autoPauseMemory: false (a filesystem-only auto-pause) is not supported by poold; leave it out to pause with memory",
        ));
    }
    if b.auto_resume.as_ref().and_then(|v| v.get("enabled")) == Some(&Value::Bool(true)) {
        return Err(bad(
            "autoResume is not supported by poold: traffic does not wake a paused sandbox; connect to it (Sandbox.connect) to resume it",
        ));
    }
    if b.mcp.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "mcp: E2B's MCP gateway is an E2B cloud service poold does not run; leave it out and start MCP servers in the sandbox yourself (reach them by get_host(port))",
        ));
    }
    let volumes = e
        .volumes
        .mounts(b.volume_mounts.as_deref().unwrap_or(&[]))?;
    let (net, network) = egress_of(b.allow_internet_access, b.network.as_ref())?;
    let port_access = port_access_of(b.network.as_ref())?;
    // The metadata, envs and template alias are the node's, persisted
    // with the sandbox: they survive a poold restart.
    let req = SpawnRequest {
        tag: b.template_id.clone(),
        n: 1,
        ttl_secs: Some(timeout),
        metadata,
        envs: env,
        alias: Some(b.template_id),
        net,
        network,
        auto_pause: b.auto_pause == Some(true),
        port_access,
        volumes,
        ..Default::default()
    };
    let recs = e.node.spawn(req).await?;
    let Some(rec) = recs.into_iter().next() else {
        return Err(E2bError::from(forkd_node::Error::internal(
            "spawn returned no sandbox",
        )));
    };
    let template = sandbox_json(&e, &rec);
    e.logs.record(
        &rec.id,
        Level::Info,
        "Sandbox created",
        &[("template_id", template["templateID"].as_str().unwrap_or(""))],
    );
    Ok((StatusCode::CREATED, Json(template)))
}

/// The `Sandbox` answer of create and connect. Its `domain` makes the
/// SDK's `get_host(port)` a name the sandbox plane routes to the port.
pub(crate) fn sandbox_json(e: &E2b, rec: &SandboxRecord) -> Value {
    let template = rec.alias.as_deref().unwrap_or(&rec.snapshot_tag);
    json!({
        "templateID": template,
        "sandboxID": rec.id,
        "clientID": "forkd",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": rec.access_token.as_str(),
        // The SDKs send it (as E2B-Traffic-Access-Token) on the code
        // interpreter's /contexts calls, which carry no X-Access-Token: the
        // sandbox plane takes either header (crate::sandbox).
        "trafficAccessToken": rec.access_token.as_str(),
        "domain": e.domain,
        "alias": template,
    })
}

pub(crate) fn rfc3339(unix: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(unix)).to_string()
}

/// `SandboxDetail` / `ListedSandbox`.
async fn detail_json(e: &E2b, sb: &E2bSandbox) -> Value {
    let rec = &sb.rec;
    let (cpus, mem) = shape(e, rec).await;
    let end = if rec.expires_at_unix != 0 {
        rec.expires_at_unix
    } else {
        rec.created_at_unix.saturating_add(MAX_TTL_SECS)
    };
    json!({
        "templateID": sb.template(),
        "alias": sb.template(),
        "sandboxID": sb.id(),
        "clientID": "forkd",
        "startedAt": rfc3339(rec.created_at_unix),
        "endAt": rfc3339(end),
        "cpuCount": cpus,
        "memoryMB": mem,
        "diskSizeMB": 0,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": rec.access_token.as_str(),
        "metadata": rec.metadata,
        "state": "running",
        "volumeMounts": e.volumes.mounted(&rec.volumes),
    })
}

/// vCPUs and MiB of RAM of a sandbox: its limits where it has them, else
/// its snapshot's machine.
async fn shape(e: &E2b, rec: &SandboxRecord) -> (u64, u64) {
    let machine = e.node.snapshot_machine(&rec.snapshot_tag).await.ok();
    let cpus = rec
        .cpus
        .map(|c| c.ceil() as u64)
        .or(machine.as_ref().map(|m| u64::from(m.vcpus)))
        .unwrap_or(1);
    let mem = rec
        .memory_limit_mib
        .or(machine.as_ref().map(|m| m.mem_mib))
        .unwrap_or(0);
    (cpus, mem)
}

fn sandbox_or_404(e: &E2b, id: &str) -> R<E2bSandbox> {
    e.sandbox_or_404(id)
}

/// `GET /sandboxes/{id}`: running or paused.
async fn info(State(e): E, Path(id): Path<String>) -> R<Json<Value>> {
    if let Some(p) = e.node.paused(&id) {
        return Ok(Json(pause::detail_json(&p)));
    }
    let sb = sandbox_or_404(&e, &id)?;
    Ok(Json(detail_json(&e, &sb).await))
}

/// `DELETE /sandboxes/{id}`: 204 (a paused sandbox's stored state goes
/// too), or 404 when there is no such sandbox.
async fn kill(State(e): E, Path(id): Path<String>) -> R<StatusCode> {
    let gone = e.node.destroy(&id).await;
    e.forget(&id);
    match gone {
        Ok(()) => {
            e.logs.record(
                &id,
                Level::Info,
                "Killing sandbox",
                &[("kill_reason", "killed by the API")],
            );
            Ok(StatusCode::NO_CONTENT)
        }
        Err(forkd_node::Error::NotFound { .. }) => {
            Err(E2bError::not_found(format!("sandbox {id:?} not found")))
        }
        Err(err) => Err(err.into()),
    }
}

/// `GET /sandboxes/{id}/logs?start&limit`: E2B's v1 log API. Like E2B,
/// a sandbox with no log (unknown, or pushed out) answers an empty one.
async fn logs_v1(State(e): E, Path(id): Path<String>, RawQuery(q): RawQuery) -> R<Json<Value>> {
    let q = logs::V1Query::parse(q.as_deref())?;
    Ok(Json(e.logs.v1(&id, &q)))
}

/// `GET /v2/sandboxes/{id}/logs?cursor&limit&direction&level&search`.
async fn logs_v2(State(e): E, Path(id): Path<String>, RawQuery(q): RawQuery) -> R<Json<Value>> {
    let q = logs::V2Query::parse(q.as_deref())?;
    Ok(Json(e.logs.v2(&id, &q)))
}

#[derive(Deserialize)]
struct NewVolume {
    name: String,
}

/// `POST /volumes {name}`: 201 with its id and content-API token.
async fn volume_create(State(e): E, Json(b): Json<NewVolume>) -> R<(StatusCode, Json<Value>)> {
    Ok((StatusCode::CREATED, Json(e.volumes.create(&b.name)?)))
}

/// `GET /volumes`.
async fn volume_list(State(e): E) -> R<Json<Value>> {
    Ok(Json(e.volumes.list()?))
}

/// `GET /volumes/{id}`.
async fn volume_get(State(e): E, Path(id): Path<String>) -> R<Json<Value>> {
    Ok(Json(e.volumes.get(&id)?))
}

/// `DELETE /volumes/{id}`: 204, or 404.
async fn volume_delete(State(e): E, Path(id): Path<String>) -> R<StatusCode> {
    e.volumes.delete(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct TimeoutBody {
    timeout: u64,
}

/// `POST /sandboxes/{id}/timeout {"timeout": secs}`: killed that long from now.
async fn set_timeout(
    State(e): E,
    Path(id): Path<String>,
    Json(b): Json<TimeoutBody>,
) -> R<StatusCode> {
    let t = check_timeout(b.timeout)?;
    sandbox_or_404(&e, &id)?;
    e.node.set_ttl(&id, t).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct ConnectBody {
    #[serde(default)]
    timeout: Option<u64>,
    /// false: resume a paused sandbox by a cold boot (refused).
    #[serde(default)]
    memory: Option<bool>,
}

/// `POST [/v2]/sandboxes/{id}/connect`: the sandbox with its token (every
/// sandbox has one, those spawned through `/v1` too, and keeps it across
/// poold restarts); a `timeout` extends its TTL, never shortens it. A
/// paused sandbox is resumed (201, as E2B answers a resume).
async fn connect(
    State(e): E,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> R<(StatusCode, Json<Value>)> {
    let b: ConnectBody = body_or_default(&body, "connect")?;
    if e.node.paused(&id).is_some() {
        pause::check_connect_memory(b.memory)?;
        let t = check_timeout(b.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS))?;
        let v = pause::resume_paused(&e, &id, t, None).await?;
        return Ok((StatusCode::CREATED, Json(v)));
    }
    let sb = sandbox_or_404(&e, &id)?;
    if let Some(t) = b.timeout {
        let t = check_timeout(t)?;
        let now = forkd_snapshot::unix_now();
        let cur = sb.rec.expires_at_unix;
        if cur != 0 && cur < now + t {
            e.node.set_ttl(&id, t).await?;
        }
    }
    Ok((StatusCode::OK, Json(sandbox_json(&e, &sb.rec))))
}

/// Most children of one fork (the SDK's own bound).
pub const MAX_FORKS: usize = 20;

#[derive(Debug, Default, Deserialize)]
struct ForkBody {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    count: Option<usize>,
}

/// `POST /sandboxes/{id}/fork {timeout, count}`: poold's branch. The
/// sandbox is captured live into snapshot `e2b-fork-<hex>` (it keeps
/// running, its TTL untouched), then `count` children are spawned from it,
/// each with the parent's template, metadata and env. 201 with one
/// `{"sandbox"}` per child, or one `{"error"}` per child when the spawn
/// failed (a spawn is all or nothing). The snapshot exists only to spawn
/// from: the node deletes it once none of its children is left (E2B's
/// own fork checkpoint lives seconds), so forking per request does not
/// grow the store.
async fn fork(
    State(e): E,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> R<(StatusCode, Json<Vec<Value>>)> {
    let b: ForkBody = body_or_default(&body, "fork")?;
    let count = b.count.unwrap_or(1);
    if !(1..=MAX_FORKS).contains(&count) {
        return Err(bad(format!("count must be 1-{MAX_FORKS}")));
    }
    let timeout = check_timeout(b.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS))?;
    let parent = sandbox_or_404(&e, &id)?;
    let tag = format!("e2b-fork-{}", forkd_snapshot::random_hex(8));
    let b = BranchBody {
        tag: Some(tag.clone()),
        ..Default::default()
    };
    e.node.branch_to_spawn(&id, b).await?;
    // Its network now: an update may have landed while this request
    // waited for the branch.
    let net_of = e.node.get(&id).unwrap_or_else(|_| parent.rec.clone());
    let req = SpawnRequest {
        tag: tag.clone(),
        n: count,
        ttl_secs: Some(timeout),
        metadata: parent.rec.metadata.clone(),
        envs: parent.rec.envs.clone(),
        alias: Some(parent.template().to_string()),
        port_access: parent.rec.port_access.clone(),
        // The parent's network, as E2B's forks keep it: none when it has
        // none (`allow_internet_access: false`), else its egress policy.
        // Left to the defaults, children of a cut-off parent could reach
        // the internet.
        net: Some(net_of.net.is_some()),
        network: net_of.egress,
        ..Default::default()
    };
    let spawned = e.node.spawn(req).await;
    if let Err(err) = e.node.reclaim_when_unused(&tag).await {
        tracing::warn!("fork snapshot {tag} will not be reclaimed: {err}");
    }
    let out = match spawned {
        Ok(recs) => recs
            .iter()
            .map(|r| json!({"sandbox": sandbox_json(&e, r)}))
            .collect(),
        Err(err) => {
            let err = E2bError::from(err);
            let one = json!({"error": {"code": err.status.as_u16(), "message": err.message}});
            vec![one; count]
        }
    };
    Ok((StatusCode::CREATED, Json(out)))
}

/// `GET /sandboxes/{id}/metrics` ([`crate::metrics`]): a sample taken now,
/// kept with the sandbox, and every kept sample in `[start, end]`.
async fn metrics(
    State(e): E,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> R<Json<Vec<Value>>> {
    let sb = sandbox_or_404(&e, &id)?;
    let now = forkd_snapshot::unix_now();
    let (start, end) = crate::metrics::parse_range(q.as_deref(), now)?;
    let sample = crate::metrics::sample(&e.node, &id, now).await?;
    sb.session.metrics.push(sample);
    Ok(Json(sb.session.metrics.range(start, end)))
}

/// The list filters, from the query string.
#[derive(Debug, Default, PartialEq)]
struct ListQuery {
    metadata: BTreeMap<String, String>,
    /// None: any state.
    states: Option<Vec<String>>,
    /// Only sandboxes started at or after this time (Unix seconds).
    started_after: Option<u64>,
    /// Only sandboxes of this template (its alias, else its snapshot tag).
    template: Option<String>,
    limit: usize,
    next: Option<String>,
}

fn parse_list_query(q: Option<&str>) -> R<ListQuery> {
    let mut out = ListQuery {
        limit: MAX_PAGE,
        ..Default::default()
    };
    for (k, v) in form_urlencoded::parse(q.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            // A query string itself: `k1=v1&k2=v2`, URL-encoded once more.
            "metadata" | "query" => {
                for (mk, mv) in form_urlencoded::parse(v.as_bytes()) {
                    out.metadata.insert(mk.into_owned(), mv.into_owned());
                }
            }
            "state" => out
                .states
                .get_or_insert_with(Vec::new)
                .extend(v.split(',').filter(|s| !s.is_empty()).map(str::to_string)),
            "limit" => out.limit = paging::parse_limit(&v).map_err(bad)?,
            "nextToken" | "next_token" => out.next = Some(v.into_owned()),
            "startedAfter" => out.started_after = Some(parse_started_after(&v)?),
            "template" => out.template = Some(v.into_owned()),
            _ => {}
        }
    }
    metadata_ok(&out.metadata)?;
    Ok(out)
}

/// `startedAfter`: an RFC 3339 time with its offset, as the SDKs send it.
fn parse_started_after(v: &str) -> R<u64> {
    let t = chrono::DateTime::parse_from_rfc3339(v).map_err(|e| {
        bad(format!(
            "startedAfter {v:?} is not an RFC 3339 time ({e}); send e.g. 2026-01-02T03:04:05Z"
        ))
    })?;
    // Before 1970 is every sandbox.
    Ok(u64::try_from(t.timestamp()).unwrap_or(0))
}

/// Whether a sandbox started at `started` from `template` passes the
/// query's time and template filters (metadata is checked apart).
fn passes(q: &ListQuery, started: u64, template: &str) -> bool {
    q.started_after.is_none_or(|t| started >= t)
        && q.template.as_deref().is_none_or(|want| want == template)
}

/// `GET [/v2]/sandboxes`: every sandbox, running (those spawned through
/// `/v1` too) and paused, oldest first, `limit` per page; `x-next-token`
/// names the next.
async fn list(State(e): E, RawQuery(q): RawQuery) -> R<Response> {
    let q = parse_list_query(q.as_deref())?;
    let wants = |state: &str| {
        q.states
            .as_ref()
            .is_none_or(|s| s.iter().any(|s| s == state))
    };
    let mut all: Vec<(u64, String, Option<forkd_node::PausedSandbox>)> = Vec::new();
    if wants("running") {
        all.extend(
            e.node
                .list()
                .into_iter()
                .map(|r| (r.created_at_unix, r.id, None)),
        );
    }
    if wants("paused") {
        all.extend(
            e.node
                .paused_list()
                .into_iter()
                .map(|p| (p.created_at_unix, p.id.clone(), Some(p))),
        );
    }
    all.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let start = paging::start_after(
        all.iter().map(|s| s.1.as_str()),
        q.next.as_deref(),
        "sandbox",
    )
    .map_err(bad)?;
    let mut page = Vec::new();
    let mut last = None;
    let mut more = false;
    for (started, id, paused) in &all[start..] {
        let (metadata, template, detail) = match paused {
            Some(p) => {
                let t = p.alias.clone().unwrap_or_else(|| p.snapshot_tag.clone());
                (p.metadata.clone(), t, None)
            }
            None => match e.sandbox(id) {
                Some(sb) => (sb.rec.metadata.clone(), sb.template().to_string(), Some(sb)),
                None => continue,
            },
        };
        if !q.metadata.iter().all(|(k, v)| metadata.get(k) == Some(v))
            || !passes(&q, *started, &template)
        {
            continue;
        }
        if page.len() == q.limit {
            more = true;
            break;
        }
        page.push(match (&detail, paused) {
            (Some(sb), _) => detail_json(&e, sb).await,
            (None, Some(p)) => pause::detail_json(p),
            (None, None) => continue,
        });
        last = Some(id.clone());
    }
    Ok(paging::reply(page, last.as_deref().filter(|_| more)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_query_parses_the_sdk_forms() {
        let q = parse_list_query(Some(
            "state=running,paused&metadata=user%3Dalice%26env%3Dprod&limit=2&nextToken=sb-1",
        ))
        .unwrap();
        assert_eq!(q.states, Some(vec!["running".into(), "paused".into()]));
        // The SDKs' startedAfter: isoformat with an offset.
        let t = parse_list_query(Some(
            "startedAfter=2026-01-02T03%3A04%3A05%2B01%3A00&template=base",
        ))
        .unwrap();
        assert_eq!(t.started_after, Some(1_767_319_445));
        assert!(passes(&t, 1_767_319_445, "base"), "at the time is after");
        assert!(!passes(&t, 1_767_319_444, "base"), "a second before");
        assert!(!passes(&t, 1_767_319_445, "other"), "another template");
        let e = parse_list_query(Some("startedAfter=yesterday")).unwrap_err();
        assert!(e.message.contains("RFC 3339"), "{}", e.message);
        assert_eq!(q.metadata["user"], "alice");
        assert_eq!(q.metadata["env"], "prod");
        assert_eq!((q.limit, q.next.as_deref()), (2, Some("sb-1")));
        let q = parse_list_query(None).unwrap();
        assert_eq!((q.limit, q.states.is_none()), (MAX_PAGE, true));
        assert!(parse_list_query(Some("limit=0")).is_err());
        assert!(parse_list_query(Some("limit=101")).is_err());
    }

    #[test]
    fn env_and_timeout_checks() {
        let ok: BTreeMap<_, _> = [("FOO_1".to_string(), "x".to_string())].into();
        assert!(check_env(&ok).is_ok());
        for bad in ["1X", "A-B", "", "A B"] {
            let m: BTreeMap<_, _> = [(bad.to_string(), "x".to_string())].into();
            assert!(check_env(&m).is_err(), "{bad:?}");
        }
        let nul: BTreeMap<_, _> = [("A".to_string(), "a\0b".to_string())].into();
        assert!(check_env(&nul).is_err());
        assert!(check_timeout(0).is_err());
        assert!(check_timeout(MAX_TTL_SECS + 1).is_err());
        assert_eq!(check_timeout(300).unwrap(), 300);
    }

    #[test]
    fn new_sandbox_accepts_both_sdk_bodies() {
        let v2: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","timeout":120,"metadata":{},"envVars":{"A":"b"}}"#,
        )
        .unwrap();
        assert_eq!((v2.template_id.as_str(), v2.timeout), ("base", Some(120)));
        let v1: NewSandbox = serde_json::from_str(
            r#"{"templateID": "base", "secure": true, "allow_internet_access": true, "autoPause": false}"#,
        )
        .unwrap();
        assert_eq!(v1.auto_pause, Some(false));
    }

    #[test]
    fn errors_have_the_sdk_shape() {
        let r = E2bError::not_found("gone").into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
    }
}
