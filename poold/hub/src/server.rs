//! `forkd hub serve DIR`: an HTTP hub over a hub directory (the same layout
//! as a `file://` hub), with the protocol described in [`super::http`].
//!
//! Everything a client sends is verified before it is stored: names through
//! [`Key::parse`], sizes against their kind's limit, chunks against their
//! ids, manifests against their ids and the chunks the hub holds, records
//! against their manifests and parent, tags against their snapshot. Records
//! and tags are written only after the directories of everything they name
//! were fsync'd.
//!
//! A bearer token (compared in constant time) is required on every request
//! but `/healthz` when one is configured, and one must be configured to bind
//! a non-loopback address. `--read-only` refuses every write.

use super::file::FileHub;
use super::http::{HasRequest, HasResponse, MAX_HAS_KEYS};
use super::layout::{decode_chunk, Key, TagObject};
use crate::auth::check_token;
use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use forkd_layers::{decode_manifest, decode_record, MAX_MANIFEST_BYTES};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

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
    let state: Shared = Arc::new(AppState {
        hub: FileHub::open(&opts.dir)?,
        token: opts.token.clone(),
        read_only: opts.read_only,
    });
    let api = Router::new()
        .route("/v1/objects/{*path}", get(get_object).put(put_object))
        .route("/v1/has", post(has))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(api)
        .layer(DefaultBodyLimit::max(MAX_MANIFEST_BYTES + 1024))
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

async fn get_object(State(st): State<Shared>, Path(path): Path<String>) -> Response {
    let key = match Key::parse(&path) {
        Ok(k) => k,
        Err(e) => return err(StatusCode::BAD_REQUEST, format!("{e:#}")),
    };
    let hub = st.hub.clone();
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
    let hub = st.hub.clone();
    match tokio::task::spawn_blocking(move || store_verified(&hub, &key, &body)).await {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err((status, msg))) => err(status, msg),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

type Refusal = (StatusCode, String);

/// Verifies an incoming object against what it claims and what the hub
/// holds, then stores it.
fn store_verified(hub: &FileHub, key: &Key, body: &[u8]) -> Result<(), Refusal> {
    let invalid = |msg: String| (StatusCode::UNPROCESSABLE_ENTITY, msg);
    let conflict = |msg: String| (StatusCode::CONFLICT, msg);
    let internal = |e: anyhow::Error| (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"));
    let present = |k: &Key| hub.has(std::slice::from_ref(k))[0];
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
            let keys: Vec<Key> = m.distinct_chunks().iter().map(|c| Key::Chunk(*c)).collect();
            if let Some((k, _)) = keys.iter().zip(hub.has(&keys)).find(|(_, h)| !h) {
                return Err(conflict(format!(
                    "manifest {id} names {k}, which this hub does not have; push the chunks first"
                )));
            }
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
    if matches!(key, Key::Snapshot(_) | Key::Tag(_)) {
        hub.flush().map_err(internal)?;
    }
    Ok(())
}
