//! forkd's REST API as a contract: the request and response bodies of
//! `/v1` (forkd v0.5.3's field names first, ours as additions a forkd
//! client ignores) and a small HTTP client for them.
//!
//! Shared by the daemon that serves the API, the CLI and benchmarks that
//! call it, and any Rust program that drives poold. Knows nothing of how
//! a request is carried out. The client is the `client` feature (on by
//! default); without it the crate has no HTTP dependency, which lets the
//! node core (`forkd-node`) reuse these types.

#![warn(missing_docs)]

#[cfg(feature = "client")]
mod client;
pub mod ids;
mod types;
mod workspaces;

#[cfg(feature = "client")]
pub use client::{
    http_builder, Client, JsonLines, Method, StatusCode, DEFAULT_URL, MAX_LINE_BYTES,
};
pub use types::*;
pub use workspaces::*;
