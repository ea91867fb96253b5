//! Bearer tokens, shared by poold's API and the hub server: loading one from
//! a file, refusing weak ones, and comparing in constant time.

use anyhow::{bail, Context, Result};
use subtle::ConstantTimeEq;

/// Shortest token accepted.
pub const MIN_TOKEN_LEN: usize = 32;

/// Reads a token: the first line of `path`, trimmed. An empty file is an
/// error (it would mean "no auth" by accident).
pub fn read_token_file(path: &std::path::Path) -> Result<String> {
    let s = std::fs::read_to_string(path)
        .with_context(|| format!("reading token file {}", path.display()))?;
    let t = s.lines().next().unwrap_or("").trim().to_string();
    if t.is_empty() {
        bail!("token file {} is empty", path.display());
    }
    Ok(t)
}

/// Refuses tokens that are short, repetitive or placeholders.
pub fn check_token(token: &str) -> Result<()> {
    let lower = token.to_ascii_lowercase();
    let distinct = token
        .bytes()
        .collect::<std::collections::HashSet<_>>()
        .len();
    let placeholder = [
        "changeme",
        "change-me",
        "password",
        "secret",
        "token",
        "example",
        "xxxx",
        "placeholder",
        "your",
    ]
    .iter()
    .any(|p| lower.contains(p));
    if token.len() < MIN_TOKEN_LEN || distinct < 10 || placeholder {
        bail!(
            "the token is too weak (at least {MIN_TOKEN_LEN} characters of real randomness, no placeholder); make one with: head -c 32 /dev/urandom | base64 > TOKEN_FILE"
        );
    }
    if token.bytes().any(|b| !b.is_ascii_graphic()) {
        bail!("the token may hold only printable ASCII characters without spaces");
    }
    Ok(())
}

/// Whether an `Authorization` header value carries `want` as a bearer token.
/// Constant time in the token's content.
pub fn bearer_matches(header: Option<&str>, want: &str) -> bool {
    let got = header.and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
    got.len() == want.len() && bool::from(got.as_bytes().ct_eq(want.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_rules() {
        assert!(check_token("short").is_err());
        assert!(check_token(&"a".repeat(64)).is_err());
        assert!(check_token("changeme-changeme-changeme-changeme").is_err());
        assert!(check_token("Zq3v9LkP0xW7rT2mB8nC4dF6gH1jK5sA").is_ok());
        assert!(check_token("Zq3v9LkP0xW7rT2m B8nC4dF6gH1jK5sA").is_err());
    }

    #[test]
    fn bearer() {
        let t = "Zq3v9LkP0xW7rT2mB8nC4dF6gH1jK5sA";
        assert!(bearer_matches(Some(&format!("Bearer {t}")), t));
        assert!(!bearer_matches(Some(t), t));
        assert!(!bearer_matches(None, t));
        assert!(!bearer_matches(
            Some("Bearer Zq3v9LkP0xW7rT2mB8nC4dF6gH1jK5sB"),
            t
        ));
    }
}
