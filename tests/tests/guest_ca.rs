//! Issue #35, "Guest trust of host CAs" (docs/network.md, "Trusting a
//! host's CA"): a sandbox behind a TLS-inspecting proxy verifies HTTPS once
//! it is given the proxy's CA, and fails verification without it.
//!
//! This test runs, in namespaces of its own (only addresses on this
//! machine): an "upstream" HTTPS server whose certificate an upstream test
//! CA signed, and a TLS-inspecting proxy (HTTP CONNECT, then TLS with a
//! certificate for the requested name that its own test CA signs, then TLS
//! to the upstream, verified). Sandboxes of a networked python-numpy
//! snapshot fetch `https://upstream.forkd.test/` through the proxy with
//! Python's `urllib`, verification on, given this host's CA bundle plus
//! the proxy's CA (as on a company host that trusts its proxy), through a
//! restore and through a pool hit; a sandbox without it fails verification.
//! Garbage is refused at the API, and a snapshot created with a CA hands
//! it to its children.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use forkd_e2e::netns::{free_lan, sh, suffix, TestNs};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

const UPSTREAM_NAME: &str = "upstream.forkd.test";
const PROXY_PORT: u16 = 3128;
const BODY: &str = "hello-through-the-inspecting-proxy";

/// A test CA and what it signs.
struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
    der: CertificateDer<'static>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = p.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: rcgen::Issuer::new(p, key),
        }
    }

    /// A server certificate for `name`, with its key.
    fn leaf(&self, name: &str) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = rcgen::KeyPair::generate().unwrap();
        let p = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (
            vec![cert.der().clone()],
            PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
        )
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config(ca: &Ca, name: &str) -> Arc<rustls::ServerConfig> {
    let (chain, key) = ca.leaf(name);
    Arc::new(
        rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap(),
    )
}

/// Reads an HTTP head (up to the blank line).
fn read_head(r: &mut impl BufRead) -> String {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" || line == "\n" {
            return head;
        }
        head.push_str(&line);
    }
}

/// The proxy's work for one client: CONNECT, TLS as the upstream (its own
/// CA), one request relayed over verified TLS to the real upstream.
fn inspect(
    client: TcpStream,
    mitm: Arc<rustls::ServerConfig>,
    upstream: Ipv4Addr,
    upstream_ca: CertificateDer<'static>,
) {
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut r = BufReader::new(client.try_clone().unwrap());
    let head = read_head(&mut r);
    if !head.starts_with(&format!("CONNECT {UPSTREAM_NAME}:443 ")) {
        let _ = (&client).write_all(b"HTTP/1.1 403 Forbidden\r\n\r\n");
        return;
    }
    (&client)
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .unwrap();
    let conn = rustls::ServerConnection::new(mitm).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, client);
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        match tls.read(&mut buf) {
            Ok(0) | Err(_) => return, // the client refused our certificate
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
    }
    let mut roots = rustls::RootCertStore::empty();
    roots.add(upstream_ca).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from(UPSTREAM_NAME).unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(cfg), name).unwrap();
    let sock = TcpStream::connect((upstream, 443)).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut up = rustls::StreamOwned::new(conn, sock);
    up.write_all(&request).unwrap();
    let mut response = Vec::new();
    let _ = up.read_to_end(&mut response);
    let _ = tls.write_all(&response);
    tls.conn.send_close_notify();
    let _ = tls.flush();
}

/// The upstream's work for one client: one HTTPS answer.
fn serve_upstream(c: TcpStream, cfg: Arc<rustls::ServerConfig>) {
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let conn = rustls::ServerConnection::new(cfg).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, c);
    let mut req = Vec::new();
    let mut buf = [0u8; 4096];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        match tls.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let _ = write!(
        tls,
        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    tls.conn.send_close_notify();
    let _ = tls.flush();
}

/// Fetches the upstream page through the proxy from sandbox `id` with
/// Python's urllib (default context: verification on); the exec's answer.
async fn fetch(p: &Poold, id: &str, proxy: Ipv4Addr) -> serde_json::Value {
    let code = format!(
        "import urllib.request\nprint(urllib.request.urlopen('https://{UPSTREAM_NAME}/', timeout=60).read().decode())"
    );
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": ["python3", "-c", code],
                   "env": {"https_proxy": format!("http://{proxy}:{PROXY_PORT}")},
                   "timeout_secs": 120}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    v
}

#[test]
fn a_sandbox_given_the_proxy_ca_verifies_https_through_it() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let sfx = suffix();
    let (upstream_ca, mitm_ca) = (
        Ca::new("forkd test upstream CA"),
        Ca::new("forkd test inspecting proxy CA"),
    );
    let [a, b, c] = free_lan(215);
    let up_addr = Ipv4Addr::new(a, b, c, 2);
    let up = TestNs::new(
        "up",
        &format!("fdw{sfx}"),
        Ipv4Addr::new(a, b, c, 1),
        up_addr,
        24,
    );
    let up_cfg = server_config(&upstream_ca, UPSTREAM_NAME);
    let (tx, rx) = std::sync::mpsc::channel();
    up.spawn(move || {
        let l = std::net::TcpListener::bind((up_addr, 443)).unwrap();
        tx.send(()).unwrap();
        for s in l.incoming().flatten() {
            let cfg = up_cfg.clone();
            std::thread::spawn(move || serve_upstream(s, cfg));
        }
    });
    rx.recv_timeout(Duration::from_secs(5)).unwrap();

    let [a, b, c] = free_lan(216);
    let proxy = Ipv4Addr::new(a, b, c, 2);
    let px = TestNs::new(
        "px",
        &format!("fdx{sfx}"),
        Ipv4Addr::new(a, b, c, 1),
        proxy,
        24,
    );
    let mitm_cfg = server_config(&mitm_ca, UPSTREAM_NAME);
    let up_root = upstream_ca.der.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    px.spawn(move || {
        let l = std::net::TcpListener::bind((proxy, PROXY_PORT)).unwrap();
        tx.send(()).unwrap();
        for s in l.incoming().flatten() {
            let (cfg, root) = (mitm_cfg.clone(), up_root.clone());
            std::thread::spawn(move || inspect(s, cfg, up_addr, root));
        }
    });
    rx.recv_timeout(Duration::from_secs(5)).unwrap();

    // The host's bundle, as if it trusted its proxy: the proxy's CA added.
    let host_bundle =
        std::fs::read_to_string("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
    let bundle = format!("{host_bundle}\n{}", mitm_ca.pem);
    let ca_body_line = mitm_ca.pem.lines().nth(1).unwrap().to_string();

    let home = Home::new();
    let scope = forkd_net::netns_name(&forkd_net::scope_of(&home.dir), "");
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        // Refused at the boundary, saying why.
        let key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        for (bad, why) in [
            ("not a certificate".to_string(), "no PEM certificate"),
            (format!("{}{key}", mitm_ca.pem), "PRIVATE KEY"),
        ] {
            let (st, v) = p
                .post(
                    "/v1/sandboxes",
                    json!({"snapshot_tag": "any", "ca_certs": bad}),
                )
                .await;
            assert_eq!(st, 400, "{v}");
            assert!(v["error"].as_str().unwrap().contains(why), "{v}");
        }

        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "py", "image": "python-numpy", "mem_mib": 512, "net": true}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let network = json!({"allow_out": [proxy.to_string()]});

        // Given the bundle: verified HTTPS through the proxy, and the
        // variables Python, requests, pip and Node read.
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "py", "network": network, "ca_certs": bundle}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let trusted = ids(&v)[0].clone();
        let v = fetch(&p, &trusted, proxy).await;
        assert_eq!(v["stdout"].as_str().unwrap().trim(), BODY, "{v}");
        let (_, v) = p
            .post(
                &format!("/v1/sandboxes/{trusted}/exec"),
                json!({"args": ["sh", "-c", "echo $SSL_CERT_FILE $REQUESTS_CA_BUNDLE $PIP_CERT $NODE_EXTRA_CA_CERTS; grep -c BEGIN /etc/forkd/extra-ca.pem"]}),
            )
            .await;
        let out = v["stdout"].as_str().unwrap();
        assert!(
            out.starts_with("/etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt /etc/forkd/extra-ca.pem"),
            "{v}"
        );
        // The warm interpreter sees them too (requests reads them per call).
        let (_, v) = p
            .post(
                &format!("/v1/sandboxes/{trusted}/eval"),
                json!({"code": "import os\nos.environ.get('REQUESTS_CA_BUNDLE')"}),
            )
            .await;
        assert!(v.to_string().contains("ca-certificates.crt"), "{v}");

        // Without it: the proxy's certificate fails verification.
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "py", "network": network}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let untrusted = ids(&v)[0].clone();
        let v = fetch(&p, &untrusted, proxy).await;
        assert_ne!(v["exit_code"], 0, "{v}");
        assert!(
            v["stderr"]
                .as_str()
                .unwrap()
                .contains("CERTIFICATE_VERIFY_FAILED"),
            "{v}"
        );

        // A pooled child gets the CA at hand-out (the pool never saw it).
        let (st, v) = p
            .put("/v1/pools/py", json!({"min_ready": 1, "network": network}))
            .await;
        assert_eq!(st, 200, "{v}");
        p.wait_pool("py", 1).await;
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "py", "ca_certs": mitm_ca.pem}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(v[0]["pool_hit"], true, "{v}");
        let pooled = ids(&v)[0].clone();
        let v = fetch(&p, &pooled, proxy).await;
        assert_eq!(v["stdout"].as_str().unwrap().trim(), BODY, "{v}");
        let (st, _) = p.delete("/v1/pools/py").await;
        assert_eq!(st, 204);

        // A snapshot created with a CA: its children have it.
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "min-ca", "image": "minimal", "mem_mib": 128, "ca_certs": mitm_ca.pem}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "min-ca"}))
            .await;
        assert_eq!(st, 201, "{v}");
        let child = ids(&v)[0].clone();
        let (_, v) = p
            .post(
                &format!("/v1/sandboxes/{child}/exec"),
                json!({"args": ["sh", "-c", format!("grep -c '{ca_body_line}' /etc/ssl/certs/ca-certificates.crt; echo $REQUESTS_CA_BUNDLE")]}),
            )
            .await;
        assert_eq!(
            v["stdout"].as_str().unwrap(),
            "1\n/etc/ssl/certs/ca-certificates.crt\n",
            "{v}"
        );
        for id in [trusted, untrusted, pooled, child] {
            let (st, v) = p.delete(&format!("/v1/sandboxes/{id}")).await;
            assert_eq!(st, 204, "{v}");
        }
    });
    drop(p);
    sh(&format!(
        "for n in $(ls /run/netns 2>/dev/null | grep '^{scope}'); do ip netns del $n; done"
    ));
    drop(px);
    drop(up);
}
