//! Building an image: populate a root directory from the recipe's source,
//! add what forkd needs, then `mkfs.ext4 -d`. Everything happens in a
//! staging directory; the finished image replaces the old one by rename, so a
//! failed build leaves the previous image untouched.
//!
//! The source is untrusted: nothing it holds (symlinks, `..`, absolute
//! names, hard links) may make a write land outside the root
//! ([`super::rootfs`] says how).

use super::recipe::{Recipe, RootSource};
use super::{Image, ImageInfo};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// Where a build reads and writes.
pub struct BuildDirs {
    /// The data dir's `images/`; the finished image is renamed in here.
    pub images: PathBuf,
    /// Scratch space for the build (removed however it ends).
    pub staging: PathBuf,
    /// Package cache shared by debootstrap runs.
    pub cache: PathBuf,
}

/// Removes the staging directory however the build ends.
struct Staging(PathBuf);
impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds image `name` from `recipe`. `step` is told what is happening.
pub fn build(name: &str, recipe: &Recipe, dirs: &BuildDirs, step: &dyn Fn(&str)) -> Result<Image> {
    super::recipe::validate_image_name(name)?;
    let started = Instant::now();
    let staging = Staging(
        dirs.staging
            .join(format!("image-{name}-{}", crate::util::random_hex(4))),
    );
    let root = staging.0.join("root");
    std::fs::create_dir_all(&root)?;
    // The guest's `/`: mkfs.ext4 -d copies this mode.
    std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    populate(&recipe.root, &root, &staging.0, &dirs.cache, step)?;
    step("adding forkd's files");
    fixups(&root, recipe)?;
    let content = du_bytes(&root)?;
    let size = image_size(recipe, content);
    step(&format!("making a {} MiB ext4 image", size >> 20));
    let out = staging.0.join("out");
    std::fs::create_dir_all(&out)?;
    mkfs(&root, &out.join("rootfs.ext4"), size)?;
    let info = ImageInfo {
        name: name.to_string(),
        recipe: recipe.clone(),
        size_bytes: size,
        content_bytes: content,
        built_at_unix: crate::util::unix_now(),
        build_secs: started.elapsed().as_secs_f64(),
    };
    std::fs::write(out.join("image.json"), serde_json::to_vec_pretty(&info)?)?;
    install(&out, &dirs.images.join(name))?;
    Image::load(&dirs.images, name)
}

fn populate(
    src: &RootSource,
    root: &Path,
    staging: &Path,
    cache: &Path,
    step: &dyn Fn(&str),
) -> Result<()> {
    match src {
        RootSource::Debootstrap {
            suite,
            variant,
            packages,
        } => {
            let mirror = super::apt::mirror_for(suite)?;
            step(&format!(
                "debootstrap {suite} ({variant}, +{}) from {mirror}",
                packages.join(",")
            ));
            std::fs::create_dir_all(cache)?;
            let mut cmd = Command::new("debootstrap");
            cmd.arg(format!("--variant={variant}"))
                .arg(format!("--cache-dir={}", cache.display()));
            if !packages.is_empty() {
                cmd.arg(format!("--include={}", packages.join(",")));
            }
            cmd.arg(suite).arg(root).arg(&mirror);
            run_logged(
                cmd,
                &staging.join("debootstrap.log"),
                "debootstrap (install it: scripts/setup.sh)",
            )
            .map_err(|e| explain_debootstrap(e, root))?;
            slim_debian(root)
        }
        RootSource::Busybox => {
            step("installing busybox");
            busybox(root)
        }
        RootSource::Dir { path } => {
            step(&format!("copying {}", path.display()));
            if !path.is_dir() {
                bail!("recipe root directory {} does not exist", path.display());
            }
            // `cp -a` copies symlinks as symlinks (-P) into a fresh root, so
            // it never writes through one; forkd's own files are added
            // afterwards without following any (`fixups`).
            let mut cmd = Command::new("cp");
            cmd.arg("-a")
                .arg("--no-dereference")
                .arg(format!("{}/.", path.display()))
                .arg(root);
            run_logged(cmd, &staging.join("cp.log"), "cp")
        }
        RootSource::Tar { path } => {
            step(&format!("unpacking {}", path.display()));
            if !path.is_file() {
                bail!("recipe tarball {} does not exist", path.display());
            }
            super::rootfs::unpack_tar(path, root)
        }
    }
}

/// The staging root (and debootstrap's own log inside it,
/// `debootstrap/debootstrap.log`) is removed when the build fails, and
/// debootstrap's output only says "see the log": so the error carries what
/// the log says went wrong.
fn explain_debootstrap(e: anyhow::Error, root: &Path) -> anyhow::Error {
    let Ok(log) = std::fs::read_to_string(root.join("debootstrap/debootstrap.log")) else {
        return e;
    };
    let missing = unresolved_dependencies(&log);
    if !missing.is_empty() {
        let list: Vec<String> = missing
            .iter()
            .map(|(pkg, dep)| format!("  {pkg} depends on {dep}"))
            .collect();
        return anyhow::anyhow!(
            "debootstrap could not configure the recipe's packages: these dependencies were \
             never installed:\n{}\ndebootstrap's resolver does not follow virtual packages \
             (Provides) or alternatives (a | b); add a real package that provides each name to \
             the recipe's `packages` (`apt-cache showpkg NAME` lists them under Reverse \
             Provides), then build again",
            list.join("\n")
        );
    }
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("dpkg: error") || l.starts_with("E: "))
        .collect();
    if errors.is_empty() {
        return e;
    }
    let shown = &errors[errors.len().saturating_sub(10)..];
    e.context(format!(
        "debootstrap/debootstrap.log in the build root reports:\n{}",
        shown.join("\n")
    ))
}

/// The (package, dependency) pairs dpkg left unconfigured because the
/// dependency is not installed at all, from a debootstrap log's
/// "dependency problems prevent configuration" blocks. (debootstrap's
/// early base phase configures with dependencies missing on purpose and
/// logs them as "configuring anyway": those are not blocks of this kind.)
fn unresolved_dependencies(log: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut in_block = false;
    let mut pending: Option<(String, String)> = None;
    for line in log.lines() {
        if line.starts_with("dpkg: dependency problems prevent configuration of ") {
            in_block = true;
            continue;
        }
        if !in_block {
            continue;
        }
        if line.trim().is_empty() || line.starts_with("dpkg:") {
            in_block = false;
            pending = None;
        } else if let Some(rest) = line.trim().strip_suffix("; however:") {
            pending = rest
                .split_once(" depends on ")
                .or_else(|| rest.split_once(" pre-depends on "))
                .map(|(p, d)| (p.to_string(), d.to_string()));
        } else if line.trim().ends_with(" is not installed.") {
            if let Some(pair) = pending.take() {
                if !out.contains(&pair) {
                    out.push(pair);
                }
            }
        }
    }
    out
}

/// Drops what a sandbox never needs from a debootstrapped tree: downloaded
/// .debs, apt lists, docs, man pages.
fn slim_debian(root: &Path) -> Result<()> {
    for d in [
        "var/cache/apt/archives",
        "var/lib/apt/lists",
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
    ] {
        // Never through a symlink: a package could make one a link to a
        // host directory.
        if !super::rootfs::exists_plain(root, Path::new(d)) {
            continue;
        }
        if let Ok(rd) = std::fs::read_dir(root.join(d)) {
            for e in rd.flatten() {
                if e.file_name() == "partial" || e.file_name() == "lock" {
                    continue;
                }
                let _ = if e.file_type().is_ok_and(|t| t.is_dir()) {
                    std::fs::remove_dir_all(e.path())
                } else {
                    std::fs::remove_file(e.path())
                };
            }
        }
    }
    Ok(())
}

/// A static busybox from the host with a symlink per applet.
fn busybox(root: &Path) -> Result<()> {
    let bb = ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(Path::new)
        .find(|p| p.exists())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "busybox not found on the host; install busybox-static (scripts/setup.sh)"
            )
        })?;
    let ldd = Command::new("ldd").arg(bb).output();
    if let Ok(o) = ldd {
        let text = String::from_utf8_lossy(&o.stdout) + String::from_utf8_lossy(&o.stderr);
        if o.status.success() && !text.contains("statically linked") {
            bail!(
                "{} is dynamically linked; install busybox-static",
                bb.display()
            );
        }
    }
    for d in ["bin", "sbin", "usr/bin", "usr/sbin"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    std::fs::copy(bb, root.join("bin/busybox"))?;
    let list = Command::new(bb)
        .arg("--list-full")
        .output()
        .context("busybox --list-full")?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let link = root.join(applet.trim_start_matches('/'));
        if link.exists() || applet.ends_with("/busybox") {
            continue;
        }
        if let Some(parent) = link.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::os::unix::fs::symlink("/bin/busybox", &link)?;
    }
    // E2B's envd runs every command as `/bin/bash -l -c CMD`; busybox has
    // no bash applet, and its ash takes those arguments, so the E2B SDK's
    // commands work on a busybox image too.
    let bash = root.join("bin/bash");
    if !bash.exists() {
        std::fs::write(&bash, "#!/bin/sh\n# busybox ash standing in for bash (forkd's busybox images)\nexec /bin/sh \"$@\"\n")?;
        std::fs::set_permissions(&bash, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    }
    Ok(())
}

/// What every forkd guest needs in its root, whatever the source. Written
/// without following symlinks ([`super::rootfs::write_file`]): a source
/// whose `etc` is a symlink is refused, a symlinked `etc/hostname` replaced.
fn fixups(root: &Path, recipe: &Recipe) -> Result<()> {
    use super::rootfs::{ensure_dir, exists_plain, write_file};
    for d in [
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "root",
        "etc/forkd",
        "var/tmp",
    ] {
        ensure_dir(root, Path::new(d))?;
    }
    let write = |rel: &str, data: &[u8]| write_file(root, Path::new(rel), data, 0o644);
    write("etc/forkd/agent.env", recipe.agent_env().as_bytes())?;
    write("etc/hostname", b"forkd\n")?;
    write("etc/hosts", b"127.0.0.1 localhost\n::1 localhost\n")?;
    if !exists_plain(root, Path::new("etc/passwd")) {
        write("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")?;
        write("etc/group", b"root:x:0:\n")?;
    }
    for (path, text) in &recipe.files {
        let rel = super::recipe::guest_file_path(path)?;
        write_file(root, &rel, text.as_bytes(), 0o644)
            .with_context(|| format!("writing the recipe's file {path}"))?;
    }
    if let Some(u) = &recipe.user {
        add_user(root, u).with_context(|| format!("adding the recipe's [user] {:?}", u.name))?;
    }
    if std::fs::symlink_metadata(root.join("etc/machine-id")).is_ok() {
        std::fs::remove_file(root.join("etc/machine-id"))?;
    }
    Ok(())
}

/// Adds `[user]` to the image's account files (never following a symlink
/// in the root): passwd, group, shadow and gshadow entries when the image
/// has those files, a home made from `/etc/skel` and owned by the user,
/// and with `sudo` a sudoers.d entry. An account of that name already in
/// the image must have the same uid; a uid or gid taken by another name
/// fails the build.
fn add_user(root: &Path, u: &super::recipe::UserSpec) -> Result<()> {
    use super::rootfs::{ensure_dir, exists_plain, write_file};
    let read = |rel: &str| -> Result<Option<String>> {
        let p = Path::new(rel);
        if std::fs::symlink_metadata(root.join(p)).is_err() {
            return Ok(None);
        }
        if !exists_plain(root, p) {
            bail!("the image's {rel} is a symlink; forkd does not follow it");
        }
        Ok(Some(std::fs::read_to_string(root.join(p))?))
    };
    let entries = |text: &str| -> Vec<(String, String)> {
        text.lines()
            .filter_map(|l| {
                let mut f = l.split(':');
                Some((f.next()?.to_string(), f.nth(1)?.to_string()))
            })
            .collect()
    };
    let (name, id) = (u.name.as_str(), u.uid.to_string());
    let home = u.home();
    let add = |rel: &str, line: String, check_id: bool, mode: u32| -> Result<()> {
        let Some(text) = read(rel)? else {
            return Ok(());
        };
        let have = entries(&text);
        if let Some((_, other)) = have.iter().find(|(n, _)| n == name) {
            if check_id && *other != id {
                bail!("the image's {rel} has {name} with id {other}, not {id}");
            }
            return Ok(());
        }
        if let Some((other, _)) = have.iter().find(|(_, i)| check_id && *i == id) {
            bail!("id {id} is {other}'s in the image's {rel}; choose another [user] uid");
        }
        let mut text = text;
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&line);
        text.push('\n');
        write_file(root, Path::new(rel), text.as_bytes(), mode)
    };
    add(
        "etc/passwd",
        format!("{name}:x:{id}:{id}::{home}:{}", u.shell),
        true,
        0o644,
    )?;
    add("etc/group", format!("{name}:x:{id}:"), true, 0o644)?;
    // No password: nobody logs in with one; root and sudo need none.
    add(
        "etc/shadow",
        format!("{name}:*:19000:0:99999:7:::"),
        false,
        0o640,
    )?;
    add("etc/gshadow", format!("{name}:!::"), false, 0o640)?;
    let home_rel = super::recipe::guest_file_path(&home)?;
    let dir = ensure_dir(root, &home_rel)?;
    std::os::unix::fs::lchown(&dir, Some(u.uid), Some(u.uid))?;
    if exists_plain(root, Path::new("etc/skel")) {
        for e in std::fs::read_dir(root.join("etc/skel"))?.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let rel = home_rel.join(e.file_name());
            write_file(root, &rel, &std::fs::read(e.path())?, 0o644)?;
            std::os::unix::fs::lchown(root.join(&rel), Some(u.uid), Some(u.uid))?;
        }
    }
    if u.sudo {
        if !exists_plain(root, Path::new("etc/sudoers.d")) {
            bail!("[user] sudo = true needs sudo in the image: add the `sudo` package");
        }
        let rule = format!("{name} ALL=(ALL:ALL) NOPASSWD: ALL\n");
        write_file(
            root,
            &Path::new("etc/sudoers.d").join(name),
            rule.as_bytes(),
            0o440,
        )?;
    }
    Ok(())
}

fn du_bytes(root: &Path) -> Result<u64> {
    let out = Command::new("du")
        .arg("-s")
        .arg("--block-size=1")
        .arg(root)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("du {}: {text}", root.display()))
}

/// Content plus ext4 overhead (~10% + 16 MiB) plus the recipe's free space,
/// rounded up to a MiB.
fn image_size(recipe: &Recipe, content: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    if recipe.disk.size_mib > 0 {
        return recipe.disk.size_mib * MIB;
    }
    let bytes = content + content / 10 + 16 * MIB + recipe.disk.free_mib * MIB;
    bytes.div_ceil(MIB) * MIB
}

fn mkfs(root: &Path, image: &Path, size: u64) -> Result<()> {
    let f = std::fs::File::create(image)?;
    f.set_len(size)?;
    drop(f);
    let mut cmd = Command::new("mkfs.ext4");
    cmd.args([
        "-q",
        "-F",
        "-L",
        "forkd-root",
        "-m",
        "0",
        "-E",
        "root_owner=0:0",
        "-d",
    ])
    .arg(root)
    .arg(image);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .context("running mkfs.ext4 (install e2fsprogs)")?;
    if !out.status.success() {
        bail!(
            "mkfs.ext4 failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Replaces `dest` with `out` using renames only.
fn install(out: &Path, dest: &Path) -> Result<()> {
    std::fs::create_dir_all(dest.parent().unwrap())?;
    let old = dest.with_extension(format!("old-{}", crate::util::random_hex(4)));
    if dest.exists() {
        std::fs::rename(dest, &old)?;
    }
    std::fs::rename(out, dest)
        .with_context(|| format!("installing image into {}", dest.display()))?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// Runs `cmd` with its output in `log`; on failure the error carries the
/// log's tail.
fn run_logged(mut cmd: Command, log: &Path, what: &str) -> Result<()> {
    let f = std::fs::File::create(log)?;
    let status = cmd
        .stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f)
        .status()
        .with_context(|| format!("running {what}"))?;
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!("{what} failed ({status}):\n{}", tail.join("\n"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_gets_its_entries_home_and_sudo_rule() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root to chown");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::create_dir_all(root.join("etc/skel")).unwrap();
        std::fs::create_dir_all(root.join("etc/sudoers.d")).unwrap();
        std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
        std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
        std::fs::write(root.join("etc/shadow"), "root:*:1:0:99999:7:::\n").unwrap();
        std::fs::write(root.join("etc/skel/.bashrc"), "# rc\n").unwrap();
        let u: super::super::recipe::UserSpec = toml::from_str("").unwrap();
        add_user(root, &u).unwrap();
        add_user(root, &u).unwrap(); // idempotent
        let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
        assert!(
            passwd.ends_with("user:x:1000:1000::/home/user:/bin/bash\n"),
            "{passwd}"
        );
        assert_eq!(passwd.lines().filter(|l| l.starts_with("user:")).count(), 1);
        let group = std::fs::read_to_string(root.join("etc/group")).unwrap();
        assert!(group.contains("user:x:1000:"), "{group}");
        assert!(std::fs::read_to_string(root.join("etc/shadow"))
            .unwrap()
            .contains("user:*:"));
        use std::os::unix::fs::MetadataExt;
        let home = std::fs::metadata(root.join("home/user")).unwrap();
        assert_eq!((home.uid(), home.gid()), (1000, 1000));
        assert_eq!(
            std::fs::metadata(root.join("home/user/.bashrc"))
                .unwrap()
                .uid(),
            1000
        );
        let sudo = root.join("etc/sudoers.d/user");
        assert_eq!(
            std::fs::read_to_string(&sudo).unwrap(),
            "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
        );
        assert_eq!(std::fs::metadata(&sudo).unwrap().mode() & 0o777, 0o440);
        // Another name holding uid 1000 is a clear error.
        let other: super::super::recipe::UserSpec = toml::from_str("name = 'other'").unwrap();
        let e = add_user(root, &other).unwrap_err();
        assert!(format!("{e:#}").contains("id 1000 is user's"), "{e:#}");
        // sudo without the sudo package says what to add.
        std::fs::remove_dir_all(root.join("etc/sudoers.d")).unwrap();
        let e = add_user(root, &u).unwrap_err();
        assert!(format!("{e:#}").contains("`sudo` package"), "{e:#}");
    }

    #[test]
    fn debootstrap_log_names_the_missing_virtual_packages() {
        let log = "\
dpkg: base-passwd: dependency problems, but configuring anyway as you requested:
 base-passwd depends on libc6 (>= 2.34); however:
  Package libc6 is not installed.
Setting up libipt2 (2.0.5-1) ...
dpkg: dependency problems prevent configuration of python3-zmq:
 python3-zmq depends on python3-cffi-backend-api-min (<= 9729); however:
  Package python3-cffi-backend-api-min is not installed.
 python3-zmq depends on python3-cffi-backend-api-max (>= 9729); however:
  Package python3-cffi-backend-api-max is not installed.

dpkg: error processing package python3-zmq (--configure):
 dependency problems - leaving unconfigured
dpkg: dependency problems prevent configuration of python3-ipykernel:
 python3-ipykernel depends on python3-zmq; however:
  Package python3-zmq is not configured yet.

dpkg: dependency problems prevent configuration of python3-zmq:
 python3-zmq depends on python3-cffi-backend-api-min (<= 9729); however:
  Package python3-cffi-backend-api-min is not installed.
";
        assert_eq!(
            unresolved_dependencies(log),
            vec![
                (
                    "python3-zmq".to_string(),
                    "python3-cffi-backend-api-min (<= 9729)".to_string()
                ),
                (
                    "python3-zmq".to_string(),
                    "python3-cffi-backend-api-max (>= 9729)".to_string()
                ),
            ]
        );
    }
}
