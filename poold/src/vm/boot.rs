//! Cold-booting a guest from an image: the VM directory, its disk overlay,
//! the QEMU launch, and the wait for the agent.

use super::{Boot, Launch, Lifetime, Machine, Memory, Vm, VmDir};
use crate::paths::Paths;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::Duration;

/// How long a cold boot may take before it is declared failed (TCG is slow).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

/// What to boot.
pub struct BootSpec {
    pub id: String,
    /// The root disk image (raw ext4); never written (the VM gets an overlay).
    pub rootfs: PathBuf,
    /// Boot this kernel instead of the data dir's.
    pub kernel: Option<PathBuf>,
    pub machine: Machine,
    pub memory: Memory,
    pub hostname: String,
    pub lifetime: Lifetime,
}

/// Boots `spec` and returns once its agent answers.
pub async fn cold_boot(paths: &Paths, spec: BootSpec) -> Result<Vm> {
    let kernel = spec.kernel.clone().unwrap_or_else(|| paths.vmlinuz());
    let initrd = paths.initramfs();
    for (what, p) in [("kernel", &kernel), ("initramfs", &initrd)] {
        if !p.exists() {
            bail!("no guest {what} at {}; run scripts/setup.sh", p.display());
        }
    }
    let dir = VmDir::new(paths.vm_dir(&spec.id));
    std::fs::create_dir_all(&dir.path)
        .with_context(|| format!("creating {}", dir.path.display()))?;
    let result = async {
        super::disk::create_overlay(&spec.rootfs, &dir.disk()).await?;
        let launch = Launch {
            name: spec.id.clone(),
            machine: spec.machine.clone(),
            memory: spec.memory.clone(),
            boot: Boot::Kernel {
                kernel,
                initrd,
                cmdline: super::qemu::kernel_cmdline(spec.machine.accel, &spec.hostname, ""),
            },
            disk: dir.disk(),
            qmp_socket: dir.qmp(),
            agent_socket: dir.agent(),
            console_log: dir.console(),
            nic: None,
        };
        let mut vm = Vm::spawn(&spec.id, dir.clone(), &launch, spec.lifetime).await?;
        if let Err(e) = vm.wait_agent(BOOT_TIMEOUT).await {
            vm.destroy().await;
            return Err(e);
        }
        Ok(vm)
    }
    .await;
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&dir.path);
    }
    result
}
