//! Bounds every front-end shares: how much one request may move, how long
//! a TTL may be, how much a front-end may keep with a sandbox. Hostile
//! input is refused at these bounds before anything is held or stored.

use std::collections::BTreeMap;

/// Largest file read or written in one request: one agent frame's payload
/// (the agent reads and writes a file in one frame).
pub const MAX_FILE_BYTES: usize = rootfs_init::protocol::frame::MAX_PAYLOAD;

/// The longest TTL a sandbox may have (10 years).
pub const MAX_TTL_SECS: u64 = 10 * 365 * 24 * 3600;

/// Most sandboxes one spawn may ask for (a sanity cap).
pub const MAX_SPAWN: usize = 1000;

/// Most published ports per sandbox.
pub const MAX_PORTS: usize = 64;

/// At most this much of a sandbox's console log is served.
pub const LOG_TAIL_BYTES: u64 = 1 << 20;

/// Most metadata pairs a sandbox keeps.
pub const MAX_METADATA: usize = 64;

/// Most create-time environment variables a sandbox keeps.
pub const MAX_ENV_VARS: usize = 128;

/// Metadata within bounds: at most [`MAX_METADATA`] keys of 1-256 bytes,
/// values of at most 4096. The message is E2B's words (its front-end
/// passes it on as is).
pub fn check_metadata(m: &BTreeMap<String, String>) -> Result<(), String> {
    if m.len() > MAX_METADATA {
        return Err(format!("metadata: at most {MAX_METADATA} keys"));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > 256 || v.len() > 4096 {
            return Err(format!(
                "metadata {k:?}: keys must be 1-256 bytes, values at most 4096"
            ));
        }
    }
    Ok(())
}

/// Environment variables a shell accepts: names of letters, digits and
/// `_` not starting with a digit, values without NUL up to 32 KiB, at
/// most [`MAX_ENV_VARS`].
pub fn check_env(env: &BTreeMap<String, String>) -> Result<(), String> {
    if env.len() > MAX_ENV_VARS {
        return Err(format!("at most {MAX_ENV_VARS} environment variables"));
    }
    for (k, v) in env {
        let name_ok = !k.is_empty()
            && k.len() <= 256
            && !k.as_bytes()[0].is_ascii_digit()
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !name_ok {
            return Err(format!(
                "environment variable name {k:?}: letters, digits and '_', not starting with a digit"
            ));
        }
        if v.len() > 32 * 1024 || v.contains('\0') {
            return Err(format!(
                "environment variable {k}: value longer than 32 KiB or containing NUL"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_and_values() {
        let ok: BTreeMap<_, _> = [("FOO_1".to_string(), "x".to_string())].into();
        assert!(check_env(&ok).is_ok());
        for bad in ["1X", "A-B", "", "A B"] {
            let m: BTreeMap<_, _> = [(bad.to_string(), "x".to_string())].into();
            assert!(check_env(&m).is_err(), "{bad:?}");
        }
        let nul: BTreeMap<_, _> = [("A".to_string(), "a\0b".to_string())].into();
        assert!(check_env(&nul).is_err());
        let many: BTreeMap<_, _> = (0..=MAX_ENV_VARS)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        assert!(check_env(&many).is_err());
    }

    #[test]
    fn metadata_bounds() {
        let ok: BTreeMap<_, _> = [("run".to_string(), "x".to_string())].into();
        assert!(check_metadata(&ok).is_ok());
        let empty_key: BTreeMap<_, _> = [(String::new(), "x".to_string())].into();
        assert!(check_metadata(&empty_key).is_err());
        let big: BTreeMap<_, _> = [("k".to_string(), "x".repeat(4097))].into();
        assert!(check_metadata(&big).is_err());
        let many: BTreeMap<_, _> = (0..=MAX_METADATA)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        assert_eq!(
            check_metadata(&many).unwrap_err(),
            "metadata: at most 64 keys"
        );
    }
}
