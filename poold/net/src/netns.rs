//! Named network namespaces, the way `ip netns` keeps them: an empty file in
//! [`NS_DIR`] with the namespace bind-mounted over it. Work inside a
//! namespace runs on a thread of its own that `setns`es first, so no thread
//! of the caller's runtime ever changes namespace.

use crate::{NetError, Result};
use std::fs::File;
use std::os::fd::AsFd;
use std::path::PathBuf;

/// Where named namespaces live (shared with iproute2).
pub const NS_DIR: &str = "/run/netns";

/// The bind mount of namespace `name`.
pub fn netns_path(name: &str) -> PathBuf {
    PathBuf::from(NS_DIR).join(name)
}

/// Names are file names under [`NS_DIR`]: refuse anything else.
pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 200
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(NetError::Invalid(format!(
            "network namespace name {name:?}: 1-200 ASCII letters, digits, '-' or '_'"
        )));
    }
    Ok(())
}

/// Creates namespace `name` (fails if it exists).
pub(crate) fn create(name: &str) -> Result<()> {
    check_name(name)?;
    std::fs::create_dir_all(NS_DIR).map_err(|e| NetError::io(format!("creating {NS_DIR}"), e))?;
    let path = netns_path(name);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| NetError::io(format!("creating {}", path.display()), e))?;
    let p = path.clone();
    let r = std::thread::spawn(move || -> std::io::Result<()> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
        nix::mount::mount(
            Some("/proc/thread-self/ns/net"),
            &p,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )?;
        Ok(())
    })
    .join()
    .unwrap_or_else(|_| Err(std::io::Error::other("namespace thread panicked")));
    if let Err(e) = r {
        let _ = std::fs::remove_file(&path);
        return Err(NetError::io(
            format!("creating network namespace {name}"),
            e,
        ));
    }
    Ok(())
}

/// Removes namespace `name`; a missing one is not an error. The namespace
/// (and every link in it) goes away once no process is left in it.
pub(crate) fn delete(name: &str) -> Result<()> {
    check_name(name)?;
    let path = netns_path(name);
    match nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => {
            return Err(NetError::io(
                format!("unmounting {}", path.display()),
                e.into(),
            ))
        }
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NetError::io(format!("removing {}", path.display()), e)),
    }
}

/// Names under [`NS_DIR`] starting with `prefix`.
pub(crate) fn list(prefix: &str) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(NS_DIR) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Opens namespace `name` (for `setns`).
pub fn open(name: &str) -> Result<File> {
    check_name(name)?;
    let path = netns_path(name);
    File::open(&path).map_err(|e| NetError::io(format!("opening {}", path.display()), e))
}

/// Runs `f` on a fresh thread inside namespace `name` and returns its result.
pub(crate) fn run_in<T, F>(name: &str, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    let ns = open(name)?;
    let name = name.to_string();
    std::thread::spawn(move || {
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| NetError::io(format!("entering network namespace {name}"), e.into()))?;
        f()
    })
    .join()
    .unwrap_or_else(|_| Err(NetError::Invalid("namespace worker panicked".into())))
}

/// Writes a sysctl of the calling thread's network namespace (entries under
/// /proc/sys/net belong to the namespace of whoever opens them).
pub(crate) fn sysctl(key: &str, value: &str) -> Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| NetError::io(format!("writing {path}"), e))
}
