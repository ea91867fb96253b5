//! What the gateway is told: where its nodes are and which tokens to use.

use std::time::Duration;

/// Where the nodes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeSource {
    /// A fixed list (`--node NAME=URL`), for systemd hosts.
    Static(Vec<NodeAddr>),
    /// Every address a DNS name resolves to, looked up again at each poll
    /// (`--discover HOST:PORT`): a Kubernetes headless Service has one
    /// record per ready node pod. Nodes are named `ADDRESS:PORT`.
    Dns {
        host: String,
        port: u16,
        https: bool,
    },
}

/// One node: its name (in errors, `/v1/nodes`) and its poold's base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAddr {
    pub name: String,
    pub url: String,
}

/// The gateway's settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub source: NodeSource,
    /// Bearer token clients must send (everything but `/healthz`); `None`
    /// leaves the gateway open, which only a loopback bind may do.
    pub token: Option<String>,
    /// Bearer token the gateway sends to nodes.
    pub node_token: Option<String>,
    /// The key the nodes' E2B planes take (their `e2b.api_key_file`);
    /// None: each node's bearer token, which then crosses to the nodes'
    /// plain-HTTP E2B planes.
    pub node_e2b_key: Option<String>,
    /// PEM of the CA that signed the nodes' TLS certificates (https nodes).
    pub node_ca_cert: Option<Vec<u8>>,
    /// Time between health polls of every node.
    pub poll_interval: Duration,
    /// How long a node may take to answer a poll or to accept a request.
    pub node_timeout: Duration,
}

impl Config {
    /// Static `nodes`, no tokens, a poll a minute (the tests poll by hand).
    #[cfg(test)]
    pub(crate) fn for_test(nodes: Vec<NodeAddr>) -> Config {
        Config {
            source: NodeSource::Static(nodes),
            token: None,
            node_token: None,
            node_e2b_key: None,
            node_ca_cert: None,
            poll_interval: Duration::from_secs(60),
            node_timeout: Duration::from_secs(5),
        }
    }
}

impl NodeAddr {
    /// Parses `NAME=URL` (or a bare URL, named after its host and port).
    pub fn parse(s: &str) -> Result<NodeAddr, String> {
        let (name, url) = match s.split_once('=') {
            Some((n, u)) => (n.to_string(), u.to_string()),
            None => (
                s.trim_start_matches("http://")
                    .trim_start_matches("https://")
                    .to_string(),
                s.to_string(),
            ),
        };
        check_name(&name)?;
        let url = url.trim_end_matches('/').to_string();
        if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() < 10 {
            return Err(format!(
                "node {name}: {url:?} is not a poold URL; give http://HOST:PORT or https://HOST:PORT"
            ));
        }
        Ok(NodeAddr { name, url })
    }
}

/// A node name: 1..=64 of `[A-Za-z0-9._:-]`, so it can sit in an error
/// message, a header and a log line as it is.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "node name {name:?} must be 1-64 characters of letters, digits, '.', '_', ':' and '-'"
        ))
    }
}

/// Parses `HOST:PORT` for DNS discovery.
pub fn parse_discover(s: &str, https: bool) -> Result<NodeSource, String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("--discover {s:?}: give HOST:PORT, e.g. poold.forkd.svc:7070"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("--discover {s:?}: {port:?} is not a port number"))?;
    if host.is_empty() {
        return Err(format!("--discover {s:?}: the host name is empty"));
    }
    Ok(NodeSource::Dns {
        host: host.to_string(),
        port,
        https,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_parse_and_bad_ones_say_why() {
        let a = NodeAddr::parse("n1=http://10.0.0.1:7070/").unwrap();
        assert_eq!(
            (a.name.as_str(), a.url.as_str()),
            ("n1", "http://10.0.0.1:7070")
        );
        let b = NodeAddr::parse("http://10.0.0.2:7070").unwrap();
        assert_eq!(b.name, "10.0.0.2:7070");
        assert!(NodeAddr::parse("n1=ftp://x")
            .unwrap_err()
            .contains("not a poold URL"));
        assert!(NodeAddr::parse("bad name=http://10.0.0.1:1")
            .unwrap_err()
            .contains("must be 1-64"));
        assert!(parse_discover("svc", false)
            .unwrap_err()
            .contains("HOST:PORT"));
        assert!(parse_discover("svc:x", false)
            .unwrap_err()
            .contains("not a port"));
        assert_eq!(
            parse_discover("poold.forkd.svc:7070", false).unwrap(),
            NodeSource::Dns {
                host: "poold.forkd.svc".into(),
                port: 7070,
                https: false
            }
        );
    }
}
