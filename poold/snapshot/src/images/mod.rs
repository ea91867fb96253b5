//! Guest images: ext4 root filesystems built from recipes, stored as
//! `$FORKD_HOME/images/<name>/{rootfs.ext4,image.json}`.

pub mod apt;
pub mod build;
pub mod recipe;
pub mod rootfs;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Why an image cannot be used (typed so the daemon answers 400 without
/// reading the message; see `daemon::error`).
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// No `image.json` for this name.
    #[error("image {name:?} is not built ({}: {error}); build it with `forkd image build --recipe {name}`", meta.display())]
    NotBuilt {
        /// The image name asked for.
        name: String,
        /// Its `image.json`.
        meta: PathBuf,
        /// Why reading it failed (part of the message, not a source).
        error: std::io::Error,
    },
}

/// `image.json`: what was built, from what, and when.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageInfo {
    /// The image's name (`forkd image ls`); also its directory's.
    pub name: String,
    /// The recipe it was built from.
    pub recipe: recipe::Recipe,
    /// Size of `rootfs.ext4`, bytes.
    pub size_bytes: u64,
    /// Bytes of the files put in it (what `du` says of the root).
    pub content_bytes: u64,
    /// When it was built, seconds since the Unix epoch.
    pub built_at_unix: u64,
    /// How long the build took, seconds.
    pub build_secs: f64,
}

/// A built image on disk.
#[derive(Debug, Clone)]
pub struct Image {
    /// Its `image.json`.
    pub info: ImageInfo,
    /// Its directory, `images/<name>/`.
    pub dir: PathBuf,
}

impl Image {
    /// The image's root filesystem, raw ext4.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs.ext4")
    }

    /// Loads image `name` from `images_dir`, with a hint when it is missing.
    pub fn load(images_dir: &Path, name: &str) -> Result<Image> {
        recipe::validate_image_name(name)?;
        let dir = images_dir.join(name);
        let meta = dir.join("image.json");
        let text = std::fs::read(&meta).map_err(|error| ImageError::NotBuilt {
            name: name.to_string(),
            meta: meta.clone(),
            error,
        })?;
        let info: ImageInfo =
            serde_json::from_slice(&text).with_context(|| format!("parsing {}", meta.display()))?;
        let img = Image { info, dir };
        if !img.rootfs().exists() {
            anyhow::bail!(
                "image {name:?} is incomplete: {} is missing; rebuild it",
                img.rootfs().display()
            );
        }
        Ok(img)
    }

    /// Every built image, by name.
    pub fn list(images_dir: &Path) -> Vec<Image> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(images_dir) {
            for e in rd.flatten() {
                if let Some(name) = e.file_name().to_str() {
                    if let Ok(img) = Image::load(images_dir, name) {
                        out.push(img);
                    }
                }
            }
        }
        out.sort_by(|a, b| a.info.name.cmp(&b.info.name));
        out
    }
}
