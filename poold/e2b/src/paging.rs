//! Paging as E2B's list endpoints do it: `limit` (1..=[`MAX_PAGE`]) items
//! a page, `nextToken` naming the last item of the page before, and an
//! `x-next-token` header on a full page that has more after it.

use crate::error::{E2bError, E2bResult};

/// Most items on one page (also the default).
pub const MAX_PAGE: usize = 100;

/// A `limit` query value.
pub fn parse_limit(v: &str) -> E2bResult<usize> {
    v.parse()
        .ok()
        .filter(|n| (1..=MAX_PAGE).contains(n))
        .ok_or_else(|| E2bError::bad_request(format!("limit must be 1-{MAX_PAGE}")))
}

/// Where the page after `token` starts in `keys` (0 without a token); a
/// token naming nothing listed is a 400 (`what` names the list).
pub fn start_after<'a>(
    mut keys: impl Iterator<Item = &'a str>,
    token: Option<&str>,
    what: &str,
) -> E2bResult<usize> {
    let Some(t) = token else { return Ok(0) };
    keys.position(|k| k == t).map(|i| i + 1).ok_or_else(|| {
        E2bError::bad_request(format!(
            "nextToken does not name a listed {what}; list from the start"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_tokens() {
        assert_eq!(parse_limit("2").unwrap(), 2);
        assert!(
            parse_limit("0").is_err() && parse_limit("101").is_err() && parse_limit("x").is_err()
        );
        let keys = ["a", "b", "c"];
        assert_eq!(start_after(keys.iter().copied(), None, "x").unwrap(), 0);
        assert_eq!(
            start_after(keys.iter().copied(), Some("b"), "x").unwrap(),
            2
        );
        assert!(start_after(keys.iter().copied(), Some("z"), "x").is_err());
    }
}
