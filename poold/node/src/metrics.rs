//! The node's Prometheus metrics (text format 0.0.4 like forkd's; a
//! front-end serves them, `GET /metrics` in `/v1`, and registers its own,
//! such as HTTP requests by status, in the same [`Registry`]).
//!
//! forkd's gauges keep their names (`forkd_snapshots_total`,
//! `forkd_sandboxes_active`, `forkd_branches_in_flight`,
//! `forkd_branch_concurrency_cap`, `forkd_build_info`); pools and spawn
//! latency are ours.

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Spawn latency buckets, seconds: from a warm pool hit under KVM (ms) to a
/// cold restore under TCG (seconds).
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Every metric poold exports.
pub struct Metrics {
    registry: Registry,
    pub snapshots: IntGauge,
    pub sandboxes: IntGauge,
    pub branches_in_flight: IntGauge,
    pub pool_ready: IntGaugeVec,
    pub pool_in_flight: IntGaugeVec,
    pub pool_hits: IntCounterVec,
    pub pool_misses: IntCounterVec,
    /// Request received → the child's agent answered; label `source`:
    /// `pool` (a hit) or `restore` (restored on demand).
    pub spawn_latency: HistogramVec,
    pub cpu_seconds: GaugeVec,
    /// The forkd-fs mount recovered; label `cause` (`mount_watch::Cause`).
    pub mount_recoveries: IntCounterVec,
    /// Sandboxes destroyed because the mount connection they mapped died.
    pub sandboxes_lost: IntCounter,
    /// Background pushes to the hub of snapshots made here; label
    /// `outcome` (`ok`, `error`).
    pub hub_pushes: IntCounterVec,
}

impl Metrics {
    pub fn new(cap: usize) -> Metrics {
        let registry = Registry::new();
        let reg = |c: Box<dyn prometheus::core::Collector>| {
            registry.register(c).expect("metric names are unique");
        };
        let snapshots = IntGauge::new("forkd_snapshots_total", "Tagged snapshots").unwrap();
        let sandboxes = IntGauge::new("forkd_sandboxes_active", "Live sandboxes").unwrap();
        let branches_in_flight =
            IntGauge::new("forkd_branches_in_flight", "Branches being taken").unwrap();
        let branch_cap = IntGauge::new(
            "forkd_branch_concurrency_cap",
            "Concurrent branches allowed",
        )
        .unwrap();
        branch_cap.set(i64::try_from(cap).unwrap_or(i64::MAX));
        let build = IntGaugeVec::new(
            Opts::new("forkd_build_info", "Build information"),
            &["version"],
        )
        .unwrap();
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let pool_ready = IntGaugeVec::new(
            Opts::new("forkd_pool_ready", "Paused children ready in the pool"),
            &["tag"],
        )
        .unwrap();
        let pool_in_flight = IntGaugeVec::new(
            Opts::new("forkd_pool_in_flight", "Pool children being restored"),
            &["tag"],
        )
        .unwrap();
        let pool_hits = IntCounterVec::new(
            Opts::new("forkd_pool_hits_total", "Children handed out from a pool"),
            &["tag"],
        )
        .unwrap();
        let pool_misses = IntCounterVec::new(
            Opts::new(
                "forkd_pool_misses_total",
                "Children restored on demand because the pool was empty",
            ),
            &["tag"],
        )
        .unwrap();
        let spawn_latency = HistogramVec::new(
            HistogramOpts::new(
                "forkd_spawn_latency_seconds",
                "Spawn request received until the child's agent answered",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["source"],
        )
        .unwrap();
        let cpu_seconds = GaugeVec::new(
            Opts::new("forkd_poold_cpu_seconds", "CPU time poold itself used"),
            &["mode"],
        )
        .unwrap();
        let mount_recoveries = IntCounterVec::new(
            Opts::new(
                "forkd_mount_recoveries_total",
                "Times the forkd-fs mount was found unmounted, dead or hung and mounted again",
            ),
            &["cause"],
        )
        .unwrap();
        let sandboxes_lost = IntCounter::new(
            "forkd_sandboxes_lost_total",
            "Sandboxes destroyed because the forkd-fs connection they mapped died",
        )
        .unwrap();
        let hub_pushes = IntCounterVec::new(
            Opts::new(
                "forkd_hub_pushes_total",
                "Snapshots made here pushed to the hub in the background",
            ),
            &["outcome"],
        )
        .unwrap();
        reg(Box::new(hub_pushes.clone()));
        reg(Box::new(mount_recoveries.clone()));
        reg(Box::new(sandboxes_lost.clone()));
        reg(Box::new(snapshots.clone()));
        reg(Box::new(sandboxes.clone()));
        reg(Box::new(branches_in_flight.clone()));
        reg(Box::new(branch_cap));
        reg(Box::new(build));
        reg(Box::new(pool_ready.clone()));
        reg(Box::new(pool_in_flight.clone()));
        reg(Box::new(pool_hits.clone()));
        reg(Box::new(pool_misses.clone()));
        reg(Box::new(spawn_latency.clone()));
        reg(Box::new(cpu_seconds.clone()));
        Metrics {
            registry,
            snapshots,
            sandboxes,
            branches_in_flight,
            pool_ready,
            pool_in_flight,
            pool_hits,
            pool_misses,
            spawn_latency,
            cpu_seconds,
            mount_recoveries,
            sandboxes_lost,
            hub_pushes,
        }
    }

    /// The registry, for front-ends' own metrics (rendered with these).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        if let Some((user, sys)) = self_cpu_seconds() {
            self.cpu_seconds.with_label_values(&["user"]).set(user);
            self.cpu_seconds.with_label_values(&["system"]).set(sys);
        }
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("encoding metrics into a Vec cannot fail");
        String::from_utf8(buf).expect("metrics are UTF-8")
    }
}

/// This process's user and system CPU seconds (from getrusage).
pub fn self_cpu_seconds() -> Option<(f64, f64)> {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).ok()?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Some((secs(u.user_time()), secs(u.system_time())))
}
