//! Pause and resume: `POST /sandboxes/{id}/pause`, `/resume`, and
//! `connect` to a paused sandbox, served by the node's paused sandboxes
//! (`forkd_node::PausedSandbox`): memory and disk go to the store, the VM
//! goes away, and the sandbox comes back with the same id and access
//! token, so a client's `Sandbox` object keeps working (the SDK's
//! `sbx.connect()` ignores the token its answer carries). A paused sandbox
//! survives poold restarts. Only a full pause is served: a filesystem-only
//! one (`memory: false`) and a cold-boot resume are refused, never
//! approximated.

use crate::control::{bad, body_or_default, check_timeout, sandbox_json, DEFAULT_TIMEOUT_SECS};
use crate::error::{E2bError, E2bResult};
use crate::logs::Level;
use crate::state::E2b;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_node::PausedSandbox;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

type R<T> = E2bResult<T>;

#[derive(Debug, Default, Deserialize)]
struct PauseBody {
    /// false: a filesystem-only pause.
    #[serde(default)]
    memory: Option<bool>,
    /// Refuse when the guest agent does not answer (the SDK's `strict`).
    #[serde(default, rename = "requireHealthyGuest")]
    require_healthy_guest: Option<bool>,
}

fn already_paused(id: &str) -> E2bError {
    E2bError::new(
        StatusCode::CONFLICT,
        format!("sandbox {id:?} is already paused; connect to it to resume it"),
    )
}

/// `POST /sandboxes/{id}/pause`: 204; 409 when it is paused already (the
/// SDK's `False`), 404 when there is no such sandbox.
pub async fn pause(
    State(e): State<Arc<E2b>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> R<StatusCode> {
    let b: PauseBody = body_or_default(&body, "pause")?;
    if b.memory == Some(false) {
        return Err(bad(
            "memory: false (a filesystem-only pause) is not supported by poold; pause with memory (mode \"full\", the default)",
        ));
    }
    if e.node.paused(&id).is_some() {
        return Err(already_paused(&id));
    }
    e.sandbox_or_404(&id)?;
    if b.require_healthy_guest == Some(true) {
        if let Err(err) = e.node.ping(&id).await {
            return Err(E2bError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the sandbox's guest agent does not answer ({err}); it keeps running, not paused"),
            ));
        }
    }
    e.node.pause(&id).await?;
    // Its processes and kernel sessions ended with the VM.
    e.forget(&id);
    e.logs.record(&id, Level::Info, "Pausing sandbox", &[]);
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct ResumeBody {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default, rename = "autoPause")]
    auto_pause: Option<bool>,
}

/// `POST /sandboxes/{id}/resume {timeout}` (the SDK's older `resume`):
/// 201 with the sandbox; 409 when it runs, 404 when there is none.
pub async fn resume(
    State(e): State<Arc<E2b>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> R<(StatusCode, Json<Value>)> {
    let b: ResumeBody = body_or_default(&body, "resume")?;
    if e.node.paused(&id).is_none() {
        e.sandbox_or_404(&id)?;
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id:?} is running; only a paused sandbox resumes"),
        ));
    }
    let t = check_timeout(b.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS))?;
    let v = resume_paused(&e, &id, t, b.auto_pause).await?;
    Ok((StatusCode::CREATED, Json(v)))
}

/// Resumes paused sandbox `id`, killed (or paused, if it pauses at its
/// TTL; `auto_pause` changes that when set) `timeout` seconds from now;
/// the `Sandbox` answer.
pub(crate) async fn resume_paused(
    e: &E2b,
    id: &str,
    timeout: u64,
    auto_pause: Option<bool>,
) -> R<Value> {
    e.forget(id);
    let rec = e.node.resume(id, timeout, auto_pause).await?;
    e.logs.record(id, Level::Info, "Sandbox resumed", &[]);
    Ok(sandbox_json(e, &rec))
}

/// The `state` E2B lists a paused sandbox with, and its `SandboxDetail`.
pub(crate) fn detail_json(p: &PausedSandbox) -> Value {
    let template = p.alias.as_deref().unwrap_or(&p.snapshot_tag);
    serde_json::json!({
        "templateID": template,
        "alias": template,
        "sandboxID": p.id,
        "clientID": "forkd",
        "startedAt": crate::control::rfc3339(p.created_at_unix),
        "endAt": crate::control::rfc3339(p.paused_at_unix),
        "cpuCount": p.cpus.map_or(1, |c| c.ceil() as u64),
        "memoryMB": p.memory_limit_mib.unwrap_or(0),
        "diskSizeMB": 0,
        "envdVersion": crate::state::ENVD_VERSION,
        "envdAccessToken": p.access_token.as_str(),
        "metadata": p.metadata,
        "state": "paused",
    })
}

/// Whether a connect may resume: E2B's `memory: false` asks for a cold
/// boot from disk, which poold does not do.
pub(crate) fn check_connect_memory(memory: Option<bool>) -> R<()> {
    if memory == Some(false) {
        return Err(bad(
            "memory: false (on_resume=\"reboot\", a cold boot from disk) is not supported by poold; resume with memory (on_resume=\"restore\", the default)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies() {
        let b: PauseBody = body_or_default(b" ", "pause").unwrap();
        assert_eq!((b.memory, b.require_healthy_guest), (None, None));
        let b: PauseBody =
            body_or_default(br#"{"memory":false,"requireHealthyGuest":true}"#, "pause").unwrap();
        assert_eq!(
            (b.memory, b.require_healthy_guest),
            (Some(false), Some(true))
        );
        let e = body_or_default::<ResumeBody>(b"{", "resume").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("bad resume body"), "{}", e.message);
        assert!(check_connect_memory(Some(false)).is_err());
        assert!(check_connect_memory(None).is_ok() && check_connect_memory(Some(true)).is_ok());
    }
}
