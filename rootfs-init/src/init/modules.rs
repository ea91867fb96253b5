//! Loading the kernel modules packed into the initramfs, in the order listed
//! in [`ORDER_FILE`] (dependencies first: `virtio_ring` before `virtio`, then
//! `virtio_mmio`, `virtio_blk`, `virtio_console`, ...).

use anyhow::{Context, Result};
use std::ffi::CString;
use std::fs::File;

/// One module file name per line, relative to [`MODULE_DIR`].
pub const ORDER_FILE: &str = "/etc/forkd/modules.order";
/// Where the guest's kernel modules are.
pub const MODULE_DIR: &str = "/lib/modules";

/// Loads every listed module; a module already loaded or built in is fine.
pub fn load_all() -> Result<Vec<String>> {
    let list = match std::fs::read_to_string(ORDER_FILE) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(e).context(ORDER_FILE),
    };
    let mut loaded = Vec::new();
    for name in list
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let path = format!("{MODULE_DIR}/{name}");
        let f = File::open(&path).with_context(|| format!("open module {path}"))?;
        match nix::kmod::finit_module(&f, &CString::default(), nix::kmod::ModuleInitFlags::empty())
        {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => loaded.push(name.to_string()),
            Err(e) => return Err(e).with_context(|| format!("load module {path}")),
        }
    }
    Ok(loaded)
}
