//! `forkd fork --tag T -n N [--keep]`: restore N children from a snapshot,
//! print per-phase timings, and clean up (or keep them until interrupted).

use anyhow::{bail, Result};
use clap::Args;
use forkd_snapshot::fork::{default_parallel, destroy_all, fork, Child};
use forkd_snapshot::restore::Source;
use forkd_snapshot::Paths;
use forkd_vmm::Lifetime;

#[derive(Args, Debug)]
pub struct ForkArgs {
    /// Snapshot tag (or id).
    #[arg(long)]
    pub tag: String,
    /// How many children.
    #[arg(short = 'n', long, default_value_t = 1)]
    pub n: usize,
    /// Keep the children running until interrupted (Ctrl-C / SIGTERM), then clean up.
    #[arg(long)]
    pub keep: bool,
    /// Children restored at once (default: 2 x cores).
    #[arg(long)]
    pub parallel: Option<usize>,
    /// Python every child evaluates once ready (printed per child; the
    /// fan-out time then runs until all answered).
    #[arg(long)]
    pub eval: Option<String>,
    /// Print JSON (one object with every child's timings).
    #[arg(long)]
    pub json: bool,
}

pub async fn run(paths: &Paths, a: ForkArgs) -> Result<i32> {
    if a.n == 0 || a.n > 1000 {
        bail!("-n must be 1-1000");
    }
    forkd_vmm::check_qemu()?;
    forkd_vmm::sweep(&paths.vms_dir()).await;
    let mount = forkd_snapshot::ensure_mount_async(paths).await?;
    let src = Source::resolve(&mount.mountpoint, &a.tag)?;
    let parallel = a.parallel.unwrap_or_else(default_parallel);
    let t0 = std::time::Instant::now();
    let forked = tokio::select! {
        r = fork(paths, &src, a.n, parallel, Lifetime::Ephemeral) => r?,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    };
    let evals = match &a.eval {
        Some(code) => Some(eval_all(&forked.children, code).await),
        None => None,
    };
    let eval_ms = t0.elapsed().as_millis() as u64;
    report(&a, &forked.children, forked.all_ready_ms)?;
    if let Some(results) = evals {
        let mut failed = 0;
        for (c, r) in forked.children.iter().zip(&results) {
            match r {
                Ok(v) => println!("{}: {v}", c.vm.id),
                Err(e) => {
                    failed += 1;
                    println!("{}: error: {e}", c.vm.id);
                }
            }
        }
        println!(
            "{} children answered the eval {} ms after the fork began",
            results.len() - failed,
            eval_ms
        );
        if failed > 0 {
            destroy_all(forked.children).await;
            bail!("{failed} children failed the eval");
        }
    }
    if a.keep {
        eprintln!(
            "{} children running; press Ctrl-C (or send SIGTERM) to stop them",
            forked.children.len()
        );
        wait_for_stop().await;
    }
    destroy_all(forked.children).await;
    Ok(0)
}

fn report(a: &ForkArgs, children: &[Child], all_ready_ms: u64) -> Result<()> {
    let mut ready: Vec<u64> = children.iter().map(|c| c.timings.ready_ms).collect();
    ready.sort_unstable();
    if a.json {
        let v = serde_json::json!({
            "tag": a.tag,
            "n": children.len(),
            "all_ready_ms": all_ready_ms,
            "children": children.iter().map(|c| serde_json::json!({
                "id": c.vm.id, "pid": c.vm.pid(), "hostname": c.hostname,
                "agent_socket": c.vm.dir.agent(), "started_ms": c.started_ms,
                "timings": c.timings,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<12} {:>8} {:>7} {:>8} {:>9} {:>8} {:>7}   (ms; phases from the child's own start)",
        "CHILD", "PID", "START", "PROCESS", "RESTORED", "RESUMED", "READY"
    );
    for c in children {
        let t = &c.timings;
        println!(
            "{:<12} {:>8} {:>7} {:>8} {:>9} {:>8} {:>7}",
            c.vm.id,
            c.vm.pid(),
            c.started_ms,
            t.process_ms,
            t.restored_ms,
            t.resumed_ms,
            t.ready_ms
        );
        if a.keep {
            println!("    agent socket: {}", c.vm.dir.agent().display());
        }
    }
    println!(
        "{} children of {} ready in {} ms (per child: median {} ms, max {} ms)",
        children.len(),
        a.tag,
        all_ready_ms,
        ready[ready.len() / 2],
        ready.last().copied().unwrap_or(0)
    );
    Ok(())
}

/// Evaluates `code` in every child at once.
async fn eval_all(children: &[Child], code: &str) -> Vec<Result<String>> {
    futures::future::join_all(children.iter().map(|c| async move {
        let r = c.vm.agent.eval(code, Some(60_000)).await?;
        match r.error {
            Some(e) => bail!("{e}"),
            None => Ok(r.result.unwrap_or_default()),
        }
    }))
    .await
}

/// Waits for SIGINT or SIGTERM.
async fn wait_for_stop() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
