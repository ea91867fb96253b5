//! Signed file URLs: `sbx.download_url(path)` and `upload_url(path)` give
//! a `/files` URL on the sandbox plane that carries no header, only
//! `signature=v1_` + the unpadded base64 of
//! sha256(`path:operation:user:token[:expiration]`) as the SDKs compute it
//! from the sandbox's access token, and `signature_expiration` (Unix
//! seconds) when the URL expires. Such a request names no sandbox, so the
//! one whose token makes that signature is found by trying every sandbox,
//! each compared in constant time (as tokens are). A wrong, expired or
//! malformed signature is a 401; a URL for reading cannot write.

use crate::error::E2bError;
use crate::state::{E2b, E2bSandbox};
use base64::Engine;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// What a signed URL claims: the signature and what it was made over.
#[derive(Debug, PartialEq)]
pub struct Signed {
    path: String,
    /// `read` (GET) or `write` (POST).
    operation: &'static str,
    /// The `username` of the URL, or "" for the default account.
    user: String,
    signature: String,
    expiration: Option<u64>,
}

/// The signature claim of a `/files` request: None when its query has no
/// `signature` (a request with headers), an error when it is malformed.
pub fn claim(write: bool, query: &str) -> Option<Result<Signed, E2bError>> {
    let (mut path, mut user, mut sig, mut exp) = (None, String::new(), None, None);
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "path" => path = Some(v.into_owned()),
            "username" => user = v.into_owned(),
            "signature" => sig = Some(v.into_owned()),
            "signature_expiration" => exp = Some(v.into_owned()),
            _ => {}
        }
    }
    let signature = sig?;
    let parsed = (|| {
        let expiration = match exp {
            None => None,
            Some(e) => Some(e.parse::<u64>().map_err(|_| {
                E2bError::unauthorized("signature_expiration must be Unix seconds")
            })?),
        };
        Ok(Signed {
            path: path.unwrap_or_default(),
            operation: if write { "write" } else { "read" },
            user,
            signature,
            expiration,
        })
    })();
    Some(parsed)
}

/// The `v1_` signature of `s`'s claim under `token`.
fn sign(s: &Signed, token: &str) -> String {
    let mut raw = format!("{}:{}:{}:{token}", s.path, s.operation, s.user);
    if let Some(e) = s.expiration {
        raw.push_str(&format!(":{e}"));
    }
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The sandbox whose token signed `s`, checked against the time `now`.
pub fn verify(e: &E2b, s: &Signed, now: u64) -> Result<E2bSandbox, E2bError> {
    if s.expiration.is_some_and(|t| t < now) {
        return Err(E2bError::unauthorized(
            "this signed URL has expired; ask the SDK for a new one",
        ));
    }
    let mut found = None;
    for rec in e.node.list() {
        let want = sign(s, rec.access_token.as_str());
        if bool::from(want.as_bytes().ct_eq(s.signature.as_bytes())) {
            found = Some(rec.id);
        }
    }
    found.and_then(|id| e.sandbox(&id)).ok_or_else(|| {
        E2bError::unauthorized(
            "the URL's signature matches no sandbox: a wrong path, user or operation, or the sandbox is gone",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_the_sdks() {
        // From the Python SDK's get_signature("/home/user/a.txt", "read",
        // None, "tok").
        let s = claim(false, "path=%2Fhome%2Fuser%2Fa.txt&signature=x")
            .unwrap()
            .unwrap();
        assert_eq!(
            sign(&s, "tok"),
            "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY"
        );
        let s = claim(
            true,
            "path=a&username=root&signature=x&signature_expiration=1700000000",
        )
        .unwrap()
        .unwrap();
        assert_eq!((s.operation, s.user.as_str()), ("write", "root"));
        assert_eq!(s.expiration, Some(1_700_000_000));
        assert!(
            claim(false, "path=a").is_none(),
            "no signature: headers decide"
        );
        assert!(claim(false, "signature=x&signature_expiration=soon")
            .unwrap()
            .is_err());
    }
}
