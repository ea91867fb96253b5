//! Rate-limited catch-up of the secondary store view.
//!
//! A name that is not found may belong to a snapshot another process just
//! committed, so a miss catches up before answering ENOENT. Callers pass the
//! instant their request started; a catch-up that *started* after it already
//! reflects every commit the caller could know about, so concurrent misses
//! share one catch-up, and catch-ups run at most every [`MIN_INTERVAL`].

use std::sync::Mutex;
use std::time::{Duration, Instant};

use forkd_layers::StoreView;

/// Smallest gap between two catch-ups.
pub const MIN_INTERVAL: Duration = Duration::from_millis(50);

/// Coalescing, rate-limited `catch_up`.
pub struct CatchUp {
    view: StoreView,
    /// When the last catch-up started.
    last: Mutex<Instant>,
}

impl CatchUp {
    pub fn new(view: StoreView) -> CatchUp {
        CatchUp {
            view,
            last: Mutex::new(Instant::now()),
        }
    }

    /// Makes sure a catch-up started at or after `since` (waiting for the
    /// rate limit if needed).
    pub fn since(&self, since: Instant) -> forkd_layers::Result<()> {
        let mut last = self.last.lock().unwrap();
        if *last >= since {
            return Ok(());
        }
        let gap = last.elapsed();
        if gap < MIN_INTERVAL {
            std::thread::sleep(MIN_INTERVAL - gap);
        }
        *last = Instant::now();
        self.view.catch_up()
    }

    /// Catches up now (subject to the rate limit).
    pub fn now(&self) -> forkd_layers::Result<()> {
        self.since(Instant::now())
    }
}
