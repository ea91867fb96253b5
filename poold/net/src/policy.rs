//! Egress policy: what a child may reach outside its namespace.
//!
//! The shape follows E2B's `allowOut`/`denyOut`: two lists of targets, each
//! an IPv4 address, a CIDR or a domain name. Evaluated per new connection,
//! in this order (first match wins):
//!
//! 1. replies to connections already allowed (conntrack);
//! 2. a destination in `allow_out` → allowed (this is the only way to reach
//!    the host itself, its loopback or link-local metadata addresses);
//! 3. DNS (port 53) to the host's upstream resolvers → allowed unless the
//!    policy denies everything and allows nothing ([`EgressPolicy::dns_allowed`]);
//! 4. a built-in denied range ([`ALWAYS_DENIED`]) → dropped;
//! 5. a destination in `deny_out` → dropped;
//! 6. everything else → allowed.
//!
//! So "deny all" is `deny_out: ["0.0.0.0/0"]`, and an allow-list is
//! `deny_out: ["0.0.0.0/0"], allow_out: [...]`. Domain names are resolved
//! once, when the policy is applied (hand-out); TTLs are not followed.

use crate::{NetError, Result};
use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;

/// Most entries a list may hold (each becomes a set element).
pub const MAX_TARGETS: usize = 256;

/// Destinations denied unless allowed explicitly: "this" network, loopback,
/// link-local (cloud metadata at 169.254.169.254) and multicast/reserved.
/// The host's own addresses are denied in the root namespace's input chain.
pub const ALWAYS_DENIED: [&str; 4] = ["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3"];

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
