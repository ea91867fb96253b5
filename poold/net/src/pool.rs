//! The range host-side addresses come from: slot `i` is the `i`-th /30 of
//! the range; `.1` of it is the root side (`fkh<i>`), `.2` the namespace side.
//! A /16 holds 16384 children; nothing assumes a /24.

use crate::{NetError, Result};
use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;

/// The configured range of host-side addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AddrPool {
    net: Ipv4Net,
}

/// The default range: 10.201.0.0/16, 16384 children.
pub const DEFAULT_RANGE: &str = "10.201.0.0/16";

impl Default for AddrPool {
    fn default() -> Self {
        AddrPool::parse(DEFAULT_RANGE).expect("valid default")
    }
}

impl AddrPool {
    /// Parses and validates `a.b.c.d/n`: the address must be the network's
    /// own (no host bits), the prefix at most /30, and the range must not
    /// overlap the guest link (10.42.0.0/30), loopback, link-local or
    /// multicast space.
    pub fn parse(s: &str) -> Result<AddrPool> {
        let net: Ipv4Net = s.trim().parse().map_err(|_| {
            NetError::Invalid(format!(
                "net.range {s:?} is not an IPv4 CIDR like {DEFAULT_RANGE}"
            ))
        })?;
        if net.network() != net.addr() {
            return Err(NetError::Invalid(format!(
                "net.range {s}: host bits are set; did you mean {}?",
                net.trunc()
            )));
        }
        if net.prefix_len() > 30 {
            return Err(NetError::Invalid(format!(
                "net.range {s} is too small: each child takes a /30, so the prefix must be /30 or shorter"
            )));
        }
        let guest: Ipv4Net = Ipv4Net::new(crate::GUEST_ADDR, crate::GUEST_PREFIX)
            .expect("valid")
            .trunc();
        for (bad, what) in [
            (guest, "the guest link 10.42.0.0/30"),
            ("127.0.0.0/8".parse().expect("valid"), "loopback"),
            ("169.254.0.0/16".parse().expect("valid"), "link-local"),
            ("224.0.0.0/3".parse().expect("valid"), "multicast/reserved"),
            ("0.0.0.0/8".parse().expect("valid"), "0.0.0.0/8"),
        ] {
            if overlaps(&net, &bad) {
                return Err(NetError::Invalid(format!(
                    "net.range {s} overlaps {what}; pick a private range such as {DEFAULT_RANGE}"
                )));
            }
        }
        Ok(AddrPool { net })
    }

    /// The range as configured.
    pub fn net(&self) -> Ipv4Net {
        self.net
    }

    /// How many children fit.
    pub fn slots(&self) -> u32 {
        1u32 << (30 - self.net.prefix_len())
    }

    /// `(root side, namespace side)` of `slot`, or `None` past the end.
    pub fn addrs(&self, slot: u32) -> Option<(Ipv4Addr, Ipv4Addr)> {
        if slot >= self.slots() {
            return None;
        }
        let base = u32::from(self.net.network()) + slot * 4;
        Some((Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2)))
    }

    pub(crate) fn exhausted(&self) -> NetError {
        NetError::PoolExhausted {
            range: self.net.to_string(),
            slots: self.slots(),
        }
    }
}

fn overlaps(a: &Ipv4Net, b: &Ipv4Net) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

impl TryFrom<String> for AddrPool {
    type Error = NetError;
    fn try_from(s: String) -> Result<AddrPool> {
        AddrPool::parse(&s)
    }
}

impl From<AddrPool> for String {
    fn from(p: AddrPool) -> String {
        p.net.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_addresses() {
        let p = AddrPool::default();
        assert_eq!(p.slots(), 16384);
        assert_eq!(
            p.addrs(0),
            Some(("10.201.0.1".parse().unwrap(), "10.201.0.2".parse().unwrap()))
        );
        assert_eq!(
            p.addrs(64),
            Some(("10.201.1.1".parse().unwrap(), "10.201.1.2".parse().unwrap()))
        );
        assert_eq!(
            p.addrs(16383),
            Some((
                "10.201.255.253".parse().unwrap(),
                "10.201.255.254".parse().unwrap()
            ))
        );
        assert_eq!(p.addrs(16384), None);
        assert_eq!(AddrPool::parse("100.64.0.0/10").unwrap().slots(), 1 << 20);
        assert_eq!(AddrPool::parse("10.9.0.0/30").unwrap().slots(), 1);
    }

    #[test]
    fn bad_ranges_are_refused_with_a_reason() {
        for (s, want) in [
            ("10.201.0.1/16", "host bits"),
            ("10.201.0.0/31", "too small"),
            ("10.42.0.0/16", "guest link"),
            ("127.0.0.0/8", "loopback"),
            ("169.254.0.0/16", "link-local"),
            ("nonsense", "not an IPv4 CIDR"),
            ("0.0.0.0/0", "overlaps"),
        ] {
            let e = AddrPool::parse(s).unwrap_err().to_string();
            assert!(e.contains(want), "{s}: {e}");
        }
    }
}
