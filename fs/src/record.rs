//! Recording which byte ranges the kernel reads from a file.
//!
//! Between `record_start` and `record_stop` every FUSE read of the inode is
//! logged. The kernel only asks for what is not in its page cache, so a
//! recording made while the first child resumes from a cold cache is the
//! list of ranges later spawns should prefetch (readahead included).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::ranges::{merge, RangeList};

/// Active recordings, by inode.
#[derive(Default)]
pub struct Recorder {
    active: AtomicUsize,
    inner: Mutex<HashMap<u64, RangeList>>,
}

/// Reads logged per recording before they are merged in place.
const COMPACT_AT: usize = 64 * 1024;

impl Recorder {
    /// Starts (or restarts, clearing it) the recording of `ino`.
    pub fn start(&self, ino: u64) {
        let mut g = self.inner.lock().unwrap();
        g.insert(ino, Vec::new());
        self.active.store(g.len(), Ordering::Release);
    }

    /// Stops recording `ino`; returns the merged, sorted ranges read, or
    /// `None` if it was not being recorded.
    pub fn stop(&self, ino: u64) -> Option<RangeList> {
        let mut g = self.inner.lock().unwrap();
        let r = g.remove(&ino);
        self.active.store(g.len(), Ordering::Release);
        r.map(merge)
    }

    /// Logs a read (cheap when nothing is being recorded).
    pub fn note(&self, ino: u64, offset: u64, len: u64) {
        if self.active.load(Ordering::Acquire) == 0 || len == 0 {
            return;
        }
        let mut g = self.inner.lock().unwrap();
        if let Some(list) = g.get_mut(&ino) {
            list.push((offset, len));
            if list.len() >= COMPACT_AT {
                *list = merge(std::mem::take(list));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_between_start_and_stop() {
        let r = Recorder::default();
        r.note(5, 0, 10);
        r.start(5);
        r.note(5, 4096, 4096);
        r.note(6, 0, 4096);
        r.note(5, 0, 4096);
        assert_eq!(r.stop(5), Some(vec![(0, 8192)]));
        assert_eq!(r.stop(5), None);
    }
}
