//! forkd-edge: what poold's HTTP front-ends share, so neither imports the
//! other: listeners ([`listen`]: TCP, unix, HTTPS through [`tls`]),
//! bearer-token auth ([`auth`]), the `Host` check against DNS rebinding
//! ([`hosts`]), the audit log ([`audit`]), bounded large transfers
//! ([`transfers`]) and E2B's list paging ([`paging`]). It knows HTTP and
//! nothing of sandboxes.

pub mod audit;
pub mod auth;
pub mod hosts;
pub mod listen;
pub mod paging;
pub mod relay;
pub mod tls;
pub mod transfers;
