//! Per-child networking for forkd (docs/network.md).
//!
//! Every networked child lives in a network namespace of its own,
//! `forkd-<scope>-<vm id>`, bind-mounted in `/run/netns` (so `ip netns`
//! lists it). The scope ([`scope_of`]) names the data directory that owns
//! the child, so several forkd instances on one host (a test run beside a
//! production daemon) never reconcile away each other's children:
//!
//! ```text
//!  guest eth0 10.42.0.2/30 ── tap0 10.42.0.1/30 [ns forkd-<id>] eth0 B/30 ══ veth ══ fkh<i> A/30 [root ns] ── uplink
//! ```
//!
//! Invariants this crate keeps:
//! - Inside every namespace the guest side is identical (tap `tap0`, its MAC
//!   [`TAP_MAC`], the gateway [`GATEWAY`], the guest's [`GUEST_ADDR`] and
//!   [`GUEST_MAC`]), so a forked guest's addresses and ARP cache stay valid
//!   in any child. Only the veth pair differs: slot `i` of the configured
//!   range ([`AddrPool`]) gives `A` (root side) and `B` (namespace side, the
//!   child's `guest_addr` as seen from the host).
//! - A slot is claimed by creating the link `fkh<i>` in the root namespace:
//!   the kernel refuses a second link of that name, so two processes never
//!   share a slot and nothing else needs to be locked.
//! - A child's egress policy lives in its own namespace's table, so it holds
//!   as long as the child's network exists, whether or not poold runs (a
//!   kill -9 and restart changes nothing); what protects the host itself
//!   lives in the root namespace's table, which stays when poold dies.
//! - Everything of a child dies with its namespace (the veth pair, the tap,
//!   its nftables table), except the one root-namespace set element that
//!   lets it reach an explicitly allowed host address; [`teardown`] removes
//!   that too, and [`reconcile`] removes whatever no live child of its scope
//!   owns, and of other scopes only what provably belongs to nobody (a veth
//!   pair never moved into a namespace, a set element whose link is gone).
//! - Root-namespace rules live only in `table inet forkd`; no other table
//!   is ever touched.

#![warn(missing_docs)]

mod error;
mod netlink;
mod netns;
mod nft;
pub mod policy;
pub mod pool;
pub mod proxy;
mod tap;

pub use error::NetError;
/// IPv4 networks (`10.0.0.0/8`), as the policy types hold them.
pub use ipnet::Ipv4Net;
pub use netns::{netns_path, open as netns_open, NS_DIR};
pub use policy::{Baseline, EffectivePolicy, EgressPolicy, ResolvedPolicy, Target};
pub use pool::AddrPool;
pub use tap::open_tap_in;

use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;

/// Result type of this crate.
pub type Result<T, E = NetError> = std::result::Result<T, E>;

/// The guest's address inside every child (never seen outside its namespace).
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 42, 0, 2);
/// The gateway the guest talks to: `tap0`'s address in every namespace.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 42, 0, 1);
/// Prefix length of the guest↔tap link.
pub const GUEST_PREFIX: u8 = 30;
/// The guest NIC's MAC, recorded in the snapshot (identical in every child).
pub const GUEST_MAC: &str = "52:54:00:42:00:02";
/// `tap0`'s MAC in every namespace, so a forked guest's ARP entry for its
/// gateway stays valid after a restore.
pub const TAP_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x42, 0x00, 0x01];
/// The tap's name inside a namespace.
pub const TAP: &str = "tap0";
/// The namespace side of the veth pair.
pub const NS_VETH: &str = "eth0";
/// Prefix of the root side of a veth pair (`fkh<slot>`).
pub const HOST_VETH_PREFIX: &str = "fkh";
/// Prefix of the namespace side of a veth pair while it is still in the
/// root namespace (`fkp<slot>`; renamed [`NS_VETH`] once moved).
pub const PEER_VETH_PREFIX: &str = "fkp";
/// Prefix of the namespaces poold manages (`forkd-<scope>-<vm id>`).
pub const NETNS_PREFIX: &str = "forkd-";
/// Prefix of the isolated namespaces a parent boots in (`fkboot-<vm id>`);
/// their names are dropped once QEMU is inside, so [`reconcile`] removes
/// any older than a minute (a crash in between).
pub const BOOT_NETNS_PREFIX: &str = "fkboot-";
/// The port of the forkd-compatible TCP agent in the guest.
pub const COMPAT_AGENT_PORT: u16 = 8888;

/// What is recorded with a VM about its network, enough to tear it down
/// after a crash and to reach the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildNet {
    /// The namespace's name (`forkd-<scope>-<vm id>`).
    pub netns: String,
    /// The slot in the address pool; the root-side link is `fkh<slot>`.
    pub slot: u32,
    /// Root side of the veth pair.
    pub host_addr: Ipv4Addr,
    /// Namespace side of the veth pair: where the host reaches the guest
    /// (traffic to it is forwarded to the guest) and the source address the
    /// outside sees.
    pub guest_addr: Ipv4Addr,
}

impl ChildNet {
    /// The root-side link's name.
    pub fn host_link(&self) -> String {
        host_link(self.slot)
    }
}

/// The root-side link name of `slot`.
pub fn host_link(slot: u32) -> String {
    format!("{HOST_VETH_PREFIX}{slot}")
}

/// The namespace name of VM `vm_id` of the instance `scope`.
pub fn netns_name(scope: &str, vm_id: &str) -> String {
    format!("{NETNS_PREFIX}{scope}-{vm_id}")
}

/// The scope of the forkd instance whose data directory is `data_dir`: 8
/// hex digits of the blake3 hash of its absolute path (stable across
/// releases, so a newer poold still finds an older one's children).
pub fn scope_of(data_dir: &std::path::Path) -> String {
    let abs = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let h = blake3::hash(abs.as_os_str().as_encoded_bytes());
    h.to_hex()[..8].to_string()
}

pub use setup::{
    apply_policy, apply_resolved, create_child, create_isolated, delete_isolated, host_setup,
    reconcile, teardown, upstream_resolvers, HostSetup, Reconciled,
};

mod setup;
