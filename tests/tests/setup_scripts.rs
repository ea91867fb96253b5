//! scripts/lib.sh's host detection (cargo without `~/.cargo/bin` on PATH,
//! rustup in another user's home, Rust from apt, no sudo), run against the
//! fake hosts `tests/scripts/setup-detect.sh` builds. Installs nothing.

use std::path::Path;
use std::process::Command;

#[test]
fn setup_detection_recovers_on_newcomer_hosts() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-detect.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .expect("running bash");
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "setup-detect.sh failed:\n{text}");
    assert!(text.contains("all setup detection checks passed"));
}
