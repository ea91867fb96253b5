//! Extra CA certificates for guests (docs/network.md, "Trusting a host's
//! CA"): on hosts behind a TLS-inspecting proxy, a sandbox's HTTPS and
//! `pip install` verify only once the guest trusts the proxy's CA.
//!
//! A [`CaBundle`] is PEM text checked at the boundary: at most
//! [`MAX_CA_BYTES`], only `CERTIFICATE` blocks (a private key or anything
//! else is refused, so a mistaken paste never reaches a guest), each parsed
//! as an X.509 certificate usable as a trust anchor. It is kept
//! re-encoded, one normalised block per certificate, so duplicates merge
//! and the guest never sees the caller's text.
//!
//! Where CAs come from: the config's `ca_certs_file` ([`configure`]), a
//! spawn's `ca_certs`, a snapshot create's `ca_certs` (installed in the
//! parent before its warm-up, so every child inherits them). A hand-out
//! installs the configured ones and the spawn's together (`restore::hand_out`):
//! a pooled child gets them when it is handed out, never while it is parked,
//! so a spawn can ask for a CA its pool did not know.

use base64::Engine;
use rustls_pki_types::pem::{PemObject, SectionKind};
use rustls_pki_types::CertificateDer;
use std::sync::OnceLock;

/// Largest PEM text accepted (a host's whole CA bundle is ~220 KiB); the
/// guest gets it in one request header.
pub const MAX_CA_BYTES: usize = rootfs_init::protocol::MAX_CA_CERTS_BYTES;
/// Most certificates in one bundle.
pub const MAX_CA_CERTS: usize = 1000;

/// Why a CA bundle was refused; each message says what to give instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaError {
    /// Over [`MAX_CA_BYTES`].
    #[error("{what}: {bytes} bytes of PEM; at most {MAX_CA_BYTES} are accepted (give only the CAs the guest needs)")]
    TooLarge {
        /// The field or file.
        what: String,
        /// Its size.
        bytes: usize,
    },
    /// No certificate in it.
    #[error("{what}: no PEM certificate (-----BEGIN CERTIFICATE-----) found; give the CA certificate(s) in PEM")]
    Empty {
        /// The field or file.
        what: String,
    },
    /// A PEM block of another kind (a private key, a CSR...).
    #[error("{what}: block {index} is a {kind}, not a CERTIFICATE; give only CA certificates (never a key)")]
    NotACertificate {
        /// The field or file.
        what: String,
        /// 1-based position of the block.
        index: usize,
        /// Its PEM label.
        kind: String,
    },
    /// Unparsable PEM or X.509.
    #[error("{what}: {reason}")]
    Bad {
        /// The field or file.
        what: String,
        /// What is wrong.
        reason: String,
    },
}

/// Validated CA certificates (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CaBundle {
    certs: Vec<String>,
}

impl CaBundle {
    /// Parses PEM `text`; `what` names it in errors (`ca_certs`, a path).
    pub fn parse(text: &str, what: &str) -> Result<CaBundle, CaError> {
        let what = what.to_string();
        if text.len() > MAX_CA_BYTES {
            return Err(CaError::TooLarge {
                what,
                bytes: text.len(),
            });
        }
        let bad = |reason: String| CaError::Bad {
            what: what.clone(),
            reason,
        };
        let mut certs = Vec::new();
        for (i, section) in <(SectionKind, Vec<u8>)>::pem_slice_iter(text.as_bytes()).enumerate() {
            let (kind, der) = section.map_err(|e| bad(format!("not valid PEM: {e:?}")))?;
            if kind != SectionKind::Certificate {
                return Err(CaError::NotACertificate {
                    what,
                    index: i + 1,
                    kind: label(text, i).unwrap_or_else(|| format!("{kind:?}")),
                });
            }
            let der = CertificateDer::from(der);
            webpki::anchor_from_trusted_cert(&der).map_err(|e| {
                bad(format!(
                    "certificate {} is not a valid X.509 certificate: {e}",
                    i + 1
                ))
            })?;
            certs.push(pem_block(&der));
            if certs.len() > MAX_CA_CERTS {
                return Err(bad(format!("more than {MAX_CA_CERTS} certificates")));
            }
        }
        // Blocks the PEM reader skips (unknown labels such as "TRUSTED
        // CERTIFICATE") would be dropped silently: refuse them instead.
        let begins = text.matches("-----BEGIN ").count();
        if begins != certs.len() {
            return Err(bad(format!(
                "{begins} PEM blocks but {} certificates; only -----BEGIN CERTIFICATE----- blocks are accepted",
                certs.len()
            )));
        }
        if certs.is_empty() {
            return Err(CaError::Empty { what });
        }
        let mut b = CaBundle::default();
        b.extend(certs);
        Ok(b)
    }

    /// Reads and parses the PEM file at `path`.
    pub fn read(path: &std::path::Path) -> Result<CaBundle, CaError> {
        let what = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| CaError::Bad {
            what: what.clone(),
            reason: e.to_string(),
        })?;
        if meta.len() > MAX_CA_BYTES as u64 {
            return Err(CaError::TooLarge {
                what,
                bytes: meta.len() as usize,
            });
        }
        let text = std::fs::read_to_string(path).map_err(|e| CaError::Bad {
            what: what.clone(),
            reason: e.to_string(),
        })?;
        CaBundle::parse(&text, &what)
    }

    fn extend(&mut self, certs: impl IntoIterator<Item = String>) {
        for c in certs {
            if !self.certs.contains(&c) {
                self.certs.push(c);
            }
        }
    }

    /// Both bundles' certificates, each once, `self`'s first.
    pub fn merged(&self, other: &CaBundle) -> CaBundle {
        let mut b = self.clone();
        b.extend(other.certs.iter().cloned());
        b
    }

    /// How many certificates.
    pub fn len(&self) -> usize {
        self.certs.len()
    }

    /// No certificates (the default bundle).
    pub fn is_empty(&self) -> bool {
        self.certs.is_empty()
    }

    /// The certificates as PEM, one normalised block each.
    pub fn pem(&self) -> String {
        self.certs.concat()
    }
}

/// The label of the `i`-th (0-based) PEM block of `text` (`PRIVATE KEY`).
fn label(text: &str, i: usize) -> Option<String> {
    let rest = text.split("-----BEGIN ").nth(i + 1)?;
    Some(rest.split("-----").next()?.chars().take(40).collect())
}

/// One certificate as a PEM block with 64-column lines.
fn pem_block(der: &CertificateDer<'_>) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut s = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        s.push_str(std::str::from_utf8(chunk).expect("base64 is ASCII"));
        s.push('\n');
    }
    s.push_str("-----END CERTIFICATE-----\n");
    s
}

static CONFIGURED: OnceLock<CaBundle> = OnceLock::new();

/// Sets the CAs every hand-out installs (poold's `ca_certs_file`), once,
/// before any child is handed out. Later calls are ignored.
pub fn configure(bundle: CaBundle) {
    let _ = CONFIGURED.set(bundle);
}

/// The configured CAs (empty when none).
pub fn configured() -> CaBundle {
    CONFIGURED.get().cloned().unwrap_or_default()
}

/// What a hand-out installs: the configured CAs and `extra` (a spawn's),
/// or None when there are none.
pub fn for_hand_out(extra: Option<&CaBundle>) -> Option<CaBundle> {
    let b = match extra {
        Some(e) => configured().merged(e),
        None => configured(),
    };
    (!b.is_empty()).then_some(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca(name: &str) -> String {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_string());
        let key = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn certificates_parse_merge_and_normalise() {
        let (a, b) = (ca("forkd test A"), ca("forkd test B"));
        let text = format!("# a comment line\n{a}\n\n{b}");
        let bundle = CaBundle::parse(&text, "ca_certs").unwrap();
        assert_eq!(bundle.len(), 2);
        assert!(!bundle.pem().contains("comment"));
        assert_eq!(
            bundle.pem().matches("-----BEGIN CERTIFICATE-----").count(),
            2
        );
        // Re-parsing the normalised text gives the same bundle.
        assert_eq!(CaBundle::parse(&bundle.pem(), "x").unwrap(), bundle);
        let only_a = CaBundle::parse(&a, "x").unwrap();
        assert_eq!(only_a.merged(&bundle).len(), 2);
        assert_eq!(only_a.merged(&only_a), only_a);
    }

    #[test]
    fn garbage_keys_and_oversize_are_refused_with_the_reason() {
        let a = ca("forkd test A");
        let key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        let cases = [
            ("hello world".to_string(), "no PEM certificate"),
            (String::new(), "no PEM certificate"),
            (format!("{a}{key}"), "PRIVATE KEY, not a CERTIFICATE"),
            (
                "-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n"
                    .to_string(),
                "not a valid X.509 certificate",
            ),
            (
                "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n".to_string(),
                "not valid PEM",
            ),
            (
                "-----BEGIN TRUSTED CERTIFICATE-----\nQUFB\n-----END TRUSTED CERTIFICATE-----\n"
                    .to_string(),
                "only -----BEGIN CERTIFICATE----- blocks",
            ),
            ("x".repeat(MAX_CA_BYTES + 1), "at most"),
        ];
        for (text, want) in cases {
            let e = CaBundle::parse(&text, "ca_certs").unwrap_err().to_string();
            assert!(e.starts_with("ca_certs: "), "{e}");
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
