//! Extra CA certificates the host asks the guest to trust (the `identity`
//! request's `ca_certs`; docs/network.md, "Trusting a host's CA").
//!
//! Where they go, so that everything a sandbox runs verifies with them:
//! - one file per certificate in [`LOCAL_DIR`] (`update-ca-certificates`,
//!   when a user runs it later, keeps them);
//! - appended to the system bundle [`SYSTEM_BUNDLE`] (created when the image
//!   has none), which OpenSSL (so Python's `ssl`, curl, git, apt, pip's
//!   truststore) reads whenever it builds a default context: no
//!   `update-ca-certificates` needed, which a minimal image does not have;
//!   OpenSSL's own default file links to it where missing;
//! - all of them together in [`EXTRA_BUNDLE`] for Node, which adds
//!   `NODE_EXTRA_CA_CERTS` to its own built-in store;
//! - variables for programs that do not read the system store by default
//!   ([`env`]): `REQUESTS_CA_BUNDLE` (requests uses certifi's bundle),
//!   `PIP_CERT` (pip's vendored requests), `SSL_CERT_FILE` (OpenSSL builds
//!   with another default path: python.org or conda Pythons, uv),
//!   `NODE_EXTRA_CA_CERTS`. A process reads them when it starts, so they
//!   are set in the base environment of every later exec, and in the warm
//!   interpreter's `os.environ`; files are what processes already running
//!   see.
//!
//! Installing is idempotent: a certificate already present is not added
//! twice, so a child of a snapshot whose parent was given a CA can be
//! given it again.

use crate::protocol::{AgentError, ErrorKind};
use std::path::Path;
use std::sync::RwLock;

/// The system bundle OpenSSL reads on Debian and Alpine.
pub const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// Where `update-ca-certificates` looks for local CAs; ours in a subfolder.
pub const LOCAL_DIR: &str = "/usr/local/share/ca-certificates/forkd";
/// Every CA forkd installed, in one file (for `NODE_EXTRA_CA_CERTS`).
pub const EXTRA_BUNDLE: &str = "/etc/forkd/extra-ca.pem";

const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
const END: &str = "-----END CERTIFICATE-----";

/// Variables added to every exec's environment once CAs are installed.
static ENV: RwLock<Vec<(String, String)>> = RwLock::new(Vec::new());

/// The variables naming the bundles, set once CAs were installed (by this
/// agent, or before a snapshot its process was restored from).
pub fn env() -> Vec<(String, String)> {
    ENV.read().map(|e| e.clone()).unwrap_or_default()
}

fn bundle_env() -> Vec<(String, String)> {
    [
        ("SSL_CERT_FILE", SYSTEM_BUNDLE),
        ("REQUESTS_CA_BUNDLE", SYSTEM_BUNDLE),
        ("PIP_CERT", SYSTEM_BUNDLE),
        ("NODE_EXTRA_CA_CERTS", EXTRA_BUNDLE),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// At agent start: an image (or a restarted agent) that has forkd's CAs
/// installed already gets the variables too.
pub fn restore_env() {
    if Path::new(EXTRA_BUNDLE).exists() {
        set_env();
    }
}

fn set_env() {
    if let Ok(mut e) = ENV.write() {
        *e = bundle_env();
    }
}

/// Splits `pem` into its certificate blocks (each normalised to end in a
/// newline); refuses anything else, since the host sends only blocks.
pub fn split(pem: &str) -> Result<Vec<String>, AgentError> {
    let bad = |why: String| {
        Err(AgentError::new(
            ErrorKind::BadRequest,
            format!("ca_certs: {why}"),
        ))
    };
    if pem.len() > crate::protocol::MAX_CA_CERTS_BYTES {
        return bad(format!(
            "{} bytes; at most {}",
            pem.len(),
            crate::protocol::MAX_CA_CERTS_BYTES
        ));
    }
    let mut out = Vec::new();
    let mut cur: Option<Vec<&str>> = None;
    for line in pem.lines().map(str::trim_end) {
        match (&mut cur, line) {
            (None, "") => {}
            (None, BEGIN) => cur = Some(vec![BEGIN]),
            (None, other) => {
                return bad(format!(
                    "unexpected line outside a certificate: {other:.60}"
                ))
            }
            (Some(lines), END) => {
                lines.push(END);
                out.push(lines.join("\n") + "\n");
                cur = None;
            }
            (Some(lines), body) => {
                if !body
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=')
                {
                    return bad(format!("not base64 inside a certificate: {body:.60}"));
                }
                lines.push(body);
            }
        }
    }
    if cur.is_some() {
        return bad("a certificate has no END line".into());
    }
    if out.is_empty() {
        return bad("no certificate".into());
    }
    Ok(out)
}

/// Installs `pem`'s certificates (see the module docs); returns how many
/// the guest now trusts of them.
pub fn install(pem: &str) -> Result<usize, AgentError> {
    let n = install_at(
        Path::new(SYSTEM_BUNDLE),
        Path::new(LOCAL_DIR),
        Path::new(EXTRA_BUNDLE),
        pem,
    )?;
    link_openssl_defaults();
    set_env();
    Ok(n)
}

/// OpenSSL's default CA file (`OPENSSLDIR/cert.pem`: /usr/lib/ssl on
/// Debian, /etc/ssl on Alpine) comes with the `openssl` package, which a
/// minimal image lacks: without it, a program that ignores `SSL_CERT_FILE`
/// (or runs with a cleared environment) finds no CA at all. Where the
/// directory exists and the file does not, it becomes a link to the
/// system bundle; an existing one is left alone.
fn link_openssl_defaults() {
    for p in ["/usr/lib/ssl/cert.pem", "/etc/ssl/cert.pem"] {
        let p = Path::new(p);
        let dir_exists = p.parent().is_some_and(Path::is_dir);
        if dir_exists && p.symlink_metadata().is_err() {
            let _ = std::os::unix::fs::symlink(SYSTEM_BUNDLE, p);
        }
    }
}

fn install_at(system: &Path, local: &Path, extra: &Path, pem: &str) -> Result<usize, AgentError> {
    let certs = split(pem)?;
    let io = |p: &Path, e: std::io::Error| AgentError::io(&p.to_string_lossy(), &e);
    std::fs::create_dir_all(local).map_err(|e| io(local, e))?;
    for c in &certs {
        let f = local.join(format!("forkd-{:016x}.crt", fnv1a(c.as_bytes())));
        if !f.exists() {
            write_atomic(&f, c.as_bytes())?;
        }
    }
    // Every CA forkd installed so far (a snapshot's parent may have had
    // some), in a stable order.
    let mut names: Vec<_> = std::fs::read_dir(local)
        .map_err(|e| io(local, e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "crt"))
        .collect();
    names.sort();
    let mut all = String::new();
    for n in &names {
        all.push_str(&std::fs::read_to_string(n).map_err(|e| io(n, e))?);
    }
    write_atomic(extra, all.as_bytes())?;
    // The system bundle: what it had, plus what it lacks. A missing one
    // (an image without ca-certificates) starts empty.
    let mut bundle = match std::fs::read_to_string(system) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io(system, e)),
    };
    let before = bundle.len();
    for c in &certs {
        if !bundle.contains(c.trim_end()) {
            if !bundle.is_empty() && !bundle.ends_with('\n') {
                bundle.push('\n');
            }
            bundle.push_str(c);
        }
    }
    if bundle.len() != before || !system.exists() {
        write_atomic(system, bundle.as_bytes())?;
    }
    Ok(certs.len())
}

/// Writes `data` to a temporary file beside `path` and renames it into
/// place (a reader never sees half a bundle); creates missing parents.
fn write_atomic(path: &Path, data: &[u8]) -> Result<(), AgentError> {
    let io = |p: &Path, e: std::io::Error| AgentError::io(&p.to_string_lossy(), &e);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    let tmp = path.with_extension("forkd-tmp");
    std::fs::write(&tmp, data).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

/// A stable name for a certificate's file (not a security measure: the
/// content decides what is trusted).
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "-----BEGIN CERTIFICATE-----\nQUFB\n-----END CERTIFICATE-----\n";
    const B: &str = "-----BEGIN CERTIFICATE-----\nQkJC\nQkJC\n-----END CERTIFICATE-----\n";

    #[test]
    fn split_keeps_certificates_and_refuses_the_rest() {
        assert_eq!(split(&format!("{A}\n{B}")).unwrap(), vec![A, B]);
        for (bad, why) in [
            ("", "no certificate"),
            ("hello", "outside a certificate"),
            ("-----BEGIN CERTIFICATE-----\nQUFB\n", "no END"),
            (
                "-----BEGIN PRIVATE KEY-----\nQUFB\n-----END PRIVATE KEY-----\n",
                "outside",
            ),
            (
                "-----BEGIN CERTIFICATE-----\n$(x)\n-----END CERTIFICATE-----\n",
                "base64",
            ),
        ] {
            let e = split(bad).unwrap_err();
            assert_eq!(e.kind, ErrorKind::BadRequest);
            assert!(e.message.contains(why), "{bad:?}: {}", e.message);
        }
    }

    #[test]
    fn install_appends_once_and_collects_every_forkd_ca() {
        let d = tempfile::tempdir().unwrap();
        let (system, local, extra) = (
            d.path().join("etc/ssl/certs/ca-certificates.crt"),
            d.path().join("local/forkd"),
            d.path().join("etc/forkd/extra-ca.pem"),
        );
        std::fs::create_dir_all(system.parent().unwrap()).unwrap();
        std::fs::write(
            &system,
            "-----BEGIN CERTIFICATE-----\nU1lT\n-----END CERTIFICATE-----",
        )
        .unwrap();
        install_at(&system, &local, &extra, A).unwrap();
        // Again, with one more: A is not duplicated.
        install_at(&system, &local, &extra, &format!("{A}{B}")).unwrap();
        let text = std::fs::read_to_string(&system).unwrap();
        assert!(text.starts_with("-----BEGIN CERTIFICATE-----\nU1lT\n-----END CERTIFICATE-----\n"));
        assert_eq!(text.matches("QUFB").count(), 1, "{text}");
        assert_eq!(text.matches("QkJC").count(), 2, "{text}");
        let extra_text = std::fs::read_to_string(&extra).unwrap();
        assert!(
            extra_text.contains("QUFB")
                && extra_text.contains("QkJC")
                && !extra_text.contains("U1lT")
        );
        assert_eq!(std::fs::read_dir(&local).unwrap().count(), 2);
        // An image without a system bundle gets one.
        let bare = d.path().join("bare/ca-certificates.crt");
        install_at(&bare, &local, &extra, B).unwrap();
        assert_eq!(std::fs::read_to_string(&bare).unwrap(), B);
    }
}
