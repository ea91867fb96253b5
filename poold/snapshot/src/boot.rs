//! Cold-booting a guest from an image: the VM directory, its disk overlay,
//! the QEMU launch, and the wait for the agent.

use crate::paths::Paths;
use anyhow::{bail, Result};
use forkd_vmm::{Boot, DiskBase, Lifetime, Machine, Memory, StartSpec, Vm, VmDir};
use std::path::PathBuf;
use std::time::Duration;

/// How long a cold boot may take before it is declared failed (TCG is slow).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

/// What to boot.
pub struct BootSpec {
    /// VM id; names its directory under `run/vms/`.
    pub id: String,
    /// The root disk image (raw ext4); never written (the VM gets an overlay).
    pub rootfs: PathBuf,
    /// Boot this kernel instead of the data dir's.
    pub kernel: Option<PathBuf>,
    /// The guest hardware.
    pub machine: Machine,
    /// How guest RAM is backed (a shared file for a future parent).
    pub memory: Memory,
    /// Guest hostname, passed on the kernel command line.
    pub hostname: String,
    /// Whether the VM dies with this process or outlives it.
    pub lifetime: Lifetime,
    /// Host folders, one per `machine.volumes` device, mounted at boot.
    pub volumes: Vec<forkd_vmm::Volume>,
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
    let spec = StartSpec {
        id: spec.id.clone(),
        machine: spec.machine.clone(),
        memory: spec.memory,
        boot: Boot::Kernel {
            kernel,
            initrd,
            cmdline: forkd_vmm::kernel_cmdline(
                spec.machine.accel,
                &spec.hostname,
                spec.machine.net,
                &forkd_vmm::volume::cmdline_words(&spec.volumes),
            ),
        },
        disk: DiskBase::Image(spec.rootfs),
        lifetime: spec.lifetime,
        nic: None,
        volumes: spec.volumes,
    };
    Vm::start(
        VmDir::new(paths.vm_dir(&spec.id)),
        spec,
        async |vm: &mut Vm| vm.wait_agent(BOOT_TIMEOUT).await.map(drop),
    )
    .await
}
