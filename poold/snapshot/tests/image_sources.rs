//! Image builds from hostile sources: real tarballs and directories, a real
//! victim directory next to them, the real `images::build::build` (with
//! mkfs.ext4). A hostile source fails the build with an error naming the
//! bad entry, leaves the victim untouched and leaves no image and no
//! staging behind; symlinks are kept as symlinks.

use forkd_snapshot::images::build::{build, BuildDirs};
use forkd_snapshot::images::recipe::{Recipe, RootSource};
use std::path::{Path, PathBuf};

struct Setup {
    t: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::create_dir_all(&victim).unwrap();
        std::fs::write(victim.join("passwd"), "precious\n").unwrap();
        std::fs::write(victim.join("shadow"), "secret\n").unwrap();
        Setup { t }
    }
    fn p(&self, rel: &str) -> PathBuf {
        self.t.path().join(rel)
    }
    fn victim(&self) -> PathBuf {
        self.p("victim")
    }
    fn dirs(&self) -> BuildDirs {
        BuildDirs {
            images: self.p("images"),
            staging: self.p("staging"),
            cache: self.p("cache"),
        }
    }
    fn build(&self, root: RootSource) -> anyhow::Result<forkd_snapshot::images::Image> {
        self.build_with_user(root, None)
    }
    fn build_with_user(
        &self,
        root: RootSource,
        user: Option<forkd_snapshot::images::recipe::UserSpec>,
    ) -> anyhow::Result<forkd_snapshot::images::Image> {
        let recipe = Recipe {
            description: String::new(),
            root,
            disk: Default::default(),
            agent: Default::default(),
            files: Default::default(),
            include: Default::default(),
            user,
        };
        build("hostile", &recipe, &self.dirs(), &|_| {})
    }
    /// The victim holds exactly what it held.
    fn assert_victim_untouched(&self) {
        let mut names: Vec<String> = std::fs::read_dir(self.victim())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["passwd", "shadow"], "files appeared in the victim");
        assert_eq!(
            std::fs::read_to_string(self.victim().join("passwd")).unwrap(),
            "precious\n"
        );
        assert_eq!(
            std::fs::read_to_string(self.victim().join("shadow")).unwrap(),
            "secret\n"
        );
    }
    /// No image and no staging left by a failed build.
    fn assert_nothing_left(&self) {
        assert!(
            !self.p("images/hostile").exists(),
            "a half-built image was installed"
        );
        let staged: Vec<_> = std::fs::read_dir(self.p("staging"))
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(staged.is_empty(), "staging left behind: {staged:?}");
    }
}

/// One tar entry, written with raw header names (so `..` and absolute
/// names, which the tar crate's builder refuses, can be made).
enum E<'a> {
    Dir(&'a str),
    File(&'a str, &'a [u8]),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
}

fn write_tar(path: &Path, entries: &[E<'_>]) {
    let mut b = tar::Builder::new(std::fs::File::create(path).unwrap());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        let (name, data): (&str, &[u8]) = match e {
            E::Dir(n) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                (n, b"")
            }
            E::File(n, d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                (n, d)
            }
            E::Symlink(n, t) | E::Hardlink(n, t) => {
                h.set_entry_type(if matches!(e, E::Symlink(..)) {
                    tar::EntryType::Symlink
                } else {
                    tar::EntryType::Link
                });
                h.set_mode(0o777);
                let ln = &mut h.as_gnu_mut().unwrap().linkname;
                ln[..t.len()].copy_from_slice(t.as_bytes());
                (n, b"")
            }
        };
        let nm = &mut h.as_gnu_mut().unwrap().name;
        nm[..name.len()].copy_from_slice(name.as_bytes());
        h.set_size(data.len() as u64);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1);
        h.set_cksum();
        b.append(&h, data).unwrap();
    }
    b.finish().unwrap();
}

fn base_entries() -> Vec<E<'static>> {
    vec![
        E::Dir("bin/"),
        E::File("bin/hello", b"#!/bin/sh\necho hi\n"),
    ]
}

#[test]
fn tar_symlink_out_of_the_root_is_refused_and_names_the_entry() {
    let s = Setup::new();
    let tar = s.p("evil.tar");
    let victim = s.victim().display().to_string();
    let mut entries = base_entries();
    entries.push(E::Symlink("etc", &victim));
    entries.push(E::File("etc/passwd", b"root::0:0::/:/bin/sh\n"));
    write_tar(&tar, &entries);
    let e = format!("{:#}", s.build(RootSource::Tar { path: tar }).unwrap_err());
    assert!(e.contains("\"etc/passwd\""), "error names the entry: {e}");
    assert!(e.contains("outside the image root"), "{e}");
    s.assert_victim_untouched();
    s.assert_nothing_left();
}

#[test]
fn tar_hostile_names_and_hard_links_are_refused() {
    let victim = "VICTIM";
    let cases: Vec<(Vec<E<'static>>, &str, &str)> = vec![
        (vec![E::File("../escape", b"x")], "\"../escape\"", "'..'"),
        (
            vec![E::File("a/../../escape", b"x")],
            "a/../../escape",
            "'..'",
        ),
        (vec![E::File("/abs", b"x")], "\"/abs\"", "absolute"),
        (
            vec![E::Hardlink("bin/pw", "VICTIM/passwd")],
            "\"bin/pw\"",
            "hard link",
        ),
        (
            vec![E::Hardlink("bin/pw", "../victim/passwd")],
            "\"bin/pw\"",
            "hard link",
        ),
        (
            vec![
                E::Symlink("lnk", "VICTIM"),
                E::Hardlink("bin/pw", "lnk/passwd"),
            ],
            "\"bin/pw\"",
            "outside the image root",
        ),
    ];
    for (extra, names, why) in cases {
        let s = Setup::new();
        let tar = s.p("evil.tar");
        let v = s.victim().display().to_string();
        // The victim's absolute path, put into the entries.
        let fix =
            |t: &'static str| -> &'static str { Box::leak(t.replace(victim, &v).into_boxed_str()) };
        let mut entries = base_entries();
        for e in extra {
            entries.push(match e {
                E::Hardlink(n, t) => E::Hardlink(n, fix(t)),
                E::Symlink(n, t) => E::Symlink(n, fix(t)),
                other => other,
            });
        }
        write_tar(&tar, &entries);
        let e = format!("{:#}", s.build(RootSource::Tar { path: tar }).unwrap_err());
        assert!(e.contains(names) && e.contains(why), "{names}: {e}");
        s.assert_victim_untouched();
        s.assert_nothing_left();
        assert!(!s.t.path().join("escape").exists());
        assert!(!Path::new("/abs").exists());
    }
}

#[test]
fn a_good_tarball_keeps_symlinks_as_symlinks_and_builds() {
    let s = Setup::new();
    let tar = s.p("good.tar");
    let victim = s.victim().display().to_string();
    let mut entries = base_entries();
    // Absolute symlinks are legal: inside the guest they resolve there.
    entries.push(E::Dir("etc/"));
    entries.push(E::Symlink("etc/mtab", "/proc/self/mounts"));
    entries.push(E::Symlink("etc/hostname", &victim));
    entries.push(E::Hardlink("bin/hello2", "bin/hello"));
    write_tar(&tar, &entries);
    // Compressed the usual way, to cover the decoder too.
    let gz = s.p("good.tar.gz");
    let ok = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("gzip -c {} > {}", tar.display(), gz.display()))
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let img = s.build(RootSource::Tar { path: gz }).unwrap();
    assert!(img.rootfs().exists());
    s.assert_victim_untouched();
    s.assert_nothing_left_but_the_image();
}

#[test]
fn dir_source_with_symlinks_never_writes_through_them() {
    // `etc` a symlink to the victim: forkd's own files (etc/hostname, ...)
    // must not land there; the build is refused, naming etc.
    let s = Setup::new();
    let src = s.p("src");
    std::fs::create_dir_all(src.join("bin")).unwrap();
    std::os::unix::fs::symlink(s.victim(), src.join("etc")).unwrap();
    let e = format!(
        "{:#}",
        s.build(RootSource::Dir { path: src.clone() }).unwrap_err()
    );
    assert!(e.contains("etc is a symlink"), "{e}");
    s.assert_victim_untouched();
    s.assert_nothing_left();

    // A real etc whose files are symlinks to the victim: they are copied
    // as symlinks, and forkd's files replace them rather than write
    // through them.
    std::fs::remove_file(src.join("etc")).unwrap();
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::os::unix::fs::symlink(s.victim().join("passwd"), src.join("etc/hostname")).unwrap();
    std::os::unix::fs::symlink(s.victim().join("shadow"), src.join("etc/shadow")).unwrap();
    std::os::unix::fs::symlink(s.victim(), src.join("victimdir")).unwrap();
    let img = s.build(RootSource::Dir { path: src }).unwrap();
    assert!(img.rootfs().exists());
    s.assert_victim_untouched();
    // What went into the image: dump it with debugfs (e2fsprogs).
    let ls = |p: &str| {
        let out = std::process::Command::new("debugfs")
            .args(["-R", &format!("stat {p}")])
            .arg(img.rootfs())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        ls("/etc/shadow").contains("Type: symlink"),
        "{}",
        ls("/etc/shadow")
    );
    assert!(ls("/victimdir").contains("Type: symlink"));
    assert!(ls("/etc/hostname").contains("Type: regular"));
}

impl Setup {
    fn assert_nothing_left_but_the_image(&self) {
        let staged: Vec<_> = std::fs::read_dir(self.p("staging"))
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(staged.is_empty(), "staging left behind: {staged:?}");
    }
}

/// A `[user]` never reads or writes through a symlinked account file: a
/// source whose `etc/group` (or `etc/shadow`) leads to the victim fails the
/// build, and the victim's files stay as they were.
#[test]
fn a_user_is_never_added_through_a_symlinked_account_file() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: building an image with a [user] needs root (chown)");
        return;
    }
    for file in ["group", "shadow"] {
        let s = Setup::new();
        let tar = s.p("evil.tar");
        let target = s.victim().join(file).display().to_string();
        let mut entries = base_entries();
        entries.push(E::Dir("etc/"));
        entries.push(E::File("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"));
        let link = if file == "group" {
            "etc/group"
        } else {
            "etc/shadow"
        };
        entries.push(E::Symlink(link, &target));
        write_tar(&tar, &entries);
        let user = toml::from_str("sudo = false").unwrap();
        let e = s
            .build_with_user(RootSource::Tar { path: tar }, Some(user))
            .unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains(&format!("etc/{file} is a symlink")), "{msg}");
        s.assert_victim_untouched();
        s.assert_nothing_left();
    }
}
