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
        "browser",
        include_str!("../../../../rootfs-init/recipes/browser.toml"),
    ),
    (
        "desktop",
        include_str!("../../../../rootfs-init/recipes/desktop.toml"),
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
        Ok(())
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
        return Ok((name.clone(), Recipe::parse(&text, spec)?));
    }
    validate_image_name(spec)?;
    let user = user_dir.join(format!("{spec}.toml"));
    if user.exists() {
        let text = std::fs::read_to_string(&user)?;
        return Ok((
            spec.into(),
            Recipe::parse(&text, &user.display().to_string())?,
        ));
    }
    match BUILTIN.iter().find(|(n, _)| *n == spec) {
        Some((n, text)) => Ok((n.to_string(), Recipe::parse(text, n)?)),
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
        }
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
    }
}
