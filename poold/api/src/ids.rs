//! Sandbox ids, and the node token a named node mints into them
//! (docs/cluster.md, "Finding a sandbox").
//!
//! An id is `sb-` followed by 24 lowercase hex digits, as forkd's. A node
//! with a name (poold's `node_name`) starts every id with its name's
//! 4-digit token: the first digit's high bit set, then 15 bits of a hash
//! of the name; 80 random bits follow. A node without a name keeps that
//! high bit clear, so none of its ids reads as a token. Any gateway replica
//! then knows an id's node from the id alone, with no shared state.
//!
//! The hash is part of the wire format: FNV-1a (32 bits) folded to 15, the
//! same on every platform and in every version.

/// What every sandbox id starts with.
pub const ID_PREFIX: &str = "sb-";

/// Hex digits after [`ID_PREFIX`].
pub const ID_HEX_DIGITS: usize = 24;

/// Longest node name: a DNS name (a Kubernetes node or pod name fits).
pub const MAX_NODE_NAME: usize = 253;

/// Checks a node name: 1 to 253 of `a-z`, `0-9`, `-` and `.`, starting and
/// ending with a letter or digit (a DNS name, so a Kubernetes node name
/// can be used as is).
pub fn validate_node_name(name: &str) -> Result<(), String> {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = name.as_bytes();
    let ok = !bytes.is_empty()
        && bytes.len() <= MAX_NODE_NAME
        && bytes.iter().all(|&b| alnum(b) || b == b'-' || b == b'.')
        && alnum(bytes[0])
        && alnum(bytes[bytes.len() - 1]);
    if !ok {
        return Err(format!(
            "node name {name:?} must be 1-{MAX_NODE_NAME} of a-z, 0-9, '-' and '.', starting and ending with a letter or digit (e.g. the Kubernetes node name)"
        ));
    }
    Ok(())
}

/// The 4-hex-digit token ids minted by node `name` start with.
pub fn node_token(name: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    let t = 0x8000 | ((h ^ (h >> 16)) & 0x7fff);
    format!("{t:04x}")
}

/// A sandbox id from 24 random hex digits `random`: with `token` (a named
/// node's [`node_token`]) in front of its last 20, else with the first
/// digit's high bit cleared.
pub fn mint_id(token: Option<&str>, random: &str) -> String {
    debug_assert_eq!(random.len(), ID_HEX_DIGITS);
    match token {
        Some(t) => format!("{ID_PREFIX}{t}{}", &random[t.len()..]),
        None => {
            let first = u8::from_str_radix(&random[..1], 16).unwrap_or(0) & 0x7;
            format!("{ID_PREFIX}{first:x}{}", &random[1..])
        }
    }
}

/// The node token in sandbox id `id`, when a named node minted it.
pub fn id_token(id: &str) -> Option<&str> {
    let hex = id.strip_prefix(ID_PREFIX)?;
    if hex.len() != ID_HEX_DIGITS || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let first = u8::from_str_radix(&hex[..1], 16).ok()?;
    (first >= 8).then(|| &hex[..4])
}

#[cfg(test)]
mod tests {
    use super::*;

    const RANDOM: &str = "f0123456789abcdef0123456";

    #[test]
    fn a_named_nodes_ids_carry_its_token() {
        let t = node_token("poold-0");
        let id = mint_id(Some(&t), RANDOM);
        assert_eq!(id.len(), 3 + ID_HEX_DIGITS);
        assert_eq!(id_token(&id), Some(t.as_str()));
        assert_ne!(node_token("poold-1"), t);
        // Stable: a wire format, the same in every version.
        assert_eq!(node_token("a"), node_token("a"));
        assert_eq!(node_token("a"), "cd20");
    }

    #[test]
    fn an_unnamed_nodes_ids_never_read_as_a_token() {
        for first in "0123456789abcdef".chars() {
            let r = format!("{first}{}", &RANDOM[1..]);
            let id = mint_id(None, &r);
            assert_eq!(id_token(&id), None, "{id}");
            assert_eq!(id.len(), 3 + ID_HEX_DIGITS);
        }
    }

    #[test]
    fn ids_that_are_not_ours_have_no_token() {
        for id in [
            "",
            "sb-",
            "sb-8abc",
            "xx-f0123456789abcdef0123456",
            "sb-f0123456789abcdef012345g",
        ] {
            assert_eq!(id_token(id), None, "{id}");
        }
    }

    #[test]
    fn node_names_are_dns_names() {
        for ok in ["a", "poold-0", "ip-10-0-0-1.ec2.internal", &"x".repeat(253)] {
            assert!(validate_node_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            ".a",
            "A",
            "a_b",
            "a:1",
            "10.0.0.5:8889",
            &"x".repeat(254),
        ] {
            assert!(validate_node_name(bad).is_err(), "{bad}");
        }
    }
}
