//! HTTPS on poold's TCP listener: a self-signed certificate made here,
//! poold started with `--tls-cert`/`--tls-key`, requests over TLS from the
//! API client (`FORKD_CA_CERT`) and the CLI succeed; a plain-HTTP request to
//! the TLS port and a client that does not trust the certificate fail.
//! Boots no guest.

use forkd_api::{Client, Method};
use forkd_e2e::bin;
use forkd_e2e::daemon::{Home, Poold};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A self-signed certificate for 127.0.0.1 and localhost, and its key.
fn self_signed(dir: &Path) -> (PathBuf, PathBuf) {
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
        .expect("rcgen");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    (cert, key)
}

/// `--tls-cert CERT --tls-key KEY`, for poold and the gateway alike.
fn tls_args<'a>(cert: &'a Path, key: &'a Path) -> [&'a str; 4] {
    [
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]
}

/// A client that does not trust the self-signed certificate gets no
/// answer from `url`, and an error that names the certificate.
async fn untrusting_client_is_refused(url: &str) {
    let untrusting = Client::new(url, None).unwrap();
    let e = untrusting
        .send(Method::GET, "/version", None)
        .await
        .expect_err("an untrusted certificate was accepted");
    assert!(
        format!("{e:#}").to_lowercase().contains("certificate"),
        "{e:#}"
    );
}

fn addr_of(url: &str) -> String {
    url.trim_start_matches("https://").to_string()
}

#[test]
fn poold_serves_https_with_a_self_signed_certificate() {
    let home = Home::new();
    let (cert, key) = self_signed(&home.dir);
    let p = Poold::start(&home.dir, &tls_args(&cert, &key), None);
    assert!(p.url.starts_with("https://127.0.0.1:"), "{}", p.url);
    forkd_e2e::block_on(async {
        // Trusting the certificate: the API answers.
        let c = Client::with_ca(&p.url, None, Some(&cert)).unwrap();
        let (s, body) = c.send(Method::GET, "/version", None).await.unwrap();
        assert_eq!(s.as_u16(), 200, "{}", String::from_utf8_lossy(&body));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["api"], "v1");
        // Not trusting it: the handshake fails, no answer.
        untrusting_client_is_refused(&p.url).await;
        // Plain HTTP to the TLS port gets no HTTP answer.
        let plain = Client::new(&p.url.replacen("https://", "http://", 1), None).unwrap();
        let r = plain.send(Method::GET, "/healthz", None).await;
        assert!(
            r.is_err(),
            "plain HTTP to the TLS port answered: {:?}",
            r.map(|(s, _)| s)
        );
    });
    let mut tcp = std::net::TcpStream::connect(addr_of(&p.url)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let _ = tcp.read_to_end(&mut got);
    assert!(
        !got.starts_with(b"HTTP/"),
        "plain HTTP got an HTTP answer: {}",
        String::from_utf8_lossy(&got)
    );

    // The listener survived the garbage, and the CLI talks TLS too.
    let out = std::process::Command::new(bin("forkd"))
        .args(["ls", "--json"])
        .env("FORKD_URL", &p.url)
        .env("FORKD_CA_CERT", &cert)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "forkd ls over TLS: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");

    // TLS requests are audited with the peer's address.
    let audit = std::fs::read_to_string(home.dir.join("poold/audit.jsonl")).unwrap();
    let line = audit
        .lines()
        .find(|l| l.contains("\"/version\""))
        .expect("GET /version audited");
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert!(
        v["remote"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{line}"
    );
}

#[test]
fn poold_refuses_to_start_with_a_key_that_is_not_the_certificates() {
    let home = Home::new();
    let (cert, _) = self_signed(&home.dir);
    let other = home.dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let (_, wrong_key) = self_signed(&other);
    let e = Poold::try_start(
        &home.dir,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            wrong_key.to_str().unwrap(),
        ],
        None,
    )
    .err()
    .expect("poold started with a mismatched key");
    assert!(e.contains("does the key match"), "{e}");
    let e = Poold::try_start(&home.dir, &["--tls-cert", cert.to_str().unwrap()], None)
        .err()
        .expect("poold started with a certificate and no key");
    assert!(e.contains("go together"), "{e}");
}

/// The gateway on HTTPS (`--tls-cert`/`--tls-key`, poold's listener code)
/// in front of a plain-HTTP poold: a client trusting the certificate gets
/// answers, including the node's merged list; one that does not gets no
/// answer. Boots no guest.
#[test]
fn the_gateway_serves_https_in_front_of_a_node() {
    let home = Home::new();
    let (cert, key) = self_signed(&home.dir);
    let p = Poold::start(&home.dir, &[], None);
    let gw =
        forkd_e2e::gateway::Gateway::start_with(&[("alpha", &p.url)], &tls_args(&cert, &key), None);
    assert!(gw.url.starts_with("https://127.0.0.1:"), "{}", gw.url);
    forkd_e2e::block_on(async {
        let c = Client::with_ca(&gw.url, None, Some(&cert)).unwrap();
        let (s, body) = c.send(Method::GET, "/version", None).await.unwrap();
        assert_eq!(s.as_u16(), 200, "{}", String::from_utf8_lossy(&body));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["role"], "gateway", "{v}");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (s, body) = c.send(Method::GET, "/v1/nodes", None).await.unwrap();
            assert_eq!(s.as_u16(), 200);
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            if v[0]["health"]["state"] == "up" {
                assert_eq!(v[0]["version"]["api"], "v1", "{v}");
                break;
            }
            assert!(std::time::Instant::now() < deadline, "node never up: {v}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (s, body) = c.send(Method::GET, "/v1/sandboxes", None).await.unwrap();
        assert_eq!(s.as_u16(), 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(&body[..], b"[]");
        untrusting_client_is_refused(&gw.url).await;
    });
}
