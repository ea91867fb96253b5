//! Builds the guest's native helpers: `openssl_reseed.node`, the Node addon
//! evald.js uses to reseed OpenSSL in a forked child (native/openssl_reseed.c
//! says why it links against nothing).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "native/openssl_reseed.c";
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("openssl_reseed.node");
    let compiler = cc::Build::new().get_compiler();
    let mut cmd: Command = compiler.to_command();
    cmd.args([
        "-shared",
        "-fPIC",
        "-nostdlib",
        "-fno-stack-protector",
        "-fvisibility=hidden",
        "-O2",
        "-Wall",
        "-Werror",
        "-o",
    ])
    .arg(&out)
    .arg(src);
    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "running the C compiler {:?} for {src}: {e}; install a C compiler (Debian: apt install gcc)",
            compiler.path()
        )
    });
    assert!(status.success(), "compiling {src} failed: {status}");
}
