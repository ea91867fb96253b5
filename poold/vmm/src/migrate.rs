//! The QMP sequences that pause, save, restore and resume a VM
//! (docs/design.md, "The VMM and its QMP sequences"). RAM never travels in
//! the migration stream here: it lives in a memory-backend file, and `x-ignore-shared` leaves it out, so the saved
//! device state (vmstate) is tens of kilobytes and takes milliseconds.

use super::Vm;
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::Path;
use std::time::Duration;

/// How long saving or loading device state may take.
pub const STATE_TIMEOUT: Duration = Duration::from_secs(120);

/// A `file:` migration URI for `path`. QEMU splits the URI's options on
/// commas, so a path with a comma cannot be expressed.
fn file_uri(path: &Path) -> Result<String> {
    let s = path
        .to_str()
        .with_context(|| format!("{} is not valid UTF-8", path.display()))?;
    if s.contains(',') {
        bail!("{s}: QEMU migration paths cannot contain ','; use a FORKD_HOME without commas");
    }
    Ok(format!("file:{s}"))
}

impl Vm {
    /// Stops the vCPUs (QMP `stop`). Devices are drained and block layers
    /// flushed to their files by QEMU as part of the stop.
    pub async fn pause(&self) -> Result<()> {
        self.qmp.execute("stop", json!({})).await.map(|_| ())
    }

    /// Resumes the vCPUs (QMP `cont`).
    pub async fn resume(&self) -> Result<()> {
        self.qmp.execute("cont", json!({})).await.map(|_| ())
    }

    /// Sets `x-ignore-shared` (RAM in a shared memory-backend file is left
    /// out of the stream). Source and destination must agree.
    pub async fn set_ignore_shared(&self, on: bool) -> Result<()> {
        self.qmp
            .execute(
                "migrate-set-capabilities",
                json!({"capabilities": [{"capability": "x-ignore-shared", "state": on}]}),
            )
            .await
            .map(|_| ())
    }

    /// Saves the device state of a paused VM whose RAM is a shared file to
    /// `path`. The VM stays paused.
    pub async fn save_state(&self, path: &Path) -> Result<()> {
        let uri = file_uri(path)?;
        // A jailed QEMU can write only files made for it.
        crate::private::create(path).with_context(|| format!("creating {}", path.display()))?;
        self.give(path)?;
        self.set_ignore_shared(true).await?;
        self.qmp
            .execute("migrate", json!({ "uri": uri }))
            .await
            .context("starting the state save")?;
        self.qmp
            .wait_migration(STATE_TIMEOUT)
            .await
            .context("saving the VM state")?;
        Ok(())
    }

    /// Loads device state from `path` into a VM started with
    /// [`super::Boot::Incoming`]. The VM is left paused.
    pub async fn load_state(&self, path: &Path) -> Result<()> {
        let uri = file_uri(path)?;
        self.set_ignore_shared(true).await?;
        self.qmp
            .execute("migrate-incoming", json!({ "uri": uri }))
            .await
            .context("starting the state restore")?;
        self.qmp
            .wait_migration(STATE_TIMEOUT)
            .await
            .with_context(|| format!("restoring the VM state from {}", path.display()))?;
        Ok(())
    }

    /// The QEMU run state (`running`, `paused`, `inmigrate`, ...).
    pub async fn run_state(&self) -> Result<super::qmp::RunState> {
        self.qmp.query_status().await
    }
}
