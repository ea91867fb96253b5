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
//!   parked (its snapshot may be gone);
//! - resident children are handed out before paged-out ones (`page_out`
//!   pools), oldest first within each kind; a refill parks its child
//!   resident while fewer than `keep_resident` are, so spawns at a pace the
//!   refills keep up with never wait for swap;
//! - while fewer than `keep_resident` are resident, the oldest paged-out
//!   child is paged back in, one per pool at a time ([`Residency`] has the
//!   states): reading a child back from swap costs a fraction of the CPU a
//!   refill's restore does, so spawns faster than refills still find a
//!   resident child;
//! - a pool whose refill was held back ([`Pools::hold_back`]: its lazy
//!   snapshot's working set is not local yet, so a parked child would fault
//!   it over the network) says why in its status and is not planned again
//!   for [`HOLD_BACK_RECHECK`]; the next refill that ends clears the reason.
//!
//! The pool bookkeeping is generic over what it parks ([`Parked`]) so its
//! rules are unit-tested without a VM; the daemon parks [`PooledVm`]s.

use crate::config::PoolSpec;
use crate::state::PooledRecord;
pub use forkd_api::PoolStatus;
use forkd_vmm::Vm;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a held-back pool waits before a refill asks again.
pub const HOLD_BACK_RECHECK: Duration = Duration::from_secs(1);

/// A paused child waiting in a pool.
pub struct PooledVm {
    pub vm: Vm,
    pub record: PooledRecord,
    /// Where its own memory is.
    pub residency: Residency,
}

/// Where a parked child's own memory is (pools with `page_out`). A child
/// is parked `Resident` or `PagedOut`; a paged-out one goes `PagingIn` when
/// [`Pools::plan_page_ins`] picks it, then `Resident`, or back to
/// `PagedOut` if reading it back failed. Taking a child ends its residency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// In RAM: a hand-out reads nothing from swap.
    Resident,
    /// Being read back from swap; counts toward `keep_resident`.
    PagingIn,
    /// In swap: a hand-out reads back what it touches, and waits for it.
    PagedOut,
}

/// What a pool parks: something with a pooled record that may have died.
pub trait Parked {
    /// Its durable record (tag, snapshot id, VM id).
    fn record(&self) -> &PooledRecord;
    /// Whether it still runs (its QEMU process exists).
    fn is_alive(&self) -> bool;
    /// Where its memory is.
    fn residency(&self) -> Residency;
    /// Records that its memory moved.
    fn set_residency(&mut self, r: Residency);
}

impl Parked for PooledVm {
    fn record(&self) -> &PooledRecord {
        &self.record
    }
    fn is_alive(&self) -> bool {
        self.vm.record.qemu.is_alive()
    }
    fn residency(&self) -> Residency {
        self.residency
    }
    fn set_residency(&mut self, r: Residency) {
        self.residency = r;
    }
}

struct Pool<V> {
    spec: Option<PoolSpec>,
    ready: VecDeque<V>,
    in_flight: usize,
    generation: u64,
    hits: u64,
    misses: u64,
    /// Why its last refill was held back, and when.
    waiting: Option<(String, Instant)>,
}

impl<V> Default for Pool<V> {
    fn default() -> Self {
        Pool {
            spec: None,
            ready: VecDeque::new(),
            in_flight: 0,
            generation: 0,
            hits: 0,
            misses: 0,
            waiting: None,
        }
    }
}

/// A refill the daemon should start now.
#[derive(Debug)]
pub struct RefillTicket {
    pub tag: String,
    pub generation: u64,
    pub warm: bool,
    /// What the warm-up evaluates (None: a no-op).
    pub warm_eval: Option<String>,
    /// Page the child out to swap once parked, unless fewer than
    /// `keep_resident` ready children are resident then.
    pub page_out: bool,
    /// The pool's `keep_resident` (see [`PoolSpec::keep_resident`]).
    pub keep_resident: usize,
}

/// A paged-out child to read back from swap now (see
/// [`Pools::plan_page_ins`]); `what` is what the caller asked to carry.
#[derive(Debug)]
pub struct PageIn<R> {
    pub tag: String,
    pub vm_id: String,
    pub what: R,
}

/// All pools.
pub struct Pools<V = PooledVm> {
    inner: Mutex<BTreeMap<String, Pool<V>>>,
    /// Woken whenever a refill ends, for [`Pools::wait_refills_done`].
    refill_done: tokio::sync::Notify,
}

impl<V> Default for Pools<V> {
    fn default() -> Self {
        Pools {
            inner: Mutex::default(),
            refill_done: tokio::sync::Notify::new(),
        }
    }
}

impl<V: Parked> Pools<V> {
    /// Sets (or with `None` removes) a pool's sizing. Returns the children
    /// that no longer fit, for the caller to destroy.
    pub fn set(&self, tag: &str, spec: Option<PoolSpec>) -> Vec<V> {
        let mut g = self.inner.lock().unwrap();
        let p = g.entry(tag.to_string()).or_default();
        let keep = spec.as_ref().map_or(0, |s| s.max());
        let gone = spec.is_none();
        p.spec = spec;
        let mut extra = Vec::new();
        while p.ready.len() > keep {
            extra.extend(p.ready.pop_back());
        }
        if gone || !extra.is_empty() {
            p.generation += 1;
        }
        extra
    }

    /// The sizing of `tag`'s pool, if it has one.
    pub fn spec(&self, tag: &str) -> Option<PoolSpec> {
        self.inner
            .lock()
            .unwrap()
            .get(tag)
            .and_then(|p| p.spec.clone())
    }

    /// Takes up to `n` ready children of snapshot `snapshot_id` for `tag`;
    /// counts them as hits and the rest as misses. Children of another
    /// snapshot (the tag moved) are returned in the second list to destroy.
    pub fn take(&self, tag: &str, snapshot_id: &str, n: usize) -> (Vec<V>, Vec<V>) {
        let mut g = self.inner.lock().unwrap();
        let p = g.entry(tag.to_string()).or_default();
        let (stale, current): (Vec<V>, Vec<V>) = p
            .ready
            .drain(..)
            .partition(|v| v.record().snapshot_id != snapshot_id);
        // Resident first, then half read back, then in swap; oldest first
        // within each (the sort is stable).
        let mut ready = current;
        ready.sort_by_key(|v| match v.residency() {
            Residency::Resident => 0,
            Residency::PagingIn => 1,
            Residency::PagedOut => 2,
        });
        let mut ready: VecDeque<V> = ready.into();
        let got: Vec<V> = ready.drain(..n.min(ready.len())).collect();
        p.ready = ready;
        p.hits += got.len() as u64;
        p.misses += (n - got.len()) as u64;
        (got, stale)
    }

    /// Every ready child of `tag` (to destroy: its snapshot is being
    /// deleted). In-flight restores are discarded when they finish.
    #[cfg(test)]
    pub fn drain(&self, tag: &str) -> Vec<V> {
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
    pub fn drain_snapshots(&self, snapshot_ids: &[String]) -> Vec<V> {
        self.drain_where(|v| snapshot_ids.contains(&v.record().snapshot_id))
    }

    /// Every ready child (of any pool) for which `gone` holds; the pools
    /// that lose one discard their in-flight restores when they finish.
    pub fn drain_where(&self, gone: impl Fn(&V) -> bool) -> Vec<V> {
        let mut g = self.inner.lock().unwrap();
        let mut out = Vec::new();
        for p in g.values_mut() {
            let (lost, keep): (Vec<_>, Vec<_>) = p.ready.drain(..).partition(|v| gone(v));
            if !lost.is_empty() {
                p.generation += 1;
            }
            p.ready = keep.into();
            out.extend(lost);
        }
        out
    }

    /// The VM ids of every ready child.
    pub fn vm_ids(&self) -> Vec<String> {
        let g = self.inner.lock().unwrap();
        g.values()
            .flat_map(|p| p.ready.iter().map(|v| v.record().vm_id.clone()))
            .collect()
    }

    /// Ready children whose QEMU has died (killed by the OOM killer, say):
    /// removed here, for the caller to clean up. Their pools refill.
    pub fn remove_dead(&self) -> Vec<V> {
        let mut g = self.inner.lock().unwrap();
        let mut out = Vec::new();
        for p in g.values_mut() {
            let (dead, alive): (Vec<_>, Vec<_>) = p.ready.drain(..).partition(|v| !v.is_alive());
            p.ready = alive.into();
            out.extend(dead);
        }
        out
    }

    /// Ready children of `tag` that count toward its `keep_resident`:
    /// resident, or being paged back in.
    pub fn kept_resident(&self, tag: &str) -> usize {
        self.inner
            .lock()
            .unwrap()
            .get(tag)
            .map_or(0, |p| kept_resident(p))
    }

    /// For each `page_out` pool with fewer than `keep_resident` children
    /// resident and none being paged in, its oldest paged-out child, marked
    /// [`Residency::PagingIn`]; `what` picks what the caller needs of it.
    /// One per pool at a time bounds the CPU this takes from sandboxes.
    pub fn plan_page_ins<R>(&self, what: impl Fn(&V) -> R) -> Vec<PageIn<R>> {
        let mut g = self.inner.lock().unwrap();
        let mut out = Vec::new();
        for (tag, p) in g.iter_mut() {
            let Some(s) = p.spec.as_ref().filter(|s| s.page_out) else {
                continue;
            };
            let busy = p.ready.iter().any(|v| v.residency() == Residency::PagingIn);
            if busy || kept_resident(p) >= s.keep_resident() {
                continue;
            }
            if let Some(v) = p
                .ready
                .iter_mut()
                .find(|v| v.residency() == Residency::PagedOut)
            {
                v.set_residency(Residency::PagingIn);
                out.push(PageIn {
                    tag: tag.clone(),
                    vm_id: v.record().vm_id.clone(),
                    what: what(v),
                });
            }
        }
        out
    }

    /// Ends a page-in: the child is resident if `ok`, else paged out
    /// again. A child taken or destroyed meanwhile is no longer here.
    pub fn finish_page_in(&self, tag: &str, vm_id: &str, ok: bool) {
        let mut g = self.inner.lock().unwrap();
        let Some(p) = g.get_mut(tag) else { return };
        if let Some(v) = p
            .ready
            .iter_mut()
            .find(|v| v.record().vm_id == vm_id && v.residency() == Residency::PagingIn)
        {
            v.set_residency(if ok {
                Residency::Resident
            } else {
                Residency::PagedOut
            });
        }
    }

    /// Restores in flight for `tag`.
    pub fn in_flight(&self, tag: &str) -> usize {
        self.inner
            .lock()
            .unwrap()
            .get(tag)
            .map_or(0, |p| p.in_flight)
    }

    /// Waits until no restore is in flight for any of `tags` (woken by
    /// [`Pools::finish_refill`], no polling). False if `timeout` passed first.
    pub async fn wait_refills_done(&self, tags: &[String], timeout: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Registered before the check, so a finish in between still wakes us.
            let done = self.refill_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if tags.iter().all(|t| self.in_flight(t) == 0) {
                return true;
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                return false;
            }
        }
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
                let s = p.spec.as_ref()?;
                let have = p.ready.len() + p.in_flight;
                let held = p
                    .waiting
                    .as_ref()
                    .is_some_and(|(_, at)| at.elapsed() < HOLD_BACK_RECHECK);
                (have < s.min_ready.min(s.max()) && !held).then(|| (have, t.clone()))
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
                let s = p.spec.as_ref().expect("listed above");
                if p.ready.len() + p.in_flight < s.min_ready.min(s.max()) {
                    p.in_flight += 1;
                    out.push(RefillTicket {
                        tag: t.clone(),
                        generation: p.generation,
                        warm: s.warm,
                        warm_eval: s.warm_eval.clone(),
                        page_out: s.page_out,
                        keep_resident: s.keep_resident(),
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
    pub fn finish_refill(&self, t: &RefillTicket, vm: Option<V>) -> Option<V> {
        let mut g = self.inner.lock().unwrap();
        let p = g.entry(t.tag.clone()).or_default();
        p.in_flight = p.in_flight.saturating_sub(1);
        p.waiting = None;
        self.refill_done.notify_waiters();
        let vm = vm?;
        let room = p.spec.as_ref().is_some_and(|s| p.ready.len() < s.max());
        if p.generation == t.generation && room {
            p.ready.push_back(vm);
            None
        } else {
            Some(vm)
        }
    }

    /// Ends an in-flight refill that did not start because the pool must
    /// wait (`why`, shown in its status); it is planned again after
    /// [`HOLD_BACK_RECHECK`].
    pub fn hold_back(&self, t: &RefillTicket, why: String) {
        let mut g = self.inner.lock().unwrap();
        let p = g.entry(t.tag.clone()).or_default();
        p.in_flight = p.in_flight.saturating_sub(1);
        p.waiting = Some((why, Instant::now()));
        self.refill_done.notify_waiters();
    }

    /// Puts back an adopted child after a restart, unless its pool has no
    /// room for it (deleted, never configured again, or shrunk below its
    /// ready children while poold was down): then the child is handed
    /// back, to destroy. A parked child nobody sized a pool for would hold
    /// its memory and network forever.
    pub fn adopt(&self, vm: V) -> Option<V> {
        let mut g = self.inner.lock().unwrap();
        let p = g.entry(vm.record().tag.clone()).or_default();
        if p.spec.as_ref().is_none_or(|s| p.ready.len() >= s.max()) {
            return Some(vm);
        }
        p.ready.push_back(vm);
        None
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
            None => status_of(tag, &Pool::<V>::default()),
        }
    }
}

fn kept_resident<V: Parked>(p: &Pool<V>) -> usize {
    p.ready
        .iter()
        .filter(|v| v.residency() != Residency::PagedOut)
        .count()
}

fn status_of<V: Parked>(tag: &str, p: &Pool<V>) -> PoolStatus {
    PoolStatus {
        tag: tag.to_string(),
        min_ready: p.spec.as_ref().map_or(0, |s| s.min_ready),
        max_ready: p.spec.as_ref().map_or(0, |s| s.max()),
        warm: p.spec.as_ref().is_some_and(|s| s.warm),
        warm_eval: p.spec.as_ref().and_then(|s| s.warm_eval.clone()),
        page_out: p.spec.as_ref().is_some_and(|s| s.page_out),
        keep_resident: p.spec.as_ref().map_or(0, |s| s.keep_resident()),
        resident: p
            .ready
            .iter()
            .filter(|v| v.residency() == Residency::Resident)
            .count(),
        ready: p.ready.len(),
        in_flight: p.in_flight,
        hits: p.hits,
        misses: p.misses,
        waiting: p.waiting.as_ref().map(|(why, _)| why.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A parked child without a VM: a record and a switch that kills it.
    struct Fake {
        record: PooledRecord,
        alive: Arc<AtomicBool>,
        residency: Residency,
    }

    impl Parked for Fake {
        fn record(&self) -> &PooledRecord {
            &self.record
        }
        fn is_alive(&self) -> bool {
            self.alive.load(Ordering::SeqCst)
        }
        fn residency(&self) -> Residency {
            self.residency
        }
        fn set_residency(&mut self, r: Residency) {
            self.residency = r;
        }
    }

    fn fake(tag: &str, snap: &str, n: usize) -> Fake {
        Fake {
            record: PooledRecord {
                vm_id: format!("sb-{tag}-{snap}-{n}"),
                tag: tag.into(),
                snapshot_id: snap.into(),
                created_at_unix: 0,
                identified: false,
            },
            alive: Arc::new(AtomicBool::new(true)),
            residency: Residency::Resident,
        }
    }

    fn spec(min: usize, max: Option<usize>) -> Option<PoolSpec> {
        Some(PoolSpec {
            min_ready: min,
            max_ready: max,
            warm: false,
            warm_eval: None,
            page_out: false,
            keep_resident: None,
            network: None,
        })
    }

    /// Plans and finishes every refill the pools want, parking a fake of
    /// snapshot `snap` for each.
    fn fill(p: &Pools<Fake>, snap: &str) -> usize {
        let tickets = p.plan_refills(usize::MAX);
        for (i, t) in tickets.iter().enumerate() {
            assert!(p.finish_refill(t, Some(fake(&t.tag, snap, i))).is_none());
        }
        tickets.len()
    }

    #[test]
    fn refills_up_to_min_and_never_past_max() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(3, Some(5)));
        let t = p.plan_refills(2);
        assert_eq!(t.len(), 2, "budget caps the restores started");
        let s = p.status_of("a");
        assert_eq!((s.ready, s.in_flight), (0, 2));
        // ready + in_flight counts toward min_ready: one more only.
        let more = p.plan_refills(10);
        assert_eq!(more.len(), 1);
        for (i, t) in t.iter().chain(&more).enumerate() {
            assert!(p.finish_refill(t, Some(fake("a", "s1", i))).is_none());
        }
        let s = p.status_of("a");
        assert_eq!(
            (s.ready, s.in_flight, s.min_ready, s.max_ready),
            (3, 0, 3, 5)
        );
        assert!(p.plan_refills(10).is_empty(), "full at min_ready");
    }

    #[test]
    fn a_held_back_pool_says_why_and_is_asked_again_later() {
        let p = Pools::<Fake>::default();
        p.set("lazy", spec(2, None));
        p.set("local", spec(1, None));
        let t = p.plan_refills(10);
        assert_eq!(t.len(), 3);
        for t in t.iter().filter(|t| t.tag == "lazy") {
            p.hold_back(t, "working set not local".into());
        }
        let s = p.status_of("lazy");
        assert_eq!((s.ready, s.in_flight), (0, 0));
        assert_eq!(s.waiting.as_deref(), Some("working set not local"));
        // Not planned again at once (the loop wakes for other pools too);
        // other pools are not held up.
        assert!(p.plan_refills(10).is_empty());
        let local = t.iter().find(|t| t.tag == "local").unwrap();
        assert!(p
            .finish_refill(local, Some(fake("local", "s2", 9)))
            .is_none());
        assert_eq!(p.status_of("local").waiting, None);
        std::thread::sleep(HOLD_BACK_RECHECK + Duration::from_millis(50));
        let again = p.plan_refills(10);
        assert_eq!(again.len(), 2, "asked again after the recheck delay");
        assert!(again.iter().all(|t| t.tag == "lazy"));
        // A refill that goes through clears the reason.
        assert!(p
            .finish_refill(&again[0], Some(fake("lazy", "s1", 0)))
            .is_none());
        let s = p.status_of("lazy");
        assert_eq!((s.ready, s.in_flight, s.waiting), (1, 1, None));
    }

    #[tokio::test]
    async fn waiting_for_refills_is_woken_by_their_end() {
        let p = Arc::new(Pools::<Fake>::default());
        p.set("a", spec(2, None));
        let t = p.plan_refills(2);
        let tags = vec!["a".to_string()];
        let short = std::time::Duration::from_millis(50);
        assert!(!p.wait_refills_done(&tags, short).await, "two in flight");
        let waiter = {
            let p = p.clone();
            let tags = tags.clone();
            tokio::spawn(async move {
                p.wait_refills_done(&tags, std::time::Duration::from_secs(30))
                    .await
            })
        };
        tokio::time::sleep(short).await;
        p.finish_refill(&t[0], None);
        tokio::time::sleep(short).await;
        assert!(!waiter.is_finished(), "one refill is still in flight");
        p.finish_refill(&t[1], None);
        assert!(waiter.await.unwrap());
        assert!(p.wait_refills_done(&["other".into()], short).await);
    }

    #[test]
    fn emptiest_pools_fill_first() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(2, None));
        p.set("b", spec(2, None));
        fill(&p, "s");
        p.take("a", "s", 2);
        let t = p.plan_refills(1);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].tag, "a");
    }

    #[test]
    fn paged_out_children_are_paged_in_oldest_first_one_at_a_time() {
        let p = Pools::<Fake>::default();
        let id = |v: &Fake| v.record.vm_id.clone();
        p.set(
            "a",
            Some(PoolSpec {
                page_out: true,
                keep_resident: Some(2),
                network: None,
                ..spec(4, None).unwrap()
            }),
        );
        for (i, t) in p.plan_refills(usize::MAX).iter().enumerate() {
            let mut f = fake(&t.tag, "s", i);
            f.residency = Residency::PagedOut;
            assert!(p.finish_refill(t, Some(f)).is_none());
        }
        p.set("plain", spec(1, None));
        fill(&p, "s");
        // Only the page_out pool, its oldest child, one at a time.
        let first = p.plan_page_ins(id);
        assert_eq!(first.len(), 1, "{first:?}");
        assert_eq!(
            (first[0].tag.as_str(), first[0].what.as_str()),
            ("a", "sb-a-s-0")
        );
        assert!(p.plan_page_ins(id).is_empty());
        assert_eq!(p.kept_resident("a"), 1);
        assert_eq!(p.status_of("a").resident, 0, "not resident until read back");
        // A child being paged in goes before those still in swap.
        let (got, _) = p.take("a", "s", 1);
        assert_eq!(got[0].record.vm_id, "sb-a-s-0");
        p.finish_page_in("a", "sb-a-s-0", true); // taken meanwhile: nothing
        let next = p.plan_page_ins(id);
        assert_eq!(next[0].what, "sb-a-s-1");
        p.finish_page_in("a", "sb-a-s-1", true);
        assert_eq!(p.status_of("a").resident, 1);
        // Fewer than keep_resident (2) still: the next one; a failure puts
        // it back in swap, to be tried again.
        let next = p.plan_page_ins(id);
        assert_eq!(next[0].what, "sb-a-s-2");
        p.finish_page_in("a", "sb-a-s-2", false);
        assert_eq!(p.kept_resident("a"), 1);
        assert_eq!(p.plan_page_ins(id)[0].what, "sb-a-s-2");
        p.finish_page_in("a", "sb-a-s-2", true);
        assert!(p.plan_page_ins(id).is_empty(), "keep_resident reached");
        assert_eq!(p.status_of("a").resident, 2);
    }

    #[test]
    fn resident_children_go_first_then_the_oldest_paged_out() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(4, None));
        let tickets = p.plan_refills(usize::MAX);
        for (i, t) in tickets.iter().enumerate() {
            let mut f = fake("a", "s", i);
            if i != 2 {
                f.residency = Residency::PagedOut; // 0, 1, 3; 2 resident
            }
            assert!(p.finish_refill(t, Some(f)).is_none());
        }
        assert_eq!(p.kept_resident("a"), 1);
        assert_eq!(p.status_of("a").resident, 1);
        let (got, _) = p.take("a", "s", 2);
        let ids: Vec<_> = got.iter().map(|v| v.record.vm_id.as_str()).collect();
        assert_eq!(ids, ["sb-a-s-2", "sb-a-s-0"]);
        let (got, _) = p.take("a", "s", 5);
        let ids: Vec<_> = got.iter().map(|v| v.record.vm_id.as_str()).collect();
        assert_eq!(ids, ["sb-a-s-1", "sb-a-s-3"]);
        assert_eq!(p.status_of("a").misses, 3);
    }

    #[test]
    fn take_counts_hits_and_returns_stale_children() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(3, None));
        fill(&p, "old");
        // The tag moved to snapshot "new": the parked children are stale.
        let (got, stale) = p.take("a", "new", 2);
        assert_eq!((got.len(), stale.len()), (0, 3));
        let s = p.status_of("a");
        assert_eq!((s.hits, s.misses, s.ready), (0, 2, 0));
        fill(&p, "new");
        let (got, stale) = p.take("a", "new", 5);
        assert_eq!((got.len(), stale.len()), (3, 0));
        let s = p.status_of("a");
        assert_eq!((s.hits, s.misses), (3, 4));
    }

    #[test]
    fn a_refill_of_an_older_generation_is_handed_back() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(2, None));
        let t = p.plan_refills(10);
        assert_eq!(t.len(), 2);
        // Drained while the restores were in flight (its snapshot is being
        // deleted): what they bring back must not be parked.
        assert!(p.drain("a").is_empty());
        let back = p.finish_refill(&t[0], Some(fake("a", "s", 0)));
        assert!(back.is_some());
        assert_eq!(p.status_of("a").in_flight, 1);
        // A failed restore only ends the flight.
        assert!(p.finish_refill(&t[1], None).is_none());
        assert_eq!(p.status_of("a").in_flight, 0);
        // A new ticket, of the new generation, parks.
        let t = p.plan_refills(1);
        assert!(p.finish_refill(&t[0], Some(fake("a", "s", 1))).is_none());
        assert_eq!(p.status_of("a").ready, 1);
    }

    #[test]
    fn resizing_down_hands_back_the_extra_and_bumps_the_generation() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(3, None));
        fill(&p, "s");
        p.set("a", spec(3, Some(4)));
        let t = p.plan_refills(10);
        assert!(t.is_empty(), "already at min_ready");
        let extra = p.set("a", spec(1, None));
        assert_eq!(extra.len(), 2);
        assert_eq!(p.status_of("a").ready, 1);
        // Removing the pool hands back everything; refills stop.
        assert_eq!(p.set("a", None).len(), 1);
        assert!(p.plan_refills(10).is_empty());
        // A child restored for a pool without a sizing has no room.
        p.set("b", spec(1, None));
        let t = p.plan_refills(10);
        p.set("b", None);
        assert!(p.finish_refill(&t[0], Some(fake("b", "s", 0))).is_some());
    }

    #[test]
    fn no_room_past_max_even_when_current() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(1, None));
        let t1 = p.plan_refills(10);
        // An adopted child (after a restart) filled the pool meanwhile.
        assert!(p.adopt(fake("a", "s", 9)).is_none());
        assert!(p.finish_refill(&t1[0], Some(fake("a", "s", 0))).is_some());
        assert_eq!(p.status_of("a").ready, 1);
    }

    #[test]
    fn drain_snapshots_takes_only_their_children() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(2, None));
        p.set("b", spec(1, None));
        let tickets = p.plan_refills(10);
        for (i, t) in tickets.iter().enumerate() {
            let snap = if t.tag == "a" && i == 0 { "x" } else { "y" };
            p.finish_refill(t, Some(fake(&t.tag, snap, i)));
        }
        let gone = p.drain_snapshots(&["x".to_string()]);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].record.snapshot_id, "x");
        assert_eq!(p.status_of("a").ready, 1);
        assert_eq!(p.status_of("b").ready, 1);
    }

    #[test]
    fn dead_children_are_removed_and_refilled() {
        let p = Pools::<Fake>::default();
        p.set("a", spec(2, None));
        fill(&p, "s");
        let (got, _) = p.take("a", "s", 1);
        // Put it back as the only one, then kill it.
        assert!(p.adopt(fake("a", "s", 7)).is_none());
        let victim = {
            let g = p.inner.lock().unwrap();
            g["a"].ready.back().unwrap().alive.clone()
        };
        victim.store(false, Ordering::SeqCst);
        let dead = p.remove_dead();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].record.vm_id, "sb-a-s-7");
        assert_eq!(p.status_of("a").ready, 1);
        assert_eq!(p.plan_refills(10).len(), 1);
        drop(got);
    }

    /// A pool deleted just before a kill -9 does not take its children
    /// back at restart: they used to sit parked (with their networks) in a
    /// pool of size 0 forever.
    #[test]
    fn adopting_into_a_deleted_or_full_pool_hands_the_child_back() {
        let p = Pools::<Fake>::default();
        p.set(
            "gone",
            Some(PoolSpec {
                min_ready: 0,
                max_ready: Some(0),
                warm: false,
                warm_eval: None,
                page_out: false,
                keep_resident: None,
                network: None,
            }),
        );
        assert!(p.adopt(fake("gone", "s", 0)).is_some());
        assert_eq!(p.status_of("gone").ready, 0);
        p.set("a", spec(1, None));
        assert!(p.adopt(fake("a", "s", 1)).is_none());
        assert!(p.adopt(fake("a", "s", 2)).is_some());
        assert_eq!(p.status_of("a").ready, 1);
    }

    #[test]
    fn status_lists_pools_with_a_sizing_or_children() {
        let p = Pools::<Fake>::default();
        assert!(p.status().is_empty());
        p.set("a", spec(1, None));
        p.set("b", spec(1, None));
        assert!(p.adopt(fake("b", "s", 0)).is_none());
        p.set("b", None);
        assert!(p.adopt(fake("orphan", "s", 0)).is_some());
        let tags: Vec<String> = p.status().into_iter().map(|s| s.tag).collect();
        assert_eq!(tags, ["a"]);
        let z = p.status_of("none");
        assert_eq!(
            (z.min_ready, z.max_ready, z.ready, z.warm),
            (0, 0, 0, false)
        );
    }
}
