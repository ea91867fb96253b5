//! Typed errors of the network layer.

use std::net::Ipv4Addr;

/// What can go wrong setting up, changing or removing a child's network.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A request's network fields are wrong; the message says which and how.
    #[error("{0}")]
    Invalid(String),
    /// The configured address range cannot hold one more child.
    #[error("the child address range {range} is full ({slots} children); configure a larger `net.range` or delete sandboxes")]
    PoolExhausted {
        /// The configured range (`net.range`).
        range: String,
        /// How many children it holds.
        slots: u32,
    },
    /// A netlink request failed.
    #[error("netlink: {what}: {source}")]
    Netlink {
        /// What was being done.
        what: String,
        /// The kernel's answer.
        #[source]
        source: rtnetlink::Error,
    },
    /// A system call or file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// `nft` refused a ruleset or could not run.
    #[error("nft: {what}: {stderr} (is nftables installed? scripts/setup.sh installs it)")]
    Nft {
        /// Which ruleset or command.
        what: String,
        /// What `nft` printed.
        stderr: String,
    },
    /// A domain name in a policy did not resolve.
    #[error("egress policy: cannot resolve {name:?}: {reason}")]
    Resolve {
        /// The name as given in the policy.
        name: String,
        /// Why it did not resolve.
        reason: String,
    },
    /// A published port could not be bound.
    #[error("publishing guest port {guest_port} on {addr}:{host_port}: {source}")]
    Publish {
        /// The host address asked for.
        addr: Ipv4Addr,
        /// The host port asked for (0: any).
        host_port: u16,
        /// The guest port to publish.
        guest_port: u16,
        /// Why binding failed.
        #[source]
        source: std::io::Error,
    },
}

impl NetError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> NetError {
        NetError::Io {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn nl(what: impl Into<String>, source: rtnetlink::Error) -> NetError {
        NetError::Netlink {
            what: what.into(),
            source,
        }
    }

    /// Whether this is the caller's fault (HTTP 400) rather than the host's.
    pub fn is_invalid(&self) -> bool {
        matches!(self, NetError::Invalid(_) | NetError::Resolve { .. })
    }
}

#[cfg(test)]
mod tests {
    /// Callers carry it in `anyhow` chains.
    #[test]
    fn is_send_sync_static() {
        fn check<T: std::error::Error + Send + Sync + 'static>() {}
        check::<super::NetError>();
    }
}
