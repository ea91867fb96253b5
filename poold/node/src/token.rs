//! Access tokens: the secret a front-end hands a sandbox's clients
//! (E2B's `envdAccessToken`), kept in the sandbox's record (and a paused
//! sandbox's workspace). Invariant: a token is compared only in constant
//! time and never printed.

use serde::{Deserialize, Serialize};

/// A sandbox's access token: 128 random bits as 32 hex digits. Compared
/// only in constant time ([`AccessToken::matches`]); never printed by
/// `Debug`.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AccessToken(String);

impl AccessToken {
    /// A fresh token.
    pub fn mint() -> AccessToken {
        AccessToken(forkd_snapshot::random_hex(16))
    }

    /// The token, to hand to the sandbox's client.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether there is none (a record from before tokens).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `got` is this token, compared in constant time (timing tells
    /// nothing of how much of it matched). An empty token matches nothing.
    pub fn matches(&self, got: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        !self.0.is_empty() && bool::from(self.0.as_bytes().ct_eq(got))
    }
}

impl std::fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() {
            "AccessToken(none)"
        } else {
            "AccessToken(..)"
        })
    }
}
