//! A directory watch in the guest ([`AgentClient::watch`]): the agent's
//! inotify events for one directory (or tree), until stopped.
//!
//! Invariants:
//! - a [`Watch`] exists only once the guest's watches are in place (the
//!   agent said `started`), so a write made after `watch` returns is seen;
//! - dropping a [`Watch`] that has not ended ends the guest's watch (an
//!   `unwatch` nobody waits for), so a client that goes away leaks no
//!   inotify instance in the guest;
//! - its frames queue under the channel's per-request bounds
//!   ([`super::MAX_UNREAD_FRAMES`]): a consumer that stops reading gets the
//!   watch failed, never poold's memory grown.

use super::{AgentClient, CallError, Events};
use rootfs_init::protocol::{
    AgentError, ErrorKind, Op, Reply, WatchEvent, WatchResult, FEATURE_WATCH,
};
use std::time::Duration;

/// How long the agent may take to put a watch in place (a recursive one
/// walks the tree).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// What a running watch reports.
#[derive(Debug)]
pub enum WatchUpdate {
    /// Events, in the order they happened.
    Events {
        /// What happened, oldest first.
        events: Vec<WatchEvent>,
        /// Some events before these were lost (the guest kernel's queue
        /// overflowed).
        lost: bool,
    },
    /// The watch ended: stopped, or its directory went away. The last update.
    Ended(WatchResult),
    /// The watch failed, or the channel closed. The last update.
    Failed(CallError),
}

/// A running directory watch in the guest.
pub struct Watch {
    agent: AgentClient,
    id: u64,
    events: Events,
    ended: bool,
}

impl AgentClient {
    /// Watches `path` in the guest (`recursive`: every directory under it
    /// too), a relative path being under `user`'s home. Returns once the
    /// guest's watches are in place; fails as the agent does (`not_found`,
    /// `not_a_directory`, limits) or `unsupported` for an agent without
    /// watches.
    pub async fn watch(
        &self,
        path: &str,
        user: Option<&str>,
        recursive: bool,
    ) -> Result<Watch, CallError> {
        self.require(FEATURE_WATCH).await?;
        self.require_user(user).await?;
        let op = Op::Watch {
            path: path.to_string(),
            user: user.map(String::from),
            recursive,
        };
        let (id, events) = self.start(op, &[])?;
        let mut w = Watch {
            agent: self.clone(),
            id,
            events,
            ended: false,
        };
        match tokio::time::timeout(START_TIMEOUT, w.events.recv()).await {
            Ok(Some((Reply::Started { .. }, _))) => Ok(w),
            Ok(Some((Reply::Error { error }, _))) => {
                w.ended = true;
                Err(CallError::Agent(error))
            }
            Ok(Some((other, _))) => Err(CallError::Channel(format!(
                "the agent answered a watch with {other:?} before starting it"
            ))),
            Ok(None) => {
                w.ended = true;
                Err(CallError::Channel("connection closed".into()))
            }
            Err(_) => Err(CallError::Timeout(START_TIMEOUT)),
        }
    }
}

impl Watch {
    /// The next update; after [`WatchUpdate::Ended`] or
    /// [`WatchUpdate::Failed`], `None`.
    pub async fn next(&mut self) -> Option<WatchUpdate> {
        if self.ended {
            return None;
        }
        let update = match self.events.recv().await {
            None => WatchUpdate::Failed(CallError::Channel("connection closed".into())),
            Some((Reply::Watch { events, lost }, _)) => {
                return Some(WatchUpdate::Events { events, lost })
            }
            Some((Reply::Ok { result }, _)) => match serde_json::from_value(result) {
                Ok(r) => WatchUpdate::Ended(r),
                Err(e) => WatchUpdate::Failed(CallError::Channel(format!(
                    "unexpected end of a watch: {e}"
                ))),
            },
            Some((Reply::Error { error }, _)) => WatchUpdate::Failed(CallError::Agent(error)),
            Some((other, _)) => WatchUpdate::Failed(CallError::Agent(AgentError::new(
                ErrorKind::Internal,
                format!("the agent sent {other:?} on a watch"),
            ))),
        };
        self.ended = true;
        self.agent.forget(self.id);
        Some(update)
    }

    /// Ends the guest's watch (its final update still arrives through
    /// [`Self::next`]).
    pub async fn stop(&self) -> Result<(), CallError> {
        let op = Op::Unwatch { target: self.id };
        match self.agent.call(op, &[], Duration::from_secs(30)).await {
            // It ended on its own meanwhile.
            Err(CallError::Agent(e)) if e.kind == ErrorKind::NotFound => Ok(()),
            r => r.map(|_| ()),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self
                .agent
                .send_routed(Op::Unwatch { target: self.id }, &[], None);
            self.agent.forget(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rootfs_init::agent::config::Lang;
    use rootfs_init::agent::eval::Interpreter;
    use rootfs_init::agent::server::{serve_stream, Agent};
    use rootfs_init::protocol::WatchKind;
    use std::sync::Arc;
    use tokio::net::UnixStream;

    /// A client talking to a real forkd-agent over a socket pair.
    fn real_agent() -> (AgentClient, Arc<Agent>) {
        let (a, b) = UnixStream::pair().unwrap();
        let agent = Agent::new(Interpreter::new(Lang::Python, None, &[], None));
        tokio::spawn(serve_stream(agent.clone(), b));
        (AgentClient::over(a), agent)
    }

    async fn next_events(w: &mut Watch) -> Vec<WatchEvent> {
        match tokio::time::timeout(Duration::from_secs(10), w.next()).await {
            Ok(Some(WatchUpdate::Events { events, .. })) => events,
            other => panic!("expected events, got {other:?}"),
        }
    }

    async fn until_running(agent: &Agent, n: usize) {
        for _ in 0..200 {
            if agent.watches.running() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{} watches run, not {n}", agent.watches.running());
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_watch_sees_a_write_and_dropping_it_ends_the_guest_watch() {
        let tmp = tempfile::tempdir().unwrap();
        let (client, agent) = real_agent();
        let dir = tmp.path().to_str().unwrap();
        let mut w = client.watch(dir, None, true).await.unwrap();
        assert_eq!(agent.watches.running(), 1);
        std::fs::write(tmp.path().join("f.txt"), b"x").unwrap();
        let evs = next_events(&mut w).await;
        assert_eq!(evs[0].name, "f.txt");
        assert_eq!(evs[0].kind, WatchKind::Create);
        drop(w);
        until_running(&agent, 0).await;

        // Stopped: the final update says how many events there were.
        let mut w = client.watch(dir, None, false).await.unwrap();
        std::fs::write(tmp.path().join("g.txt"), b"y").unwrap();
        next_events(&mut w).await;
        w.stop().await.unwrap();
        let end = loop {
            match w.next().await.unwrap() {
                WatchUpdate::Events { .. } => {}
                end => break end,
            }
        };
        assert!(
            matches!(end, WatchUpdate::Ended(WatchResult { events, gone: false }) if events >= 1)
        );
        assert!(w.next().await.is_none());
        until_running(&agent, 0).await;
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_watch_of_a_missing_directory_fails_with_the_agents_error() {
        let (client, agent) = real_agent();
        let err = client
            .watch("/nonexistent-forkd-dir", None, false)
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&err, CallError::Agent(e) if e.kind == ErrorKind::NotFound),
            "{err}"
        );
        until_running(&agent, 0).await;
    }
}
