//! The QEMU command line. One function builds it for parents and children
//! alike, so a child's device list always matches the snapshot's parent
//! (a mismatch fails the restore with "Unknown savevm section").

use super::accel::Accel;
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The QEMU binary: `$FORKD_QEMU`, or `qemu-system-x86_64` on PATH.
pub fn qemu_binary() -> OsString {
    std::env::var_os("FORKD_QEMU").unwrap_or_else(|| "qemu-system-x86_64".into())
}

/// The QEMU version (e.g. "10.0.2"); vmstate is tied to it.
pub fn qemu_version() -> anyhow::Result<String> {
    static V: OnceLock<Result<String, String>> = OnceLock::new();
    V.get_or_init(|| {
        let out = std::process::Command::new(qemu_binary())
            .arg("--version")
            .output()
            .map_err(|e| {
                format!(
                    "running {:?} --version: {e} (is QEMU >= 10 installed? run scripts/setup.sh)",
                    qemu_binary()
                )
            })?;
        let text = String::from_utf8_lossy(&out.stdout);
        parse_version(&text).ok_or_else(|| format!("unrecognised QEMU version output: {text:?}"))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// The version in `qemu-system-x86_64 --version` output ("10.0.2").
pub fn parse_version(text: &str) -> Option<String> {
    let rest = text.lines().next()?.split("version ").nth(1)?;
    Some(rest.split_whitespace().next()?.to_string())
}

/// Fails unless QEMU is at least version 10 (older ones lack what forkd uses).
pub fn check_qemu() -> anyhow::Result<String> {
    let v = qemu_version()?;
    let major: u32 = v
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if major < 10 {
        anyhow::bail!("QEMU {v} is too old: forkd needs QEMU >= 10 (scripts/setup.sh installs it)");
    }
    Ok(v)
}

/// Everything that determines the guest's hardware. A snapshot records it;
/// a child must be started with an identical one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// KVM or TCG.
    pub accel: Accel,
    /// CPU model: `max` under TCG, `host` under KVM.
    pub cpu: String,
    /// Guest RAM, MiB.
    pub mem_mib: u64,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Whether the guest has a virtio-net device.
    #[serde(default)]
    pub net: bool,
    /// Number of virtio-fs devices (host folders, [`crate::volume`]),
    /// tagged [`volume_tag`]`(0..volumes)`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub volumes: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The virtio-fs tag of volume device `i`: what the guest mounts.
pub fn volume_tag(i: u32) -> String {
    format!("forkd-vol{i}")
}

impl Machine {
    /// The machine for `accel`, with the CPU model that accelerator needs and no NIC.
    pub fn new(accel: Accel, mem_mib: u64, vcpus: u32) -> Machine {
        let cpu = match accel {
            Accel::Kvm => "host",
            Accel::Tcg => "max",
        };
        Machine {
            accel,
            cpu: cpu.into(),
            mem_mib,
            vcpus,
            net: false,
            volumes: 0,
        }
    }

    /// The machine type, CPU and device list, as recorded in a snapshot.
    /// Derived from [`Machine::devices`], like the QEMU arguments, so the
    /// two cannot drift apart.
    pub fn signature(&self) -> String {
        let mut parts = vec![MACHINE_TYPE.to_string(), format!("cpu={}", self.cpu)];
        parts.extend(self.devices().iter().map(|d| d.signature()));
        parts.join(";")
    }

    /// The guest's devices, in the order QEMU creates them. vmstate names
    /// its sections by device, so a child must get exactly its parent's list.
    pub fn devices(&self) -> Vec<Device> {
        let mut d = vec![
            Device::Console,
            Device::RootDisk,
            Device::Agent,
            Device::Rng,
        ];
        if self.net {
            d.push(Device::Net);
        }
        d.extend((0..self.volumes).map(Device::Volume));
        d
    }
}

/// One guest device. [`Device::signature`] is what a snapshot records;
/// [`Device::args`] is how QEMU is told to make it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The serial console (ttyS0), written to the VM's console log.
    Console,
    /// The root disk: the VM's private qcow2 overlay.
    RootDisk,
    /// The agent's virtio-serial port, backed by a unix socket.
    Agent,
    /// virtio-rng fed from the host's /dev/urandom.
    Rng,
    /// virtio-net on a tap device.
    Net,
    /// A host folder: vhost-user-fs served by a virtiofsd over a unix
    /// socket ([`crate::volume`]). Needs shared guest RAM.
    Volume(u32),
}

impl Device {
    /// The device's name in a snapshot's machine signature.
    pub fn signature(self) -> String {
        match self {
            Device::Console => "isa-serial".into(),
            Device::RootDisk => "virtio-blk-device".into(),
            Device::Agent => format!(
                "virtio-serial-device+virtserialport({})",
                rootfs_init::protocol::AGENT_PORT_NAME
            ),
            Device::Rng => "virtio-rng-device".into(),
            Device::Net => "virtio-net-device".into(),
            Device::Volume(i) => format!("vhost-user-fs-device({})", volume_tag(i)),
        }
    }

    /// The QEMU arguments that create the device for `l`.
    fn args(self, l: &Launch) -> Vec<String> {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        match self {
            Device::Console => v(&[
                "-chardev",
                // append: poold rotates a long console log by truncating it.
                &format!("file,id=con,path={},append=on", path_opt(&l.console_log)),
                "-serial",
                "chardev:con",
            ]),
            Device::RootDisk => v(&[
                "-drive",
                &format!(
                    "id=root,file={},format=qcow2,if=none,cache=unsafe,discard=unmap,file.drop-cache=off,backing.file.drop-cache=off",
                    path_opt(&l.disk)
                ),
                "-device",
                "virtio-blk-device,drive=root",
            ]),
            Device::Agent => v(&[
                "-device",
                "virtio-serial-device,max_ports=2",
                "-chardev",
                &format!(
                    "socket,id=agent,path={},server=on,wait=off",
                    path_opt(&l.agent_socket)
                ),
                "-device",
                &format!(
                    "virtserialport,chardev=agent,name={}",
                    rootfs_init::protocol::AGENT_PORT_NAME
                ),
            ]),
            Device::Rng => v(&[
                "-object",
                "rng-random,id=rng,filename=/dev/urandom",
                "-device",
                "virtio-rng-device,rng=rng",
            ]),
            // The tap is an open descriptor (Vm::spawn); the MAC is part
            // of the guest's state, identical in every child.
            Device::Net => v(&[
                "-netdev",
                &format!("tap,id=net0,fd={TAP_FD}"),
                "-device",
                &format!("virtio-net-device,netdev=net0,mac={}", forkd_net::GUEST_MAC),
            ]),
            // The socket is poold's listening socket, handed to virtiofsd;
            // QEMU connects at start-up and the backend accepts it.
            Device::Volume(i) => {
                let sock = l
                    .volume_sockets
                    .get(i as usize)
                    .map(|p| path_opt(p))
                    .unwrap_or_default();
                v(&[
                    "-chardev",
                    &format!("socket,id=vol{i},path={sock}"),
                    "-device",
                    &format!("vhost-user-fs-device,chardev=vol{i},tag={}", volume_tag(i)),
                ])
            }
        }
    }
}

/// QEMU's seccomp filter: on, with every optional group denied (obsolete
/// system calls, set*id, fork/exec, and scheduler/affinity changes). It
/// applies to every thread, from before the guest runs.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// The machine type and its options.
pub const MACHINE_TYPE: &str = "microvm,acpi=on,pit=on,pic=on,rtc=on";

/// Where guest RAM lives.
#[derive(Debug, Clone)]
pub enum Memory {
    /// Plain anonymous RAM (a VM that will never be snapshotted).
    Anonymous,
    /// A parent: RAM is a shared file (a snapshot reads it back as memory.bin).
    Shared(PathBuf),
    /// A child: a private copy-on-write mapping of a snapshot's memory.bin,
    /// opened read-only. Children share its page cache until they write.
    Private(PathBuf),
}

/// How the guest starts.
#[derive(Debug, Clone)]
pub enum Boot {
    /// Cold boot a kernel.
    Kernel {
        /// The guest kernel image.
        kernel: PathBuf,
        /// The initrd (forkd-init).
        initrd: PathBuf,
        /// The kernel command line.
        cmdline: String,
    },
    /// Wait for an incoming migration (a restore), started over QMP.
    Incoming,
}

/// The guest's NIC: the tap `tap0` inside the network namespace `netns`
/// (docs/network.md). QEMU gets the tap as an open descriptor, [`TAP_FD`],
/// opened in that namespace before the jail drops privileges.
#[derive(Debug, Clone)]
pub struct Nic {
    /// A namespace name under /run/netns.
    pub netns: String,
    /// The child's network (None: an isolated parent namespace), recorded
    /// with the VM so whoever destroys it tears the network down.
    pub child: Option<forkd_net::ChildNet>,
}

/// The descriptor QEMU finds its tap at (`-netdev tap,fd=`).
pub const TAP_FD: i32 = 100;

/// One QEMU invocation.
#[derive(Debug, Clone)]
pub struct Launch {
    /// QEMU's `-name`: the VM id.
    pub name: String,
    /// The guest hardware; a child's must equal its snapshot's.
    pub machine: Machine,
    /// How guest RAM is backed.
    pub memory: Memory,
    /// Cold boot or incoming migration.
    pub boot: Boot,
    /// The root disk: a qcow2 overlay private to this VM.
    pub disk: PathBuf,
    /// QMP socket QEMU listens on.
    pub qmp_socket: PathBuf,
    /// Socket of the agent's virtio-serial port.
    pub agent_socket: PathBuf,
    /// File the serial console is appended to.
    pub console_log: PathBuf,
    /// A tap-backed virtio-net NIC; None for no network device.
    pub nic: Option<Nic>,
    /// The vhost-user socket of each volume device, in device order (as
    /// many as `machine.volumes`).
    pub volume_sockets: Vec<PathBuf>,
}

impl Launch {
    /// The full argument list (without the binary).
    pub fn args(&self) -> Vec<OsString> {
        let m = &self.machine;
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |parts: &[&str]| a.extend(parts.iter().map(OsString::from));
        push(&["-name", &self.name]);
        push(&[
            "-M",
            MACHINE_TYPE,
            "-accel",
            m.accel.as_str(),
            "-cpu",
            &m.cpu,
        ]);
        push(&[
            "-m",
            &format!("{}M", m.mem_mib),
            "-smp",
            &m.vcpus.to_string(),
        ]);
        push(&[
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-sandbox",
            SANDBOX,
        ]);
        let mem = match &self.memory {
            Memory::Anonymous => String::new(),
            Memory::Shared(p) => format!("share=on,mem-path={}", path_opt(p)),
            Memory::Private(p) => format!("share=off,readonly=on,rom=off,mem-path={}", path_opt(p)),
        };
        let backend = match &self.memory {
            Memory::Anonymous => format!("memory-backend-ram,id=mem,size={}M", m.mem_mib),
            _ => format!("memory-backend-file,id=mem,size={}M,{mem}", m.mem_mib),
        };
        push(&["-object", &backend, "-machine", "memory-backend=mem"]);
        match &self.boot {
            Boot::Kernel {
                kernel,
                initrd,
                cmdline,
            } => {
                push(&[
                    "-kernel",
                    &kernel.to_string_lossy(),
                    "-initrd",
                    &initrd.to_string_lossy(),
                ]);
                push(&["-append", cmdline]);
            }
            // -S: stay paused after the state arrives, whatever the source
            // was doing (a live migration source is running).
            Boot::Incoming => push(&["-incoming", "defer", "-S"]),
        }
        for d in m.devices() {
            let args = d.args(self);
            push(&args.iter().map(String::as_str).collect::<Vec<_>>());
        }
        push(&[
            "-qmp",
            &format!("unix:{},server=on,wait=off", path_opt(&self.qmp_socket)),
        ]);
        a
    }
}

/// Escapes a path for a QEMU option value (commas are doubled).
fn path_opt(p: &Path) -> String {
    p.to_string_lossy().replace(',', ",,")
}

/// The host's TSC frequency in kHz, measured once against CLOCK_MONOTONIC_RAW.
///
/// Under TCG the guest's TSC advances at the host's TSC rate, so passing this
/// as `tsc_early_khz=` lets the guest skip its PIT-based calibration, which
/// fails when the host is busy (the guest then hangs early in boot).
pub fn host_tsc_khz() -> u64 {
    static KHZ: OnceLock<u64> = OnceLock::new();
    *KHZ.get_or_init(|| {
        use nix::time::{clock_gettime, ClockId};
        let now = || {
            let t = clock_gettime(ClockId::CLOCK_MONOTONIC_RAW).expect("clock_gettime");
            t.tv_sec() as u128 * 1_000_000_000 + t.tv_nsec() as u128
        };
        // SAFETY: rdtsc has no memory effects.
        let tsc = || unsafe { core::arch::x86_64::_rdtsc() } as u128;
        // Best of three 20 ms samples (least disturbed by preemption).
        let mut best = 0u128;
        for _ in 0..3 {
            let (t0, c0) = (now(), tsc());
            std::thread::sleep(std::time::Duration::from_millis(20));
            let (c1, t1) = (tsc(), now());
            let khz = (c1 - c0) * 1_000_000 / (t1 - t0).max(1);
            best = best.max(khz);
        }
        best as u64
    })
}

/// The kernel command line of a forkd guest under `accel`; a networked
/// guest (`net`) configures eth0 at boot (forkd-init reads `forkd.ip`).
pub fn kernel_cmdline(accel: Accel, hostname: &str, net: bool, extra: &str) -> String {
    // An idle sandbox should not wake its vCPU: no soft-lockup watchdog
    // (an hrtimer every 4 s, and false alarms after a pause in the pool) and
    // no proactive compaction (kcompactd checks every 500 ms). Each wakeup
    // costs ~1 ms of host CPU under TCG, paid by every idle child at once.
    let mut c = format!(
        "console=ttyS0 quiet panic=-1 nowatchdog sysctl.vm.compaction_proactiveness=0 forkd.hostname={hostname}"
    );
    if net {
        c.push_str(&format!(
            " forkd.ip={}/{} forkd.gw={}",
            forkd_net::GUEST_ADDR,
            forkd_net::GUEST_PREFIX,
            forkd_net::GATEWAY
        ));
    }
    if accel == Accel::Tcg {
        // Guest TSC = host TSC under TCG: trust it and skip calibration.
        c.push_str(&format!(" tsc=reliable tsc_early_khz={}", host_tsc_khz()));
    }
    if !extra.is_empty() {
        c.push(' ');
        c.push_str(extra);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launch of `machine` with placeholder paths, no NIC, no volumes.
    fn launch(machine: Machine, memory: Memory) -> Launch {
        Launch {
            name: "t".into(),
            machine,
            memory,
            boot: Boot::Incoming,
            disk: "/d".into(),
            qmp_socket: "/q".into(),
            agent_socket: "/a".into(),
            console_log: "/c".into(),
            nic: None,
            volume_sockets: Vec::new(),
        }
    }

    fn args_of(l: &Launch) -> Vec<String> {
        l.args()
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    #[test]
    fn version_parse() {
        assert_eq!(
            parse_version("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)\nCopyright")
                .as_deref(),
            Some("10.0.2")
        );
    }

    #[test]
    fn parent_and_child_differ_only_in_memory_and_boot() {
        let l = launch(
            Machine::new(Accel::Tcg, 256, 1),
            Memory::Shared("/m,x".into()),
        );
        let args = args_of(&l);
        assert!(args.iter().any(|a| a.contains("mem-path=/m,,x")));
        assert!(args.contains(&"defer".to_string()));
    }

    /// Each volume is a vhost-user-fs device on its socket, named in the
    /// signature; a machine without volumes has neither.
    #[test]
    fn volumes_are_devices_in_args_and_signature() {
        let mut machine = Machine::new(Accel::Tcg, 256, 1);
        assert!(!machine.signature().contains("vhost-user-fs"));
        machine.volumes = 2;
        let l = Launch {
            volume_sockets: vec!["/s/vol0.sock".into(), "/s/vol1.sock".into()],
            ..launch(machine.clone(), Memory::Shared("/m".into()))
        };
        let args = args_of(&l);
        assert!(args.contains(&"socket,id=vol1,path=/s/vol1.sock".to_string()));
        assert!(args.contains(&"vhost-user-fs-device,chardev=vol0,tag=forkd-vol0".to_string()));
        let sig = machine.signature();
        assert!(sig.ends_with("vhost-user-fs-device(forkd-vol0);vhost-user-fs-device(forkd-vol1)"));
        // Old records (no `volumes` field) read as none.
        let old: Machine = serde_json::from_str(
            r#"{"accel":"tcg","cpu":"max","mem_mib":256,"vcpus":1,"net":false}"#,
        )
        .unwrap();
        assert_eq!(old.volumes, 0);
    }

    /// The signature and the command line come from one device list: every
    /// device the signature names is created by the arguments, in order, and
    /// adding a NIC changes both.
    #[test]
    fn signature_and_args_come_from_one_device_list() {
        for net in [false, true] {
            let mut machine = Machine::new(Accel::Tcg, 256, 1);
            machine.net = net;
            let l = Launch {
                nic: net.then(|| Nic {
                    netns: "forkd-t".into(),
                    child: None,
                }),
                ..launch(machine.clone(), Memory::Anonymous)
            };
            let args = args_of(&l);
            let created: Vec<&str> = args
                .windows(2)
                .filter(|w| w[0] == "-device" || w[0] == "-serial")
                .map(|w| w[1].split(',').next().unwrap())
                .collect();
            let expect: Vec<&str> = if net {
                vec![
                    "chardev:con",
                    "virtio-blk-device",
                    "virtio-serial-device",
                    "virtserialport",
                    "virtio-rng-device",
                    "virtio-net-device",
                ]
            } else {
                vec![
                    "chardev:con",
                    "virtio-blk-device",
                    "virtio-serial-device",
                    "virtserialport",
                    "virtio-rng-device",
                ]
            };
            assert_eq!(created, expect);
            let sig = machine.signature();
            for d in machine.devices() {
                assert!(sig.contains(&d.signature()), "{sig} lacks {d:?}");
            }
            assert_eq!(sig.contains("virtio-net-device"), net);
        }
    }
}
