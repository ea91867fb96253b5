//! Choosing the accelerator: KVM where it can run a Linux guest, TCG
//! otherwise.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AccelChoice {
    /// KVM if this host can run a Linux guest with it, TCG otherwise.
    #[default]
    Auto,
    /// KVM or fail: never fall back to TCG.
    Kvm,
    /// TCG even where KVM works (slow, but runs anywhere).
    Tcg,
}

/// What QEMU runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualization through /dev/kvm.
    Kvm,
    /// QEMU's software emulator.
    Tcg,
}

impl Accel {
    /// QEMU's `-accel` name: `kvm` or `tcg`.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

impl std::str::FromStr for AccelChoice {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "auto" | "" => Ok(AccelChoice::Auto),
            "kvm" => Ok(AccelChoice::Kvm),
            "tcg" => Ok(AccelChoice::Tcg),
            _ => anyhow::bail!("unknown accelerator {s:?}: use auto, kvm or tcg"),
        }
    }
}

impl AccelChoice {
    /// From `FORKD_ACCEL`, default auto.
    pub fn from_env() -> anyhow::Result<AccelChoice> {
        std::env::var("FORKD_ACCEL").unwrap_or_default().parse()
    }

    /// Resolves `auto`; an explicit `kvm` fails with the reason when KVM is
    /// unusable.
    pub fn resolve(self) -> anyhow::Result<Accel> {
        match self {
            AccelChoice::Tcg => Ok(Accel::Tcg),
            AccelChoice::Kvm => kvm_usable().map(|()| Accel::Kvm),
            AccelChoice::Auto => Ok(if kvm_usable().is_ok() {
                Accel::Kvm
            } else {
                Accel::Tcg
            }),
        }
    }
}

/// KVM is usable when /dev/kvm opens read-write and is not the nested
/// paravirtual KVM (kvm_pvm), which cannot run an unmodified Linux guest.
pub fn kvm_usable() -> anyhow::Result<()> {
    kvm_usable_in(Path::new("/sys"), Path::new("/dev"))
}

/// [`kvm_usable`] against other sysfs and /dev roots (`forkd doctor`'s
/// tests point it at fake trees).
pub fn kvm_usable_in(sys: &Path, dev: &Path) -> anyhow::Result<()> {
    if sys.join("module/kvm_pvm").exists() {
        anyhow::bail!("/dev/kvm is kvm_pvm (nested paravirtual KVM), which cannot run an unmodified Linux guest; use --accel tcg");
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev.join("kvm"))
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!("/dev/kvm: {e}; KVM is unavailable, use --accel tcg"))
}
