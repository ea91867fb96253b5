//! Paging as E2B's list endpoints do it, for every front-end that pages an
//! E2B list (poold's E2B API, the gateway's merged lists): `limit`
//! (1..=[`MAX_PAGE`]) items a page, `nextToken` naming the last item of the
//! page before, and an `x-next-token` header on a full page that has more
//! after it. Errors are the message a 400 carries; each front-end maps them
//! into its own error type.

use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// Most items on one page (also the default).
pub const MAX_PAGE: usize = 100;

/// The header that names the last item of a full page with more after it.
pub const NEXT_TOKEN: &str = "x-next-token";

/// `page` as a JSON reply; `more_after`, the name of its last item when
/// more items follow, goes in [`NEXT_TOKEN`] (a name that cannot be a
/// header value is left out, so the client sees a last page, not an error).
pub fn reply(page: impl Serialize, more_after: Option<&str>) -> Response {
    let mut r = Json(page).into_response();
    if let Some(v) = more_after.and_then(|t| HeaderValue::from_str(t).ok()) {
        r.headers_mut().insert(NEXT_TOKEN, v);
    }
    r
}

/// A `limit` query value.
pub fn parse_limit(v: &str) -> Result<usize, String> {
    v.parse()
        .ok()
        .filter(|n| (1..=MAX_PAGE).contains(n))
        .ok_or_else(|| format!("limit must be 1-{MAX_PAGE}"))
}

/// Where the page after `token` starts in `keys` (0 without a token); a
/// token naming nothing listed is refused (`what` names the list).
pub fn start_after<'a>(
    mut keys: impl Iterator<Item = &'a str>,
    token: Option<&str>,
    what: &str,
) -> Result<usize, String> {
    let Some(t) = token else { return Ok(0) };
    keys.position(|k| k == t)
        .map(|i| i + 1)
        .ok_or_else(|| format!("nextToken does not name a listed {what}; list from the start"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_tokens() {
        assert_eq!(parse_limit("2").unwrap(), 2);
        assert_eq!(parse_limit("100").unwrap(), 100);
        assert!(
            parse_limit("0").is_err() && parse_limit("101").is_err() && parse_limit("x").is_err()
        );
        let keys = ["a", "b", "c"];
        assert_eq!(start_after(keys.iter().copied(), None, "x").unwrap(), 0);
        assert_eq!(
            start_after(keys.iter().copied(), Some("b"), "x").unwrap(),
            2
        );
        assert!(start_after(keys.iter().copied(), Some("z"), "x")
            .unwrap_err()
            .contains("listed x"));
    }

    #[test]
    fn a_page_names_its_last_item_only_when_more_follow() {
        let r = reply(["a", "b"], Some("b"));
        assert_eq!(r.headers()[NEXT_TOKEN], "b");
        assert!(reply(["a"], None).headers().get(NEXT_TOKEN).is_none());
        assert!(reply(["a"], Some("bad\nname"))
            .headers()
            .get(NEXT_TOKEN)
            .is_none());
    }
}
