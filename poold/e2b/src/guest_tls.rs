//! TLS to a guest server on one of a sandbox's `httpsPorts` (docs/e2b.md,
//! "Ports"): the plane speaks TLS to it over the agent's tunnel and plain
//! HTTP to the client, as E2B's proxy does.
//!
//! Any certificate is accepted: a guest's server has a self-signed one
//! (nothing could vouch for it), the tunnel already reaches exactly that
//! sandbox's loopback, so there is no one in between to authenticate
//! against. The handshake's signature is still checked against the
//! certificate presented, and only HTTP/1.1 is offered (what
//! [`crate::ports`] speaks).

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use std::sync::{Arc, OnceLock};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// Opens TLS over `io` to the guest's server, sending `host` (the `Host`
/// the guest sees, without its port) as SNI when it is a DNS name.
pub async fn connect<T>(io: T, host: &str) -> std::io::Result<TlsStream<T>>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    TlsConnector::from(config())
        .connect(server_name(host), io)
        .await
}

/// The name the handshake carries: `host`'s name part if it is a DNS
/// name, else an address (for which no SNI is sent).
fn server_name(host: &str) -> ServerName<'static> {
    host.parse::<axum::http::uri::Authority>()
        .ok()
        .and_then(|a| ServerName::try_from(a.host().trim_matches(['[', ']']).to_string()).ok())
        .unwrap_or_else(|| ServerName::from(std::net::Ipv4Addr::LOCALHOST))
}

fn config() -> Arc<ClientConfig> {
    static CONFIG: OnceLock<Arc<ClientConfig>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut c = ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .expect("ring supports the default TLS versions")
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth();
            c.alpn_protocols = vec![b"http/1.1".to_vec()];
            Arc::new(c)
        })
        .clone()
}

/// Accepts whatever certificate the guest presents (see the module doc).
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn the_name_sent_is_the_hosts_name_part() {
        let dns = |h: &str| match server_name(h) {
            ServerName::DnsName(d) => Some(d.as_ref().to_string()),
            _ => None,
        };
        assert_eq!(dns("app.internal:8443").as_deref(), Some("app.internal"));
        assert_eq!(
            dns("8443-sb-1.e2b.local").as_deref(),
            Some("8443-sb-1.e2b.local")
        );
        assert_eq!(dns("127.0.0.1:443"), None);
        assert_eq!(dns("[::1]:443"), None);
        assert_eq!(dns("bad host"), None);
    }

    /// A server with a self-signed certificate for another name is reached,
    /// and what it answers comes back decrypted.
    #[tokio::test]
    async fn a_self_signed_guest_server_is_reached() {
        let cert = rcgen::generate_simple_self_signed(vec!["guest.invalid".into()]).unwrap();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.der().clone()], key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let (client_io, server_io) = tokio::io::duplex(4096);
        let srv = tokio::spawn(async move {
            let mut s = acceptor.accept(server_io).await.unwrap();
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(&buf.to_ascii_uppercase()).await.unwrap();
            s.flush().await.unwrap();
        });
        let mut c = connect(client_io, "localhost:8443").await.unwrap();
        c.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"HELLO");
        srv.await.unwrap();
    }
}
