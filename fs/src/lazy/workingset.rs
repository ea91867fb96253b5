//! Working sets on a mount of [`Lazy`]: recording a snapshot's working set
//! on its first restore, fetching a lazy snapshot's working set ahead of
//! its faults, and telling which slow reads it missed (docs/fs.md,
//! "Recording working sets" and "Lazy snapshots").

use super::*;

impl Lazy {
    /// A file of `snap` was opened (`first`: no other handle of the
    /// snapshot was open). Starts the working-set prefetch of a lazy
    /// snapshot, and the recording of the working set of a snapshot that
    /// has none. The recording sees what the kernel asks for, so it is
    /// complete when the page cache holds nothing of the snapshot: true
    /// for a snapshot's first restore after it was made or pulled (its
    /// files were never read through the mount); a snapshot first opened
    /// after a worker restart may have pages cached and records less.
    pub fn on_open(self: &Arc<Self>, snap: SnapshotId, first: bool) {
        if self.is_lazy(&snap) {
            self.start_prefetch(snap);
        }
        if !first
            || self.recorded.lock().unwrap().contains(&snap)
            || self.recordings.lock().unwrap().contains_key(&snap)
        {
            return;
        }
        match self.view.working_set(&snap) {
            Ok(None) => {}
            _ => {
                self.recorded.lock().unwrap().insert(snap);
                return;
            }
        }
        let now = Instant::now();
        self.recordings.lock().unwrap().insert(
            snap,
            Recording {
                started: now,
                last: now,
                ws: WorkingSet::new(),
                seen: HashSet::new(),
            },
        );
        info!(snapshot = %snap, "recording its working set (its first restore)");
    }

    /// Notes a read for a working set being recorded.
    pub fn note_read(&self, snap: &SnapshotId, file: &str, offset: u64, len: u64, chunk: u64) {
        if len == 0 || chunk == 0 {
            return;
        }
        let mut recs = self.recordings.lock().unwrap();
        let Some(r) = recs.get_mut(snap) else { return };
        r.last = Instant::now();
        for slot in offset / chunk..=(offset + len - 1) / chunk {
            let slot = slot as u32;
            if r.seen.insert((file.to_string(), slot)) {
                r.ws.push(file, slot);
            }
        }
    }

    /// Starts fetching `snap`'s working set in its recorded order (once per
    /// worker, again after a failure); faults on its chunks join those
    /// flights.
    pub(super) fn start_prefetch(self: &Arc<Self>, snap: SnapshotId) -> Arc<Flight> {
        let mut p = self.prefetches.lock().unwrap();
        if let Some(f) = p.get(&snap) {
            // A failed prefetch (its hub was down) starts again.
            if !matches!(*f.done.lock().unwrap(), Some(Err(_))) {
                return f.clone();
            }
        }
        let flight = Flight::new();
        p.insert(snap, flight.clone());
        drop(p);
        let (l, f) = (self.clone(), flight.clone());
        let spawned = std::thread::Builder::new()
            .name("forkd-fs-prefetch".into())
            .spawn(move || {
                let t0 = Instant::now();
                let r = l.prefetch_working_set(&snap);
                match &r {
                    Ok(n) => info!(
                        snapshot = %snap,
                        chunks = n,
                        ms = t0.elapsed().as_millis() as u64,
                        "working set prefetched"
                    ),
                    Err(e) => warn!(snapshot = %snap, "working-set prefetch failed: {e}"),
                }
                f.finish(
                    r.map(|_| ChunkData::from(Vec::new()))
                        .map_err(|e| e.to_string()),
                );
            });
        if let Err(e) = spawned {
            flight.finish(Err(e.to_string()));
        }
        flight
    }

    /// Fetches the working set **in the order it was recorded**, in reads
    /// of up to [`PREFETCH_READ`] with [`PREFETCH_WINDOW`] in flight: the
    /// chunks a restore needs first arrive first (all at once would share
    /// the link and finish together), and the link stays full. Flights are
    /// taken per read as it is issued, so a fault on a chunk further down
    /// the list fetches it at once instead of queueing behind the others.
    fn prefetch_working_set(&self, snap: &SnapshotId) -> forkd_layers::Result<usize> {
        let Some(rec) = self.view.snapshot(snap)? else {
            return Ok(0);
        };
        let Some(ws) = self.view.working_set(snap)? else {
            return Ok(0);
        };
        let chunks = ws.chunks(&self.view, &rec)?;
        let locs = self.view.remote_chunks(&chunks)?;
        let remote: Vec<(ChunkId, RemoteChunk)> = chunks
            .iter()
            .zip(locs)
            .filter_map(|(c, l)| l.map(|l| (*c, l)))
            .collect();
        let batches: Vec<Vec<ChunkId>> = if remote.iter().all(|(_, l)| l.len == 0) {
            // Layout 1: an object per chunk, nothing to coalesce; batches
            // keep as many GETs in flight as faults may have.
            remote
                .chunks(URGENT_REQUESTS / PREFETCH_WINDOW)
                .map(|b| b.iter().map(|(c, _)| *c).collect())
                .collect()
        } else {
            let wanted: Vec<(ChunkId, Location)> =
                remote.iter().map(|(c, l)| (*c, pack_location(l))).collect();
            let coalesce = Coalesce {
                max_read: PREFETCH_READ,
                ..Coalesce::LAZY
            };
            plan_reads(&wanted, coalesce)
                .into_iter()
                .map(|r| r.chunks.iter().map(|(c, _, _)| *c).collect())
                .collect()
        };
        let next = AtomicUsize::new(0);
        let first_err = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..PREFETCH_WINDOW {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(ids) = batches.get(i) else { return };
                    if let Err(e) = self.ensure_chunks(ids, true) {
                        first_err.lock().unwrap().get_or_insert(e);
                        return;
                    }
                });
            }
        });
        match first_err.into_inner().unwrap() {
            Some(e) => Err(e),
            None => Ok(chunks.len()),
        }
    }

    /// The chunks of `snap`'s recorded working set, decoded once per
    /// worker (a saved working set does not change); None without one.
    pub(super) fn working_set_chunks(&self, snap: &SnapshotId) -> Option<Arc<HashSet<ChunkId>>> {
        if let Some(s) = self.ws_chunks.lock().unwrap().get(snap) {
            return Some(s.clone());
        }
        let rec = self.view.snapshot(snap).ok()??;
        let ws = self.view.working_set(snap).ok()??;
        let set: Arc<HashSet<ChunkId>> =
            Arc::new(ws.chunks(&self.view, &rec).ok()?.into_iter().collect());
        self.ws_chunks.lock().unwrap().insert(*snap, set.clone());
        Some(set)
    }
}
