//! `GET /sandboxes/{id}/metrics` (`sbx.get_metrics()`): CPU, memory and
//! disk as the guest sees them.
//!
//! A sample is taken when a client asks (one short command in the guest:
//! `/proc/stat` twice a quarter second apart, `/proc/meminfo`, `nproc`,
//! `df` of `/`), kept with the sandbox's E2B session, and the answer is
//! every kept sample in the asked range, oldest first. Nothing samples a
//! sandbox nobody asks about, so idle sandboxes cost nothing.
//!
//! Invariants: at most [`MAX_SAMPLES`] samples are kept per sandbox (the
//! oldest go first); a guest that answers garbage gets a 502 naming what
//! could not be read, never a made-up figure.

use crate::error::{E2bError, E2bResult};
use axum::http::StatusCode;
use forkd_node::{ExecSpec, Node};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::time::{Duration, UNIX_EPOCH};

/// Samples kept per sandbox.
pub const MAX_SAMPLES: usize = 720;

/// What the guest runs for one sample (busybox and coreutils alike).
const PROBE: &str = "head -n1 /proc/stat; sleep 0.25; head -n1 /proc/stat; \
                     cat /proc/meminfo; nproc; df -B1 -P /";

/// One sample, as E2B's `SandboxMetric`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Seconds since the Unix epoch.
    pub unix: u64,
    pub cpu_count: u64,
    /// Busy share of all CPUs over the probe's quarter second, 0..=100.
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

impl Sample {
    fn json(&self) -> Value {
        let t = UNIX_EPOCH + Duration::from_secs(self.unix);
        json!({
            "timestamp": humantime::format_rfc3339_seconds(t).to_string(),
            "timestampUnix": self.unix,
            "cpuCount": self.cpu_count,
            "cpuUsedPct": (self.cpu_used_pct * 100.0).round() / 100.0,
            "memUsed": self.mem_used,
            "memTotal": self.mem_total,
            "memCache": self.mem_cache,
            "diskUsed": self.disk_used,
            "diskTotal": self.disk_total,
        })
    }
}

/// (total, idle) jiffies of a `/proc/stat` `cpu` line.
fn cpu_times(line: &str) -> Option<(u64, u64)> {
    let mut f = line.split_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.map(|x| x.parse().ok()).collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal (guest time is in user).
    let total = v.iter().take(8).sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some((total, idle))
}

/// A `/proc/meminfo` value in bytes.
fn meminfo(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    })
}

/// Parses the probe's output into a sample taken at `unix`.
pub fn parse(out: &str, unix: u64) -> Result<Sample, String> {
    let lines: Vec<&str> = out.lines().collect();
    let (t0, i0) = lines
        .first()
        .and_then(|l| cpu_times(l))
        .ok_or("the first /proc/stat line")?;
    let (t1, i1) = lines
        .get(1)
        .and_then(|l| cpu_times(l))
        .ok_or("the second /proc/stat line")?;
    let (dt, di) = (t1.saturating_sub(t0), i1.saturating_sub(i0));
    let cpu_used_pct = if dt == 0 {
        0.0
    } else {
        (dt.saturating_sub(di)) as f64 * 100.0 / dt as f64
    };
    let mem_total = meminfo(out, "MemTotal").ok_or("MemTotal")?;
    let available = meminfo(out, "MemAvailable").ok_or("MemAvailable")?;
    let mem_cache = meminfo(out, "Cached").unwrap_or(0);
    // nproc's line: the only one that is a bare number.
    let cpu_count = lines
        .iter()
        .skip(2)
        .find_map(|l| l.trim().parse::<u64>().ok())
        .ok_or("nproc")?;
    let df = lines.last().ok_or("df")?;
    let f: Vec<&str> = df.split_whitespace().collect();
    let (disk_total, disk_used) = match (f.get(1), f.get(2)) {
        (Some(t), Some(u)) => (
            t.parse().map_err(|_| "df's size")?,
            u.parse().map_err(|_| "df's used")?,
        ),
        _ => return Err("df's line".into()),
    };
    Ok(Sample {
        unix,
        cpu_count,
        cpu_used_pct: cpu_used_pct.clamp(0.0, 100.0),
        mem_used: mem_total.saturating_sub(available),
        mem_total,
        mem_cache,
        disk_used,
        disk_total,
    })
}

/// The sandbox's samples (kept with its E2B session).
#[derive(Default)]
pub struct Samples(std::sync::Mutex<VecDeque<Sample>>);

impl Samples {
    /// Keeps `s`, dropping the oldest beyond [`MAX_SAMPLES`].
    pub fn push(&self, s: Sample) {
        let mut q = self.0.lock().unwrap();
        if q.len() == MAX_SAMPLES {
            q.pop_front();
        }
        q.push_back(s);
    }

    /// The kept samples taken in `[start, end]`, oldest first, as E2B's JSON.
    pub fn range(&self, start: u64, end: u64) -> Vec<Value> {
        let q = self.0.lock().unwrap();
        q.iter()
            .filter(|s| (start..=end).contains(&s.unix))
            .map(Sample::json)
            .collect()
    }
}

/// `start`/`end` (Unix seconds) of the query; `end` defaults to now.
pub fn parse_range(q: Option<&str>, now: u64) -> E2bResult<(u64, u64)> {
    let (mut start, mut end) = (0, now);
    for (k, v) in form_urlencoded::parse(q.unwrap_or("").as_bytes()) {
        let n = || {
            v.parse::<u64>()
                .map_err(|_| E2bError::bad_request(format!("{k} must be Unix seconds")))
        };
        match k.as_ref() {
            "start" => start = n()?,
            "end" => end = n()?,
            _ => {}
        }
    }
    if start > end {
        return Err(E2bError::bad_request("start is after end"));
    }
    Ok((start, end))
}

/// Takes one sample of sandbox `id` (at `now`, Unix seconds).
pub async fn sample(node: &Node, id: &str, now: u64) -> E2bResult<Sample> {
    let spec = ExecSpec {
        shell: Some(PROBE.into()),
        timeout_ms: Some(10_000),
        ..Default::default()
    };
    let out = node.exec(id, spec, &[]).await?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse(&text, now).map_err(|what| {
        E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!("the sandbox's metrics could not be read ({what} is missing or malformed in the guest's /proc or df)"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "cpu  100 0 100 800 0 0 0 0 0 0\n\
cpu  150 0 150 850 0 0 0 0 0 0\n\
MemTotal:        1000 kB\n\
MemFree:          100 kB\n\
MemAvailable:     600 kB\n\
Cached:           200 kB\n\
2\n\
Filesystem 1-blocks Used Available Capacity Mounted on\n\
/dev/vda 8000 3000 5000 38% /\n";

    #[test]
    fn a_sample_from_the_guest() {
        let s = parse(OUT, 7).unwrap();
        assert_eq!(s.cpu_count, 2);
        // 150 jiffies passed, 50 of them idle.
        assert!((s.cpu_used_pct - 200.0 / 3.0).abs() < 1e-9);
        assert_eq!(
            (s.mem_total, s.mem_used, s.mem_cache),
            (1_024_000, 409_600, 204_800)
        );
        assert_eq!((s.disk_total, s.disk_used), (8000, 3000));
        let v = s.json();
        assert_eq!(v["timestampUnix"], 7);
        assert_eq!(v["cpuUsedPct"], 66.67);
        assert!(parse("garbage", 7).is_err());
        assert!(parse(&OUT.replace("MemAvailable", "X"), 7).is_err());
    }

    #[test]
    fn samples_are_bounded_and_ranged() {
        let s = Samples::default();
        let base = parse(OUT, 0).unwrap();
        for t in 0..(MAX_SAMPLES as u64 + 5) {
            s.push(Sample {
                unix: t,
                ..base.clone()
            });
        }
        assert_eq!(s.0.lock().unwrap().len(), MAX_SAMPLES);
        assert_eq!(s.range(0, 4).len(), 0);
        assert_eq!(s.range(5, 9).len(), 5);
        assert_eq!(parse_range(Some("start=3&end=9"), 100).unwrap(), (3, 9));
        assert_eq!(parse_range(None, 100).unwrap(), (0, 100));
        assert!(parse_range(Some("start=9&end=3"), 100).is_err());
        assert!(parse_range(Some("start=x"), 100).is_err());
    }
}
