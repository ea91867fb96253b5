//! forkd-init, PID 1 of every forkd guest.
//!
//! Stage 1 runs from the initramfs: mount proc/sys/dev, load the virtio
//! modules, mount the root disk, copy forkd-agent into a tmpfs `/run/forkd`
//! on it, and switch root. Stage 2 runs in the guest's own root: tmpfs /tmp,
//! /dev/shm, devpts, hostname, loopback (and eth0 if configured), then the
//! supervisor loop that reaps zombies and keeps the agent running.
//!
//! Keeping the agent out of the image means any root filesystem (a Debian
//! image, a directory, a tarball) works unchanged.

pub mod cmdline;
pub mod modules;
pub mod mounts;
pub mod net;
pub mod supervisor;

use anyhow::{Context, Result};
use cmdline::BootParams;
use nix::mount::MsFlags;

/// The agent binary inside the initramfs.
const INITRAMFS_AGENT: &str = "/forkd-agent";

/// Entry point of the forkd-init binary.
pub fn main() {
    if std::process::id() != 1 {
        eprintln!("forkd-init must run as PID 1 (it is the guest's init)");
        std::process::exit(2);
    }
    let params = match boot() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("forkd-init: boot failed: {e:#}");
            supervisor::shut_down(supervisor::Ending::PowerOff);
        }
    };
    eprintln!(
        "forkd-init: {} ready, starting forkd-agent",
        params.hostname
    );
    let ending = supervisor::run();
    supervisor::shut_down(ending)
}

fn boot() -> Result<BootParams> {
    mounts::mount_early()?;
    redirect_console();
    let params = BootParams::parse(&std::fs::read_to_string("/proc/cmdline").unwrap_or_default());
    let modules = modules::load_all()?;
    eprintln!("forkd-init: loaded {} modules", modules.len());
    mounts::wait_for_device(&params.root, 500)?;
    mounts::mount_root(&params.root, &params.rootfstype, params.read_only)?;
    install_agent()?;
    mounts::switch_root()?;
    mounts::mount_late()?;
    mounts::mount_volumes(&params.volumes);
    nix::unistd::sethostname(&params.hostname).context("sethostname")?;
    net::link_up("lo").context("loopback")?;
    if let Some(ip) = &params.ip {
        net::configure("eth0", ip, params.gateway.as_deref()).context("eth0")?;
    }
    Ok(params)
}

/// Points stdin/stdout/stderr at /dev/console (the kernel may start PID 1
/// without them when the initramfs has no /dev).
fn redirect_console() {
    use std::os::fd::AsRawFd;
    if let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors.
            unsafe { libc::dup2(f.as_raw_fd(), fd) };
        }
    }
}

/// Copies the agent from the initramfs into a tmpfs on the new root.
fn install_agent() -> Result<()> {
    let run = format!("{}/run", mounts::NEW_ROOT);
    mounts::mount_fs(
        "tmpfs",
        &run,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )?;
    std::fs::create_dir_all(format!("{run}/forkd"))?;
    let dst = format!("{}{}", mounts::NEW_ROOT, supervisor::AGENT_PATH);
    std::fs::copy(INITRAMFS_AGENT, &dst).with_context(|| format!("copy agent to {dst}"))?;
    Ok(())
}
