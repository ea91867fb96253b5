//! The warm interpreter: one persistent Python process per guest (or, in
//! forkd's Node mode, a Node process) that has already imported the warm-up
//! modules, so a forked child evaluates code without paying the imports
//! again. Requests are serialised (one interpreter, one thread of it). Both
//! programs (`evald.py`, `evald.js`) speak the same line protocol on fds 3
//! and 4: a ready line, then one reply per `eval`/`reseed` request.

use super::config::Lang;
use crate::protocol::{AgentError, ErrorKind, EvalResult};
use serde::Deserialize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio::sync::{watch, Mutex};

const EVALD_PY: &str = include_str!("evald.py");
const EVALD_JS: &str = include_str!("evald.js");
/// The Node addon that reseeds OpenSSL at hand-out (build.rs builds it from
/// native/openssl_reseed.c, which says why Node needs it).
const OPENSSL_RESEED_NODE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/openssl_reseed.node"));
/// Where the agent puts that addon: its own tmpfs in the guest.
const NATIVE_DIR: &str = "/run/forkd";
/// Default bound on one eval; on expiry the interpreter is restarted.
pub const DEFAULT_EVAL_TIMEOUT: Duration = Duration::from_secs(300);
/// Bound on a reseed, warm-up modules' `forkd_reseed` hooks included. A
/// hook may do real work (the browser image's reseeds every Chromium
/// process and opens a page in a new renderer: up to 25 s under TCG on a
/// busy host), yet the whole identity request must answer within the
/// host's 60 s (poold's `restore::READY_TIMEOUT`).
pub const RESEED_TIMEOUT: Duration = Duration::from_secs(50);

/// What ping reports about the interpreter.
#[derive(Debug, Clone, Default)]
pub struct Status {
    /// The interpreter is running and finished its warm-up.
    pub ready: bool,
    /// Why it is not running or its warm-up failed.
    pub error: Option<String>,
    /// Pid of the interpreter process.
    pub pid: Option<u32>,
    /// Its Python version.
    pub python_version: Option<String>,
    /// numpy's version, when numpy imports.
    pub numpy_version: Option<String>,
    /// Node's version, for a Node interpreter.
    pub node_version: Option<String>,
}

struct Proc {
    child: Child,
    tx: pipe::Sender,
    rx: BufReader<pipe::Receiver>,
}

/// Handle to the warm interpreter. Cheap to clone.
#[derive(Clone)]
pub struct Interpreter {
    /// The program (python3 or node); `None`: no eval in this image.
    program: Option<String>,
    lang: Lang,
    env: Vec<(String, String)>,
    proc_: Arc<Mutex<Option<Proc>>>,
    status: watch::Sender<Status>,
}

#[derive(Deserialize)]
struct Ready {
    pid: u32,
    python: Option<String>,
    numpy: Option<String>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    errors: Vec<String>,
}

impl Interpreter {
    /// Creates the handle for a `lang` interpreter run by `program` (None:
    /// the image has none, eval answers "not ready"); `start` launches it.
    /// `warmup_code` is in the interpreter's language.
    pub fn new(
        lang: Lang,
        program: Option<String>,
        imports: &[String],
        warmup_code: Option<&str>,
    ) -> Self {
        let mut env = vec![("FORKD_WARMUP_IMPORTS".to_string(), imports.join(","))];
        if let Some(c) = warmup_code {
            env.push(("FORKD_WARMUP_CODE".into(), c.into()));
        }
        let missing = match lang {
            Lang::Python => "no python3 in this image",
            Lang::Node => "no node in this image",
        };
        let status = Status {
            error: program.is_none().then(|| missing.to_string()),
            ..Default::default()
        };
        Interpreter {
            program,
            lang,
            env,
            proc_: Arc::new(Mutex::new(None)),
            status: watch::channel(status).0,
        }
    }

    /// The interpreter's language.
    pub fn lang(&self) -> Lang {
        self.lang
    }

    /// The interpreter's state now, for `ping`.
    pub fn status(&self) -> Status {
        self.status.borrow().clone()
    }

    /// Starts (or restarts) the interpreter and waits for its warm-up.
    pub async fn start(&self) {
        let mut guard = self.proc_.lock().await;
        self.start_locked(&mut guard).await;
    }

    async fn start_locked(&self, slot: &mut Option<Proc>) {
        if let Some(mut old) = slot.take() {
            let _ = old.child.start_kill();
            let _ = old.child.wait().await;
        }
        let Some(program) = self.program.clone() else {
            return;
        };
        self.status.send_modify(|s| *s = Status::default());
        match self.spawn(&program).await {
            Ok((p, ready)) => {
                let err = (!ready.errors.is_empty()).then(|| ready.errors.join("; "));
                self.status.send_replace(Status {
                    ready: true,
                    error: err,
                    pid: Some(ready.pid),
                    python_version: ready.python,
                    numpy_version: ready.numpy,
                    node_version: ready.node,
                });
                *slot = Some(p);
            }
            Err(e) => {
                eprintln!("forkd-agent: warm interpreter failed to start: {e}");
                self.status.send_replace(Status {
                    error: Some(e),
                    ..Default::default()
                });
            }
        }
    }

    async fn spawn(&self, program: &str) -> Result<(Proc, Ready), String> {
        let (req_r, req_w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| e.to_string())?;
        let (rep_r, rep_w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(program);
        match self.lang {
            Lang::Python => cmd.arg("-u").arg("-c").arg(EVALD_PY),
            Lang::Node => {
                let addon = install_openssl_reseed(std::path::Path::new(NATIVE_DIR))?;
                cmd.env("FORKD_OPENSSL_RESEED", addon);
                cmd.arg("-e").arg(EVALD_JS)
            }
        };
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        // CA bundles installed before this (re)start.
        cmd.envs(super::ca::env());
        cmd.env("PYTHONDONTWRITEBYTECODE", "1");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit());
        cmd.current_dir("/");
        let (cr, cw) = (req_r.as_raw_fd(), rep_w.as_raw_fd());
        // SAFETY: only async-signal-safe calls (fcntl, dup2) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let r = libc::fcntl(cr, libc::F_DUPFD, 10);
                let w = libc::fcntl(cw, libc::F_DUPFD, 10);
                if r < 0 || w < 0 || libc::dup2(r, 3) < 0 || libc::dup2(w, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                crate::unblock_all_signals()
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("spawning {program}: {e}"))?;
        drop((req_r, rep_w));
        let tx = pipe_sender(req_w)?;
        let mut rx = BufReader::new(pipe_receiver(rep_r)?);
        let mut line = String::new();
        let n = rx.read_line(&mut line).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!(
                "{program} exited during warm-up (see the console log)"
            ));
        }
        let ready: Ready =
            serde_json::from_str(&line).map_err(|e| format!("bad warm-up reply: {e}"))?;
        Ok((Proc { child, tx, rx }, ready))
    }

    /// Evaluates `code`; the interpreter's state persists between calls.
    pub async fn eval(
        &self,
        code: &str,
        timeout: Option<Duration>,
    ) -> Result<EvalResult, AgentError> {
        let req = serde_json::json!({"op": "eval", "code": code});
        let v = self
            .call(req, timeout.unwrap_or(DEFAULT_EVAL_TIMEOUT))
            .await?;
        serde_json::from_value(v).map_err(|e| {
            AgentError::new(
                ErrorKind::Internal,
                format!("bad reply from the interpreter: {e}"),
            )
        })
    }

    /// Reseeds the interpreter's generators from fresh entropy: `random`,
    /// numpy's global RNG and the `ssl` module's OpenSSL in Python; OpenSSL
    /// (through native/openssl_reseed.c) and `Math.random` in Node. Fails
    /// when the interpreter could not reseed one of them, so a hand-out never
    /// yields a child that draws its siblings' numbers.
    pub async fn reseed(&self, seed: &[u8]) -> Result<(), AgentError> {
        let hex: String = seed.iter().map(|b| format!("{b:02x}")).collect();
        let reply = self
            .call(
                serde_json::json!({"op": "reseed", "seed": hex}),
                RESEED_TIMEOUT,
            )
            .await?;
        match reply.get("error").and_then(|e| e.as_str()) {
            Some(e) => Err(AgentError::new(
                ErrorKind::Internal,
                format!("reseeding the warm interpreter: {e}"),
            )),
            None => Ok(()),
        }
    }

    /// Sets `vars` in the running interpreter's environment (`os.environ`,
    /// `process.env`), for what it reads per call (requests reads
    /// `REQUESTS_CA_BUNDLE` per request) and the processes it starts. A
    /// no-op when no interpreter runs: the next one starts with them.
    pub async fn set_env(&self, vars: &[(String, String)]) -> Result<(), AgentError> {
        if !self.status().ready {
            return Ok(());
        }
        let set: serde_json::Map<String, serde_json::Value> = vars
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::from(v.as_str())))
            .collect();
        let reply = self
            .call(
                serde_json::json!({"op": "env", "set": set}),
                Duration::from_secs(10),
            )
            .await?;
        match reply.get("error").and_then(|e| e.as_str()) {
            Some(e) => Err(AgentError::new(
                ErrorKind::Internal,
                format!("setting the warm interpreter's environment: {e}"),
            )),
            None => Ok(()),
        }
    }

    async fn call(
        &self,
        req: serde_json::Value,
        timeout: Duration,
    ) -> Result<serde_json::Value, AgentError> {
        let mut guard = self.proc_.lock().await;
        let Some(p) = guard.as_mut() else {
            let why = self
                .status()
                .error
                .unwrap_or_else(|| "it is not running".into());
            return Err(AgentError::new(
                ErrorKind::NotReady,
                format!("warm interpreter unavailable: {why}"),
            ));
        };
        let mut line = serde_json::to_vec(&req).expect("json");
        line.push(b'\n');
        let exchange = async {
            p.tx.write_all(&line).await?;
            let mut reply = String::new();
            let n = p.rx.read_line(&mut reply).await?;
            Ok::<_, std::io::Error>((n, reply))
        };
        let outcome = tokio::time::timeout(timeout, exchange).await;
        let failure = match outcome {
            Ok(Ok((n, reply))) if n > 0 => {
                return serde_json::from_str(&reply).map_err(|e| {
                    AgentError::new(ErrorKind::Internal, format!("bad reply from the interpreter: {e}"))
                })
            }
            Ok(Ok(_)) => AgentError::new(ErrorKind::Internal, "the warm interpreter exited; it was restarted and its state is lost"),
            Ok(Err(e)) => AgentError::new(ErrorKind::Io, format!("warm interpreter pipe: {e}; it was restarted")),
            Err(_) => AgentError::new(
                ErrorKind::Timeout,
                format!("eval took longer than {:.0?}; the interpreter was restarted and its state is lost", timeout),
            ),
        };
        self.start_locked(&mut guard).await;
        Err(failure)
    }
}

/// Writes the OpenSSL reseed addon to `/run/forkd/openssl_reseed.node`
/// at the agent's start, in every mode: other Node processes in the guest
/// that must be reseeded after a fork load it from there (the
/// code-interpreter image's JavaScript contexts).
pub fn install_native_helpers() {
    if let Err(e) = install_openssl_reseed(std::path::Path::new(NATIVE_DIR)) {
        eprintln!("forkd-agent: {e}");
    }
}

/// Writes the OpenSSL reseed addon into `dir` (or the temporary directory
/// when `dir` does not exist, as outside a guest) and returns its path.
fn install_openssl_reseed(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let dir = if dir.is_dir() {
        dir.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let path = dir.join("openssl_reseed.node");
    let tmp = dir.join(".openssl_reseed.node.tmp");
    std::fs::write(&tmp, OPENSSL_RESEED_NODE)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(path)
}

fn pipe_sender(fd: OwnedFd) -> Result<pipe::Sender, String> {
    set_nonblocking(&fd)?;
    pipe::Sender::from_owned_fd(fd).map_err(|e| e.to_string())
}

fn pipe_receiver(fd: OwnedFd) -> Result<pipe::Receiver, String> {
    set_nonblocking(&fd)?;
    pipe::Receiver::from_owned_fd(fd).map_err(|e| e.to_string())
}

fn set_nonblocking(fd: &OwnedFd) -> Result<(), String> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(fd.as_raw_fd(), FcntlArg::F_GETFL).map_err(|e| e.to_string())?;
    fcntl(
        fd.as_raw_fd(),
        FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK),
    )
    .map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The addon loads into a real Node and reseeds its OpenSSL (the fork
    /// property itself needs a cloned VM: tests/tests/recipes.rs).
    #[test]
    fn openssl_reseed_addon_loads_and_reseeds_in_node() {
        let dir = tempfile::tempdir().unwrap();
        let addon = install_openssl_reseed(dir.path()).unwrap();
        assert!(addon.starts_with(dir.path()));
        let script = "const m = {exports: {}}; process.dlopen(m, process.env.ADDON); \
            console.log(m.exports.reseed(require('crypto').randomBytes(32))); \
            try { m.exports.reseed('x') } catch (e) { console.log(e.name) }";
        let out = match std::process::Command::new("node")
            .args(["-e", script])
            .env("ADDON", &addon)
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                eprintln!("no node to load the addon into ({e}): skipped");
                return;
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stdout}{stderr}");
        assert_eq!(stdout, "true\nTypeError\n");
    }
}
