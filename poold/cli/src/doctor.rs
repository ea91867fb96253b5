//! `forkd doctor`: every check a user needs before and after setup, each a
//! PASS, WARN or FAIL with a one-line fix; exits non-zero on any FAIL.
//!
//! Each check is a small function of a [`Host`]: the roots it reads
//! (`/proc`, `/sys`, `/dev`), the `PATH` it searches, the QEMU binaries it
//! runs and the data dir. The real host is [`Host::real`]; tests build fake
//! trees. Only [`check_poold`] talks to the network, and only to poold.

use clap::Args;
use forkd_snapshot::Paths;
use forkd_vmm::{AccelChoice, Hierarchy};
use serde::Serialize;
use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// `forkd doctor` flags.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Print the checks as JSON (`{"checks": [...], "pass", "warn", "fail"}`).
    #[arg(long)]
    pub json: bool,
    /// Skip the poold check (`$FORKD_URL`, `$FORKD_TOKEN`).
    #[arg(long)]
    pub no_poold: bool,
}

/// A check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    /// Works.
    Pass,
    /// Works, with a cost or a missing extra the user should know about.
    Warn,
    /// forkd will not work until this is fixed.
    Fail,
}

/// One check's result.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Short name (`qemu`, `kvm`, ...).
    pub name: &'static str,
    /// PASS, WARN or FAIL.
    pub verdict: Verdict,
    /// What was found.
    pub detail: String,
    /// What to do about a WARN or FAIL; empty on PASS.
    pub fix: String,
}

impl Check {
    fn pass(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            verdict: Verdict::Pass,
            detail: detail.into(),
            fix: String::new(),
        }
    }
    fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            verdict: Verdict::Warn,
            detail: detail.into(),
            fix: fix.into(),
        }
    }
    fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            verdict: Verdict::Fail,
            detail: detail.into(),
            fix: fix.into(),
        }
    }
}

/// What the checks read.
#[derive(Debug, Clone)]
pub struct Host {
    /// procfs root (`/proc`).
    pub proc_root: PathBuf,
    /// sysfs root (`/sys`).
    pub sys_root: PathBuf,
    /// devtmpfs root (`/dev`).
    pub dev_root: PathBuf,
    /// Directories searched for tools (`$PATH`).
    pub path: Vec<PathBuf>,
    /// The QEMU system emulator (`$FORKD_QEMU` or `qemu-system-x86_64`).
    pub qemu: OsString,
    /// The data dir.
    pub paths: Paths,
    /// `$FORKD_ACCEL`, unparsed.
    pub accel_env: String,
    /// The effective uid the checks answer for.
    pub uid: u32,
}

impl Host {
    /// This machine.
    pub fn real(paths: Paths) -> Host {
        Host {
            proc_root: "/proc".into(),
            sys_root: "/sys".into(),
            dev_root: "/dev".into(),
            path: std::env::var_os("PATH")
                .map(|p| std::env::split_paths(&p).collect())
                .unwrap_or_default(),
            qemu: forkd_vmm::qemu_binary(),
            paths,
            accel_env: std::env::var("FORKD_ACCEL").unwrap_or_default(),
            uid: nix::unistd::geteuid().as_raw(),
        }
    }

    /// `name` as found on [`Host::path`] (or as given, when it has a slash).
    fn which(&self, name: &Path) -> Option<PathBuf> {
        if name.components().count() > 1 {
            return name.is_file().then(|| name.to_path_buf());
        }
        self.path.iter().map(|d| d.join(name)).find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
        })
    }

    fn read(&self, root: &Path, rel: &str) -> Option<String> {
        std::fs::read_to_string(root.join(rel)).ok()
    }
}

/// The minimum QEMU major version (vmstate, microvm features forkd uses).
const MIN_QEMU_MAJOR: u32 = 10;

/// QEMU present and new enough.
pub fn check_qemu(h: &Host) -> Check {
    let name = "qemu";
    let Some(bin) = h.which(Path::new(&h.qemu)) else {
        return Check::fail(
            name,
            format!("{} not found", h.qemu.to_string_lossy()),
            "run scripts/setup.sh (installs QEMU >= 10; from bookworm-backports on Debian 12)",
        );
    };
    let out = match std::process::Command::new(&bin).arg("--version").output() {
        Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
        Err(e) => {
            return Check::fail(
                name,
                format!("{} --version: {e}", bin.display()),
                "reinstall QEMU (scripts/setup.sh)",
            )
        }
    };
    let Some(v) = forkd_vmm::parse_qemu_version(&out) else {
        return Check::fail(
            name,
            format!(
                "{}: unrecognised --version output {:?}",
                bin.display(),
                out.trim()
            ),
            "point $FORKD_QEMU at qemu-system-x86_64 >= 10",
        );
    };
    let major: u32 = v
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if major < MIN_QEMU_MAJOR {
        return Check::fail(
            name,
            format!("QEMU {v} ({}) is too old", bin.display()),
            "run scripts/setup.sh (installs QEMU >= 10), or set $FORKD_QEMU to one",
        );
    }
    if h.which(Path::new("qemu-img")).is_none() {
        return Check::fail(
            name,
            format!("QEMU {v}, but no qemu-img (disk overlays and branches need it)"),
            "apt-get install qemu-utils",
        );
    }
    Check::pass(name, format!("QEMU {v} ({})", bin.display()))
}

/// Whether this CPU offers hardware virtualization (vmx/svm in cpuinfo).
fn cpu_virt_flag(h: &Host) -> Option<&'static str> {
    let info = h.read(&h.proc_root, "cpuinfo")?;
    let flags = info.lines().find(|l| l.starts_with("flags"))?;
    let words: Vec<&str> = flags.split_whitespace().collect();
    if words.contains(&"vmx") {
        Some("vmx")
    } else if words.contains(&"svm") {
        Some("svm")
    } else {
        None
    }
}

/// Why KVM cannot run Linux guests here, or `None` when it can.
fn kvm_problem(h: &Host) -> Option<(String, String)> {
    if h.sys_root.join("module/kvm_pvm").exists() {
        return Some((
            "/dev/kvm is kvm_pvm (nested paravirtual KVM), which cannot run an unmodified Linux guest".into(),
            "use a host (or VM with nested VMX/SVM) whose KVM runs Linux guests; until then sandboxes run under TCG".into(),
        ));
    }
    let dev = h.dev_root.join("kvm");
    if !dev.exists() {
        return Some(match cpu_virt_flag(h) {
            None => (
                "no /dev/kvm, and the CPU shows no vmx/svm (a VM without nested virtualization, or virtualization off in firmware)".into(),
                "enable VT-x/AMD-V in firmware, or nested virtualization for this VM; until then sandboxes run under TCG".into(),
            ),
            Some(f) => (
                format!("no /dev/kvm, though the CPU has {f}"),
                format!("modprobe {}", if f == "vmx" { "kvm_intel" } else { "kvm_amd" }),
            ),
        });
    }
    match forkd_vmm::kvm_usable_in(&h.sys_root, &h.dev_root) {
        Ok(()) => None,
        Err(e) => Some((
            format!("{e:#}"),
            if h.uid == 0 {
                "check /dev/kvm's permissions and that no security module denies it".into()
            } else {
                "run forkd as root (poold and the CLI need root)".into()
            },
        )),
    }
}

/// `/dev/kvm` usable for Linux guests (nested paravirtual KVM is not).
pub fn check_kvm(h: &Host) -> Check {
    match kvm_problem(h) {
        None => Check::pass("kvm", "/dev/kvm opens read-write"),
        Some((detail, fix)) => Check::warn("kvm", detail, fix),
    }
}

/// What sandboxes will run under, and what TCG means when it is that.
pub fn check_accel(h: &Host) -> Check {
    let name = "accelerator";
    let choice: AccelChoice = match h.accel_env.parse() {
        Ok(c) => c,
        Err(e) => {
            return Check::fail(
                name,
                format!("FORKD_ACCEL: {e:#}"),
                "set FORKD_ACCEL to auto, kvm or tcg (or unset it)",
            )
        }
    };
    const TCG: &str = "TCG: QEMU emulates the CPU in software, several times slower per instruction, and the isolation boundary is QEMU's translator rather than hardware virtualization (docs/security.md)";
    match (choice, kvm_problem(h)) {
        (AccelChoice::Tcg, _) => Check::pass(name, format!("{TCG}; chosen by FORKD_ACCEL=tcg")),
        (_, None) => Check::pass(name, "KVM (hardware virtualization)"),
        (AccelChoice::Kvm, Some((why, fix))) => Check::fail(
            name,
            format!("FORKD_ACCEL=kvm, but KVM is unusable: {why}"),
            format!("{fix}; or unset FORKD_ACCEL to fall back to TCG"),
        ),
        (AccelChoice::Auto, Some(_)) => Check::warn(
            name,
            format!("falling back to {TCG}"),
            "for KVM speed and isolation, fix the kvm check above; everything works under TCG meanwhile",
        ),
    }
}

/// `/dev/fuse`, which forkd-fs (the memory of every child) mounts through.
pub fn check_fuse(h: &Host) -> Check {
    let dev = h.dev_root.join("fuse");
    if !dev.exists() {
        return Check::fail(
            "fuse",
            "no /dev/fuse",
            "modprobe fuse (and apt-get install fuse3); in a container, pass /dev/fuse through",
        );
    }
    let listed = h.read(&h.proc_root, "filesystems").is_some_and(|t| {
        t.lines()
            .any(|l| l.split_whitespace().last() == Some("fuse"))
    });
    if !listed {
        return Check::warn(
            "fuse",
            "/dev/fuse exists but the kernel lists no fuse filesystem",
            "modprobe fuse",
        );
    }
    Check::pass("fuse", "/dev/fuse; the kernel has fuse")
}

/// cgroup version and the controllers sandbox limits use.
pub fn check_cgroups(h: &Host) -> Check {
    let name = "cgroups";
    let mounts = h.read(&h.proc_root, "self/mounts").unwrap_or_default();
    let hier = match Hierarchy::detect_in(&h.sys_root.join("fs/cgroup"), &mounts) {
        Ok(x) => x,
        Err(e) => {
            return Check::warn(
                name,
                format!("{e:#}"),
                "boot with cgroup v2 (systemd.unified_cgroup_hierarchy=1) or mount the v1 memory, cpu and pids controllers; sandboxes run, without limits",
            )
        }
    };
    use forkd_vmm::Controller::{Cpu, Memory, Pids};
    let missing: Vec<&str> = [(Memory, "memory"), (Cpu, "cpu"), (Pids, "pids")]
        .into_iter()
        .filter(|(c, _)| !hier.supports(*c))
        .map(|(_, n)| n)
        .collect();
    let version = match &hier {
        Hierarchy::V2 { controllers, .. } => format!("cgroup v2 ({})", controllers.join(" ")),
        Hierarchy::V1 { .. } => "cgroup v1".to_string(),
    };
    if missing.is_empty() {
        Check::pass(
            name,
            format!("{version}: memory, cpu and pids limits available"),
        )
    } else {
        Check::warn(
            name,
            format!("{version}: no {} controller", missing.join(", ")),
            format!(
                "enable {} in the root cgroup (cgroup.subtree_control) or the kernel; spawns asking for those limits get 400",
                missing.join(", ")
            ),
        )
    }
}

/// What sandbox networking needs: `nft`, `/dev/net/tun`, network namespaces.
pub fn check_network(h: &Host) -> Check {
    let name = "network";
    let mut missing = Vec::new();
    let mut fixes = Vec::new();
    if h.which(Path::new("nft")).is_none() {
        missing.push("nft (nftables)");
        fixes.push("apt-get install nftables");
    }
    if !h.dev_root.join("net/tun").exists() {
        missing.push("/dev/net/tun");
        fixes.push("modprobe tun");
    }
    if !h.proc_root.join("self/ns/net").exists() {
        missing.push("network namespaces");
        fixes.push("a kernel with CONFIG_NET_NS");
    }
    if !missing.is_empty() {
        return Check::fail(
            name,
            format!(
                "missing {}: snapshots with a NIC (python images) cannot spawn",
                missing.join(", ")
            ),
            fixes.join("; "),
        );
    }
    let fwd = h
        .read(&h.proc_root, "sys/net/ipv4/ip_forward")
        .map(|s| s.trim().to_string());
    let fwd = match fwd.as_deref() {
        Some("1") => "on",
        _ => "off (poold turns it on when a sandbox gets a network)",
    };
    Check::pass(
        name,
        format!("nft, /dev/net/tun, network namespaces; IPv4 forwarding {fwd}"),
    )
}

/// The nearest existing ancestor of `p` (the data dir may not exist yet).
fn existing_ancestor(p: &Path) -> PathBuf {
    let mut p = p.to_path_buf();
    while !p.exists() {
        if !p.pop() {
            return PathBuf::from("/");
        }
    }
    p
}

/// poold refuses new work under this much free disk (its default
/// `min_free_disk_mib`); images and snapshots want more.
const MIN_FREE_DISK_MIB: u64 = 1024;
const WARN_FREE_DISK_MIB: u64 = 10 * 1024;

/// Free space where the data dir is.
pub fn check_disk(h: &Host) -> Check {
    let at = existing_ancestor(&h.paths.home);
    match nix::sys::statvfs::statvfs(&at) {
        Ok(st) => disk_verdict(
            &at,
            st.blocks_available() * st.fragment_size() / (1024 * 1024),
        ),
        Err(e) => Check::fail(
            "disk",
            format!("statvfs {}: {e}", at.display()),
            "check that the data dir's filesystem is mounted",
        ),
    }
}

fn disk_verdict(at: &Path, free_mib: u64) -> Check {
    let detail = format!("{} MiB free at {}", free_mib, at.display());
    if free_mib < MIN_FREE_DISK_MIB {
        Check::fail("disk", detail, format!("free space: poold refuses new work under {MIN_FREE_DISK_MIB} MiB (min_free_disk_mib); `forkd store gc` reclaims unreferenced chunks"))
    } else if free_mib < WARN_FREE_DISK_MIB {
        Check::warn(
            "disk",
            detail,
            "images take ~1 GiB each and snapshots grow with use: keep 10 GiB or more free",
        )
    } else {
        Check::pass("disk", detail)
    }
}

/// `MemAvailable` against poold's default floor.
/// The swap it reports is not needed, only noted: pools with `page_out`
/// park their children in it.
pub fn check_memory(h: &Host) -> Check {
    let meminfo = h.read(&h.proc_root, "meminfo").unwrap_or_default();
    let field = |name| forkd_vmm::meminfo_field(&meminfo, name);
    let swap = match field("SwapTotal").unwrap_or(0) / 1024 {
        0 => "no swap (pools' page_out needs some: docs/poold.md)".to_string(),
        s => format!("{s} MiB of swap"),
    };
    match field("MemAvailable").map(|kib| kib / 1024) {
        None => Check::warn("memory", "no MemAvailable in /proc/meminfo", "a kernel >= 3.14"),
        Some(m) if m < 256 => Check::fail("memory", format!("{m} MiB available, {swap}"), "free memory: poold refuses new work under 256 MiB (min_free_memory_mib)"),
        Some(m) if m < 2048 => Check::warn("memory", format!("{m} MiB available, {swap}"), "each sandbox needs its guest's RAM (512 MiB by default) less what it shares with its snapshot"),
        Some(m) => Check::pass("memory", format!("{m} MiB available, {swap}")),
    }
}

/// The data dir: present, root's, private, writable by us; kernel and
/// images in it.
pub fn check_data_dir(h: &Host) -> Check {
    let name = "data dir";
    let home = &h.paths.home;
    let md = match std::fs::metadata(home) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Check::warn(
                name,
                format!("{} does not exist yet", home.display()),
                "run scripts/setup.sh (or set FORKD_HOME to your data dir)",
            )
        }
        Err(e) => return Check::fail(name, format!("{}: {e}", home.display()), "run as root"),
    };
    if !md.is_dir() {
        return Check::fail(
            name,
            format!("{} is not a directory", home.display()),
            "set FORKD_HOME to a directory",
        );
    }
    let mode = md.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Check::fail(
            name,
            format!("{} is writable by others (mode {mode:04o})", home.display()),
            format!("chmod 700 {}", home.display()),
        );
    }
    if nix::unistd::access(home, nix::unistd::AccessFlags::W_OK).is_err() {
        return Check::fail(
            name,
            format!("{} is not writable by uid {}", home.display(), h.uid),
            "run forkd as root",
        );
    }
    if md.uid() != 0 {
        return Check::warn(
            name,
            format!("{} belongs to uid {}", home.display(), md.uid()),
            format!("chown root:root {}", home.display()),
        );
    }
    if mode & 0o077 != 0 {
        return Check::warn(
            name,
            format!(
                "{} is readable by others (mode {mode:04o}); it holds sandbox memory and disks",
                home.display()
            ),
            format!("chmod 700 {}", home.display()),
        );
    }
    if !h.paths.vmlinuz().exists() || !h.paths.initramfs().exists() {
        return Check::fail(
            name,
            format!(
                "{}: no guest kernel or initramfs in {}",
                home.display(),
                h.paths.kernel_dir().display()
            ),
            "run scripts/setup.sh (scripts/fetch-kernel.sh, scripts/build-guest.sh)",
        );
    }
    let images = std::fs::read_dir(h.paths.images_dir())
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.path().is_dir())
                .count()
        })
        .unwrap_or(0);
    if images == 0 {
        return Check::warn(name, format!("{}: kernel ready, no guest images", home.display()), "forkd image build --recipe python-numpy (scripts/setup.sh builds minimal and python-numpy)");
    }
    Check::pass(
        name,
        format!(
            "{} (mode {mode:04o}): kernel, initramfs, {images} image(s)",
            home.display()
        ),
    )
}

/// What is at the forkd-fs mount point, as doctor sees it.
#[derive(Debug)]
pub enum MountSeen {
    /// Nothing is mounted.
    Free,
    /// forkd-fs serves it and answers its control socket.
    Live,
    /// forkd-fs serves files, its control socket is silent.
    Silent,
    /// A forkd-fs mount nobody serves (or a hung one).
    Stale {
        /// statfs did not answer.
        hung: bool,
    },
    /// Something else is mounted there.
    Foreign(String),
    /// The mount table could not be read.
    Unknown(String),
}

/// Looks at the data dir's forkd-fs mount.
pub fn observe_mount(paths: &Paths) -> MountSeen {
    use forkd_fs::mount::State;
    let mp = paths.mount_dir();
    match forkd_fs::mount::state(&mp, &forkd_fs::default_control_socket(&mp)) {
        Ok(State::Free) => MountSeen::Free,
        Ok(State::Live(_)) => MountSeen::Live,
        Ok(State::Silent) => MountSeen::Silent,
        Ok(State::Stale { hung, .. }) => MountSeen::Stale { hung },
        Ok(State::Foreign(e)) => MountSeen::Foreign(e.fstype),
        Err(e) => MountSeen::Unknown(format!("{e:#}")),
    }
}

/// forkd-fs mounted and serving.
pub fn check_fs_mount(mount: &Path, seen: &MountSeen) -> Check {
    let name = "forkd-fs";
    let m = mount.display();
    match seen {
        MountSeen::Live => Check::pass(name, format!("mounted at {m}, answering")),
        MountSeen::Silent => Check::warn(name, format!("mounted at {m} and serving, but its control socket does not answer"), "if it persists, restart poold (it re-adopts the mount)"),
        MountSeen::Free => Check::warn(name, format!("not mounted at {m}"), "poold (or the first forkd snapshot/fork command) mounts it; if poold runs, see its log"),
        MountSeen::Stale { hung } => Check::fail(
            name,
            format!("a forkd-fs mount at {m} that nobody serves ({})", if *hung { "its daemon hangs" } else { "its daemon died" }),
            format!("a running poold mounts it again within seconds (its /healthz says so); without poold: forkd-fs unmount --lazy {m}"),
        ),
        MountSeen::Foreign(t) => Check::fail(name, format!("{m} has a {t} mount, not forkd-fs"), format!("umount {m}")),
        MountSeen::Unknown(e) => Check::warn(name, e.clone(), "run as root"),
    }
}

/// What answered at `$FORKD_URL`.
#[derive(Debug)]
pub enum PooldSeen {
    /// `GET /version` answered 200.
    Ok {
        /// Its `version`.
        version: String,
        /// Its `accelerator`.
        accel: String,
        /// Its `/healthz` `mount` object (null when it had none).
        mount: serde_json::Value,
    },
    /// 401: reachable, token missing or wrong.
    Unauthorized {
        /// Whether `$FORKD_TOKEN` was set.
        had_token: bool,
    },
    /// Another status.
    Status(u16),
    /// `$FORKD_URL` or `$FORKD_CA_CERT` is unusable (no request was made).
    BadClient(String),
    /// Something answered TLS with a certificate we do not trust.
    Untrusted(String),
    /// No connection.
    Unreachable(String),
}

/// Asks poold at `$FORKD_URL` for `/version` with `$FORKD_TOKEN`.
pub async fn observe_poold() -> PooldSeen {
    let had_token = std::env::var("FORKD_TOKEN").is_ok_and(|t| !t.trim().is_empty());
    let client = match forkd_api::Client::from_env() {
        Ok(c) => c,
        Err(e) => return PooldSeen::BadClient(format!("{e:#}")),
    };
    match client.send(forkd_api::Method::GET, "/version", None).await {
        Ok((s, body)) if s.is_success() => {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let field = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("?").to_string();
            // No token needed; a poold from before mount healing has no
            // `mount` in it.
            let mount = match client.send(forkd_api::Method::GET, "/healthz", None).await {
                Ok((_, body)) => serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|h| h.get("mount").cloned())
                    .unwrap_or_default(),
                Err(_) => serde_json::Value::Null,
            };
            PooldSeen::Ok {
                version: field("version"),
                accel: field("accelerator"),
                mount,
            }
        }
        Ok((s, _)) if s.as_u16() == 401 => PooldSeen::Unauthorized { had_token },
        Ok((s, _)) => PooldSeen::Status(s.as_u16()),
        // rustls names certificate problems in the error chain
        // ("invalid peer certificate: UnknownIssuer").
        Err(e) if format!("{e:#}").to_lowercase().contains("certificate") => {
            PooldSeen::Untrusted(format!("{e:#}"))
        }
        Err(e) => PooldSeen::Unreachable(format!("{e:#}")),
    }
}

/// poold reachable at `url` and accepting our token.
pub fn check_poold(url: &str, seen: &PooldSeen) -> Check {
    let name = "poold";
    match seen {
        PooldSeen::Ok { version, accel, mount } => {
            let what = format!("poold {version} at {url}, sandboxes under {accel}");
            check_poold_mount(name, what, mount)
        }
        PooldSeen::Unauthorized { had_token: false } => Check::fail(name, format!("{url} answers 401: poold wants a token"), "export FORKD_TOKEN=\"$(cat TOKEN_FILE)\" (poold's token_file)"),
        PooldSeen::Unauthorized { had_token: true } => Check::fail(name, format!("{url} answers 401: FORKD_TOKEN is not poold's token"), "set FORKD_TOKEN to the first line of poold's token_file"),
        PooldSeen::Status(s) => Check::warn(name, format!("{url} answers {s} to GET /version"), "is FORKD_URL pointing at poold? (a proxy or another service answers)"),
        PooldSeen::BadClient(e) => Check::fail(name, e.clone(), "fix FORKD_URL (http://HOST:PORT, https://HOST:PORT or unix:///PATH) or FORKD_CA_CERT (a readable PEM file)"),
        PooldSeen::Untrusted(e) => Check::fail(name, format!("{url} answers TLS with a certificate this client does not trust: {e}"), "export FORKD_CA_CERT=PATH (poold's tls_cert, or the CA that signed it)"),
        PooldSeen::Unreachable(e) => Check::warn(name, format!("not reachable at {url}: {e}"), "start it: systemctl enable --now poold (or `poold`); set FORKD_URL if it listens elsewhere"),
    }
}

/// What poold's `/healthz` says of its forkd-fs mount: failing when it does
/// not serve, a warning when poold had to mount it again.
fn check_poold_mount(name: &'static str, what: String, m: &serde_json::Value) -> Check {
    if m["ok"] == false {
        let why = m["error"].as_str().unwrap_or("no reason given");
        return Check::fail(
            name,
            format!("{what}; its forkd-fs mount does not serve: {why}"),
            "spawns fail until it does; poold retries every 2 s (see its log)",
        );
    }
    let count = m["recoveries"].as_u64().unwrap_or(0);
    let last = &m["last_recovery"];
    if count == 0 || last.is_null() {
        return Check::pass(name, what);
    }
    let why = match last["cause"].as_str().unwrap_or("?") {
        "holder_died" => "its holder died and a new holder adopted the connection".to_string(),
        cause => format!("the mount was {cause}"),
    };
    Check::warn(
        name,
        format!(
            "{what}; its forkd-fs mount recovered {count} time(s), last because {why} ({} sandboxes lost, {} pooled children discarded) at {}",
            last["lost_sandboxes"],
            last["discarded_pooled"],
            forkd_snapshot::format_unix(last["at_unix"].as_u64().unwrap_or(0)),
        ),
        "find what killed or unmounted forkd-fs (an OOM kill: dmesg; an operator's umount or pkill) in poold's log and the system journal",
    )
}

/// Where poold's config is: `$POOLD_CONFIG`, else the systemd unit's
/// `/etc/forkd/poold.toml` when it exists.
fn poold_config_path() -> Option<PathBuf> {
    std::env::var_os("POOLD_CONFIG")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            let p = PathBuf::from("/etc/forkd/poold.toml");
            p.exists().then_some(p)
        })
}

/// The parts of poold's config the egress check reads: `net.egress` and
/// each pool's `network`. Other keys are poold's to check (it refuses a
/// file with unknown ones); these are parsed as poold parses them.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
pub struct EgressConfig {
    net: EgressNet,
    pools: std::collections::BTreeMap<String, EgressPool>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct EgressNet {
    egress: forkd_net::EgressPolicy,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct EgressPool {
    network: Option<forkd_net::EgressPolicy>,
}

impl EgressConfig {
    /// Parses poold's config text, checking each policy's size as poold does.
    pub fn parse(text: &str) -> anyhow::Result<EgressConfig> {
        let c: EgressConfig = toml::from_str(text)?;
        c.net.egress.validate()?;
        for p in c.pools.values().filter_map(|p| p.network.as_ref()) {
            p.validate()?;
        }
        Ok(c)
    }

    /// Reads and parses the file at `path`.
    pub fn read(path: &Path) -> anyhow::Result<EgressConfig> {
        let text = std::fs::read_to_string(path)?;
        EgressConfig::parse(&text)
    }
}

/// Whether poold's configured egress policies (`net.egress`, each pool's
/// `network`) let sandboxes reach internal ranges (docs/network.md): a
/// WARN naming each entry that does. `config` is the file's path and what
/// reading it gave; None when there is none (the default: public only).
pub fn check_egress(config: Option<(&Path, anyhow::Result<EgressConfig>)>) -> Check {
    let name = "egress";
    let Some((path, loaded)) = config else {
        return Check::pass(name, "no poold config: sandboxes reach the public internet only (private, link-local, loopback, reserved ranges and the host are denied)");
    };
    let cfg = match loaded {
        Ok(c) => c,
        Err(e) => {
            return Check::warn(
                name,
                format!("cannot read poold's config {}: {e:#}", path.display()),
                "fix the file (poold refuses to start with it too); docs/poold.md",
            )
        }
    };
    let mut open = Vec::new();
    let mut policies = vec![("net.egress".to_string(), cfg.net.egress.clone())];
    for (tag, p) in &cfg.pools {
        if let Some(n) = &p.network {
            policies.push((format!("pools.{tag}.network"), n.clone()));
        }
    }
    for (what, p) in &policies {
        for (net, range, why) in p.opens_internal() {
            open.push(format!("{what} allows {net} ({range}: {why})"));
        }
    }
    if open.is_empty() {
        return Check::pass(
            name,
            format!(
                "{}: sandboxes reach the public internet, no internal range (domain names in allow_out are not checked)",
                path.display()
            ),
        );
    }
    Check::warn(
        name,
        format!("{}: {}", path.display(), open.join("; ")),
        "sandboxes run untrusted code: allow only the internal hosts they need (one address, not a range), per pool or per spawn; docs/network.md",
    )
}

/// Runs every local check (not poold's).
pub fn local_checks(h: &Host, mount: &MountSeen) -> Vec<Check> {
    vec![
        check_qemu(h),
        check_kvm(h),
        check_accel(h),
        check_fuse(h),
        check_cgroups(h),
        check_network(h),
        check_disk(h),
        check_memory(h),
        check_data_dir(h),
        check_fs_mount(&h.paths.mount_dir(), mount),
    ]
}

/// Renders the checks as text lines.
pub fn render(checks: &[Check]) -> String {
    let mut out = String::new();
    for c in checks {
        let v = match c.verdict {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
        };
        out.push_str(&format!("{v}  {:<12} {}\n", c.name, c.detail));
        if !c.fix.is_empty() {
            out.push_str(&format!("      {:<12} fix: {}\n", "", c.fix));
        }
    }
    let n = |v| checks.iter().filter(|c| c.verdict == v).count();
    out.push_str(&format!(
        "{} passed, {} warnings, {} failed\n",
        n(Verdict::Pass),
        n(Verdict::Warn),
        n(Verdict::Fail)
    ));
    out
}

/// `forkd doctor`: exit status 1 when any check fails.
pub async fn run(paths: &Paths, a: DoctorArgs) -> anyhow::Result<i32> {
    let h = Host::real(paths.clone());
    let probe_paths = paths.clone();
    let mount = tokio::task::spawn_blocking(move || observe_mount(&probe_paths)).await?;
    let mut checks = tokio::task::spawn_blocking({
        let h = h.clone();
        move || local_checks(&h, &mount)
    })
    .await?;
    let cfg_path = poold_config_path();
    checks.push(check_egress(
        cfg_path.as_deref().map(|p| (p, EgressConfig::read(p))),
    ));
    if !a.no_poold {
        let url = std::env::var("FORKD_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| forkd_api::DEFAULT_URL.to_string());
        let seen = tokio::time::timeout(std::time::Duration::from_secs(10), observe_poold())
            .await
            .unwrap_or_else(|_| PooldSeen::Unreachable("no answer in 10 s".into()));
        checks.push(check_poold(&url, &seen));
    }
    let failed = checks.iter().any(|c| c.verdict == Verdict::Fail);
    if a.json {
        let n = |v| checks.iter().filter(|c| c.verdict == v).count();
        let doc = serde_json::json!({
            "checks": checks,
            "pass": n(Verdict::Pass),
            "warn": n(Verdict::Warn),
            "fail": n(Verdict::Fail),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", render(&checks));
    }
    Ok(if failed { 1 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A fake host: /proc, /sys, /dev, a PATH dir and a data dir under one
    /// temp dir, populated as a healthy KVM host; tests then break one thing.
    struct Fake {
        _dir: tempfile::TempDir,
        root: PathBuf,
        h: Host,
    }

    fn write(p: &Path, text: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn tool(dir: &Path, name: &str, script: &str) {
        let p = dir.join(name);
        write(&p, &format!("#!/bin/sh\n{script}\n"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    impl Fake {
        fn healthy() -> Fake {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().to_path_buf();
            let (proc_root, sys_root, dev_root, bin) = (
                root.join("proc"),
                root.join("sys"),
                root.join("dev"),
                root.join("bin"),
            );
            write(
                &proc_root.join("cpuinfo"),
                "processor\t: 0\nflags\t\t: fpu vmx sse2\n",
            );
            write(
                &proc_root.join("filesystems"),
                "nodev\tsysfs\nnodev\tfuse\n\text4\n",
            );
            write(
                &proc_root.join("self/mounts"),
                "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n",
            );
            write(&proc_root.join("self/ns/net"), "");
            write(&proc_root.join("sys/net/ipv4/ip_forward"), "0\n");
            write(
                &proc_root.join("meminfo"),
                "MemTotal: 24000000 kB\nMemAvailable: 16000000 kB\n",
            );
            write(
                &sys_root.join("fs/cgroup/cgroup.controllers"),
                "cpuset cpu io memory pids\n",
            );
            // Plain files stand in for the device nodes: the checks open
            // and stat them, they never ioctl.
            write(&dev_root.join("kvm"), "");
            write(&dev_root.join("fuse"), "");
            write(&dev_root.join("net/tun"), "");
            tool(
                &bin,
                "qemu-system-x86_64",
                "echo 'QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-1~bpo12+1)'",
            );
            tool(&bin, "qemu-img", "exit 0");
            tool(&bin, "nft", "exit 0");
            let home = root.join("forkd");
            let paths = Paths::new(&home);
            write(&paths.vmlinuz(), "");
            write(&paths.initramfs(), "");
            std::fs::create_dir_all(paths.images_dir().join("minimal")).unwrap();
            std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
            let h = Host {
                proc_root,
                sys_root,
                dev_root,
                path: vec![bin],
                qemu: "qemu-system-x86_64".into(),
                paths,
                accel_env: String::new(),
                uid: 0,
            };
            Fake { _dir: dir, root, h }
        }
        fn bin(&self) -> PathBuf {
            self.h.path[0].clone()
        }
    }

    fn verdicts(h: &Host) -> Vec<(&'static str, Verdict)> {
        local_checks(h, &MountSeen::Live)
            .into_iter()
            .map(|c| (c.name, c.verdict))
            .collect()
    }

    #[test]
    fn a_healthy_host_passes_every_check() {
        let f = Fake::healthy();
        // Every check but `disk`, which reads the real free space under the
        // temp dir (its verdicts are tested through `disk_verdict`).
        let checks: Vec<Check> = local_checks(&f.h, &MountSeen::Live)
            .into_iter()
            .filter(|c| c.name != "disk")
            .collect();
        assert_eq!(checks.len(), 9);
        for c in &checks {
            assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
            assert!(c.fix.is_empty());
        }
        assert!(checks[0].detail.contains("QEMU 10.0.2"), "{:?}", checks[0]);
        let text = render(&checks);
        assert!(text.contains("9 passed, 0 warnings, 0 failed"), "{text}");
    }

    #[test]
    fn qemu_missing_or_old_fails_with_the_fix() {
        let f = Fake::healthy();
        tool(
            &f.bin(),
            "qemu-system-x86_64",
            "echo 'QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u18)'",
        );
        let c = check_qemu(&f.h);
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(
            c.detail.contains("7.2.19") && c.fix.contains("setup.sh"),
            "{c:?}"
        );
        std::fs::remove_file(f.bin().join("qemu-system-x86_64")).unwrap();
        let c = check_qemu(&f.h);
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.detail.contains("not found"), "{c:?}");
        let f = Fake::healthy();
        std::fs::remove_file(f.bin().join("qemu-img")).unwrap();
        let c = check_qemu(&f.h);
        assert_eq!(
            (c.verdict, c.fix.as_str()),
            (Verdict::Fail, "apt-get install qemu-utils")
        );
    }

    #[test]
    fn nested_paravirtual_kvm_is_not_usable_and_tcg_is_explained() {
        let mut f = Fake::healthy();
        std::fs::create_dir_all(f.h.sys_root.join("module/kvm_pvm")).unwrap();
        let kvm = check_kvm(&f.h);
        assert_eq!(kvm.verdict, Verdict::Warn);
        assert!(
            kvm.detail.contains("kvm_pvm") && kvm.detail.contains("cannot run"),
            "{kvm:?}"
        );
        let accel = check_accel(&f.h);
        assert_eq!(accel.verdict, Verdict::Warn);
        assert!(
            accel.detail.contains("TCG")
                && accel.detail.contains("slower")
                && accel.detail.contains("security.md"),
            "{accel:?}"
        );
        // Asking for KVM where it cannot run is a failure, not a fallback.
        f.h.accel_env = "kvm".into();
        assert_eq!(check_accel(&f.h).verdict, Verdict::Fail);
        // Choosing TCG is fine, and still says what it means.
        f.h.accel_env = "tcg".into();
        let c = check_accel(&f.h);
        assert_eq!(c.verdict, Verdict::Pass);
        assert!(c.detail.contains("software"), "{c:?}");
        f.h.accel_env = "qvm".into();
        assert_eq!(check_accel(&f.h).verdict, Verdict::Fail);
    }

    #[test]
    fn no_dev_kvm_says_why() {
        let f = Fake::healthy();
        std::fs::remove_file(f.h.dev_root.join("kvm")).unwrap();
        let c = check_kvm(&f.h);
        assert_eq!(c.verdict, Verdict::Warn);
        assert_eq!(c.fix, "modprobe kvm_intel", "{c:?}");
        write(
            &f.h.proc_root.join("cpuinfo"),
            "flags\t\t: fpu sse2 hypervisor\n",
        );
        let c = check_kvm(&f.h);
        assert!(
            c.detail.contains("no vmx/svm") && c.fix.contains("nested"),
            "{c:?}"
        );
    }

    #[test]
    fn missing_fuse_and_network_tools_fail() {
        let f = Fake::healthy();
        std::fs::remove_file(f.h.dev_root.join("fuse")).unwrap();
        std::fs::remove_file(f.bin().join("nft")).unwrap();
        std::fs::remove_file(f.h.dev_root.join("net/tun")).unwrap();
        let v = verdicts(&f.h);
        assert!(v.contains(&("fuse", Verdict::Fail)), "{v:?}");
        let n = check_network(&f.h);
        assert_eq!(n.verdict, Verdict::Fail);
        assert!(
            n.detail.contains("nft") && n.detail.contains("/dev/net/tun"),
            "{n:?}"
        );
        assert!(
            n.fix.contains("apt-get install nftables") && n.fix.contains("modprobe tun"),
            "{n:?}"
        );
    }

    #[test]
    fn cgroup_versions_and_missing_controllers() {
        let f = Fake::healthy();
        let c = check_cgroups(&f.h);
        assert!(c.detail.starts_with("cgroup v2"), "{c:?}");
        write(
            &f.h.sys_root.join("fs/cgroup/cgroup.controllers"),
            "memory io\n",
        );
        let c = check_cgroups(&f.h);
        assert_eq!(c.verdict, Verdict::Warn);
        assert!(c.detail.contains("no cpu, pids"), "{c:?}");
        // v1: the controllers' own mounts.
        std::fs::remove_file(f.h.sys_root.join("fs/cgroup/cgroup.controllers")).unwrap();
        write(
            &f.h.proc_root.join("self/mounts"),
            "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\ncgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\ncgroup /sys/fs/cgroup/pids cgroup rw,pids 0 0\n",
        );
        let c = check_cgroups(&f.h);
        assert_eq!(
            (c.verdict, c.detail.starts_with("cgroup v1")),
            (Verdict::Pass, true),
            "{c:?}"
        );
        write(&f.h.proc_root.join("self/mounts"), "");
        assert_eq!(check_cgroups(&f.h).verdict, Verdict::Warn);
    }

    #[test]
    fn disk_and_memory_floors() {
        assert_eq!(disk_verdict(Path::new("/x"), 500).verdict, Verdict::Fail);
        assert_eq!(disk_verdict(Path::new("/x"), 5000).verdict, Verdict::Warn);
        assert_eq!(disk_verdict(Path::new("/x"), 50_000).verdict, Verdict::Pass);
        let f = Fake::healthy();
        assert_eq!(check_disk(&f.h).name, "disk");
        write(&f.h.proc_root.join("meminfo"), "MemAvailable: 102400 kB\n");
        assert_eq!(check_memory(&f.h).verdict, Verdict::Fail);
        write(&f.h.proc_root.join("meminfo"), "MemAvailable: 1048576 kB\n");
        assert_eq!(check_memory(&f.h).verdict, Verdict::Warn);
        assert!(check_memory(&f.h).detail.contains("no swap"));
        write(
            &f.h.proc_root.join("meminfo"),
            "MemAvailable: 4194304 kB\nSwapTotal: 2097152 kB\n",
        );
        let c = check_memory(&f.h);
        assert_eq!(c.verdict, Verdict::Pass);
        assert_eq!(c.detail, "4096 MiB available, 2048 MiB of swap");
    }

    #[test]
    fn data_dir_permissions_and_contents() {
        let f = Fake::healthy();
        let home = f.h.paths.home.clone();
        let set = |m| std::fs::set_permissions(&home, std::fs::Permissions::from_mode(m)).unwrap();
        set(0o755);
        let c = check_data_dir(&f.h);
        assert_eq!(c.verdict, Verdict::Warn);
        assert!(c.fix.starts_with("chmod 700"), "{c:?}");
        set(0o777);
        assert_eq!(check_data_dir(&f.h).verdict, Verdict::Fail);
        set(0o700);
        std::fs::remove_dir_all(f.h.paths.images_dir()).unwrap();
        let c = check_data_dir(&f.h);
        assert!(
            c.verdict == Verdict::Warn && c.fix.contains("image build"),
            "{c:?}"
        );
        std::fs::remove_file(f.h.paths.initramfs()).unwrap();
        let c = check_data_dir(&f.h);
        assert!(
            c.verdict == Verdict::Fail && c.fix.contains("build-guest.sh"),
            "{c:?}"
        );
        let mut h = f.h.clone();
        h.paths = Paths::new(f.root.join("nowhere"));
        let c = check_data_dir(&h);
        assert!(
            c.verdict == Verdict::Warn && c.detail.contains("does not exist"),
            "{c:?}"
        );
    }

    #[test]
    fn mount_states() {
        let m = Path::new("/var/lib/forkd/mnt");
        assert_eq!(check_fs_mount(m, &MountSeen::Live).verdict, Verdict::Pass);
        assert_eq!(check_fs_mount(m, &MountSeen::Free).verdict, Verdict::Warn);
        assert_eq!(check_fs_mount(m, &MountSeen::Silent).verdict, Verdict::Warn);
        let c = check_fs_mount(m, &MountSeen::Stale { hung: false });
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(
            c.fix.contains("forkd-fs unmount --lazy /var/lib/forkd/mnt"),
            "{c:?}"
        );
        assert_eq!(
            check_fs_mount(m, &MountSeen::Foreign("tmpfs".into())).verdict,
            Verdict::Fail
        );
    }

    #[test]
    fn poold_states() {
        let u = "http://127.0.0.1:8889";
        let seen = |mount: serde_json::Value| PooldSeen::Ok {
            version: "0.1.0".into(),
            accel: "tcg".into(),
            mount,
        };
        let ok = seen(serde_json::json!({"ok": true, "recoveries": 0, "last_recovery": null}));
        assert_eq!(check_poold(u, &ok).verdict, Verdict::Pass);
        assert_eq!(
            check_poold(u, &seen(serde_json::Value::Null)).verdict,
            Verdict::Pass
        );
        let healed = seen(
            serde_json::json!({"ok": true, "recoveries": 1, "last_recovery":
            {"at_unix": 1, "cause": "dead", "took_ms": 900, "lost_sandboxes": 2, "discarded_pooled": 1}}),
        );
        let c = check_poold(u, &healed);
        assert!(
            c.verdict == Verdict::Warn && c.detail.contains("was dead (2 sandboxes lost"),
            "{c:?}"
        );
        let adopted = seen(
            serde_json::json!({"ok": true, "recoveries": 1, "last_recovery":
            {"at_unix": 1, "cause": "holder_died", "took_ms": 300, "lost_sandboxes": 0, "discarded_pooled": 0}}),
        );
        let c = check_poold(u, &adopted);
        assert!(
            c.verdict == Verdict::Warn
                && c.detail
                    .contains("new holder adopted the connection (0 sandboxes lost"),
            "{c:?}"
        );
        let down = seen(serde_json::json!({"ok": false, "error": "mounting failed: x"}));
        let c = check_poold(u, &down);
        assert!(
            c.verdict == Verdict::Fail && c.detail.contains("mounting failed: x"),
            "{c:?}"
        );
        let c = check_poold(u, &PooldSeen::Unauthorized { had_token: false });
        assert!(
            c.verdict == Verdict::Fail && c.fix.contains("FORKD_TOKEN"),
            "{c:?}"
        );
        let c = check_poold(u, &PooldSeen::Unauthorized { had_token: true });
        assert!(
            c.verdict == Verdict::Fail && c.detail.contains("not poold's token"),
            "{c:?}"
        );
        let c = check_poold(u, &PooldSeen::Untrusted("invalid peer certificate".into()));
        assert!(
            c.verdict == Verdict::Fail && c.fix.contains("FORKD_CA_CERT"),
            "{c:?}"
        );
        let c = check_poold(u, &PooldSeen::BadClient("reading FORKD_CA_CERT /x".into()));
        assert!(
            c.verdict == Verdict::Fail && c.fix.contains("FORKD_CA_CERT"),
            "{c:?}"
        );
        let c = check_poold(u, &PooldSeen::Unreachable("connection refused".into()));
        assert!(
            c.verdict == Verdict::Warn && c.fix.contains("systemctl"),
            "{c:?}"
        );
    }

    #[test]
    fn egress_warns_when_a_policy_opens_internal_ranges() {
        let p = Path::new("/etc/forkd/poold.toml");
        assert_eq!(check_egress(None).verdict, Verdict::Pass);
        let parse = EgressConfig::parse;
        let c = check_egress(Some((
            p,
            parse("[net]\negress = { allow_out = [\"93.184.215.14\"] }\n"),
        )));
        assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
        let c = check_egress(Some((
            p,
            parse(
                "[net]\negress = { allow_out = [\"10.0.0.0/8\"] }\n[pools.py]\nmin_ready = 1\nnetwork = { allow_out = [\"169.254.169.254\"] }\n",
            ),
        )));
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(
            c.detail.contains("net.egress allows 10.0.0.0/8"),
            "{}",
            c.detail
        );
        assert!(
            c.detail
                .contains("pools.py.network allows 169.254.169.254/32"),
            "{}",
            c.detail
        );
        assert!(c.fix.contains("docs/network.md"));
        // The rest of poold's config is not this check's business.
        let c = check_egress(Some((p, parse("bind = \"0.0.0.0:8889\"\n[e2b]\n"))));
        assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
        for bad in [
            "[net]\negress = { allow_out = [\"10.0.0.1/8\"] }\n",
            "[net]\negress = { allowOut = [] }\n",
            "[net\n",
        ] {
            let c = check_egress(Some((p, parse(bad))));
            assert_eq!(c.verdict, Verdict::Warn, "{bad}: {c:?}");
            assert!(c.detail.contains("cannot read"), "{}", c.detail);
        }
        let many = format!(
            "[pools.py]\nnetwork = {{ deny_out = [{}] }}\n",
            vec!["\"1.2.3.4\""; 257].join(",")
        );
        let c = check_egress(Some((p, parse(&many))));
        assert!(c.detail.contains("at most"), "{c:?}");
    }

    #[test]
    fn json_shape() {
        let c = Check::fail("fuse", "no /dev/fuse", "modprobe fuse");
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"name": "fuse", "verdict": "FAIL", "detail": "no /dev/fuse", "fix": "modprobe fuse"})
        );
    }
}
