//! Per-child networking with real guests (docs/network.md): children of a
//! networked snapshot fetch a page from an HTTP server this test runs in a
//! namespace of its own (never any address off this machine), each seen
//! from a distinct source; egress policies hold; a published port serves a
//! server started in a child; a kill -9 of poold loses no child network,
//! and deleting the children leaves no namespace, link or rule of theirs.
//!
//! Needs root and nftables. The test namespace is `fdt-srv-<pid>`, linked
//! to the root namespace by the veth `fdtv<pid>`, 10.209.0.1/24 on the root
//! side and the server at 10.209.0.2 and 10.209.0.3: private addresses,
//! which a default policy denies (tests/tests/egress.rs), so the children
//! here name the server in `allow_out` (per spawn, and per pool).

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use serde_json::json;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MINIMAL_MIB: u64 = 128;
const SERVER_A: &str = "10.209.0.2";
const SERVER_B: &str = "10.209.0.3";
const PORT: u16 = 8080;

fn sh(cmd: &str) -> (bool, String) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// The test's HTTP server in its own namespace; records each client's
/// source address. Removed (namespace and veth) on drop.
struct Server {
    ns: String,
    link: String,
    seen: Arc<Mutex<Vec<Ipv4Addr>>>,
}

impl Server {
    fn start() -> Server {
        let pid = std::process::id();
        let (ns, link) = (format!("fdt-srv-{pid}"), format!("fdtv{}", pid % 100_000));
        let peer = format!("fdtp{}", pid % 100_000);
        let s = Server {
            ns: ns.clone(),
            link: link.clone(),
            seen: Arc::default(),
        };
        for cmd in [
            format!("ip netns add {ns}"),
            format!("ip link add {link} type veth peer name {peer}"),
            format!("ip link set {peer} netns {ns}"),
            format!("ip addr add 10.209.0.1/24 dev {link}"),
            format!("ip link set {link} up"),
            format!("ip -n {ns} link set lo up"),
            format!("ip -n {ns} addr add {SERVER_A}/24 dev {peer}"),
            format!("ip -n {ns} addr add {SERVER_B}/24 dev {peer}"),
            format!("ip -n {ns} link set {peer} up"),
            format!("ip -n {ns} route add default via 10.209.0.1"),
        ] {
            let (ok, out) = sh(&cmd);
            assert!(ok, "{cmd}: {out}");
        }
        let f = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
        let seen = s.seen.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let l = TcpListener::bind(("0.0.0.0", PORT)).unwrap();
            tx.send(()).unwrap();
            for c in l.incoming().flatten() {
                if let Ok(std::net::SocketAddr::V4(peer)) = c.peer_addr() {
                    seen.lock().unwrap().push(*peer.ip());
                }
                let mut r = BufReader::new(&c);
                let mut line = String::new();
                while r.read_line(&mut line).map(|n| n > 2).unwrap_or(false) {
                    line.clear();
                }
                let _ =
                    (&c).write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 13\r\n\r\nhello-from-ns");
            }
        });
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        s
    }

    fn sources(&self) -> BTreeSet<Ipv4Addr> {
        self.seen.lock().unwrap().iter().copied().collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        sh(&format!(
            "ip netns del {}; ip link del {}",
            self.ns, self.link
        ));
    }
}

/// Sends an HTTP request from the sandbox to `addr:port` with busybox `nc`
/// (Debian's static busybox `wget` crashes); returns the exec's answer.
async fn http_from(p: &Poold, id: &str, addr: &str, port: u16) -> serde_json::Value {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": ["sh", "-c",
                format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {addr} {port}")],
                   "timeout_secs": 20}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    v
}

/// Fetches the test server's page from the sandbox: Ok when it came back,
/// else what the exec said.
async fn fetch(p: &Poold, id: &str, addr: &str) -> Result<(), String> {
    let v = http_from(p, id, addr, PORT).await;
    match v["stdout"]
        .as_str()
        .unwrap_or("")
        .ends_with("hello-from-ns")
    {
        true => Ok(()),
        false => Err(v.to_string()),
    }
}

/// Deletes every namespace of a test data dir's scope on drop, so a failed
/// run leaves no child network for the next one to trip on.
struct Scope(String);

impl Scope {
    fn of(home: &std::path::Path) -> Scope {
        Scope(forkd_net::netns_name(&forkd_net::scope_of(home), ""))
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        sh(&format!(
            "for n in $(ls /run/netns 2>/dev/null | grep '^{}'); do ip netns del $n; done",
            self.0
        ));
    }
}

/// The two tests here count the host's child networks: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The test's turn (see [`SERIAL`]), or None with a note when not root.
fn serial_as_root() -> Option<std::sync::MutexGuard<'static, ()>> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return None;
    }
    Some(SERIAL.lock().unwrap_or_else(|e| e.into_inner()))
}

/// What of the children's networks is left on the host.
fn leftovers() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
    {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with("forkd-") {
            out.push(format!("netns {n}"));
        }
    }
    for e in std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
    {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with("fkh") || n.starts_with("fkp") {
            out.push(format!("link {n}"));
        }
    }
    let (_, set) = sh("nft list set inet forkd host_allow");
    if set.contains("fkh") {
        out.push(format!("host_allow elements: {set}"));
    }
    out
}

#[test]
fn children_fetch_from_a_local_server_with_policies_and_survive_a_poold_kill() {
    let Some(_serial) = serial_as_root() else {
        return;
    };
    assert!(
        leftovers().is_empty(),
        "child networks left before the test: {:?}",
        leftovers()
    );
    let server = Server::start();
    let home = Home::new();
    let _scope = Scope::of(&home.dir);
    let p = Poold::start(&home.dir, &[], None);
    let sandboxes = block_on(async {
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "net", "image": "minimal", "mem_mib": MINIMAL_MIB, "net": true}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        // A snapshot without a NIC refuses network requests.
        let (st, _) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "nonet", "image": "minimal", "mem_mib": MINIMAL_MIB}),
            )
            .await;
        assert_eq!(st, 201);
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "nonet", "per_child_netns": true}),
            )
            .await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"].as_str().unwrap().contains("--net"), "{v}");
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "net", "network": {"allow_out": ["not a host!"]}}),
            )
            .await;
        assert_eq!(st, 400, "{v}");

        // Ten children, each fetching from the server: ten sources.
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "net", "n": 10, "per_child_netns": true,
                       "network": {"allow_out": [SERVER_A, SERVER_B]}}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let ten = ids(&v);
        let mut addrs = BTreeSet::new();
        for s in v.as_array().unwrap() {
            assert!(s["netns"].as_str().unwrap().starts_with("forkd-"), "{s}");
            addrs.insert(
                s["guest_addr"]
                    .as_str()
                    .unwrap()
                    .parse::<Ipv4Addr>()
                    .unwrap(),
            );
        }
        assert_eq!(addrs.len(), 10, "{v}");
        for id in &ten {
            if let Err(e) = fetch(&p, id, SERVER_A).await {
                panic!("child {id} could not fetch: {e}");
            }
        }
        assert_eq!(
            server.sources(),
            addrs,
            "the server saw each child's own address"
        );

        // The forkd-compatible agent answers at guest_addr:8888 from the host.
        let a = v[0]["guest_addr"].as_str().unwrap().to_string();
        let mut c = std::net::TcpStream::connect((a.as_str(), 8888)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        c.write_all(b"{\"action\":\"ping\"}\n").unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut reply = String::new();
        BufReader::new(&c).read_line(&mut reply).unwrap();
        assert!(reply.contains("\"pong\":true"), "{reply}");

        // Deny all: nothing; an allow list: only what it lists.
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "net", "network": {"deny_out": ["0.0.0.0/0"]}}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let denied = ids(&v)[0].clone();
        assert!(fetch(&p, &denied, SERVER_A).await.is_err());
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "net",
                       "network": {"deny_out": ["0.0.0.0/0"], "allow_out": [SERVER_A]}}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let listed = ids(&v)[0].clone();
        fetch(&p, &listed, SERVER_A).await.unwrap();
        assert!(fetch(&p, &listed, SERVER_B).await.is_err());
        // The host itself is denied by default.
        // Port 1 has no listener: a refusal would mean the packet got in.
        let v = http_from(&p, &ten[0], "10.209.0.1", 1).await;
        assert_ne!(v["exit_code"], 0, "{v}");
        assert!(
            !v["stderr"].as_str().unwrap_or("").contains("refused"),
            "the host must drop, not refuse: {v}"
        );
        // Pool children wait (paused) with their pool's policy written; a
        // hand-out asking for another one gets it instead.
        let (st, v) = p
            .put(
                "/v1/pools/net",
                json!({"min_ready": 3, "network": {"allow_out": [SERVER_A]}}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        p.wait_pool("net", 3).await;
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "net", "n": 2}))
            .await;
        assert_eq!(st, 201, "{v}");
        let pooled = ids(&v);
        for (s, id) in v.as_array().unwrap().iter().zip(&pooled) {
            assert_eq!(s["pool_hit"], true, "{s}");
            if let Err(e) = fetch(&p, id, SERVER_A).await {
                panic!("pooled child {id} could not fetch: {e}");
            }
        }
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "net", "network": {"deny_out": ["0.0.0.0/0"]}}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(v[0]["pool_hit"], true, "{v}");
        let pooled_denied = ids(&v)[0].clone();
        assert!(fetch(&p, &pooled_denied, SERVER_A).await.is_err());
        let (st, v) = p.delete("/v1/pools/net").await;
        assert_eq!(st, 204, "{v}");
        let mut all = ten.clone();
        all.extend([denied, listed]);
        all.extend(pooled);
        all.push(pooled_denied);
        all
    });

    // kill -9 poold; a new one re-adopts every child with its network.
    p.kill9();
    let mut p = Poold::start(&home.dir, &[], None);
    block_on(async {
        for id in &sandboxes[..10] {
            if let Err(e) = fetch(&p, id, SERVER_A).await {
                panic!("child {id} after the restart: {e}");
            }
        }
        for id in &sandboxes {
            let (st, v) = p.delete(&format!("/v1/sandboxes/{id}")).await;
            assert_eq!(st, 204, "{v}");
        }
    });
    let left = leftovers();
    assert!(
        left.is_empty(),
        "left after delete: {left:?}; poold's log:\n{}",
        p.stderr_now()
    );
    drop(p);
    drop(server);
}

#[test]
fn a_published_port_serves_a_server_started_in_a_child() {
    let Some(_serial) = serial_as_root() else {
        return;
    };
    let home = Home::new();
    let _scope = Scope::of(&home.dir);
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "py", "image": "python-numpy", "mem_mib": 512, "net": true}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "py", "ports": [{"guest_port": 8000}]}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let id = v[0]["id"].as_str().unwrap().to_string();
        let port = v[0]["ports"][0]["host_port"].as_u64().unwrap();
        assert_eq!(v[0]["ports"][0]["host_addr"], "127.0.0.1");
        let (st, v) = p
            .post(
                &format!("/v1/sandboxes/{id}/exec"),
                json!({"args": ["sh", "-c",
                    "mkdir -p /srv && echo served-by-child > /srv/index.html && cd /srv && (nohup python3 -m http.server 8000 >/dev/null 2>&1 &)"]}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let mut body = String::new();
        for _ in 0..120 {
            if let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", port as u16)) {
                c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let _ = c.write_all(b"GET / HTTP/1.0\r\n\r\n");
                body.clear();
                let _ = std::io::Read::read_to_string(&mut c, &mut body);
                if body.contains("served-by-child") {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(body.contains("served-by-child"), "{body}");
        let (st, _) = p.delete(&format!("/v1/sandboxes/{id}")).await;
        assert_eq!(st, 204);
        assert!(std::net::TcpStream::connect(("127.0.0.1", port as u16)).is_err());
    });
}
