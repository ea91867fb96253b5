//! TLS on poold's TCP listener (`tls_cert`/`tls_key`, `--tls-cert`/
//! `--tls-key`): rustls with the ring provider, the one every forkd HTTP
//! client installs (`forkd_api::http_builder`), so the build carries one
//! crypto library.
//!
//! Handshakes run on their own tasks, off the accept loop, each bounded by
//! [`HANDSHAKE_TIMEOUT`], and at most [`MAX_HANDSHAKES`] at once: a peer
//! that opens connections and never finishes a handshake holds a slot for
//! seconds, not the listener. Finished connections wait in a bounded queue
//! for axum to take them.

use anyhow::{bail, Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// A client that has not finished its handshake by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in flight at most; more connections wait in the kernel's
/// accept backlog.
pub const MAX_HANDSHAKES: usize = 256;

/// Reads a PEM certificate chain and private key into a server config
/// (TLS 1.2 and 1.3, HTTP/1.1 and HTTP/2 by ALPN). Errors name the file and
/// what is wrong with it.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>> {
    let cert_pem = std::fs::read(cert)
        .with_context(|| format!("reading the TLS certificate {}", cert.display()))?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("{}: not a PEM certificate chain: {e}", cert.display()))?;
    if chain.is_empty() {
        bail!(
            "{}: no CERTIFICATE block; tls_cert wants the PEM certificate (chain), leaf first",
            cert.display()
        );
    }
    let key_pem =
        std::fs::read(key).with_context(|| format!("reading the TLS key {}", key.display()))?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
        anyhow::anyhow!(
            "{}: no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}",
            key.display()
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .with_context(|| {
            format!(
                "{} and {} do not make a usable certificate and key (does the key match the certificate?)",
                cert.display(),
                key.display()
            )
        })?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// A TCP listener that hands axum TLS streams.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Starts accepting on `tcp`; the accept task ends when the listener
    /// is dropped.
    pub fn new(tcp: TcpListener, cfg: Arc<rustls::ServerConfig>) -> std::io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(cfg);
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (sock, peer) = tokio::select! {
                    r = tcp.accept() => match r {
                        Ok(x) => x,
                        Err(e) => {
                            tracing::warn!("accept: {e}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                    _ = tx.closed() => return,
                };
                // Streamed answers go out as written; dead peers are found.
                super::listen::tune(&sock);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let hs = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(sock)).await;
                    drop(permit);
                    match hs {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake with {peer}: {e}"),
                        Err(_) => tracing::debug!("TLS handshake with {peer}: timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(x) => x,
            // The accept task only ends when the receiver is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_files_say_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("c.pem");
        let key = dir.path().join("k.pem");
        let e = format!("{:#}", server_config(&cert, &key).unwrap_err());
        assert!(e.contains("reading the TLS certificate"), "{e}");
        std::fs::write(&cert, "hello").unwrap();
        std::fs::write(&key, "hello").unwrap();
        let e = format!("{:#}", server_config(&cert, &key).unwrap_err());
        assert!(e.contains("no CERTIFICATE block"), "{e}");
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        std::fs::write(&cert, ck.cert.pem()).unwrap();
        let e = format!("{:#}", server_config(&cert, &key).unwrap_err());
        assert!(e.contains("no PEM private key"), "{e}");
        // A key that is not the certificate's.
        let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        std::fs::write(&key, other.signing_key.serialize_pem()).unwrap();
        let e = format!("{:#}", server_config(&cert, &key).unwrap_err());
        assert!(e.contains("does the key match"), "{e}");
        std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
        server_config(&cert, &key).unwrap();
    }
}
