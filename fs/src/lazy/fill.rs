//! The housekeeping thread of [`Lazy`]: the working-set recorder's clock
//! and the background fill (docs/fs.md, "Lazy snapshots").

use super::*;

impl Lazy {
    /// The recorder's clock, and the fill.
    pub(super) fn housekeeping_loop(&self) {
        let mut next_fill = Instant::now();
        // Since when the fill has stood aside for a restore.
        let mut waited: Option<Instant> = None;
        loop {
            std::thread::sleep(Duration::from_millis(250));
            self.end_recordings();
            // A restore under way keeps the link and the CPUs (each fill
            // step decodes and verifies 16 MiB), as the writer does, and
            // for as long at most.
            let since = *waited.get_or_insert_with(Instant::now);
            if self.restoring() && since.elapsed() < IMPORT_DEFER_LONGEST {
                continue;
            }
            waited = None;
            if self.opts.fill && Instant::now() >= next_fill {
                let busy = match self.fill_step() {
                    Ok(b) => b,
                    Err(e) => {
                        debug!("fill: {e}");
                        false
                    }
                };
                next_fill = Instant::now()
                    + if busy {
                        Duration::ZERO
                    } else {
                        Duration::from_secs(1)
                    };
            }
        }
    }

    fn end_recordings(&self) {
        let now = Instant::now();
        let done: Vec<(SnapshotId, WorkingSet)> = {
            let mut recs = self.recordings.lock().unwrap();
            let ended: Vec<SnapshotId> = recs
                .iter()
                .filter(|(_, r)| {
                    let quiet = now - r.last >= RECORD_QUIET && now - r.started >= RECORD_MIN;
                    quiet || now - r.started >= RECORD_MAX
                })
                .map(|(id, _)| *id)
                .collect();
            ended
                .into_iter()
                .filter_map(|id| recs.remove(&id).map(|r| (id, r.ws)))
                .collect()
        };
        for (id, ws) in done {
            self.recorded.lock().unwrap().insert(id);
            if ws.reads.is_empty() {
                continue;
            }
            info!(snapshot = %id, reads = ws.reads.len(), "working set recorded");
            self.jobs.lock().unwrap().working_sets.push((id, ws));
            self.wake_writer();
        }
    }

    /// One step of the fill: the next missing chunks of the first lazy
    /// snapshot that has any (working set first), fetched in large reads.
    /// Returns whether there is more to do.
    fn fill_step(&self) -> forkd_layers::Result<bool> {
        if self.pending_bytes.load(Ordering::Relaxed) > PENDING_MAX
            || self.urgent_now.load(Ordering::Relaxed) > 0
        {
            return Ok(false);
        }
        self.view.catch_up()?;
        for (snap, _) in self.view.lazy_snapshots()? {
            let Some(rec) = self.view.snapshot(&snap)? else {
                continue;
            };
            let mut order = match self.view.working_set(&snap)? {
                Some(ws) => ws.chunks(&self.view, &rec)?,
                None => Vec::new(),
            };
            let seen_at = *self
                .fill_seen
                .lock()
                .unwrap()
                .entry(snap)
                .or_insert_with(Instant::now);
            if seen_at.elapsed() < FILL_GRACE && !order.is_empty() && !self.all_here(&order)? {
                continue;
            }
            let mut seen: HashSet<ChunkId> = order.iter().copied().collect();
            for c in self.view.snapshot_chunks(&rec)? {
                if seen.insert(c) {
                    order.push(c);
                }
            }
            let have = self.view.has_chunks(&order)?;
            let missing: Vec<ChunkId> = {
                let pending = self.pending.lock().unwrap();
                let flights = self.flights.lock().unwrap();
                order
                    .iter()
                    .zip(have)
                    .filter(|(c, h)| !h && !pending.contains_key(*c) && !flights.contains_key(*c))
                    .map(|(c, _)| *c)
                    .collect()
            };
            if missing.is_empty() {
                let pending = self.pending.lock().unwrap();
                if !order.iter().any(|c| pending.contains_key(c)) {
                    self.jobs.lock().unwrap().finish.insert(snap);
                    self.wake_writer();
                }
                continue;
            }
            // About 16 MiB per step, then look again (faults may have come).
            let mut take = Vec::new();
            let mut bytes = 0u64;
            for (c, l) in missing.iter().zip(self.view.remote_chunks(&missing)?) {
                let Some(l) = l else { continue };
                bytes += u64::from(l.len.max(1 << 16));
                take.push(*c);
                if bytes >= 16 << 20 {
                    break;
                }
            }
            if take.is_empty() {
                continue;
            }
            if let Err(e) = self.ensure_chunks(&take, false) {
                debug!(snapshot = %snap, "fill: {e}");
                return Ok(false);
            }
            return Ok(true);
        }
        Ok(false)
    }
}
