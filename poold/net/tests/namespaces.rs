//! Real namespaces, links and nftables rules (no guests). Run as root; they
//! skip with a note otherwise. Children here are named `fdt-net-*`; every
//! test cleans up through a guard, even when it fails. The tests share the
//! host's root namespace, so they run one at a time (a mutex), and nothing
//! else on the host may create forkd child networks meanwhile (reconcile is
//! host-wide by design).

use forkd_net::{
    apply_policy, create_child, host_setup, reconcile, teardown, AddrPool, Baseline, ChildNet,
    EgressPolicy, Target,
};
use std::process::Command;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

/// The one lock every test takes, with the host's forwarding switch and
/// `table inet forkd` as they were, restored when it is released: a test
/// run leaves the host as it found it.
struct Serial {
    _lock: std::sync::MutexGuard<'static, ()>,
    ip_forward: String,
    had_table: bool,
}

fn serial() -> Serial {
    let lock = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Serial {
        _lock: lock,
        ip_forward: std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap_or_default(),
        had_table: Command::new("nft")
            .args(["list", "table", "inet", "forkd"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false),
    }
}

impl Drop for Serial {
    fn drop(&mut self) {
        if !self.had_table {
            sh("nft delete table inet forkd");
        }
        if !self.ip_forward.is_empty() {
            let _ = std::fs::write("/proc/sys/net/ipv4/ip_forward", self.ip_forward.trim());
        }
    }
}

fn root() -> bool {
    if nix::unistd::geteuid().is_root() {
        true
    } else {
        eprintln!("skipped: needs root");
        false
    }
}

/// The tests' instance scope: reconcile never touches another's children.
const SCOPE: &str = "fdt00000";

fn pool() -> AddrPool {
    AddrPool::parse("10.203.0.0/24").unwrap()
}

fn id(tag: &str) -> String {
    format!("fdt-net-{tag}-{}", std::process::id())
}

/// Tears every child down on drop (a failing assertion included).
struct Guard(Vec<ChildNet>);
impl Drop for Guard {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = teardown(n);
        }
    }
}

fn sh(cmd: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

fn netns_exists(name: &str) -> bool {
    std::path::Path::new("/run/netns").join(name).exists()
}

fn link_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

fn host_allow() -> String {
    sh("nft list set inet forkd host_allow")
}

#[test]
fn children_get_distinct_addresses_and_teardown_leaves_nothing() {
    if !root() {
        return;
    }
    let _l = serial();
    host_setup(&pool()).unwrap();
    let mut g = Guard(Vec::new());
    for i in 0..3 {
        g.0.push(create_child(&pool(), SCOPE, &id(&format!("d{i}"))).unwrap());
    }
    let mut addrs: Vec<_> = g.0.iter().map(|n| n.guest_addr).collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), 3, "{:?}", g.0);
    for n in &g.0 {
        assert!(pool().net().contains(&n.guest_addr));
        assert!(netns_exists(&n.netns), "{}", n.netns);
        assert!(link_exists(&n.host_link()));
        let inside = sh(&format!("ip -n {} -br addr", n.netns));
        assert!(
            inside.contains("tap0") && inside.contains("10.42.0.1/30"),
            "{inside}"
        );
        assert!(inside.contains(&format!("{}/30", n.guest_addr)), "{inside}");
        let mac = sh(&format!("ip -n {} link show tap0", n.netns));
        assert!(mac.contains("52:54:00:42:00:01"), "{mac}");
        // The host reaches the namespace side of the veth.
        let ping = Command::new("ping")
            .args(["-c1", "-W2", &n.host_addr.to_string()])
            .status();
        if let Ok(s) = ping {
            assert!(s.success(), "ping {}", n.host_addr);
        }
        let rules = sh(&format!(
            "nft list table inet forkd -n 2>&1; ip netns exec {} nft list table inet forkd",
            n.netns
        ));
        assert!(rules.contains("dnat ip to 10.42.0.2"), "{rules}");
    }
    // Allowing a host address adds a root-namespace element; teardown takes it.
    let n0 = g.0[0].clone();
    let p = EgressPolicy {
        allow_out: vec![Target::parse(&n0.host_addr.to_string()).unwrap()],
        deny_out: vec![],
    };
    apply_policy(&n0, &p, &Baseline::default()).unwrap();
    assert!(host_allow().contains(&n0.host_link()), "{}", host_allow());
    // Re-applying replaces, never duplicates.
    apply_policy(&n0, &p, &Baseline::default()).unwrap();
    assert_eq!(
        host_allow()
            .matches(&format!("\"{}\"", n0.host_link()))
            .count(),
        1,
        "{}",
        host_allow()
    );
    for n in g.0.drain(..) {
        teardown(&n).unwrap();
        assert!(!netns_exists(&n.netns));
        assert!(!link_exists(&n.host_link()));
        assert!(!host_allow().contains(&format!("\"{}\"", n.host_link())));
        // Idempotent.
        teardown(&n).unwrap();
    }
}

#[test]
fn reconcile_removes_what_no_live_child_owns() {
    if !root() {
        return;
    }
    let _l = serial();
    host_setup(&pool()).unwrap();
    let mut g = Guard(Vec::new());
    let keep = create_child(&pool(), SCOPE, &id("keep")).unwrap();
    g.0.push(keep.clone());
    let lost = create_child(&pool(), SCOPE, &id("lost")).unwrap();
    g.0.push(lost.clone());
    // Another forkd instance's child on the same host: never ours to remove.
    let other = create_child(&pool(), "fdt11111", &id("other")).unwrap();
    g.0.push(other.clone());
    apply_policy(
        &lost,
        &EgressPolicy {
            allow_out: vec![Target::parse("192.0.2.1").unwrap()],
            deny_out: vec![],
        },
        &Baseline::default(),
    )
    .unwrap();
    // As after a kill -9: `lost` is no longer recorded anywhere.
    let done = reconcile(SCOPE, std::slice::from_ref(&keep)).unwrap();
    assert!(done.namespaces.contains(&lost.netns), "{done:?}");
    assert!(!netns_exists(&lost.netns));
    assert!(!link_exists(&lost.host_link()));
    assert!(!host_allow().contains(&format!("\"{}\"", lost.host_link())));
    assert!(netns_exists(&keep.netns));
    assert!(link_exists(&keep.host_link()));
    // A root-side link whose namespace vanished (crash mid-setup) goes too.
    let half = create_child(&pool(), SCOPE, &id("half")).unwrap();
    g.0.push(half.clone());
    sh(&format!(
        "umount /run/netns/{0}; rm /run/netns/{0}",
        half.netns
    ));
    sh("ip link add fkh9999 type veth peer name fkp9999");
    let done = reconcile(SCOPE, std::slice::from_ref(&keep)).unwrap();
    assert!(done.links.contains(&"fkh9999".to_string()), "{done:?}");
    assert!(!link_exists("fkh9999"));
    let done = reconcile(SCOPE, &[]).unwrap();
    assert!(done.namespaces.contains(&keep.netns));
    assert!(!netns_exists(&keep.netns) && !link_exists(&keep.host_link()));
    assert!(netns_exists(&other.netns) && link_exists(&other.host_link()));
    assert!(!done.namespaces.contains(&other.netns), "{done:?}");
}

#[test]
fn policy_refuses_bad_input_before_touching_anything() {
    let e = serde_json::from_str::<EgressPolicy>(r#"{"allow_out":["not a host!"]}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("neither an IPv4 address"), "{e}");
}
