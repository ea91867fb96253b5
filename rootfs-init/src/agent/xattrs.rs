//! File metadata on guest files ([`crate::protocol::metadata`]) as
//! `user.e2b.*` extended attributes.
//!
//! A write replaces the set through the open descriptor, so a rename
//! racing the write cannot point it at another file. Reads go by path and
//! follow a symlink, as envd's do, and are best-effort: an entry is still
//! reported when its metadata cannot be read. A filesystem without user
//! xattrs (tmpfs before Linux 6.6, /proc) stores none, as with envd; the
//! caller sees that in what is read back.

use crate::protocol::metadata::{Metadata, XATTR_PREFIX};
use std::fs::File;
use std::io;
use std::path::Path;
use xattr::FileExt;

/// Makes `m` the whole metadata set of `f`: keys it lacks are removed.
pub fn replace(f: &File, m: &Metadata) -> io::Result<()> {
    let existing = match f.list_xattr() {
        Err(e) if unsupported(&e) => return Ok(()),
        r => r?,
    };
    for name in existing {
        let Some(key) = name.to_str().and_then(|n| n.strip_prefix(XATTR_PREFIX)) else {
            continue;
        };
        if !m.contains_key(key) {
            match f.remove_xattr(&name) {
                Err(e) if e.raw_os_error() != Some(libc::ENODATA) => return Err(e),
                _ => {}
            }
        }
    }
    for (k, v) in m {
        match f.set_xattr(format!("{XATTR_PREFIX}{k}"), v.as_bytes()) {
            Err(e) if unsupported(&e) => return Ok(()),
            r => r?,
        }
    }
    Ok(())
}

/// The metadata of `path` (what a symlink leads to); empty when there is
/// none or it cannot be read.
pub fn read(path: &Path) -> Metadata {
    let Ok(names) = xattr::list_deref(path) else {
        return Metadata::new();
    };
    let mut m = Metadata::new();
    for name in names {
        let Some(key) = name.to_str().and_then(|n| n.strip_prefix(XATTR_PREFIX)) else {
            continue;
        };
        // Set in the guest with setfattr, a value may be any bytes; only
        // UTF-8 can be reported.
        if let Ok(Some(v)) = xattr::get_deref(path, &name) {
            if let Ok(v) = String::from_utf8(v) {
                m.insert(key.to_string(), v);
            }
        }
    }
    m
}

fn unsupported(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EOPNOTSUPP)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(pairs: &[(&str, &str)]) -> Metadata {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// A replace drops keys it was not given and leaves other namespaces'
    /// attributes alone. Skipped where the test dir has no user xattrs.
    #[test]
    fn a_replace_is_the_whole_set() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = File::create(&p).unwrap();
        if let Err(e) = f.set_xattr("user.other", b"kept") {
            assert!(unsupported(&e), "{e}");
            return;
        }
        replace(&f, &set(&[("a", "1"), ("b", "2")])).unwrap();
        assert_eq!(read(&p), set(&[("a", "1"), ("b", "2")]));
        replace(&f, &set(&[("b", "3")])).unwrap();
        assert_eq!(read(&p), set(&[("b", "3")]));
        replace(&f, &Metadata::new()).unwrap();
        assert!(read(&p).is_empty());
        assert_eq!(f.get_xattr("user.other").unwrap().unwrap(), b"kept");
    }
}
