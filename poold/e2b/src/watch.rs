//! envd's directory watches: the `WatchDir` stream (E2B's async Python and
//! JavaScript SDKs) and the polled watchers of the sync Python SDK
//! (`CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`), both over the
//! guest agent's inotify watch (`forkd_node::Node::watch_dir`).
//!
//! Invariants:
//! - a `WatchDir` stream owns its guest watch: a client that goes away
//!   drops the stream, which ends the watch in the guest;
//! - a polled watcher lives in its sandbox's session until `RemoveWatcher`
//!   or the sandbox's end, at most [`MAX_WATCHERS`] per sandbox, each
//!   queuing at most [`MAX_QUEUED`] events; one whose queue overflows or
//!   whose guest watch fails answers every later `GetWatcherEvents` with
//!   that error (as envd does) until it is removed;
//! - events are named as envd names them: the path relative to the watched
//!   directory, and an `EVENT_TYPE_*`; events the guest lost are an error,
//!   never a silent gap.

use crate::connect;
use crate::error::{Code, RpcError, RpcResult};
use crate::guest::Account;
use crate::state::Guest;
use bytes::{Bytes, BytesMut};
use forkd_node::{Watch, WatchUpdate};
use rootfs_init::protocol::{WatchEvent, WatchKind};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Most polled watchers one sandbox keeps.
pub const MAX_WATCHERS: usize = 16;
/// Most events a polled watcher queues between two `GetWatcherEvents`.
pub const MAX_QUEUED: usize = 10_000;

/// `WatchDirRequest` / `CreateWatcherRequest`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, alias = "include_entry")]
    include_entry: bool,
}

/// Starts the guest watch a request asks for, as `acct`.
async fn start(g: Guest<'_>, acct: &Account, msg: &[u8]) -> RpcResult<Watch> {
    let r: WatchRequest = connect::parse(msg)?;
    if r.include_entry {
        // The SDK never asks this of envd before 0.6.3 (poold reports 0.6.2).
        return Err(RpcError::invalid(format!(
            "include_entry needs envd 0.6.3; poold's envd is {}: watch without it and stat the entries",
            crate::state::ENVD_VERSION
        )));
    }
    let path = acct.resolve(&r.path)?;
    Ok(g.node
        .watch_dir(g.id(), &path, r.recursive, acct.agent_user())
        .await?)
}

fn type_name(kind: WatchKind) -> &'static str {
    match kind {
        WatchKind::Create => "EVENT_TYPE_CREATE",
        WatchKind::Write => "EVENT_TYPE_WRITE",
        WatchKind::Remove => "EVENT_TYPE_REMOVE",
        WatchKind::Rename => "EVENT_TYPE_RENAME",
        WatchKind::Chmod => "EVENT_TYPE_CHMOD",
    }
}

/// envd's `FilesystemEvent`.
fn event_json(e: &WatchEvent) -> Value {
    json!({"name": e.name, "type": type_name(e.kind)})
}

fn lost() -> RpcError {
    RpcError::new(
        Code::Internal,
        "events were lost: the guest's inotify queue overflowed (fs.inotify.max_queued_events) \
         or a new directory could not be watched; watch again",
    )
}

/// `WatchDir`: the stream of one guest watch, as envd sends it.
pub async fn watch_dir(
    g: Guest<'_>,
    acct: &Account,
    msg: &[u8],
    keepalive: Duration,
    deadline: Option<Instant>,
) -> RpcResult<impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>>> {
    let w = start(g, acct, msg).await?;
    enum S {
        Start(Box<Watch>),
        Events(Box<Watch>),
        Close(Bytes),
        Done,
    }
    Ok(futures::stream::unfold(
        S::Start(Box::new(w)),
        move |s| async move {
            match s {
                S::Start(w) => Some((Ok(connect::message(&json!({"start": {}}))), S::Events(w))),
                S::Events(mut w) => {
                    let update = match connect::next_or_tick(w.next(), keepalive, deadline).await {
                        connect::Tick::Item(u) => u,
                        connect::Tick::Keepalive => {
                            let ka = connect::message(&json!({"keepalive": {}}));
                            return Some((Ok(ka), S::Events(w)));
                        }
                        connect::Tick::Deadline => {
                            let e = RpcError::new(
                                Code::DeadlineExceeded,
                                "the watch's deadline (its timeout) passed",
                            );
                            return Some((Ok(e.end_of_stream()), S::Done));
                        }
                    };
                    Some(match update {
                        Some(WatchUpdate::Events { events, lost: true }) => {
                            (Ok(envelopes(&events)), S::Close(lost().end_of_stream()))
                        }
                        Some(WatchUpdate::Events { events, .. }) => {
                            (Ok(envelopes(&events)), S::Events(w))
                        }
                        Some(WatchUpdate::Ended(_)) | None => (Ok(connect::end_ok()), S::Done),
                        Some(WatchUpdate::Failed(e)) => (
                            Ok(RpcError::from(forkd_node::Error::from(e)).end_of_stream()),
                            S::Done,
                        ),
                    })
                }
                S::Close(b) => Some((Ok(b), S::Done)),
                S::Done => None,
            }
        },
    ))
}

/// One data envelope per event, in one chunk.
fn envelopes(events: &[WatchEvent]) -> Bytes {
    let mut b = BytesMut::new();
    for e in events {
        b.extend_from_slice(&connect::message(&json!({"filesystem": event_json(e)})));
    }
    b.freeze()
}

/// What a polled watcher has gathered since it was last asked.
#[derive(Default)]
struct Queue {
    events: Vec<Value>,
    /// Set once the watcher cannot go on; reported by every later poll.
    error: Option<RpcError>,
}

/// A polled watcher: its queue, filled by a task that owns the guest
/// watch; dropping it stops the task, which ends the guest watch.
struct Polled {
    queue: Arc<Mutex<Queue>>,
    pump: tokio::task::AbortHandle,
}

impl Drop for Polled {
    fn drop(&mut self) {
        self.pump.abort();
    }
}

/// A sandbox's polled watchers, by id.
#[derive(Default)]
pub struct Watchers {
    by_id: Mutex<HashMap<String, Polled>>,
}

impl Watchers {
    fn get(&self, id: &str) -> RpcResult<Arc<Mutex<Queue>>> {
        let by_id = self.by_id.lock().unwrap();
        by_id
            .get(id)
            .map(|p| p.queue.clone())
            .ok_or_else(|| unknown(id))
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatcherId {
    #[serde(default, alias = "watcher_id")]
    watcher_id: String,
}

/// `CreateWatcher`: a guest watch whose events queue until polled.
pub async fn create(g: Guest<'_>, acct: &Account, msg: &[u8]) -> RpcResult<Value> {
    let watchers = &g.sb.session.watchers;
    let full = || {
        RpcError::new(
            Code::ResourceExhausted,
            format!("{MAX_WATCHERS} watchers exist in this sandbox: remove one (WatchHandle.stop) first"),
        )
    };
    if watchers.by_id.lock().unwrap().len() >= MAX_WATCHERS {
        return Err(full());
    }
    let w = start(g, acct, msg).await?;
    let queue = Arc::new(Mutex::new(Queue::default()));
    let pump = tokio::spawn(pump(w, queue.clone())).abort_handle();
    let id = format!("w{:016x}", rand::random::<u64>());
    let mut by_id = watchers.by_id.lock().unwrap();
    if by_id.len() >= MAX_WATCHERS {
        pump.abort();
        return Err(full());
    }
    by_id.insert(id.clone(), Polled { queue, pump });
    Ok(json!({"watcherId": id}))
}

/// Moves a guest watch's events into `queue` until it ends or fails.
async fn pump(mut w: Watch, queue: Arc<Mutex<Queue>>) {
    while let Some(update) = w.next().await {
        let mut q = queue.lock().unwrap();
        match update {
            WatchUpdate::Events { events, lost: l } => {
                q.events.extend(events.iter().map(event_json));
                if l {
                    q.error = Some(lost());
                } else if q.events.len() > MAX_QUEUED {
                    q.error = Some(RpcError::new(
                        Code::ResourceExhausted,
                        format!(
                            "more than {MAX_QUEUED} events were not fetched: poll get_new_events more often, or watch a smaller tree"
                        ),
                    ));
                }
            }
            WatchUpdate::Ended(r) if r.gone => {
                q.error = Some(RpcError::new(
                    Code::NotFound,
                    "the watched directory was removed or moved away",
                ))
            }
            WatchUpdate::Ended(_) => {}
            WatchUpdate::Failed(e) => q.error = Some(RpcError::from(forkd_node::Error::from(e))),
        }
        if q.error.is_some() {
            return;
        }
    }
}

/// `GetWatcherEvents`: what a watcher gathered since the last call.
pub fn events(g: Guest<'_>, msg: &[u8]) -> RpcResult<Value> {
    let r: WatcherId = connect::parse(msg)?;
    let queue = g.sb.session.watchers.get(&r.watcher_id)?;
    let mut q = queue.lock().unwrap();
    if let Some(e) = &q.error {
        return Err(e.clone());
    }
    Ok(json!({"events": std::mem::take(&mut q.events)}))
}

/// `RemoveWatcher`: ends a watcher and its guest watch.
pub fn remove(g: Guest<'_>, msg: &[u8]) -> RpcResult<Value> {
    let r: WatcherId = connect::parse(msg)?;
    let gone =
        g.sb.session
            .watchers
            .by_id
            .lock()
            .unwrap()
            .remove(&r.watcher_id);
    match gone {
        Some(_) => Ok(json!({})),
        None => Err(unknown(&r.watcher_id)),
    }
}

fn unknown(id: &str) -> RpcError {
    RpcError::new(
        Code::NotFound,
        format!("watcher {id:?} not found (removed, or its sandbox was paused or poold restarted)"),
    )
}
