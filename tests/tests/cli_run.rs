//! `forkd run`: boots a real guest, streams output, exits with the
//! command's status, and leaves nothing behind.

use forkd_e2e::{bin, paths};
use std::process::Command;

fn forkd() -> Command {
    let mut c = Command::new(bin("forkd"));
    c.env("FORKD_HOME", &paths().home);
    c
}

/// The `forkd run` VM directories whose record names `pid` as the owner.
/// (Counting every `run-*` dir raced with the other tests of this binary,
/// which run concurrently and leave or sweep their own.)
fn vm_dirs_of(pid: u32) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(paths().vms_dir())
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("run-"))
                .filter(|p| {
                    let rec: serde_json::Value = serde_json::from_slice(
                        &std::fs::read(p.join("vm.json")).unwrap_or_default(),
                    )
                    .unwrap_or_default();
                    rec["owner"]["pid"] == pid
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn run_prints_output_and_propagates_the_exit_code() {
    let out = forkd()
        .args([
            "run",
            "--image",
            "minimal",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 7",
        ])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("err\n"));
}

#[test]
fn run_forwards_stdin_and_cleans_up() {
    use std::io::Write;
    let mut child = forkd()
        .args(["run", "--image", "minimal", "--", "tr", "a-z", "A-Z"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HELLO\n");
    let left = vm_dirs_of(pid);
    assert!(
        left.is_empty(),
        "forkd run left its VM directory behind: {left:?}"
    );
}

#[test]
fn run_numpy_quickstart() {
    let out = forkd()
        .args([
            "run",
            "--image",
            "python-numpy",
            "--",
            "python3",
            "-c",
            "import numpy; print(numpy.zeros(5).tolist())",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "[0.0, 0.0, 0.0, 0.0, 0.0]\n"
    );
}

#[test]
fn run_errors_are_one_clear_line() {
    let out = forkd()
        .args(["run", "--image", "no-such-image", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("error: image \"no-such-image\" is not built"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let out = forkd()
        .args(["run", "--image", "../etc", "--", "true"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid image name"));
}

#[test]
fn killed_cli_leaves_nothing_running() {
    let mut child = forkd()
        .args(["run", "--image", "minimal", "--", "sleep", "600"])
        .spawn()
        .unwrap();
    // Wait until its VM directory exists and QEMU is up.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let dir = loop {
        let found = std::fs::read_dir(paths().vms_dir()).ok().and_then(|rd| {
            rd.flatten().map(|e| e.path()).find(|p| {
                p.join("vm.json").exists()
                    && p.file_name().unwrap().to_string_lossy().starts_with("run-")
                    && {
                        let rec: serde_json::Value = serde_json::from_slice(
                            &std::fs::read(p.join("vm.json")).unwrap_or_default(),
                        )
                        .unwrap_or_default();
                        rec["owner"]["pid"] == child.id()
                    }
            })
        });
        if let Some(d) = found {
            break d;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "forkd run never started its VM"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("vm.json")).unwrap()).unwrap();
    let qemu_pid = rec["qemu"]["pid"].as_u64().unwrap();
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // QEMU dies with its owner...
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{qemu_pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{qemu_pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "QEMU {qemu_pid} survived its owner"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // ...and the next forkd command sweeps the directory.
    let _ = forkd()
        .args(["run", "--image", "minimal", "--", "true"])
        .output()
        .unwrap();
    assert!(!dir.exists(), "{} was not swept", dir.display());
}
