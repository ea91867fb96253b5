//! Image recipes: how to make a guest root filesystem. Built-in recipes live
//! in `rootfs-init/recipes/` (compiled in); users add their own as
//! `$FORKD_HOME/recipes/<name>.toml` or pass a path.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Recipes shipped with forkd.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "minimal",
        include_str!("../../../../rootfs-init/recipes/minimal.toml"),
    ),
    (
        "python-numpy",
        include_str!("../../../../rootfs-init/recipes/python-numpy.toml"),
    ),
    (
        "nodejs",
        include_str!("../../../../rootfs-init/recipes/nodejs.toml"),
    ),
    (
        "postgres-fixture",
        include_str!("../../../../rootfs-init/recipes/postgres-fixture.toml"),
    ),
    (
        "coding-agent",
        include_str!("../../../../rootfs-init/recipes/coding-agent.toml"),
    ),
    (
        "jupyter-kernel",
        include_str!("../../../../rootfs-init/recipes/jupyter-kernel.toml"),
    ),
    (
        "code-interpreter",
        include_str!("../../../../rootfs-init/recipes/code-interpreter.toml"),
    ),
    (
        "e2b-base",
        include_str!("../../../../rootfs-init/recipes/e2b-base.toml"),
    ),
    (
        "browser",
        include_str!("../../../../rootfs-init/recipes/browser.toml"),
    ),
    (
        "desktop",
        include_str!("../../../../rootfs-init/recipes/desktop.toml"),
    ),
];

/// Files the built-in recipes `[include]`, by their path relative to
/// `rootfs-init/recipes/` (compiled in, like the recipes).
pub const BUILTIN_INCLUDES: &[(&str, &str)] = &[
    (
        "code-interpreter/forkd_ci.py",
        include_str!("../../../../rootfs-init/recipes/code-interpreter/forkd_ci.py"),
    ),
    (
        "code-interpreter/forkd_ci_charts.py",
        include_str!("../../../../rootfs-init/recipes/code-interpreter/forkd_ci_charts.py"),
    ),
    (
        "code-interpreter/forkd_ci_hook.py",
        include_str!("../../../../rootfs-init/recipes/code-interpreter/forkd_ci_hook.py"),
    ),
    (
        "code-interpreter/forkd_ci_repl.js",
        include_str!("../../../../rootfs-init/recipes/code-interpreter/forkd_ci_repl.js"),
    ),
];

/// An image recipe (TOML): where the root's files come from, the disk size and the agent's settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// One line shown by `forkd image ls`.
    #[serde(default)]
    pub description: String,
    /// Where the root filesystem's files come from.
    pub root: RootSource,
    /// How large the image is.
    #[serde(default)]
    pub disk: DiskSpec,
    /// Settings for forkd-agent in the image.
    #[serde(default)]
    pub agent: AgentSpec,
    /// Small files written into the image after its packages: absolute
    /// guest path → contents (a helper module, a fixture, a config file).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
    /// Files kept next to the recipe: absolute guest path → a path relative
    /// to the recipe's directory. [`find`] reads them into `files` (so a
    /// change to one is a change to the recipe for `--if-changed`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub include: BTreeMap<String, String>,
    /// An unprivileged account (E2B's sandboxes run as `user`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<UserSpec>,
}

/// `[user]`: an account added to the image, with its home (from
/// `/etc/skel`) and, with `sudo`, passwordless sudo. forkd's own API runs
/// as root unless a request names the user; E2B's front-end names it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UserSpec {
    /// Login name (default `user`, E2B's).
    #[serde(default = "default_user_name")]
    pub name: String,
    /// Its uid, and the gid of its own group (default 1000).
    #[serde(default = "default_uid")]
    pub uid: u32,
    /// Home directory (default `/home/NAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home: Option<String>,
    /// Login shell (default `/bin/bash`).
    #[serde(default = "default_shell")]
    pub shell: String,
    /// `NAME ALL=(ALL:ALL) NOPASSWD: ALL` in `/etc/sudoers.d/NAME` (needs
    /// the `sudo` package; default true).
    #[serde(default = "yes")]
    pub sudo: bool,
}

fn default_user_name() -> String {
    "user".into()
}
fn default_uid() -> u32 {
    1000
}
fn default_shell() -> String {
    "/bin/bash".into()
}
fn yes() -> bool {
    true
}

impl UserSpec {
    /// The home directory.
    pub fn home(&self) -> String {
        self.home
            .clone()
            .unwrap_or_else(|| format!("/home/{}", self.name))
    }

    fn validate(&self) -> Result<()> {
        let n = &self.name;
        let first_ok = n
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        if n.len() > 32
            || !first_ok
            || !n
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        {
            bail!(
                "[user] name {n:?}: 1-32 of a-z, 0-9, '_' and '-', starting with a letter or '_'"
            );
        }
        if !(1..=60000).contains(&self.uid) {
            bail!("[user] uid {}: must be in 1..=60000 (0 is root)", self.uid);
        }
        guest_file_path(&self.home()).context("[user] home")?;
        guest_file_path(&self.shell).context("[user] shell")?;
        Ok(())
    }
}

/// At most this many `files` per recipe, each at most [`MAX_FILE_BYTES`].
pub const MAX_FILES: usize = 64;
/// Largest `files` entry: recipes carry helpers, not data sets.
pub const MAX_FILE_BYTES: usize = 1 << 20;

/// Where the root filesystem's files come from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum RootSource {
    /// `debootstrap --variant=VARIANT --include=PACKAGES SUITE`.
    Debootstrap {
        /// Debian suite (default `bookworm`).
        #[serde(default = "default_suite")]
        suite: String,
        /// debootstrap variant (default `minbase`).
        #[serde(default = "default_variant")]
        variant: String,
        /// Packages added with `--include`.
        #[serde(default)]
        packages: Vec<String>,
    },
    /// A static busybox and its applets.
    Busybox,
    /// A copy of a directory on the host.
    Dir {
        /// The host directory, copied with `cp -a --no-dereference`.
        path: PathBuf,
    },
    /// A tarball (optionally compressed) on the host.
    Tar {
        /// The tarball on the host (gzip, zstd, xz or bzip2, or none).
        path: PathBuf,
    },
}

fn default_suite() -> String {
    "bookworm".into()
}
fn default_variant() -> String {
    "minbase".into()
}

/// Size of the image's ext4 file system.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DiskSpec {
    /// Fixed image size; 0 sizes it to the content plus `free_mib`.
    #[serde(default)]
    pub size_mib: u64,
    /// Free space left for the guest when sizing automatically.
    #[serde(default = "default_free")]
    pub free_mib: u64,
}

impl Default for DiskSpec {
    fn default() -> Self {
        DiskSpec {
            size_mib: 0,
            free_mib: default_free(),
        }
    }
}

fn default_free() -> u64 {
    256
}

/// Settings written to `/etc/forkd/agent.env` in the image.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AgentSpec {
    /// Modules the warm interpreter imports at start.
    #[serde(default)]
    pub warmup_imports: Vec<String>,
    /// Extra `KEY=VALUE` settings for the agent.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

impl Recipe {
    /// Parses and validates a recipe; errors name `origin` (a file or built-in name).
    pub fn parse(text: &str, origin: &str) -> Result<Recipe> {
        let r: Recipe = toml::from_str(text).with_context(|| format!("recipe {origin}"))?;
        r.validate().with_context(|| format!("recipe {origin}"))?;
        Ok(r)
    }

    fn validate(&self) -> Result<()> {
        if let RootSource::Debootstrap {
            suite,
            variant,
            packages,
        } = &self.root
        {
            let word = |s: &str| {
                !s.is_empty()
                    && s.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-.+_".contains(c))
            };
            if !word(suite) || !word(variant) {
                bail!("bad suite or variant: {suite:?} / {variant:?}");
            }
            if let Some(p) = packages.iter().find(|p| !word(p) || p.starts_with('-')) {
                bail!("bad package name {p:?}");
            }
        }
        for m in &self.agent.warmup_imports {
            if m.is_empty()
                || !m
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            {
                bail!("bad warm-up module name {m:?}");
            }
        }
        if self.files.len() > MAX_FILES {
            bail!(
                "{} files; a recipe carries at most {MAX_FILES}",
                self.files.len()
            );
        }
        for (path, text) in &self.files {
            guest_file_path(path)?;
            if text.len() > MAX_FILE_BYTES {
                bail!(
                    "file {path:?} is {} bytes; at most {MAX_FILE_BYTES}",
                    text.len()
                );
            }
        }
        for (k, v) in &self.agent.env {
            if k.is_empty()
                || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                || v.contains('\n')
            {
                bail!("bad agent env entry {k:?}");
            }
        }
        for (guest, rel) in &self.include {
            guest_file_path(guest)?;
            include_path(rel)?;
        }
        if let Some(u) = &self.user {
            u.validate()?;
        }
        Ok(())
    }

    /// Reads every `[include]` into `files` with `read` (a path relative to
    /// the recipe's directory → its text), then checks the limits again.
    pub fn resolve_includes(&mut self, read: &dyn Fn(&str) -> Result<String>) -> Result<()> {
        for (guest, rel) in std::mem::take(&mut self.include) {
            if self.files.contains_key(&guest) {
                bail!("{guest:?} is both in [files] and in [include]");
            }
            let text = read(&rel).with_context(|| format!("[include] {guest:?} = {rel:?}"))?;
            self.files.insert(guest, text);
        }
        self.validate()
    }

    /// Contents of `/etc/forkd/agent.env`.
    pub fn agent_env(&self) -> String {
        let mut s = String::from("# Written by forkd image build.\n");
        if !self.agent.warmup_imports.is_empty() {
            s.push_str(&format!(
                "FORKD_WARMUP_IMPORTS={}\n",
                self.agent.warmup_imports.join(",")
            ));
        }
        for (k, v) in &self.agent.env {
            s.push_str(&format!("{k}={}\n", shell_quote(v)));
        }
        s
    }
}

/// A `files` key as a path relative to the image's root: it must be
/// absolute, with only plain components (no `.`, `..` or empty ones).
pub fn guest_file_path(path: &str) -> Result<PathBuf> {
    use std::path::Component;
    let rel = path
        .strip_prefix('/')
        .filter(|r| !r.is_empty() && path.len() <= 4096 && !path.contains('\0'))
        .ok_or_else(|| anyhow::anyhow!("file path {path:?} must be absolute (and not /)"))?;
    let p = Path::new(rel);
    if rel
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
        || !p.components().all(|c| matches!(c, Component::Normal(_)))
    {
        bail!("file path {path:?} may not contain empty, '.' or '..' components");
    }
    Ok(p.to_path_buf())
}

/// An `[include]` source: relative to the recipe's directory, plain
/// components only (it can never name a file outside that directory).
fn include_path(rel: &str) -> Result<&Path> {
    let p = Path::new(rel);
    if rel.is_empty()
        || rel.contains('\0')
        || !p
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
    {
        bail!("[include] source {rel:?} must be a relative path without '.' or '..'");
    }
    Ok(p)
}

/// Reads `[include]` sources from the directory `dir`.
fn read_from(dir: &Path) -> impl Fn(&str) -> Result<String> + '_ {
    move |rel| {
        let p = dir.join(include_path(rel)?);
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    }
}

/// Reads `[include]` sources of the built-in recipes.
fn read_builtin(rel: &str) -> Result<String> {
    BUILTIN_INCLUDES
        .iter()
        .find(|(n, _)| *n == rel)
        .map(|(_, t)| t.to_string())
        .ok_or_else(|| anyhow::anyhow!("no built-in file {rel:?} (add it to BUILTIN_INCLUDES)"))
}

fn shell_quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', "'\\''"))
}

/// Image names follow the tag rule, so they are safe as directory names.
pub fn validate_image_name(name: &str) -> Result<()> {
    forkd_layers::validate_tag(name).map_err(|_| {
        anyhow::anyhow!("invalid image name {name:?}: 1-64 chars, ASCII alnum or dash/underscore")
    })
}

/// Finds a recipe by name (user recipes first, then built-in) or by path
/// (anything containing '/' or ending in .toml). Returns (name, recipe).
pub fn find(spec: &str, user_dir: &Path) -> Result<(String, Recipe)> {
    if spec.contains('/') || spec.ends_with(".toml") {
        let p = Path::new(spec);
        let text = std::fs::read_to_string(p).with_context(|| format!("reading recipe {spec}"))?;
        let name = p
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| anyhow::anyhow!("recipe path {spec} has no file name"))?
            .to_string();
        validate_image_name(&name)?;
        let mut r = Recipe::parse(&text, spec)?;
        r.resolve_includes(&read_from(p.parent().unwrap_or(Path::new("."))))
            .with_context(|| format!("recipe {spec}"))?;
        return Ok((name.clone(), r));
    }
    validate_image_name(spec)?;
    let user = user_dir.join(format!("{spec}.toml"));
    if user.exists() {
        let text = std::fs::read_to_string(&user)?;
        let origin = user.display().to_string();
        let mut r = Recipe::parse(&text, &origin)?;
        r.resolve_includes(&read_from(user_dir))
            .with_context(|| format!("recipe {origin}"))?;
        return Ok((spec.into(), r));
    }
    match BUILTIN.iter().find(|(n, _)| *n == spec) {
        Some((n, text)) => {
            let mut r = Recipe::parse(text, n)?;
            r.resolve_includes(&read_builtin)
                .with_context(|| format!("recipe {n}"))?;
            Ok((n.to_string(), r))
        }
        None => {
            let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
            bail!(
                "no recipe named {spec:?}: built-in recipes are {}; put your own in {}/<name>.toml",
                names.join(", "),
                user_dir.display()
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_recipes_parse() {
        for (n, t) in BUILTIN {
            Recipe::parse(t, n).unwrap();
            let (_, r) = find(n, Path::new("/nonexistent")).unwrap();
            assert!(r.include.is_empty(), "{n}: includes resolved into files");
        }
        let (_, ci) = find("code-interpreter", Path::new("/nonexistent")).unwrap();
        assert!(ci.files["/usr/lib/python3/dist-packages/forkd_ci.py"].contains("/execute"));
        assert_eq!(ci.user.as_ref().unwrap().home(), "/home/user");
        let (_, r) = find("python-numpy", Path::new("/nonexistent")).unwrap();
        assert_eq!(r.agent.warmup_imports, vec!["numpy"]);
        assert!(r.agent_env().contains("FORKD_WARMUP_IMPORTS=numpy"));
    }

    /// Each recipe carries its own copy of the warm browser module (a
    /// recipe is one self-contained file a user can copy): the copies must
    /// not drift apart.
    #[test]
    fn browser_and_desktop_carry_the_same_browser_module() {
        let module = "/usr/lib/python3/dist-packages/forkd_browser.py";
        let (_, browser) = find("browser", Path::new("/nonexistent")).unwrap();
        let (_, desktop) = find("desktop", Path::new("/nonexistent")).unwrap();
        assert!(browser.files[module].contains("def forkd_reseed("));
        assert_eq!(browser.files[module], desktop.files[module]);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(Recipe::parse("[root]\nkind='debootstrap'\npackages=['-oops']", "t").is_err());
        assert!(Recipe::parse("[root]\nkind='nope'", "t").is_err());
        assert!(find("../etc", Path::new("/x")).is_err());
        assert!(find("nosuch", Path::new("/x")).is_err());
        let file = |p: &str| format!("[root]\nkind='busybox'\n[files]\n{p:?} = 'x'\n");
        assert!(Recipe::parse(&file("/etc/x.conf"), "t").is_ok());
        for bad in ["etc/x", "/", "/etc/../x", "/etc//x", "/./x", "/etc/x/"] {
            assert!(Recipe::parse(&file(bad), "t").is_err(), "{bad}");
        }
        let user = |u: &str| format!("[root]\nkind='busybox'\n[user]\n{u}\n");
        assert!(Recipe::parse(&user("name = 'user'"), "t").is_ok());
        for bad in [
            "name = 'Root'",
            "name = '../x'",
            "uid = 0",
            "home = 'rel'",
            "nope = 1",
        ] {
            assert!(Recipe::parse(&user(bad), "t").is_err(), "{bad}");
        }
    }

    /// `[include]` reads files next to the recipe, never outside it, and
    /// their content is part of the recipe (so `--if-changed` sees edits).
    #[test]
    fn includes_are_read_next_to_the_recipe() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("sub/helper.py"), "X = 1\n").unwrap();
        let recipe = d.path().join("r.toml");
        std::fs::write(
            &recipe,
            "[root]\nkind='busybox'\n[include]\n'/opt/helper.py' = 'sub/helper.py'\n",
        )
        .unwrap();
        let (_, r) = find(recipe.to_str().unwrap(), Path::new("/x")).unwrap();
        assert_eq!(r.files["/opt/helper.py"], "X = 1\n");
        for bad in ["../r.toml", "/etc/passwd", "sub/../r.toml"] {
            let t = format!("[root]\nkind='busybox'\n[include]\n'/opt/x' = {bad:?}\n");
            assert!(Recipe::parse(&t, "t").is_err(), "{bad}");
        }
        std::fs::write(
            &recipe,
            "[root]\nkind='busybox'\n[include]\n'/opt/x' = 'missing.py'\n",
        )
        .unwrap();
        let e = find(recipe.to_str().unwrap(), Path::new("/x")).unwrap_err();
        assert!(format!("{e:#}").contains("missing.py"), "{e:#}");
    }
}
