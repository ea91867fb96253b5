//! Creating, changing and removing children's networks, the host's shared
//! rules, and reconciling after a crash. See the crate docs for the
//! invariants.

use crate::netlink::{self, with_handle};
use crate::policy::{Baseline, EgressPolicy, ResolvedPolicy};
use crate::{
    host_link, netns, nft, pool::AddrPool, ChildNet, NetError, Result, GATEWAY, GUEST_PREFIX,
    HOST_VETH_PREFIX, NS_VETH, PEER_VETH_PREFIX, TAP, TAP_MAC,
};
use ipnet::Ipv4Net;
use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, Ordering};

/// Where the next slot search starts (a hint; the kernel arbitrates).
static NEXT_SLOT: AtomicU32 = AtomicU32::new(0);

/// What [`host_setup`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSetup {
    /// Interfaces of the default routes; the child range is masqueraded
    /// only when leaving through them.
    pub uplinks: Vec<String>,
    /// The upstream DNS servers children are given.
    pub resolvers: Vec<Ipv4Addr>,
}

/// Prepares the root namespace: turns on IPv4 forwarding and (re)writes
/// `table inet forkd`. Idempotent; keeps the `host_allow` elements of live
/// children.
pub fn host_setup(pool: &AddrPool) -> Result<HostSetup> {
    netns::sysctl("net.ipv4.ip_forward", "1")?;
    let uplinks = with_handle(None, |h| async move { netlink::uplinks(&h).await })?;
    let resolvers = upstream_resolvers();
    nft::apply(
        None,
        &nft::host_ruleset(pool.net(), &uplinks, &resolvers),
        "writing the host's table inet forkd",
    )?;
    Ok(HostSetup { uplinks, resolvers })
}

/// The host's upstream IPv4 resolvers: /etc/resolv.conf (or the file
/// `$FORKD_RESOLV_CONF` names: resolvers meant for sandboxes only, and
/// tests), or systemd-resolved's upstream list when that file names only a
/// loopback stub. Loopback entries are dropped (a guest cannot reach the
/// host's loopback).
pub fn upstream_resolvers() -> Vec<Ipv4Addr> {
    let parse = |path: &str| -> Vec<Ipv4Addr> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("nameserver"))
            .filter_map(|a| a.trim().parse::<Ipv4Addr>().ok())
            .collect()
    };
    let file = std::env::var("FORKD_RESOLV_CONF").unwrap_or_else(|_| "/etc/resolv.conf".into());
    let etc = parse(&file);
    let chosen = if !etc.is_empty() && etc.iter().all(|a| a.is_loopback()) {
        parse("/run/systemd/resolve/resolv.conf")
    } else {
        etc
    };
    chosen.into_iter().filter(|a| !a.is_loopback()).collect()
}

/// Creates namespace `name` holding only loopback and the tap, with the
/// guest-side addressing and no way out: for a snapshot's parent, whose
/// guest needs its NIC at boot but no network.
pub fn create_isolated(name: &str) -> Result<()> {
    netns::create(name)?;
    let r = inner_side(name);
    if r.is_err() {
        let _ = netns::delete(name);
    }
    r
}

/// Removes a namespace made by [`create_isolated`]; a missing one is fine.
pub fn delete_isolated(name: &str) -> Result<()> {
    netns::delete(name)
}

/// Loopback and tap0 (fixed MAC, the gateway address), forwarding on.
fn inner_side(name: &str) -> Result<()> {
    netns::run_in(name, || {
        crate::tap::create_persistent(TAP)?;
        netns::sysctl("net.ipv4.ip_forward", "1")?;
        netns::sysctl("net.ipv6.conf.all.disable_ipv6", "1")?;
        Ok(())
    })?;
    with_handle(Some(name), |h| async move {
        netlink::configure(&h, "lo", None, None, None).await?;
        netlink::configure(&h, TAP, None, Some(TAP_MAC), Some((GATEWAY, GUEST_PREFIX))).await?;
        Ok(())
    })
}

/// Creates the network of VM `vm_id`: its namespace with the tap and one end
/// of a veth pair, the other end in the root namespace, addresses from
/// `pool`, and a deny-all policy until [`apply_policy`] sets the real one.
/// On failure nothing is left behind.
pub fn create_child(pool: &AddrPool, scope: &str, vm_id: &str) -> Result<ChildNet> {
    let name = crate::netns_name(scope, vm_id);
    netns::create(&name)?;
    let mut slot_taken = None;
    let r = (|| {
        inner_side(&name)?;
        let slot = claim_slot(pool)?;
        slot_taken = Some(slot);
        let (host_addr, guest_addr) = pool.addrs(slot).ok_or_else(|| pool.exhausted())?;
        let net = ChildNet {
            netns: name.clone(),
            slot,
            host_addr,
            guest_addr,
        };
        wire(&net)?;
        apply_policy(&net, &EgressPolicy::deny_all(), &Baseline::default())?;
        Ok(net)
    })();
    if r.is_err() {
        let _ = netns::delete(&name);
        if let Some(slot) = slot_taken {
            let link = host_link(slot);
            let _ = with_handle(None, move |h| async move {
                netlink::delete_link(&h, &link).await
            });
        }
    }
    r
}

/// Claims a free slot by creating its veth pair (`fkh<i>` / `fkp<i>`).
fn claim_slot(pool: &AddrPool) -> Result<u32> {
    let pool = *pool;
    let slots = pool.slots();
    let start = NEXT_SLOT.load(Ordering::Relaxed) % slots;
    with_handle(None, move |h| async move {
        for k in 0..slots {
            let slot = (start + k) % slots;
            if netlink::create_veth(&h, &host_link(slot), &peer_link(slot)).await? {
                NEXT_SLOT.store(slot + 1, Ordering::Relaxed);
                return Ok(slot);
            }
        }
        Err(pool.exhausted())
    })
}

fn peer_link(slot: u32) -> String {
    format!("{PEER_VETH_PREFIX}{slot}")
}

/// Moves the peer into the namespace as eth0 and addresses both ends.
fn wire(net: &ChildNet) -> Result<()> {
    let ns = netns::open(&net.netns)?;
    let (host, peer, a) = (net.host_link(), peer_link(net.slot), net.host_addr);
    with_handle(None, move |h| async move {
        netlink::move_to_netns(&h, &peer, &ns).await?;
        netlink::configure(&h, &host, None, None, Some((a, 30))).await?;
        Ok(())
    })?;
    let (peer, b) = (peer_link(net.slot), net.guest_addr);
    with_handle(Some(&net.netns), move |h| async move {
        netlink::configure(&h, &peer, Some(NS_VETH), None, Some((b, 30))).await?;
        netlink::default_route(&h, a).await
    })
}

/// Sets the child's egress policy on top of the host's `base` (internal
/// ranges, resolvers), replacing the previous one atomically, and lets it
/// reach the host addresses its allow list names. Domain names are
/// resolved here ([`EgressPolicy::resolve`]), blocking the calling thread.
pub fn apply_policy(net: &ChildNet, policy: &EgressPolicy, base: &Baseline) -> Result<()> {
    policy.validate()?;
    let resolved = {
        let p = policy.clone();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| NetError::io("starting a resolver runtime", e))?
                .block_on(p.resolve())
        })
        .join()
        .unwrap_or_else(|_| Err(NetError::Invalid("resolver thread panicked".into())))?
    };
    apply_resolved(net, &resolved, base)
}

/// [`apply_policy`] of a policy already resolved. In this order, so the
/// guest reaches at most what the old or the new policy allows at every
/// step: the `host_allow` elements the new policy lacks go first (the root
/// namespace's gate to host addresses), then the child's table is
/// replaced (one transaction), then the new elements are added.
pub fn apply_resolved(net: &ChildNet, resolved: &ResolvedPolicy, base: &Baseline) -> Result<()> {
    let link = net.host_link();
    remove_host_allows(&|l, n| l == link && !resolved.allow.contains(&n))?;
    nft::apply(
        Some(&net.netns),
        &nft::child_ruleset(resolved, base),
        &format!("writing the egress policy of {}", net.netns),
    )?;
    if !resolved.allow.is_empty() {
        let elems: Vec<String> = resolved
            .allow
            .iter()
            .map(|n| nft::host_allow_element(&link, *n))
            .collect();
        nft::apply(
            None,
            &format!(
                "add element inet forkd host_allow {{ {} }}\n",
                elems.join(", ")
            ),
            "letting a child reach allowed host addresses",
        )?;
    }
    Ok(())
}

/// Removes everything of the child: its namespace (with the veth pair, the
/// tap and its table), the root-side link if it survived, and its
/// `host_allow` elements. Missing pieces are not errors.
pub fn teardown(net: &ChildNet) -> Result<()> {
    netns::delete(&net.netns)?;
    let link = net.host_link();
    with_handle(None, move |h| async move {
        netlink::delete_link(&h, &link).await
    })?;
    remove_host_allows(&|l, _| l == net.host_link())
}

/// Deletes the `host_allow` elements (interface, network) `which` picks.
fn remove_host_allows(which: &dyn Fn(&str, Ipv4Net) -> bool) -> Result<()> {
    let out = match nft::run(
        None,
        &["-j", "list", "set", "inet", "forkd", "host_allow"],
        "",
        "listing host_allow",
    ) {
        Ok(o) => o,
        // No table yet: nothing to remove.
        Err(NetError::Nft { .. }) => return Ok(()),
        Err(e) => return Err(e),
    };
    let doomed: Vec<String> = host_allow_elements(&out)
        .into_iter()
        .filter(|(l, n)| which(l, *n))
        .map(|(l, n)| nft::host_allow_element(&l, n))
        .collect();
    if doomed.is_empty() {
        return Ok(());
    }
    nft::apply(
        None,
        &format!(
            "delete element inet forkd host_allow {{ {} }}\n",
            doomed.join(", ")
        ),
        "removing host_allow elements",
    )
}

/// Parses `nft -j list set` output into (interface, network) pairs.
fn host_allow_elements(json: &str) -> Vec<(String, Ipv4Net)> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    let mut out = Vec::new();
    let sets = v["nftables"].as_array().cloned().unwrap_or_default();
    for s in sets {
        for e in s["set"]["elem"].as_array().cloned().unwrap_or_default() {
            let c = e.get("elem").map(|x| &x["val"]).unwrap_or(&e);
            let Some(parts) = c["concat"].as_array() else {
                continue;
            };
            let (Some(l), Some(a)) = (parts.first().and_then(|x| x.as_str()), parts.get(1)) else {
                continue;
            };
            let net = if let Some(s) = a.as_str() {
                s.parse::<Ipv4Addr>().ok().map(Ipv4Net::from)
            } else if let Some(p) = a.get("prefix") {
                p["addr"]
                    .as_str()
                    .and_then(|x| x.parse::<Ipv4Addr>().ok())
                    .and_then(|x| Ipv4Net::new(x, p["len"].as_u64()? as u8).ok())
            } else {
                None
            };
            if let Some(n) = net {
                out.push((l.to_string(), n));
            }
        }
    }
    out
}

/// What [`reconcile`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reconciled {
    /// Namespaces removed (no live child owned them).
    pub namespaces: Vec<String>,
    /// Host-side links removed.
    pub links: Vec<String>,
    /// Host allow rules removed.
    pub host_allows: usize,
}

/// Removes every `forkd-*` namespace, `fkh*` link and `host_allow` element
/// that no child in `owned` has (after a crash or kill -9). `owned` is every
/// child network recorded as alive.
pub fn reconcile(scope: &str, owned: &[ChildNet]) -> Result<Reconciled> {
    let names: HashSet<&str> = owned.iter().map(|n| n.netns.as_str()).collect();
    let mut done = Reconciled::default();
    // This instance's namespaces that no live VM of it records; its tap and
    // nftables table die with it.
    for ns in netns::list(&crate::netns_name(scope, "")) {
        if !names.contains(ns.as_str()) {
            // The kernel frees a namespace's links lazily; deleting the
            // veth end inside it takes the root-side end at once.
            let inner = ns.clone();
            let _ = with_handle(Some(&inner), |h| async move {
                netlink::delete_link(&h, NS_VETH).await
            });
            netns::delete(&ns)?;
            done.namespaces.push(ns);
        }
    }
    // Any instance's boot namespace is unnamed within milliseconds of its
    // QEMU starting; one older than a minute is a crash's leftover.
    for ns in netns::list(crate::BOOT_NETNS_PREFIX) {
        let old = std::fs::metadata(netns::netns_path(&ns))
            .and_then(|m| m.modified())
            .map(|t| t.elapsed().unwrap_or_default() > std::time::Duration::from_secs(60))
            .unwrap_or(true);
        if old {
            netns::delete(&ns)?;
            done.namespaces.push(ns);
        }
    }
    // A pair whose namespace side is still in the root namespace was never
    // wired (a crash between claiming the slot and moving it): nobody's.
    done.links = with_handle(None, move |h| async move {
        let peers: HashSet<String> = netlink::links_with_prefix(&h, PEER_VETH_PREFIX)
            .await?
            .into_iter()
            .collect();
        let mut removed = Vec::new();
        for l in netlink::links_with_prefix(&h, HOST_VETH_PREFIX).await? {
            let slot = &l[HOST_VETH_PREFIX.len()..];
            if peers.contains(&format!("{PEER_VETH_PREFIX}{slot}")) {
                netlink::delete_link(&h, &l).await?;
                removed.push(l);
            }
        }
        Ok(removed)
    })?;
    // Set elements whose link is gone, whoever made them.
    let live: HashSet<String> = with_handle(None, |h| async move {
        netlink::links_with_prefix(&h, HOST_VETH_PREFIX).await
    })?
    .into_iter()
    .collect();
    let before = count_host_allows();
    remove_host_allows(&|l, _| !live.contains(l))?;
    done.host_allows = before.saturating_sub(count_host_allows());
    Ok(done)
}

fn count_host_allows() -> usize {
    nft::run(
        None,
        &["-j", "list", "set", "inet", "forkd", "host_allow"],
        "",
        "listing host_allow",
    )
    .map(|o| host_allow_elements(&o).len())
    .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_allow_json_parses() {
        let j = r#"{"nftables":[{"metainfo":{}},{"set":{"family":"inet","name":"host_allow","table":"forkd","type":["ifname","ipv4_addr"],"flags":["interval"],"elem":[{"concat":["fkh3","192.0.2.1"]},{"concat":["fkh4",{"prefix":{"addr":"10.0.0.0","len":8}}]}]}}]}"#;
        assert_eq!(
            host_allow_elements(j),
            vec![
                ("fkh3".to_string(), "192.0.2.1/32".parse().unwrap()),
                ("fkh4".to_string(), "10.0.0.0/8".parse().unwrap())
            ]
        );
    }
}
