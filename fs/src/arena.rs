//! The holder's request arena: every FUSE request the holder has read and
//! not yet answered, in shared memory that outlives the holder.
//!
//! The kernel of this host (6.1) cannot resend a request: one a holder read
//! from `/dev/fuse` and died holding would leave its caller (a QEMU faulting
//! a page) waiting forever. So the holder reads each request straight into
//! a slot of a memfd; a keeper (poold) holds that memfd and a duplicate of
//! the `/dev/fuse` connection, and a holder started in its place adopts both
//! and replays what the slots hold (`holder`, `keeper`).
//!
//! Layout: [`SLOTS`] slots of [`SLOT_BYTES`] each (the buffer a `/dev/fuse`
//! read needs), the memfd sparse: only the pages requests touch cost
//! memory. Slot 0 keeps a copy of the mount's INIT request.
//!
//! Invariants:
//! - a slot is *pending* exactly when its `fuse_in_header.unique` is not 0:
//!   the kernel writes it by the read that fills the slot, and the holder
//!   zeroes it once the request is answered (or, for one that wants no
//!   answer, forwarded). A request is never lost; one answered and not yet
//!   zeroed when the holder died is replayed once more, and the kernel
//!   drops its second answer (unknown unique). That window is one write:
//!   an OPEN caught in it counts its handle twice, and its snapshot cannot
//!   be deleted until the mount is restarted. Slots of requests that want
//!   no answer (forgets, interrupts) are let go by an adopter, not
//!   replayed;
//! - a slot is written only by the read that takes it from the free list,
//!   and freed only once no pending entry names it.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use anyhow::{bail, Context, Result};

/// Bytes of one slot: the largest request the kernel sends (fuser's
/// max_write, 16 MiB) plus headers, page-aligned.
pub const SLOT_BYTES: usize = (16 << 20) + 8192;
/// Slots: the most requests the holder keeps unanswered at once (it waits
/// for a free slot before reading more).
pub const SLOTS: usize = 512;
/// The slot holding the INIT request.
const INIT_SLOT: usize = 0;

/// The fuse_in_header fields the holder needs: (len, opcode, unique).
pub fn in_header(b: &[u8]) -> Option<(u32, u32, u64)> {
    Some((
        u32::from_ne_bytes(b.get(0..4)?.try_into().ok()?),
        u32::from_ne_bytes(b.get(4..8)?.try_into().ok()?),
        u64::from_ne_bytes(b.get(8..16)?.try_into().ok()?),
    ))
}

/// The shared request slots (see the module doc).
pub struct Arena {
    fd: OwnedFd,
    base: *mut u8,
    free: Mutex<Vec<usize>>,
    freed: Condvar,
}

// SAFETY: the mapping is shared memory; who may touch which slot is
// serialised by the free list (module doc), and `unique` is accessed
// atomically.
unsafe impl Send for Arena {}
// SAFETY: as for Send: shared access is serialised by the free list.
unsafe impl Sync for Arena {}

impl Arena {
    /// A new, empty arena on a fresh memfd.
    pub fn create() -> Result<Arena> {
        let fd = nix::sys::memfd::memfd_create(
            c"forkd-fs-requests",
            nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
        )
        .context("creating the request arena (memfd)")?;
        nix::unistd::ftruncate(&fd, (SLOTS * SLOT_BYTES) as i64)
            .context("sizing the request arena")?;
        Arena::map(fd)
    }

    /// Adopts the arena of a holder that died: its memfd, as a keeper kept
    /// it.
    pub fn adopt(fd: OwnedFd) -> Result<Arena> {
        let size = nix::sys::stat::fstat(fd.as_raw_fd())
            .context("reading the adopted request arena")?
            .st_size as usize;
        if size != SLOTS * SLOT_BYTES {
            bail!(
                "the adopted request arena is {size} bytes, not {}: a forkd-fs of another version made it",
                SLOTS * SLOT_BYTES
            );
        }
        Arena::map(fd)
    }

    fn map(fd: OwnedFd) -> Result<Arena> {
        use nix::sys::mman::{mmap, MapFlags, ProtFlags};
        let len = std::num::NonZeroUsize::new(SLOTS * SLOT_BYTES).expect("non-zero");
        // SAFETY: a fresh shared mapping of a memfd we own, never unmapped
        // while the Arena lives.
        let p = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .context("mapping the request arena")?;
        let arena = Arena {
            fd,
            base: p.as_ptr() as *mut u8,
            free: Mutex::new(Vec::new()),
            freed: Condvar::new(),
        };
        let pending: Vec<usize> = arena.pending().into_iter().map(|(i, _)| i).collect();
        *arena.free.lock().unwrap() = (1..SLOTS).rev().filter(|i| !pending.contains(i)).collect();
        Ok(arena)
    }

    /// The memfd, for a keeper.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    fn slot_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < SLOTS);
        // SAFETY: in bounds of the mapping.
        unsafe { self.base.add(i * SLOT_BYTES) }
    }

    fn unique(&self, i: usize) -> &AtomicU64 {
        // SAFETY: offset 8 of a page-aligned slot is 8-aligned and in the
        // mapping; AtomicU64 has u64's layout.
        unsafe { &*(self.slot_ptr(i).add(8) as *const AtomicU64) }
    }

    /// Takes a free slot, waiting for one when all are pending.
    pub fn take(&self) -> usize {
        let mut f = self.free.lock().unwrap();
        loop {
            if let Some(i) = f.pop() {
                return i;
            }
            f = self.freed.wait(f).unwrap();
        }
    }

    /// The whole of slot `i`, to read a request into.
    ///
    /// # Safety
    /// `i` must come from [`Arena::take`] and not be released yet, and no
    /// other reference to the slot may live meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, i: usize) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.slot_ptr(i), SLOT_BYTES)
    }

    /// The first `len` bytes of pending slot `i` (its request).
    pub fn request(&self, i: usize, len: usize) -> &[u8] {
        // SAFETY: in bounds; a pending slot is not written until released.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(i), len.min(SLOT_BYTES)) }
    }

    /// Marks slot `i` answered and returns it to the free list.
    pub fn release(&self, i: usize) {
        self.unique(i).store(0, Ordering::SeqCst);
        self.free.lock().unwrap().push(i);
        self.freed.notify_one();
    }

    /// Keeps a copy of the INIT request (replayed to every new worker, and
    /// to the workers of a holder that adopts this arena).
    pub fn set_init(&self, req: &[u8]) {
        let n = req.len().min(SLOT_BYTES);
        // SAFETY: slot 0 is never taken from the free list; only the
        // kernel reader writes it, once.
        unsafe { std::ptr::copy_nonoverlapping(req.as_ptr(), self.slot_ptr(INIT_SLOT), n) };
    }

    /// The INIT request kept by [`Arena::set_init`] (by this holder or the
    /// one before it): (unique, bytes).
    pub fn init(&self) -> Option<(u64, &[u8])> {
        self.header(INIT_SLOT)
            .map(|(len, _, unique)| (unique, self.request(INIT_SLOT, len as usize)))
    }

    /// A slot's header when it holds a request.
    fn header(&self, i: usize) -> Option<(u32, u32, u64)> {
        if self.unique(i).load(Ordering::SeqCst) == 0 {
            return None;
        }
        let h = in_header(self.request(i, 16))?;
        let sane = (16..=SLOT_BYTES as u32).contains(&h.0);
        sane.then_some(h)
    }

    /// Every pending request slot (not INIT's) with its length, oldest
    /// first: what a holder adopting this arena replays.
    pub fn pending(&self) -> Vec<(usize, (u32, u32, u64))> {
        let mut v: Vec<(usize, (u32, u32, u64))> = (1..SLOTS)
            .filter_map(|i| self.header(i).map(|h| (i, h)))
            .collect();
        v.sort_by_key(|(_, (_, _, unique))| *unique);
        v
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: our own mapping, not used after this.
        unsafe {
            let _ = nix::sys::mman::munmap(
                std::ptr::NonNull::new_unchecked(self.base as *mut libc::c_void),
                SLOTS * SLOT_BYTES,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(unique: u64, opcode: u32, len: u32) -> Vec<u8> {
        let mut r = vec![0u8; len as usize];
        r[0..4].copy_from_slice(&len.to_ne_bytes());
        r[4..8].copy_from_slice(&opcode.to_ne_bytes());
        r[8..16].copy_from_slice(&unique.to_ne_bytes());
        r
    }

    #[test]
    fn an_adopted_arena_has_the_pending_requests_and_the_init() {
        let a = Arena::create().unwrap();
        a.set_init(&request(2, 26, 104));
        let mut taken = Vec::new();
        for u in [10u64, 8, 12] {
            let i = a.take();
            // SAFETY: just taken.
            let s = unsafe { a.slot_mut(i) };
            let r = request(u, 15, 80);
            s[..r.len()].copy_from_slice(&r);
            taken.push(i);
        }
        a.release(taken[2]); // unique 12 answered
        let dup = a.fd().try_clone().unwrap();
        drop(a);
        let b = Arena::adopt(dup).unwrap();
        let (init_unique, init) = b.init().unwrap();
        assert_eq!((init_unique, init.len()), (2, 104));
        let uniques: Vec<u64> = b.pending().iter().map(|(_, h)| h.2).collect();
        assert_eq!(uniques, vec![8, 10], "oldest first, the answered one gone");
        // The free list holds everything else.
        let mut n = 0;
        while b.free.lock().unwrap().pop().is_some() {
            n += 1;
        }
        assert_eq!(n, SLOTS - 1 - 2);
    }
}
