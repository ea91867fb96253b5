//! `forkd shell ID [-- CMD...]`: an interactive terminal in a sandbox, over
//! poold's WebSocket terminal sessions (docs/api.md, "Terminal sessions").
//! The local terminal is put in raw mode for the session, its size follows
//! the window (SIGWINCH), and the command's exit status is returned.

use super::sandbox::path_part;
use anyhow::{bail, Context, Result};
use clap::Args;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::io::Write;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

#[derive(Args, Debug)]
pub struct ShellArgs {
    /// Sandbox id.
    pub id: String,
    /// Working directory in the guest.
    #[arg(long)]
    pub cwd: Option<String>,
    /// The program and its arguments (default: a login shell).
    #[arg(last = true)]
    pub cmd: Vec<String>,
}

pub async fn shell(a: ShellArgs) -> Result<i32> {
    let url = std::env::var("FORKD_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| forkd_api::DEFAULT_URL.into());
    let token = std::env::var("FORKD_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    let (rows, cols) = window_size().unwrap_or((24, 80));
    let mut query = format!("rows={rows}&cols={cols}");
    if !a.cmd.is_empty() {
        let cmd: Vec<String> = a.cmd.iter().map(|w| quote(w)).collect();
        query += &format!("&cmd={}", encode(&cmd.join(" ")));
    }
    if let Some(c) = &a.cwd {
        query += &format!("&cwd={}", encode(c));
    }
    let path = format!("/v1/sandboxes/{}/pty?{query}", path_part(&a.id)?);
    if let Some(sock) = url.strip_prefix("unix://") {
        let stream = tokio::net::UnixStream::connect(sock)
            .await
            .with_context(|| format!("connecting to poold at {sock}"))?;
        drive(stream, &format!("ws://localhost{path}"), token).await
    } else if let Some(hostport) = url.strip_prefix("http://") {
        let hostport = hostport.trim_end_matches('/');
        let stream = tokio::net::TcpStream::connect(hostport)
            .await
            .with_context(|| format!("connecting to poold at {hostport}: is it running?"))?;
        drive(stream, &format!("ws://{hostport}{path}"), token).await
    } else {
        bail!("forkd shell needs FORKD_URL http://HOST:PORT or unix:///PATH, not {url:?}");
    }
}

/// Runs the session over `stream` until the remote program exits.
async fn drive<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    url: &str,
    token: Option<String>,
) -> Result<i32> {
    let mut req = url.into_client_request()?;
    if let Some(t) = token {
        req.headers_mut()
            .insert("Authorization", format!("Bearer {t}").parse()?);
    }
    let (ws, _) = tokio_tungstenite::client_async(req, stream)
        .await
        .context("opening the terminal session (is the sandbox id right?)")?;
    let (mut tx, mut rx) = ws.split();
    let _raw = RawMode::enter();
    let mut input = stdin_chunks();
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())?;
    let mut out = std::io::stdout();
    let mut input_open = true;
    loop {
        tokio::select! {
            msg = rx.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    out.write_all(&b)?;
                    out.flush()?;
                }
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(t.as_str()).unwrap_or_default();
                    match v["type"].as_str() {
                        Some("exit") => {
                            let code = match v["signal"].as_i64() {
                                Some(s) => 128 + s,
                                None => v["exit_code"].as_i64().unwrap_or(1),
                            };
                            return Ok(code as i32);
                        }
                        Some("error") => bail!("{}", v["error"].as_str().unwrap_or("session failed")),
                        _ => {}
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => bail!("terminal session: {e}"),
                None => bail!("poold closed the terminal session"),
            },
            chunk = input.recv(), if input_open => match chunk {
                Some(b) => tx.send(Message::Binary(b.into())).await?,
                // Local stdin ended: the remote terminal reads end of input.
                None => {
                    input_open = false;
                    tx.send(Message::Binary(vec![4u8].into())).await?;
                }
            },
            _ = winch.recv() => {
                if let Some((rows, cols)) = window_size() {
                    let m = json!({"type": "resize", "rows": rows, "cols": cols});
                    tx.send(Message::Text(m.to_string().into())).await?;
                }
            }
        }
    }
}

/// Local stdin on a thread of its own (a read blocked at exit must not
/// keep the process alive), as a bounded queue of chunks.
fn stdin_chunks() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 4096];
        let mut stdin = std::io::stdin();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}

/// The local terminal's size, if stdout is one.
fn window_size() -> Option<(u16, u16)> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize to the pointer, which outlives the call.
    let r = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_row > 0 && ws.ws_col > 0).then_some((ws.ws_row, ws.ws_col))
}

/// The local terminal in raw mode (keys go to the remote program as typed),
/// restored on drop; nothing when stdin is not a terminal.
struct RawMode(Option<nix::sys::termios::Termios>);

impl RawMode {
    fn enter() -> RawMode {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let Ok(saved) = tcgetattr(&stdin) else {
            return RawMode(None);
        };
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        if tcsetattr(&stdin, SetArg::TCSANOW, &raw).is_err() {
            return RawMode(None);
        }
        RawMode(Some(saved))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(saved) = &self.0 {
            let _ = nix::sys::termios::tcsetattr(
                std::io::stdin(),
                nix::sys::termios::SetArg::TCSANOW,
                saved,
            );
        }
    }
}

/// A word for `/bin/sh`, single-quoted unless it needs no quoting.
fn quote(w: &str) -> String {
    if !w.is_empty()
        && w.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
    {
        return w.to_string();
    }
    format!("'{}'", w.replace('\'', r"'\''"))
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_for_the_shell_and_encoded_for_the_query() {
        assert_eq!(quote("ls"), "ls");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
        assert_eq!(encode("python3 -i"), "python3%20-i");
        assert_eq!(encode("a&b=c/d"), "a%26b%3Dc%2Fd");
    }
}
