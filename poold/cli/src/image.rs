//! `forkd image build|ls|rm`.

use anyhow::Result;
use clap::Subcommand;
use forkd_snapshot::images::{build, recipe, Image};
use forkd_snapshot::Paths;

#[derive(Subcommand, Debug)]
pub enum ImageCmd {
    /// Build (or rebuild) an image from a recipe.
    Build {
        /// A recipe name (built-in or $FORKD_HOME/recipes/NAME.toml) or a path to a .toml file.
        #[arg(long)]
        recipe: String,
        /// Image name (default: the recipe's name).
        #[arg(long)]
        name: Option<String>,
        /// Skip the build when the image exists and was built from this exact recipe.
        #[arg(long)]
        if_changed: bool,
    },
    /// List built images and the available recipes.
    Ls,
    /// Remove a built image.
    Rm { name: String },
}

pub async fn run(paths: &Paths, cmd: ImageCmd) -> Result<()> {
    match cmd {
        ImageCmd::Build {
            recipe: spec,
            name,
            if_changed,
        } => {
            let (rname, r) = recipe::find(&spec, &paths.recipes_dir())?;
            let name = name.unwrap_or(rname);
            recipe::validate_image_name(&name)?;
            if if_changed {
                if let Ok(img) = Image::load(&paths.images_dir(), &name) {
                    if img.info.recipe == r {
                        println!("image {name} is up to date");
                        return Ok(());
                    }
                }
            }
            let dirs = build::BuildDirs {
                images: paths.images_dir(),
                staging: paths.staging_dir(),
                cache: paths.home.join("cache/debootstrap"),
            };
            let img = tokio::task::spawn_blocking(move || {
                build::build(&name, &r, &dirs, &|s| eprintln!("==> {s}"))
            })
            .await??;
            println!(
                "built image {} ({} MiB, {:.1} MiB of files) in {:.1}s: {}",
                img.info.name,
                img.info.size_bytes >> 20,
                img.info.content_bytes as f64 / (1 << 20) as f64,
                img.info.build_secs,
                img.rootfs().display()
            );
            Ok(())
        }
        ImageCmd::Ls => {
            let imgs = Image::list(&paths.images_dir());
            println!("{:<20} {:>9} {:>10}  DESCRIPTION", "IMAGE", "SIZE", "FILES");
            for i in &imgs {
                println!(
                    "{:<20} {:>8}M {:>9.1}M  {}",
                    i.info.name,
                    i.info.size_bytes >> 20,
                    i.info.content_bytes as f64 / (1 << 20) as f64,
                    i.info.recipe.description
                );
            }
            let built: Vec<&str> = imgs.iter().map(|i| i.info.name.as_str()).collect();
            let unbuilt: Vec<&str> = recipe::BUILTIN
                .iter()
                .map(|(n, _)| *n)
                .filter(|n| !built.contains(n))
                .collect();
            if !unbuilt.is_empty() {
                println!(
                    "\nnot built yet: {} (forkd image build --recipe NAME)",
                    unbuilt.join(", ")
                );
            }
            Ok(())
        }
        ImageCmd::Rm { name } => {
            let img = Image::load(&paths.images_dir(), &name)?;
            std::fs::remove_dir_all(&img.dir)?;
            println!("removed image {name}");
            Ok(())
        }
    }
}
