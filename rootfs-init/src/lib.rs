//! The guest side of forkd and the protocol it speaks.
//!
//! - [`protocol`]: frames and messages between the host and forkd-agent; the
//!   host's agent client (in poold) uses this module too.
//! - [`agent`]: forkd-agent, which serves the protocol on a virtio-serial port
//!   (and forkd's one-JSON-line TCP protocol on :8888).
//! - [`init`]: forkd-init, PID 1 of every guest.

pub mod agent;
pub mod init;
pub mod protocol;

/// Version of the guest binaries, reported by `ping`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
