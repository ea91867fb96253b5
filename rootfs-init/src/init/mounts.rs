//! Mounting the early filesystems and switching from the initramfs to the
//! guest's root disk.

use anyhow::{Context, Result};
use nix::mount::{mount, MsFlags};
use std::fs;
use std::path::Path;

/// Where the root disk is mounted before the switch.
pub const NEW_ROOT: &str = "/newroot";

/// Mounts `fstype` at `target` (creating it) unless something is there.
pub fn mount_fs(fstype: &str, target: &str, flags: MsFlags, data: Option<&str>) -> Result<()> {
    fs::create_dir_all(target).ok();
    match mount(Some(fstype), target, Some(fstype), flags, data) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EBUSY) => Ok(()),
        Err(e) => Err(e).with_context(|| format!("mount {fstype} on {target}")),
    }
}

/// proc, sys and devtmpfs: what module loading and device discovery need.
pub fn mount_early() -> Result<()> {
    let nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_fs("proc", "/proc", nodev, None)?;
    mount_fs("sysfs", "/sys", nodev, None)?;
    mount_fs("devtmpfs", "/dev", MsFlags::MS_NOSUID, Some("mode=0755"))?;
    Ok(())
}

/// Waits for the root block device node to appear.
pub fn wait_for_device(dev: &str, tries: u32) -> Result<()> {
    for _ in 0..tries {
        if Path::new(dev).exists() {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    anyhow::bail!("root device {dev} did not appear (is virtio_blk loaded and a disk attached?)")
}

/// Mounts the root disk at [`NEW_ROOT`].
pub fn mount_root(dev: &str, fstype: &str, read_only: bool) -> Result<()> {
    fs::create_dir_all(NEW_ROOT)?;
    let flags = if read_only {
        MsFlags::MS_RDONLY
    } else {
        MsFlags::empty()
    };
    mount(Some(dev), NEW_ROOT, Some(fstype), flags, None::<&str>)
        .with_context(|| format!("mount {dev} ({fstype}) on {NEW_ROOT}"))
}

/// Moves the early mounts into the new root and makes it `/`.
pub fn switch_root() -> Result<()> {
    for m in ["/proc", "/sys", "/dev"] {
        let target = format!("{NEW_ROOT}{m}");
        fs::create_dir_all(&target).ok();
        mount(
            Some(m),
            target.as_str(),
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .with_context(|| format!("move {m} to {target}"))?;
    }
    nix::unistd::chdir(NEW_ROOT)?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .context("move new root to /")?;
    nix::unistd::chroot(".").context("chroot into new root")?;
    nix::unistd::chdir("/")?;
    Ok(())
}

/// Mounts each virtio-fs host folder at its guest path (nosuid, nodev;
/// read-only when asked). A volume that fails to mount is reported on the
/// console and skipped: the guest still boots, and the host side
/// (virtiofsd) enforces read-only whatever the guest does.
pub fn mount_volumes(vols: &[super::cmdline::VolumeParam]) {
    for v in vols {
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if v.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        let r = fs::create_dir_all(&v.path)
            .context("creating the mount point")
            .and_then(|()| {
                mount(
                    Some(v.tag.as_str()),
                    v.path.as_str(),
                    Some("virtiofs"),
                    flags,
                    None::<&str>,
                )
                .context("mount -t virtiofs")
            });
        match r {
            Ok(()) => eprintln!("forkd-init: volume {} mounted at {}", v.tag, v.path),
            Err(e) => eprintln!("forkd-init: volume {} at {}: {e:#}", v.tag, v.path),
        }
    }
}

/// The mounts every guest has after the switch.
pub fn mount_late() -> Result<()> {
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount_fs(
        "devpts",
        "/dev/pts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=0620,ptmxmode=0666"),
    )?;
    mount_fs("tmpfs", "/dev/shm", nosuid, Some("mode=1777"))?;
    mount_fs("tmpfs", "/tmp", nosuid, Some("mode=1777"))?;
    Ok(())
}
