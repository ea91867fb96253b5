//! `forkd hub serve DIR`: an HTTP hub over a hub directory (the same layout
//! as a `file://` hub), with the protocol described in [`super::http`].
//!
//! Everything a client sends is verified before it is stored: names through
//! [`Key::parse`], sizes against their kind's limit, chunks against their
//! ids, packs against their ids, index objects against their ids and every
//! chunk they locate (read back from the stored pack and hashed), manifests
//! against their ids and the chunks the hub holds (as objects or in packs
//! an index names), locators against the indexes they name, records against
//! their manifests and parent, tags against their snapshot, `layout.json`
//! against the layouts this build knows. Records, locators and tags are
//! written only after the directories of everything they name were fsync'd.
//!
//! `GET` answers a `Range: bytes=A-B` header with 206 and exactly those
//! bytes (a lazy read of one chunk of a pack); `GET /v1/list/{index,snapshots}`
//! lists those directories.
//!
//! A bearer token (compared in constant time) is required on every request
//! but `/healthz` when one is configured, and one must be configured to bind
//! a non-loopback address. `--read-only` refuses every write.

use crate::auth::check_token;
use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::HeaderMap;
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use forkd_layers::{decode_manifest, decode_record, ChunkId, ObjectId, MAX_MANIFEST_BYTES};
use forkd_remote::layout::{decode_chunk, Key, LayoutObject, Locator, TagObject};
use forkd_remote::packs::Index;
use forkd_remote::{FileHub, HasRequest, HasResponse, ListResponse, MAX_HAS_KEYS, MAX_LIST_KEYS};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// How to run the server.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The hub directory.
    pub dir: PathBuf,
    /// Address to listen on (port 0 picks a free port).
    pub bind: SocketAddr,
    /// Bearer token clients must present.
    pub token: Option<String>,
    /// Refuse writes.
    pub read_only: bool,
}

struct AppState {
    hub: FileHub,
    token: Option<String>,
    read_only: bool,
    /// Chunks the index objects locate (loaded at start, grown as indexes
    /// arrive), and the indexes read so far.
    packed: Mutex<Packed>,
}

#[derive(Default)]
struct Packed {
    chunks: HashSet<ChunkId>,
    indexes: HashSet<ObjectId>,
}

type Shared = Arc<AppState>;

/// Serves until SIGINT/SIGTERM. `on_ready` gets the bound address.
pub async fn serve(opts: ServeOptions, on_ready: impl FnOnce(SocketAddr)) -> Result<()> {
    if let Some(t) = &opts.token {
        check_token(t)?;
    } else if !opts.bind.ip().is_loopback() {
        bail!(
            "refusing to serve on non-loopback address {} without a token: pass --token-file (or bind 127.0.0.1)",
            opts.bind
        );
    }
    if !opts.dir.is_absolute() {
        bail!(
            "hub directory {} must be an absolute path",
            opts.dir.display()
        );
    }
    let hub = FileHub::open(&opts.dir)?;
    let packed = load_packed(&hub)?;
    let state: Shared = Arc::new(AppState {
        hub,
        token: opts.token.clone(),
        read_only: opts.read_only,
        packed: Mutex::new(packed),
    });
    let api = Router::new()
        .route("/v1/objects/{*path}", get(get_object).put(put_object))
        .route("/v1/has", post(has))
        .route("/v1/list/{dir}", get(list))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(api)
        .layer(DefaultBodyLimit::max(
            MAX_MANIFEST_BYTES.max(forkd_remote::layout::MAX_PACK_BYTES as usize) + 1024,
        ))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(opts.bind)
        .await
        .with_context(|| format!("binding {}", opts.bind))?;
    on_ready(listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving the hub")
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// A JSON error body `{"error": "..."}` with a status.
fn err(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": msg.into() }))).into_response()
}

async fn auth(State(st): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(want) = &st.token {
        let got = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if !crate::auth::bearer_matches(got, want) {
            return err(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
        }
    }
    next.run(req).await
}

/// The chunks located by the index objects in `hub` (read at start).
fn load_packed(hub: &FileHub) -> Result<Packed> {
    let mut p = Packed::default();
    for name in hub.list("index")? {
        let Ok(key @ Key::Index(id)) = Key::parse(&name) else {
            continue;
        };
        if let Some(b) = hub.get(&key)? {
            let index = Index::decode(&id, &b)?;
            p.add(id, &index);
        }
    }
    Ok(p)
}

impl Packed {
    fn add(&mut self, id: ObjectId, index: &Index) {
        self.indexes.insert(id);
        for pack in &index.packs {
            self.chunks.extend(pack.entries.iter().map(|e| e.chunk));
        }
    }
}

/// `Range: bytes=A-B` → (A, B - A + 1); anything else is refused.
fn parse_range(h: &HeaderMap) -> Result<Option<(u64, u64)>, String> {
    let Some(v) = h.get(header::RANGE) else {
        return Ok(None);
    };
    let s = v
        .to_str()
        .map_err(|_| "unreadable Range header".to_string())?;
    let (a, b) = s
        .strip_prefix("bytes=")
        .and_then(|r| r.split_once('-'))
        .ok_or_else(|| format!("unsupported Range {s:?}: use bytes=A-B"))?;
    let (a, b): (u64, u64) = match (a.parse(), b.parse()) {
        (Ok(a), Ok(b)) if b >= a => (a, b),
        _ => return Err(format!("unsupported Range {s:?}: use bytes=A-B")),
    };
    Ok(Some((a, b - a + 1)))
}

async fn get_object(
    State(st): State<Shared>,
    Path(path): Path<String>,
    headers: HeaderMap,
) -> Response {
    let key = match Key::parse(&path) {
        Ok(k) => k,
        Err(e) => return err(StatusCode::BAD_REQUEST, format!("{e:#}")),
    };
    let range = match parse_range(&headers) {
        Ok(r) => r,
        Err(e) => return err(StatusCode::RANGE_NOT_SATISFIABLE, e),
    };
    let hub = st.hub.clone();
    if let Some((start, len)) = range {
        return match tokio::task::spawn_blocking(move || hub.get_range(&key, start, len)).await {
            Ok(Ok(Some(b))) => (
                StatusCode::PARTIAL_CONTENT,
                [(header::CONTENT_TYPE, "application/octet-stream")],
                b,
            )
                .into_response(),
            Ok(Ok(None)) => err(StatusCode::NOT_FOUND, format!("no object {path}")),
            Ok(Err(e)) => err(StatusCode::RANGE_NOT_SATISFIABLE, format!("{e:#}")),
            Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
    }
    match tokio::task::spawn_blocking(move || hub.get(&key)).await {
        Ok(Ok(Some(b))) => {
            ([(header::CONTENT_TYPE, "application/octet-stream")], b).into_response()
        }
        Ok(Ok(None)) => err(StatusCode::NOT_FOUND, format!("no object {path}")),
        Ok(Err(e)) => err(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn has(State(st): State<Shared>, Json(req): Json<HasRequest>) -> Response {
    if req.keys.len() > MAX_HAS_KEYS {
        return err(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("at most {MAX_HAS_KEYS} keys per request"),
        );
    }
    let keys: Result<Vec<Key>> = req.keys.iter().map(|k| Key::parse(k)).collect();
    let keys = match keys {
        Ok(k) => k,
        Err(e) => return err(StatusCode::BAD_REQUEST, format!("{e:#}")),
    };
    let hub = st.hub.clone();
    match tokio::task::spawn_blocking(move || hub.has(&keys)).await {
        Ok(have) => Json(HasResponse { have }).into_response(),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn list(State(st): State<Shared>, Path(dir): Path<String>) -> Response {
    if dir != "index" && dir != "snapshots" {
        return err(
            StatusCode::BAD_REQUEST,
            "only index and snapshots are listed",
        );
    }
    let hub = st.hub.clone();
    match tokio::task::spawn_blocking(move || hub.list(&dir)).await {
        Ok(Ok(keys)) if keys.len() <= MAX_LIST_KEYS => Json(ListResponse { keys }).into_response(),
        Ok(Ok(_)) => err(
            StatusCode::INSUFFICIENT_STORAGE,
            format!("over {MAX_LIST_KEYS} objects to list"),
        ),
        Ok(Err(e)) => err(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn put_object(State(st): State<Shared>, Path(path): Path<String>, body: Bytes) -> Response {
    if st.read_only {
        return err(StatusCode::FORBIDDEN, "this hub is read-only");
    }
    let key = match Key::parse(&path) {
        Ok(k) => k,
        Err(e) => return err(StatusCode::BAD_REQUEST, format!("{e:#}")),
    };
    if body.len() as u64 > key.max_len() {
        return err(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{key} is over the {}-byte limit", key.max_len()),
        );
    }
    let st2 = st.clone();
    match tokio::task::spawn_blocking(move || store_verified(&st2, &key, &body)).await {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err((status, msg))) => err(status, msg),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

type Refusal = (StatusCode, String);

/// Verifies an incoming object against what it claims and what the hub
/// holds, then stores it.
fn store_verified(st: &AppState, key: &Key, body: &[u8]) -> Result<(), Refusal> {
    let hub = &st.hub;
    let invalid = |msg: String| (StatusCode::UNPROCESSABLE_ENTITY, msg);
    let conflict = |msg: String| (StatusCode::CONFLICT, msg);
    let internal = |e: anyhow::Error| (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"));
    let present = |k: &Key| hub.has(std::slice::from_ref(k))[0];
    let mut new_index = None;
    match key {
        Key::Chunk(id) => {
            if present(key) {
                return Ok(());
            }
            decode_chunk(*id, body)
                .and_then(|c| c.verify())
                .map_err(|r| invalid(format!("chunk {id} failed verification: {r}")))?;
        }
        Key::Manifest(id) => {
            if present(key) {
                return Ok(());
            }
            let m = decode_manifest(id, body).map_err(|e| invalid(e.to_string()))?;
            let unpacked: Vec<Key> = {
                let p = st.packed.lock().unwrap();
                m.distinct_chunks()
                    .iter()
                    .filter(|c| !p.chunks.contains(*c))
                    .map(|c| Key::Chunk(*c))
                    .collect()
            };
            if let Some((k, _)) = unpacked.iter().zip(hub.has(&unpacked)).find(|(_, h)| !h) {
                return Err(conflict(format!(
                    "manifest {id} names {k}, which this hub does not have; push the chunks first"
                )));
            }
        }
        Key::Pack(id) => {
            if present(key) {
                return Ok(());
            }
            let got = ObjectId::of(body);
            if &got != id {
                return Err(invalid(format!(
                    "pack {id} failed verification: its bytes hash to {got}"
                )));
            }
        }
        Key::Index(id) => {
            if present(key) {
                return Ok(());
            }
            let index = Index::decode(id, body).map_err(|e| invalid(format!("{e:#}")))?;
            verify_index(hub, &index).map_err(|(s, m)| (s, format!("index {id}: {m}")))?;
            new_index = Some((*id, index));
        }
        Key::Locator(id) => {
            let l = Locator::decode(id, body).map_err(|e| invalid(format!("{e:#}")))?;
            let missing = {
                let p = st.packed.lock().unwrap();
                l.indexes.iter().find(|i| !p.indexes.contains(*i)).copied()
            };
            if let Some(i) = missing {
                return Err(conflict(format!(
                    "the locator of snapshot {id} names index {i}, which this hub does not have; push it first"
                )));
            }
            hub.flush().map_err(internal)?;
        }
        Key::WorkingSet(id) => {
            forkd_layers::WorkingSet::decode(id, body).map_err(|e| invalid(e.to_string()))?;
        }
        Key::Layout => {
            let new = LayoutObject::decode(body).map_err(|e| invalid(format!("{e:#}")))?;
            if let Some(old) = hub.get(key).map_err(internal)? {
                let old = LayoutObject::decode(&old).map_err(internal)?;
                if new.layout < old.layout {
                    return Err(conflict(format!(
                        "this hub has layout {}; it does not go back to {}",
                        old.layout, new.layout
                    )));
                }
            }
            hub.flush().map_err(internal)?;
        }
        Key::Snapshot(id) => {
            let rec = decode_record(id, body).map_err(|e| invalid(e.to_string()))?;
            if let Some(old) = hub.get(key).map_err(internal)? {
                return match decode_record(id, &old) {
                    Ok(o) if o == rec => Ok(()),
                    _ => Err(conflict(format!(
                        "snapshot {id} already exists on this hub with different content; snapshot ids never change"
                    ))),
                };
            }
            let packed_hub = hub
                .get(&Key::Layout)
                .map_err(internal)?
                .and_then(|b| LayoutObject::decode(&b).ok())
                .is_some_and(|l| l.layout >= forkd_remote::LAYOUT_PACKED);
            if packed_hub && !present(&Key::Locator(*id)) {
                return Err(conflict(format!(
                    "this hub has layout 2 and snapshot {id} has no chunk locator; push the locator first"
                )));
            }
            if let Some(p) = rec.parent {
                if !present(&Key::Snapshot(p)) {
                    return Err(conflict(format!(
                        "the parent {p} of snapshot {id} is not on this hub; push the parent first"
                    )));
                }
            }
            for f in rec.files.values() {
                if !present(&Key::Manifest(f.manifest)) {
                    return Err(conflict(format!(
                        "snapshot {id} names manifest {}, which this hub does not have; push it first",
                        f.manifest
                    )));
                }
            }
            hub.flush().map_err(internal)?;
        }
        Key::Deleted(t) => {
            TagObject::decode(t, body).map_err(|e| invalid(format!("{e:#}")))?;
        }
        Key::Pending(p) | Key::Wanted(p) => {
            // This hub verifies every index against packs it holds, so a
            // push to it never runs ahead of its packs.
            return Err(invalid(format!(
                "{key}: an HTTP hub takes packs before the index that names them, so nothing is pending on it (pack {p})"
            )));
        }
        Key::Tag(t) => {
            let obj = TagObject::decode(t, body).map_err(|e| invalid(format!("{e:#}")))?;
            if !present(&Key::Snapshot(obj.snapshot)) {
                return Err(conflict(format!(
                    "tag '{t}' names snapshot {}, which this hub does not have",
                    obj.snapshot
                )));
            }
            hub.flush().map_err(internal)?;
        }
    }
    hub.put(key, body).map_err(internal)?;
    if matches!(
        key,
        Key::Snapshot(_)
            | Key::Tag(_)
            | Key::Deleted(_)
            | Key::Index(_)
            | Key::Locator(_)
            | Key::Layout
    ) {
        hub.flush().map_err(internal)?;
    }
    if let Some((id, index)) = new_index {
        st.packed.lock().unwrap().add(id, &index);
    }
    Ok(())
}

/// Every chunk an incoming index locates must lie in a pack this hub has
/// and hash to its id there.
fn verify_index(hub: &FileHub, index: &Index) -> Result<(), Refusal> {
    for p in &index.packs {
        let key = Key::Pack(p.id);
        let Some(bytes) = hub
            .get(&key)
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")))?
        else {
            return Err((
                StatusCode::CONFLICT,
                format!(
                    "names pack {}, which this hub does not have; push it first",
                    p.id
                ),
            ));
        };
        if bytes.len() as u64 != p.len {
            return Err((
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "says pack {} has {} bytes, it has {}",
                    p.id,
                    p.len,
                    bytes.len()
                ),
            ));
        }
        for e in &p.entries {
            let b = &bytes[e.offset as usize..(e.offset + u64::from(e.len)) as usize];
            decode_chunk(e.chunk, b)
                .and_then(|c| c.verify())
                .map_err(|why| {
                    (
                        StatusCode::UNPROCESSABLE_ENTITY,
                        format!(
                            "chunk {} in pack {} failed verification: {why}",
                            e.chunk, p.id
                        ),
                    )
                })?;
        }
    }
    Ok(())
}
