//! Byte ranges of a file: what a child read (recording) and what to pull in
//! ahead of use (prefetch). Serialized as a JSON array of `[offset, len]`.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// `(offset, len)` pairs, as on the wire: `[[offset, len], ...]`.
pub type RangeList = Vec<(u64, u64)>;

/// Sorts and merges overlapping or touching ranges; drops empty ones.
pub fn merge(mut ranges: RangeList) -> RangeList {
    ranges.retain(|&(_, len)| len > 0);
    ranges.sort_unstable();
    let mut out: RangeList = Vec::with_capacity(ranges.len());
    for (off, len) in ranges {
        let end = off.saturating_add(len);
        match out.last_mut() {
            Some((o, l)) if off <= *o + *l => *l = (*l).max(end - *o),
            _ => out.push((off, len)),
        }
    }
    out
}

/// Total bytes covered by a merged list.
pub fn total_bytes(ranges: &[(u64, u64)]) -> u64 {
    ranges.iter().map(|&(_, l)| l).sum()
}

/// Parses a range list: either `[[off, len], ...]` or an object with a
/// `"ranges"` field holding that array (what `record_stop` answers).
pub fn parse(text: &str) -> Result<RangeList> {
    let v: serde_json::Value = serde_json::from_str(text).context("range list is not JSON")?;
    let arr = match &v {
        serde_json::Value::Object(m) => m.get("ranges").cloned().unwrap_or_default(),
        _ => v,
    };
    if !arr.is_array() {
        bail!(
            "expected a JSON array of [offset, len] pairs (or an object with a \"ranges\" array)"
        );
    }
    let list: RangeList = serde_json::from_value(arr)
        .context("expected a JSON array of [offset, len] pairs of non-negative integers")?;
    Ok(merge(list))
}

/// Reads and parses a range-list file (see [`parse`]).
pub fn read_file(path: &Path) -> Result<RangeList> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading range list {}", path.display()))?;
    parse(&text).with_context(|| format!("parsing range list {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_overlapping_and_touching() {
        let m = merge(vec![(100, 10), (0, 4096), (4096, 10), (50, 0), (105, 20)]);
        assert_eq!(m, vec![(0, 4106)]);
        assert_eq!(
            merge(vec![(0, 10), (20, 5), (12, 3)]),
            vec![(0, 10), (12, 3), (20, 5)]
        );
        assert_eq!(merge(vec![(0, 10), (5, 2)]), vec![(0, 10)]);
        assert_eq!(merge(vec![(10, 5), (0, 10)]), vec![(0, 15)]);
        assert_eq!(total_bytes(&merge(vec![(0, 10), (20, 5)])), 15);
    }

    #[test]
    fn parses_both_forms() {
        assert_eq!(parse("[[0,10],[5,10]]").unwrap(), vec![(0, 15)]);
        assert_eq!(
            parse(r#"{"ranges":[[4096,4096]],"bytes":4096}"#).unwrap(),
            vec![(4096, 4096)]
        );
        assert!(parse("[[-1,2]]").is_err());
        assert!(parse("{}").is_err());
    }
}
