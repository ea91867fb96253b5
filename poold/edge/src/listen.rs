//! Listeners: a unix socket or a TCP address (HTTPS with a rustls config,
//! [`super::tls`]), bound before serving so a caller can print where it
//! listens first, and served until SIGINT/SIGTERM.

use anyhow::{Context, Result};
use axum::Router;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A bound listener, not yet serving.
pub enum Listener {
    /// A unix socket at this path.
    Unix(tokio::net::UnixListener, PathBuf),
    /// A TCP socket, with TLS when a config is given.
    Tcp(tokio::net::TcpListener, Option<Arc<rustls::ServerConfig>>),
}

impl Listener {
    /// Binds a unix socket at `path`, replacing a stale socket a previous
    /// poold left (the data dir's lock ensures none serves it); anything
    /// else there is refused.
    pub fn bind_unix(path: &Path) -> Result<Listener> {
        remove_stale_socket(path)?;
        if let Some(dir) = path.parent() {
            forkd_vmm::private::create_dir_all(dir)?;
        }
        let l = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("binding {}", path.display()))?;
        Ok(Listener::Unix(l, path.to_path_buf()))
    }

    /// Binds TCP `addr`, serving HTTPS with `tls`.
    pub async fn bind_tcp(
        addr: SocketAddr,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Result<Listener> {
        let l = tokio::net::TcpListener::bind(addr).await.with_context(|| {
            format!("binding {addr} (is another poold or gateway listening there?)")
        })?;
        Ok(Listener::Tcp(l, tls))
    }

    /// Where it listens: `unix:///path`, `http://ip:port` or `https://ip:port`.
    pub fn url(&self) -> String {
        match self {
            Listener::Unix(_, p) => format!("unix://{}", p.display()),
            Listener::Tcp(l, tls) => {
                let scheme = if tls.is_some() { "https" } else { "http" };
                let addr = l
                    .local_addr()
                    .map_or_else(|_| "?".to_string(), |a| a.to_string());
                format!("{scheme}://{addr}")
            }
        }
    }

    /// Serves `app` until SIGINT/SIGTERM. TCP requests carry the peer's
    /// address (`ConnectInfo<SocketAddr>`, the audit's `remote`).
    pub async fn serve(self, app: Router) -> Result<()> {
        match self {
            Listener::Unix(l, _) => axum::serve(l, app)
                .with_graceful_shutdown(shutdown_signal())
                .await
                .context("serving"),
            Listener::Tcp(l, tls) => {
                let svc = app.into_make_service_with_connect_info::<SocketAddr>();
                match tls {
                    // `tap_io` is a no-op whose wrapper gives the TLS listener
                    // axum's `ConnectInfo<SocketAddr>`.
                    Some(cfg) => {
                        use axum::serve::ListenerExt;
                        let l = super::tls::TlsListener::new(l, cfg)?.tap_io(|_| {});
                        axum::serve(l, svc)
                            .with_graceful_shutdown(shutdown_signal())
                            .await
                            .context("serving")
                    }
                    None => axum::serve(no_delay(l), svc)
                        .with_graceful_shutdown(shutdown_signal())
                        .await
                        .context("serving"),
                }
            }
        }
    }
}

/// `l` with every accepted connection [`tune`]d.
pub fn no_delay(
    l: tokio::net::TcpListener,
) -> axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)> {
    use axum::serve::ListenerExt;
    fn set(tcp: &mut tokio::net::TcpStream) {
        tune(tcp)
    }
    l.tap_io(set as fn(&mut tokio::net::TcpStream))
}

/// Nagle's algorithm off and TCP keepalive on, for a connection that may
/// carry a stream for long.
///
/// Streamed answers (process output, NDJSON cells, an answer whose
/// headers go out before its body, terminal frames) are small writes in
/// a row: with Nagle on, a write may wait for the ACK of the one before,
/// which the peer delays (up to 40 ms on Linux). Keepalive finds a quiet
/// peer that vanished without a FIN (a host gone, a NAT that forgot)
/// within about two minutes, and the user timeout one that stopped
/// acknowledging what was sent to it, so what its stream holds (a relay
/// slot, a PTY) is let go; a quiet but live peer is not disturbed.
pub fn tune(tcp: &tokio::net::TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!("TCP_NODELAY: {e}");
    }
    let ka = socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(60))
        .with_interval(std::time::Duration::from_secs(15))
        .with_retries(4);
    let sock = socket2::SockRef::from(tcp);
    if let Err(e) = sock.set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keepalive: {e}");
    }
    if let Err(e) = sock.set_tcp_user_timeout(Some(std::time::Duration::from_secs(120))) {
        tracing::debug!("TCP_USER_TIMEOUT: {e}");
    }
}

/// Removes the socket a previous poold left at `path`; anything else there
/// is refused, so a mistyped `--unix` never deletes a file.
fn remove_stale_socket(path: &Path) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display())),
        Ok(_) => anyhow::bail!(
            "--unix {}: a file that is not a socket is there; pick another path",
            path.display()
        ),
        Err(_) => Ok(()),
    }
}

/// Resolves at SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("poold stopping; sandboxes keep running and are re-adopted at the next start");
}
