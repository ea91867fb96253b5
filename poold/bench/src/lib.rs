//! Benchmarks that print numbers (never assert them): `forkd bench fork`,
//! `forkd bench spawn`, `forkd bench branch`, `forkd bench e2b`,
//! `forkd bench browser` and `forkd bench gateway`. Results and the commands that produced them are
//! recorded in docs/BENCHMARKS.md.

#![warn(missing_docs)]

pub mod branch;
pub mod browser;
pub mod e2b;
pub mod fork;
pub mod gateway;
pub mod mem;
pub mod spawn;

/// Milliseconds since `t0`.
pub(crate) fn ms(t0: std::time::Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// Polls poold's pool `tag` until `done` holds (at most 30 minutes).
pub(crate) async fn wait_pool(
    c: &forkd_api::Client,
    tag: &str,
    done: impl Fn(&forkd_api::PoolStatus) -> bool,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1800);
    loop {
        let p: forkd_api::PoolStatus = c.get(&format!("/v1/pools/{tag}")).await?;
        if done(&p) {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("pool {tag} did not settle within 30 minutes: {p:?}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

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
