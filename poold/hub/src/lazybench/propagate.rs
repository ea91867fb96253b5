//! `forkd hub bench --propagate TAG`: how long a snapshot made on one host
//! takes to answer from a child on each of N others that have never seen
//! it, through an S3 hub: the push, then on every node at once a lazy pull
//! and a fork (docs/BENCHMARKS.md, "Propagation to N nodes").
//!
//! The network is the lazy bench's (`net`): s3s-fs in a hub namespace
//! behind the delaying proxy, and one namespace per host, each with a link
//! of its own to the hub shaped to `--rate-mbit` (`tc tbf` both ends) with
//! `--rtt-ms` added: host 0 is the origin (this data dir), hosts 1..=N the
//! nodes, each with a fresh data dir (kernel and images linked from this
//! one) and its own forkd-fs. Each run pushes into a prefix of its own, so
//! every push starts from an empty hub.
//!
//! What is timed, from before the push: the push and its publication; each
//! node's first answer (its pull starts when the push has published, which
//! on S3 is once the working set's packs are up, while the push goes on
//! with the rest; the nodes run at once); the first and the last node's. Bytes are what the hub sent: the push's
//! are what it received.
//!
//! On one machine the nodes share its CPUs: with TCG, N children booting
//! at once is what dominates the last answer, not the links.

use super::net::{wait_port, DelayProxy, Net, MAX_HOSTS};
use super::{
    forkd_in, median_f, median_u, pull_and_answer, source, start_push, start_s3, teardown_home,
    write_json, Args, Header, PushFigures, BUCKET, S3_PORT,
};
use anyhow::{bail, Context, Result};
use forkd_snapshot::Paths;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};

/// The proxy port of the shaped links.
const PORT: u16 = 9101;

/// One node's pull and first answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Node {
    /// From before the push to the end of this node's pull, s.
    pub pull_s: f64,
    /// From before the push to this node's first child's answer, s.
    pub first_answer_s: f64,
    /// Hub bytes this node received before the answer.
    pub bytes_before_answer: u64,
    /// Hub requests this node made before the answer.
    pub requests_before_answer: u64,
    /// Reads that waited for the hub outside the recorded working set
    /// (forkd-fs's `slow_reads_outside_working_set`) by the answer.
    #[serde(default)]
    pub waits_outside_working_set: u64,
    /// What its child answered.
    pub answer: String,
}

/// One propagation to `nodes` nodes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    /// Nodes propagated to.
    pub nodes: usize,
    /// The push from the origin.
    pub push: PushFigures,
    /// Every node, in host order.
    pub per_node: Vec<Node>,
    /// The first node's answer, s since before the push.
    pub first_node_s: f64,
    /// The last node's answer: the snapshot answers everywhere, s.
    pub all_nodes_s: f64,
    /// Hub bytes all nodes received before their answers.
    pub bytes_to_nodes: u64,
}

/// Medians of the runs with one node count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// Nodes.
    pub nodes: usize,
    /// Runs.
    pub runs: usize,
    /// Median push, s.
    pub push_s: f64,
    /// Median time to publication (the nodes start then), s.
    #[serde(default)]
    pub published_s: f64,
    /// Median first node's answer, s.
    pub first_node_s: f64,
    /// Median last node's answer, s.
    pub all_nodes_s: f64,
    /// Median last node's answer after the publication, s: what the nodes'
    /// own links and CPUs add.
    #[serde(alias = "all_after_push_s")]
    pub all_after_publish_s: f64,
    /// Runs whose push sent no working set (no child of the snapshot had
    /// run before it: each node then faults chunk by chunk).
    pub pushes_without_working_set: usize,
    /// Median hub bytes per node before its answer.
    pub bytes_per_node: u64,
    /// Median hub bytes all nodes received before their answers.
    pub bytes_to_nodes: u64,
}

/// The bench's report (`--json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// The bench, the snapshot and the links (every one shaped).
    #[serde(flatten)]
    pub head: Header,
    /// Every run, in order.
    pub runs: Vec<Run>,
    /// Medians per node count.
    pub summary: Vec<Summary>,
}

/// Runs the bench for `tag` of the data dir at `paths` (the origin).
pub async fn run(paths: &Paths, tag: &str, args: &Args) -> Result<Report> {
    let most = args.nodes.iter().copied().max().unwrap_or(0);
    if args.nodes.contains(&0) || most == 0 || most >= MAX_HOSTS {
        bail!(
            "--nodes takes counts from 1 to {}, not {:?}",
            MAX_HOSTS - 1,
            args.nodes
        );
    }
    if !args.s3s_fs.is_file() {
        bail!(
            "{} is not there: the bench needs s3s-fs (cargo install s3s-fs --version 0.14.1 --features binary --locked --root /usr/local)",
            args.s3s_fs.display()
        );
    }
    let src = source(paths, tag).await?;
    let sfx = forkd_snapshot::random_hex(3);
    let work = paths.staging_dir().join(format!("propbench-{sfx}"));
    std::fs::create_dir_all(work.join("s3").join(BUCKET))?;
    let net = Net::new(&sfx, most + 1)?;
    let runs = run_in(paths, tag, args, &work, &net).await;
    drop(net);
    let _ = std::fs::remove_dir_all(&work);
    let runs = runs?;
    Ok(Report {
        head: Header::new("hub-propagate", tag, src, args),
        summary: summarize(&args.nodes, &runs),
        runs,
    })
}

async fn run_in(paths: &Paths, tag: &str, args: &Args, work: &Path, net: &Net) -> Result<Vec<Run>> {
    let most = args.nodes.iter().copied().max().unwrap_or(0);
    for host in 0..=most {
        net.shape(host, args.rate_mbit)?;
    }
    let _s3 = start_s3(net, args, work)?;
    let _proxy = DelayProxy::start(&net.hub, PORT, Duration::from_millis(args.rtt_ms) / 2)?;
    wait_port(&net.hub, S3_PORT)?;
    let forkd = std::env::current_exe().context("finding the forkd binary")?;
    let mut runs = Vec::new();
    for i in 0..args.runs {
        for &nodes in &args.nodes {
            let url = format!("s3://{BUCKET}/propagate-{nodes}-{i}");
            let r = one_run(&forkd, paths, work, net, nodes, tag, &url, &args.eval)
                .with_context(|| format!("run {i} to {nodes} nodes"))?;
            eprintln!(
                "{nodes} nodes, run {i}: push {:.2} s, first node {:.2} s, all {:.2} s, {} to the nodes, {} reads waited outside the working set",
                r.push.seconds,
                r.first_node_s,
                r.all_nodes_s,
                forkd_snapshot::mib(r.bytes_to_nodes),
                r.per_node.iter().map(|n| n.waits_outside_working_set).sum::<u64>()
            );
            runs.push(r);
        }
    }
    Ok(runs)
}

/// The push from host 0, then every node's pull and fork at once.
#[allow(clippy::too_many_arguments)]
fn one_run(
    forkd: &Path,
    paths: &Paths,
    work: &Path,
    net: &Net,
    nodes: usize,
    tag: &str,
    url: &str,
    eval: &str,
) -> Result<Run> {
    let t0 = Instant::now();
    // The nodes start when the snapshot is published, which may be before
    // the push ends (the packs outside the working set go after it).
    let pushing = start_push(forkd_in(forkd, &paths.home, net, 0, PORT), tag, url)?;
    let homes: Vec<_> = (1..=nodes)
        .map(|host| work.join(format!("node-{nodes}-{host}")))
        .collect();
    let answered: Vec<Result<Node>> = std::thread::scope(|s| {
        let threads: Vec<_> = homes
            .iter()
            .enumerate()
            .map(|(i, home)| {
                s.spawn(move || {
                    let pull = || forkd_in(forkd, home, net, i + 1, PORT);
                    let a = pull_and_answer(forkd, paths, home, pull, true, tag, url, eval, t0)?;
                    Ok(Node {
                        pull_s: a.pull_s,
                        first_answer_s: a.first_answer_s,
                        bytes_before_answer: a.bytes,
                        requests_before_answer: a.requests,
                        waits_outside_working_set: a.waits_outside_working_set,
                        answer: a.answer,
                    })
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| bail!("a node's thread panicked"))
            })
            .collect()
    });
    let push = pushing.finish();
    for home in &homes {
        teardown_home(home);
    }
    let push = push?;
    let per_node = answered
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.with_context(|| format!("node {}", i + 1)))
        .collect::<Result<Vec<Node>>>()?;
    let times = per_node.iter().map(|n| n.first_answer_s);
    Ok(Run {
        nodes,
        push,
        first_node_s: times.clone().fold(f64::INFINITY, f64::min),
        all_nodes_s: times.fold(0.0, f64::max),
        bytes_to_nodes: per_node.iter().map(|n| n.bytes_before_answer).sum(),
        per_node,
    })
}

/// Medians per node count, in the order `--nodes` gave them.
fn summarize(counts: &[usize], runs: &[Run]) -> Vec<Summary> {
    counts
        .iter()
        .filter_map(|&nodes| {
            let rs: Vec<&Run> = runs.iter().filter(|r| r.nodes == nodes).collect();
            (!rs.is_empty()).then(|| Summary {
                nodes,
                runs: rs.len(),
                push_s: median_f(rs.iter().map(|r| r.push.seconds).collect()),
                first_node_s: median_f(rs.iter().map(|r| r.first_node_s).collect()),
                all_nodes_s: median_f(rs.iter().map(|r| r.all_nodes_s).collect()),
                published_s: median_f(rs.iter().map(|r| r.push.published()).collect()),
                all_after_publish_s: median_f(
                    rs.iter()
                        .map(|r| r.all_nodes_s - r.push.published())
                        .collect(),
                ),
                pushes_without_working_set: rs.iter().filter(|r| !r.push.working_set).count(),
                bytes_per_node: median_u(
                    rs.iter()
                        .flat_map(|r| r.per_node.iter().map(|n| n.bytes_before_answer))
                        .collect(),
                ),
                bytes_to_nodes: median_u(rs.iter().map(|r| r.bytes_to_nodes).collect()),
            })
        })
        .collect()
}

impl Report {
    /// Writes the report as pretty JSON, with the command line.
    pub fn write(&self, path: &Path, command: Vec<String>) -> Result<()> {
        let mut r = self.clone();
        r.head.command = command;
        write_json(path, &r)
    }

    /// The medians as Markdown, with the last answer relative to one node.
    pub fn render(&self) -> String {
        let mib = forkd_snapshot::mib;
        let h = &self.head;
        let mut s = format!(
            "{}; every link {} Mbit/s, +{} ms round trip\n\n",
            h.render(),
            h.rate_mbit,
            h.rtt_ms
        );
        s.push_str("| nodes | runs | push (s) | published (s) | first node answers (s) | all nodes answered (s) | of which after publishing (s) | vs 1 node | hub bytes per node | to all nodes |\n");
        s.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        let one = self.summary.iter().find(|m| m.nodes == 1);
        for m in &self.summary {
            s.push_str(&format!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | **{:.2}** | {:.2} | {} | {} | {} |\n",
                m.nodes,
                m.runs,
                m.push_s,
                m.published_s,
                m.first_node_s,
                m.all_nodes_s,
                m.all_after_publish_s,
                one.map_or("-".into(), |o| format!(
                    "{:.2}x",
                    m.all_nodes_s / o.all_nodes_s.max(1e-9)
                )),
                mib(m.bytes_per_node),
                mib(m.bytes_to_nodes)
            ));
        }
        let bare: usize = self
            .summary
            .iter()
            .map(|m| m.pushes_without_working_set)
            .sum();
        if bare > 0 {
            s.push_str(&format!(
                "\n{bare} run(s) pushed WITHOUT a working set (no child of {} had run): their nodes faulted chunk by chunk\n",
                h.tag
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(nodes: usize, push_s: f64, answers: &[f64]) -> Run {
        let per_node: Vec<Node> = answers
            .iter()
            .map(|&a| Node {
                pull_s: push_s,
                first_answer_s: a,
                bytes_before_answer: 10,
                requests_before_answer: 1,
                waits_outside_working_set: 0,
                answer: "[0.0]".into(),
            })
            .collect();
        Run {
            nodes,
            push: PushFigures {
                seconds: push_s,
                ..Default::default()
            },
            first_node_s: answers.iter().copied().fold(f64::INFINITY, f64::min),
            all_nodes_s: answers.iter().copied().fold(0.0, f64::max),
            bytes_to_nodes: 10 * nodes as u64,
            per_node,
        }
    }

    #[test]
    fn medians_are_per_node_count_in_the_order_asked() {
        let runs = [
            run(3, 1.0, &[2.0, 3.0, 4.0]),
            run(1, 1.0, &[2.0]),
            run(3, 2.0, &[5.0, 6.0, 9.0]),
        ];
        let s = summarize(&[1, 3, 5], &runs);
        assert_eq!(s.len(), 2, "no row for a count that never ran");
        assert_eq!((s[0].nodes, s[0].runs, s[0].all_nodes_s), (1, 1, 2.0));
        assert_eq!((s[1].nodes, s[1].runs), (3, 2));
        assert_eq!((s[1].first_node_s, s[1].all_nodes_s), (5.0, 9.0));
        assert_eq!((s[1].bytes_per_node, s[1].bytes_to_nodes), (10, 30));
        assert_eq!(s[1].all_after_publish_s, 7.0);
        assert_eq!(s[1].pushes_without_working_set, 2);
    }

    /// The header is flattened: a committed report reads back and writes
    /// out with the same top-level keys (plot-benchmarks.py reads them).
    #[test]
    fn committed_reports_keep_their_shape() {
        fn keys(v: &serde_json::Value) -> Vec<String> {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        }
        let text = include_str!("../../../../docs/bench/hub-propagate.json");
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        let r: Report = serde_json::from_str(text).unwrap();
        assert_eq!(keys(&serde_json::to_value(&r).unwrap()), keys(&v));
        let text = include_str!("../../../../docs/bench/hub-lazy.json");
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        let r: super::super::Report = serde_json::from_str(text).unwrap();
        assert_eq!(keys(&serde_json::to_value(&r).unwrap()), keys(&v));
        assert_eq!(r.head.bench, "hub-lazy");
    }
}
