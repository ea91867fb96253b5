//! The VM jail: every QEMU runs as an unprivileged user of its own, in a
//! mount namespace that holds only what it needs, with no capabilities and
//! `no_new_privs`, under QEMU's own seccomp filter (`-sandbox`, see
//! [`super::qemu::SANDBOX`]). docs/security.md explains the threat model.
//!
//! Invariants:
//! - A jailed QEMU's uid is `uid_base + slot` with `slot` in
//!   `1..uid_count`, claimed host-wide by an `O_EXCL` file in
//!   [`claims_dir`] before QEMU starts and released when its VM directory
//!   goes. No two live VMs share a uid, so one compromised QEMU cannot
//!   signal, ptrace or open the files of another. Its gid is the shared
//!   jail group `gid` (which owns nothing writable).
//! - Its root is a fresh tmpfs holding read-only binds of `/usr` (with the
//!   host's `/lib*`, `/bin` symlinks), `/etc/ld.so.cache`, a few device
//!   nodes, and the paths its [`super::Launch`] names, each at its host path
//!   (so QMP paths, qcow2 backing names and migration files need no
//!   translation). Nothing else of the host is reachable: no `/proc`, no
//!   `$FORKD_HOME`, no other VM.
//! - What the jailed QEMU may write is exactly: the files poold pre-created
//!   and chowned to it (disk overlays, console log, memory and vmstate
//!   files of a snapshot being taken) and its own `sock/` directory. Every
//!   other directory it sees is root's, so it cannot plant a symlink where
//!   poold (root) later opens a file.
//! - All setup runs in the child between fork and exec using only
//!   async-signal-safe system calls on data prepared before the fork.

use anyhow::{bail, Context, Result};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Default first uid of the jail range (0x70000000), above the ranges
/// distributions, container runtimes and systemd allocate from.
pub const DEFAULT_UID_BASE: u32 = 0x7000_0000;
/// Default number of uids in the range (so at most this many VMs at once,
/// less one: slot 0 is the group).
pub const DEFAULT_UID_COUNT: u32 = 65536;

/// How VMs are jailed on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailConfig {
    /// False only when switched off (`FORKD_JAIL=off`) or not running as root.
    pub enabled: bool,
    /// First uid of the jail range; each VM gets its own uid from it.
    pub uid_base: u32,
    /// Number of uids in the range (slot 0 is the group, so one less VM at once).
    pub uid_count: u32,
    /// The group every jailed QEMU runs in; it may read the shared,
    /// read-only inputs (images, kernel) and nothing else.
    pub gid: u32,
}

impl JailConfig {
    /// From `FORKD_JAIL` (`on`/`off`, default on), `FORKD_JAIL_UID_BASE`,
    /// `FORKD_JAIL_UID_COUNT` and `FORKD_JAIL_GID` (default: the uid base).
    pub fn from_env() -> Result<JailConfig> {
        let num = |name: &str, default: u32| -> Result<u32> {
            match std::env::var(name) {
                Ok(v) if !v.is_empty() => v
                    .parse()
                    .with_context(|| format!("{name}={v:?} is not a number")),
                _ => Ok(default),
            }
        };
        let enabled = match std::env::var("FORKD_JAIL").as_deref() {
            Ok("off") | Ok("0") | Ok("false") => false,
            Ok("on") | Ok("1") | Ok("true") | Ok("") | Err(_) => true,
            Ok(v) => bail!("FORKD_JAIL={v:?}: use on or off"),
        };
        let uid_base = num("FORKD_JAIL_UID_BASE", DEFAULT_UID_BASE)?;
        let uid_count = num("FORKD_JAIL_UID_COUNT", DEFAULT_UID_COUNT)?;
        let gid = num("FORKD_JAIL_GID", uid_base)?;
        let c = JailConfig {
            enabled: enabled && nix::unistd::geteuid().is_root(),
            uid_base,
            uid_count,
            gid,
        };
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        if self.uid_base == 0 || self.gid == 0 {
            bail!("the jail uid base and gid must not be 0 (root)");
        }
        if self.uid_count < 2 {
            bail!("FORKD_JAIL_UID_COUNT must be at least 2");
        }
        if self.uid_base.checked_add(self.uid_count).is_none()
            || self.uid_base + self.uid_count > 0xFFFF_FFFE
        {
            bail!(
                "jail uid range {}+{} passes the largest uid",
                self.uid_base,
                self.uid_count
            );
        }
        Ok(())
    }

    /// The process-wide configuration, read once.
    pub fn get() -> Result<&'static JailConfig> {
        static C: std::sync::OnceLock<std::result::Result<JailConfig, String>> =
            std::sync::OnceLock::new();
        C.get_or_init(|| JailConfig::from_env().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))
    }
}

/// Where uid claims live: host-wide, so two data dirs never hand out the
/// same uid, and on tmpfs, so a reboot (which ends every VM) clears them.
pub fn claims_dir() -> PathBuf {
    PathBuf::from("/run/forkd/jail-uids")
}

/// A uid claimed for one VM. The claim file names the VM directory; it is
/// released by [`UidClaim::release`] or found stale once that directory is
/// gone or its QEMU is dead.
#[derive(Debug, Clone)]
pub struct UidClaim {
    pub uid: u32,
    file: PathBuf,
}

impl UidClaim {
    /// Claims a free uid for the VM in `vm_dir`.
    pub fn acquire(cfg: &JailConfig, vm_dir: &Path) -> Result<UidClaim> {
        Self::acquire_in(&claims_dir(), cfg, vm_dir)
    }

    fn acquire_in(dir: &Path, cfg: &JailConfig, vm_dir: &Path) -> Result<UidClaim> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        crate::private::create_dir_all(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        let slots = cfg.uid_count - 1;
        let start = rand::random::<u32>() % slots;
        for i in 0..slots {
            let uid = cfg.uid_base + 1 + (start + i) % slots;
            let file = dir.join(uid.to_string());
            for _ in 0..2 {
                match std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(crate::private::FILE_MODE)
                    .open(&file)
                {
                    Ok(mut f) => {
                        f.write_all(vm_dir.as_os_str().as_bytes())?;
                        return Ok(UidClaim { uid, file });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        if !claim_is_stale(&file) {
                            break;
                        }
                        let _ = std::fs::remove_file(&file);
                    }
                    Err(e) => {
                        return Err(e).with_context(|| format!("claiming {}", file.display()))
                    }
                }
            }
        }
        bail!(
            "all {} jail uids from {} are in use; raise FORKD_JAIL_UID_COUNT or stop some VMs",
            slots,
            cfg.uid_base + 1
        )
    }

    /// Releases the claim of `uid` if it is still the one of `vm_dir` (after
    /// a QEMU died, its uid may have been claimed again by another VM).
    pub fn release_for(uid: u32, vm_dir: &Path) {
        let file = claims_dir().join(uid.to_string());
        if std::fs::read(&file).is_ok_and(|t| t == vm_dir.as_os_str().as_bytes()) {
            let _ = std::fs::remove_file(&file);
        }
    }

    /// Frees the uid. Call only once no process runs as it.
    pub fn release(&self) {
        let _ = std::fs::remove_file(&self.file);
    }
}

/// A claim is stale when its VM directory is gone, or its record names a
/// QEMU that is dead; a directory without a record yet is given two minutes
/// (the time between claiming and starting QEMU).
fn claim_is_stale(file: &Path) -> bool {
    let Ok(target) = std::fs::read(file) else {
        return false;
    };
    let dir = super::VmDir::new(PathBuf::from(std::ffi::OsStr::from_bytes(&target)));
    if !dir.path.is_dir() {
        return true;
    }
    match dir.read_record() {
        Ok(r) => !r.qemu.is_alive(),
        Err(_) => std::fs::metadata(file)
            .and_then(|m| m.modified())
            .map(|t| t.elapsed().unwrap_or_default().as_secs() > 120)
            .unwrap_or(true),
    }
}

/// One path the jailed QEMU sees, at the same path as on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    pub path: PathBuf,
    pub writable: bool,
}

impl Bind {
    pub fn ro(path: impl Into<PathBuf>) -> Bind {
        Bind {
            path: path.into(),
            writable: false,
        }
    }
    pub fn rw(path: impl Into<PathBuf>) -> Bind {
        Bind {
            path: path.into(),
            writable: true,
        }
    }
}

/// Everything one jailed process needs, decided before the fork.
#[derive(Debug, Clone)]
pub struct JailSpec {
    pub uid: u32,
    pub gid: u32,
    /// Extra groups (the group of `/dev/kvm` under KVM).
    pub groups: Vec<u32>,
    /// The empty directory the jail's tmpfs root is mounted on (in the
    /// child's own mount namespace only).
    pub root: PathBuf,
    pub binds: Vec<Bind>,
    /// Device nodes bound in (`/dev/null`, `/dev/urandom`, ...).
    pub devices: Vec<PathBuf>,
}

/// The host paths every QEMU needs read-only: its binary's tree, the
/// dynamic linker's cache, and the merged-/usr symlinks.
fn system_entries(binary: &Path) -> (Vec<Bind>, Vec<(PathBuf, PathBuf)>) {
    let mut binds = vec![Bind::ro("/usr")];
    let mut links = Vec::new();
    for p in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
        let path = Path::new(p);
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(t) = std::fs::read_link(path) {
                    links.push((path.to_path_buf(), t));
                }
            }
            Ok(m) if m.is_dir() => binds.push(Bind::ro(path)),
            _ => {}
        }
    }
    if Path::new("/etc/ld.so.cache").exists() {
        binds.push(Bind::ro("/etc/ld.so.cache"));
    }
    if !binary.starts_with("/usr") {
        if let Some(dir) = binary.parent() {
            binds.push(Bind::ro(dir));
        }
    }
    (binds, links)
}

/// Gives the jail group read access to a shared input (an image, the
/// kernel) unless everyone may read it already. Files on read-only mounts
/// (forkd-fs) are left as they are.
pub fn grant_group_read(path: &Path, gid: u32) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let m = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    let mode = m.mode();
    let other_read = if m.is_dir() { 0o005 } else { 0o004 };
    let group_read = if m.is_dir() { 0o050 } else { 0o040 };
    if mode & other_read == other_read || (m.gid() == gid && mode & group_read == group_read) {
        return Ok(());
    }
    let r = std::os::unix::fs::chown(path, None, Some(gid)).and_then(|()| {
        std::fs::set_permissions(
            path,
            std::fs::Permissions::from_mode((mode | group_read) & 0o7777),
        )
    });
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => Ok(()),
        Err(e) => Err(e).with_context(|| {
            format!(
                "giving the VM jail group {gid} read access to {}",
                path.display()
            )
        }),
    }
}

/// Sets owner, group and mode of a path the jailed QEMU uses.
pub fn own(path: &Path, uid: u32, gid: u32, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
        .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)))
        .with_context(|| {
            format!(
                "setting owner {uid}:{gid} mode {mode:o} on {}",
                path.display()
            )
        })
}

/// The plan the child carries out: only C strings and numbers.
struct Plan {
    root: CString,
    dirs: Vec<CString>,
    files: Vec<CString>,
    links: Vec<(CString, CString)>,
    /// (source, target, writable, is_device)
    binds: Vec<(CString, CString, bool, bool)>,
    groups: Vec<libc::gid_t>,
    uid: libc::uid_t,
    gid: libc::gid_t,
    dot: CString,
    slash: CString,
    tmpfs: CString,
    tmpfs_opts: CString,
}

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .with_context(|| format!("path {} contains a NUL byte", p.display()))
}

impl Plan {
    fn new(spec: &JailSpec, binary: &Path) -> Result<Plan> {
        let (mut binds, links) = system_entries(binary);
        binds.extend(spec.binds.iter().cloned());
        let root = &spec.root;
        let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap_or(p));
        let mut dirs: Vec<PathBuf> = Vec::new();
        let mut files: Vec<PathBuf> = Vec::new();
        let add_parents = |p: &Path, dirs: &mut Vec<PathBuf>| {
            for a in p.ancestors().skip(1) {
                if a == Path::new("/") || a.as_os_str().is_empty() {
                    break;
                }
                let d = inside(a);
                if !dirs.contains(&d) {
                    dirs.push(d);
                }
            }
        };
        let mut plan_binds = Vec::new();
        for b in &binds {
            if !b.path.is_absolute() {
                bail!("jail bind {} is not absolute", b.path.display());
            }
            let meta = std::fs::metadata(&b.path)
                .with_context(|| format!("a VM needs {}, which is missing", b.path.display()))?;
            add_parents(&b.path, &mut dirs);
            let target = inside(&b.path);
            if meta.is_dir() {
                if !dirs.contains(&target) {
                    dirs.push(target.clone());
                }
            } else {
                files.push(target.clone());
            }
            plan_binds.push((cstr(&b.path)?, cstr(&target)?, b.writable, false));
        }
        for d in &spec.devices {
            add_parents(d, &mut dirs);
            let target = inside(d);
            files.push(target.clone());
            plan_binds.push((cstr(d)?, cstr(&target)?, true, true));
        }
        let mut plan_links = Vec::new();
        for (l, t) in &links {
            plan_links.push((cstr(t)?, cstr(&inside(l))?));
        }
        // Parents before children, for directories and for binds (a bind
        // inside another bind is mounted over it).
        dirs.sort_by_key(|d| d.components().count());
        plan_binds.sort_by_key(|b| b.1.as_bytes().iter().filter(|c| **c == b'/').count());
        let mut groups = vec![spec.gid];
        groups.extend(spec.groups.iter().copied().filter(|g| *g != spec.gid));
        Ok(Plan {
            root: cstr(root)?,
            dirs: dirs.iter().map(|d| cstr(d)).collect::<Result<_>>()?,
            files: files.iter().map(|f| cstr(f)).collect::<Result<_>>()?,
            links: plan_links,
            binds: plan_binds,
            groups,
            uid: spec.uid,
            gid: spec.gid,
            dot: CString::new(".").unwrap(),
            slash: CString::new("/").unwrap(),
            tmpfs: CString::new("tmpfs").unwrap(),
            tmpfs_opts: CString::new("mode=0755,size=1m").unwrap(),
        })
    }
}

fn check(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Carries out the plan in the forked child. Only async-signal-safe calls.
fn enter(p: &Plan) -> std::io::Result<()> {
    use std::ptr::null;
    // SAFETY: every call below is a plain system call on NUL-terminated
    // strings owned by `p`, which outlives the call; none allocates.
    unsafe {
        // The jail's own tree (its tmpfs root, /dev, the mount points) must
        // be traversable by the VM's uid whatever umask poold runs with
        // (077): without this the jailed QEMU cannot reach /dev/urandom.
        libc::umask(0o022);
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(
            null(),
            p.slash.as_ptr(),
            null(),
            libc::MS_REC | libc::MS_PRIVATE,
            null(),
        ))?;
        check(libc::mount(
            p.tmpfs.as_ptr(),
            p.root.as_ptr(),
            p.tmpfs.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            p.tmpfs_opts.as_ptr().cast(),
        ))?;
        for d in &p.dirs {
            if libc::mkdir(d.as_ptr(), 0o755) < 0 && *libc::__errno_location() != libc::EEXIST {
                return Err(std::io::Error::last_os_error());
            }
        }
        for f in &p.files {
            let fd = libc::open(
                f.as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                0o600,
            );
            check(fd)?;
            libc::close(fd);
        }
        for (target, link) in &p.links {
            check(libc::symlink(target.as_ptr(), link.as_ptr()))?;
        }
        for (src, dst, writable, device) in &p.binds {
            check(libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                null(),
                libc::MS_BIND,
                null(),
            ))?;
            let mut flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID;
            if !writable {
                flags |= libc::MS_RDONLY;
            }
            if !device {
                flags |= libc::MS_NODEV;
            }
            check(libc::mount(null(), dst.as_ptr(), null(), flags, null()))?;
        }
        check(libc::chdir(p.root.as_ptr()))?;
        check(libc::syscall(libc::SYS_pivot_root, p.dot.as_ptr(), p.dot.as_ptr()) as libc::c_int)?;
        check(libc::umount2(p.dot.as_ptr(), libc::MNT_DETACH))?;
        check(libc::chdir(p.slash.as_ptr()))?;
        // The root tmpfs itself becomes read-only: nothing new can appear.
        check(libc::mount(
            null(),
            p.slash.as_ptr(),
            null(),
            libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
            null(),
        ))?;
        // Empty the bounding set while still privileged (needs CAP_SETPCAP).
        for cap in 0..64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) < 0
                && *libc::__errno_location() != libc::EINVAL
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        check(libc::setgroups(p.groups.len(), p.groups.as_ptr()))?;
        check(libc::setresgid(p.gid, p.gid, p.gid))?;
        // Leaving uid 0 clears the permitted, effective and ambient sets.
        check(libc::setresuid(p.uid, p.uid, p.uid))?;
        check(libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ))?;
        // The inheritable set survives setuid; clear it too.
        let mut hdr = CapHeader {
            version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
            pid: 0,
        };
        let data = [CapData::default(); 2];
        check(libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) as libc::c_int)?;
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        libc::umask(0o077);
    }
    Ok(())
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Makes `cmd` (whose program is `binary`, an absolute path) enter the jail
/// described by `spec` between fork and exec.
pub fn apply(cmd: &mut std::process::Command, spec: &JailSpec, binary: &Path) -> Result<()> {
    use std::os::unix::process::CommandExt;
    check_root_is_mount_point()?;
    std::fs::create_dir_all(&spec.root)
        .with_context(|| format!("creating {}", spec.root.display()))?;
    let plan = Plan::new(spec, binary)?;
    // SAFETY: `enter` only makes async-signal-safe system calls on data
    // prepared above (see its doc).
    unsafe {
        cmd.pre_exec(move || enter(&plan));
    }
    Ok(())
}

/// The jail makes `/` private and pivots out of it, which the kernel
/// refuses (a bare EINVAL from the forked child) when `/` is not a mount
/// point, as inside a plain `chroot`. Says so before the fork instead.
fn check_root_is_mount_point() -> Result<()> {
    // Unreadable (no /proc): let the jail itself report what fails.
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Ok(());
    };
    if root_is_mount_point(&info) {
        return Ok(());
    }
    bail!(
        "the VM jail needs / to be a mount point, and here it is not (is forkd running inside a \
         chroot?): run it from the host's root or a container, or bind-mount the chroot \
         directory onto itself (mount --bind DIR DIR) before entering it"
    )
}

/// Whether a `/proc/self/mountinfo` lists a mount at `/` (field 5, the
/// mount point relative to the reader's root; mounts outside a chroot are
/// not listed).
fn root_is_mount_point(mountinfo: &str) -> bool {
    mountinfo.lines().any(|l| l.split(' ').nth(4) == Some("/"))
}

/// Finds `program` on PATH (or takes it as is when it has a slash), as an
/// absolute, canonical path: the jail binds its directory when it is not
/// under /usr, and the exec happens after the root changed.
pub fn resolve_binary(program: &std::ffi::OsStr) -> Result<PathBuf> {
    let p = Path::new(program);
    let found = if p.as_os_str().as_bytes().contains(&b'/') {
        Some(p.to_path_buf())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(p))
                .find(|c| c.is_file())
        })
    };
    let found = found.with_context(|| {
        format!("{program:?} not found on PATH (is QEMU >= 10 installed? run scripts/setup.sh)")
    })?;
    std::fs::canonicalize(&found).with_context(|| format!("resolving {}", found.display()))
}

/// The qcow2 backing chain of `disk`: every file QEMU opens for it, the
/// disk first. Stops at a raw file. Reads only headers.
pub fn backing_chain(disk: &Path) -> Result<Vec<PathBuf>> {
    let mut chain = vec![disk.to_path_buf()];
    let mut cur = disk.to_path_buf();
    while let Some(next) = qcow2_backing(&cur)? {
        let next = if next.is_absolute() {
            next
        } else {
            cur.parent().unwrap_or(Path::new("/")).join(next)
        };
        if chain.contains(&next) || chain.len() > 64 {
            bail!(
                "{}: the qcow2 backing chain loops or is too deep",
                disk.display()
            );
        }
        chain.push(next.clone());
        cur = next;
    }
    Ok(chain)
}

/// The backing file name in a qcow2 header, or None for a file that is not
/// qcow2 or has no backing file.
fn qcow2_backing(path: &Path) -> Result<Option<PathBuf>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = [0u8; 20];
    if f.read_exact(&mut h).is_err() || &h[0..4] != b"QFI\xfb" {
        return Ok(None);
    }
    let off = u64::from_be_bytes(h[8..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    if off == 0 || len == 0 {
        return Ok(None);
    }
    if len > 4096 {
        bail!("{}: qcow2 backing file name of {len} bytes", path.display());
    }
    let mut name = vec![0u8; len as usize];
    f.seek(SeekFrom::Start(off))?;
    f.read_exact(&mut name)
        .with_context(|| format!("reading the backing name of {}", path.display()))?;
    Ok(Some(PathBuf::from(std::ffi::OsStr::from_bytes(&name))))
}

/// Drops binds already covered by a bind of one of their ancestors, and
/// duplicates (a writable bind wins over a read-only one of the same path).
pub fn minimize(binds: Vec<Bind>) -> Vec<Bind> {
    let mut out: Vec<Bind> = Vec::new();
    for b in binds {
        if let Some(same) = out.iter_mut().find(|o| o.path == b.path) {
            same.writable |= b.writable;
            continue;
        }
        out.push(b);
    }
    let all = out.clone();
    out.retain(|b| {
        !all.iter()
            .any(|o| o.path != b.path && b.path.starts_with(&o.path) && (o.writable || !b.writable))
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> JailConfig {
        JailConfig {
            enabled: true,
            uid_base: 1_000_000,
            uid_count: 4,
            gid: 1_000_000,
        }
    }

    #[test]
    fn claims_are_unique_and_stale_ones_are_reused() {
        let t = tempfile::tempdir().unwrap();
        let claims = t.path().join("claims");
        let vms: Vec<PathBuf> = (0..4).map(|i| t.path().join(format!("vm{i}"))).collect();
        for v in &vms {
            std::fs::create_dir_all(v).unwrap();
        }
        let a = UidClaim::acquire_in(&claims, &cfg(), &vms[0]).unwrap();
        let b = UidClaim::acquire_in(&claims, &cfg(), &vms[1]).unwrap();
        let c = UidClaim::acquire_in(&claims, &cfg(), &vms[2]).unwrap();
        let mut uids = vec![a.uid, b.uid, c.uid];
        uids.sort();
        assert_eq!(uids, vec![1_000_001, 1_000_002, 1_000_003]);
        // Full while each claim's VM dir exists (and has no record yet).
        let e = UidClaim::acquire_in(&claims, &cfg(), &vms[3]).unwrap_err();
        assert!(format!("{e}").contains("FORKD_JAIL_UID_COUNT"), "{e}");
        // A claim whose VM dir is gone is stale and taken over.
        std::fs::remove_dir_all(&vms[1]).unwrap();
        let d = UidClaim::acquire_in(&claims, &cfg(), &vms[3]).unwrap();
        assert_eq!(d.uid, b.uid);
        a.release();
        let e2 = UidClaim::acquire_in(&claims, &cfg(), &vms[0]).unwrap();
        assert_eq!(e2.uid, a.uid);
    }

    #[test]
    fn config_refuses_root_and_overflow() {
        let mut c = cfg();
        c.uid_base = 0;
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.uid_base = u32::MAX - 10;
        c.uid_count = 20;
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.uid_count = 1;
        assert!(c.validate().is_err());
        assert!(cfg().validate().is_ok());
    }

    #[test]
    fn root_mount_point_is_found_in_mountinfo() {
        let host = "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
                    23 22 0:5 / /proc rw - proc proc rw\n";
        assert!(root_is_mount_point(host));
        // A plain chroot sees only the mounts under its root, none at /.
        let chroot = "40 22 0:5 / /proc rw - proc proc rw\n\
                      41 22 0:6 / /dev rw - devtmpfs udev rw\n";
        assert!(!root_is_mount_point(chroot));
        assert!(!root_is_mount_point(""));
    }

    #[test]
    fn minimize_drops_covered_binds() {
        let m = minimize(vec![
            Bind::ro("/a/b/c"),
            Bind::rw("/a/b"),
            Bind::ro("/x"),
            Bind::rw("/x/y"),
            Bind::ro("/x"),
        ]);
        assert_eq!(m, vec![Bind::rw("/a/b"), Bind::ro("/x"), Bind::rw("/x/y")]);
    }

    #[test]
    fn backing_chain_follows_qcow2_headers() {
        let t = tempfile::tempdir().unwrap();
        let base = t.path().join("base.raw");
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let ovl = t.path().join("o1.qcow2");
        let ovl2 = t.path().join("o2.qcow2");
        let img = |args: &[&std::ffi::OsStr]| {
            let ok = std::process::Command::new("qemu-img")
                .args(args)
                .status()
                .unwrap()
                .success();
            assert!(ok);
        };
        img(&[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-F".as_ref(),
            "raw".as_ref(),
            "-b".as_ref(),
            base.as_os_str(),
            ovl.as_os_str(),
        ]);
        img(&[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-F".as_ref(),
            "qcow2".as_ref(),
            "-b".as_ref(),
            ovl.as_os_str(),
            ovl2.as_os_str(),
        ]);
        assert_eq!(backing_chain(&ovl2).unwrap(), vec![ovl2, ovl, base]);
    }
}
