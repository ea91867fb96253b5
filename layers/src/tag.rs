//! Name rules: the one tag rule of the project, and snapshot file names.
//!
//! Dependency-free on purpose: the CLI and the daemon call [`validate_tag`] on
//! every request.

use std::fmt;

/// Longest tag accepted.
pub const MAX_TAG_LEN: usize = 64;

/// Tags the rule admits but forkd-fs needs for itself (`MOUNT/by-id/`).
pub const RESERVED_TAGS: &[&str] = &["by-id"];

/// A tag that breaks the project's tag rule `^[A-Za-z0-9_-]{1,64}$`, or a
/// reserved one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagError {
    tag: String,
    reserved: bool,
}

impl TagError {
    /// The refused tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }
}

impl fmt::Display for TagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.reserved {
            return write!(
                f,
                "invalid tag '{}': the name is reserved (the store's mount uses it); pick another",
                self.tag
            );
        }
        write!(
            f,
            "invalid tag '{}': 1-64 chars, ASCII alnum or dash/underscore",
            self.tag
        )
    }
}

impl std::error::Error for TagError {}

/// Checks the project's single tag rule: `^[A-Za-z0-9_-]{1,64}$`.
///
/// This keeps tags safe as path components, URL segments and shell words
/// (`..`, `/`, `.` and the empty string are all refused).
pub fn validate_tag(tag: &str) -> Result<(), TagError> {
    let ok = !tag.is_empty()
        && tag.len() <= MAX_TAG_LEN
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    let reserved = RESERVED_TAGS.contains(&tag);
    if ok && !reserved {
        Ok(())
    } else {
        Err(TagError {
            tag: tag.to_string(),
            reserved,
        })
    }
}

/// Checks a snapshot file name: `^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$` and no `..`.
///
/// File names become paths on the FUSE mount, so they must be one safe
/// path component.
pub fn is_valid_file_name(name: &str) -> bool {
    let b = name.as_bytes();
    let first_ok = b
        .first()
        .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_');
    first_ok
        && b.len() <= 64
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
        && !name.contains("..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_rule() {
        for bad in ["", "../x", "a/b", ".", "..", "a b", "é", &"a".repeat(65)] {
            let e = validate_tag(bad).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("invalid tag '{bad}': 1-64 chars, ASCII alnum or dash/underscore")
            );
        }
        for good in ["a", "A-z_09", "-", "_", &"a".repeat(64)] {
            validate_tag(good).unwrap();
        }
        assert!(validate_tag("by-id")
            .unwrap_err()
            .to_string()
            .contains("reserved"));
    }

    #[test]
    fn file_name_rule() {
        for good in ["memory.bin", "vmstate", "rootfs.img", "_x", "a-b.c_d"] {
            assert!(is_valid_file_name(good), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "-x",
            "a/b",
            "a..b",
            &"a".repeat(65),
        ] {
            assert!(!is_valid_file_name(bad), "{bad}");
        }
    }
}
