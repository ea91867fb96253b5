//! nftables rulesets, applied with `nft -f -` as one atomic transaction
//! each. Everything written here comes from typed values (addresses, CIDRs,
//! slot numbers, fixed interface names); no request text reaches `nft`.
//!
//! Two places hold rules:
//! - the root namespace's `table inet forkd` ([`host_ruleset`]), shared by
//!   every child and re-applied idempotently at start-up: masquerade of the
//!   child range towards the uplinks only, no child↔child traffic, nothing
//!   from a child to any address of the host (matched by the kernel's own
//!   routing table, `fib daddr type local`, so an address added later is
//!   covered too) unless `host_allow` lets it;
//! - `table inet forkd` inside each child's namespace ([`child_ruleset`]),
//!   which dies with the namespace: DNAT to the guest, SNAT to the child's
//!   address, and the egress policy.

use crate::policy::{Baseline, ResolvedPolicy};
use crate::{NetError, Result, GUEST_ADDR, HOST_VETH_PREFIX, NS_VETH, TAP};
use ipnet::Ipv4Net;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};

/// The `nft` binary: `$FORKD_NFT` or `nft` on PATH.
fn nft_binary() -> std::ffi::OsString {
    std::env::var_os("FORKD_NFT").unwrap_or_else(|| "nft".into())
}

/// Runs `nft` with `args`, feeding `script` on stdin, in namespace `ns`
/// (the caller's when None). Returns stdout.
pub(crate) fn run(ns: Option<&str>, args: &[&str], script: &str, what: &str) -> Result<String> {
    let mut cmd = Command::new(nft_binary());
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let ns_file = ns.map(crate::netns::open).transpose()?;
    if let Some(f) = &ns_file {
        let fd = f.as_raw_fd();
        // SAFETY: setns is async-signal-safe; `fd` stays open in the parent
        // (and so in the child) until spawn returns.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::setns(fd, libc::CLONE_NEWNET) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().map_err(|e| NetError::Nft {
        what: what.into(),
        stderr: format!("cannot run {:?}: {e}", nft_binary()),
    })?;
    drop(ns_file);
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(script.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| NetError::io(format!("waiting for nft ({what})"), e))?;
    if !out.status.success() {
        return Err(NetError::Nft {
            what: what.into(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Applies `script` in namespace `ns`.
pub(crate) fn apply(ns: Option<&str>, script: &str, what: &str) -> Result<()> {
    run(ns, &["-f", "-"], script, what).map(drop)
}

fn set_elements(nets: &[Ipv4Net]) -> String {
    if nets.is_empty() {
        return String::new();
    }
    let list: Vec<String> = nets.iter().map(|n| n.to_string()).collect();
    format!("elements = {{ {} }}", list.join(", "))
}

/// The root namespace's table. `range` is the child address range,
/// `uplinks` the interfaces of the default routes, `resolvers` the upstream
/// DNS servers (a child may query one that is an address of the host).
///
/// A child's packet to the host is stopped twice: in `prerouting`, before
/// any DNAT (a host's port forwarding would otherwise turn it into
/// forwarded traffic to a container), where `fib daddr type` asks the
/// kernel whether the destination is one of the host's addresses *now* —
/// on any interface, added at any time; and in `input`, for anything that
/// still arrives. Replies to connections the host opened (the port proxy,
/// the agent at `guest_addr:8888`) pass both.
pub(crate) fn host_ruleset(range: Ipv4Net, uplinks: &[String], resolvers: &[Ipv4Addr]) -> String {
    let fkh = format!("\"{HOST_VETH_PREFIX}*\"");
    let mut s = String::new();
    s.push_str("add table inet forkd\n");
    s.push_str("add set inet forkd host_allow { type ifname . ipv4_addr; flags interval; }\n");
    s.push_str("add set inet forkd host_dns { type ipv4_addr; flags interval; }\nflush set inet forkd host_dns\n");
    if !resolvers.is_empty() {
        let dns: Vec<Ipv4Net> = resolvers.iter().map(|a| Ipv4Net::from(*a)).collect();
        s.push_str(&format!(
            "add element inet forkd host_dns {{ {} }}\n",
            dns.iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    for (chain, hook, prio) in [
        ("prerouting", "filter hook prerouting", "-150"),
        ("input", "filter hook input", "-10"),
        ("forward", "filter hook forward", "-10"),
        ("postrouting", "nat hook postrouting", "110"),
    ] {
        s.push_str(&format!(
            "add chain inet forkd {chain} {{ type {hook} priority {prio}; policy accept; }}\nflush chain inet forkd {chain}\n"
        ));
    }
    // From a child to the host itself: only replies, explicit allows and
    // DNS to a resolver that is the host. Checked before DNAT (prerouting)
    // and again on delivery (input).
    let host_open = format!(
        "iifname {fkh} ct state established,related accept\n\
         iifname {fkh} meta nfproto ipv4 iifname . ip daddr @host_allow accept\n\
         iifname {fkh} ip daddr @host_dns udp dport 53 accept\n\
         iifname {fkh} ip daddr @host_dns tcp dport 53 accept\n"
    );
    for line in host_open.lines() {
        s.push_str(&format!("add rule inet forkd prerouting {line}\n"));
        s.push_str(&format!("add rule inet forkd input {line}\n"));
    }
    s.push_str(&format!(
        "add rule inet forkd prerouting iifname {fkh} meta nfproto ipv6 drop\n\
         add rule inet forkd prerouting iifname {fkh} fib daddr type {{ local, broadcast, multicast }} drop\n\
         add rule inet forkd input iifname {fkh} drop\n"
    ));
    // Between children, and from elsewhere into a child: dropped.
    s.push_str(&format!(
        "add rule inet forkd forward iifname {fkh} oifname {fkh} drop\n\
         add rule inet forkd forward iifname {fkh} meta nfproto ipv6 drop\n\
         add rule inet forkd forward oifname {fkh} ct state established,related accept\n\
         add rule inet forkd forward oifname {fkh} drop\n"
    ));
    if !uplinks.is_empty() {
        let ups: Vec<String> = uplinks.iter().map(|u| format!("\"{u}\"")).collect();
        s.push_str(&format!(
            "add rule inet forkd postrouting ip saddr {range} oifname {{ {} }} masquerade\n",
            ups.join(", ")
        ));
    }
    s
}

/// The root-namespace set element letting `link` reach host address `net`.
pub(crate) fn host_allow_element(link: &str, net: Ipv4Net) -> String {
    format!("\"{link}\" . {net}")
}

/// A child namespace's table for `policy`, on top of what holds for every
/// child (`base`: the internal ranges, the upstream resolvers).
pub(crate) fn child_ruleset(policy: &ResolvedPolicy, base: &Baseline) -> String {
    let mut s = String::new();
    // Re-applying replaces the whole table atomically.
    s.push_str("table inet forkd {}\ndelete table inet forkd\n");
    s.push_str("table inet forkd {\n");
    s.push_str(&format!(
        "  set allow {{ type ipv4_addr; flags interval; auto-merge; {} }}\n",
        set_elements(&policy.allow)
    ));
    s.push_str(&format!(
        "  set deny {{ type ipv4_addr; flags interval; auto-merge; {} }}\n",
        set_elements(&policy.deny)
    ));
    s.push_str(&format!(
        "  set internal {{ type ipv4_addr; flags interval; auto-merge; {} }}\n",
        set_elements(&base.internal)
    ));
    let dns: Vec<Ipv4Net> = base.resolvers.iter().map(|a| Ipv4Net::from(*a)).collect();
    s.push_str(&format!(
        "  set dns {{ type ipv4_addr; flags interval; auto-merge; {} }}\n",
        set_elements(if policy.dns { &dns } else { &[] })
    ));
    s.push_str(&format!(
        "  chain prerouting {{ type nat hook prerouting priority -100; policy accept;\n\
         \x20   iifname \"{NS_VETH}\" meta nfproto ipv4 dnat ip to {GUEST_ADDR}\n  }}\n"
    ));
    s.push_str(&format!(
        "  chain postrouting {{ type nat hook postrouting priority 100; policy accept;\n\
         \x20   oifname \"{NS_VETH}\" masquerade\n  }}\n"
    ));
    s.push_str(&format!(
        "  chain input {{ type filter hook input priority 0; policy accept;\n\
         \x20   iifname \"{TAP}\" ct state established,related accept\n\
         \x20   iifname \"{TAP}\" drop\n  }}\n"
    ));
    s.push_str(&format!(
        "  chain forward {{ type filter hook forward priority 0; policy drop;\n\
         \x20   ct state established,related accept\n\
         \x20   iifname \"{NS_VETH}\" oifname \"{TAP}\" ct status dnat accept\n\
         \x20   iifname \"{TAP}\" oifname \"{NS_VETH}\" meta nfproto ipv4 jump egress\n  }}\n"
    ));
    s.push_str(
        "  chain egress {\n\
         \x20   ip daddr @allow accept\n\
         \x20   ip daddr @dns udp dport 53 accept\n\
         \x20   ip daddr @dns tcp dport 53 accept\n\
         \x20   ip daddr @internal drop\n\
         \x20   ip daddr @deny drop\n\
         \x20   accept\n  }\n",
    );
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_ruleset_lists_policy_sets() {
        let p = ResolvedPolicy {
            allow: vec!["192.0.2.7/32".parse().unwrap()],
            deny: vec!["0.0.0.0/0".parse().unwrap()],
            dns: false,
        };
        let base = Baseline::new(&[], vec!["198.51.100.53".parse().unwrap()]);
        let s = child_ruleset(&p, &base);
        assert!(s.contains(
            "set allow { type ipv4_addr; flags interval; auto-merge; elements = { 192.0.2.7/32 } }"
        ));
        assert!(s.contains("elements = { 0.0.0.0/0 }"));
        assert!(!s.contains("198.51.100.53"), "DNS must be closed: {s}");
        assert!(s.contains("dnat ip to 10.42.0.2"));
    }

    #[test]
    fn child_ruleset_denies_internal_ranges_after_allow_and_dns() {
        let p = ResolvedPolicy {
            dns: true,
            ..Default::default()
        };
        let base = Baseline::new(
            &["44.0.0.0/8".parse().unwrap()],
            vec!["10.0.0.53".parse().unwrap()],
        );
        let s = child_ruleset(&p, &base);
        for r in [
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
            "44.0.0.0/8",
        ] {
            assert!(s.contains(r), "{r} missing: {s}");
        }
        let at = |needle: &str| s.find(needle).unwrap_or_else(|| panic!("{needle}: {s}"));
        assert!(at("ip daddr @allow accept") < at("ip daddr @dns udp dport 53 accept"));
        assert!(at("ip daddr @dns tcp dport 53 accept") < at("ip daddr @internal drop"));
        assert!(at("ip daddr @internal drop") < at("ip daddr @deny drop"));
        assert!(s.contains(
            "set dns { type ipv4_addr; flags interval; auto-merge; elements = { 10.0.0.53/32 } }"
        ));
    }

    #[test]
    fn host_ruleset_masquerades_only_towards_uplinks() {
        let s = host_ruleset("10.201.0.0/16".parse().unwrap(), &["eth0".into()], &[]);
        assert!(s.contains("ip saddr 10.201.0.0/16 oifname { \"eth0\" } masquerade"));
        assert!(!host_ruleset("10.201.0.0/16".parse().unwrap(), &[], &[]).contains("masquerade"));
    }

    #[test]
    fn host_ruleset_guards_every_host_address_before_dnat() {
        let s = host_ruleset(
            "10.201.0.0/16".parse().unwrap(),
            &[],
            &["192.168.1.1".parse().unwrap()],
        );
        assert!(
            s.contains("type filter hook prerouting priority -150"),
            "{s}"
        );
        assert!(s.contains(
            "add rule inet forkd prerouting iifname \"fkh*\" fib daddr type { local, broadcast, multicast } drop"
        ));
        assert!(s.contains("add element inet forkd host_dns { 192.168.1.1/32 }"));
        // Replies and explicit allows come first in both chains.
        for chain in ["prerouting", "input"] {
            let allow = s
                .find(&format!("add rule inet forkd {chain} iifname \"fkh*\" meta nfproto ipv4 iifname . ip daddr @host_allow accept"))
                .unwrap();
            let drop = s
                .rfind(&format!("add rule inet forkd {chain} iifname \"fkh*\""))
                .unwrap();
            assert!(allow < drop, "{chain}: {s}");
        }
    }
}
