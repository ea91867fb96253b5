//! A small async QMP client: commands with ids, errors as values, and events
//! on a broadcast channel.
//!
//! Invariants:
//! - every command carries a fresh `id`; one reader task routes each reply to
//!   the command with that id, in whatever order QEMU answers, and every
//!   line with an `event` key to the broadcast channel (never to a command);
//! - when the connection closes, every command still waiting fails (its
//!   sender is dropped) rather than hanging;
//! - QEMU's states are read into enums ([`RunState`], [`MigrationStatus`]),
//!   never compared as strings by callers;
//! - no command waits longer than [`COMMAND_TIMEOUT`] (sending included): a
//!   wedged QEMU fails its caller with an error naming the command, it does
//!   not hang a reaper, a spawn or a delete;
//! - a QEMU is as untrusted as its guest (it runs guest-driven device code),
//!   so a line from it longer than [`MAX_LINE`] closes the connection.

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value>>>>>;

/// Longest a QMP command may take, from sending it to its reply. QEMU
/// answers every command forkd uses at once (migrations run in the
/// background and are polled).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest line accepted from QEMU (its replies to forkd are small).
pub const MAX_LINE: usize = 4 << 20;

/// A connected QMP session (capabilities negotiated).
pub struct Qmp {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Pending,
    next_id: AtomicU64,
    events: broadcast::Sender<Value>,
    timeout: Duration,
}

impl Qmp {
    /// Connects, retrying until `deadline` while QEMU creates the socket.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Qmp> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("connecting to QMP at {}", path.display()))
                }
            }
        };
        Qmp::handshake(stream, deadline, &path.display().to_string()).await
    }

    /// Reads the greeting on a connected stream, starts the reader task and
    /// negotiates capabilities. `what` names the peer in errors.
    async fn handshake(stream: UnixStream, deadline: Instant, what: &str) -> Result<Qmp> {
        let (rd, wr) = stream.into_split();
        let mut rd = BufReader::new(rd);
        let mut greeting = String::new();
        // QEMU greets at once; a socket that accepts but stays silent (another
        // QMP client is attached) must not hang the caller.
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(2));
        tokio::time::timeout(left, rd.read_line(&mut greeting))
            .await
            .map_err(|_| anyhow!("no QMP greeting from {what} within {left:?}"))?
            .context("reading the QMP greeting")?;
        if !greeting.contains("QMP") {
            bail!("unexpected QMP greeting: {greeting:?}");
        }
        let pending: Pending = Arc::default();
        let (events, _) = broadcast::channel(64);
        tokio::spawn(read_loop(rd, pending.clone(), events.clone()));
        let qmp = Qmp {
            writer: tokio::sync::Mutex::new(wr),
            pending,
            next_id: AtomicU64::new(1),
            events,
            timeout: COMMAND_TIMEOUT,
        };
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    /// Subscribes to QMP events (e.g. STOP, RESUME, SHUTDOWN).
    pub fn events(&self) -> broadcast::Receiver<Value> {
        self.events.subscribe()
    }

    /// Runs a command and returns its `return` value; a QMP error is an `Err`
    /// carrying QEMU's description.
    pub async fn execute(&self, cmd: &str, args: Value) -> Result<Value> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let mut line = serde_json::to_vec(&json!({"execute": cmd, "arguments": args, "id": id}))?;
        line.push(b'\n');
        let run = async {
            {
                let mut w = self.writer.lock().await;
                w.write_all(&line)
                    .await
                    .map_err(|e| anyhow!("QMP {cmd}: {e} (QEMU exited?)"))?;
            }
            rx.await
                .map_err(|_| anyhow!("QMP {cmd}: connection closed (QEMU exited?)"))?
                .with_context(|| format!("QMP {cmd}"))
        };
        self.bounded(id, cmd, run).await
    }

    /// Runs one command's send-and-wait within the command timeout; on any
    /// failure its pending entry is removed (a late reply is dropped).
    async fn bounded<T>(
        &self,
        id: u64,
        cmd: &str,
        run: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let r = match tokio::time::timeout(self.timeout, run).await {
            Ok(r) => r,
            Err(_) => Err(anyhow!(
                "QMP {cmd}: no answer from QEMU within {:?}; it is wedged: destroy the VM",
                self.timeout
            )),
        };
        if r.is_err() {
            self.pending.lock().unwrap().remove(&id);
        }
        r
    }

    /// Passes `fd` to QEMU under `name` (QMP `getfd`, the descriptor sent as
    /// SCM_RIGHTS with the command): a jailed QEMU cannot open host paths, so
    /// poold opens them and hands over the descriptor.
    pub async fn send_fd(&self, name: &str, fd: std::os::fd::BorrowedFd<'_>) -> Result<()> {
        use std::os::fd::AsRawFd;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let mut line = serde_json::to_vec(
            &json!({"execute": "getfd", "arguments": {"fdname": name}, "id": id}),
        )?;
        line.push(b'\n');
        let run = async {
            let mut w = self.writer.lock().await;
            let stream: &UnixStream = w.as_ref();
            let first = loop {
                stream.writable().await?;
                let r = stream.try_io(tokio::io::Interest::WRITABLE, || {
                    let iov = [std::io::IoSlice::new(&line)];
                    let fds = [fd.as_raw_fd()];
                    let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
                    nix::sys::socket::sendmsg::<()>(
                        stream.as_raw_fd(),
                        &iov,
                        &cmsg,
                        nix::sys::socket::MsgFlags::empty(),
                        None,
                    )
                    .map_err(std::io::Error::from)
                });
                match r {
                    Ok(n) => break Ok(n),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => break Err(e),
                }
            };
            // The descriptor went with the first byte; the rest is plain.
            let sent = match first {
                Ok(n) => w.write_all(&line[n..]).await,
                Err(e) => Err(e),
            };
            drop(w);
            sent.map_err(|e| anyhow!("QMP getfd: {e} (QEMU exited?)"))?;
            rx.await
                .map_err(|_| anyhow!("QMP getfd: connection closed (QEMU exited?)"))?
                .context("QMP getfd")
                .map(drop)
        };
        self.bounded(id, "getfd", run).await
    }

    /// The VM's run state (`query-status`).
    pub async fn query_status(&self) -> Result<RunState> {
        let st = self.execute("query-status", json!({})).await?;
        Ok(RunState::from_reply(&st))
    }

    /// Where the current (or last) migration stands (`query-migrate`).
    pub async fn query_migrate(&self) -> Result<MigrationInfo> {
        let st = self.execute("query-migrate", json!({})).await?;
        Ok(MigrationInfo::from_reply(st))
    }

    /// Polls `query-migrate` until it completes, failing on `failed` or
    /// `cancelled` with QEMU's error description.
    pub async fn wait_migration(&self, timeout: Duration) -> Result<MigrationInfo> {
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.query_migrate().await?;
            match st.status {
                MigrationStatus::Completed => return Ok(st),
                s if s.is_failed() => bail!("migration failed: {}", st.error_desc()),
                _ if Instant::now() > deadline => {
                    bail!("migration did not complete within {timeout:?}: {st}")
                }
                _ => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
    }
}

/// QEMU's run state, as `query-status` reports it (QAPI `RunState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunState {
    /// vCPUs run.
    Running,
    /// Stopped by `stop` (or `-S` before the first `cont`).
    Paused,
    /// Started with `-incoming`, waiting for (or loading) device state.
    Inmigrate,
    /// An outgoing migration finished; the source stays stopped until `cont`.
    Postmigrate,
    /// Stopped before the first `cont` (`-S`).
    Prelaunch,
    /// The last stage of an outgoing migration (vCPUs stopped).
    FinishMigrate,
    /// Loading state with `loadvm`.
    RestoreVm,
    /// Saving state with `savevm`.
    SaveVm,
    /// The guest shut down (QEMU kept running).
    Shutdown,
    /// The guest is suspended (S3).
    Suspended,
    /// Stopped by a block device I/O error.
    IoError,
    /// Stopped by an internal error.
    InternalError,
    /// Stopped by the watchdog.
    Watchdog,
    /// The guest panicked.
    GuestPanicked,
    /// Stopped at a debugger breakpoint.
    Debug,
    /// Any state this client does not know.
    #[serde(other)]
    Unknown,
}

impl RunState {
    /// Reads the `status` of a `query-status` reply.
    pub fn from_reply(reply: &Value) -> RunState {
        reply
            .get("status")
            .and_then(|s| RunState::deserialize(s).ok())
            .unwrap_or(RunState::Unknown)
    }
}

/// Where a migration stands, as `query-migrate` reports it (QAPI
/// `MigrationStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationStatus {
    /// No migration has started (QEMU then omits `status`).
    None,
    /// Setting up.
    Setup,
    /// Copying RAM and devices.
    Active,
    /// Stopped before switching over (`pause-before-switchover`); waits for
    /// `migrate-continue`.
    PreSwitchover,
    /// Sending device state, vCPUs stopped.
    Device,
    /// Being cancelled.
    Cancelling,
    /// Cancelled.
    Cancelled,
    /// Finished.
    Completed,
    /// Failed (`error-desc` says why).
    Failed,
    /// Any other status (postcopy, COLO, `wait-unplug`, ...).
    #[serde(other)]
    Other,
}

impl MigrationStatus {
    /// Failed or cancelled: it will not complete.
    pub fn is_failed(self) -> bool {
        matches!(self, MigrationStatus::Failed | MigrationStatus::Cancelled)
    }

    /// Still moving: a cancel has not settled yet.
    pub fn is_in_progress(self) -> bool {
        matches!(
            self,
            MigrationStatus::Active
                | MigrationStatus::Cancelling
                | MigrationStatus::PreSwitchover
                | MigrationStatus::Device
        )
    }
}

/// A `query-migrate` reply: its status, and the whole reply for messages.
#[derive(Debug, Clone)]
pub struct MigrationInfo {
    /// The status.
    pub status: MigrationStatus,
    /// The reply as QEMU sent it (statistics, `error-desc`).
    pub raw: Value,
}

impl MigrationInfo {
    /// Reads a `query-migrate` reply; no `status` means no migration yet.
    pub fn from_reply(raw: Value) -> MigrationInfo {
        let status = match raw.get("status") {
            None => MigrationStatus::None,
            Some(s) => MigrationStatus::deserialize(s).unwrap_or(MigrationStatus::Other),
        };
        MigrationInfo { status, raw }
    }

    /// QEMU's reason for a failure, or "no reason given".
    pub fn error_desc(&self) -> &str {
        self.raw
            .get("error-desc")
            .and_then(Value::as_str)
            .unwrap_or("no reason given")
    }
}

impl std::fmt::Display for MigrationInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.raw)
    }
}

async fn read_loop(
    mut rd: BufReader<tokio::net::unix::OwnedReadHalf>,
    pending: Pending,
    events: broadcast::Sender<Value>,
) {
    let mut line = Vec::new();
    loop {
        line.clear();
        // At most MAX_LINE + 1 bytes: a longer line ends the session.
        let mut limited = (&mut rd).take(MAX_LINE as u64 + 1);
        match limited.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) if line.len() > MAX_LINE => {
                tracing::warn!("QMP: a line over {MAX_LINE} bytes from QEMU; closing");
                break;
            }
            Ok(_) => {}
        }
        let Ok(v) = serde_json::from_slice::<Value>(&line) else {
            continue;
        };
        if v.get("event").is_some() {
            let _ = events.send(v);
            continue;
        }
        let Some(id) = v.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let Some(tx) = pending.lock().unwrap().remove(&id) else {
            continue;
        };
        let res = match (v.get("return"), v.get("error")) {
            (Some(r), _) => Ok(r.clone()),
            (_, Some(e)) => Err(anyhow!(
                "{}",
                e.get("desc")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown QMP error")
            )),
            _ => Err(anyhow!("malformed QMP reply: {v}")),
        };
        let _ = tx.send(res);
    }
    // Fail everything still waiting.
    pending.lock().unwrap().clear();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    /// A fake QEMU on the far end of a socket pair: its reader and writer.
    struct FakeQemu {
        rd: BufReader<tokio::net::unix::OwnedReadHalf>,
        wr: tokio::net::unix::OwnedWriteHalf,
    }

    impl FakeQemu {
        async fn recv(&mut self) -> Value {
            let mut line = String::new();
            self.rd.read_line(&mut line).await.unwrap();
            serde_json::from_str(&line).unwrap()
        }
        async fn send(&mut self, v: Value) {
            let mut b = serde_json::to_vec(&v).unwrap();
            b.push(b'\n');
            self.wr.write_all(&b).await.unwrap();
        }
    }

    /// A connected client and the fake QEMU, capabilities negotiated.
    async fn pair() -> (Qmp, FakeQemu) {
        let (a, b) = UnixStream::pair().unwrap();
        let (rd, wr) = b.into_split();
        let mut fake = FakeQemu {
            rd: BufReader::new(rd),
            wr,
        };
        let server = async {
            fake.send(json!({"QMP": {"version": {}, "capabilities": []}}))
                .await;
            let caps = fake.recv().await;
            assert_eq!(caps["execute"], "qmp_capabilities");
            fake.send(json!({"return": {}, "id": caps["id"]})).await;
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        let (qmp, ()) = tokio::join!(Qmp::handshake(a, deadline, "test"), server);
        (qmp.unwrap(), fake)
    }

    #[tokio::test]
    async fn replies_route_by_id_and_events_by_channel() {
        let (qmp, mut fake) = pair().await;
        let mut events = qmp.events();
        let server = async {
            let a = fake.recv().await;
            let b = fake.recv().await;
            let c = fake.recv().await;
            let by = |cmd: &str| {
                [&a, &b, &c]
                    .into_iter()
                    .find(|v| v["execute"] == cmd)
                    .cloned()
            };
            let (st, mig, bad) = (
                by("query-status").unwrap(),
                by("query-migrate").unwrap(),
                by("no-such").unwrap(),
            );
            // An event between replies, and the replies in reverse order.
            fake.send(json!({"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 5}}))
                .await;
            fake.send(json!({"error": {"class": "CommandNotFound", "desc": "The command no-such has not been found"}, "id": bad["id"]}))
                .await;
            fake.send(json!({"return": {"status": "pre-switchover"}, "id": mig["id"]}))
                .await;
            fake.send(json!({"return": {"status": "paused", "running": false}, "id": st["id"]}))
                .await;
        };
        let (st, mig, bad, ()) = tokio::join!(
            qmp.query_status(),
            qmp.query_migrate(),
            qmp.execute("no-such", json!({})),
            server
        );
        assert_eq!(st.unwrap(), RunState::Paused);
        assert_eq!(mig.unwrap().status, MigrationStatus::PreSwitchover);
        let e = format!("{:#}", bad.unwrap_err());
        assert_eq!(e, "QMP no-such: The command no-such has not been found");
        let ev = events.recv().await.unwrap();
        assert_eq!(ev["event"], "STOP");
    }

    #[tokio::test]
    async fn a_closed_connection_fails_waiting_commands() {
        let (qmp, mut fake) = pair().await;
        let server = async {
            let _ = fake.recv().await;
            drop(fake);
        };
        let (r, ()) = tokio::join!(qmp.execute("stop", json!({})), server);
        let e = format!("{:#}", r.unwrap_err());
        assert!(e.contains("connection closed"), "{e}");
    }

    #[tokio::test]
    async fn wait_migration_reports_failure_with_qemus_reason() {
        let (qmp, mut fake) = pair().await;
        let server = async {
            for st in [
                json!({}),
                json!({"status": "active"}),
                json!({"status": "failed", "error-desc": "disk full"}),
            ] {
                let c = fake.recv().await;
                assert_eq!(c["execute"], "query-migrate");
                fake.send(json!({"return": st, "id": c["id"]})).await;
            }
        };
        let (r, ()) = tokio::join!(qmp.wait_migration(Duration::from_secs(5)), server);
        assert_eq!(r.unwrap_err().to_string(), "migration failed: disk full");
    }

    #[test]
    fn states_parse_from_qemus_words() {
        for (w, s) in [
            ("running", RunState::Running),
            ("paused", RunState::Paused),
            ("inmigrate", RunState::Inmigrate),
            ("postmigrate", RunState::Postmigrate),
            ("finish-migrate", RunState::FinishMigrate),
            ("guest-panicked", RunState::GuestPanicked),
            ("colo", RunState::Unknown),
        ] {
            assert_eq!(RunState::from_reply(&json!({"status": w})), s, "{w}");
        }
        assert_eq!(RunState::from_reply(&json!({})), RunState::Unknown);
        for (v, s) in [
            (json!({}), MigrationStatus::None),
            (json!({"status": "completed"}), MigrationStatus::Completed),
            (
                json!({"status": "pre-switchover"}),
                MigrationStatus::PreSwitchover,
            ),
            (json!({"status": "cancelling"}), MigrationStatus::Cancelling),
            (json!({"status": "postcopy-active"}), MigrationStatus::Other),
        ] {
            assert_eq!(MigrationInfo::from_reply(v.clone()).status, s, "{v}");
        }
        assert!(MigrationStatus::Cancelled.is_failed());
        assert!(!MigrationStatus::Completed.is_failed());
        assert!(MigrationStatus::Device.is_in_progress());
        assert!(!MigrationStatus::Cancelled.is_in_progress());
    }

    /// A QEMU that never answers fails the command after the timeout with
    /// an error naming it; commands used to wait forever.
    #[tokio::test]
    async fn a_wedged_qemu_fails_the_command_instead_of_hanging() {
        let (mut qmp, mut fake) = pair().await;
        qmp.timeout = Duration::from_millis(200);
        let server = async {
            let _ = fake.recv().await;
            fake
        };
        let (r, _fake) = tokio::join!(qmp.execute("stop", json!({})), server);
        let e = format!("{:#}", r.unwrap_err());
        assert!(e.contains("QMP stop") && e.contains("wedged"), "{e}");
        assert!(qmp.pending.lock().unwrap().is_empty());
    }

    /// An endless line from a hostile QEMU ends the session (waiters fail)
    /// instead of growing poold's memory.
    #[tokio::test]
    async fn an_endless_line_closes_the_session() {
        let (qmp, mut fake) = pair().await;
        // The writer may block once poold stops reading: not awaited.
        tokio::spawn(async move {
            let _ = fake.recv().await;
            let chunk = vec![b'x'; 1 << 20];
            for _ in 0..(MAX_LINE >> 20) + 2 {
                if fake.wr.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        });
        let r = qmp.execute("stop", json!({})).await;
        let e = format!("{:#}", r.unwrap_err());
        assert!(e.contains("connection closed"), "{e}");
    }
}
