//! The guest as envd presents it: accounts, their homes, and paths
//! resolved against the home of the account a request acts as.
//!
//! Invariants:
//! - A request acts as the account it names (`Authorization: Basic
//!   base64("<user>:")`, or `?username=` on `/files`), else as the
//!   sandbox's default: E2B's `user` when the guest has that account (E2B's
//!   images do: `e2b-base`, `code-interpreter`), else root.
//! - An account the guest does not have is refused (401 /
//!   `unauthenticated`, as envd does); it never falls back to root.
//! - Accounts come from the guest's own `/etc/passwd`, read through the
//!   agent and cached per sandbox; a name the cache lacks is looked up
//!   again (a sandbox may add users at any time).

use crate::error::{Code, RpcError, RpcResult};
use std::collections::HashMap;

/// Root's name.
pub const ROOT: &str = "root";
/// Root's home.
pub const ROOT_HOME: &str = "/root";
/// E2B's default account: commands, files and relative paths use it when a
/// request names none and the guest has it.
pub const DEFAULT_USER: &str = "user";

/// The account a request acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// Login name.
    pub name: String,
    /// Home directory (relative paths resolve against it).
    pub home: String,
}

impl Account {
    /// Root, in `/root`.
    pub fn root() -> Account {
        Account {
            name: ROOT.into(),
            home: ROOT_HOME.into(),
        }
    }

    /// The user to name in agent requests: `None` for root (the agent's
    /// default, and what an agent without user support does).
    pub fn agent_user(&self) -> Option<&str> {
        (self.name != ROOT).then_some(self.name.as_str())
    }

    /// Resolves a path of this account's request (see [`resolve_path`]).
    pub fn resolve(&self, p: &str) -> RpcResult<String> {
        resolve_path(p, &self.home)
    }
}

/// Accounts of a guest: login name -> home.
pub type Accounts = HashMap<String, String>;

/// Parses `/etc/passwd`: name -> home, for lines with seven fields and an
/// absolute home (`/` otherwise, as login does).
pub fn parse_passwd(text: &str) -> Accounts {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 7 || f[0].is_empty() || f[0].starts_with('#') {
                return None;
            }
            let home = if f[5].starts_with('/') { f[5] } else { "/" };
            Some((f[0].to_string(), home.to_string()))
        })
        .collect()
}

/// The account `asked` names (`None` or empty: the default) among
/// `accounts`; `None` when it is not there.
pub fn pick(accounts: &Accounts, asked: Option<&str>) -> Option<Account> {
    let name = match asked.filter(|a| !a.is_empty()) {
        Some(a) => a,
        None if accounts.contains_key(DEFAULT_USER) => DEFAULT_USER,
        None => ROOT,
    };
    if name == ROOT {
        return Some(Account::root());
    }
    accounts.get(name).map(|home| Account {
        name: name.to_string(),
        home: home.clone(),
    })
}

/// The refusal of an account the guest lacks.
pub fn no_such_user(name: &str) -> RpcError {
    RpcError::new(
        Code::Unauthenticated,
        format!("user {name:?} does not exist in the sandbox (its /etc/passwd); use an existing user, or \"root\""),
    )
}

/// Resolves a guest path as envd does: relative (or `~/`) against the home.
pub fn resolve_path(p: &str, home: &str) -> RpcResult<String> {
    let abs = if p.is_empty() || p == "~" {
        home.to_string()
    } else if let Some(rest) = p.strip_prefix("~/") {
        format!("{home}/{rest}")
    } else if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{home}/{p}")
    };
    rootfs_init::protocol::validate_guest_path(&abs).map_err(|e| RpcError::invalid(e.message))?;
    Ok(abs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        user:x:1000:1000::/home/user:/bin/bash\n\
        odd:x:7:7::relative:/bin/sh\n\
        short:x:1\n";

    #[test]
    fn paths_resolve_like_envd() {
        assert_eq!(resolve_path("", ROOT_HOME).unwrap(), "/root");
        assert_eq!(resolve_path("a.txt", ROOT_HOME).unwrap(), "/root/a.txt");
        assert_eq!(resolve_path("~/x", "/home/user").unwrap(), "/home/user/x");
        assert_eq!(resolve_path("/tmp/x", ROOT_HOME).unwrap(), "/tmp/x");
        assert!(resolve_path("/a\0b", ROOT_HOME).is_err());
    }

    #[test]
    fn the_default_is_user_when_the_guest_has_it() {
        let a = parse_passwd(PASSWD);
        assert_eq!(a.len(), 3);
        assert_eq!(a["odd"], "/");
        let user = pick(&a, None).unwrap();
        assert_eq!(
            (user.name.as_str(), user.home.as_str()),
            ("user", "/home/user")
        );
        assert_eq!(user.agent_user(), Some("user"));
        assert_eq!(pick(&a, Some("")).unwrap(), user);
        let root = pick(&a, Some("root")).unwrap();
        assert_eq!(root, Account::root());
        assert_eq!(root.agent_user(), None);
        assert_eq!(pick(&a, Some("nobody")), None);
        // A guest without E2B's account: root, as before.
        let only_root = parse_passwd("root:x:0:0:root:/root:/bin/sh\n");
        assert_eq!(pick(&only_root, None).unwrap(), Account::root());
        assert_eq!(pick(&only_root, Some("user")), None);
    }
}
