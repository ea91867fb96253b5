//! Warm pools: per snapshot tag, a few children restored ahead of time and
//! parked *paused* (no CPU), so a spawn only resumes one and gives it its
//! identity. Identity is never applied before hand-out.
//!
//! Invariants:
//! - a pooled VM is in `ready` and in the durable state's `pooled` map, or
//!   in neither (taken: it becomes a sandbox in the same state commit);
//! - `ready + in_flight <= max` per pool; a refill restores at most
//!   `refill_concurrency` children at once across all pools, so refills
//!   never crowd out running sandboxes;
//! - a pool's `generation` changes when it is drained or resized down; a
//!   restore that finishes under an older generation is destroyed instead of
//!   parked (its snapshot may be gone).

use super::config::PoolSpec;
use super::state::PooledRecord;
use crate::vm::Vm;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

/// A paused child waiting in a pool.
pub struct PooledVm {
    pub vm: Vm,
    pub record: PooledRecord,
}

#[derive(Default)]
struct Pool {
    spec: Option<PoolSpec>,
    ready: VecDeque<PooledVm>,
    in_flight: usize,
    generation: u64,
    hits: u64,
    misses: u64,
}

/// What `GET /v1/pools` shows for one pool.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolStatus {
    pub tag: String,
    pub min_ready: usize,
    pub max_ready: usize,
    pub warm: bool,
    pub ready: usize,
    pub in_flight: usize,
    pub hits: u64,
    pub misses: u64,
}

/// A refill the daemon should start now.
pub struct RefillTicket {
    pub tag: String,
    pub generation: u64,
    pub warm: bool,
}

/// All pools.
#[derive(Default)]
pub struct Pools {
    inner: Mutex<BTreeMap<String, Pool>>,
}

impl Pools {
    /// Sets (or with `None` removes) a pool's sizing. Returns the children
    /// that no longer fit, for the caller to destroy.
    pub fn set(&self, tag: &str, spec: Option<PoolSpec>) -> Vec<PooledVm> {
        let mut g = self.inner.lock().unwrap();
        let p = g.entry(tag.to_string()).or_default();
        p.spec = spec;
        let keep = spec.map_or(0, |s| s.max());
        let mut extra = Vec::new();
        while p.ready.len() > keep {
            extra.extend(p.ready.pop_back());
        }
        if spec.is_none() || !extra.is_empty() {
            p.generation += 1;
        }
        extra
    }

    /// The sizing of `tag`'s pool, if it has one.
    pub fn spec(&self, tag: &str) -> Option<PoolSpec> {
        self.inner.lock().unwrap().get(tag).and_then(|p| p.spec)
    }

    /// Takes up to `n` ready children of snapshot `snapshot_id` for `tag`;
    /// counts them as hits and the rest as misses. Children of another
    /// snapshot (the tag moved) are returned in the second list to destroy.
    pub fn take(&self, tag: &str, snapshot_id: &str, n: usize) -> (Vec<PooledVm>, Vec<PooledVm>) {
        let mut g = self.inner.lock().unwrap();
        let p = g.entry(tag.to_string()).or_default();
        let mut got = Vec::new();
        let mut stale = Vec::new();
        while got.len() < n {
            match p.ready.pop_front() {
                Some(v) if v.record.snapshot_id == snapshot_id => got.push(v),
                Some(v) => stale.push(v),
                None => break,
            }
        }
        p.hits += got.len() as u64;
        p.misses += (n - got.len()) as u64;
        (got, stale)
    }

    /// Every ready child of `tag` (to destroy: its snapshot is being
    /// deleted). In-flight restores are discarded when they finish.
    pub fn drain(&self, tag: &str) -> Vec<PooledVm> {
        let mut g = self.inner.lock().unwrap();
        match g.get_mut(tag) {
            Some(p) => {
                p.generation += 1;
                p.ready.drain(..).collect()
            }
            None => Vec::new(),
        }
    }

    /// Every ready child (of any pool) restored from one of `snapshot_ids`:
    /// those snapshots are about to be deleted. Their pools' in-flight
    /// restores are discarded when they finish.
    pub fn drain_snapshots(&self, snapshot_ids: &[String]) -> Vec<PooledVm> {
        let mut g = self.inner.lock().unwrap();
        let mut out = Vec::new();
        for p in g.values_mut() {
            let (gone, keep): (Vec<_>, Vec<_>) = p
                .ready
                .drain(..)
                .partition(|v| snapshot_ids.contains(&v.record.snapshot_id));
            if !gone.is_empty() {
                p.generation += 1;
            }
            p.ready = keep.into();
            out.extend(gone);
        }
        out
    }

    /// Ready children whose QEMU has died (killed by the OOM killer, say):
    /// removed here, for the caller to clean up. Their pools refill.
    pub fn remove_dead(&self) -> Vec<PooledVm> {
        let mut g = self.inner.lock().unwrap();
        let mut out = Vec::new();
        for p in g.values_mut() {
            let (dead, alive): (Vec<_>, Vec<_>) = p
                .ready
                .drain(..)
                .partition(|v| !v.vm.record.qemu.is_alive());
            p.ready = alive.into();
            out.extend(dead);
        }
        out
    }

    /// Restores in flight for `tag`.
    pub fn in_flight(&self, tag: &str) -> usize {
        self.inner
            .lock()
            .unwrap()
            .get(tag)
            .map_or(0, |p| p.in_flight)
    }

    /// Pools that need children, one ticket per child to restore now, and
    /// marks them in flight. `budget` is how many restores may start.
    pub fn plan_refills(&self, budget: usize) -> Vec<RefillTicket> {
        let mut g = self.inner.lock().unwrap();
        let mut out = Vec::new();
        // Fill the emptiest pools first.
        let mut tags: Vec<(usize, String)> = g
            .iter()
            .filter_map(|(t, p)| {
                let s = p.spec?;
                let have = p.ready.len() + p.in_flight;
                (have < s.min_ready.min(s.max())).then(|| (have, t.clone()))
            })
            .collect();
        tags.sort();
        let mut progress = true;
        while out.len() < budget && progress {
            progress = false;
            for (_, t) in &tags {
                if out.len() >= budget {
                    break;
                }
                let p = g.get_mut(t).expect("listed above");
                let s = p.spec.expect("listed above");
                if p.ready.len() + p.in_flight < s.min_ready.min(s.max()) {
                    p.in_flight += 1;
                    out.push(RefillTicket {
                        tag: t.clone(),
                        generation: p.generation,
                        warm: s.warm,
                    });
                    progress = true;
                }
            }
        }
        out
    }

    /// Ends an in-flight refill. With `Some(vm)` the child is parked if its
    /// ticket is still current and there is room; otherwise it is handed
    /// back to be destroyed.
    pub fn finish_refill(&self, t: &RefillTicket, vm: Option<PooledVm>) -> Option<PooledVm> {
        let mut g = self.inner.lock().unwrap();
        let p = g.entry(t.tag.clone()).or_default();
        p.in_flight = p.in_flight.saturating_sub(1);
        let vm = vm?;
        let room = p.spec.is_some_and(|s| p.ready.len() < s.max());
        if p.generation == t.generation && room {
            p.ready.push_back(vm);
            None
        } else {
            Some(vm)
        }
    }

    /// Puts back an adopted child after a restart.
    pub fn adopt(&self, vm: PooledVm) {
        let mut g = self.inner.lock().unwrap();
        g.entry(vm.record.tag.clone())
            .or_default()
            .ready
            .push_back(vm);
    }

    /// Status of every pool that has a sizing or children.
    pub fn status(&self) -> Vec<PoolStatus> {
        let g = self.inner.lock().unwrap();
        g.iter()
            .filter(|(_, p)| p.spec.is_some() || !p.ready.is_empty() || p.in_flight > 0)
            .map(|(t, p)| status_of(t, p))
            .collect()
    }

    /// Status of one pool (zeros when it has none).
    pub fn status_of(&self, tag: &str) -> PoolStatus {
        let g = self.inner.lock().unwrap();
        match g.get(tag) {
            Some(p) => status_of(tag, p),
            None => status_of(tag, &Pool::default()),
        }
    }
}

fn status_of(tag: &str, p: &Pool) -> PoolStatus {
    PoolStatus {
        tag: tag.to_string(),
        min_ready: p.spec.map_or(0, |s| s.min_ready),
        max_ready: p.spec.map_or(0, |s| s.max()),
        warm: p.spec.is_some_and(|s| s.warm),
        ready: p.ready.len(),
        in_flight: p.in_flight,
        hits: p.hits,
        misses: p.misses,
    }
}
