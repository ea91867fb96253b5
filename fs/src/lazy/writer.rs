//! The writer thread of [`Lazy`]: imports pending chunks into the store,
//! finishes filled snapshots and saves recorded working sets, each time
//! opening the store read-write for a moment (the crash-safety argument is
//! in the parent module's docs).

use super::*;

impl Lazy {
    pub(super) fn wake_writer(&self) {
        *self.writer_wake.0.lock().unwrap() = true;
        self.writer_wake.1.notify_one();
    }

    /// Imports pending chunks, finishes filled snapshots and saves recorded
    /// working sets, each time opening the store read-write for a moment.
    pub(super) fn writer_loop(&self) {
        let mut backoff = Duration::from_millis(250);
        // Since when work has waited for a restore.
        let mut deferred: Option<Instant> = None;
        loop {
            {
                let g = self.writer_wake.0.lock().unwrap();
                let (mut g, _) = self
                    .writer_wake
                    .1
                    .wait_timeout_while(g, Duration::from_millis(250), |w| !*w)
                    .unwrap();
                *g = false;
            }
            let has_work = !self.pending.lock().unwrap().is_empty() || {
                let j = self.jobs.lock().unwrap();
                !j.working_sets.is_empty() || !j.finish.is_empty()
            };
            if !has_work {
                deferred = None;
                continue;
            }
            let since = *deferred.get_or_insert_with(Instant::now);
            if self.defers_import() && since.elapsed() < IMPORT_DEFER_LONGEST {
                continue;
            }
            deferred = None;
            match self.write_once() {
                Ok(()) => backoff = Duration::from_millis(250),
                Err(e) => {
                    if matches!(
                        e.downcast_ref::<StoreError>(),
                        Some(StoreError::Locked { .. })
                    ) {
                        debug!("the store is busy; importing later");
                    } else {
                        warn!("importing fetched chunks: {e:#}; retrying in {backoff:?}");
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Whether a restore is faulting or prefetching: urgent reads in
    /// flight, or one fetched something less than [`URGENT_QUIET`] ago.
    pub(super) fn restoring(&self) -> bool {
        let last = self.last_urgent_ms.load(Ordering::Relaxed);
        let since = self
            .epoch
            .elapsed()
            .as_millis()
            .saturating_sub(u128::from(last));
        self.urgent_now.load(Ordering::Relaxed) > 0
            || (last > 0 && since < URGENT_QUIET.as_millis())
    }

    /// Whether the writer should wait for a restore (the caller bounds how
    /// long, [`IMPORT_DEFER_LONGEST`]): one is under way and what is
    /// pending still fits.
    fn defers_import(&self) -> bool {
        self.restoring() && self.pending_bytes.load(Ordering::Relaxed) < IMPORT_DEFER_MAX
    }

    fn write_once(&self) -> anyhow::Result<()> {
        let batch: Vec<VerifiedChunk> = {
            let p = self.pending.lock().unwrap();
            let mut bytes = 0usize;
            p.values()
                .take_while(|c| {
                    bytes += c.payload.len();
                    bytes <= 64 << 20
                })
                .cloned()
                .collect()
        };
        let (working_sets, finish) = {
            let mut j = self.jobs.lock().unwrap();
            (
                std::mem::take(&mut j.working_sets),
                std::mem::take(&mut j.finish),
            )
        };
        let opts = StoreOptions {
            lock_timeout: Duration::from_millis(500),
            cache_bytes: 1 << 20,
            ingest_threads: 1,
            ..StoreOptions::default()
        };
        let store = match Store::open(&self.store_dir, opts) {
            Ok(s) => s,
            Err(e) => {
                let mut j = self.jobs.lock().unwrap();
                j.working_sets.extend(working_sets);
                j.finish.extend(finish);
                return Err(e.into());
            }
        };
        if !batch.is_empty() {
            let r = store.import_chunks(&batch)?;
            self.counters
                .imported
                .fetch_add(r.new_chunks, Ordering::Relaxed);
            debug!(chunks = r.new_chunks, "imported fetched chunks");
        }
        for (snap, ws) in &working_sets {
            match store.set_working_set(snap, ws) {
                Ok(()) => {
                    self.counters.recorded.fetch_add(1, Ordering::Relaxed);
                    info!(snapshot = %snap, reads = ws.reads.len(), "working set saved");
                }
                // Deleted meanwhile: nothing to keep.
                Err(StoreError::NoSuchSnapshot(_)) => {}
                Err(e) => warn!(snapshot = %snap, "saving its working set: {e}"),
            }
        }
        for snap in &finish {
            if store.finish_remote(snap)? {
                info!(snapshot = %snap, "all local now");
            }
        }
        drop(store);
        self.view.catch_up()?;
        // Drop from memory what the store serves now.
        let ids: Vec<ChunkId> = batch.iter().map(|c| c.id).collect();
        let indexed = self.view.has_chunks(&ids)?;
        let mut p = self.pending.lock().unwrap();
        for (id, ix) in ids.iter().zip(indexed) {
            if ix {
                if let Some(c) = p.remove(id) {
                    self.pending_bytes
                        .fetch_sub(c.payload.len() as u64, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }
}
