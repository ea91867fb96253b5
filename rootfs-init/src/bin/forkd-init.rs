//! forkd-init: PID 1 of every forkd guest.
fn main() {
    rootfs_init::init::main()
}
