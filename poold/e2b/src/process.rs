//! envd's process service (`process.Process/*`) over the agent's streaming
//! exec: a per-sandbox table of processes that outlive the request that
//! started them, so a background command keeps running after its client
//! disconnects, and `Connect`, `List`, `SendSignal`, `SendInput` and
//! `CloseStdin` reach it by pid (or tag).
//!
//! Each process has one pump task reading the agent's events for it and
//! fanning them out to its subscribers (the `Start` stream, `Connect`
//! streams). Bounds:
//! - at most [`MAX_PROCESSES`] processes per sandbox (running, plus ended
//!   ones kept [`KEEP_ENDED`] for a late `Connect`);
//! - at most [`MAX_SUBSCRIBERS`] streams per process;
//! - each subscriber queues at most [`SUBSCRIBER_QUEUE`] events (64 KiB
//!   each at most); one that falls further behind is dropped, and its
//!   stream ends with `resource_exhausted` (the process keeps running, a
//!   new `Connect` re-attaches). The pump never waits for a client, so the
//!   agent's own unread bound is never hit by a slow client.

use crate::connect;
use crate::error::{Code, RpcError, RpcResult};
use base64::Engine;
use bytes::Bytes;
use forkd_node::{ExecEvent, ExecResult, ExecSpec, Node, ProcessControl, PtySize};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Most processes one sandbox's table holds.
pub const MAX_PROCESSES: usize = 64;
/// Most streams attached to one process.
pub const MAX_SUBSCRIBERS: usize = 8;
/// Events queued per subscriber before it is dropped.
pub const SUBSCRIBER_QUEUE: usize = 64;
/// How long an ended process stays reachable by `Connect`.
pub const KEEP_ENDED: Duration = Duration::from_secs(30);
/// Output a streaming exec may produce in all (the agent's per-stream cap):
/// large, since nothing is buffered for it beyond the subscriber queues.
const OUTPUT_LIMIT: u64 = 1 << 40;

/// One event of a process.
#[derive(Debug, Clone)]
pub enum Ev {
    /// Output on stdout.
    Stdout(Bytes),
    /// Output on stderr.
    Stderr(Bytes),
    /// The process ended (always the last event).
    End(End),
}

/// How a process ended, as envd's `EndEvent`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct End {
    /// The exit code; -1 when killed by a signal.
    pub exit_code: i32,
    /// Whether it exited (rather than being killed).
    pub exited: bool,
    /// `exit status N` or `signal: killed`, as Go prints them.
    pub status: String,
    /// Why it could not be followed to its end, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The sandbox went away (killed, paused, crashed) before the process
    /// ended: its streams end with `unavailable`, not an end event, so
    /// the SDK probes the sandbox and reports it gone, as with E2B.
    #[serde(skip)]
    pub lost: bool,
}

impl End {
    /// The end of an exec the agent reported.
    pub fn from_result(r: &ExecResult) -> End {
        match (r.exit_code, r.signal) {
            (Some(c), _) if !r.timed_out => End {
                exit_code: c,
                exited: true,
                status: format!("exit status {c}"),
                error: None,
                lost: false,
            },
            (_, s) => End {
                exit_code: -1,
                exited: false,
                status: format!("signal: {}", signal_name(s.unwrap_or(9))),
                error: None,
                lost: false,
            },
        }
    }

    fn failed(why: String) -> End {
        End {
            exit_code: -1,
            exited: false,
            status: "error".into(),
            error: Some(why),
            lost: false,
        }
    }

    /// The sandbox's agent channel closed before the process ended.
    fn lost() -> End {
        End {
            lost: true,
            ..End::failed(
                "the connection to the sandbox ended before the process did \
                 (the sandbox was killed, paused or crashed)"
                    .into(),
            )
        }
    }
}

/// Go's name of a signal (`signal: killed`).
fn signal_name(s: i32) -> String {
    match s {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        9 => "killed".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// `ProcessConfig`: what was started (answered by `List`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessConfig {
    /// The program.
    pub cmd: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Environment added for this process.
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// A process started through the process service.
pub struct Proc {
    /// Its pid in the guest.
    pub pid: u32,
    /// Its tag, when `Start` gave one.
    pub tag: Option<String>,
    /// What was started.
    pub config: ProcessConfig,
    /// It runs on a terminal: its output is envd's `pty` data.
    pub pty: bool,
    /// Its stdin and signals.
    control: Option<ProcessControl>,
    state: Mutex<ProcState>,
}

#[derive(Default)]
struct ProcState {
    subs: Vec<mpsc::Sender<Ev>>,
    end: Option<End>,
}

impl Proc {
    /// Attaches a stream: it gets every event from now on (just the end
    /// when the process has ended).
    pub fn subscribe(&self) -> RpcResult<mpsc::Receiver<Ev>> {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        let mut st = self.state.lock().unwrap();
        if let Some(end) = &st.end {
            let _ = tx.try_send(Ev::End(end.clone()));
            return Ok(rx);
        }
        if st.subs.len() >= MAX_SUBSCRIBERS {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!(
                    "process {} already has {MAX_SUBSCRIBERS} streams attached; close one first",
                    self.pid
                ),
            ));
        }
        st.subs.push(tx);
        Ok(rx)
    }

    /// Output to every subscriber that has room; one without room left for
    /// the end event is dropped.
    fn publish(&self, ev: Ev) {
        let mut st = self.state.lock().unwrap();
        st.subs
            .retain(|tx| tx.capacity() > 1 && tx.try_send(ev.clone()).is_ok());
    }

    fn finish(&self, end: End) {
        let mut st = self.state.lock().unwrap();
        for tx in st.subs.drain(..) {
            // A slot is always left for the end (see `publish`).
            let _ = tx.try_send(Ev::End(end.clone()));
        }
        st.end = Some(end);
    }

    fn running(&self) -> bool {
        self.state.lock().unwrap().end.is_none()
    }
}

type Procs = Arc<Mutex<HashMap<u32, Arc<Proc>>>>;

/// A sandbox's processes, by pid.
#[derive(Default)]
pub struct Table {
    procs: Procs,
}

impl Table {
    /// Starts `spec` (streaming) in sandbox `id` and returns the process
    /// once the agent reported its pid, with a subscriber attached from its
    /// first output.
    pub async fn start(
        &self,
        node: &Node,
        id: &str,
        spec: ExecSpec,
        config: ProcessConfig,
        tag: Option<String>,
    ) -> RpcResult<(Arc<Proc>, mpsc::Receiver<Ev>)> {
        if self.procs.lock().unwrap().len() >= MAX_PROCESSES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!(
                    "this sandbox has {MAX_PROCESSES} processes (running or ended less than {}s ago); kill some or wait",
                    KEEP_ENDED.as_secs()
                ),
            ));
        }
        let pty = spec.pty.is_some();
        let mut events = node.exec_stream_as(id, spec, &[]).await?;
        let first = tokio::time::timeout(Duration::from_secs(30), events.next()).await;
        let pid = match first {
            Ok(Some(ExecEvent::Started { pid })) => pid,
            Ok(Some(ExecEvent::Failed(e))) => return Err(e.into()),
            Ok(Some(other)) => {
                return Err(RpcError::new(
                    Code::Internal,
                    format!("the agent answered {other:?} before the process started"),
                ))
            }
            Ok(None) => {
                return Err(RpcError::new(
                    Code::Unavailable,
                    "the sandbox's agent channel closed before the process started",
                ))
            }
            Err(_) => {
                return Err(RpcError::new(
                    Code::DeadlineExceeded,
                    "the process did not start within 30 s",
                ))
            }
        };
        let p = Arc::new(Proc {
            pid,
            tag,
            config,
            pty,
            control: Some(events.control()),
            state: Mutex::new(ProcState::default()),
        });
        let rx = p.subscribe()?;
        self.procs.lock().unwrap().insert(pid, p.clone());
        let procs = self.procs.clone();
        let pump = p.clone();
        tokio::spawn(async move {
            let end = loop {
                match events.next().await {
                    Some(ExecEvent::Stdout(b)) => pump.publish(Ev::Stdout(b)),
                    Some(ExecEvent::Stderr(b)) => pump.publish(Ev::Stderr(b)),
                    Some(ExecEvent::Started { .. }) => {}
                    Some(ExecEvent::Exited(r)) => break End::from_result(&r),
                    Some(ExecEvent::Failed(forkd_node::Error::Guest(e))) => {
                        break End::failed(e.to_string())
                    }
                    Some(ExecEvent::Failed(_)) | None => break End::lost(),
                }
            };
            pump.finish(end);
            tokio::time::sleep(KEEP_ENDED).await;
            let mut m = procs.lock().unwrap();
            if m.get(&pump.pid).is_some_and(|q| Arc::ptr_eq(q, &pump)) {
                m.remove(&pump.pid);
            }
        });
        Ok((p, rx))
    }

    /// The process a `ProcessSelector` (`{"pid": N}` or `{"tag": "t"}`) names.
    pub fn find(&self, sel: &Value) -> RpcResult<Arc<Proc>> {
        let m = self.procs.lock().unwrap();
        let found = if let Some(pid) = sel.get("pid") {
            let pid = pid
                .as_u64()
                .or_else(|| pid.as_str().and_then(|s| s.parse().ok()))
                .ok_or_else(|| RpcError::invalid("process.pid must be a number"))?;
            m.get(&(pid as u32)).cloned()
        } else if let Some(tag) = sel.get("tag").and_then(Value::as_str) {
            m.values().find(|p| p.tag.as_deref() == Some(tag)).cloned()
        } else {
            return Err(RpcError::invalid(
                "process must name a pid ({\"pid\": N}) or a tag ({\"tag\": \"t\"})",
            ));
        };
        found.ok_or_else(|| RpcError::new(Code::NotFound, format!("process {sel} not found")))
    }

    /// Running processes, by pid.
    pub fn running(&self) -> Vec<Arc<Proc>> {
        let mut v: Vec<_> = self
            .procs
            .lock()
            .unwrap()
            .values()
            .filter(|p| p.running())
            .cloned()
            .collect();
        v.sort_by_key(|p| p.pid);
        v
    }
}

/// The event stream of one subscriber, as Connect envelopes: `start`
/// first, output as it comes, `keepalive` after `keepalive` of silence,
/// the `end` event, then the end-of-stream message. At `deadline` (the
/// call's `Connect-Timeout-Ms`) it ends with `deadline_exceeded` instead.
pub fn event_stream(
    pid: u32,
    pty: bool,
    rx: mpsc::Receiver<Ev>,
    keepalive: Duration,
    deadline: Option<Instant>,
) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    enum S {
        Start(mpsc::Receiver<Ev>),
        Events(mpsc::Receiver<Ev>),
        Close(Bytes),
        Done,
    }
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    futures::stream::unfold(S::Start(rx), move |s| async move {
        match s {
            S::Start(rx) => Some((
                Ok(connect::message(&json!({"event": {"start": {"pid": pid}}}))),
                S::Events(rx),
            )),
            S::Events(mut rx) => {
                let item = match connect::next_or_tick(rx.recv(), keepalive, deadline).await {
                    connect::Tick::Item(item) => item,
                    connect::Tick::Keepalive => {
                        let ka = connect::message(&json!({"event": {"keepalive": {}}}));
                        return Some((Ok(ka), S::Events(rx)));
                    }
                    connect::Tick::Deadline => {
                        return Some((Ok(deadline_passed(pid).end_of_stream()), S::Done))
                    }
                };
                Some(match item {
                    Some(Ev::Stdout(b)) => (
                        Ok(connect::message(&data_event(pty, &b64(&b)))),
                        S::Events(rx),
                    ),
                    Some(Ev::Stderr(b)) => (
                        Ok(connect::message(
                            &json!({"event": {"data": {"stderr": b64(&b)}}}),
                        )),
                        S::Events(rx),
                    ),
                    Some(Ev::End(end)) if end.lost => (
                        Ok(RpcError::new(
                            Code::Unavailable,
                            end.error.unwrap_or_default(),
                        )
                        .end_of_stream()),
                        S::Done,
                    ),
                    Some(Ev::End(end)) => (
                        Ok(connect::message(&json!({"event": {"end": end}}))),
                        S::Close(connect::end_ok()),
                    ),
                    None => (
                        Ok(RpcError::new(
                            Code::ResourceExhausted,
                            format!(
                                "this stream fell more than {SUBSCRIBER_QUEUE} output chunks behind and was detached; process {pid} keeps running: re-attach with Connect"
                            ),
                        )
                        .end_of_stream()),
                        S::Done,
                    ),
                })
            }
            S::Close(b) => Some((Ok(b), S::Done)),
            S::Done => None,
        }
    })
}

/// envd's data event of output: `pty` on a terminal, else `stdout`.
fn data_event(pty: bool, b64: &str) -> Value {
    let key = if pty { "pty" } else { "stdout" };
    let mut data = serde_json::Map::new();
    data.insert(key.to_string(), json!(b64));
    json!({"event": {"data": data}})
}

fn deadline_passed(pid: u32) -> RpcError {
    RpcError::new(
        Code::DeadlineExceeded,
        format!(
            "the call's timeout (Connect-Timeout-Ms) passed before process {pid} ended; a process Start ran is killed, one Connect attached to runs on (pass timeout=0 for no limit)"
        ),
    )
}

/// `StartRequest`.
#[derive(Debug, Deserialize)]
pub struct StartRequest {
    /// What to run.
    pub process: ProcessConfig,
    /// A terminal (not served).
    #[serde(default)]
    pub pty: Option<Value>,
    /// A name to find it by later.
    #[serde(default)]
    pub tag: Option<String>,
    /// Keep stdin open for `SendInput`.
    #[serde(default)]
    pub stdin: Option<bool>,
}

/// The exec spec of a `Start`: the request's env (the node adds the
/// sandbox's create-time envs under it), `cwd` resolved against `home`,
/// the deadline as the exec timeout.
pub fn exec_spec(req: &StartRequest, home: &str, timeout: Option<Duration>) -> RpcResult<ExecSpec> {
    let pty = req.pty.as_ref().map(pty_size).transpose()?;
    if req.process.cmd.is_empty() || req.process.cmd.contains('\0') {
        return Err(RpcError::invalid(
            "process.cmd must be a non-empty program path",
        ));
    }
    if req.process.args.len() > 4096 || req.process.args.iter().any(|a| a.contains('\0')) {
        return Err(RpcError::invalid(
            "process.args: at most 4096 arguments, none containing NUL",
        ));
    }
    if req.tag.as_ref().is_some_and(|t| t.len() > 256) {
        return Err(RpcError::invalid("tag: at most 256 bytes"));
    }
    forkd_node::limits::check_env(&req.process.envs)
        .map_err(|m| RpcError::invalid(format!("process.envs: {m}")))?;
    let mut env = req.process.envs.clone();
    env.insert("HOME".into(), home.to_string());
    let cwd = crate::guest::resolve_path(req.process.cwd.as_deref().unwrap_or(""), home)?;
    let mut argv = vec![req.process.cmd.clone()];
    argv.extend(req.process.args.iter().cloned());
    Ok(ExecSpec {
        argv: Some(argv),
        env,
        cwd: Some(cwd),
        timeout_ms: timeout.map(|t| t.as_millis() as u64),
        output_limit: Some(OUTPUT_LIMIT),
        stream: true,
        stdin_open: req.stdin == Some(true) || pty.is_some(),
        pty,
        ..Default::default()
    })
}

/// A terminal's size from envd's `PTY` message (`{"size": {"rows", "cols"}}`).
pub fn pty_size(v: &Value) -> RpcResult<PtySize> {
    let dim = |k: &str| {
        v.get("size")
            .and_then(|s| s.get(k))
            .and_then(Value::as_u64)
            .and_then(|n| u16::try_from(n).ok())
    };
    let (Some(rows), Some(cols)) = (dim("rows"), dim("cols")) else {
        return Err(RpcError::invalid(
            "pty.size needs rows and cols (whole numbers)",
        ));
    };
    let size = PtySize { rows, cols };
    size.validate()
        .map_err(|m| RpcError::invalid(format!("pty.size: {m}")))?;
    Ok(size)
}

/// `{"processes": [ProcessInfo]}` for `List`.
pub fn list_json(t: &Table) -> Value {
    let ps: Vec<Value> = t
        .running()
        .iter()
        .map(|p| {
            let mut v = json!({"pid": p.pid, "config": p.config});
            if let Some(tag) = &p.tag {
                v["tag"] = json!(tag);
            }
            v
        })
        .collect();
    json!({"processes": ps})
}

/// A signal of `SendSignal`: envd's enum names or numbers.
pub fn parse_signal(v: &Value) -> RpcResult<i32> {
    let n = match v {
        Value::String(s) => match s.as_str() {
            "SIGNAL_SIGKILL" => 9,
            "SIGNAL_SIGTERM" => 15,
            "SIGNAL_SIGINT" => 2,
            "SIGNAL_SIGHUP" => 1,
            other => other.parse().unwrap_or(0),
        },
        Value::Number(n) => n.as_i64().unwrap_or(0) as i32,
        _ => 0,
    };
    if matches!(n, 1 | 2 | 9 | 15) {
        Ok(n)
    } else {
        Err(RpcError::invalid(format!(
            "signal {v}: want SIGNAL_SIGKILL, SIGNAL_SIGTERM, SIGNAL_SIGINT or SIGNAL_SIGHUP"
        )))
    }
}

/// The control of `p` while it runs.
fn running(p: &Proc) -> RpcResult<&ProcessControl> {
    match &p.control {
        Some(c) if p.running() => Ok(c),
        _ => Err(RpcError::new(
            Code::NotFound,
            format!("process {} has ended", p.pid),
        )),
    }
}

/// Sends `signal` to the process group of `p`.
pub async fn signal(p: &Proc, signal: i32) -> RpcResult<()> {
    Ok(running(p)?.signal(signal).await?)
}

/// Resizes the terminal of `p`.
pub async fn resize(p: &Proc, size: PtySize) -> RpcResult<()> {
    if !p.pty {
        return Err(RpcError::invalid(format!(
            "process {} has no terminal to resize",
            p.pid
        )));
    }
    Ok(running(p)?.resize(size).await?)
}

/// Writes `data` (and EOF when `eof`) to the stdin of `p`.
pub async fn input(p: &Proc, data: &[u8], eof: bool) -> RpcResult<()> {
    Ok(running(p)?.stdin(data, eof).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_read_like_envd() {
        let ok = End::from_result(&ExecResult {
            exit_code: Some(0),
            ..Default::default()
        });
        assert_eq!(
            serde_json::to_value(&ok).unwrap(),
            json!({"exitCode": 0, "exited": true, "status": "exit status 0"})
        );
        let killed = End::from_result(&ExecResult {
            signal: Some(9),
            ..Default::default()
        });
        assert_eq!((killed.exit_code, killed.exited), (-1, false));
        assert_eq!(killed.status, "signal: killed");
        let timed_out = End::from_result(&ExecResult {
            exit_code: None,
            signal: Some(9),
            timed_out: true,
            ..Default::default()
        });
        assert_eq!(timed_out.status, "signal: killed");
    }

    #[test]
    fn terminal_sizes_and_output() {
        let s = pty_size(&json!({"size": {"rows": 24, "cols": 80}})).unwrap();
        assert_eq!((s.rows, s.cols), (24, 80));
        assert!(pty_size(&json!({"size": {"rows": 0, "cols": 80}})).is_err());
        assert!(pty_size(&json!({"size": {"rows": 70000, "cols": 80}})).is_err());
        assert!(pty_size(&json!({})).is_err());
        assert_eq!(data_event(true, "eA==")["event"]["data"]["pty"], "eA==");
        assert_eq!(data_event(false, "eA==")["event"]["data"]["stdout"], "eA==");
    }

    #[test]
    fn signals() {
        assert_eq!(parse_signal(&json!("SIGNAL_SIGKILL")).unwrap(), 9);
        assert_eq!(parse_signal(&json!(15)).unwrap(), 15);
        assert!(parse_signal(&json!("SIGNAL_UNSPECIFIED")).is_err());
        assert!(parse_signal(&json!(11)).is_err());
    }

    #[test]
    fn a_slow_subscriber_is_dropped_and_keeps_room_for_the_end() {
        let p = Proc {
            pid: 7,
            pty: false,
            tag: None,
            config: ProcessConfig::default(),
            control: None,
            state: Mutex::new(ProcState::default()),
        };
        let mut slow = p.subscribe().unwrap();
        let mut fast = p.subscribe().unwrap();
        for i in 0..SUBSCRIBER_QUEUE * 2 {
            p.publish(Ev::Stdout(Bytes::from(vec![b'x'; 10])));
            // The fast one reads as output comes.
            assert!(matches!(fast.try_recv(), Ok(Ev::Stdout(_))), "event {i}");
        }
        p.finish(End::failed("x".into()));
        assert!(matches!(fast.try_recv(), Ok(Ev::End(_))));
        let mut n = 0;
        while let Ok(ev) = slow.try_recv() {
            assert!(matches!(ev, Ev::Stdout(_)));
            n += 1;
        }
        assert_eq!(n, SUBSCRIBER_QUEUE - 1);
        // Attaching after the end gets the end at once.
        let mut late = p.subscribe().unwrap();
        assert!(matches!(late.try_recv(), Ok(Ev::End(_))));
    }

    #[test]
    fn subscribers_are_bounded() {
        let p = Proc {
            pid: 7,
            pty: false,
            tag: None,
            config: ProcessConfig::default(),
            control: None,
            state: Mutex::new(ProcState::default()),
        };
        let _subs: Vec<_> = (0..MAX_SUBSCRIBERS)
            .map(|_| p.subscribe().unwrap())
            .collect();
        assert_eq!(p.subscribe().unwrap_err().code, Code::ResourceExhausted);
    }

    #[tokio::test]
    async fn a_stream_ends_with_deadline_exceeded_at_its_deadline() {
        use futures::StreamExt;
        let (_tx, rx) = mpsc::channel(1);
        let deadline = Instant::now() + Duration::from_millis(50);
        let s = event_stream(7, false, rx, Duration::from_secs(60), Some(deadline));
        let msgs: Vec<Bytes> = s.map(|m| m.unwrap()).collect().await;
        assert_eq!(msgs.len(), 2, "start, then the end of stream");
        assert_eq!(msgs[0][0], connect::FLAG_DATA);
        assert_eq!(msgs[1][0], connect::FLAG_END);
        let v: Value = serde_json::from_slice(&msgs[1][5..]).unwrap();
        assert_eq!(v["error"]["code"], "deadline_exceeded");
        assert!(Instant::now() >= deadline);
    }
}
