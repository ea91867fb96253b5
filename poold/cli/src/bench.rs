//! `forkd bench fork|spawn|branch|e2b|browser`: benchmarks that print medians and ratios.

use anyhow::{bail, Result};
use clap::Subcommand;
use forkd_bench as bench;
use forkd_snapshot::Paths;
use forkd_vmm::AccelChoice;

/// What every child evaluates to count as ready (docs/design.md,
/// "How readiness is measured").
const PROBE: &str = "numpy.zeros(5).tolist()";

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Cold boot + warm-up per child vs restore from a warm snapshot, for several N.
    Fork {
        #[arg(long, default_value = "python-numpy")]
        image: String,
        /// Comma-separated child counts.
        #[arg(long, default_value = "1,10,100")]
        n: String,
        #[arg(long, default_value_t = 512)]
        mem: u64,
        #[arg(long, env = "FORKD_ACCEL", default_value = "auto")]
        accel: AccelChoice,
        /// Sequential cold boots to measure.
        #[arg(long, default_value_t = 3)]
        cold_samples: usize,
        /// Children restored at once.
        #[arg(long)]
        parallel: Option<usize>,
        /// Code every child evaluates to count as ready.
        #[arg(long, default_value = PROBE)]
        probe: String,
    },
    /// BRANCH pauses on a busy guest, spawn latency by chain depth, a one-package link.
    Branch {
        #[arg(long, default_value = "python-numpy")]
        image: String,
        #[arg(long, default_value_t = 512)]
        mem: u64,
        #[arg(long, env = "FORKD_ACCEL", default_value = "auto")]
        accel: AccelChoice,
        /// Live branches of the busy source.
        #[arg(long, default_value_t = 10)]
        branches: usize,
        /// Comma-separated chain depths to spawn from.
        #[arg(long, default_value = "0,1,5,10")]
        depths: String,
        /// Spawns per depth.
        #[arg(long, default_value_t = 3)]
        spawns: usize,
        /// Debian package for the one-package link.
        #[arg(long, default_value = "hello")]
        package: String,
        /// MiB of memory the busy source rewrites in a loop.
        #[arg(long, default_value_t = 128)]
        busy_mib: u64,
        /// Write the report (every sample and the summaries) as JSON here
        /// (for scripts/plot-benchmarks.py).
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// Spawns through a running poold: sequential single spawns (pool hit,
    /// on demand, cold boot) and fan-out from a full pool, with the memory
    /// of the pooled children.
    Spawn {
        #[arg(long)]
        tag: String,
        /// Sequential single spawns per source (0: skip that part).
        #[arg(long, default_value_t = 30)]
        seq: usize,
        /// Comma-separated fan-out sizes (empty: skip that part).
        #[arg(long, default_value = "10,50,100")]
        fanout: String,
        /// Write the report as JSON here (for scripts/plot-benchmarks.py).
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Cold boots measured for comparison (0: none).
        #[arg(long, default_value_t = 3)]
        cold_samples: usize,
        #[arg(long, default_value = PROBE)]
        probe: String,
        /// Set the pools' `warm_eval` to this code (e.g. the probe): each
        /// child runs it before it is parked (docs/poold.md).
        #[arg(long, value_name = "CODE")]
        warm_eval: Option<String>,
        /// Set the pools' `page_out`: parked children are paged out to
        /// swap, and their memory is reported resident and swapped apart.
        #[arg(long)]
        page_out: bool,
        /// With --page-out, the pools' `keep_resident` (default 2): held
        /// pools hand these out first, then paged-out children.
        #[arg(long, requires = "page_out", value_name = "N")]
        keep_resident: Option<usize>,
        /// A networked snapshot of the same image: adds a pool-hit row
        /// with per-child networking (docs/network.md).
        #[arg(long)]
        net_tag: Option<String>,
    },
    /// A forked warm Chromium through poold (a networked snapshot of the
    /// `browser` image): spawn to first CDP answer over the published port,
    /// next to a cold boot and Chromium start; navigation; memory per child.
    Browser {
        #[arg(long)]
        tag: String,
        /// Sequential spawns per source (pool hit, on demand).
        #[arg(long, default_value_t = 5)]
        seq: usize,
        /// Cold boots measured (0: none).
        #[arg(long, default_value_t = 2)]
        cold_samples: usize,
        /// Children alive at once for the memory figure (0: skip).
        #[arg(long, default_value_t = 5)]
        mem_children: usize,
        /// Write the report as JSON here (for scripts/plot-benchmarks.py).
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// What the cluster gateway adds: a pool-hit spawn and an exec, each
    /// made to the node and through a gateway in front of it, interleaved.
    Gateway {
        /// Snapshot tag with a pool on the node.
        #[arg(long)]
        tag: String,
        /// Samples per call and path (the pool is filled with 2n+1).
        #[arg(short = 'n', long, default_value_t = 20)]
        n: usize,
        /// The node's poold.
        #[arg(long, env = "FORKD_URL", default_value = "http://127.0.0.1:8889")]
        direct: String,
        /// File holding the node's bearer token (its token_file).
        #[arg(long)]
        direct_token_file: Option<std::path::PathBuf>,
        /// The gateway, with the node behind it (alone).
        #[arg(long)]
        gateway: String,
        /// File holding the gateway's bearer token (its --token-file).
        #[arg(long)]
        gateway_token_file: Option<std::path::PathBuf>,
        /// Write the report as JSON here (for scripts/plot-benchmarks.py).
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// Create + run code through poold's E2B endpoints next to spawn + eval through /v1.
    E2b {
        /// Snapshot tag (the E2B template).
        #[arg(long)]
        tag: String,
        /// Round trips per path.
        #[arg(short = 'n', long, default_value_t = 20)]
        n: usize,
        #[arg(long, default_value = PROBE)]
        probe: String,
        /// poold's E2B API (its --e2b-bind).
        #[arg(long, env = "E2B_API_URL", default_value = "http://127.0.0.1:3000")]
        api_url: String,
        /// poold's E2B sandbox plane (its --e2b-sandbox-bind).
        #[arg(long, env = "E2B_SANDBOX_URL", default_value = "http://127.0.0.1:3001")]
        sandbox_url: String,
        /// The E2B API key (poold's e2b.api_key_file, else its token).
        #[arg(
            long,
            env = "E2B_API_KEY",
            default_value = "forkd",
            hide_env_values = true
        )]
        api_key: String,
        /// Also time `n` cells returning a matplotlib chart on this
        /// template (a snapshot of the `code-interpreter` image).
        #[arg(long)]
        chart_tag: Option<String>,
    },
}

pub async fn run(paths: &Paths, cmd: BenchCmd) -> Result<i32> {
    match cmd {
        BenchCmd::Fork {
            image,
            n,
            mem,
            accel,
            cold_samples,
            parallel,
            probe,
        } => {
            let ns = parse_list(&n)?;
            if ns.iter().any(|&n| n == 0 || n > 1000) {
                bail!("each N must be 1-1000");
            }
            bench::fork::run(
                paths,
                bench::fork::ForkBench {
                    image,
                    mem_mib: mem,
                    accel: accel.resolve()?,
                    ns,
                    cold_samples,
                    parallel: parallel.unwrap_or_else(forkd_snapshot::fork::default_parallel),
                    probe,
                },
            )
            .await?;
        }
        BenchCmd::Branch {
            image,
            mem,
            accel,
            branches,
            depths,
            spawns,
            package,
            busy_mib,
            json,
        } => {
            let depths = parse_list(&depths)?;
            if depths.iter().any(|&d| d > 100) {
                bail!("depths must be at most 100");
            }
            bench::branch::run(
                paths,
                bench::branch::BranchBench {
                    image,
                    mem_mib: mem,
                    accel: accel.resolve()?,
                    branches: branches.max(1),
                    depths,
                    spawns,
                    package,
                    busy_mib,
                    json,
                },
            )
            .await?;
        }
        BenchCmd::Spawn {
            tag,
            seq,
            fanout,
            json,
            cold_samples,
            probe,
            warm_eval,
            page_out,
            keep_resident,
            net_tag,
        } => {
            let fanout = if fanout.trim().is_empty() {
                Vec::new()
            } else {
                parse_list(&fanout)?
            };
            if fanout.iter().any(|&n| n == 0 || n > 1000) {
                bail!("--fanout sizes must be 1-1000, got {fanout:?}");
            }
            bench::spawn::run(
                paths,
                bench::spawn::SpawnBench {
                    tag,
                    seq,
                    fanout,
                    cold_samples,
                    probe,
                    warm_eval,
                    page_out,
                    keep_resident,
                    net_tag,
                    json,
                },
            )
            .await?;
        }
        BenchCmd::Browser {
            tag,
            seq,
            cold_samples,
            mem_children,
            json,
        } => {
            if seq > 100 || mem_children > 100 {
                bail!("--seq and --mem-children must be at most 100");
            }
            bench::browser::run(
                paths,
                bench::browser::BrowserBench {
                    tag,
                    seq,
                    cold_samples,
                    mem_children,
                    json,
                },
            )
            .await?;
        }
        BenchCmd::E2b {
            tag,
            n,
            probe,
            api_url,
            sandbox_url,
            api_key,
            chart_tag,
        } => {
            if n == 0 || n > 500 {
                bail!("-n must be 1-500");
            }
            bench::e2b::run(bench::e2b::E2bBench {
                tag,
                n,
                probe,
                api_url,
                sandbox_url,
                api_key,
                chart_tag,
            })
            .await?;
        }
        BenchCmd::Gateway {
            tag,
            n,
            direct,
            direct_token_file,
            gateway,
            gateway_token_file,
            json,
        } => {
            if n == 0 || n > 500 {
                bail!("-n must be 1-500");
            }
            let client =
                |url: &str, token: Option<std::path::PathBuf>| -> Result<forkd_api::Client> {
                    let token = token
                        .map(|p| forkd_hub::auth::read_token_file(&p))
                        .transpose()?;
                    forkd_api::Client::new(url, token)
                };
            bench::gateway::run(bench::gateway::GatewayBench {
                tag,
                n,
                direct: client(&direct, direct_token_file)?,
                gateway: client(&gateway, gateway_token_file)?,
                json,
            })
            .await?;
        }
    }
    Ok(0)
}

/// `1,10,100` → [1, 10, 100].
fn parse_list(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| anyhow::anyhow!("{s:?}: expected comma-separated numbers, e.g. 1,10,100"))
}
