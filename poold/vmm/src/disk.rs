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
    precreate(overlay)?;
    qemu_img(
        "create",
        &["-q", "-f", "qcow2", "-F", "raw", "-b"],
        &[base.as_os_str(), overlay.as_os_str()],
        overlay,
    )
    .await?;
    private_disk(overlay)
}

/// Creates `p` empty and private before qemu-img writes it (qemu-img keeps
/// an existing file's mode), so a disk is never readable by others, not
/// even for a moment.
fn precreate(p: &Path) -> Result<()> {
    crate::private::create(p)
        .map(drop)
        .with_context(|| format!("creating {}", p.display()))
}

/// Creates `overlay` (qcow2) over a raw base without opening the base
/// (`-u`), so it costs no read of a FUSE-served base; `size` is the base's.
pub async fn create_overlay_unchecked(base: &Path, size: u64, overlay: &Path) -> Result<()> {
    create_overlay_on(base, "raw", size, overlay).await
}

/// Creates `overlay` (qcow2) over `base` of format `base_format` without
/// opening the base (it may be in use by a running VM).
pub async fn create_overlay_on(
    base: &Path,
    base_format: &str,
    size: u64,
    overlay: &Path,
) -> Result<()> {
    let size = size.to_string();
    precreate(overlay)?;
    qemu_img(
        "create",
        &["-q", "-f", "qcow2", "-F", base_format, "-u", "-b"],
        &[base.as_os_str(), overlay.as_os_str(), size.as_ref()],
        overlay,
    )
    .await?;
    private_disk(overlay)
}

/// A disk overlay holds what its VM wrote: root's only (qemu-img creates it
/// with the umask's mode). The jail then hands it to the VM's uid, 0600.
fn private_disk(p: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        p,
        std::fs::Permissions::from_mode(crate::private::FILE_MODE),
    )
    .with_context(|| format!("making {} private", p.display()))
}

/// One extent of `qemu-img map --output=json`.
#[derive(Debug, Clone, serde::Deserialize)]
struct MapEntry {
    start: u64,
    length: u64,
    depth: usize,
    #[serde(default)]
    present: bool,
    #[serde(default)]
    data: bool,
    #[serde(default)]
    compressed: bool,
    offset: Option<u64>,
}

/// Where the bytes of one guest-visible range live.
#[derive(Debug, Clone)]
struct Extent {
    start: u64,
    len: u64,
    /// Index into `OverlayView::files` (the backing-chain depth).
    depth: usize,
    /// Offset of `start` in that file.
    file_offset: u64,
}

/// A qcow2 overlay's guest-visible content (overlay over its backing chain),
/// readable without materialising it: `qemu-img map` says, for every range,
/// which file of the chain holds it and where; this reads it from there.
///
/// The overlay must be quiescent (its VM stopped, or the overlay made a
/// read-only backing file by a disk snapshot).
pub struct OverlayView {
    size: u64,
    files: Vec<std::fs::File>,
    extents: Vec<Extent>,
    /// Ranges some overlay of the chain holds (data or explicit zeros):
    /// everything that may differ from the bottom file.
    own: Vec<std::ops::Range<u64>>,
    name: String,
}

impl OverlayView {
    /// Maps `overlay` and opens every file of its backing chain.
    pub async fn open(overlay: &Path) -> Result<OverlayView> {
        let chain: Vec<serde_json::Value> = serde_json::from_slice(
            &qemu_img_json(&["info", "-U", "--backing-chain", "--output=json"], overlay).await?,
        )
        .context("parsing qemu-img info")?;
        let mut files = Vec::new();
        for layer in &chain {
            let name = layer["filename"].as_str().unwrap_or_default();
            let path = std::path::PathBuf::from(name);
            files.push(
                std::fs::File::open(&path)
                    .with_context(|| format!("opening disk layer {}", path.display()))?,
            );
        }
        let size = chain
            .first()
            .and_then(|l| l["virtual-size"].as_u64())
            .context("qemu-img info gave no virtual-size")?;
        let map: Vec<MapEntry> =
            serde_json::from_slice(&qemu_img_json(&["map", "-U", "--output=json"], overlay).await?)
                .context("parsing qemu-img map")?;
        let mut extents = Vec::new();
        let mut own = Vec::new();
        let bottom = files.len().saturating_sub(1);
        for e in &map {
            if e.depth < bottom && e.present {
                push_range(&mut own, e.start..e.start + e.length);
            }
            if !(e.present && e.data) {
                continue;
            }
            if e.compressed || e.depth >= files.len() {
                bail!(
                    "{}: cannot read extent at {} (compressed or outside the backing chain)",
                    overlay.display(),
                    e.start
                );
            }
            let file_offset = e
                .offset
                .with_context(|| format!("qemu-img map gave no offset for {}", e.start))?;
            extents.push(Extent {
                start: e.start,
                len: e.length,
                depth: e.depth,
                file_offset,
            });
        }
        Ok(OverlayView {
            size,
            files,
            extents,
            own,
            name: overlay.display().to_string(),
        })
    }

    /// Byte ranges any overlay of the chain holds (every layer but the
    /// bottom file): everything that may differ from the base image.
    pub fn changed_ranges(&self) -> Vec<std::ops::Range<u64>> {
        self.own.clone()
    }
}

fn push_range(v: &mut Vec<std::ops::Range<u64>>, r: std::ops::Range<u64>) {
    match v.last_mut() {
        Some(last) if last.end == r.start => last.end = r.end,
        _ => v.push(r),
    }
}

impl forkd_layers::IngestSource for OverlayView {
    fn size(&self) -> u64 {
        self.size
    }

    fn data_extents(&self) -> std::io::Result<Vec<std::ops::Range<u64>>> {
        let mut out = Vec::new();
        for e in &self.extents {
            push_range(&mut out, e.start..e.start + e.len);
        }
        Ok(out)
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        buf.fill(0);
        let end = offset + buf.len() as u64;
        let first = self.extents.partition_point(|e| e.start + e.len <= offset);
        for e in self.extents[first..].iter().take_while(|e| e.start < end) {
            let from = e.start.max(offset);
            let to = (e.start + e.len).min(end);
            let dst = &mut buf[(from - offset) as usize..(to - offset) as usize];
            self.files[e.depth].read_exact_at(dst, e.file_offset + (from - e.start))?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}

async fn qemu_img_json(args: &[&str], image: &Path) -> Result<Vec<u8>> {
    qemu_img(args[0], &args[1..], &[image.as_os_str()], image).await
}

/// Runs `qemu-img SUB FLAGS... PATHS...` and returns its stdout; a failure
/// names the subcommand, `about` and qemu-img's own message.
async fn qemu_img(
    sub: &str,
    flags: &[&str],
    paths: &[&std::ffi::OsStr],
    about: &Path,
) -> Result<Vec<u8>> {
    let out = Command::new("qemu-img")
        .arg(sub)
        .args(flags)
        .args(paths)
        .output()
        .await
        .context("running qemu-img (install qemu-utils)")?;
    if !out.status.success() {
        bail!(
            "qemu-img {sub} {}: {}",
            about.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}
