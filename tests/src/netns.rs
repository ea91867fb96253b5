//! Network namespaces a test creates to stand for "elsewhere" (a LAN, the
//! internet, a proxy): each linked to the root namespace by a veth pair,
//! named with a random suffix (other engineers' tests run beside ours), and
//! removed with everything added for it when dropped. Servers run on
//! threads that entered the namespace, so they only ever talk to addresses
//! on this machine.

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::process::Command;
use std::time::Duration;

/// Runs `cmd` with `sh -c`; whether it succeeded, and its output.
pub fn sh(cmd: &str) -> (bool, String) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// Runs `cmd`, failing the test with its output when it fails.
pub fn must(cmd: &str) {
    let (ok, out) = sh(cmd);
    assert!(ok, "{cmd}: {out}");
}

/// Six random hex digits for names.
pub fn suffix() -> String {
    format!("{:06x}", rand::random::<u32>() & 0xff_ffff)
}

/// A namespace `fdt-<kind>-<suffix>` linked to the root namespace by the
/// veth `<link>` (root side) / `<link>p` (inside).
pub struct TestNs {
    /// The namespace's name.
    pub name: String,
    /// The root side of its veth pair.
    pub link: String,
    /// The root side's address (a host address).
    pub root_addr: Ipv4Addr,
    /// Commands undoing what was added beside the namespace, run last first.
    undo: Vec<String>,
}

impl TestNs {
    /// Creates the namespace with `inner/prefix` inside and `root/prefix` on
    /// the root side; the namespace's default route goes through the root.
    /// `link` is at most 14 characters.
    pub fn new(kind: &str, link: &str, root: Ipv4Addr, inner: Ipv4Addr, prefix: u8) -> TestNs {
        let name = format!("fdt-{kind}-{}", &link[link.len().saturating_sub(6)..]);
        let ns = TestNs {
            name: name.clone(),
            link: link.to_string(),
            root_addr: root,
            undo: Vec::new(),
        };
        let peer = format!("{link}p");
        for cmd in [
            format!("ip netns add {name}"),
            format!("ip link add {link} type veth peer name {peer}"),
            format!("ip link set {peer} netns {name}"),
            format!("ip addr add {root}/{prefix} dev {link}"),
            format!("ip link set {link} up"),
            format!("ip -n {name} link set lo up"),
            format!("ip -n {name} addr add {inner}/{prefix} dev {peer}"),
            format!("ip -n {name} link set {peer} up"),
            format!("ip -n {name} route add default via {root}"),
        ] {
            must(&cmd);
        }
        ns
    }

    /// Runs `cmd` now and `undo` when the namespace is dropped.
    pub fn add(&mut self, cmd: &str, undo: &str) {
        must(cmd);
        self.undo.push(undo.to_string());
    }

    /// Runs `cmd` inside the namespace.
    pub fn sh_in(&self, cmd: &str) -> (bool, String) {
        sh(&format!("ip netns exec {} sh -c '{cmd}'", self.name))
    }

    /// Runs `f` on a new thread inside the namespace (its sockets, and
    /// those of threads it starts, live there).
    pub fn spawn<F: FnOnce() + Send + 'static>(&self, f: F) {
        let file = std::fs::File::open(format!("/run/netns/{}", self.name)).unwrap();
        std::thread::spawn(move || {
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        });
    }

    /// An HTTP/1.0 server at `addr:port` answering `body` to every request.
    pub fn serve_http(&self, addr: Ipv4Addr, port: u16, body: &'static str) {
        let (tx, rx) = std::sync::mpsc::channel();
        self.spawn(move || {
            let l = std::net::TcpListener::bind((addr, port)).unwrap();
            tx.send(()).unwrap();
            for c in l.incoming().flatten() {
                std::thread::spawn(move || answer_http(c, body));
            }
        });
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
    }

    /// A DNS server on `addr:53` (UDP) answering `name`'s A query with
    /// `answer`, other A queries with NXDOMAIN and anything else with no
    /// records (hickory-proto encodes and decodes).
    pub fn serve_dns(&self, addr: Ipv4Addr, name: &'static str, answer: Ipv4Addr) {
        let (tx, rx) = std::sync::mpsc::channel();
        self.spawn(move || {
            let s = std::net::UdpSocket::bind((addr, 53)).unwrap();
            tx.send(()).unwrap();
            let mut buf = [0u8; 1500];
            while let Ok((n, peer)) = s.recv_from(&mut buf) {
                if let Some(reply) = dns_answer(&buf[..n], name, answer) {
                    let _ = s.send_to(&reply, peer);
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        for cmd in self.undo.iter().rev() {
            sh(cmd);
        }
        sh(&format!(
            "ip netns del {}; ip link del {}",
            self.name, self.link
        ));
    }
}

fn answer_http(c: std::net::TcpStream, body: &str) {
    use std::io::{BufRead, BufReader, Write};
    let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
    let mut r = BufReader::new(&c);
    let mut line = String::new();
    while r.read_line(&mut line).map(|n| n > 2).unwrap_or(false) {
        line.clear();
    }
    let _ = write!(
        &c,
        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
}

/// The answer to DNS query `q`, or None when it is not a query.
fn dns_answer(q: &[u8], name: &str, answer: Ipv4Addr) -> Option<Vec<u8>> {
    use hickory_proto::op::{Message, MessageType, ResponseCode};
    use hickory_proto::rr::{rdata::A, RData, Record, RecordType};
    let q = Message::from_vec(q).ok()?;
    let mut r = Message::new();
    r.set_id(q.id())
        .set_message_type(MessageType::Response)
        .set_op_code(q.op_code())
        .set_recursion_desired(q.recursion_desired())
        .set_recursion_available(true);
    let mut known = false;
    for query in q.queries() {
        r.add_query(query.clone());
        let matches = query.name().to_ascii().trim_end_matches('.') == name;
        known |= matches;
        if matches && query.query_type() == RecordType::A {
            r.add_answer(Record::from_rdata(
                query.name().clone(),
                60,
                RData::A(A(answer)),
            ));
        }
    }
    if !known {
        r.set_response_code(ResponseCode::NXDomain);
    }
    r.to_vec().ok()
}

/// The first `/24` of `10.<second>.x.0/24` no address of this host is in,
/// so a test's LAN never collides with a real one (or another test's).
pub fn free_lan(second: u8) -> [u8; 3] {
    let (_, used) = sh("ip -4 -o addr show");
    loop {
        let third = rand::random::<u8>();
        let prefix = format!(" 10.{second}.{third}.");
        if !used.contains(&prefix) {
            return [10, second, third];
        }
    }
}

/// What a TCP connection from a sandbox to an address came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// It connected and this came back.
    Reached(String),
    /// Something answered with a reset: the packet got there.
    Refused,
    /// No answer within the timeout: the packet was dropped on the way.
    Dropped,
}

/// Sends an HTTP request from sandbox `id` to `addr:port` with busybox `nc`
/// (a 4 s connect timeout) and says what happened.
pub async fn probe(p: &crate::daemon::Poold, id: &str, addr: Ipv4Addr, port: u16) -> Probe {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            serde_json::json!({"args": ["sh", "-c",
                format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 4 {addr} {port}")],
                   "timeout_secs": 30}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let out = v["stdout"].as_str().unwrap_or("").to_string();
    let err = v["stderr"].as_str().unwrap_or("");
    if v["exit_code"] == 0 && out.contains("200 OK") {
        Probe::Reached(out.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
    } else if err.contains("refused") {
        Probe::Refused
    } else {
        assert!(
            err.contains("timed out") || out.is_empty(),
            "neither an answer, a refusal nor a timeout: {v}"
        );
        Probe::Dropped
    }
}
