//! forkd-agent: serves the host↔agent protocol inside the guest.
fn main() {
    if let Err(e) = rootfs_init::agent::main() {
        eprintln!("forkd-agent: {e:#}");
        std::process::exit(1);
    }
}
