//! Issue #31: a sandbox cannot reach its host's private networks unless
//! told to (docs/network.md, "Egress policy"). With real guests and
//! namespaces this test creates:
//!
//! - a "LAN" namespace at a private address (an HTTP server and the DNS
//!   resolver the sandboxes are given), and a "public" namespace at a
//!   non-private address, both routed through the host;
//! - a default child reaches the public server, not the LAN one, not the
//!   resolver's address except on port 53, and no address of the host:
//!   its LAN-side address, the gateway, poold's API port, and an address
//!   added after the child started that a port forward (DNAT) of the host
//!   would send on to the LAN;
//! - `allow_out` opens the LAN server; a pooled child behaves like the
//!   rest; after `kill -9` of poold (and while it is down) and a restart,
//!   every rule still holds;
//! - through the E2B API, `allow_internet_access: false` and a deny-all
//!   `denyOut` cut a sandbox and its forks off the public server, and
//!   `update_network` changes a running sandbox's egress for good (its
//!   forks, its pause and resume).
//!
//! The "public" address: 100.128.X.10 (100.129.X.10 for the E2B test), just above the shared address
//! space 100.64.0.0/10 (so it is public, and checks that boundary). It is
//! safe to use because it never leaves this machine: before any sandbox
//! sends a packet, the test routes it with a /32 host route through its
//! own veth into its own namespace (checked with `ip route get`), the
//! public namespace has no route anywhere else, and the route goes with
//! the veth at the end. Every other address is private and on this host.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{ids, Home, Poold};
use forkd_e2e::netns::{free_lan, probe, sh, suffix, Probe, TestNs};
use serde_json::json;
use std::net::Ipv4Addr;

const MINIMAL_MIB: u64 = 128;
const PORT: u16 = 8080;
/// The name the LAN resolver answers.
const LAN_NAME: &str = "lan-db.forkd.test";

/// Deletes every namespace of a test data dir's scope on drop.
struct Scope(String);

impl Drop for Scope {
    fn drop(&mut self) {
        sh(&format!(
            "for n in $(ls /run/netns 2>/dev/null | grep '^{}'); do ip netns del $n; done",
            self.0
        ));
    }
}

/// The sandbox's answer to `nslookup LAN_NAME` (busybox, resolv.conf's
/// resolver): its output.
async fn lookup(p: &Poold, id: &str) -> String {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": ["nslookup", LAN_NAME], "timeout_secs": 30}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    v["stdout"].as_str().unwrap_or("").to_string() + v["stderr"].as_str().unwrap_or("")
}

fn guest_addr(v: &serde_json::Value) -> Ipv4Addr {
    v["guest_addr"].as_str().unwrap().parse().unwrap()
}

/// The address after `a`: [`public_server`]'s second one.
fn next(a: Ipv4Addr) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(a) + 1)
}

/// A namespace serving `hello-from-public` on PORT at a public address
/// (100.<128 + lan - 214>.X.10), routed by a /32 host route into that
/// namespace only; the namespace, the address and its link's root side.
fn public_server(sfx: &str, lan: u8) -> (TestNs, Ipv4Addr, Ipv4Addr) {
    let [_, b2, c2] = free_lan(lan);
    let (pub_root, pub_link) = (Ipv4Addr::new(10, b2, c2, 1), Ipv4Addr::new(10, b2, c2, 2));
    // Each caller its own second octet (100.128 and up: just above the
    // shared space 100.64.0.0/10), so tests running at once never share it.
    let public = Ipv4Addr::new(100, 128 + (lan - 214), c2, 10);
    let mut pubns = TestNs::new("pub", &format!("fdu{sfx}"), pub_root, pub_link, 30);
    pubns.add(
        &format!("ip -n {} addr add {public}/32 dev fdu{sfx}p", pubns.name),
        "true",
    );
    // The next address too, where nothing listens: a connection allowed
    // there is refused, one denied is dropped.
    let other = next(public);
    pubns.add(
        &format!("ip -n {} addr add {other}/32 dev fdu{sfx}p", pubns.name),
        "true",
    );
    for a in [public, other] {
        pubns.add(
            &format!("ip route add {a}/32 via {pub_link}"),
            &format!("ip route del {a}/32"),
        );
        let (_, route) = sh(&format!("ip route get {a}"));
        assert!(
            route.contains(&format!("dev fdu{sfx}")),
            "the public test addresses must be routed into the test's namespace only: {route}"
        );
    }
    pubns.serve_http(public, PORT, "hello-from-public");
    assert!(forkd_net::policy::internal_overlap(public.into()).is_none());
    (pubns, public, pub_root)
}

/// E2B's network controls through the E2B API (docs/e2b.md, "Limits"):
/// an ordinary sandbox reaches the public test server; one created with
/// `allow_internet_access: false`, or with `denyOut: 0.0.0.0/0`, does
/// not; and neither do their forks (`POST /sandboxes/{id}/fork`), which
/// keep the parent's network. Before, a fork's children got the default
/// policy, so a cut-off parent forked into children with the internet.
#[test]
fn e2b_network_controls_hold_for_a_sandbox_and_its_forks() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let sfx = suffix();
    let (pubns, public, _) = public_server(&sfx, 215);
    let home = Home::new();
    let _scope = Scope(forkd_net::netns_name(&forkd_net::scope_of(&home.dir), ""));
    let key = format!("e2b_{}", forkd_snapshot::random_hex(20));
    let key_file = home.dir.join("e2b.key");
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let args = [
        "--e2b-bind",
        "127.0.0.1:0",
        "--e2b-sandbox-bind",
        "127.0.0.1:0",
        "--e2b-api-key-file",
        key_file.to_str().unwrap(),
    ];
    let p = Poold::start(&home.dir, &args, None);
    let (api, _) = p.e2b.clone().expect("poold printed its E2B listeners");
    let http = forkd_api::http_builder().build().unwrap();
    let e2b = |path: String, body: serde_json::Value| {
        let req = http
            .post(format!("{api}{path}"))
            .header("x-api-key", &key)
            .json(&body);
        async move {
            let r = req.send().await.unwrap();
            let st = r.status().as_u16();
            (st, r.json::<serde_json::Value>().await.unwrap())
        }
    };
    block_on(async {
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "net", "image": "minimal", "mem_mib": MINIMAL_MIB, "net": true}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let create = |body: serde_json::Value| async {
            let (st, v) = e2b("/sandboxes".into(), body).await;
            assert_eq!(st, 201, "{v}");
            v["sandboxID"].as_str().unwrap().to_string()
        };
        let fork = |id: String| async move {
            let (st, v) = e2b(format!("/sandboxes/{id}/fork"), json!({"count": 1})).await;
            assert_eq!(st, 201, "{v}");
            v[0]["sandbox"]["sandboxID"]
                .as_str()
                .unwrap_or_else(|| panic!("{v}"))
                .to_string()
        };
        let reached = Probe::Reached("hello-from-public".into());
        let open = create(json!({"templateID": "net"})).await;
        assert_eq!(probe(&p, &open, public, PORT).await, reached);
        let open_child = fork(open.clone()).await;
        assert_eq!(
            probe(&p, &open_child, public, PORT).await,
            reached,
            "a fork of an open sandbox"
        );
        for cut in [
            json!({"templateID": "net", "allow_internet_access": false}),
            json!({"templateID": "net", "network": {"denyOut": ["0.0.0.0/0"]}}),
        ] {
            let parent = create(cut.clone()).await;
            assert_eq!(
                probe(&p, &parent, public, PORT).await,
                Probe::Dropped,
                "{cut}"
            );
            let child = fork(parent.clone()).await;
            assert_eq!(
                probe(&p, &child, public, PORT).await,
                Probe::Dropped,
                "a fork of {cut}"
            );
        }
        update_network(&p, &api, &key, &open, public).await;
    });
    drop(p);
    drop(pubns);
}

/// `sbx.update_network` (`PUT /sandboxes/{id}/network`) on running sandbox
/// `id`, which reaches `public`: through E2B's Python SDK and as its wire
/// form, each update replaces the whole egress; the policy holds in the
/// sandbox's forks and across its pause and resume; `/v1` has the same.
async fn update_network(p: &Poold, api: &str, key: &str, id: &str, public: Ipv4Addr) {
    let http = forkd_api::http_builder().build().unwrap();
    let put = |id: &str, body: &str| {
        let req = http
            .put(format!("{api}/sandboxes/{id}/network"))
            .header("x-api-key", key)
            .header("content-type", "application/json")
            .body(body.to_string());
        async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let post = |path: String| {
        let req = http.post(format!("{api}{path}")).header("x-api-key", key);
        async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let reached = Probe::Reached("hello-from-public".into());
    // E2B's SDK, unmodified: deny everything.
    let py =
        std::env::var("FORKD_TEST_PYTHON").expect("FORKD_TEST_PYTHON (scripts/test.sh sets it)");
    let out = std::process::Command::new(py)
        .args(["-c", "import sys; from e2b import Sandbox; Sandbox.update_network(sys.argv[1], {'deny_out': ['0.0.0.0/0']})", id])
        .env("E2B_API_URL", api)
        .env("E2B_API_KEY", key)
        .env_remove("E2B_DOMAIN")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        probe(p, id, public, PORT).await,
        Probe::Dropped,
        "after denyOut 0.0.0.0/0"
    );
    // An update leaves nothing of the last one: `{}` is the default again.
    assert_eq!(put(id, "{}").await.0, 204);
    assert_eq!(probe(p, id, public, PORT).await, reached, "after {{}}");
    let other = next(public);
    assert_eq!(
        probe(p, id, other, PORT).await,
        Probe::Refused,
        "after {{}}"
    );
    // E2B's allow-list form: that address only.
    let allow = format!(r#"{{"allowOut": ["{public}"], "allow_internet_access": false}}"#);
    assert_eq!(put(id, &allow).await.0, 204);
    assert_eq!(probe(p, id, public, PORT).await, reached, "{allow}");
    assert_eq!(probe(p, id, other, PORT).await, Probe::Dropped, "{allow}");
    let (st, v) = p.get(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!(st, 200, "{v}");
    assert!(v["egress"].to_string().contains(&public.to_string()), "{v}");
    assert_eq!(put(id, r#"{"allow_internet_access": false}"#).await.0, 204);
    assert_eq!(
        probe(p, id, public, PORT).await,
        Probe::Dropped,
        "no internet"
    );
    // Refused, and nothing changes: ingress keys, E2B's proxies, a sandbox
    // that does not exist.
    for (body, want) in [
        (r#"{"httpsPorts": [443]}"#, 400),
        (r#"{"egressProxy": {"address": "127.0.0.1:1080"}}"#, 400),
        (r#"{"allowOut": ["300.1.1.1"]}"#, 400),
    ] {
        let (st, text) = put(id, body).await;
        assert_eq!(st, want, "{body}: {text}");
    }
    assert_eq!(put("sb-000000000000000000000000", "{}").await.0, 404);
    assert_eq!(
        probe(p, id, public, PORT).await,
        Probe::Dropped,
        "after refusals"
    );
    // A fork keeps the updated policy; so does a pause and resume.
    let (st, v) = post(format!("/sandboxes/{id}/fork")).await;
    assert_eq!(st, 201, "{v}");
    let v: serde_json::Value = serde_json::from_str(&v).unwrap();
    let child = v[0]["sandbox"]["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(
        probe(p, &child, public, PORT).await,
        Probe::Dropped,
        "its fork"
    );
    let (st, v) = post(format!("/sandboxes/{id}/pause")).await;
    assert_eq!(st, 204, "{v}");
    let (st, text) = put(id, "{}").await;
    assert_eq!(st, 409, "a paused sandbox: {text}");
    let (st, v) = post(format!("/sandboxes/{id}/resume")).await;
    assert_eq!(st, 201, "{v}");
    assert_eq!(
        probe(p, id, public, PORT).await,
        Probe::Dropped,
        "after its resume"
    );
    // forkd's own API: the whole policy, the sandbox after.
    let (st, v) = p
        .put(&format!("/v1/sandboxes/{id}/network"), json!({}))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(probe(p, id, public, PORT).await, reached, "after /v1 {{}}");
}

#[test]
fn default_egress_reaches_the_internet_not_the_lan_nor_the_host() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let sfx = suffix();
    let [a, b, c] = free_lan(213);
    let lan_root = Ipv4Addr::new(a, b, c, 1);
    let lan_srv = Ipv4Addr::new(a, b, c, 2);
    let mut lan = TestNs::new("lan", &format!("fdl{sfx}"), lan_root, lan_srv, 24);
    lan.serve_http(lan_srv, PORT, "hello-from-lan");
    // The resolver answers with an address of its own choosing (never the
    // resolver's, which nslookup prints as the server).
    let lan_db = Ipv4Addr::new(a, b, c, 99);
    lan.serve_dns(lan_srv, LAN_NAME, lan_db);

    let (pubns, public, pub_root) = public_server(&sfx, 214);
    let c2 = public.octets()[2];

    let home = Home::new();
    let _scope = Scope(forkd_net::netns_name(&forkd_net::scope_of(&home.dir), ""));
    let resolv = home.dir.join("sandbox-resolv.conf");
    std::fs::write(&resolv, format!("nameserver {lan_srv}\n")).unwrap();
    let token: String = (0..3)
        .map(|_| format!("{:016x}", rand::random::<u64>()))
        .collect();
    let token_file = home.dir.join("token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    // On every address, so its API port is open on the host's LAN address
    // too: only the rules keep a sandbox from it.
    let args = [
        "--bind",
        "0.0.0.0:0",
        "--token-file",
        token_file.to_str().unwrap(),
    ];
    let env = [("FORKD_RESOLV_CONF", resolv.to_str().unwrap())];
    let p = Poold::start_env(&home.dir, &args, Some(token.as_str()), &env);
    let api_port: u16 = p.url.rsplit(':').next().unwrap().parse().unwrap();

    let (plain, allowed, pooled) = block_on(async {
        let (st, v) = p
            .post(
                "/v1/snapshots",
                json!({"tag": "net", "image": "minimal", "mem_mib": MINIMAL_MIB, "net": true}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "net"}))
            .await;
        assert_eq!(st, 201, "{v}");
        let plain = ids(&v)[0].clone();
        let gateway = Ipv4Addr::from(u32::from(guest_addr(&v[0])) - 1);

        // The effective policy is shown.
        let (st, info) = p.get(&format!("/v1/sandboxes/{plain}")).await;
        assert_eq!(st, 200, "{info}");
        let denied = info["egress"]["internal_denied"].to_string();
        for r in [
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
            "169.254.0.0/16",
        ] {
            assert!(denied.contains(r), "{r} not denied: {info}");
        }
        assert_eq!(
            info["egress"]["dns"],
            json!([lan_srv.to_string()]),
            "{info}"
        );

        // The internet yes; the LAN, the host (its LAN address, the
        // child's gateway, the API port) no.
        assert_eq!(
            probe(&p, &plain, public, PORT).await,
            Probe::Reached("hello-from-public".into())
        );
        assert_eq!(probe(&p, &plain, lan_srv, PORT).await, Probe::Dropped);
        for host in [lan_root, pub_root, gateway] {
            assert_eq!(
                probe(&p, &plain, host, api_port).await,
                Probe::Dropped,
                "host address {host}:{api_port}"
            );
        }
        // DNS to the resolver works although it is in the LAN; nothing
        // else at its address does (the HTTP server above).
        let answer = lookup(&p, &plain).await;
        assert!(answer.contains(&lan_db.to_string()), "{answer}");

        // An address the host gets after the child started, forwarded
        // (DNAT, as Docker publishes ports) to the LAN server: the public
        // namespace reaches the LAN through it, a sandbox does not.
        let late = Ipv4Addr::new(100, 128, c2, 20);
        let table = format!("fdt_dnat_{sfx}");
        lan.add(
            &format!("ip addr add {late}/32 dev fdu{sfx}"),
            &format!("ip addr del {late}/32 dev fdu{sfx}"),
        );
        lan.add(
            &format!(
                "nft add table ip {table} && nft add chain ip {table} pre '{{ type nat hook prerouting priority -100; }}' && nft add rule ip {table} pre ip daddr {late} tcp dport 8081 dnat to {lan_srv}:{PORT}"
            ),
            &format!("nft delete table ip {table}"),
        );
        let (_, via) = pubns.sh_in(&format!(
            "printf \"GET / HTTP/1.0\\r\\n\\r\\n\" | busybox nc -w 4 {late} 8081"
        ));
        assert!(
            via.contains("hello-from-lan"),
            "the port forward works: {via}"
        );
        assert_eq!(probe(&p, &plain, late, 8081).await, Probe::Dropped);
        assert_eq!(probe(&p, &plain, late, api_port).await, Probe::Dropped);

        // allow_out opens the LAN server (and nothing else of the host).
        let (st, v) = p
            .post(
                "/v1/sandboxes",
                json!({"snapshot_tag": "net", "network": {"allow_out": [lan_srv.to_string()]}}),
            )
            .await;
        assert_eq!(st, 201, "{v}");
        let allowed = ids(&v)[0].clone();
        assert_eq!(
            probe(&p, &allowed, lan_srv, PORT).await,
            Probe::Reached("hello-from-lan".into())
        );
        assert_eq!(
            probe(&p, &allowed, lan_root, api_port).await,
            Probe::Dropped
        );
        let (_, info) = p.get(&format!("/v1/sandboxes/{allowed}")).await;
        assert_eq!(
            info["egress"]["allow_out"],
            json!([lan_srv.to_string()]),
            "{info}"
        );

        // A pooled child: the same default, written while it was parked.
        let (st, v) = p.put("/v1/pools/net", json!({"min_ready": 1})).await;
        assert_eq!(st, 200, "{v}");
        p.wait_pool("net", 1).await;
        let (st, v) = p
            .post("/v1/sandboxes", json!({"snapshot_tag": "net"}))
            .await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(v[0]["pool_hit"], true, "{v}");
        let pooled = ids(&v)[0].clone();
        assert_eq!(
            probe(&p, &pooled, public, PORT).await,
            Probe::Reached("hello-from-public".into())
        );
        assert_eq!(probe(&p, &pooled, lan_srv, PORT).await, Probe::Dropped);
        assert_eq!(probe(&p, &pooled, late, 8081).await, Probe::Dropped);
        let answer = lookup(&p, &pooled).await;
        assert!(answer.contains(&lan_db.to_string()), "{answer}");
        let (st, _) = p.delete("/v1/pools/net").await;
        assert_eq!(st, 204);
        (plain, allowed, pooled)
    });

    // kill -9: the rules live in the children's namespaces and the host's
    // table, not in poold, so they hold while it is down...
    let (_, info) = block_on(p.get(&format!("/v1/sandboxes/{plain}")));
    let netns = info["netns"].as_str().unwrap().to_string();
    p.kill9();
    let (ok, table) = sh(&format!(
        "ip netns exec {netns} nft list set inet forkd internal"
    ));
    assert!(ok && table.contains("10.0.0.0/8"), "{table}");
    let (ok, host) = sh("nft list chain inet forkd prerouting");
    assert!(ok && host.contains("fib daddr type"), "{host}");
    // A poold killed mid-update (`PUT .../network`) left a deny-all
    // policy recorded but pending: the restart writes it.
    let state = home.dir.join("poold/state.json");
    let mut st: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    let rec = &mut st["sandboxes"][&pooled];
    assert!(rec.is_object(), "{st}");
    rec["egress"] = json!({"allow_out": [], "deny_out": ["0.0.0.0/0"]});
    rec["egress_pending"] = json!(true);
    std::fs::write(&state, serde_json::to_vec_pretty(&st).unwrap()).unwrap();
    // ...and after a restart, which re-adopts the children.
    let p = Poold::start_env(&home.dir, &args, Some(token.as_str()), &env);
    block_on(async {
        assert_eq!(
            probe(&p, &plain, public, PORT).await,
            Probe::Reached("hello-from-public".into())
        );
        assert_eq!(probe(&p, &plain, lan_srv, PORT).await, Probe::Dropped);
        assert_eq!(
            probe(&p, &plain, Ipv4Addr::new(100, 128, c2, 20), 8081).await,
            Probe::Dropped
        );
        assert_eq!(
            probe(&p, &allowed, lan_srv, PORT).await,
            Probe::Reached("hello-from-lan".into())
        );
        assert_eq!(probe(&p, &pooled, lan_srv, PORT).await, Probe::Dropped);
        assert_eq!(
            probe(&p, &pooled, public, PORT).await,
            Probe::Dropped,
            "the pending deny-all was written at adoption"
        );
        let (_, info) = p.get(&format!("/v1/sandboxes/{pooled}")).await;
        assert_eq!(info["egress"]["deny_out"], json!(["0.0.0.0/0"]), "{info}");
        let (_, info) = p.get(&format!("/v1/sandboxes/{plain}")).await;
        assert!(
            info["egress"]["internal_denied"]
                .to_string()
                .contains("10.0.0.0/8"),
            "{info}"
        );
        for id in [&plain, &allowed, &pooled] {
            let (st, v) = p.delete(&format!("/v1/sandboxes/{id}")).await;
            assert_eq!(st, 204, "{v}");
        }
    });
    drop(p);
    drop(pubns);
    drop(lan);
}
