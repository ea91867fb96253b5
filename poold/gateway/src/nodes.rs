//! The nodes the gateway knows, what each last said, and where a sandbox is.
//!
//! A poll asks every node for its pools, snapshots and sandboxes (poold's
//! own `/v1` lists, so any poold is a node as it is). A node that fails a
//! poll is down from that moment, with the reason, and up again at the
//! first poll it answers: nodes rejoin on their own. With DNS discovery the
//! node set is re-read at every poll; a node that left the records stays
//! listed as down (its sandboxes then get a 410 naming it, not a 404).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::config::{Config, NodeAddr, NodeSource};
use crate::error::{DownList, GatewayError};

/// At most this many sandbox → node entries are cached; past it the cache
/// starts over (it is only a shortcut: a miss asks the nodes).
const ID_CACHE_MAX: usize = 65_536;

/// A node's health as of its last poll.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Health {
    /// Not polled yet.
    Unknown,
    Up,
    Down {
        since_unix: u64,
        why: String,
    },
}

/// What the last successful poll of a node saw.
#[derive(Debug, Clone, Default)]
struct Seen {
    /// Ready children per pool tag.
    ready: HashMap<String, usize>,
    snapshots: HashSet<String>,
    sandboxes: usize,
    /// The node's `GET /version` (build, accelerator, jail, isolation).
    version: Option<serde_json::Value>,
    /// Its E2B planes, read from `version` once per poll ([`Node::e2b`]).
    e2b: Option<E2bUrls>,
}

/// Where a node serves E2B: `(control plane URL, sandbox plane URL, its
/// sandbox domain)`.
pub type E2bUrls = (String, String, String);

/// One poold node.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub url: String,
    state: RwLock<(Health, Seen)>,
    clients: Clients,
    /// The host name its URL carries and the address it stands for here
    /// (DNS discovery over https, see [`Node::new`]).
    pin: Option<(String, std::net::SocketAddr)>,
}

/// How a call to a node is bounded.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Bound {
    /// Polls and whole-JSON calls: the node timeout end to end.
    Whole,
    /// Streamed calls: only connecting is bounded (an exec stream may run
    /// for as long as its command does).
    Connect,
}

/// A node's HTTP clients (its own, so a discovered node's address can be
/// pinned under the Service's TLS name) and the token it expects.
#[derive(Debug)]
struct Clients {
    whole: reqwest::Client,
    connect: reqwest::Client,
    token: Option<String>,
}

/// `GET /v1/nodes`: one node as operators see it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeView {
    pub name: String,
    pub url: String,
    pub health: serde_json::Value,
    /// Ready children per pool tag.
    pub ready: HashMap<String, usize>,
    pub snapshots: Vec<String>,
    pub sandboxes: usize,
    /// The node's own `GET /version`, as of its last good poll.
    #[serde(default)]
    pub version: Option<serde_json::Value>,
}

impl Node {
    /// `pin`: connect to this address whatever the URL's host resolves to
    /// (DNS discovery over https: the URL names the Service, which the
    /// nodes' certificate names, and each node is one of its addresses).
    fn new(
        a: &NodeAddr,
        cfg: &ClientConfig,
        pin: Option<(&str, std::net::SocketAddr)>,
    ) -> anyhow::Result<Node> {
        let build = |whole: bool| -> anyhow::Result<reqwest::Client> {
            let mut b = forkd_api::http_builder().connect_timeout(cfg.timeout);
            if whole {
                b = b.timeout(cfg.timeout);
            }
            if let Some(pem) = &cfg.ca_cert {
                b = b.add_root_certificate(reqwest::Certificate::from_pem(pem)?);
            }
            if let Some((host, addr)) = pin {
                b = b.resolve(host, addr);
            }
            Ok(b.build()?)
        };
        Ok(Node {
            name: a.name.clone(),
            url: a.url.clone(),
            state: RwLock::new((Health::Unknown, Seen::default())),
            clients: Clients {
                whole: build(true)?,
                connect: build(false)?,
                token: cfg.token.clone(),
            },
            pin: pin.map(|(h, a)| (h.to_string(), a)),
        })
    }

    /// Where to open a connection of its own to `base` (one of this
    /// node's plane URLs): `host:port`, the pinned address for the pinned
    /// name, as its clients connect.
    pub(crate) fn connect_addr(&self, base: &str) -> Option<String> {
        let u = reqwest::Url::parse(base).ok()?;
        let (host, port) = (u.host_str()?, u.port_or_known_default()?);
        Some(match &self.pin {
            Some((name, addr)) if name == host => {
                std::net::SocketAddr::new(addr.ip(), port).to_string()
            }
            _ => format!("{host}:{port}"),
        })
    }

    /// A request to this node, with its token.
    pub(crate) fn call(
        &self,
        bound: Bound,
        method: reqwest::Method,
        path_and_query: &str,
    ) -> reqwest::RequestBuilder {
        let rb = self.call_url(bound, method, &format!("{}{}", self.url, path_and_query));
        match &self.clients.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    /// A request to `url` (one of this node's E2B planes) on this node's
    /// clients, without the `/v1` bearer token: E2B calls carry their own
    /// key and tokens.
    pub(crate) fn call_url(
        &self,
        bound: Bound,
        method: reqwest::Method,
        url: &str,
    ) -> reqwest::RequestBuilder {
        let c = match bound {
            Bound::Whole => &self.clients.whole,
            Bound::Connect => &self.clients.connect,
        };
        c.request(method, url)
    }

    /// Where this node serves the E2B planes, as its last `/version` said,
    /// at the host its `/v1` is reached at. None: E2B is off there.
    pub fn e2b(&self) -> Option<E2bUrls> {
        self.state.read().unwrap().1.e2b.clone()
    }

    /// The E2B planes a `/version` names, at the host of this node's URL.
    fn e2b_of(&self, version: &serde_json::Value) -> Option<E2bUrls> {
        let planes: forkd_api::E2bPlanes =
            serde_json::from_value(version.get("e2b")?.clone()).ok()?;
        let url = reqwest::Url::parse(&self.url).ok()?;
        // Bracketed for IPv6, as a URL needs it.
        let host = url.host_str()?;
        Some((
            format!("http://{host}:{}", planes.api_port),
            format!("http://{host}:{}", planes.sandbox_port),
            planes.domain,
        ))
    }

    pub(crate) fn token(&self) -> Option<&str> {
        self.clients.token.as_deref()
    }

    pub fn health(&self) -> Health {
        self.state.read().unwrap().0.clone()
    }

    /// The token this node mints into sandbox ids
    /// ([`forkd_api::ids::node_token`]): of the name its `/version` gave, or
    /// before it answered one, of the name it is listed under (when that is
    /// a node name, not a discovered address).
    pub fn id_token(&self) -> Option<String> {
        let st = self.state.read().unwrap();
        let told = st.1.version.as_ref().map(|v| v["node"].as_str());
        match told {
            Some(Some(name)) => Some(forkd_api::ids::node_token(name)),
            // It answered, without a name: its ids carry no token.
            Some(None) => None,
            None => forkd_api::ids::validate_node_name(&self.name)
                .ok()
                .map(|()| forkd_api::ids::node_token(&self.name)),
        }
    }

    pub fn is_up(&self) -> bool {
        self.health() == Health::Up
    }

    /// Ready children of `tag`, whether it holds the snapshot, its load.
    pub fn for_tag(&self, tag: &str) -> (usize, bool, usize) {
        let s = &self.state.read().unwrap().1;
        (
            s.ready.get(tag).copied().unwrap_or(0),
            s.snapshots.contains(tag),
            s.sandboxes,
        )
    }

    /// Whether the node pulls tags it lacks from a hub (its `/version`
    /// names one).
    pub fn has_hub(&self) -> bool {
        let st = self.state.read().unwrap();
        st.1.version
            .as_ref()
            .is_some_and(|v| v["hub"].as_str().is_some())
    }

    pub fn load(&self) -> usize {
        self.state.read().unwrap().1.sandboxes
    }

    fn mark_up(&self, seen: Seen) {
        *self.state.write().unwrap() = (Health::Up, seen);
    }

    fn mark_down(&self, why: String) {
        let mut st = self.state.write().unwrap();
        let since_unix = match &st.0 {
            Health::Down { since_unix, .. } => *since_unix,
            _ => now_unix(),
        };
        st.0 = Health::Down { since_unix, why };
    }

    /// Counts a sandbox placed here until the next poll says how many.
    pub fn note_spawned(&self, tag: &str, n: usize) {
        let mut st = self.state.write().unwrap();
        st.1.sandboxes += n;
        if let Some(r) = st.1.ready.get_mut(tag) {
            *r = r.saturating_sub(n);
        }
    }

    /// Counts one sandbox the gateway killed on it, until the next poll.
    pub fn note_gone(&self) {
        let mut st = self.state.write().unwrap();
        st.1.sandboxes = st.1.sandboxes.saturating_sub(1);
    }

    fn view(&self) -> NodeView {
        let st = self.state.read().unwrap();
        let mut snapshots: Vec<String> = st.1.snapshots.iter().cloned().collect();
        snapshots.sort();
        NodeView {
            name: self.name.clone(),
            url: self.url.clone(),
            health: serde_json::to_value(&st.0).unwrap_or_default(),
            ready: st.1.ready.clone(),
            snapshots,
            sandboxes: st.1.sandboxes,
            version: st.1.version.clone(),
        }
    }
}

/// Every node, the clients to reach them, and the sandbox → node cache.
pub struct Registry {
    source: NodeSource,
    clients: ClientConfig,
    poll_interval: Duration,
    nodes: RwLock<Vec<Arc<Node>>>,
    ids: Mutex<HashMap<String, String>>,
}

impl Registry {
    pub fn new(cfg: &Config) -> anyhow::Result<Registry> {
        let clients = ClientConfig {
            timeout: cfg.node_timeout,
            token: cfg.node_token.clone(),
            ca_cert: cfg.node_ca_cert.clone(),
        };
        let nodes = match &cfg.source {
            NodeSource::Static(list) => list
                .iter()
                .map(|a| Node::new(a, &clients, None).map(Arc::new))
                .collect::<anyhow::Result<_>>()?,
            NodeSource::Dns { .. } => Vec::new(),
        };
        Ok(Registry {
            source: cfg.source.clone(),
            clients,
            poll_interval: cfg.poll_interval,
            nodes: RwLock::new(nodes),
            ids: Mutex::new(HashMap::new()),
        })
    }

    pub fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.read().unwrap().clone()
    }

    pub fn up_nodes(&self) -> Vec<Arc<Node>> {
        self.nodes().into_iter().filter(|n| n.is_up()).collect()
    }

    /// The names of the nodes that are not up, for error messages.
    pub fn down(&self) -> DownList {
        DownList(
            self.nodes()
                .iter()
                .filter(|n| !n.is_up())
                .map(|n| n.name.clone())
                .collect(),
        )
    }

    pub fn views(&self) -> Vec<NodeView> {
        self.nodes().iter().map(|n| n.view()).collect()
    }

    /// GETs `path` from `node` as JSON, with the node timeout.
    pub(crate) async fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        node: &Node,
        path: &str,
    ) -> Result<T, String> {
        let r = node
            .call(Bound::Whole, reqwest::Method::GET, path)
            .send()
            .await
            .map_err(|e| error_chain(&e))?;
        let status = r.status();
        if !status.is_success() {
            let body = r.text().await.unwrap_or_default();
            return Err(format!("GET {path}: {status} {}", body.trim()));
        }
        r.json()
            .await
            .map_err(|e| format!("GET {path}: {}", error_chain(&e)))
    }

    /// Polls every node once (after re-reading DNS, with discovery).
    pub async fn poll_once(&self) {
        if let NodeSource::Dns { host, port, https } = &self.source {
            self.rediscover(host, *port, *https).await;
        }
        let polls = self.nodes().into_iter().map(|n| async move {
            match self.poll(&n).await {
                Ok(seen) => n.mark_up(seen),
                Err(why) => {
                    if n.is_up() {
                        tracing::warn!(node = %n.name, %why, "node down");
                    }
                    n.mark_down(why)
                }
            }
        });
        futures::future::join_all(polls).await;
    }

    async fn poll(&self, n: &Node) -> Result<Seen, String> {
        #[derive(Deserialize)]
        struct Pool {
            tag: String,
            ready: usize,
        }
        #[derive(Deserialize)]
        struct Snap {
            tag: String,
        }
        let (pools, snaps, sandboxes, version) = tokio::try_join!(
            self.get_json::<Vec<Pool>>(n, "/v1/pools"),
            self.get_json::<Vec<Snap>>(n, "/v1/snapshots"),
            self.get_json::<Vec<serde_json::Value>>(n, "/v1/sandboxes"),
            self.get_json::<serde_json::Value>(n, "/version"),
        )?;
        Ok(Seen {
            ready: pools.into_iter().map(|p| (p.tag, p.ready)).collect(),
            snapshots: snaps.into_iter().map(|s| s.tag).collect(),
            sandboxes: sandboxes.len(),
            e2b: n.e2b_of(&version),
            version: Some(version),
        })
    }

    async fn rediscover(&self, host: &str, port: u16, https: bool) {
        let addrs: Vec<std::net::SocketAddr> = match tokio::net::lookup_host((host, port)).await {
            Ok(a) => a.collect(),
            Err(e) => {
                tracing::warn!(%host, error = %e, "node discovery: DNS lookup failed");
                return;
            }
        };
        let mut nodes = self.nodes.write().unwrap();
        for a in &addrs {
            let name = a.to_string();
            if nodes.iter().any(|n| n.name == name) {
                continue;
            }
            // Over https the URL names the Service (which the nodes'
            // certificate names) and the client is pinned to this address.
            let (url, pin) = if https {
                (format!("https://{host}:{port}"), Some((host, *a)))
            } else {
                (format!("http://{name}"), None)
            };
            match Node::new(&NodeAddr { name, url }, &self.clients, pin) {
                Ok(n) => nodes.push(Arc::new(n)),
                Err(e) => {
                    tracing::warn!(node = %a, error = %e, "node discovery: cannot make a client")
                }
            }
        }
        for n in nodes.iter() {
            if !addrs.iter().any(|a| a.to_string() == n.name) {
                n.mark_down(format!("no longer among the DNS records of {host}"));
            }
        }
    }

    pub fn node(&self, name: &str) -> Option<Arc<Node>> {
        self.nodes().into_iter().find(|n| n.name == name)
    }

    /// The node that minted `id`, read from its token, when exactly one
    /// node has that token (two names may share one: then nodes are asked).
    fn owner_by_token(&self, id: &str) -> Option<Arc<Node>> {
        let token = forkd_api::ids::id_token(id)?;
        let mut owners = self
            .nodes()
            .into_iter()
            .filter(|n| n.id_token().as_deref() == Some(token));
        let first = owners.next()?;
        owners.next().is_none().then_some(first)
    }

    pub fn remember(&self, id: &str, node: &str) {
        let mut ids = self.ids.lock().unwrap();
        if ids.len() >= ID_CACHE_MAX {
            ids.clear();
        }
        ids.insert(id.to_string(), node.to_string());
    }

    pub fn forget(&self, id: &str) {
        self.ids.lock().unwrap().remove(id);
    }

    /// The node holding sandbox `id`: the cache's answer, else the one node
    /// whose token the id carries (410 if that node is down), else whichever
    /// healthy node knows the id.
    pub async fn locate(&self, id: &str) -> Result<Arc<Node>, GatewayError> {
        let cached = self.ids.lock().unwrap().get(id).cloned();
        let known = cached
            .and_then(|name| self.node(&name))
            .or_else(|| self.owner_by_token(id));
        if let Some(node) = known {
            return match node.health() {
                Health::Down { why, .. } => Err(GatewayError::SandboxNodeDown {
                    id: id.to_string(),
                    node: node.name.clone(),
                    why,
                }),
                _ => {
                    self.remember(id, &node.name);
                    Ok(node)
                }
            };
        }
        let path = format!("/v1/sandboxes/{id}");
        let asks = self.up_nodes().into_iter().map(|n| {
            let path = path.clone();
            async move {
                let r = n
                    .call(Bound::Whole, reqwest::Method::GET, &path)
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().is_success() => Some(n),
                    _ => None,
                }
            }
        });
        let found = futures::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .next();
        match found {
            Some(n) => {
                self.remember(id, &n.name);
                Ok(n)
            }
            None => Err(GatewayError::SandboxNotFound {
                id: id.to_string(),
                down: self.down(),
            }),
        }
    }
}

/// What every node's clients are made with.
#[derive(Debug, Clone)]
struct ClientConfig {
    timeout: Duration,
    token: Option<String>,
    /// PEM: the CA that signed the nodes' certificates.
    ca_cert: Option<Vec<u8>>,
}

/// Polls forever at the configured interval.
pub async fn poll_forever(reg: Arc<Registry>) {
    loop {
        tokio::time::sleep(reg.poll_interval).await;
        reg.poll_once().await;
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// An error with its causes ("error sending request: connection refused").
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod connect_tests {
    use super::*;

    /// A node found by DNS over https is connected to at its own address
    /// under the Service's name, as its clients are; others by name.
    #[test]
    fn own_connections_go_where_the_clients_go() {
        let cfg = ClientConfig {
            timeout: Duration::from_secs(1),
            token: None,
            ca_cert: None,
        };
        let a = NodeAddr {
            name: "10.0.0.7:8443".into(),
            url: "https://poold.forkd.svc:8443".into(),
        };
        let pinned = Node::new(
            &a,
            &cfg,
            Some(("poold.forkd.svc", "10.0.0.7:8443".parse().unwrap())),
        )
        .unwrap();
        assert_eq!(
            pinned
                .connect_addr("http://poold.forkd.svc:3001")
                .as_deref(),
            Some("10.0.0.7:3001")
        );
        assert_eq!(
            pinned.connect_addr("http://other.example:3001").as_deref(),
            Some("other.example:3001")
        );
        let plain = Node::new(&a, &cfg, None).unwrap();
        assert_eq!(
            plain.connect_addr("http://10.0.0.8:3001").as_deref(),
            Some("10.0.0.8:3001")
        );
        assert_eq!(plain.connect_addr("not a url"), None);
    }
}
