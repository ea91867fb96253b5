//! Terminal sessions end to end: an interactive shell on a pseudo-terminal
//! in a real guest, driven over poold's WebSocket (`/v1/sandboxes/:id/pty`)
//! with a real WebSocket client: prompt and echo, the terminal's size and
//! its change, Ctrl-C reaching the foreground job, the exit status; and a
//! client that leaves takes its processes with it.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

const MINIMAL_MIB: u64 = 128;

/// Percent-encodes a query value.
fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn connect(p: &Poold, id: &str, query: &str) -> Ws {
    let url = format!(
        "{}/v1/sandboxes/{id}/pty?{query}",
        p.url.replacen("http://", "ws://", 1)
    );
    let (ws, _) = tokio_tungstenite::connect_async(url.as_str())
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    ws
}

/// The session as it arrives: terminal output, and the control messages.
#[derive(Default)]
struct Seen {
    out: String,
    control: Vec<Value>,
}

impl Seen {
    /// Reads until `done` holds (panics after 60 s or if the socket ends).
    async fn until(&mut self, ws: &mut Ws, what: &str, done: impl Fn(&Seen) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !done(self) {
            let msg = tokio::time::timeout_at(deadline, ws.next())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "timed out waiting for {what}; output so far: {:?}, control: {:?}",
                        self.out, self.control
                    )
                });
            match msg {
                Some(Ok(Message::Binary(b))) => self.out.push_str(&String::from_utf8_lossy(&b)),
                Some(Ok(Message::Text(t))) => self.control.push(serde_json::from_str(&t).unwrap()),
                Some(Ok(Message::Close(_))) | None => {
                    assert!(
                        done(self),
                        "the session ended before {what}: {:?} {:?}",
                        self.out,
                        self.control
                    );
                    return;
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => panic!("websocket: {e}"),
            }
        }
    }

    /// Waits for `text` in the output after byte `from`.
    async fn output(&mut self, ws: &mut Ws, from: usize, text: &str) {
        self.until(ws, text, |s| {
            s.out.get(from..).is_some_and(|o| o.contains(text))
        })
        .await
    }
}

async fn typed(ws: &mut Ws, s: &str) {
    ws.send(Message::Binary(s.as_bytes().to_vec().into()))
        .await
        .unwrap();
}

async fn control(ws: &mut Ws, v: Value) {
    ws.send(Message::Text(v.to_string().into())).await.unwrap();
}

#[test]
fn an_interactive_shell_on_a_terminal() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        p.snapshot("m", "minimal", MINIMAL_MIB).await;
        let (st, v) = p.post("/v1/sandboxes", json!({"snapshot_tag": "m"})).await;
        assert_eq!(st, 201, "{v}");
        let id = ids(&v).remove(0);

        let mut ws = connect(
            &p,
            &id,
            &format!(
                "rows=30&cols=100&cmd={}",
                enc("PS1='ready> ' exec /bin/sh -i")
            ),
        )
        .await;
        let mut s = Seen::default();
        s.until(&mut ws, "started", |s| {
            s.control.iter().any(|c| c["type"] == "started")
        })
        .await;
        s.output(&mut ws, 0, "ready> ").await;

        // The terminal echoes what is typed and is the shell's own.
        let mark = s.out.len();
        typed(&mut ws, "tty; stty size\r").await;
        s.output(&mut ws, mark, "tty; stty size").await;
        s.output(&mut ws, mark, "/dev/pts/").await;
        s.output(&mut ws, mark, "30 100").await;

        // A resize reaches the terminal.
        control(&mut ws, json!({"type": "resize", "rows": 45, "cols": 132})).await;
        let mark = s.out.len();
        typed(&mut ws, "stty size\r").await;
        s.output(&mut ws, mark, "45 132").await;

        // Ctrl-C interrupts the foreground job, as on any terminal: only a
        // controlling terminal turns the byte into SIGINT.
        let mark = s.out.len();
        typed(&mut ws, "sleep 600; echo slept\r").await;
        s.output(&mut ws, mark, "sleep 600").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        typed(&mut ws, "\x03").await;
        typed(&mut ws, "echo $((6 * 7))\r").await;
        s.output(&mut ws, mark, "\r\n42\r\n").await;
        // The typed line echoes "echo slept"; the command's own output
        // would be "slept" on a line of its own.
        assert!(
            !s.out[mark..].contains("\nslept\r\n"),
            "{:?}",
            &s.out[mark..]
        );

        // A program reading the terminal gets what is typed.
        let mark = s.out.len();
        typed(&mut ws, "read answer; echo \"got [$answer]\"\r").await;
        s.output(&mut ws, mark, "read answer").await;
        typed(&mut ws, "forty two\r").await;
        s.output(&mut ws, mark, "got [forty two]").await;

        // A bad control message is answered, and the session goes on.
        control(&mut ws, json!({"type": "resize", "rows": 0, "cols": 5})).await;
        s.until(&mut ws, "a warning", |s| {
            s.control.iter().any(|c| c["type"] == "warning")
        })
        .await;

        // Input as a text control message, then the exit status.
        control(&mut ws, json!({"type": "input", "data": "exit 3\r"})).await;
        s.until(&mut ws, "the exit", |s| {
            s.control.iter().any(|c| c["type"] == "exit")
        })
        .await;
        let exit = s.control.iter().find(|c| c["type"] == "exit").unwrap();
        assert_eq!(exit["exit_code"], 3, "{exit}");

        // A client that goes away takes its session's processes along.
        let mut ws = connect(&p, &id, &format!("cmd={}", enc("exec sleep 4242"))).await;
        let mut s = Seen::default();
        s.until(&mut ws, "started", |s| {
            s.control.iter().any(|c| c["type"] == "started")
        })
        .await;
        let running = |p: &Poold| {
            let p = p.client.clone();
            let id = id.clone();
            async move {
                let (_, body) = p
                    .send(
                        forkd_api::Method::POST,
                        &format!("/v1/sandboxes/{id}/exec"),
                        Some(json!({"args": ["/bin/sh", "-c", "ps -o args | grep -c '^sleep 4242' || true"]})),
                    )
                    .await
                    .unwrap();
                let v: Value = serde_json::from_slice(&body).unwrap();
                v["stdout"].as_str().unwrap().trim().to_string()
            }
        };
        assert_eq!(running(&p).await, "1");
        drop(ws);
        let mut left = String::new();
        for _ in 0..100 {
            left = running(&p).await;
            if left == "0" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(left, "0", "the session's process outlived its client");
    });
}

/// forkd's `stream` action on the guest's :8888 line protocol (a networked
/// sandbox): a shell on a terminal, typed into with `{"in"}`, resized with
/// `{"resize"}`, its exit status as `{"exit_code"}`; and `{"action":"stop"}`
/// ending a command that would run for ever.
#[test]
fn forkd_stream_action_runs_a_terminal_session() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (child networks)");
        return;
    }
    let home = Home::new();
    let _scope = NetnsScope(forkd_net::netns_name(&forkd_net::scope_of(&home.dir), ""));
    let p = Poold::start(&home.dir, &[], None);
    let addr = block_on(async {
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "mnet", "image": "minimal", "mem_mib": MINIMAL_MIB, "net": true}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "mnet", "per_child_netns": true}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        v[0]["guest_addr"].as_str().unwrap().to_string()
    });
    use std::io::{BufRead, BufReader, Write};
    let open = |req: Value| {
        let c = std::net::TcpStream::connect((addr.as_str(), 8888)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut w = c.try_clone().unwrap();
        writeln!(w, "{req}").unwrap();
        (w, BufReader::new(c))
    };
    let line = |r: &mut BufReader<std::net::TcpStream>| -> Value {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("{l:?}: {e}"))
    };
    // Reads `{"out"}` lines until `text` has appeared; returns the output.
    let until = |r: &mut BufReader<std::net::TcpStream>, text: &str| -> String {
        let mut out = String::new();
        while !out.contains(text) {
            let v = line(r);
            match v["out"].as_str() {
                Some(o) => out.push_str(o),
                None => panic!("waiting for {text:?}: {v}, output so far {out:?}"),
            }
        }
        out
    };

    let (mut w, mut r) = open(
        json!({"action": "stream", "args": ["/bin/sh", "-i"], "pty": true, "rows": 20, "cols": 70}),
    );
    let started = line(&mut r);
    assert_eq!(started["stream"], "started", "{started}");
    assert_eq!(started["pty"], true, "{started}");
    assert!(started["pid"].as_u64().unwrap() > 1, "{started}");
    writeln!(w, "{}", json!({"in": "stty size\r"})).unwrap();
    until(&mut r, "20 70");
    writeln!(w, "{}", json!({"resize": [50, 160]})).unwrap();
    writeln!(w, "{}", json!({"in": "stty size\r"})).unwrap();
    until(&mut r, "50 160");
    writeln!(w, "{}", json!({"in": "exit 5\r"})).unwrap();
    let last = loop {
        let v = line(&mut r);
        if v.get("out").is_none() {
            break v;
        }
    };
    assert_eq!(last, json!({"exit_code": 5}));

    // Without a terminal: output as it comes, then stop.
    let (mut w, mut r) =
        open(json!({"action": "stream", "args": ["/bin/sh", "-c", "echo begun; exec sleep 3600"]}));
    assert_eq!(line(&mut r)["pty"], false);
    until(&mut r, "begun\n");
    writeln!(w, "{}", json!({"action": "stop"})).unwrap();
    let last = line(&mut r);
    assert_eq!(last["exit_code"], 137, "SIGKILL: {last}");
    drop(p);
}

/// Deletes the test data dir's child namespaces on drop (a failed run
/// leaves none behind).
struct NetnsScope(String);

impl Drop for NetnsScope {
    fn drop(&mut self) {
        let _ = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "for n in $(ls /run/netns 2>/dev/null | grep '^{}'); do ip netns del $n; done",
                self.0
            ))
            .status();
    }
}
