//! The guest's accounts, for requests that name a `user`: its ids, groups
//! and home, read from `/etc/passwd` and `/etc/group` at each request (a
//! sandbox may add users at any time, and the files are small).
//!
//! Invariant: a request that names a user who does not exist fails with
//! `not_found`; it never falls back to root.

use crate::protocol::{validate_guest_path, AgentError, ErrorKind};
use std::collections::HashMap;
use std::path::Path;

/// An account a process can run as and files can belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Every group the process gets: the primary one, then each group that
    /// lists the user as a member.
    pub groups: Vec<u32>,
    /// Home directory (absolute).
    pub home: String,
}

/// Finds `spec` (a login name, or a uid in decimal) in `etc/passwd` under `root`.
pub fn lookup_in(root: &Path, spec: &str) -> Result<User, AgentError> {
    let passwd = std::fs::read_to_string(root.join("etc/passwd"))
        .map_err(|e| AgentError::io("/etc/passwd", &e))?;
    let by_uid = spec.parse::<u32>().ok();
    let found = passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        let uid = f[2].parse::<u32>().ok()?;
        let gid = f[3].parse::<u32>().ok()?;
        (f[0] == spec || by_uid == Some(uid)).then(|| (f[0].to_string(), uid, gid, f[5]))
    });
    let Some((name, uid, gid, home)) = found else {
        return Err(AgentError::new(
            ErrorKind::NotFound,
            format!("no user {spec:?} in the guest's /etc/passwd (the image needs the account; a recipe adds one with [user])"),
        ));
    };
    let mut groups = vec![gid];
    if let Ok(group) = std::fs::read_to_string(root.join("etc/group")) {
        for line in group.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 4 {
                continue;
            }
            let Ok(g) = f[2].parse::<u32>() else { continue };
            if f[3].split(',').any(|m| m == name) && !groups.contains(&g) {
                groups.push(g);
            }
        }
    }
    let home = if home.starts_with('/') { home } else { "/" };
    Ok(User {
        name,
        uid,
        gid,
        groups,
        home: home.to_string(),
    })
}

/// [`lookup_in`] the guest's own `/etc`.
pub fn lookup(spec: &str) -> Result<User, AgentError> {
    lookup_in(Path::new("/"), spec)
}

/// [`lookup`] when a request names a user.
pub fn lookup_opt(spec: Option<&str>) -> Result<Option<User>, AgentError> {
    spec.map(lookup).transpose()
}

/// A request's path as an absolute one: absolute paths stay; with a user,
/// `~`, `~/x` and relative paths are under its home (E2B's rule).
pub fn resolve_path(path: &str, user: Option<&User>) -> Result<String, AgentError> {
    let joined = match user {
        Some(u) if !path.starts_with('/') => {
            let rest = path
                .strip_prefix("~/")
                .or(if path == "~" { Some("") } else { None })
                .unwrap_or(path);
            if rest.is_empty() {
                u.home.clone()
            } else {
                format!("{}/{rest}", u.home.trim_end_matches('/'))
            }
        }
        _ => path.to_string(),
    };
    validate_guest_path(&joined)?;
    Ok(joined)
}

/// Names of uids and gids, read once per request that reports many.
pub struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    /// The names under `root`'s `etc/passwd` and `etc/group` (none when unreadable).
    pub fn load_in(root: &Path) -> Names {
        let read = |file: &str| {
            std::fs::read_to_string(root.join(file))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let mut f = l.split(':');
                    let name = f.next()?;
                    let id = f.nth(1)?.parse::<u32>().ok()?;
                    Some((id, name.to_string()))
                })
                .rev() // the first entry of an id wins
                .collect::<HashMap<_, _>>()
        };
        Names {
            users: read("etc/passwd"),
            groups: read("etc/group"),
        }
    }

    /// The guest's names.
    pub fn load() -> Names {
        Names::load_in(Path::new("/"))
    }

    /// The name of `uid`, else the number (what envd reports).
    pub fn user(&self, uid: u32) -> String {
        self.users
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    /// The name of `gid`, else the number.
    pub fn group(&self, gid: u32) -> String {
        self.groups
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn etc() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("etc")).unwrap();
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbroken\n",
        )
        .unwrap();
        std::fs::write(
            d.path().join("etc/group"),
            "root:x:0:\nsudo:x:27:user\nuser:x:1000:\nother:x:5:root,user\n",
        )
        .unwrap();
        d
    }

    #[test]
    fn users_by_name_and_uid_with_their_groups() {
        let d = etc();
        let u = lookup_in(d.path(), "user").unwrap();
        assert_eq!((u.uid, u.gid, &u.home[..]), (1000, 1000, "/home/user"));
        assert_eq!(u.groups, vec![1000, 27, 5]);
        assert_eq!(lookup_in(d.path(), "1000").unwrap().name, "user");
        assert_eq!(lookup_in(d.path(), "0").unwrap().groups, vec![0, 5]);
        let e = lookup_in(d.path(), "nobody").unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        assert!(e.message.contains("\"nobody\""), "{e}");
    }

    #[test]
    fn relative_paths_are_under_the_home() {
        let d = etc();
        let u = lookup_in(d.path(), "user").unwrap();
        let r = |p: &str| resolve_path(p, Some(&u)).unwrap();
        assert_eq!(r("a.txt"), "/home/user/a.txt");
        assert_eq!(r("~/a/b"), "/home/user/a/b");
        assert_eq!(r("~"), "/home/user");
        assert_eq!(r("/etc/x"), "/etc/x");
        assert_eq!(
            resolve_path("a.txt", None).unwrap_err().kind,
            ErrorKind::BadRequest
        );
    }

    #[test]
    fn names_fall_back_to_numbers() {
        let d = etc();
        let n = Names::load_in(d.path());
        assert_eq!((n.user(1000), n.group(27)), ("user".into(), "sudo".into()));
        assert_eq!(
            (n.user(4242), n.group(4242)),
            ("4242".into(), "4242".into())
        );
    }
}
