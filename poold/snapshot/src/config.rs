//! What a snapshot records about the VM it was taken from, and the check
//! that refuses a restore this host cannot do (docs/design.md,
//! "Snapshot compatibility").
//!
//! vmstate is tied to the QEMU version, the machine type, the CPU model and
//! the device list. A mismatch makes QEMU fail late and cryptically
//! ("Unknown savevm section"), so it is refused before QEMU starts, with a
//! message naming both values.

use anyhow::{bail, Context, Result};
use forkd_vmm::{kvm_usable, Accel};
use forkd_vmm::{qemu_version, Machine, MACHINE_TYPE};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The VM configuration stored in a snapshot record's `config`.
///
/// `qemu_version` and `machine_signature` are also read by the hub's
/// compatibility check (`hub::compat`), so their names are fixed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmConfig {
    /// QEMU version that took the snapshot; a restore needs the same one.
    pub qemu_version: String,
    /// Machine type, CPU model and device list (see [`Machine::signature`]).
    pub machine_signature: String,
    /// QEMU's `-machine` value (forkd-vmm's `MACHINE_TYPE`).
    pub machine_type: String,
    /// Accelerator, CPU model, memory, vCPUs, NIC.
    pub machine: Machine,
    /// blake3 of the kernel and initramfs the parent booted.
    pub kernel_blake3: String,
    /// blake3 of the initramfs the parent booted.
    pub initrd_blake3: String,
    /// Kernel command line the parent booted with.
    pub cmdline: String,
    /// The image the parent booted, and when that image was built.
    pub image: String,
    /// When that image was built, seconds since the Unix epoch.
    pub image_built_at_unix: u64,
    /// Under KVM the guest sees the host's own CPU (`cpu=host`), and its
    /// vmstate carries that CPU's features: the host CPU it was taken on
    /// ([`host_cpu_id`]). None under TCG, whose `max` model depends only on
    /// the QEMU version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cpu: Option<String>,
    /// The host folders behind the machine's volume devices, in device
    /// order, with the guest paths the parent mounted them at: what a
    /// child gets unless its spawn rebinds them (docs/volumes.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<forkd_vmm::Volume>,
}

impl VmConfig {
    /// Reads the config recorded in a snapshot.
    pub fn from_record(rec: &forkd_layers::SnapshotRecord) -> Result<VmConfig> {
        serde_json::from_value(rec.config.clone()).with_context(|| {
            format!(
                "snapshot {} has no usable VM config (not made by `forkd snapshot create`?)",
                rec.id
            )
        })
    }

    /// Fails, before anything starts, if this host cannot restore the
    /// snapshot: another QEMU version, machine type, device list or an
    /// accelerator it cannot use.
    pub fn check_restorable(&self) -> Result<()> {
        let host = qemu_version()?;
        let cpu = match self.machine.accel {
            Accel::Kvm => Some(host_cpu_id()?),
            Accel::Tcg => None,
        };
        self.check_against(
            &host,
            kvm_usable().map_err(|e| e.to_string()),
            cpu.as_deref(),
        )
    }

    fn check_against(
        &self,
        host_qemu: &str,
        kvm: Result<(), String>,
        host_cpu: Option<&str>,
    ) -> Result<()> {
        if self.qemu_version != host_qemu {
            bail!(
                "snapshot was taken with QEMU {}, this host runs QEMU {host_qemu}: device state is tied to the QEMU version; take the snapshot again on this host",
                self.qemu_version
            );
        }
        if self.machine_type != MACHINE_TYPE {
            bail!(
                "snapshot machine type is {:?}, this forkd builds {MACHINE_TYPE:?}; take the snapshot again",
                self.machine_type
            );
        }
        let ours = self.machine.signature();
        if self.machine_signature != ours {
            bail!(
                "snapshot devices/CPU are {:?}, this forkd would start {ours:?} (CPU model {}); take the snapshot again",
                self.machine_signature,
                self.machine.cpu
            );
        }
        if self.machine.accel == Accel::Kvm {
            if let Err(why) = kvm {
                bail!(
                    "snapshot was taken under KVM (CPU model {}), which this host cannot run: {why}",
                    self.machine.cpu
                );
            }
            if let (Some(theirs), Some(ours)) = (&self.host_cpu, host_cpu) {
                if theirs != ours {
                    bail!(
                        "snapshot was taken under KVM on CPU {theirs:?}, this host's CPU is {ours:?}: the guest's CPU features would change under it; take the snapshot again on this host (or on one with the same CPU)"
                    );
                }
            }
        }
        Ok(())
    }
}

/// Smallest guest memory forkd makes, MiB.
pub const MIN_MEM_MIB: u64 = 64;
/// Most vCPUs forkd gives a VM.
pub const MAX_VCPUS: u32 = 64;

impl VmConfig {
    /// Refuses a config `forkd snapshot create` would never record: a CPU
    /// model other than its accelerator's, vCPUs outside 1..=[`MAX_VCPUS`],
    /// memory under [`MIN_MEM_MIB`] or over this host's `host_mem_mib`, or
    /// a `memory.bin` of another size than the memory. A record pulled from
    /// a hub is not trusted: without this it would choose QEMU's `-cpu`
    /// argument and size a child past what the host has.
    pub fn check_sane(&self, memory_bin_bytes: Option<u64>, host_mem_mib: u64) -> Result<()> {
        let m = &self.machine;
        let want_cpu = Machine::new(m.accel, m.mem_mib, m.vcpus).cpu;
        if m.cpu != want_cpu {
            bail!(
                "snapshot asks for CPU model {:?}, but a {:?} VM is always {want_cpu:?}; the record was not made by forkd (or was altered): refusing it",
                m.cpu,
                m.accel
            );
        }
        if m.vcpus == 0 || m.vcpus > MAX_VCPUS {
            bail!(
                "snapshot asks for {} vCPUs; forkd runs 1-{MAX_VCPUS}: the record was not made by forkd (or was altered)",
                m.vcpus
            );
        }
        if m.mem_mib < MIN_MEM_MIB || m.mem_mib > host_mem_mib {
            bail!(
                "snapshot asks for {} MiB of memory; this host allows {MIN_MEM_MIB}-{host_mem_mib} MiB (its RAM): take the snapshot with less memory",
                m.mem_mib
            );
        }
        if let Some(len) = memory_bin_bytes {
            if len != m.mem_mib << 20 {
                bail!(
                    "snapshot's memory.bin is {len} bytes but its VM has {} MiB ({} bytes): the record is inconsistent (altered or corrupt)",
                    m.mem_mib,
                    m.mem_mib << 20
                );
            }
        }
        Ok(())
    }
}

/// MemTotal of this host in MiB (`u64::MAX` if unknown).
pub fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(u64::MAX, |kib| kib / 1024)
}

/// Identifies this host's CPU for [`VmConfig::host_cpu`]: vendor, family,
/// model, stepping, name and a hash of the feature flags of the first
/// processor in /proc/cpuinfo.
pub fn host_cpu_id() -> Result<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").context("reading /proc/cpuinfo")?;
    cpu_id_from(&info).context("/proc/cpuinfo has no vendor_id, model or flags line")
}

fn cpu_id_from(cpuinfo: &str) -> Option<String> {
    let first = cpuinfo.split("\n\n").next()?;
    let field = |name: &str| {
        first.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim().to_string())
        })
    };
    let flags = field("flags")?;
    let hash = blake3::hash(flags.as_bytes()).to_hex();
    Some(format!(
        "{} family {} model {} stepping {} ({}), flags {}",
        field("vendor_id")?,
        field("cpu family").unwrap_or_default(),
        field("model")?,
        field("stepping").unwrap_or_default(),
        field("model name").unwrap_or_default(),
        &hash[..16]
    ))
}

/// blake3 of a file, hex.
pub fn file_blake3(path: &Path) -> Result<String> {
    let mut h = blake3::Hasher::new();
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    std::io::copy(&mut f, &mut h).with_context(|| format!("hashing {}", path.display()))?;
    Ok(h.finalize().to_hex().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> VmConfig {
        let machine = Machine::new(Accel::Tcg, 256, 1);
        VmConfig {
            qemu_version: "10.0.2".into(),
            machine_signature: machine.signature(),
            machine_type: MACHINE_TYPE.into(),
            machine,
            kernel_blake3: String::new(),
            initrd_blake3: String::new(),
            cmdline: String::new(),
            image: "minimal".into(),
            image_built_at_unix: 0,
            host_cpu: None,
            volumes: Vec::new(),
        }
    }

    #[test]
    fn matching_host_passes() {
        cfg()
            .check_against("10.0.2", Err("no kvm".into()), None)
            .unwrap();
    }

    #[test]
    fn mismatches_name_both_values() {
        let e = cfg()
            .check_against("10.1.0", Ok(()), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("10.0.2") && e.contains("10.1.0"), "{e}");

        let mut c = cfg();
        c.machine_type = "pc-q35".into();
        let e = c
            .check_against("10.0.2", Ok(()), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("pc-q35") && e.contains("microvm"), "{e}");

        let mut c = cfg();
        c.machine.cpu = "host".into();
        let e = c
            .check_against("10.0.2", Ok(()), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cpu=max") && e.contains("cpu=host"), "{e}");

        let mut c = cfg();
        c.machine = Machine::new(Accel::Kvm, 256, 1);
        c.machine_signature = c.machine.signature();
        let e = c
            .check_against("10.0.2", Err("kvm_pvm".into()), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("KVM") && e.contains("kvm_pvm"), "{e}");

        c.host_cpu = Some("GenuineIntel family 6 model 85".into());
        c.check_against("10.0.2", Ok(()), Some("GenuineIntel family 6 model 85"))
            .unwrap();
        let e = c
            .check_against("10.0.2", Ok(()), Some("AuthenticAMD family 25 model 1"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("model 85") && e.contains("AuthenticAMD"), "{e}");
    }

    #[test]
    fn sane_config_passes_and_forged_ones_are_refused() {
        let mut c = cfg();
        c.check_sane(Some(256 << 20), 1024).unwrap();
        c.check_sane(None, 1024).unwrap();
        let refused = |c: &VmConfig, mem: Option<u64>, host: u64, want: &str| {
            let e = c.check_sane(mem, host).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        };
        refused(&c, Some(1 << 20), 1024, "memory.bin is 1048576 bytes");
        refused(&c, None, 128, "this host allows 64-128 MiB");
        c.machine.cpu = "max,+pdpe1gb".into();
        refused(&c, None, 1024, "CPU model \"max,+pdpe1gb\"");
        c.machine.cpu = "host".into();
        refused(&c, None, 1024, "always \"max\"");
        let mut c = cfg();
        c.machine.vcpus = 0;
        refused(&c, None, 1024, "0 vCPUs");
        c.machine.vcpus = 4096;
        refused(&c, None, 1024, "4096 vCPUs");
        let mut c = cfg();
        c.machine.mem_mib = 1 << 40;
        refused(&c, None, 1 << 20, "MiB of memory");
    }

    #[test]
    fn cpu_id_reads_the_first_processor() {
        let info = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\nmodel name\t: Xeon\nstepping\t: 7\nflags\t\t: fpu vme avx512f\n\nprocessor\t: 1\nvendor_id\t: Other\nmodel\t\t: 1\nflags\t\t: fpu\n";
        let id = cpu_id_from(info).unwrap();
        assert!(
            id.starts_with("GenuineIntel family 6 model 85 stepping 7 (Xeon), flags "),
            "{id}"
        );
        let other = cpu_id_from(&info.replace("avx512f", "")).unwrap();
        assert_ne!(id, other, "a different flag set is a different CPU");
        assert!(cpu_id_from("nothing here").is_none());
        host_cpu_id().unwrap();
    }
}
