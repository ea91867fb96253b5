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
