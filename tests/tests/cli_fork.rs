//! The snapshot and fork commands through the real `forkd` binary: create,
//! ls, info, fork (with its timings), rm; and a `fork --keep` killed with
//! SIGKILL leaves nothing running once the next command has swept.

use forkd_e2e::{bin, paths};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn forkd() -> Command {
    let mut c = Command::new(bin("forkd"));
    c.env("FORKD_HOME", &paths().home);
    c
}

fn ok(args: &[&str]) -> String {
    let out = forkd().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "forkd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fork_dirs() -> Vec<std::path::PathBuf> {
    std::fs::read_dir(paths().vms_dir())
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with("fork-")
                })
                .collect()
        })
        .unwrap_or_default()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

#[test]
fn snapshot_fork_and_rm_through_the_cli() {
    let tag = format!("t-cli-{}", forkd_snapshot::random_hex(3));
    let out = ok(&[
        "snapshot",
        "create",
        "--tag",
        &tag,
        "--image",
        "minimal",
        "--mem",
        "128",
        "--quiet",
        "--warmup",
        "echo warm > /warm",
    ]);
    assert!(out.contains(&format!("snapshot {tag} = ")), "{out}");
    assert!(ok(&["snapshot", "ls"]).contains(&tag));
    let info = ok(&["snapshot", "info", &tag, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["chain_depth"], 0);
    assert_eq!(v["config"]["image"], "minimal");
    assert_eq!(v["lineage"]["warmup_cmd"], "echo warm > /warm");

    let out = ok(&["fork", "--tag", &tag, "-n", "3", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let kids = v["children"].as_array().unwrap();
    assert_eq!(kids.len(), 3);
    for c in kids {
        let t = &c["timings"];
        let (p, r, u, d) = (
            t["process_ms"].as_u64().unwrap(),
            t["restored_ms"].as_u64().unwrap(),
            t["resumed_ms"].as_u64().unwrap(),
            t["ready_ms"].as_u64().unwrap(),
        );
        assert!(p <= r && r <= u && u <= d, "phases out of order: {t}");
        assert!(
            !alive(c["pid"].as_u64().unwrap() as u32),
            "child outlived fork"
        );
        let dir = paths().vm_dir(c["id"].as_str().unwrap());
        assert!(!dir.exists(), "fork left {}", dir.display());
    }
    assert!(v["all_ready_ms"].as_u64().unwrap() > 0);

    // Bad input: one clear line.
    for (args, want) in [
        (vec!["fork", "--tag", "../x"], "invalid tag"),
        (vec!["fork", "--tag", "nope-nope"], "no snapshot"),
        (vec!["fork", "--tag", &tag, "-n", "0"], "-n must be"),
        (
            vec!["snapshot", "create", "--tag", "a/b", "--image", "minimal"],
            "invalid tag",
        ),
        (vec!["snapshot", "rm", "nope-nope"], "no snapshot"),
    ] {
        let out = forkd().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("error: ") && err.contains(want),
            "{args:?}: {err}"
        );
    }

    let out = ok(&["snapshot", "rm", &tag]);
    assert!(out.contains("deleted snapshot"), "{out}");
    assert!(!ok(&["snapshot", "ls"]).contains(&tag));
}

#[test]
fn killed_fork_keep_leaves_nothing_running() {
    let tag = format!("t-keep-{}", forkd_snapshot::random_hex(3));
    ok(&[
        "snapshot", "create", "--tag", &tag, "--image", "minimal", "--mem", "128", "--quiet",
    ]);
    let mut child = forkd()
        .args(["fork", "--tag", &tag, "-n", "2", "--keep"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut pids = Vec::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(120);
    while pids.len() < 2 {
        let line = lines.next().expect("fork exited early").unwrap();
        if line.starts_with("fork-") {
            pids.push(
                line.split_whitespace()
                    .nth(1)
                    .unwrap()
                    .parse::<u32>()
                    .unwrap(),
            );
        }
        assert!(Instant::now() < deadline);
    }
    let dirs: Vec<_> = fork_dirs()
        .into_iter()
        .filter(|d| {
            let rec = std::fs::read(d.join("vm.json")).unwrap_or_default();
            let v: serde_json::Value = serde_json::from_slice(&rec).unwrap_or_default();
            pids.contains(&(v["qemu"]["pid"].as_u64().unwrap_or(0) as u32))
        })
        .collect();
    assert_eq!(dirs.len(), 2);
    assert!(pids.iter().all(|p| alive(*p)));
    child.kill().unwrap(); // SIGKILL: no cleanup code runs
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|p| alive(*p)) {
        assert!(Instant::now() < deadline, "children survived the CLI");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The next fork proves the owner is gone and sweeps the directories.
    ok(&["fork", "--tag", &tag, "-n", "1"]);
    for d in &dirs {
        assert!(!d.exists(), "{} was not swept", d.display());
    }
    ok(&["snapshot", "rm", &tag]);
}
