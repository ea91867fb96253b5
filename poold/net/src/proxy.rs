//! Published ports: a userspace TCP proxy (like docker-proxy) from a host
//! address and port to the child's `guest_addr` and the guest port. It
//! works for 127.0.0.1 without `route_localnet`, and dies with its owner
//! (poold listens again after a restart). Connections per port are bounded.

use crate::{NetError, Result};
use serde::{Deserialize, Serialize};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// At most this many connections at once through one published port.
pub const MAX_CONNECTIONS: usize = 256;

/// One published port, as requested and as shown in `SandboxInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortSpec {
    /// The port a server in the guest listens on.
    pub guest_port: u16,
    /// 0 or absent: any free port (the chosen one is shown).
    #[serde(default)]
    pub host_port: u16,
    /// Default 127.0.0.1.
    #[serde(default = "localhost")]
    pub host_addr: Ipv4Addr,
}

fn localhost() -> Ipv4Addr {
    Ipv4Addr::LOCALHOST
}

impl PortSpec {
    /// Parses the CLI's `[HOST_ADDR:]HOST_PORT:GUEST_PORT` or `GUEST_PORT`.
    pub fn parse(s: &str) -> Result<PortSpec> {
        let bad = || {
            NetError::Invalid(format!(
                "--publish {s:?}: expected GUEST_PORT, HOST_PORT:GUEST_PORT or HOST_ADDR:HOST_PORT:GUEST_PORT"
            ))
        };
        let parts: Vec<&str> = s.split(':').collect();
        let port = |p: &str| p.parse::<u16>().map_err(|_| bad());
        let spec = match parts.as_slice() {
            [g] => PortSpec {
                guest_port: port(g)?,
                host_port: 0,
                host_addr: localhost(),
            },
            [h, g] => PortSpec {
                guest_port: port(g)?,
                host_port: port(h)?,
                host_addr: localhost(),
            },
            [a, h, g] => PortSpec {
                guest_port: port(g)?,
                host_port: port(h)?,
                host_addr: a.parse().map_err(|_| bad())?,
            },
            _ => return Err(bad()),
        };
        spec.validate()?;
        Ok(spec)
    }

    /// A guest port is 1-65535; the host address must be the host's own or
    /// unspecified (checked again by bind).
    pub fn validate(&self) -> Result<()> {
        if self.guest_port == 0 {
            return Err(NetError::Invalid(
                "ports[].guest_port must be 1-65535".into(),
            ));
        }
        if self.host_addr.is_multicast() || self.host_addr.is_broadcast() {
            return Err(NetError::Invalid(format!(
                "ports[].host_addr {} is not a local address to listen on",
                self.host_addr
            )));
        }
        Ok(())
    }
}

/// A listening published port; dropping it stops listening and closes the
/// connections it carries.
pub struct Published {
    /// What is published, with the host port actually bound.
    pub spec: PortSpec,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Published {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Listens on `spec.host_addr:spec.host_port` and forwards each connection
/// to `guest:spec.guest_port`. The returned spec carries the bound port.
pub async fn publish(spec: &PortSpec, guest: Ipv4Addr) -> Result<Published> {
    spec.validate()?;
    let listener = TcpListener::bind(SocketAddrV4::new(spec.host_addr, spec.host_port))
        .await
        .map_err(|source| NetError::Publish {
            addr: spec.host_addr,
            host_port: spec.host_port,
            guest_port: spec.guest_port,
            source,
        })?;
    let bound = listener
        .local_addr()
        .map_err(|e| NetError::io("reading a published port's address", e))?
        .port();
    let target = SocketAddrV4::new(guest, spec.guest_port);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let task = tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                continue;
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                // Over the bound: refuse by closing at once.
                drop(client);
                continue;
            };
            tokio::spawn(async move {
                let _permit = permit;
                if let Ok(Ok(mut upstream)) = tokio::time::timeout(
                    std::time::Duration::from_secs(10),
                    TcpStream::connect(target),
                )
                .await
                {
                    let mut client = client;
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
            });
        }
    });
    Ok(Published {
        spec: PortSpec {
            host_port: bound,
            ..spec.clone()
        },
        task,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn cli_forms_parse() {
        assert_eq!(PortSpec::parse("8000").unwrap().guest_port, 8000);
        let p = PortSpec::parse("9000:8000").unwrap();
        assert_eq!((p.host_port, p.guest_port), (9000, 8000));
        let p = PortSpec::parse("0.0.0.0:9000:8000").unwrap();
        assert_eq!(p.host_addr, Ipv4Addr::UNSPECIFIED);
        for bad in ["", "x", "1:2:3:4", "0", "70000", "a.b:1:2"] {
            assert!(PortSpec::parse(bad).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<PortSpec>(r#"{"guest_port":80,"extra":1}"#).is_err());
    }

    #[tokio::test]
    async fn forwards_both_ways_and_stops_when_dropped() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_port = echo.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = echo.accept().await.unwrap();
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(&buf).await.unwrap();
        });
        let spec = PortSpec {
            guest_port: echo_port,
            host_port: 0,
            host_addr: Ipv4Addr::LOCALHOST,
        };
        let p = publish(&spec, Ipv4Addr::LOCALHOST).await.unwrap();
        let port = p.spec.host_port;
        assert_ne!(port, 0);
        let mut c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        c.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello");
        drop(p);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(TcpStream::connect(("127.0.0.1", port)).await.is_err());
    }
}
