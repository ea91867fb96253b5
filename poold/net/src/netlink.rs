//! Links, addresses and routes over rtnetlink. Each batch of requests runs
//! on a thread of its own (inside a namespace when asked) with a
//! current-thread runtime: a netlink socket belongs to the namespace of the
//! thread that opened it.

use crate::{NetError, Result};
use futures::TryStreamExt;
use rtnetlink::{new_connection, Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;

/// Runs `f` with a netlink handle in namespace `ns` (the caller's when None).
pub(crate) fn with_handle<T, F, Fut>(ns: Option<&str>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(Handle) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T>>,
{
    let run = move || -> Result<T> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| NetError::io("starting a netlink runtime", e))?;
        rt.block_on(async move {
            let (conn, handle, _) =
                new_connection().map_err(|e| NetError::io("opening a netlink socket", e))?;
            let task = tokio::spawn(conn);
            let r = f(handle).await;
            task.abort();
            r
        })
    };
    match ns {
        Some(ns) => crate::netns::run_in(ns, run),
        None => std::thread::spawn(run)
            .join()
            .unwrap_or_else(|_| Err(NetError::Invalid("netlink worker panicked".into()))),
    }
}

/// The errno of a netlink refusal, if it was one.
pub(crate) fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => Some(-m.raw_code()),
        _ => None,
    }
}

pub(crate) async fn index_of(h: &Handle, name: &str) -> Result<Option<u32>> {
    let mut links = h.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(l) => Ok(l.map(|l| l.header.index)),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(NetError::nl(format!("looking up {name}"), e)),
    }
}

pub(crate) async fn need_index(h: &Handle, name: &str) -> Result<u32> {
    index_of(h, name).await?.ok_or_else(|| {
        NetError::io(
            format!("link {name}"),
            std::io::Error::from_raw_os_error(libc::ENODEV),
        )
    })
}

/// Creates the veth pair `host`/`peer` in the current namespace. Returns
/// false when `host` already exists (its slot is taken).
pub(crate) async fn create_veth(h: &Handle, host: &str, peer: &str) -> Result<bool> {
    match h
        .link()
        .add(LinkVeth::new(host, peer).build())
        .execute()
        .await
    {
        Ok(()) => Ok(true),
        Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(NetError::nl(format!("creating veth {host}"), e)),
    }
}

pub(crate) async fn move_to_netns(h: &Handle, link: &str, ns: &std::fs::File) -> Result<()> {
    let idx = need_index(h, link).await?;
    h.link()
        .set(
            LinkUnspec::new_with_index(idx)
                .setns_by_fd(ns.as_raw_fd())
                .build(),
        )
        .execute()
        .await
        .map_err(|e| NetError::nl(format!("moving {link} into its namespace"), e))
}

/// Renames (when `new_name` is given), sets the MAC (when given), adds
/// `addr/prefix` (when given) and brings the link up.
pub(crate) async fn configure(
    h: &Handle,
    name: &str,
    new_name: Option<&str>,
    mac: Option<[u8; 6]>,
    addr: Option<(Ipv4Addr, u8)>,
) -> Result<u32> {
    let idx = need_index(h, name).await?;
    let shown = new_name.unwrap_or(name);
    if new_name.is_some() || mac.is_some() {
        let mut b = LinkUnspec::new_with_index(idx);
        if let Some(n) = new_name {
            b = b.name(n.to_string());
        }
        if let Some(m) = mac {
            b = b.address(m.to_vec());
        }
        h.link()
            .set(b.build())
            .execute()
            .await
            .map_err(|e| NetError::nl(format!("renaming or re-addressing {name}"), e))?;
    }
    if let Some((a, p)) = addr {
        match h.address().add(idx, IpAddr::V4(a), p).execute().await {
            Ok(()) => {}
            Err(e) if errno(&e) == Some(libc::EEXIST) => {}
            Err(e) => return Err(NetError::nl(format!("adding {a}/{p} to {shown}"), e)),
        }
    }
    h.link()
        .set(LinkUnspec::new_with_index(idx).up().build())
        .execute()
        .await
        .map_err(|e| NetError::nl(format!("bringing {shown} up"), e))?;
    Ok(idx)
}

pub(crate) async fn default_route(h: &Handle, via: Ipv4Addr) -> Result<()> {
    let r = RouteMessageBuilder::<Ipv4Addr>::new().gateway(via).build();
    match h.route().add(r).execute().await {
        Ok(()) => Ok(()),
        Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
        Err(e) => Err(NetError::nl(format!("adding a default route via {via}"), e)),
    }
}

/// Deletes link `name`; a missing one is not an error.
pub(crate) async fn delete_link(h: &Handle, name: &str) -> Result<()> {
    let Some(idx) = index_of(h, name).await? else {
        return Ok(());
    };
    match h.link().del(idx).execute().await {
        Ok(()) => Ok(()),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(()),
        Err(e) => Err(NetError::nl(format!("deleting {name}"), e)),
    }
}

/// Names of every link in the current namespace starting with `prefix`.
pub(crate) async fn links_with_prefix(h: &Handle, prefix: &str) -> Result<Vec<String>> {
    use rtnetlink::packet_route::link::LinkAttribute;
    let mut out = Vec::new();
    let mut links = h.link().get().execute();
    while let Some(l) = links
        .try_next()
        .await
        .map_err(|e| NetError::nl("listing links", e))?
    {
        for a in l.attributes {
            if let LinkAttribute::IfName(n) = a {
                if n.starts_with(prefix) {
                    out.push(n);
                }
            }
        }
    }
    Ok(out)
}

/// The interfaces default routes leave through (the uplinks).
pub(crate) async fn uplinks(h: &Handle) -> Result<Vec<String>> {
    use rtnetlink::packet_route::link::LinkAttribute;
    use rtnetlink::packet_route::route::RouteAttribute;
    let mut idxs = Vec::new();
    let mut routes = h
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute();
    while let Some(r) = routes
        .try_next()
        .await
        .map_err(|e| NetError::nl("listing routes", e))?
    {
        if r.header.destination_prefix_length != 0 || r.header.table != 254 {
            continue;
        }
        for a in r.attributes {
            if let RouteAttribute::Oif(i) = a {
                idxs.push(i);
            }
        }
    }
    let mut names = Vec::new();
    for i in idxs {
        let mut l = h.link().get().match_index(i).execute();
        if let Ok(Some(l)) = l.try_next().await {
            for a in l.attributes {
                if let LinkAttribute::IfName(n) = a {
                    names.push(n);
                }
            }
        }
    }
    names.sort();
    names.dedup();
    Ok(names)
}
