//! Disk overlays: every VM writes to its own qcow2 overlay over a read-only
//! base, so a base image or a snapshot's rootfs.img is never written.

use anyhow::{bail, Context, Result};
use std::path::Path;
use tokio::process::Command;

/// Creates `overlay` (qcow2) backed by the raw image `base`.
pub async fn create_overlay(base: &Path, overlay: &Path) -> Result<()> {
    if !base.exists() {
        bail!("disk base {} does not exist", base.display());
    }
    let out = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(base)
        .arg(overlay)
        .output()
        .await
        .context("running qemu-img (install qemu-utils)")?;
    if !out.status.success() {
        bail!(
            "qemu-img create {}: {}",
            overlay.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Writes the overlay's full view (base + changes) to a raw sparse file.
pub async fn flatten(overlay: &Path, out_raw: &Path) -> Result<()> {
    let out = Command::new("qemu-img")
        .args(["convert", "-q", "-O", "raw", "-S", "4k"])
        .arg(overlay)
        .arg(out_raw)
        .output()
        .await
        .context("running qemu-img convert")?;
    if !out.status.success() {
        bail!(
            "qemu-img convert {}: {}",
            overlay.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
