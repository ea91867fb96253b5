//! Lazy snapshots on the mount: fetching chunks the store lacks from their
//! hub when a read needs them, prefetching a snapshot's working set when a
//! restore starts, filling the rest in the background, and recording the
//! working set of snapshots that have none (docs/fs.md, "Lazy snapshots").
//!
//! The fault path (a FUSE read, often a QEMU vCPU blocked on a page fault
//! of `memory.bin`):
//! 1. the read's chunks the store lacks are found (index lookups) and
//!    fetched together: grouped by hub object and coalesced into few ranged
//!    GETs, each chunk verified against its id (bounded zstd decode,
//!    blake3) before anything is answered;
//! 2. **single flight**: a chunk being fetched has one [`Flight`]; every
//!    other read of it waits on that flight, never fetches again. A
//!    planned read ends its chunks' flights as soon as it is done, not
//!    with the rest of its batch;
//! 3. **bounded**: at most [`URGENT_REQUESTS`] requests of faults and
//!    working-set prefetches are in flight, [`FILL_REQUESTS`] of the fill,
//!    which also steps aside while urgent ones run;
//! 4. **retries**: a request that fails for a reason that may pass (network,
//!    5xx, timeout) is retried with backoff (100 ms doubling to 2 s) until
//!    the deadline (`--remote-deadline-secs`, default 120 s) from its first
//!    try; so is a pack a push has promised and not uploaded yet (see
//!    `forkd_remote::layout`, "Pending packs"): a fault's read asks the
//!    pusher for it and polls every 100 ms. A fill read polls without
//!    asking (packs the fill asked for would go ahead of the ones faults
//!    wait on), backs off to 500 ms, gives its request slot up while it
//!    sleeps (the fill's other reads go on), and at the deadline gives the
//!    pack up quietly (no failure; the fill comes back to it). Once a fault
//!    joins a fill read, that read asks, polls every 100 ms and has a
//!    deadline from then. Bytes that fail verification or an object the
//!    hub lacks are refused at once. A
//!    final failure answers that read with EIO, is
//!    logged with the chunk, snapshot and hub, and is kept in the `status`
//!    reply (`lazy.failures`) for poold to report;
//! 5. no lock is held across a network wait: the maps of flights and of
//!    fetched chunks are locked only to look up, insert or remove.
//!
//! Fetched chunks are **pending**: verified, held in memory, served from
//! there, until the writer thread imports them into the store (it opens the
//! store read-write for a moment, with a short lock timeout, so it never
//! holds up poold or the CLI for long and never blocks a read). The store's
//! own rules make that crash-safe: pack bytes are fdatasync'd before the
//! one batch that indexes them (and drops their remote locations). A
//! worker killed with chunks pending loses nothing the store had; the next
//! worker fetches them again. A chunk is visible in the store only once it
//! is durable and verified.
//!
//! The two background threads live in [`writer`] (imports) and [`fill`]
//! (the recorder's clock and the background fill).

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use forkd_layers::{
    ChunkData, ChunkId, ChunkRef, Error as StoreError, FileReader, ObjectId, RemoteChunk,
    SnapshotId, Store, StoreOptions, StoreView, VerifiedChunk, WorkingSet,
};
use forkd_remote::layout::{decode_chunk, Key};
use forkd_remote::packs::{plan_reads, split_read, Coalesce, Location, RangeRead};
use forkd_remote::{Credentials, Hub, Timeouts};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

mod fill;
mod workingset;
mod writer;

/// Requests of faults and working-set prefetches in flight at once.
pub const URGENT_REQUESTS: usize = 32;
/// Requests of the background fill in flight at once.
pub const FILL_REQUESTS: usize = 2;
/// Largest read of a working-set prefetch, and how many are in flight.
const PREFETCH_READ: u64 = 1 << 20;
/// A read that waits this long for its chunks is logged.
const SLOW_READ: Duration = Duration::from_millis(100);
const PREFETCH_WINDOW: usize = 4;
/// Fetched chunks held before the fill waits for the writer (faults never
/// wait for it).
const PENDING_MAX: u64 = 256 << 20;
/// The writer imports once this much is pending (or every tick), unless
/// a restore defers it ([`URGENT_QUIET`]).
const IMPORT_AT: u64 = 8 << 20;
/// The writer (and the fill) leave the store alone while faults or a
/// working-set prefetch run and for this long after the last one fetched
/// something: a restore is under way, and each import opens the store
/// read-write (recovery, a new MANIFEST, table files, syncs), CPU and disk
/// the restoring child would wait behind. Bounded: the writer imports
/// anyway once [`IMPORT_DEFER_MAX`] is pending or it has waited
/// [`IMPORT_DEFER_LONGEST`] (a child that faults for minutes, or reads
/// that keep failing against a dead hub, must not hold up every import,
/// working-set save and "all local").
const URGENT_QUIET: Duration = Duration::from_secs(1);
const IMPORT_DEFER_MAX: u64 = 64 << 20;
const IMPORT_DEFER_LONGEST: Duration = Duration::from_secs(5);
/// Failures kept for `status`.
const FAILURES_KEPT: usize = 32;
/// A working-set recording ends after this long without a read of the
/// snapshot (its first child is idle), at least [`RECORD_MIN`] after the
/// first open, and at most [`RECORD_MAX`] after it.
const RECORD_QUIET: Duration = Duration::from_secs(3);
const RECORD_MIN: Duration = Duration::from_secs(1);
const RECORD_MAX: Duration = Duration::from_secs(30);
/// The fill leaves a lazy snapshot's link to its working set this long
/// after it first sees it (a restore usually starts right after a lazy
/// pull, and its prefetch should have the bandwidth), unless the working
/// set is local by then.
const FILL_GRACE: Duration = Duration::from_secs(10);

/// How lazy reads behave.
#[derive(Debug, Clone, Copy)]
pub struct LazyOptions {
    /// How long one chunk may be retried before its read fails.
    pub deadline: Duration,
    /// Fill lazy snapshots in the background.
    pub fill: bool,
}

impl Default for LazyOptions {
    fn default() -> Self {
        LazyOptions {
            deadline: Duration::from_secs(120),
            fill: true,
        }
    }
}

/// A hub a lazy snapshot comes from, opened once per worker.
struct Source {
    id: u32,
    url: String,
    layout: u32,
    hub: Hub,
    health: Mutex<Health>,
    /// Pending packs this process has asked the pusher for (`wanted/`).
    wanted: Mutex<HashSet<ObjectId>>,
}

/// What the last requests to a hub did.
#[derive(Default, Clone)]
struct Health {
    last_ok: Option<Instant>,
    down_since: Option<Instant>,
    last_error: Option<String>,
    /// When `remote_ready` last probed, and whether the hub answered.
    last_probe: Option<(Instant, bool)>,
}

/// How long a probe's answer stands for later `remote_ready` calls.
const PROBE_FRESH: Duration = Duration::from_secs(1);

/// One chunk being fetched; readers of it wait here.
struct Flight {
    done: Mutex<Option<Result<ChunkData, String>>>,
    cv: Condvar,
    /// A fault waits on it: a fill read polling a promised pack for it
    /// polls at the faults' pace, asks the pusher, and keeps a deadline.
    fault_waits: AtomicBool,
    /// Ended *not yet* (see [`Lazy::try_read`]): a waiter fetches the
    /// chunk itself.
    not_yet: AtomicBool,
}

impl Flight {
    fn new() -> Arc<Flight> {
        Arc::new(Flight {
            done: Mutex::new(None),
            cv: Condvar::new(),
            fault_waits: AtomicBool::new(false),
            not_yet: AtomicBool::new(false),
        })
    }

    fn finish(&self, r: Result<ChunkData, String>) {
        *self.done.lock().unwrap() = Some(r);
        self.cv.notify_all();
    }

    fn wait(&self) -> Result<ChunkData, String> {
        let mut g = self.done.lock().unwrap();
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone();
            }
            g = self.cv.wait(g).unwrap();
        }
    }
}

/// Why a fetch failed.
#[derive(Debug, Clone)]
enum Failure {
    /// May pass (network, server error, timeout): retried to the deadline.
    Transient(String),
    /// Will not pass (bad bytes, a missing object): not retried.
    Refused(String),
    /// A pack a push is still uploading: retried to the deadline like a
    /// transient failure, but the hub is answering, so its health stands.
    Promised(String),
}

/// A failed chunk fetch, as `status` reports it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FetchFailure {
    /// Seconds since the Unix epoch.
    pub at_unix: u64,
    /// The chunk.
    pub chunk: String,
    /// The hub.
    pub source: String,
    /// What went wrong (and for how long it was tried).
    pub error: String,
}

/// A hub as `status` reports it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SourceStatus {
    /// The source's number in the store.
    pub id: u32,
    /// The hub URL.
    pub url: String,
    /// The last request to it succeeded.
    pub healthy: bool,
    /// For how long requests have been failing, ms.
    pub down_ms: Option<u64>,
    /// The last failure.
    pub last_error: Option<String>,
}

/// The `lazy` part of the `status` reply.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct LazyStatus {
    /// Chunks fetched from hubs since the worker started.
    pub fetched_chunks: u64,
    /// Their bytes as the hubs sent them.
    pub fetched_bytes: u64,
    /// Requests sent to hubs.
    pub requests: u64,
    /// Requests that were retried.
    pub retries: u64,
    /// Fetched chunks not yet imported into the store.
    pub pending_chunks: u64,
    /// Their stored bytes.
    pub pending_bytes: u64,
    /// Chunks imported into the store by this worker.
    pub imported_chunks: u64,
    /// Requests of faults and prefetches in flight now.
    pub urgent_in_flight: u64,
    /// Snapshots whose working set is being recorded now.
    pub recording: Vec<String>,
    /// Working sets recorded and saved by this worker.
    pub recorded: u64,
    /// Reads of a lazy snapshot that waited at least 100 ms for a hub.
    #[serde(default)]
    pub slow_reads: u64,
    /// Of those, reads of chunks outside the snapshot's recorded working
    /// set: what a better recording would have fetched ahead.
    #[serde(default)]
    pub slow_reads_outside_working_set: u64,
    /// The hubs opened, and their health.
    pub sources: Vec<SourceStatus>,
    /// The last fetches that failed for good, newest last.
    pub failures: Vec<FetchFailure>,
}

/// The answer of `remote_ready`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoteReady {
    /// The snapshot has chunks still on a hub.
    pub lazy: bool,
    /// Its working set is all here (or pending import).
    pub working_set_local: bool,
    /// Chunks of the working set (0 without one).
    pub working_set_chunks: u64,
}

/// Work only the writer thread does (it opens the store read-write).
#[derive(Default)]
struct Jobs {
    working_sets: Vec<(SnapshotId, WorkingSet)>,
    finish: HashSet<SnapshotId>,
}

/// A working set being recorded.
struct Recording {
    started: Instant,
    last: Instant,
    ws: WorkingSet,
    seen: HashSet<(String, u32)>,
}

#[derive(Default)]
struct Counters {
    fetched_chunks: AtomicU64,
    fetched_bytes: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
    imported: AtomicU64,
    recorded: AtomicU64,
    slow_reads: AtomicU64,
    slow_outside: AtomicU64,
}

/// Everything lazy on one mount (see the module doc).
pub struct Lazy {
    view: StoreView,
    store_dir: PathBuf,
    opts: LazyOptions,
    rt: tokio::runtime::Runtime,
    urgent: tokio::sync::Semaphore,
    fill: tokio::sync::Semaphore,
    urgent_now: AtomicUsize,
    /// When the last urgent read ended, ms since `epoch`.
    last_urgent_ms: AtomicU64,
    epoch: Instant,
    sources: Mutex<HashMap<u32, Arc<Source>>>,
    flights: Mutex<HashMap<ChunkId, Arc<Flight>>>,
    pending: Mutex<HashMap<ChunkId, VerifiedChunk>>,
    pending_bytes: AtomicU64,
    jobs: Mutex<Jobs>,
    writer_wake: (Mutex<bool>, Condvar),
    prefetches: Mutex<HashMap<SnapshotId, Arc<Flight>>>,
    recordings: Mutex<HashMap<SnapshotId, Recording>>,
    recorded: Mutex<HashSet<SnapshotId>>,
    /// Working sets' chunks, for telling slow reads outside them.
    ws_chunks: Mutex<HashMap<SnapshotId, Arc<HashSet<ChunkId>>>>,
    failures: Mutex<VecDeque<FetchFailure>>,
    counters: Counters,
    /// When the fill first saw each lazy snapshot.
    fill_seen: Mutex<HashMap<SnapshotId, Instant>>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Lazy {
    /// Starts the lazy machinery of a worker: its runtime, the writer, the
    /// fill and the recorder's clock. Installs itself as the view's
    /// [`forkd_layers::Fetcher`].
    pub fn start(
        view: StoreView,
        store_dir: PathBuf,
        opts: LazyOptions,
    ) -> anyhow::Result<Arc<Lazy>> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("forkd-fs-remote")
            .enable_all()
            .build()?;
        let lazy = Arc::new(Lazy {
            view: view.clone(),
            store_dir,
            opts,
            rt,
            urgent: tokio::sync::Semaphore::new(URGENT_REQUESTS),
            fill: tokio::sync::Semaphore::new(FILL_REQUESTS),
            urgent_now: AtomicUsize::new(0),
            last_urgent_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            sources: Mutex::new(HashMap::new()),
            flights: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            pending_bytes: AtomicU64::new(0),
            jobs: Mutex::new(Jobs::default()),
            writer_wake: (Mutex::new(false), Condvar::new()),
            prefetches: Mutex::new(HashMap::new()),
            recordings: Mutex::new(HashMap::new()),
            recorded: Mutex::new(HashSet::new()),
            ws_chunks: Mutex::new(HashMap::new()),
            failures: Mutex::new(VecDeque::new()),
            counters: Counters::default(),
            fill_seen: Mutex::new(HashMap::new()),
        });
        view.set_fetcher(Arc::new(ViewFetcher(Arc::downgrade(&lazy))));
        let l = lazy.clone();
        std::thread::Builder::new()
            .name("forkd-fs-writer".into())
            .spawn(move || l.writer_loop())?;
        let l = lazy.clone();
        std::thread::Builder::new()
            .name("forkd-fs-fill".into())
            .spawn(move || l.housekeeping_loop())?;
        Ok(lazy)
    }

    // ---- the read path ----------------------------------------------------

    /// Whether reads of `snap` may need fetching (it is lazy).
    pub fn is_lazy(&self, snap: &SnapshotId) -> bool {
        self.view.lazy_source(snap).ok().flatten().is_some()
    }

    /// Makes sure every chunk of `len` bytes at `offset` of `r` is local or
    /// pending, fetching the missing ones together (see the module doc).
    /// Called before a read of a lazy snapshot's file.
    pub fn ensure(&self, r: &FileReader, offset: u64, len: u64) -> forkd_layers::Result<()> {
        let m = r.manifest();
        let cs = u64::from(m.chunk_size());
        if len == 0 || offset >= m.size() {
            return Ok(());
        }
        let first = offset / cs;
        let last = (offset + len - 1).min(m.size() - 1) / cs;
        let mut ids = Vec::new();
        for slot in first..=last {
            if let ChunkRef::Chunk(c) = m.entry(slot as usize) {
                if !ids.contains(&c) {
                    ids.push(c);
                }
            }
        }
        let t0 = Instant::now();
        let waited_for = self.ensure_chunks(&ids, true)?;
        if !waited_for.is_empty() && t0.elapsed() >= SLOW_READ {
            self.note_slow_read(r, offset, len, &waited_for, t0.elapsed());
        }
        Ok(())
    }

    /// Counts and logs a read that waited for `chunks` from a hub; one
    /// that waited for chunks outside the recorded working set is logged at
    /// info (the working set should have fetched them ahead), the rest at
    /// debug.
    fn note_slow_read(
        &self,
        r: &FileReader,
        offset: u64,
        len: u64,
        chunks: &[ChunkId],
        waited: Duration,
    ) {
        let c = &self.counters;
        c.slow_reads.fetch_add(1, Ordering::Relaxed);
        let outside = self
            .working_set_chunks(r.snapshot())
            .is_some_and(|ws| chunks.iter().any(|c| !ws.contains(c)));
        let ms = waited.as_millis() as u64;
        if outside {
            c.slow_outside.fetch_add(1, Ordering::Relaxed);
            info!(snapshot = %r.snapshot(), file = r.name(), offset, len, ms, "a read outside the working set waited for the hub");
        } else {
            debug!(snapshot = %r.snapshot(), file = r.name(), offset, len, ms, "a read waited for the hub");
        }
    }

    /// Fetches the chunks of `ids` that are neither indexed nor pending,
    /// joining flights already under way; returns once all are here, with
    /// those it fetched or waited for.
    fn ensure_chunks(&self, ids: &[ChunkId], urgent: bool) -> forkd_layers::Result<Vec<ChunkId>> {
        let have = self.view.has_chunks(ids)?;
        let absent: Vec<ChunkId> = {
            let pending = self.pending.lock().unwrap();
            ids.iter()
                .zip(have)
                .filter(|(c, h)| !h && !pending.contains_key(*c))
                .map(|(c, _)| *c)
                .collect()
        };
        if absent.is_empty() {
            return Ok(Vec::new());
        }
        let locs = self.view.remote_chunks(&absent)?;
        let mut lead: Vec<(ChunkId, RemoteChunk)> = Vec::new();
        let mut wait: Vec<(ChunkId, Arc<Flight>)> = Vec::new();
        {
            // Checked again under the flights lock: a flight that ended
            // since the check above left its chunk pending (its leader
            // keeps it before it removes the flight), or the writer has
            // imported it since (it drops a chunk from pending only once
            // the view has it). Without this, a chunk could be fetched
            // twice. Lock order, as in the fill: pending, then flights.
            let pending = self.pending.lock().unwrap();
            let mut flights = self.flights.lock().unwrap();
            let mut maybe: Vec<(ChunkId, RemoteChunk)> = Vec::new();
            {
                for (c, loc) in absent.iter().zip(locs) {
                    // Not located: not remote after all (or stale view);
                    // the read goes to the store, which says what is wrong.
                    let Some(loc) = loc else { continue };
                    match flights.get(c) {
                        Some(f) => {
                            if urgent {
                                f.fault_waits.store(true, Ordering::Relaxed);
                            }
                            wait.push((*c, f.clone()))
                        }
                        None if pending.contains_key(c) => {}
                        None => maybe.push((*c, loc)),
                    }
                }
            }
            drop(pending);
            let ids: Vec<ChunkId> = maybe.iter().map(|(c, _)| *c).collect();
            let stored = self.view.has_chunks(&ids)?;
            for ((c, loc), stored) in maybe.into_iter().zip(stored) {
                if !stored {
                    flights.insert(c, Flight::new());
                    lead.push((c, loc));
                }
            }
        }
        let fetched: Vec<ChunkId> = lead
            .iter()
            .map(|(c, _)| *c)
            .chain(wait.iter().map(|(c, _)| *c))
            .collect();
        let mut first_err = None;
        if !lead.is_empty() {
            if let Err(e) = self.fetch_led(lead, urgent) {
                first_err = Some(e);
            }
        }
        let mut again = Vec::new();
        for (c, f) in wait {
            match f.wait() {
                Ok(_) => {}
                Err(_) if f.not_yet.load(Ordering::Relaxed) => again.push(c),
                Err(e) => {
                    first_err.get_or_insert((c, e));
                }
            }
        }
        if !again.is_empty() && first_err.is_none() {
            // A fill read gave up on a pack still to come as this joined.
            self.ensure_chunks(&again, urgent)?;
        }
        match first_err {
            None => Ok(fetched),
            Some((id, reason)) => Err(StoreError::RemoteFetch {
                id,
                source_url: self.url_of(&id),
                reason,
            }),
        }
    }

    /// Whether every chunk of `ids` is in the store or fetched and
    /// pending import.
    pub(super) fn all_here(&self, ids: &[ChunkId]) -> forkd_layers::Result<bool> {
        let have = self.view.has_chunks(ids)?;
        let pending = self.pending.lock().unwrap();
        Ok(ids
            .iter()
            .zip(have)
            .all(|(c, h)| h || pending.contains_key(c)))
    }

    /// Fetches chunks this thread leads the flights of (each read ends its
    /// own; this ends those no read answered). Returns the first failure.
    fn fetch_led(
        &self,
        lead: Vec<(ChunkId, RemoteChunk)>,
        urgent: bool,
    ) -> Result<(), (ChunkId, String)> {
        let ids: Vec<ChunkId> = lead.iter().map(|(c, _)| *c).collect();
        let results = self.rt.block_on(self.fetch_many(lead, urgent));
        let mut first_err = None;
        let mut flights = self.flights.lock().unwrap();
        for id in ids {
            match results.get(&id) {
                // Its read ended its flight; a flight of it now is a new
                // one, another's.
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    first_err.get_or_insert_with(|| (id, e.clone()));
                }
                None => {
                    let e = format!("the hub's answer did not hold chunk {id}");
                    first_err.get_or_insert_with(|| (id, e.clone()));
                    if let Some(f) = flights.remove(&id) {
                        f.finish(Err(e));
                    }
                }
            }
        }
        match first_err {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Groups chunks by source and object, plans coalesced reads and runs
    /// them (bounded), each with retries to the deadline.
    async fn fetch_many(
        &self,
        chunks: Vec<(ChunkId, RemoteChunk)>,
        urgent: bool,
    ) -> HashMap<ChunkId, Result<ChunkData, String>> {
        let mut by_source: HashMap<u32, Vec<(ChunkId, RemoteChunk)>> = HashMap::new();
        for (c, l) in chunks {
            by_source.entry(l.source).or_default().push((c, l));
        }
        let mut tasks = Vec::new();
        let mut out = HashMap::new();
        for (src_id, list) in by_source {
            let src = match self.source(src_id) {
                Ok(s) => s,
                Err(e) => {
                    for (c, _) in list {
                        out.insert(c, Err(e.clone()));
                    }
                    continue;
                }
            };
            for read in reads_for(&src, &list, urgent) {
                tasks.push(self.run_read(src.clone(), read, urgent));
            }
        }
        for r in futures::future::join_all(tasks).await {
            out.extend(r);
        }
        out
    }

    /// One planned read: waits for a request slot, fetches with retries,
    /// verifies, keeps the chunks pending, then ends their flights (each
    /// read as soon as it is done, not with the rest of its batch) and
    /// returns their bytes.
    async fn run_read(
        &self,
        src: Arc<Source>,
        read: RangeRead,
        urgent: bool,
    ) -> Vec<(ChunkId, Result<ChunkData, String>)> {
        let (out, not_yet) = self.try_read(&src, &read, urgent).await;
        let mut flights = self.flights.lock().unwrap();
        for (c, r) in &out {
            if let Some(f) = flights.remove(c) {
                f.not_yet.store(not_yet, Ordering::Relaxed);
                f.finish(r.clone());
            }
        }
        out
    }

    /// [`Lazy::run_read`]'s fetch. Also says whether it ended *not yet*: a
    /// fill read that gave a promised pack up at the deadline while no
    /// fault waited on it. That is no failure (nothing is recorded; a
    /// fault that joins its flight in the last instant fetches the chunk
    /// itself, and the fill comes back to it).
    async fn try_read(
        &self,
        src: &Source,
        read: &RangeRead,
        urgent: bool,
    ) -> (Vec<(ChunkId, Result<ChunkData, String>)>, bool) {
        let sem = if urgent { &self.urgent } else { &self.fill };
        let mut permit = Some(sem.acquire().await.expect("semaphore open"));
        let _gauge = urgent.then(|| Gauge::up(&self.urgent_now));
        let start = Instant::now();
        // When a fault joined this fill read: its deadline runs from then.
        let mut fault_since: Option<Instant> = None;
        let mut delay = Duration::from_millis(100);
        let mut not_yet = false;
        let result = loop {
            if permit.is_none() {
                permit = Some(sem.acquire().await.expect("semaphore open"));
            }
            if !urgent && fault_since.is_none() && self.fault_waits_on(read) {
                fault_since = Some(Instant::now());
            }
            let faulted = urgent || fault_since.is_some();
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            let (why, hint, promised) = match self.get_read(src, read, faulted).await {
                Ok(chunks) => {
                    src.ok();
                    break Ok(chunks);
                }
                Err(Failure::Refused(why)) => break Err(why),
                Err(Failure::Transient(why)) => {
                    src.failed(&why);
                    let hint = format!("is {} reachable?", src.url);
                    (why, hint, false)
                }
                Err(Failure::Promised(why)) => {
                    let hint = "if its push is still running, raise --remote-deadline-secs; if it stopped, run it again to complete the snapshot";
                    (why, hint.to_string(), true)
                }
            };
            let from = fault_since.unwrap_or(start);
            if from.elapsed() + delay > self.opts.deadline {
                not_yet = promised && !faulted;
                break Err(format!(
                    "{why} (retried for {:.0} s, the deadline; {hint})",
                    from.elapsed().as_secs_f64(),
                ));
            }
            self.counters.retries.fetch_add(1, Ordering::Relaxed);
            debug!(hub = %src.url, "retrying in {delay:?}: {why}");
            if promised && !urgent {
                // The fill's other reads (which faults may wait on) run
                // meanwhile: a pack that is up is not held up by one a
                // push has still to send.
                permit = None;
            }
            tokio::time::sleep(delay).await;
            // A promised pack a fault waits on is polled for every 100 ms
            // (asked for, it comes soon); the fill's polls back off to
            // 500 ms (a fault that joins waits out one at most); errors
            // back off to 2 s.
            delay = if promised && (urgent || self.fault_waits_on(read)) {
                Duration::from_millis(100)
            } else if promised {
                (delay * 2).min(Duration::from_millis(500))
            } else {
                (delay * 2).min(Duration::from_secs(2))
            };
        };
        drop(permit);
        if urgent && result.is_ok() {
            let now = self.epoch.elapsed().as_millis().max(1);
            self.last_urgent_ms.store(now as u64, Ordering::Relaxed);
        }
        let out = match result {
            Ok(chunks) => chunks,
            Err(why) => {
                if !not_yet {
                    for (c, _, _) in &read.chunks {
                        self.record_failure(c, &src.url, &why);
                    }
                }
                read.chunks
                    .iter()
                    .map(|(c, _, _)| (*c, Err(why.clone())))
                    .collect()
            }
        };
        (out, not_yet)
    }

    /// One attempt at a read: the bytes, then each chunk verified and kept
    /// pending.
    async fn get_read(
        &self,
        src: &Source,
        read: &RangeRead,
        ask: bool,
    ) -> Result<Vec<(ChunkId, Result<ChunkData, String>)>, Failure> {
        let layout1 = src.layout == forkd_remote::LAYOUT_CHUNKS;
        let key = if layout1 {
            Key::Chunk(ChunkId(read.object.0))
        } else {
            Key::Pack(read.object)
        };
        let got = if read.object_len.is_none() || read.object_len == Some(read.len) {
            src.hub.get(&key).await
        } else {
            src.hub.get_range(&key, read.start, read.len).await
        };
        let bytes = match got {
            Ok(Some(b)) => b,
            Ok(None) => return Err(missing(src, read, &key, ask).await),
            Err(e) => return Err(Failure::Transient(format!("{e:#}"))),
        };
        self.counters
            .fetched_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let read2 = read.clone();
        let checked = tokio::task::spawn_blocking(move || {
            if layout1 {
                let id = ChunkId(read2.object.0);
                vec![decode_chunk(id, &bytes)
                    .and_then(|c| c.verify_decoded())
                    .map_err(|why| (id, why))]
            } else {
                split_read(&read2, &bytes)
                    .into_iter()
                    .map(|r| r.and_then(reverify))
                    .collect()
            }
        })
        .await
        .map_err(|e| Failure::Transient(format!("verifying panicked: {e}")))?;
        let mut out = Vec::new();
        for r in checked {
            match r {
                Ok((v, raw)) => {
                    self.counters.fetched_chunks.fetch_add(1, Ordering::Relaxed);
                    let id = v.id;
                    self.keep(v);
                    out.push((id, Ok(ChunkData::from(raw))));
                }
                Err((id, why)) => {
                    let msg = format!(
                        "chunk {id} from {} failed verification ({why}); refused, the hub copy is corrupt: re-push the snapshot",
                        src.url
                    );
                    self.record_failure(&id, &src.url, &msg);
                    out.push((id, Err(msg)));
                }
            }
        }
        Ok(out)
    }

    /// Keeps a verified chunk until the writer imports it.
    fn keep(&self, v: VerifiedChunk) {
        let n = v.payload.len() as u64;
        if self.pending.lock().unwrap().insert(v.id, v).is_none() {
            let total = self.pending_bytes.fetch_add(n, Ordering::Relaxed) + n;
            if total >= IMPORT_AT {
                self.wake_writer();
            }
        }
    }

    /// A fault on one chunk the view did not find (the view's fallback,
    /// when a read came without [`Lazy::ensure`]).
    fn fetch_one(&self, id: &ChunkId, _loc: &RemoteChunk) -> forkd_layers::Result<ChunkData> {
        if let Some(d) = self.pending_data(id) {
            return Ok(d);
        }
        self.ensure_chunks(std::slice::from_ref(id), true)?;
        match self.pending_data(id) {
            Some(d) => Ok(d),
            // Imported meanwhile: the store has it now.
            None => {
                self.view.catch_up()?;
                self.view.chunk(id)
            }
        }
    }

    /// A pending chunk's bytes.
    fn pending_data(&self, id: &ChunkId) -> Option<ChunkData> {
        let v = self.pending.lock().unwrap().get(id).cloned()?;
        v.into_inner()
            .verify_decoded()
            .ok()
            .map(|(_, raw)| ChunkData::from(raw))
    }

    fn url_of(&self, id: &ChunkId) -> String {
        self.view
            .remote_chunk(id)
            .ok()
            .flatten()
            .and_then(|l| {
                self.sources
                    .lock()
                    .unwrap()
                    .get(&l.source)
                    .map(|s| s.url.clone())
            })
            .unwrap_or_else(|| "its hub".into())
    }

    /// Whether a fault has joined the flight of a chunk of `read`.
    fn fault_waits_on(&self, read: &RangeRead) -> bool {
        let flights = self.flights.lock().unwrap();
        read.chunks.iter().any(|(c, _, _)| {
            flights
                .get(c)
                .is_some_and(|f| f.fault_waits.load(Ordering::Relaxed))
        })
    }

    fn record_failure(&self, chunk: &ChunkId, url: &str, why: &str) {
        warn!(chunk = %chunk, hub = %url, "fetching a chunk of a lazy snapshot failed: {why}");
        let mut f = self.failures.lock().unwrap();
        f.push_back(FetchFailure {
            at_unix: unix_now(),
            chunk: chunk.to_string(),
            source: url.to_string(),
            error: why.to_string(),
        });
        while f.len() > FAILURES_KEPT {
            f.pop_front();
        }
    }

    /// The opened hub of source `id` (opened on first use, with the
    /// credentials the lazy pull saved).
    fn source(&self, id: u32) -> Result<Arc<Source>, String> {
        if let Some(s) = self.sources.lock().unwrap().get(&id) {
            return Ok(s.clone());
        }
        let rec = self
            .view
            .remote_source(id)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("remote source {id} is not in the store"))?;
        let creds = Credentials::load(&Credentials::path(&self.store_dir, id))
            .map_err(|e| format!("{e:#}"))?;
        let hub = Hub::open_with(&rec.url, &creds, Timeouts::LAZY)
            .map_err(|e| format!("opening {}: {e:#}", rec.url))?;
        let s = Arc::new(Source {
            id,
            url: rec.url,
            layout: rec.layout,
            hub,
            health: Mutex::new(Health::default()),
            wanted: Mutex::new(HashSet::new()),
        });
        Ok(self.sources.lock().unwrap().entry(id).or_insert(s).clone())
    }

    /// Whether `snap` can be restored without waiting on a dead hub: not
    /// lazy, or its hub answers (a HEAD of the record, 3 s at most; an
    /// answer stands for a second, so a burst of spawns probes once).
    /// Starts the working-set prefetch; with `wait`, waits for it up to
    /// that long.
    pub fn remote_ready(
        self: &Arc<Self>,
        snap: SnapshotId,
        wait: Duration,
    ) -> anyhow::Result<RemoteReady> {
        let Some(src_id) = self.view.lazy_source(&snap)? else {
            return Ok(RemoteReady {
                lazy: false,
                working_set_local: true,
                working_set_chunks: 0,
            });
        };
        let flight = self.start_prefetch(snap);
        let src = self.source(src_id).map_err(|e| anyhow::anyhow!(e))?;
        let last_probe = src.health.lock().unwrap().last_probe;
        let fresh = last_probe.filter(|(at, _)| at.elapsed() < PROBE_FRESH);
        if let Some((_, false)) = fresh {
            let h = src.health.lock().unwrap().clone();
            anyhow::bail!(
                "snapshot {snap} is lazy and its hub {} does not answer ({}); new children cannot start until it does (running ones wait for it, up to {} s per read)",
                src.url,
                h.last_error.unwrap_or_default(),
                self.opts.deadline.as_secs()
            );
        }
        if fresh.is_none() {
            let probe = self.rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(3), src.hub.has(&[Key::Snapshot(snap)]))
                    .await
            });
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            let answered = matches!(probe, Ok(Ok(_)));
            src.health.lock().unwrap().last_probe = Some((Instant::now(), answered));
            match probe {
                Ok(Ok(_)) => src.ok(),
                Ok(Err(e)) => {
                    let why = format!("{e:#}");
                    src.failed(&why);
                    anyhow::bail!(
                        "snapshot {snap} is lazy and its hub {} does not answer ({why}); new children cannot start until it does (running ones wait for it, up to {} s per read)",
                        src.url,
                        self.opts.deadline.as_secs()
                    );
                }
                Err(_) => {
                    src.failed("no answer within 3 s");
                    anyhow::bail!(
                        "snapshot {snap} is lazy and its hub {} does not answer within 3 s; new children cannot start until it does (running ones wait for it, up to {} s per read)",
                        src.url,
                        self.opts.deadline.as_secs()
                    );
                }
            }
        }
        if !wait.is_zero() {
            let deadline = Instant::now() + wait;
            let mut g = flight.done.lock().unwrap();
            while g.is_none() && Instant::now() < deadline {
                g = flight
                    .cv
                    .wait_timeout(g, deadline - Instant::now())
                    .unwrap()
                    .0;
            }
            if let Some(Err(e)) = g.as_ref() {
                anyhow::bail!("fetching the working set of snapshot {snap}: {e}");
            }
        }
        let rec = self
            .view
            .snapshot(&snap)?
            .ok_or(StoreError::NoSuchSnapshot(snap))?;
        let (n, local) = match self.view.working_set(&snap)? {
            Some(ws) => {
                let c = ws.chunks(&self.view, &rec)?;
                (c.len() as u64, self.all_here(&c)?)
            }
            None => (0, false),
        };
        Ok(RemoteReady {
            lazy: true,
            working_set_local: local,
            working_set_chunks: n,
        })
    }

    /// The `lazy` part of `status`.
    pub fn status(&self) -> LazyStatus {
        let c = &self.counters;
        let (pending_chunks, pending_bytes) = {
            let p = self.pending.lock().unwrap();
            (p.len() as u64, self.pending_bytes.load(Ordering::Relaxed))
        };
        LazyStatus {
            fetched_chunks: c.fetched_chunks.load(Ordering::Relaxed),
            fetched_bytes: c.fetched_bytes.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            pending_chunks,
            pending_bytes,
            imported_chunks: c.imported.load(Ordering::Relaxed),
            urgent_in_flight: self.urgent_now.load(Ordering::Relaxed) as u64,
            recording: self
                .recordings
                .lock()
                .unwrap()
                .keys()
                .map(|k| k.to_string())
                .collect(),
            recorded: c.recorded.load(Ordering::Relaxed),
            slow_reads: c.slow_reads.load(Ordering::Relaxed),
            slow_reads_outside_working_set: c.slow_outside.load(Ordering::Relaxed),
            sources: self
                .sources
                .lock()
                .unwrap()
                .values()
                .map(|s| {
                    let h = s.health.lock().unwrap();
                    SourceStatus {
                        id: s.id,
                        url: s.url.clone(),
                        healthy: h.down_since.is_none() && h.last_ok.is_some(),
                        down_ms: h.down_since.map(|d| d.elapsed().as_millis() as u64),
                        last_error: h.last_error.clone(),
                    }
                })
                .collect(),
            failures: self.failures.lock().unwrap().iter().cloned().collect(),
        }
    }
}

/// Re-checks a verified chunk to also get its uncompressed bytes.
fn reverify(v: VerifiedChunk) -> Result<(VerifiedChunk, Vec<u8>), (ChunkId, String)> {
    let id = v.id;
    v.into_inner().verify_decoded().map_err(|why| (id, why))
}

/// Where a located chunk sits in its pack, as the read planner takes it.
fn pack_location(l: &RemoteChunk) -> Location {
    Location {
        pack: l.object,
        pack_len: 0,
        offset: l.offset,
        len: l.len,
        raw_len: l.raw_len,
        index: ObjectId::default(),
    }
}

/// The reads for `list` on `src`: coalesced ranges of packs (layout 2), or
/// one whole object per chunk (layout 1).
fn reads_for(src: &Source, list: &[(ChunkId, RemoteChunk)], urgent: bool) -> Vec<RangeRead> {
    if src.layout == forkd_remote::LAYOUT_CHUNKS {
        return list
            .iter()
            .map(|(c, _)| RangeRead {
                object: ObjectId(c.0),
                start: 0,
                len: 0,
                object_len: None,
                chunks: vec![(*c, 0, 0)],
            })
            .collect();
    }
    let wanted: Vec<(ChunkId, Location)> =
        list.iter().map(|(c, l)| (*c, pack_location(l))).collect();
    let c = if urgent {
        Coalesce::LAZY
    } else {
        Coalesce {
            max_read: 4 << 20,
            whole_pack: 2.0,
            ..Coalesce::BULK
        }
    };
    plan_reads(&wanted, c)
}

/// Why the object of `read` is missing: a pack a push promised (wait, and
/// ask the pusher for it when `ask`: a fault waits on it), one that
/// arrived between the two requests (read again), or one that is not
/// coming (refuse). Only plain object stores hold promises.
async fn missing(src: &Source, read: &RangeRead, key: &Key, ask: bool) -> Failure {
    if src.layout == forkd_remote::LAYOUT_CHUNKS || !src.hub.is_object_store() {
        return Failure::Refused(incomplete(&src.url, key));
    }
    match src.hub.pack_pending(&read.object).await {
        Ok(true) => {
            // Not for the fill alone: packs it asked for would go ahead of
            // the ones faults wait on (the push sends asked-for packs in
            // its own order), and all of a fill batch's reads poll.
            if ask {
                src.want(&read.object).await;
            }
            Failure::Promised(format!(
                "{key} is not on {} yet: a push still running promised it",
                src.url
            ))
        }
        Ok(false) => match src.hub.has(std::slice::from_ref(key)).await {
            Ok(up) if up[0] => Failure::Promised(format!("{key} arrived on {}", src.url)),
            Ok(_) => Failure::Refused(incomplete(&src.url, key)),
            Err(e) => Failure::Transient(format!("{e:#}")),
        },
        Err(e) => Failure::Transient(format!("{e:#}")),
    }
}

/// The error for an object the hub lacks and no push has promised.
fn incomplete(url: &str, key: &Key) -> String {
    format!("{url} has no {key}; the hub copy is incomplete, push the snapshot again")
}

impl Source {
    fn ok(&self) {
        let mut h = self.health.lock().unwrap();
        if h.down_since.is_some() {
            info!(hub = %self.url, "the hub answers again");
        }
        h.last_ok = Some(Instant::now());
        h.down_since = None;
    }

    /// Asks the pusher for pending pack `pack` (once per pack): a push
    /// sends wanted packs before the rest. Best effort: a hub that does not
    /// take the marker leaves the push's own order.
    async fn want(&self, pack: &ObjectId) {
        if !self.hub.is_object_store() || !self.wanted.lock().unwrap().insert(*pack) {
            return;
        }
        if let Err(e) = self
            .hub
            .put(&Key::Wanted(*pack), b"{}".to_vec().into())
            .await
        {
            debug!(hub = %self.url, "asking for pack {pack} failed: {e:#}");
        }
    }

    fn failed(&self, why: &str) {
        let mut h = self.health.lock().unwrap();
        if h.down_since.is_none() {
            warn!(hub = %self.url, "a request to the hub failed: {why}; retrying");
        }
        h.down_since.get_or_insert_with(Instant::now);
        h.last_error = Some(why.to_string());
    }
}

/// Counts what is in flight while it lives.
struct Gauge<'a>(&'a AtomicUsize);

impl<'a> Gauge<'a> {
    fn up(n: &'a AtomicUsize) -> Gauge<'a> {
        n.fetch_add(1, Ordering::Relaxed);
        Gauge(n)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The view's fetcher: a weak handle, so the view (held by `Lazy`) does not
/// keep `Lazy` alive in a cycle.
struct ViewFetcher(std::sync::Weak<Lazy>);

impl forkd_layers::Fetcher for ViewFetcher {
    fn fetch(&self, id: &ChunkId, loc: &RemoteChunk) -> forkd_layers::Result<ChunkData> {
        match self.0.upgrade() {
            Some(l) => l.fetch_one(id, loc),
            None => Err(StoreError::RemoteFetch {
                id: *id,
                source_url: "its hub".into(),
                reason: "the mount is shutting down".into(),
            }),
        }
    }
}
