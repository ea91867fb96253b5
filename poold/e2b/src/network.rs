//! E2B's `network` settings (docs/e2b.md, "Network"): what a create's
//! `network` and `allow_internet_access` become (the sandbox's egress
//! policy, and how its ports are reached by URL), and
//! `PUT /sandboxes/{id}/network`, which replaces a running sandbox's
//! egress as `sbx.update_network` / `sandbox.updateNetwork` send it.
//!
//! Egress (`allowOut`, `denyOut`, `dnsServers`, `allow_internet_access`)
//! can change while the sandbox runs; ingress (`allowPublicTraffic`,
//! `maskRequestHost`, `httpsPorts`) is set at create only, as in E2B.
//! Every key is checked here, and one poold cannot honour (E2B's egress
//! proxies: `rules`, `egressProxy`) is refused, never dropped.

use crate::control::bad;
use crate::error::{E2bError, E2bResult};
use crate::logs::Level;
use crate::state::E2b;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use forkd_net::{EgressPolicy, Ipv4Net, Target};
use forkd_node::PortAccess;
use serde_json::{Map, Value};
use std::net::Ipv4Addr;
use std::sync::Arc;

type R<T> = E2bResult<T>;

/// The DNS server E2B allows when `allowOut` names a domain and
/// `dnsServers` is left out.
const E2B_DNS: Ipv4Addr = Ipv4Addr::new(8, 8, 8, 8);
/// Most `dnsServers` entries (E2B's limit).
pub const MAX_DNS_SERVERS: usize = 10;
/// Most `httpsPorts` entries (E2B's limit).
pub const MAX_HTTPS_PORTS: usize = 128;

/// The keys of a create's `network` about egress, and about ingress.
const EGRESS_KEYS: [&str; 3] = ["allowOut", "denyOut", "dnsServers"];
const INGRESS_KEYS: [&str; 3] = ["allowPublicTraffic", "maskRequestHost", "httpsPorts"];

/// The egress of an E2B create, as forkd's spawn fields `(net, network)`
/// (docs/network.md). `allowOut`/`denyOut` take addresses, CIDRs and
/// domain names and allow wins, as in E2B; `allowOut` is also how an
/// internal address is opened, as in `/v1`. Without them the sandbox gets
/// the pool's or the config's policy: the public internet, nothing
/// internal. Unknown keys are refused; the ingress keys are
/// [`port_access_of`]'s.
pub(crate) fn egress_of(
    internet: Option<bool>,
    network: Option<&Value>,
) -> R<(Option<bool>, Option<EgressPolicy>)> {
    let no_internet = internet == Some(false);
    let Some(net) = network.filter(|v| !v.is_null()) else {
        return Ok((no_internet.then_some(false), None));
    };
    let obj = object(net, "network")?;
    check_keys(obj, "network", &[&EGRESS_KEYS, &INGRESS_KEYS])?;
    let policy = policy_of(obj, no_internet)?;
    if policy == EgressPolicy::default() {
        return Ok((None, None));
    }
    Ok((None, Some(policy)))
}

/// The policy of `obj`'s egress keys, denying everything else when
/// `no_internet` (E2B's allow-list form).
fn policy_of(obj: &Map<String, Value>, no_internet: bool) -> R<EgressPolicy> {
    let mut policy = EgressPolicy {
        allow_out: targets(obj, "allowOut")?,
        deny_out: targets(obj, "denyOut")?,
    };
    // E2B: with a domain in allowOut, its DNS servers are allowed too.
    let dns = dns_servers(obj.get("dnsServers"))?;
    if (policy.allow_out.iter()).any(|t| matches!(t, Target::Domain(_))) {
        let servers = dns.unwrap_or_else(|| vec![E2B_DNS]);
        let nets = servers.into_iter().map(Ipv4Net::from);
        policy.allow_out.extend(nets.map(Target::Net));
    }
    if no_internet {
        policy.deny_out.push(Target::Net(Ipv4Net::default()));
    }
    policy
        .validate()
        .map_err(|e| bad(format!("network: {e}")))?;
    Ok(policy)
}

fn object<'a>(v: &'a Value, what: &str) -> R<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| bad(format!("{what} must be an object ({{allowOut, denyOut}})")))
}

/// Refuses keys outside `known`, naming E2B's egress proxies where one
/// is asked for.
fn check_keys(obj: &Map<String, Value>, what: &str, known: &[&[&str]]) -> R<()> {
    for k in obj.keys() {
        if known.iter().any(|set| set.contains(&k.as_str())) {
            continue;
        }
        let why = match k.as_str() {
            "rules" | "egressProxy" if obj[k].is_null() => continue,
            "rules" if obj[k].as_object().is_some_and(Map::is_empty) => continue,
            "rules" | "egressProxy" => format!(
                "{what}.{k}: E2B's egress proxies (header rules, a SOCKS5 proxy) are not part of poold (docs/e2b.md, \"Not supported\"); leave {k} out and use allowOut/denyOut"
            ),
            k => format!("{what}.{k} is not an E2B network setting poold knows"),
        };
        return Err(bad(why));
    }
    Ok(())
}

/// `obj[key]`: a list of addresses, CIDRs and domain names (none when left
/// out or null).
fn targets(obj: &Map<String, Value>, key: &str) -> R<Vec<Target>> {
    let Some(v) = obj.get(key).filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let items = v
        .as_array()
        .ok_or_else(|| bad(format!("network.{key} must be a list of strings")))?;
    items
        .iter()
        .map(|t| {
            let s = t
                .as_str()
                .ok_or_else(|| bad(format!("network.{key}: {t} is not a string")))?;
            Target::parse(s).map_err(|e| bad(format!("network.{key}: {e}")))
        })
        .collect()
}

/// `network.dnsServers`: IPv4 addresses, at most [`MAX_DNS_SERVERS`];
/// None when left out (or null).
fn dns_servers(v: Option<&Value>) -> R<Option<Vec<Ipv4Addr>>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad_list = || {
        bad(format!(
            "network.dnsServers must be a list of at most {MAX_DNS_SERVERS} IPv4 addresses"
        ))
    };
    let items = v
        .as_array()
        .filter(|a| a.len() <= MAX_DNS_SERVERS)
        .ok_or_else(bad_list)?;
    let servers = items
        .iter()
        .map(|i| {
            i.as_str()
                .and_then(|s| s.trim().parse().ok())
                .ok_or_else(bad_list)
        })
        .collect::<R<Vec<Ipv4Addr>>>()?;
    Ok(Some(servers))
}

/// How clients reach the sandbox's ports by URL, from E2B's `network`
/// (docs/e2b.md, "Ports"): public, as in E2B, unless
/// `allowPublicTraffic: false` makes every request need the traffic token;
/// `maskRequestHost` (with `${PORT}`) is the `Host` the guest's server
/// sees; `httpsPorts` are the guest ports reached over TLS.
pub(crate) fn port_access_of(network: Option<&Value>) -> R<PortAccess> {
    let Some(obj) = network.and_then(Value::as_object) else {
        return Ok(PortAccess {
            public: true,
            ..PortAccess::default()
        });
    };
    let public = match obj.get("allowPublicTraffic") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(public)) => *public,
        Some(v) => {
            return Err(bad(format!(
                "network.allowPublicTraffic must be true or false, not {v}"
            )))
        }
    };
    let mask_host = match obj.get("maskRequestHost") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(check_mask(m)?),
        Some(v) => {
            return Err(bad(format!(
                "network.maskRequestHost must be a string, not {v}"
            )))
        }
    };
    let https_ports = https_ports(obj.get("httpsPorts"))?;
    Ok(PortAccess {
        public,
        mask_host,
        https_ports,
    })
}

/// A `maskRequestHost`: a `host[:port]` once `${PORT}` is replaced.
fn check_mask(m: &str) -> R<String> {
    let sample = m.replace(crate::ports::PORT_PLACEHOLDER, "80");
    let ok = m.len() <= 255
        && sample
            .parse::<axum::http::uri::Authority>()
            .is_ok_and(|a| a.as_str() == sample && !sample.contains('@'));
    if !ok {
        return Err(bad(format!(
            "network.maskRequestHost {m:?} is not a host[:port] (with ${{PORT}} for the port), e.g. \"localhost:${{PORT}}\""
        )));
    }
    Ok(m.to_string())
}

/// `network.httpsPorts`: distinct guest ports, 1–65535, at most
/// [`MAX_HTTPS_PORTS`], never envd's or the code interpreter's (served by
/// poold itself, over plain HTTP), sorted.
fn https_ports(v: Option<&Value>) -> R<Vec<u16>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let items = v
        .as_array()
        .ok_or_else(|| bad("network.httpsPorts must be a list of port numbers"))?;
    if items.len() > MAX_HTTPS_PORTS {
        return Err(bad(format!(
            "network.httpsPorts has {} entries; at most {MAX_HTTPS_PORTS} are allowed",
            items.len()
        )));
    }
    let mut ports = Vec::with_capacity(items.len());
    for i in items {
        let port = i
            .as_u64()
            .filter(|p| (1..=65535).contains(p))
            .ok_or_else(|| bad(format!("network.httpsPorts: {i} is not a port (1–65535)")))?
            as u16;
        if port == crate::ENVD_PORT || port == crate::INTERPRETER_PORT {
            return Err(bad(format!(
                "network.httpsPorts: {port} is envd's or the code interpreter's port, which poold serves itself over plain HTTP; leave it out"
            )));
        }
        if ports.contains(&port) {
            return Err(bad(format!(
                "network.httpsPorts: {port} is listed more than once"
            )));
        }
        ports.push(port);
    }
    ports.sort_unstable();
    Ok(ports)
}

/// `PUT /sandboxes/{id}/network`'s body (E2B's
/// `SandboxNetworkUpdateConfig`) as a policy: the whole egress, every key
/// left out cleared (so `{}` gives the node's default policy, None), as
/// E2B's update replaces rather than merges. `dnsServers` is taken as at
/// create (E2B's update has no such key: forkd's addition).
pub(crate) fn update_policy(body: &[u8]) -> R<Option<EgressPolicy>> {
    let v: Value = if body.iter().all(u8::is_ascii_whitespace) {
        Value::Object(Map::new())
    } else {
        serde_json::from_slice(body).map_err(|e| bad(format!("bad network body: {e}")))?
    };
    let obj = object(&v, "the network body")?;
    const INTERNET: [&str; 2] = ["allow_internet_access", "allowInternetAccess"];
    for k in INGRESS_KEYS {
        if obj.contains_key(k) {
            return Err(bad(format!(
                "{k} is set when a sandbox is created and cannot change while it runs; an update takes allowOut, denyOut and allow_internet_access"
            )));
        }
    }
    check_keys(obj, "network", &[&EGRESS_KEYS, &INTERNET])?;
    let internet = match INTERNET.iter().find_map(|k| obj.get(*k)) {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(bad(format!(
                "allow_internet_access must be true or false, not {v}"
            )))
        }
    };
    let policy = policy_of(obj, !internet)?;
    Ok((policy != EgressPolicy::default()).then_some(policy))
}

/// `PUT /sandboxes/{id}/network`: replaces a running sandbox's egress;
/// 204. A paused sandbox is 409 (resume it first), an unknown one 404.
pub(crate) async fn update(
    State(e): State<Arc<E2b>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> R<StatusCode> {
    let policy = update_policy(&body)?;
    if e.node.paused(&id).is_some() {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!(
                "sandbox {id} is paused: resume it (Sandbox.connect) before changing its network"
            ),
        ));
    }
    e.sandbox_or_404(&id)?;
    e.node.set_egress(&id, policy).await?;
    e.logs
        .record(&id, Level::Info, "Sandbox network updated", &[]);
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn egress_maps_e2b_network_settings() {
        let deny_all = forkd_net::Target::Net(forkd_net::Ipv4Net::default());
        assert_eq!(egress_of(None, None).unwrap(), (None, None));
        assert_eq!(egress_of(Some(true), None).unwrap(), (None, None));
        assert_eq!(egress_of(Some(false), None).unwrap(), (Some(false), None));
        let net = json!({"allowOut": ["10.0.5.20", "pypi.org"], "allowPublicTraffic": true});
        let (n, p) = egress_of(Some(true), Some(&net)).unwrap();
        assert_eq!(n, None);
        let p = p.unwrap();
        // A domain in allowOut allows E2B's default DNS server too.
        let google = forkd_net::Target::Net("8.8.8.8/32".parse().unwrap());
        assert_eq!(p.allow_out.len(), 3);
        assert_eq!(p.allow_out[2], google);
        assert!(p.deny_out.is_empty());
        // No internet plus an allow list: E2B's allow-list form.
        let (_, p) = egress_of(Some(false), Some(&net)).unwrap();
        assert_eq!(p.unwrap().deny_out, vec![deny_all]);
        assert_eq!(egress_of(None, Some(&json!({}))).unwrap(), (None, None));
        for (bad, why) in [
            (json!({"allowOut": ["10.0.0.1/8"]}), "host bits"),
            (json!({"allowOut": "1.2.3.4"}), "a list of strings"),
            (json!({"denyOut": [7]}), "not a string"),
            (json!({"allowOutt": []}), "allowOutt"),
            (json!(["1.2.3.4"]), "an object"),
            (json!({"dnsServers": ["dns.google"]}), "IPv4 addresses"),
            (json!({"dnsServers": vec!["1.1.1.1"; 11]}), "at most 10"),
        ] {
            let e = egress_of(None, Some(&bad)).unwrap_err();
            assert!(format!("{e:?}").contains(why), "{bad}: {e:?}");
        }
    }

    /// `dnsServers` replaces E2B's default server when allowOut names a
    /// domain (`[]`: none), and has no effect without one, as in E2B.
    #[test]
    fn dns_servers_follow_a_domain_in_allow_out() {
        let allowed = |net: Value| egress_of(None, Some(&net)).unwrap().1.map(|p| p.allow_out);
        let one = forkd_net::Target::Net("1.1.1.1/32".parse().unwrap());
        let with = allowed(json!({"allowOut": ["pypi.org"], "dnsServers": ["1.1.1.1"]})).unwrap();
        assert_eq!(with.len(), 2);
        assert_eq!(with[1], one);
        let none = allowed(json!({"allowOut": ["pypi.org"], "dnsServers": []})).unwrap();
        assert_eq!(none.len(), 1);
        let no_domain =
            allowed(json!({"allowOut": ["10.0.5.20"], "dnsServers": ["1.1.1.1"]})).unwrap();
        assert_eq!(no_domain.len(), 1);
        assert_eq!(allowed(json!({"dnsServers": ["1.1.1.1"]})), None);
    }

    #[test]
    fn port_access_maps_public_traffic_and_the_host_mask() {
        let open = PortAccess {
            public: true,
            ..PortAccess::default()
        };
        assert_eq!(port_access_of(None).unwrap(), open);
        let net = json!({"allowPublicTraffic": true, "allowOut": ["1.2.3.4"]});
        assert_eq!(port_access_of(Some(&net)).unwrap(), open);
        let closed = json!({"allowPublicTraffic": false, "maskRequestHost": "app.local:${PORT}"});
        let a = port_access_of(Some(&closed)).unwrap();
        assert!(!a.public);
        assert_eq!(a.mask_host.as_deref(), Some("app.local:${PORT}"));
        // Both keys pass the egress mapping untouched.
        assert_eq!(egress_of(None, Some(&closed)).unwrap(), (None, None));
        for (bad, why) in [
            (json!({"allowPublicTraffic": "no"}), "true or false"),
            (json!({"maskRequestHost": 7}), "a string"),
            (json!({"maskRequestHost": "a b"}), "host[:port]"),
            (json!({"maskRequestHost": "u@h"}), "host[:port]"),
            (json!({"maskRequestHost": "h/${PORT}"}), "host[:port]"),
        ] {
            let e = port_access_of(Some(&bad)).unwrap_err();
            assert!(format!("{e:?}").contains(why), "{bad}: {e:?}");
        }
    }

    #[test]
    fn https_ports_are_checked_as_e2b_checks_them() {
        let of = |v: Value| port_access_of(Some(&json!({ "httpsPorts": v })));
        assert_eq!(of(json!([8443, 443])).unwrap().https_ports, vec![443, 8443]);
        assert!(of(json!(null)).unwrap().https_ports.is_empty());
        let many: Vec<u16> = (1..=129).collect();
        for (bad, why) in [
            (json!([0]), "not a port"),
            (json!([65536]), "not a port"),
            (json!(["443"]), "not a port"),
            (json!(443), "a list"),
            (json!([443, 443]), "more than once"),
            (json!([crate::ENVD_PORT]), "envd's"),
            (json!([crate::INTERPRETER_PORT]), "code interpreter's"),
            (json!(many), "at most 128"),
        ] {
            let e = of(bad.clone()).unwrap_err();
            assert!(format!("{e:?}").contains(why), "{bad}: {e:?}");
        }
        // The egress mapping leaves the key to this one.
        let net = json!({"httpsPorts": [443]});
        assert_eq!(egress_of(None, Some(&net)).unwrap(), (None, None));
    }

    /// An update replaces the whole egress: what it leaves out is cleared,
    /// `allow_internet_access: false` denies the rest, ingress keys and
    /// E2B's proxies are refused.
    #[test]
    fn an_update_is_the_whole_egress() {
        let deny_all = Target::Net(Ipv4Net::default());
        assert_eq!(update_policy(b"").unwrap(), None);
        assert_eq!(update_policy(b"{}").unwrap(), None);
        let p = update_policy(br#"{"allowOut": ["1.2.3.4"], "allow_internet_access": false, "rules": null, "egressProxy": null}"#)
            .unwrap()
            .unwrap();
        assert_eq!(p.allow_out, vec![Target::parse("1.2.3.4").unwrap()]);
        assert_eq!(p.deny_out, vec![deny_all.clone()]);
        let p = update_policy(br#"{"allowInternetAccess": false}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            p,
            EgressPolicy {
                allow_out: vec![],
                deny_out: vec![deny_all]
            }
        );
        let p = update_policy(br#"{"denyOut": ["10.0.0.0/8"], "allow_internet_access": true}"#)
            .unwrap()
            .unwrap();
        assert_eq!(p.deny_out.len(), 1);
        // A domain brings E2B's DNS server, as at create.
        let p = update_policy(br#"{"allowOut": ["pypi.org"], "denyOut": ["0.0.0.0/0"]}"#)
            .unwrap()
            .unwrap();
        assert_eq!(p.allow_out[1], Target::Net("8.8.8.8/32".parse().unwrap()));
        for (bad, why) in [
            (&br#"{"allowPublicTraffic": false}"#[..], "created"),
            (br#"{"httpsPorts": [443]}"#, "created"),
            (br#"{"maskRequestHost": "x"}"#, "created"),
            (
                br#"{"egressProxy": {"address": "1.2.3.4:1080"}}"#,
                "egress proxies",
            ),
            (br#"{"rules": {"pypi.org": []}}"#, "egress proxies"),
            (br#"{"allowOutt": []}"#, "allowOutt"),
            (br#"{"allow_internet_access": "no"}"#, "true or false"),
            (br#"[]"#, "an object"),
            (br#"{"allowOut": "#, "bad network body"),
        ] {
            let e = update_policy(bad).unwrap_err();
            assert!(
                format!("{e:?}").contains(why),
                "{}: {e:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
