//! Egress policy: what a child may reach outside its namespace.
//!
//! The shape follows E2B's `allowOut`/`denyOut`: two lists of targets, each
//! an IPv4 address, a CIDR or a domain name. Evaluated per new connection,
//! in this order (first match wins):
//!
//! 1. replies to connections already allowed (conntrack);
//! 2. a destination in `allow_out` → allowed (the only way to reach an
//!    internal range, the host itself, its loopback or link-local metadata);
//! 3. DNS (port 53) to the host's upstream resolvers → allowed unless the
//!    policy denies everything and allows nothing ([`EgressPolicy::dns_allowed`]),
//!    even where a resolver sits in an internal range;
//! 4. an internal range ([`INTERNAL_RANGES`], plus the operator's extra
//!    ranges in [`Baseline`]) → dropped;
//! 5. a destination in `deny_out` → dropped;
//! 6. everything else (the public internet) → allowed.
//!
//! The host's own addresses, on every interface and whenever they were
//! added, are denied in the root namespace (`fib daddr type local`, see
//! `nft::host_ruleset`) unless `allow_out` names them, whatever range they
//! are in. So the empty policy (the default) reaches the public internet
//! and nothing internal; "deny all" is `deny_out: ["0.0.0.0/0"]`; an
//! allow-list is `deny_out: ["0.0.0.0/0"], allow_out: [...]`. Domain names
//! are resolved once, when the policy is applied (hand-out); TTLs are not
//! followed. Children have no IPv6 (their namespaces disable it and the
//! root namespace drops theirs), so every range here is IPv4.

use crate::{NetError, Result};
use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;

/// Most entries a list may hold (each becomes a set element).
pub const MAX_TARGETS: usize = 256;

/// Destinations every child is denied unless its `allow_out` names them:
/// every block of IANA's IPv4 special-purpose registry that is not
/// globally reachable (RFC 6890 and its updates), with why. Private
/// networks, carrier-grade NAT, loopback, link-local (cloud metadata at
/// 169.254.169.254), documentation, benchmarking, multicast, reserved and
/// broadcast: what a sandbox could only use to reach its operator's
/// networks (or nothing at all).
pub const INTERNAL_RANGES: [(&str, &str); 15] = [
    ("0.0.0.0/8", "\"this\" network"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    (
        "100.64.0.0/10",
        "shared address space, carrier-grade NAT (RFC 6598)",
    ),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local, cloud metadata"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.88.99.0/24", "6to4 relay anycast (deprecated)"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking (RFC 2544)"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved, limited broadcast"),
];

/// The built-in internal ranges, parsed.
pub fn internal_ranges() -> Vec<Ipv4Net> {
    INTERNAL_RANGES
        .iter()
        .map(|(n, _)| n.parse().expect("valid constant"))
        .collect()
}

/// Why `net` is internal: the first built-in range it overlaps, with its
/// description; None for a public network. An overlap in either direction
/// counts (`0.0.0.0/0` contains every internal range).
pub fn internal_overlap(net: Ipv4Net) -> Option<(Ipv4Net, &'static str)> {
    INTERNAL_RANGES.iter().find_map(|(r, why)| {
        let r: Ipv4Net = r.parse().expect("valid constant");
        (r.contains(&net) || net.contains(&r)).then_some((r, *why))
    })
}

/// The networks of `list`, refusing domain names (`what` names the list in
/// the error): for lists that must not depend on DNS, such as the
/// operator's extra internal ranges.
pub fn networks_only(list: &[Target], what: &str) -> Result<Vec<Ipv4Net>> {
    if list.len() > MAX_TARGETS {
        return Err(NetError::Invalid(format!(
            "{what} has {} entries; at most {MAX_TARGETS} are allowed (use CIDRs)",
            list.len()
        )));
    }
    list.iter()
        .map(|t| match t {
            Target::Net(n) => Ok(*n),
            Target::Domain(d) => Err(NetError::Invalid(format!(
                "{what}: {d:?} is a domain name; give addresses or CIDRs (like 10.96.0.0/12)"
            ))),
        })
        .collect()
}

/// What holds for every child of a host whatever its policy: the ranges it
/// is denied unless it allows them, and the resolvers its DNS may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Baseline {
    /// [`INTERNAL_RANGES`] and the operator's extra ranges (a cluster's pod
    /// and service CIDRs: `net.internal_ranges`).
    pub internal: Vec<Ipv4Net>,
    /// The upstream resolvers the guest's resolv.conf names; DNS to them
    /// passes where the policy allows DNS ([`EgressPolicy::dns_allowed`]).
    pub resolvers: Vec<Ipv4Addr>,
}

impl Baseline {
    /// The built-in ranges plus `extra`, and `resolvers`.
    pub fn new(extra: &[Ipv4Net], resolvers: Vec<Ipv4Addr>) -> Baseline {
        let mut internal = internal_ranges();
        internal.extend(extra.iter().map(|n| n.trunc()));
        internal.sort();
        internal.dedup();
        Baseline {
            internal,
            resolvers,
        }
    }

    /// What a child with `policy` may reach, for people and programs
    /// (`SandboxInfo.egress`).
    pub fn effective(&self, policy: &EgressPolicy) -> EffectivePolicy {
        EffectivePolicy {
            allow_out: policy.allow_out.clone(),
            deny_out: policy.deny_out.clone(),
            internal_denied: self.internal.iter().map(|n| n.to_string()).collect(),
            dns: if policy.dns_allowed() {
                self.resolvers.clone()
            } else {
                Vec::new()
            },
        }
    }
}

/// A child's policy as it is enforced: its lists, the internal ranges it is
/// denied unless `allow_out` names them, and the resolvers it may query.
/// The host's own addresses are always denied unless allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EffectivePolicy {
    /// Allowed before anything else (names as given, resolved at hand-out).
    pub allow_out: Vec<Target>,
    /// Denied after the internal ranges.
    pub deny_out: Vec<Target>,
    /// Ranges denied unless `allow_out` names them: the built-in internal
    /// ranges and the operator's `net.internal_ranges`.
    pub internal_denied: Vec<String>,
    /// Resolvers reachable on port 53 (udp and tcp), wherever they are;
    /// empty when the policy closes DNS.
    pub dns: Vec<Ipv4Addr>,
}

/// One entry of `allow_out` or `deny_out`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// An IPv4 network (`10.0.0.0/8`, or one address as a /32).
    Net(Ipv4Net),
    /// A domain name, resolved by poold when the policy is applied.
    Domain(String),
}

impl Target {
    /// Parses an address, a CIDR, or a domain name; anything else is refused
    /// with the reason.
    pub fn parse(s: &str) -> Result<Target> {
        let s = s.trim();
        if let Ok(a) = s.parse::<Ipv4Addr>() {
            return Ok(Target::Net(Ipv4Net::from(a)));
        }
        if s.contains('/') {
            let n: Ipv4Net = s.parse().map_err(|_| {
                NetError::Invalid(format!(
                    "egress target {s:?} is not an IPv4 CIDR (like 10.0.0.0/8)"
                ))
            })?;
            if n.network() != n.addr() {
                return Err(NetError::Invalid(format!(
                    "egress target {s}: host bits are set; did you mean {}?",
                    n.trunc()
                )));
            }
            return Ok(Target::Net(n));
        }
        if s.contains(':') {
            return Err(NetError::Invalid(format!(
                "egress target {s:?}: IPv6 is not supported (children have IPv4 only)"
            )));
        }
        check_domain(s)?;
        Ok(Target::Domain(s.trim_end_matches('.').to_ascii_lowercase()))
    }
}

fn check_domain(s: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(NetError::Invalid(format!(
            "egress target {s:?} is neither an IPv4 address, a CIDR nor a domain name: {why}"
        )))
    };
    let name = s.trim_end_matches('.');
    if name.is_empty() || name.len() > 253 {
        return bad("a name is 1 to 253 characters");
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return bad("each label is 1 to 63 characters");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            || label.starts_with('-')
            || label.ends_with('-')
        {
            return bad("labels are letters, digits and inner dashes");
        }
    }
    if name.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return bad("an all-numeric name is not a valid address");
    }
    Ok(())
}

impl Serialize for Target {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Target::Net(n) if n.prefix_len() == 32 => s.serialize_str(&n.addr().to_string()),
            Target::Net(n) => s.serialize_str(&n.to_string()),
            Target::Domain(d) => s.serialize_str(d),
        }
    }
}

impl<'de> Deserialize<'de> for Target {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Target, D::Error> {
        let s = String::deserialize(d)?;
        Target::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// A child's egress policy (`network` in a spawn request, `net.egress` in
/// the config as the default).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressPolicy {
    /// Destinations the child may reach (see the module doc for how the
    /// lists combine).
    #[serde(default)]
    pub allow_out: Vec<Target>,
    /// Destinations the child may not reach.
    #[serde(default)]
    pub deny_out: Vec<Target>,
}

/// A policy with every domain name resolved to addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvedPolicy {
    /// Allowed networks, names resolved.
    pub allow: Vec<Ipv4Net>,
    /// Denied networks, names resolved.
    pub deny: Vec<Ipv4Net>,
    /// Whether the child may reach its DNS resolvers.
    pub dns: bool,
}

impl EgressPolicy {
    /// Deny everything.
    pub fn deny_all() -> EgressPolicy {
        EgressPolicy {
            allow_out: vec![],
            deny_out: vec![Target::Net(Ipv4Net::default())],
        }
    }

    /// Checks sizes (parsing already checked each entry).
    pub fn validate(&self) -> Result<()> {
        for (name, l) in [("allow_out", &self.allow_out), ("deny_out", &self.deny_out)] {
            if l.len() > MAX_TARGETS {
                return Err(NetError::Invalid(format!(
                    "network.{name} has {} entries; at most {MAX_TARGETS} are allowed (use CIDRs)",
                    l.len()
                )));
            }
        }
        Ok(())
    }

    /// The `allow_out` entries that open an internal range (private, shared,
    /// link-local, loopback, reserved: [`INTERNAL_RANGES`]), each with the
    /// range and why it is internal; what `forkd doctor` warns about.
    /// Domain names are not resolved here, so not judged.
    pub fn opens_internal(&self) -> Vec<(Ipv4Net, Ipv4Net, &'static str)> {
        self.allow_out
            .iter()
            .filter_map(|t| match t {
                Target::Net(n) => internal_overlap(*n).map(|(r, why)| (*n, r, why)),
                Target::Domain(_) => None,
            })
            .collect()
    }

    /// Whether DNS to the upstream resolvers is let through: always, unless
    /// the policy denies every address and allows none.
    pub fn dns_allowed(&self) -> bool {
        let denies_all = self
            .deny_out
            .iter()
            .any(|t| matches!(t, Target::Net(n) if n.prefix_len() == 0));
        !(denies_all && self.allow_out.is_empty())
    }

    /// Resolves domain names (A records, via the host's resolver).
    pub async fn resolve(&self) -> Result<ResolvedPolicy> {
        Ok(ResolvedPolicy {
            allow: resolve_list(&self.allow_out).await?,
            deny: resolve_list(&self.deny_out).await?,
            dns: self.dns_allowed(),
        })
    }
}

async fn resolve_list(l: &[Target]) -> Result<Vec<Ipv4Net>> {
    let mut out = Vec::new();
    for t in l {
        match t {
            Target::Net(n) => out.push(*n),
            Target::Domain(d) => {
                let addrs = tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    tokio::net::lookup_host((d.as_str(), 0)),
                )
                .await
                .map_err(|_| NetError::Resolve {
                    name: d.clone(),
                    reason: "timed out after 5 s".into(),
                })?
                .map_err(|e| NetError::Resolve {
                    name: d.clone(),
                    reason: e.to_string(),
                })?;
                let before = out.len();
                for a in addrs {
                    if let std::net::IpAddr::V4(v4) = a.ip() {
                        out.push(Ipv4Net::from(v4));
                    }
                }
                if out.len() == before {
                    return Err(NetError::Resolve {
                        name: d.clone(),
                        reason: "no IPv4 address".into(),
                    });
                }
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_or_say_why() {
        assert_eq!(
            Target::parse("1.2.3.4").unwrap(),
            Target::Net("1.2.3.4/32".parse().unwrap())
        );
        assert_eq!(
            Target::parse("10.0.0.0/8").unwrap(),
            Target::Net("10.0.0.0/8".parse().unwrap())
        );
        assert_eq!(
            Target::parse("PyPI.org.").unwrap(),
            Target::Domain("pypi.org".into())
        );
        for (s, want) in [
            ("10.0.0.1/8", "host bits"),
            ("10.0.0.0/33", "not an IPv4 CIDR"),
            ("::1", "IPv6"),
            ("a..b", "each label"),
            ("bad_name.com", "labels"),
            ("1.2.3", "all-numeric"),
            ("", "1 to 253"),
            ("x;drop table", "labels"),
        ] {
            let e = Target::parse(s).unwrap_err().to_string();
            assert!(e.contains(want), "{s}: {e}");
        }
    }

    #[test]
    fn json_shape_round_trips_and_rejects_unknown_fields() {
        let p: EgressPolicy = serde_json::from_str(
            r#"{"allow_out":["1.2.3.4","example.com"],"deny_out":["0.0.0.0/0"]}"#,
        )
        .unwrap();
        assert_eq!(p.allow_out.len(), 2);
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"allow_out":["1.2.3.4","example.com"],"deny_out":["0.0.0.0/0"]}"#
        );
        assert!(serde_json::from_str::<EgressPolicy>(r#"{"allowOut":[]}"#).is_err());
        assert!(serde_json::from_str::<EgressPolicy>(r#"{"allow_out":["1.2.3.4/40"]}"#).is_err());
    }

    #[test]
    fn dns_follows_deny_all() {
        assert!(EgressPolicy::default().dns_allowed());
        assert!(!EgressPolicy::deny_all().dns_allowed());
        let mut p = EgressPolicy::deny_all();
        p.allow_out.push(Target::parse("1.2.3.4").unwrap());
        assert!(p.dns_allowed());
    }

    #[test]
    fn internal_ranges_cover_private_reserved_and_not_public() {
        for a in [
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "100.64.0.1",
            "127.0.0.1",
            "169.254.169.254",
            "0.0.0.1",
            "192.0.0.9",
            "192.0.2.1",
            "198.18.0.1",
            "198.19.255.1",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.251",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
        ] {
            let n = Ipv4Net::from(a.parse::<Ipv4Addr>().unwrap());
            assert!(internal_overlap(n).is_some(), "{a} must be internal");
        }
        for a in [
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "198.20.0.1",
            "192.169.0.1",
            "223.255.255.254",
        ] {
            let n = Ipv4Net::from(a.parse::<Ipv4Addr>().unwrap());
            assert_eq!(internal_overlap(n), None, "{a} is public");
        }
        // A wider allow (the whole space) opens internal ranges too.
        assert!(internal_overlap("0.0.0.0/0".parse().unwrap()).is_some());
    }

    #[test]
    fn opens_internal_names_the_allowed_internal_entries() {
        let p: EgressPolicy = serde_json::from_str(
            r#"{"allow_out":["10.5.0.7","93.184.215.14","db.example","0.0.0.0/0"]}"#,
        )
        .unwrap();
        let open: Vec<String> = p.opens_internal().iter().map(|x| x.0.to_string()).collect();
        assert_eq!(open, ["10.5.0.7/32", "0.0.0.0/0"]);
        assert!(EgressPolicy::default().opens_internal().is_empty());
    }

    #[test]
    fn baseline_adds_extra_ranges_and_shows_the_effective_policy() {
        let extra = networks_only(
            &[
                Target::parse("10.96.0.0/12").unwrap(),
                Target::parse("44.0.0.0/8").unwrap(),
            ],
            "net.internal_ranges",
        )
        .unwrap();
        let b = Baseline::new(&extra, vec!["10.0.0.53".parse().unwrap()]);
        assert!(b.internal.contains(&"44.0.0.0/8".parse().unwrap()));
        assert!(b.internal.contains(&"10.0.0.0/8".parse().unwrap()));
        let e = b.effective(&EgressPolicy::default());
        assert!(e.internal_denied.contains(&"192.168.0.0/16".to_string()));
        assert_eq!(e.dns, vec!["10.0.0.53".parse::<Ipv4Addr>().unwrap()]);
        assert!(b.effective(&EgressPolicy::deny_all()).dns.is_empty());
        let e = networks_only(
            &[Target::parse("pods.local").unwrap()],
            "net.internal_ranges",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("domain name"), "{e}");
    }

    #[test]
    fn too_many_targets_is_refused() {
        let p = EgressPolicy {
            allow_out: vec![Target::parse("1.2.3.4").unwrap(); MAX_TARGETS + 1],
            deny_out: vec![],
        };
        assert!(p.validate().unwrap_err().to_string().contains("at most"));
    }

    #[tokio::test]
    async fn resolve_keeps_cidrs_and_dedups() {
        let p = EgressPolicy {
            allow_out: vec![
                Target::parse("10.0.0.0/8").unwrap(),
                Target::parse("10.0.0.0/8").unwrap(),
                Target::parse("localhost").unwrap(),
            ],
            deny_out: vec![],
        };
        let r = p.resolve().await.unwrap();
        assert!(r.allow.contains(&"127.0.0.1/32".parse().unwrap()));
        assert_eq!(r.allow.iter().filter(|n| n.prefix_len() == 8).count(), 1);
    }
}
