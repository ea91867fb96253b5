//! The guest side of forkd and the protocol it speaks.
//!
//! - [`protocol`]: frames and messages between the host and forkd-agent; the
//!   host's agent client (in poold) uses this module too.
//! - [`agent`]: forkd-agent, which serves the protocol on a virtio-serial port
//!   (and forkd's one-JSON-line TCP protocol on :8888).
//! - [`init`]: forkd-init, PID 1 of every guest.

#![warn(missing_docs)]

pub mod agent;
pub mod init;
pub mod protocol;

/// Clears the signal mask; call in `pre_exec` so a child never inherits the
/// signals PID 1 blocks for `sigtimedwait`. Async-signal-safe.
pub fn unblock_all_signals() -> std::io::Result<()> {
    // SAFETY: sigemptyset/sigprocmask on a local set are async-signal-safe.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        if libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Version of the guest binaries, reported by `ping`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
