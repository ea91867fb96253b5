//! Deleted snapshots free their disk without anyone running `forkd store
//! gc`: poold reclaims after its deletes, `forkd snapshot rm` right away.

use forkd_e2e::block_on;
use forkd_e2e::daemon::{Home, Poold};
use std::path::Path;
use std::time::{Duration, Instant};

const MINIMAL_MIB: u64 = 128;

/// Bytes of the store's pack files.
fn pack_bytes(home: &Path) -> u64 {
    let dir = forkd_snapshot::Paths::new(home).store_dir().join("packs");
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Waits (up to a minute: GC is asynchronous) until the packs are back to
/// `baseline` bytes, or fails naming what is left.
fn wait_back_to(home: &Path, baseline: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = pack_bytes(home);
        if now <= baseline {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the store's packs still hold {now} bytes, {baseline} before"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Fails on the previous code: a deleted snapshot only released its
/// references, and its chunks stayed on disk until `forkd store gc`.
#[test]
fn deleted_snapshots_free_their_disk_by_themselves() {
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let baseline = pack_bytes(&home.dir);
    block_on(p.snapshot("g", "minimal", MINIMAL_MIB));
    let full = pack_bytes(&home.dir);
    assert!(full > baseline + (1 << 20), "{full} bytes after a snapshot");
    block_on(async { assert_eq!(p.delete("/v1/snapshots/g").await.0, 204) });
    wait_back_to(&home.dir, baseline, "after DELETE /v1/snapshots/g");

    // The CLI's delete reclaims before it returns, poold running or not.
    block_on(p.snapshot("h", "minimal", MINIMAL_MIB));
    assert!(pack_bytes(&home.dir) > baseline + (1 << 20));
    let out = std::process::Command::new(forkd_e2e::bin("forkd"))
        .args(["snapshot", "rm", "h"])
        .env("FORKD_HOME", &home.dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("store GC reclaimed"), "{text}");
    assert!(
        pack_bytes(&home.dir) <= baseline,
        "`forkd snapshot rm` left {} bytes in packs",
        pack_bytes(&home.dir)
    );
    drop(p);
}
