//! Benchmarks that print numbers (never assert them): `forkd bench fork`,
//! `forkd bench spawn` and `forkd bench branch`. Results and the commands that produced them are
//! recorded in docs/BENCHMARKS.md.

#![warn(missing_docs)]

pub mod branch;
pub mod e2b;
pub mod fork;
pub mod mem;
pub mod spawn;

/// The median of `v` (0 when empty).
pub fn median(v: &[f64]) -> f64 {
    pct(v, 50.0)
}

/// The `p`th percentile of `v` by nearest rank (0 when empty).
pub fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

#[cfg(test)]
mod tests {
    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(super::median(&v), 50.0);
        assert_eq!(super::pct(&v, 99.0), 99.0);
        assert_eq!(super::pct(&[3.0], 99.0), 3.0);
        assert_eq!(super::median(&[]), 0.0);
    }
}
