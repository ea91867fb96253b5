//! File metadata: user-defined key/value pairs kept on a guest file as
//! `user.e2b.<key>` extended attributes. That is E2B's envd convention, so
//! metadata written through poold, through an E2B SDK, or with `setfattr`
//! in the guest is one set.
//!
//! Invariants: a set that passes [`validate`] can be stored on ext4 (each
//! name fits the kernel's 255-byte xattr name limit, and names plus values
//! fit one 4 KiB block); keys and values are printable US-ASCII, so they
//! travel as HTTP header values and JSON strings unchanged. Both ends
//! check: the host to answer a clear 400, the agent because the host is
//! not its only possible caller.

use std::collections::BTreeMap;

/// A file's metadata, keys without the [`XATTR_PREFIX`].
pub type Metadata = BTreeMap<String, String>;

/// The xattr namespace metadata lives in (`user.` is the namespace an
/// unprivileged process may write; `e2b.` keeps other tools' `user.*` out).
pub const XATTR_PREFIX: &str = "user.e2b.";

/// Longest key: the kernel limits a whole xattr name to 255 bytes.
pub const MAX_KEY_BYTES: usize = 255 - XATTR_PREFIX.len();

/// Most bytes of names (with the prefix) plus values on one file: ext4
/// keeps a file's xattrs in one 4 KiB block.
pub const MAX_TOTAL_BYTES: usize = 4096;

/// Why `m` cannot be stored, in words a caller can act on.
pub fn validate(m: &Metadata) -> Result<(), String> {
    let mut total = 0;
    for (k, v) in m {
        if k.is_empty() {
            return Err("a metadata key is empty: name every key".into());
        }
        if k.len() > MAX_KEY_BYTES {
            return Err(format!(
                "metadata key {k:?} is {} bytes, over the {MAX_KEY_BYTES}-byte limit",
                k.len()
            ));
        }
        printable("key", k, k)?;
        printable("value for key", k, v)?;
        total += XATTR_PREFIX.len() + k.len() + v.len();
    }
    if total > MAX_TOTAL_BYTES {
        return Err(format!(
            "the metadata is {total} bytes (keys with their {XATTR_PREFIX:?} prefix, and values), \
             over the {MAX_TOTAL_BYTES} a file can hold; store less"
        ));
    }
    Ok(())
}

fn printable(what: &str, key: &str, s: &str) -> Result<(), String> {
    match s.bytes().position(|c| !(0x20..=0x7e).contains(&c)) {
        None => Ok(()),
        Some(i) => Err(format!(
            "metadata {what} {key:?} has a byte outside printable US-ASCII at offset {i}; \
             keys and values must be printable ASCII (0x20-0x7e)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(k: &str, v: &str) -> Metadata {
        [(k.to_string(), v.to_string())].into()
    }

    #[test]
    fn what_fits_an_inode_and_a_header_passes() {
        assert!(validate(&Metadata::new()).is_ok());
        assert!(validate(&one("owner", "agent 7")).is_ok());
        assert!(validate(&one(&"k".repeat(MAX_KEY_BYTES), "v")).is_ok());
    }

    #[test]
    fn what_cannot_be_stored_or_sent_is_refused() {
        assert!(validate(&one("", "v")).unwrap_err().contains("empty"));
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        assert!(validate(&one(&long, "v")).unwrap_err().contains("limit"));
        assert!(validate(&one("k", "caf\u{e9}"))
            .unwrap_err()
            .contains("offset 3"));
        assert!(validate(&one("a\nb", "v")).unwrap_err().contains("key"));
        let big: Metadata = (0..40)
            .map(|i| (format!("k{i}"), "v".repeat(100)))
            .collect();
        assert!(validate(&big).unwrap_err().contains("4096"));
    }
}
