//! Browser sandboxes (docs/browser.md) with real guests. A snapshot of the
//! `browser` image holds a warm headless Chromium; six children fork from
//! it, each publishing its DevTools port. Through Playwright's
//! connect_over_cdp (tests/python/browser_cdp.py, the pinned PyPI package;
//! no browser is downloaded), five of them navigate to a page served from a
//! network namespace this test creates, each with its own id in the URL,
//! which the page's script writes into the page, and take a screenshot: the
//! pages and screenshots differ per child. What a cloned browser would
//! share with its siblings is drawn in each and must differ: V8's
//! Math.random (in the warm page and after the navigation),
//! getRandomValues, and BoringSSL in the network service (the TLS client
//! randoms the test's server sees); the parent drew from V8 and BoringSSL
//! before the snapshot, so without the reseed at hand-out both would repeat
//! (they did, before forkd_browser.forkd_reseed). Each child's clock is
//! the host's and its timers fire. The sixth child's browser, never driven,
//! still lists only its warm blank page.
//!
//! Needs root (namespaces). The test's namespace is `fdt-brw-<hex>`, linked
//! by the veth `fdbv<hex>` to the root namespace, 10.212.R.1/24 there and
//! the server at 10.212.R.2 (R random, so concurrent runs keep apart).

use forkd_e2e::daemon::{ids, Home, Poold};
use forkd_e2e::{bin, block_on, paths};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Guest RAM of the warm browser parent and its children (docs/browser.md,
/// "Sizes and limits": what a child costs the host).
const BROWSER_MIB: u64 = 1024;
const HTTP_PORT: u16 = 8080;
const TLS_PORT: u16 = 8443;
/// The DevTools port the image's forwarder serves.
const DEVTOOLS_PORT: u16 = 9222;
/// The desktop image's noVNC (websockify).
const NOVNC_PORT: u16 = 6080;

fn sh(cmd: &str) -> (bool, String) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// What the test's server saw: each page request (client, path) and each
/// TLS ClientHello's random (client, hex).
#[derive(Default)]
struct Seen {
    pages: Vec<(Ipv4Addr, String)>,
    hellos: Vec<(Ipv4Addr, String)>,
}

/// The test's web server in a namespace of its own: a page that writes the
/// `id` of its URL into itself, and a TLS port that keeps each ClientHello's
/// random and closes. Removed (namespace and veth) on drop.
struct Server {
    ns: String,
    link: String,
    addr: Ipv4Addr,
    seen: Arc<Mutex<Seen>>,
}

const PAGE: &str = r#"<!doctype html>
<html><head><title>?</title></head>
<body style="margin:0;font:64px sans-serif">
<h1 id="child">?</h1>
<script>
  const id = new URLSearchParams(location.search).get('id');
  document.getElementById('child').textContent = id;
  document.title = id;
  const n = Number(id.replace(/\D/g, ''));
  document.body.style.background = 'hsl(' + (n * 67 % 360) + ', 70%, 80%)';
</script>
</body></html>"#;

impl Server {
    fn start() -> Server {
        let tag = forkd_snapshot::random_hex(3);
        let subnet = u8::from_str_radix(&tag[..2], 16).unwrap();
        let (ns, link, peer) = (
            format!("fdt-brw-{tag}"),
            format!("fdbv{tag}"),
            format!("fdbp{tag}"),
        );
        let addr = Ipv4Addr::new(10, 212, subnet, 2);
        let s = Server {
            ns: ns.clone(),
            link: link.clone(),
            addr,
            seen: Arc::default(),
        };
        for cmd in [
            format!("ip netns add {ns}"),
            format!("ip link add {link} type veth peer name {peer}"),
            format!("ip link set {peer} netns {ns}"),
            format!("ip addr add 10.212.{subnet}.1/24 dev {link}"),
            format!("ip link set {link} up"),
            format!("ip -n {ns} link set lo up"),
            format!("ip -n {ns} addr add {addr}/24 dev {peer}"),
            format!("ip -n {ns} link set {peer} up"),
            format!("ip -n {ns} route add default via 10.212.{subnet}.1"),
        ] {
            let (ok, out) = sh(&cmd);
            assert!(ok, "{cmd}: {out}");
        }
        let f = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
        let seen = s.seen.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let http = TcpListener::bind(("0.0.0.0", HTTP_PORT)).unwrap();
            let tls = TcpListener::bind(("0.0.0.0", TLS_PORT)).unwrap();
            tx.send(()).unwrap();
            let hello_seen = seen.clone();
            std::thread::spawn(move || {
                for c in tls.incoming().flatten() {
                    if let (Ok(std::net::SocketAddr::V4(peer)), Some(random)) =
                        (c.peer_addr(), client_random(&c))
                    {
                        hello_seen.lock().unwrap().hellos.push((*peer.ip(), random));
                    }
                }
            });
            for c in http.incoming().flatten() {
                let seen = seen.clone();
                std::thread::spawn(move || serve_page(c, &seen));
            }
        });
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        s
    }

    fn url(&self, id: &str) -> String {
        format!("http://{}:{HTTP_PORT}/page?id={id}", self.addr)
    }

    fn tls_url(&self) -> String {
        format!("https://{}:{TLS_PORT}/", self.addr)
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

/// Answers one HTTP/1.x request with [`PAGE`] (404 for anything but
/// `/page`), recording who asked for what.
fn serve_page(c: TcpStream, seen: &Mutex<Seen>) {
    let _ = c.set_read_timeout(Some(Duration::from_secs(30)));
    let mut r = BufReader::new(&c);
    let mut first = String::new();
    if r.read_line(&mut first).is_err() {
        return;
    }
    let mut line = String::new();
    while r.read_line(&mut line).map(|n| n > 2).unwrap_or(false) {
        line.clear();
    }
    let path = first.split_whitespace().nth(1).unwrap_or("").to_string();
    if let Ok(std::net::SocketAddr::V4(peer)) = c.peer_addr() {
        seen.lock().unwrap().pages.push((*peer.ip(), path.clone()));
    }
    let (status, body) = if path.starts_with("/page?") {
        ("200 OK", PAGE)
    } else {
        ("404 Not Found", "")
    };
    let _ = write!(
        &c,
        "HTTP/1.1 {status}\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// The 32-byte random of the TLS ClientHello that opens `c`, in hex: after
/// the record header (5 bytes), the handshake header (4) and the client
/// version (2).
fn client_random(mut c: &TcpStream) -> Option<String> {
    c.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut head = [0u8; 43];
    c.read_exact(&mut head).ok()?;
    (head[0] == 0x16 && head[5] == 0x01).then(|| hex(&head[11..43]))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The Python with Playwright (tests/python/requirements.txt).
fn python() -> PathBuf {
    let p = std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| {
        panic!("FORKD_TEST_PYTHON is not set: scripts/test.sh builds the Python venv of tests/python and sets it")
    });
    let p = PathBuf::from(p);
    assert!(
        p.exists(),
        "FORKD_TEST_PYTHON={} does not exist",
        p.display()
    );
    p
}

/// Builds recipe `name` into the test data dir unless it is built already.
fn build_image(name: &str) {
    let t = Instant::now();
    let st = Command::new(bin("forkd"))
        .args(["image", "build", "--recipe", name, "--if-changed"])
        .env("FORKD_HOME", &paths().home)
        .status()
        .unwrap();
    assert!(st.success(), "forkd image build --recipe {name} failed");
    eprintln!("image {name}: ready in {:.1} s", t.elapsed().as_secs_f64());
}

/// The parent's warm-up, in its warm interpreter, after Chromium started:
/// it makes the browser draw from BoringSSL in the network service (a TLS
/// ClientHello to a listener in the guest, which reads it and hangs up)
/// and calls Math.random in the blank page, so every child resumes
/// generators that have run.
const WARMUP: &str = r#"
import socket, threading
srv = socket.create_server(('127.0.0.1', 8443))
hello = threading.Event()
def take_hello():
    conn, _ = srv.accept()
    conn.recv(4096)
    conn.close()
    srv.close()  # a retry is refused at once, not left in the backlog
    hello.set()
threading.Thread(target=take_hello, daemon=True).start()
page = forkd_browser.pages()[0]['id']
forkd_browser.cdp('Page.navigate', {'url': 'https://127.0.0.1:8443/'}, target=page)
assert hello.wait(300), 'no TLS ClientHello from the browser'
forkd_browser.cdp('Page.navigate', {'url': 'about:blank'}, target=page)
drawn = forkd_browser.cdp('Runtime.evaluate', {'expression': 'Math.random()'}, target=page)
assert drawn['result']['type'] == 'number', drawn
'warm'
"#;

/// Values of `key` in every child's `section`, which must all differ.
fn assert_all_differ(children: &[Value], section: &str, key: &str) {
    let vals: Vec<String> = children
        .iter()
        .map(|c| c[section][key].to_string())
        .collect();
    let distinct: BTreeSet<&String> = vals.iter().collect();
    assert_eq!(
        distinct.len(),
        vals.len(),
        "{section}.{key} repeats across sibling browsers: {vals:?}"
    );
}

#[test]
fn five_children_drive_their_own_warm_browser_and_a_sixth_stays_untouched() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let py = python();
    build_image("browser");
    let server = Server::start();
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let shots = home.dir.join("shots");
    std::fs::create_dir_all(&shots).unwrap();
    block_on(async {
        let t = Instant::now();
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "br", "image": "browser", "mem_mib": BROWSER_MIB, "net": true,
                       "eval_warmup": WARMUP}),
            )
            .await;
        assert_eq!(st, 201, "snapshot of the browser image: {v}");
        eprintln!("warm browser snapshot: {:.1} s", t.elapsed().as_secs_f64());
        // One spawn at a time: each child's hand-out reseeds its browser
        // (seconds under TCG), and six at once on a loaded host could pass
        // the identity request's deadline.
        let mut kids = Vec::new();
        let mut endpoints = Vec::new();
        for _ in 0..6 {
            let t = Instant::now();
            let (st, v) = p
                .post(
                    "/v1/sandboxes",
                    // The page server sits on a private address, which
                    // the default egress policy denies (docs/network.md):
                    // open it, as a user opens an internal service.
                    json!({"snapshot_tag": "br", "ports": [{"guest_port": DEVTOOLS_PORT}],
                           "network": {"allow_out": [server.addr.to_string()]}}),
                )
                .await;
            assert_eq!(st, 201, "spawn: {v}");
            let s = &v[0];
            eprintln!("child {}: {:.1} s", s["id"], t.elapsed().as_secs_f64());
            assert_eq!(s["ports"][0]["guest_port"], DEVTOOLS_PORT, "{s}");
            assert_eq!(s["ports"][0]["host_addr"], "127.0.0.1", "{s}");
            kids.extend(ids(&v));
            endpoints.push(format!(
                "http://127.0.0.1:{}",
                s["ports"][0]["host_port"].as_u64().unwrap()
            ));
        }
        // What each hand-out's reseed did: BoringSSL's pages wiped in the
        // browser's processes (the network service's among them, since the
        // parent made a TLS handshake), the blank page renewed.
        for k in &kids {
            let (st, v) = p
                .post(
                    &format!("/v1/sandboxes/{k}/eval"),
                    json!({"code": "import json; print(json.dumps(forkd_browser.last_reseed))"}),
                )
                .await;
            assert_eq!(st, 200, "{v}");
            let r: Value = serde_json::from_str(v["stdout"].as_str().unwrap_or(""))
                .unwrap_or_else(|e| panic!("{e}: {v}"));
            eprintln!("{k} reseed: {r}");
            assert!(r["mappings"].as_u64().unwrap() >= 3, "{r}");
            assert_eq!(r["fresh_pages"], 1, "{r}");
        }
        let children: Vec<Value> = (0..5)
            .map(|i| {
                let id = format!("child-{i}");
                json!({"endpoint": endpoints[i], "id": id, "url": server.url(&id),
                       "tls_url": server.tls_url(),
                       "shot": shots.join(format!("{id}.png"))})
            })
            .collect();
        let spec = json!({"children": children, "untouched": endpoints[5]});
        let t = Instant::now();
        let out = tokio::task::spawn_blocking(move || {
            Command::new(py)
                .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/browser_cdp.py"))
                .arg(spec.to_string())
                .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("Playwright: {:.1} s", t.elapsed().as_secs_f64());
        assert!(
            out.status.success(),
            "browser_cdp.py failed:\n{stdout}\n{stderr}"
        );
        let report: Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
            .unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
        let children = report["children"].as_array().unwrap();
        assert_eq!(children.len(), 5);
        for c in children {
            eprintln!(
                "{}: connect {:.2} s, navigate {:.2} s, screenshot {:.2} s",
                c["id"], c["connect_s"], c["navigate_s"], c["screenshot_s"]
            );
            // The warm blank page was there, alone, and is what navigated.
            assert_eq!(c["pages_before"], json!(["about:blank"]), "{c}");
            assert_eq!(c["text"], c["id"], "{c}");
            assert_eq!(c["title"], c["id"], "{c}");
            assert_eq!(c["pages_after"].as_array().unwrap().len(), 1, "{c}");
            // The clock is the host's, and a timer armed now fires.
            let skew =
                c["clock"]["date_now"].as_f64().unwrap() - c["host_now_ms"].as_f64().unwrap();
            assert!(
                skew.abs() < 30_000.0,
                "Date.now() is {skew} ms off the host's: {c}"
            );
            assert!(c["clock"]["timer_ms"].as_f64().unwrap() >= 99.0, "{c}");
        }
        // Each page shows its own child's id; the screenshots are PNGs and
        // all differ.
        let mut pngs = BTreeSet::new();
        for i in 0..5 {
            let png = std::fs::read(shots.join(format!("child-{i}.png"))).unwrap();
            assert!(
                png.starts_with(b"\x89PNG\r\n\x1a\n"),
                "child-{i}.png is no PNG"
            );
            pngs.insert(png);
        }
        assert_eq!(pngs.len(), 5, "two children's screenshots are identical");
        for section in ["warm_page_draws", "draws"] {
            for key in ["math_random", "get_random_values"] {
                assert_all_differ(children, section, key);
            }
        }
        // The server saw each page fetched from a child of its own, and a
        // TLS ClientHello from each child, no random twice.
        {
            let seen = server.seen.lock().unwrap();
            let mut by_child: BTreeMap<String, BTreeSet<Ipv4Addr>> = BTreeMap::new();
            for (src, path) in &seen.pages {
                if let Some(id) = path.strip_prefix("/page?id=") {
                    by_child.entry(id.to_string()).or_default().insert(*src);
                }
            }
            assert_eq!(by_child.len(), 5, "{:?}", seen.pages);
            let sources: BTreeSet<Ipv4Addr> = by_child.values().flatten().copied().collect();
            assert_eq!(sources.len(), 5, "{:?}", seen.pages);
            let hello_sources: BTreeSet<Ipv4Addr> = seen.hellos.iter().map(|h| h.0).collect();
            assert_eq!(hello_sources, sources, "{:?}", seen.hellos);
            let randoms: BTreeSet<&String> = seen.hellos.iter().map(|h| &h.1).collect();
            assert_eq!(
                randoms.len(),
                seen.hellos.len(),
                "TLS client randoms repeat across sibling browsers: {:?}",
                seen.hellos
            );
        }
        // The sixth child's browser never saw its siblings' navigation.
        assert_eq!(
            report["untouched_pages"],
            json!(["about:blank"]),
            "{report}"
        );
        let (st, v) = p.get(&format!("/v1/sandboxes/{}", kids[5])).await;
        assert_eq!(st, 200, "{v}");
        for k in &kids {
            let (st, _) = p.delete(&format!("/v1/sandboxes/{k}")).await;
            assert_eq!(st, 204);
        }
    });
    drop(p);
    drop(server);
}

/// Runs `cmd` in sandbox `id` the way E2B's envd does (`bash -l -c`);
/// returns (exit code, stdout).
async fn bash(p: &Poold, id: &str, cmd: &str) -> (i64, String) {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": ["bash", "-l", "-c", cmd], "timeout_secs": 300}),
        )
        .await;
    assert_eq!(st, 200, "exec {cmd}: {v}");
    (
        v["exit_code"].as_i64().unwrap(),
        v["stdout"].as_str().unwrap_or("").to_string() + v["stderr"].as_str().unwrap_or(""),
    )
}

/// Evaluates Python in sandbox `id`'s warm interpreter; returns its stdout.
async fn py(p: &Poold, id: &str, code: &str) -> String {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/eval"),
            json!({"code": code, "timeout_secs": 300}),
        )
        .await;
    assert_eq!(st, 200, "eval {code}: {v}");
    assert!(v["error"].is_null(), "eval {code}: {v}");
    v["stdout"].as_str().unwrap_or("").trim().to_string()
}

/// The desktop image, forked: the commands E2B's Desktop SDK runs for its
/// calls (e2b_desktop 2.x: xdpyinfo, xrandr, xdotool, scrot, pgrep,
/// xdg-open), run unchanged as envd runs them, work in the child: the
/// pointer moves, typed text reaches the warm browser's page, the screen
/// comes back as a 1024x768 PNG, xdg-open opens a tab in the warm browser.
/// noVNC's page and its WebSocket, proxied by websockify to x11vnc, answer
/// through the published port 6080 with the VNC banner.
#[test]
fn a_forked_desktop_takes_input_shows_its_screen_and_streams() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    build_image("desktop");
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let t = Instant::now();
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "desk", "image": "desktop", "mem_mib": BROWSER_MIB, "net": true}),
            )
            .await;
        assert_eq!(st, 201, "snapshot of the desktop image: {v}");
        eprintln!("warm desktop snapshot: {:.1} s", t.elapsed().as_secs_f64());
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "desk",
                       "ports": [{"guest_port": DEVTOOLS_PORT}, {"guest_port": NOVNC_PORT}]}),
            )
            .await;
        assert_eq!(st, 201, "spawn: {v}");
        let id = v[0]["id"].as_str().unwrap().to_string();
        let novnc = v[0]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["guest_port"] == NOVNC_PORT)
            .and_then(|p| p["host_port"].as_u64())
            .unwrap() as u16;

        // Sandbox.create: the SDK waits for the display; the session is up.
        let (code, out) = bash(&p, &id, "xdpyinfo -display :0 | grep dimensions").await;
        assert_eq!(code, 0, "{out}");
        assert!(out.contains("1024x768 pixels"), "{out}");
        // get_screen_size, move_mouse, get_cursor_position.
        let (code, out) = bash(&p, &id, "xrandr").await;
        assert!(code == 0 && out.contains("1024x768"), "{out}");
        let (code, out) = bash(
            &p,
            &id,
            "xdotool mousemove --sync 300 400 && xdotool getmouselocation",
        )
        .await;
        assert!(code == 0 && out.starts_with("x:300 y:400 "), "{out}");
        // write / press: text typed into a page of the warm browser.
        py(
            &p,
            &id,
            "import time\n\
             page = forkd_browser.pages()[0]['id']\n\
             forkd_browser.cdp('Page.navigate', {'url': 'data:text/html,<input id=i autofocus \
             style=\"position:fixed;left:0;top:0;width:100%;height:100%;font:40px sans-serif\">'}, target=page)\n\
             ready = \"document.getElementById('i') !== null && document.readyState\"\n\
             while forkd_browser.cdp('Runtime.evaluate', {'expression': ready}, target=page)['result'].get('value') != 'complete':\n\
             \x20   time.sleep(0.2)",
        )
        .await;
        let typed = "xdotool mousemove --sync 512 500 click 1 && \
                     xdotool type --delay 75 -- 'hello from a fork' && xdotool key Return";
        let (code, out) = bash(&p, &id, typed).await;
        assert_eq!(code, 0, "{out}");
        let value = py(
            &p,
            &id,
            "print(forkd_browser.cdp('Runtime.evaluate', {'expression': \
             \"document.getElementById('i').value\"}, target=page)['result']['value'])",
        )
        .await;
        assert_eq!(value, "hello from a fork");
        // screenshot: scrot, then files.read.
        let (code, out) = bash(&p, &id, "scrot --pointer /tmp/screenshot-test.png").await;
        assert_eq!(code, 0, "{out}");
        let (st, png) = p
            .client
            .send(
                forkd_api::Method::GET,
                &format!("/v1/sandboxes/{id}/files?path=/tmp/screenshot-test.png"),
                None,
            )
            .await
            .unwrap();
        assert_eq!(st.as_u16(), 200);
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "no PNG");
        // IHDR: width and height, big-endian, at bytes 16..24.
        assert_eq!(&png[16..24], &[0, 0, 4, 0, 0, 0, 3, 0], "not 1024x768");
        // open: web pages go to a new tab of the warm browser.
        let (code, out) = bash(&p, &id, "xdg-open http://127.0.0.1:9223/json/version").await;
        assert_eq!(code, 0, "{out}");
        let urls = py(
            &p,
            &id,
            "print(sorted(t['url'] for t in forkd_browser.pages()))",
        )
        .await;
        assert!(
            urls.contains("http://127.0.0.1:9223/json/version"),
            "{urls}"
        );
        // stream.start() checks for x11vnc first: it runs already.
        let (code, out) = bash(&p, &id, "pgrep -x x11vnc").await;
        assert_eq!(code, 0, "{out}");

        // noVNC through the published port: its page, then the WebSocket
        // websockify bridges to x11vnc, which greets with its version.
        let page = tokio::task::spawn_blocking(move || http_get(novnc, "/vnc.html"))
            .await
            .unwrap();
        assert!(
            page.starts_with("HTTP/1.1 200") && page.contains("noVNC"),
            "{page}"
        );
        let banner = tokio::task::spawn_blocking(move || rfb_banner(novnc))
            .await
            .unwrap();
        assert_eq!(banner, b"RFB 003.008\n");
        let (st, _) = p.delete(&format!("/v1/sandboxes/{id}")).await;
        assert_eq!(st, 204);
    });
}

/// A plain HTTP/1.0 GET to 127.0.0.1:`port`; the whole response.
fn http_get(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// Opens websockify's WebSocket on 127.0.0.1:`port` and returns the first
/// binary message: the VNC server's protocol version.
fn rfb_banner(port: u16) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "GET /websockify HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: binary\r\n\r\n"
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 101"), "websockify: {line}");
    while r.read_line(&mut line).map(|n| n > 2).unwrap_or(false) {
        line.clear();
    }
    let mut head = [0u8; 2];
    r.read_exact(&mut head).unwrap();
    assert_eq!(head[0] & 0x0f, 0x2, "not a binary frame");
    let mut msg = vec![0u8; usize::from(head[1] & 0x7f)];
    r.read_exact(&mut msg).unwrap();
    msg
}
