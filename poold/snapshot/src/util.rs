//! Small helpers shared across modules.

use rand::Rng;

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A random lowercase hex string of `bytes` random bytes (unguessable ids).
pub fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::rngs::OsRng.fill(&mut b[..]);
    hex::encode(b)
}

/// A Unix time as RFC 3339 UTC (`2026-11-23T05:01:02Z`).
pub fn format_unix(secs: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
    humantime::format_rfc3339_seconds(t).to_string()
}
