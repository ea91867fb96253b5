//! Host folders in guests (docs/volumes.md): each volume is a
//! `vhost-user-fs-device` ([`crate::Device::Volume`]) served by one
//! virtiofsd per VM and volume.
//!
//! Invariants:
//! - A volume's host path is absolute and canonical (symlinks and `..`
//!   resolved by whoever accepted it; poold also confines it to its
//!   `volume_roots`), and a directory. Its guest path is an absolute,
//!   normalized path outside the guest's system directories, with no
//!   characters the kernel command line or `--volume` syntax would split.
//! - A read-only volume is read-only on the host side (`virtiofsd
//!   --readonly`): a guest that remounts it read-write still cannot write.
//! - virtiofsd runs as root (it must act for the guest's users) in its own
//!   namespace sandbox: new mount, pid and network namespaces whose root is
//!   the shared folder (`--sandbox=namespace`), its seccomp filter, and
//!   without `CAP_MKNOD`/`CAP_SETFCAP`. Guest uids and gids are squashed to
//!   the owner of the host folder, so nothing a guest writes is owned by
//!   root (no setuid-root file can be planted in a host folder).
//! - Its listening socket is made by the caller and passed as fd 3, so QEMU
//!   can connect before virtiofsd runs; virtiofsd exits when QEMU closes
//!   the connection (the VM's end), so it never outlives its QEMU.
//! - vhost-user needs guest RAM the backend can map: a VM with volumes has
//!   shared RAM (a parent's staging file, or a child's private copy on
//!   tmpfs made by [`copy_ram`]); a private copy-on-write mapping cannot be
//!   served.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

/// At most this many volumes per VM.
pub const MAX_VOLUMES: usize = 8;

/// One host folder mounted into a guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    /// The host directory (absolute, canonical).
    pub host_path: PathBuf,
    /// Where the guest mounts it (absolute).
    pub guest_path: String,
    /// The guest may only read it.
    #[serde(default)]
    pub read_only: bool,
}

/// Guest directories a volume may not cover: the guest's own system
/// (and the agent under `/run/forkd`).
const RESERVED: &[&str] = &[
    "/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys",
    "/usr", "/var",
];

impl Volume {
    /// Parses `HOST:GUEST[:ro|rw]` (forkd's `--volume`); default read-write.
    /// The host path is taken as given (see [`Volume::canonical`]).
    pub fn parse(s: &str) -> Result<Volume> {
        let parts: Vec<&str> = s.split(':').collect();
        let (host, guest, ro) = match parts.as_slice() {
            [h, g] => (*h, *g, false),
            [h, g, "ro"] => (*h, *g, true),
            [h, g, "rw"] => (*h, *g, false),
            [_, _, m] => bail!("volume {s:?}: mode {m:?} must be ro or rw"),
            _ => bail!("volume {s:?}: use HOST:GUEST[:ro|rw] (paths cannot contain ':')"),
        };
        let v = Volume {
            host_path: PathBuf::from(host),
            guest_path: guest.to_string(),
            read_only: ro,
        };
        v.check_guest_path()?;
        Ok(v)
    }

    /// The same volume with its host path resolved (symlinks, `..`) and
    /// checked to be a directory.
    pub fn canonical(&self) -> Result<Volume> {
        if !self.host_path.is_absolute() {
            bail!(
                "volume host path {:?} must be absolute",
                self.host_path.display()
            );
        }
        let real = std::fs::canonicalize(&self.host_path).with_context(|| {
            format!(
                "volume host path {}: create the directory first",
                self.host_path.display()
            )
        })?;
        if !real.is_dir() {
            bail!(
                "volume host path {} is not a directory",
                self.host_path.display()
            );
        }
        Ok(Volume {
            host_path: real,
            ..self.clone()
        })
    }

    /// Checks the guest path (see the module invariants).
    pub fn check_guest_path(&self) -> Result<()> {
        let g = &self.guest_path;
        let bad = |why: &str| anyhow::anyhow!("volume guest path {g:?} {why}");
        if !g.starts_with('/') {
            return Err(bad("must be absolute"));
        }
        if g.len() > 200 {
            return Err(bad("is longer than 200 bytes"));
        }
        if g.len() > 1 && g.ends_with('/') {
            return Err(bad("must not end in '/'"));
        }
        if g.chars()
            .any(|c| !(c.is_ascii_alphanumeric() || "/._-+@".contains(c)))
        {
            return Err(bad("may use only letters, digits and / . _ - + @"));
        }
        if Path::new(g)
            .components()
            .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
            || g.contains("//")
        {
            return Err(bad("must be normalized (no '.', '..' or '//')"));
        }
        if RESERVED.contains(&g.as_str()) || g.starts_with("/run/") || g.starts_with("/proc/") {
            return Err(bad(
                "is a guest system directory; mount somewhere like /data",
            ));
        }
        Ok(())
    }
}

/// Checks a VM's volume list: each guest path, their number, and that no
/// guest path is another's or inside another's.
pub fn check_list(vols: &[Volume]) -> Result<()> {
    if vols.len() > MAX_VOLUMES {
        bail!("{} volumes asked for; at most {MAX_VOLUMES}", vols.len());
    }
    for (i, v) in vols.iter().enumerate() {
        v.check_guest_path()?;
        for w in &vols[..i] {
            let (a, b) = (Path::new(&v.guest_path), Path::new(&w.guest_path));
            if a.starts_with(b) || b.starts_with(a) {
                bail!(
                    "volume guest paths {:?} and {:?} overlap; give each its own directory",
                    w.guest_path,
                    v.guest_path
                );
            }
        }
    }
    Ok(())
}

/// The kernel command line words that make forkd-init mount `vols`
/// (`forkd.vol=TAG:GUEST:ro|rw`, in device order).
pub fn cmdline_words(vols: &[Volume]) -> String {
    vols.iter()
        .enumerate()
        .map(|(i, v)| {
            format!(
                "forkd.vol={}:{}:{}",
                crate::qemu::volume_tag(i as u32),
                v.guest_path,
                if v.read_only { "ro" } else { "rw" }
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The virtiofsd binary: `$FORKD_VIRTIOFSD`, else `virtiofsd` on PATH,
/// else Debian's `/usr/libexec/virtiofsd`.
pub fn virtiofsd_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("FORKD_VIRTIOFSD") {
        return Ok(PathBuf::from(p));
    }
    if let Ok(p) = crate::jail::resolve_binary("virtiofsd".as_ref()) {
        return Ok(p);
    }
    let debian = Path::new("/usr/libexec/virtiofsd");
    if debian.exists() {
        return Ok(debian.to_path_buf());
    }
    bail!("volumes need virtiofsd, which is not installed (scripts/setup.sh installs it; or set FORKD_VIRTIOFSD)")
}

/// The arguments virtiofsd serves `v` with (the listening socket is fd 3).
fn virtiofsd_args(v: &Volume, owner: (u32, u32)) -> Vec<String> {
    let (uid, gid) = owner;
    let mut a = vec![
        "--fd=3".to_string(),
        format!("--shared-dir={}", v.host_path.display()),
        "--sandbox=namespace".into(),
        "--seccomp=kill".into(),
        // No device nodes, no file capabilities in a host folder.
        "--modcaps=-mknod:-setfcap".into(),
        // Always ask the host: a child's folder is not its parent's, and
        // the host may change files under a running guest.
        "--cache=never".into(),
        "--allow-mmap".into(),
        "--inode-file-handles=never".into(),
        // Snapshots carry virtiofsd's open inodes by path; an inode the
        // child's folder lacks becomes an error for that file only.
        "--migration-mode=find-paths".into(),
        "--migration-on-error=guest-error".into(),
        // Keep poold's descriptor limit (raising it may be refused).
        "--rlimit-nofile=0".into(),
        "--thread-pool-size=4".into(),
        "--log-level=warn".into(),
        format!("--translate-uid=squash-guest:0:{uid}:4294967295"),
        format!("--translate-gid=squash-guest:0:{gid}:4294967295"),
        format!("--translate-uid=host:{uid}:0:1"),
        format!("--translate-gid=host:{gid}:0:1"),
    ];
    if v.read_only {
        a.push("--readonly".into());
    }
    a
}

/// A running virtiofsd.
pub struct Backend {
    /// The process.
    pub child: std::process::Child,
}

/// Starts virtiofsd for `v` on the listening socket `listener`, logging
/// to `log`. `ephemeral`: it dies with this process too. `vm_dir` is put
/// in its environment (`FORKD_VM_DIR`) so a sweep can find it.
pub fn start_backend(
    v: &Volume,
    listener: OwnedFd,
    log: &Path,
    vm_dir: &Path,
    ephemeral: bool,
) -> Result<Backend> {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    let bin = virtiofsd_binary()?;
    let m = std::fs::metadata(&v.host_path)
        .with_context(|| format!("volume host path {}", v.host_path.display()))?;
    let log = crate::private::create(log)?;
    let mut cmd = std::process::Command::new(&bin);
    // A sweep finds it by this name (and its FORKD_VM_DIR).
    cmd.arg0("virtiofsd");
    cmd.args(virtiofsd_args(v, (m.uid(), m.gid())))
        .env_clear()
        .env("FORKD_VM_DIR", vm_dir)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let fd = listener.as_raw_fd();
    // SAFETY: dup2, setsid and prctl are async-signal-safe; `listener`
    // stays open in this process until spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            if ephemeral && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    drop(listener);
    Ok(Backend { child })
}

/// Makes the listening socket a volume device's QEMU connects to, owned
/// by the VM's uid (a jailed QEMU needs write access to connect).
pub fn listen(path: &Path, owner: Option<(u32, u32)>) -> Result<OwnedFd> {
    crate::check_socket_path(path)?;
    let _ = std::fs::remove_file(path);
    let l = std::os::unix::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    if let Some((uid, gid)) = owner {
        crate::jail::own(path, uid, gid, 0o600)?;
    }
    Ok(OwnedFd::from(l))
}

/// Copies a snapshot's `memory.bin` into `dst` (a new file on tmpfs)
/// for a child that needs shared RAM, skipping zero pages so the copy
/// holds only what the parent had written. Returns the bytes written.
pub fn copy_ram(src: &Path, dst: &Path, size: u64) -> Result<u64> {
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    const PAGE: usize = 4096;
    let mut from =
        std::fs::File::open(src).with_context(|| format!("opening {}", src.display()))?;
    let to = crate::private::create(dst)?;
    to.set_len(size)
        .with_context(|| format!("sizing {}", dst.display()))?;
    let mut buf = vec![0u8; 2 << 20];
    let (mut off, mut written) = (0u64, 0u64);
    while off < size {
        let want = buf.len().min((size - off) as usize);
        from.read_exact(&mut buf[..want])
            .with_context(|| format!("reading {} at {off}", src.display()))?;
        let mut i = 0;
        while i < want {
            // A run of non-zero pages is written at once.
            let start = i;
            while i < want && buf[i..(i + PAGE).min(want)].iter().any(|b| *b != 0) {
                i += PAGE;
            }
            let end = i.min(want);
            if end > start {
                to.write_all_at(&buf[start..end], off + start as u64)
                    .with_context(|| format!("writing {}", dst.display()))?;
                written += (end - start) as u64;
            }
            i += PAGE;
        }
        off += want as u64;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_check() {
        let v = Volume::parse("/srv/in:/data:ro").unwrap();
        assert_eq!(v.guest_path, "/data");
        assert!(v.read_only);
        assert!(!Volume::parse("/srv/out:/out").unwrap().read_only);
        assert!(!Volume::parse("/srv/out:/out:rw").unwrap().read_only);
        for bad in [
            "/a:/b:rx",
            "/a",
            "/a:b",
            "/a:/",
            "/a:/etc",
            "/a:/run/forkd",
            "/a:/x/../y",
            "/a:/x y",
            "/a:/x,y",
            "/a:/x/",
        ] {
            assert!(Volume::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn list_refuses_overlaps_and_too_many() {
        let v = |g: &str| Volume::parse(&format!("/h:{g}")).unwrap();
        assert!(check_list(&[v("/a"), v("/b")]).is_ok());
        assert!(check_list(&[v("/a"), v("/a/b")]).is_err());
        assert!(check_list(&[v("/a"), v("/a")]).is_err());
        let many: Vec<_> = (0..=MAX_VOLUMES).map(|i| v(&format!("/v{i}"))).collect();
        assert!(check_list(&many).is_err());
        assert_eq!(
            cmdline_words(&[v("/a"), Volume::parse("/h:/b:ro").unwrap()]),
            "forkd.vol=forkd-vol0:/a:rw forkd.vol=forkd-vol1:/b:ro"
        );
    }

    #[test]
    fn canonical_resolves_and_requires_a_directory() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("d")).unwrap();
        std::fs::write(t.path().join("f"), b"x").unwrap();
        let v = Volume {
            host_path: t.path().join("d/../d"),
            guest_path: "/data".into(),
            read_only: false,
        };
        assert_eq!(
            v.canonical().unwrap().host_path,
            std::fs::canonicalize(t.path().join("d")).unwrap()
        );
        let f = Volume {
            host_path: t.path().join("f"),
            ..v.clone()
        };
        assert!(f.canonical().is_err());
        let rel = Volume {
            host_path: "d".into(),
            ..v
        };
        assert!(rel.canonical().is_err());
    }

    #[test]
    fn copy_ram_keeps_content_and_skips_zero_pages() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("m");
        let mut data = vec![0u8; 5 << 20];
        data[4096 * 3 + 7] = 1;
        data[(3 << 20) + 1] = 2;
        let last = data.len() - 1;
        data[last] = 3;
        std::fs::write(&src, &data).unwrap();
        let dst = t.path().join("c");
        let written = copy_ram(&src, &dst, data.len() as u64).unwrap();
        assert_eq!(written, 3 * 4096);
        assert_eq!(std::fs::read(&dst).unwrap(), data);
    }
}
