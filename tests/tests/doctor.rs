//! `forkd doctor` against a real poold (HTTPS with a self-signed certificate
//! and a token): its `poold` check passes with the right token, FAILs with
//! a missing or wrong token or an untrusted certificate (exit status 1), and
//! WARNs when nothing listens.
//! The host checks' verdicts are unit-tested on fake trees
//! (`poold/src/cli/doctor.rs`). Boots no guest.

use forkd_e2e::bin;
use forkd_e2e::daemon::{Home, Poold};
use serde_json::Value;
use std::path::Path;

const TOKEN: &str = "Vb7nQ2xK9mL4pR8sT1wY6zA3cD5fG0hJ";

/// Runs `forkd doctor --json` with `env`; returns the exit status and the
/// `poold` check.
fn doctor(home: &Path, env: &[(&str, &str)]) -> (i32, Value) {
    let mut cmd = std::process::Command::new(bin("forkd"));
    cmd.args(["doctor", "--json"])
        .env("FORKD_HOME", home)
        .env_remove("FORKD_TOKEN")
        .env_remove("FORKD_CA_CERT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "forkd doctor --json printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let checks = doc["checks"].as_array().expect("checks");
    // Every check has a verdict and, unless it passed, a fix.
    for c in checks {
        let v = c["verdict"].as_str().unwrap();
        assert!(["PASS", "WARN", "FAIL"].contains(&v), "{c}");
        assert_eq!(v == "PASS", c["fix"].as_str().unwrap().is_empty(), "{c}");
    }
    let fails = checks.iter().filter(|c| c["verdict"] == "FAIL").count();
    assert_eq!(doc["fail"].as_u64().unwrap() as usize, fails, "{doc}");
    let code = out.status.code().unwrap();
    assert_eq!(code, if fails > 0 { 1 } else { 0 }, "{doc}");
    let poold = checks
        .iter()
        .find(|c| c["name"] == "poold")
        .cloned()
        .unwrap_or_else(|| panic!("no poold check: {doc}"));
    (code, poold)
}

#[test]
fn doctor_checks_that_poold_is_reachable_and_authenticated() {
    let home = Home::new();
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    let (cert, key, tf) = (
        home.dir.join("tls.crt"),
        home.dir.join("tls.key"),
        home.dir.join("token"),
    );
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    std::fs::write(&tf, format!("{TOKEN}\n")).unwrap();
    let p = Poold::start(
        &home.dir,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--token-file",
            tf.to_str().unwrap(),
        ],
        Some(TOKEN),
    );
    let url = p.url.clone();
    let (url, ca) = (url.as_str(), cert.to_str().unwrap());

    let (_, c) = doctor(
        &home.dir,
        &[
            ("FORKD_URL", url),
            ("FORKD_CA_CERT", ca),
            ("FORKD_TOKEN", TOKEN),
        ],
    );
    assert_eq!(c["verdict"], "PASS", "{c}");
    assert!(c["detail"].as_str().unwrap().contains(url), "{c}");

    let (code, c) = doctor(&home.dir, &[("FORKD_URL", url), ("FORKD_CA_CERT", ca)]);
    assert_eq!((code, c["verdict"].as_str()), (1, Some("FAIL")), "{c}");
    assert!(c["fix"].as_str().unwrap().contains("FORKD_TOKEN"), "{c}");

    let wrong = "Vb7nQ2xK9mL4pR8sT1wY6zA3cD5fG0hX";
    let (code, c) = doctor(
        &home.dir,
        &[
            ("FORKD_URL", url),
            ("FORKD_CA_CERT", ca),
            ("FORKD_TOKEN", wrong),
        ],
    );
    assert_eq!((code, c["verdict"].as_str()), (1, Some("FAIL")), "{c}");
    assert!(
        c["detail"].as_str().unwrap().contains("not poold's token"),
        "{c}"
    );

    // Not trusting the certificate: a failure that names FORKD_CA_CERT.
    let (code, c) = doctor(&home.dir, &[("FORKD_URL", url), ("FORKD_TOKEN", TOKEN)]);
    assert_eq!((code, c["verdict"].as_str()), (1, Some("FAIL")), "{c}");
    assert!(c["fix"].as_str().unwrap().contains("FORKD_CA_CERT"), "{c}");

    // Nothing listening.
    p.kill9();
    let (_, c) = doctor(&home.dir, &[("FORKD_URL", url), ("FORKD_CA_CERT", ca)]);
    assert_eq!(c["verdict"], "WARN", "{c}");
    assert!(c["fix"].as_str().unwrap().contains("poold"), "{c}");
}
