//! The guest as envd presents it: one user, its home, and paths resolved
//! against that home.

use crate::error::{RpcError, RpcResult};

/// The only user processes run as, and its home (relative paths resolve
/// against it).
pub const USER: &str = "root";
/// `USER`'s home.
pub const HOME: &str = "/root";

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
