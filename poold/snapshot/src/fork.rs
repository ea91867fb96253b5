//! Forking N children from a snapshot: restore them concurrently (bounded),
//! hand each out, and report per-phase timings.

use super::restore::{hand_out, restore_paused, ChildTimings, Identity, Source};
use crate::paths::Paths;
use anyhow::Result;
use forkd_vmm::{Lifetime, Vm};
use futures::stream::{self, StreamExt};
use std::time::Instant;

/// How many children restore at once by default. QEMU start-up is mostly
/// waiting on the kernel (mmap, file opens), so a few more than cores helps.
pub fn default_parallel() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()) * 2
}

/// A running, handed-out child.
pub struct Child {
    /// The child's VM, started and handed out (resumed, with its own identity).
    pub vm: Vm,
    /// The guest hostname, `forkd-<hex>` from its VM id `fork-<hex>`.
    pub hostname: String,
    /// Phase times from this child's own start.
    pub timings: ChildTimings,
    /// When this child's start began, in ms after the fork began.
    pub started_ms: u64,
}

/// The outcome of [`fork`].
pub struct Forked {
    /// The children, in start order.
    pub children: Vec<Child>,
    /// From the fork's start until every child answered.
    pub all_ready_ms: u64,
}

/// Restores `n` children of `src` and hands each out. If any child fails,
/// every child started so far is destroyed and the first error returned.
pub async fn fork(
    paths: &Paths,
    src: &Source,
    n: usize,
    parallel: usize,
    lifetime: Lifetime,
) -> Result<Forked> {
    let t0 = Instant::now();
    let results: Vec<Result<Child>> = stream::iter(0..n)
        .map(|_| async move {
            let id = format!("fork-{}", crate::util::random_hex(6));
            let hostname = format!("forkd-{}", &id[5..]);
            let start = Instant::now();
            let started_ms = super::create::ms(t0.elapsed());
            let mut timings = ChildTimings::default();
            let mut vm = restore_paused(paths, src, &id, lifetime, &mut timings).await?;
            if let Err(e) = hand_out(
                &mut vm,
                &hostname,
                Identity::Bare,
                None,
                None,
                start,
                &mut timings,
            )
            .await
            {
                vm.destroy().await;
                return Err(e);
            }
            Ok(Child {
                vm,
                hostname,
                timings,
                started_ms,
            })
        })
        .buffer_unordered(parallel.max(1))
        .collect()
        .await;
    let all_ready_ms = super::create::ms(t0.elapsed());
    let mut children = Vec::new();
    let mut first_err = None;
    for r in results {
        match r {
            Ok(c) => children.push(c),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        destroy_all(children).await;
        return Err(e);
    }
    Ok(Forked {
        children,
        all_ready_ms,
    })
}

/// Destroys children concurrently.
pub async fn destroy_all(children: Vec<Child>) {
    futures::future::join_all(children.into_iter().map(|c| c.vm.destroy())).await;
}
