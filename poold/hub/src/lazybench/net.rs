//! The network of the hub benches, all on this machine: a namespace for
//! the hub (s3s-fs on its loopback, delaying proxies in front of it) and
//! one per host, each joined to the hub's by its own veth pair, so each
//! host has a link of its own to shape.
//!
//! Invariants: every namespace and link a [`Net`] made is removed when it
//! is dropped, also after a failed setup; addresses stay inside
//! 10.254.0.0/16, on links that exist only between these namespaces.

use super::S3_PORT;
use anyhow::{anyhow, bail, Context, Result};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Most hosts one [`Net`] links (a /30 each in one /24).
pub(super) const MAX_HOSTS: usize = 63;

/// The namespaces and links of one bench, removed when dropped.
pub(super) struct Net {
    /// The hub's namespace.
    pub hub: String,
    /// The hosts' namespaces, host `i` at index `i`.
    hosts: Vec<String>,
    sfx: String,
    /// Third octet of the 10.254.X.0/24 the links use.
    octet: u8,
}

impl Net {
    /// `hosts` namespaces, each linked to the hub's; names end in `sfx`.
    pub fn new(sfx: &str, hosts: usize) -> Result<Net> {
        if hosts == 0 || hosts > MAX_HOSTS {
            bail!("a bench network links 1 to {MAX_HOSTS} hosts, not {hosts}");
        }
        let octet = 1 + (u32::from_str_radix(&sfx[..2], 16).unwrap_or(0) % 250) as u8;
        let mut net = Net {
            hub: format!("fkbh-{sfx}"),
            hosts: Vec::new(),
            sfx: sfx.to_string(),
            octet,
        };
        ip(&["netns", "add", &net.hub])?;
        ip(&["-n", &net.hub, "link", "set", "lo", "up"])?;
        for i in 0..hosts {
            let ns = format!("fkb{i}-{sfx}");
            ip(&["netns", "add", &ns])?;
            net.hosts.push(ns.clone());
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let (h, b) = net.veth(i);
            ip(&["link", "add", &h, "type", "veth", "peer", "name", &b])?;
            ip(&["link", "set", &h, "netns", &net.hub])?;
            ip(&["link", "set", &b, "netns", &ns])?;
            let base = 4 * i;
            let hub_addr = format!("10.254.{octet}.{}/30", base + 1);
            ip(&["-n", &net.hub, "addr", "add", &hub_addr, "dev", &h])?;
            let host_addr = format!("10.254.{octet}.{}/30", base + 2);
            ip(&["-n", &ns, "addr", "add", &host_addr, "dev", &b])?;
            ip(&["-n", &net.hub, "link", "set", &h, "up"])?;
            ip(&["-n", &ns, "link", "set", &b, "up"])?;
        }
        Ok(net)
    }

    /// Host `i`'s namespace.
    pub fn host(&self, i: usize) -> &str {
        &self.hosts[i]
    }

    /// The veth pair of host `i`: (hub end, host end).
    fn veth(&self, i: usize) -> (String, String) {
        (format!("fkh{i}{}", self.sfx), format!("fkb{i}{}", self.sfx))
    }

    /// The hub's address on host `i`'s link.
    pub fn hub_ip(&self, i: usize) -> String {
        format!("10.254.{}.{}", self.octet, 4 * i + 1)
    }

    /// tc tbf at `mbit` on both ends of host `i`'s link.
    pub fn shape(&self, i: usize, mbit: u32) -> Result<()> {
        let (h, b) = self.veth(i);
        for (ns, dev) in [(self.hub.as_str(), h), (self.host(i), b)] {
            let status = Command::new("ip")
                .args([
                    "netns", "exec", ns, "tc", "qdisc", "add", "dev", &dev, "root",
                ])
                .args(["tbf", "rate", &format!("{mbit}mbit"), "burst", "128kb"])
                .args(["latency", "50ms"])
                .status()?;
            if !status.success() {
                bail!("tc tbf on {dev} in {ns} failed (is sch_tbf available?)");
            }
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain([&self.hub]) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

pub(super) fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Waits until something listens on `port` on the loopback of `ns`.
pub(super) fn wait_port(ns: &str, port: u16) -> Result<()> {
    let start = Instant::now();
    loop {
        let ok = in_netns(ns, move || {
            Ok(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
        })?;
        if ok {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(20) {
            bail!("nothing listens on port {port} in {ns} after 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `f` on a thread that joined network namespace `ns` (sockets it
/// makes stay in that namespace).
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
        nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)
            .with_context(|| format!("joining {path}"))?;
        f()
    })
    .join()
    .map_err(|_| anyhow!("a netns thread panicked"))?
}

/// A child process killed when dropped.
pub(super) struct Proc(Child);

impl Proc {
    pub fn spawn(c: &mut Command) -> Result<Proc> {
        Ok(Proc(
            c.stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting a bench process")?,
        ))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A TCP proxy in the hub's namespace, from `0.0.0.0:port` to s3s-fs,
/// holding every piece of data `delay` in each direction (order kept, so
/// throughput is unchanged and each round trip gains twice `delay`).
pub(super) struct DelayProxy {
    stop: tokio::sync::watch::Sender<bool>,
}

impl DelayProxy {
    pub fn start(ns: &str, port: u16, delay: Duration) -> Result<DelayProxy> {
        let (stop, rx) = tokio::sync::watch::channel(false);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let path = format!("/run/netns/{ns}");
        std::thread::Builder::new()
            .name(format!("delay-proxy-{port}"))
            .spawn(move || {
                let run = || -> Result<()> {
                    let fd = std::fs::File::open(&path)?;
                    nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)?;
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    rt.block_on(proxy(port, delay, rx, ready_tx.clone()))
                };
                if let Err(e) = run() {
                    let _ = ready_tx.send(Err(format!("{e:#}")));
                }
            })?;
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => Ok(DelayProxy { stop }),
            Ok(Err(e)) => bail!("the delaying proxy did not start: {e}"),
            Err(_) => bail!("the delaying proxy did not start within 10 s"),
        }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn proxy(
    port: u16,
    delay: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
    ready: std::sync::mpsc::Sender<std::result::Result<(), String>>,
) -> Result<()> {
    let l = tokio::net::TcpListener::bind(("0.0.0.0", port)).await?;
    let _ = ready.send(Ok(()));
    loop {
        tokio::select! {
            _ = stop.changed() => return Ok(()),
            a = l.accept() => {
                let (client, _) = a?;
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", S3_PORT)).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, delay), pipe(sr, cw, delay));
                });
            }
        }
    }
}

/// Copies `r` to `w`, each piece of data written `delay` after it was read.
async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(4096);
    let reader = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let due = tokio::time::Instant::now() + delay;
                    if tx.send((due, buf[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, b)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if w.write_all(&b).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}
