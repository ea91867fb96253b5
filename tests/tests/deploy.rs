//! deploy/kubernetes/ validates against Kubernetes' own OpenAPI schemas
//! (strict: an unknown or misspelt field fails), with `kubernetes-validate`
//! from the test venv (tests/python/requirements.txt; scripts/test.sh exports
//! FORKD_TEST_PYTHON). The schemas ship with the package: no network.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Oldest and newest Kubernetes the manifests are checked against.
const VERSIONS: [&str; 2] = ["1.29.0", "1.37.0"];

fn python() -> String {
    std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| {
        panic!("FORKD_TEST_PYTHON is not set: run the tests with scripts/test.sh (it makes the venv with kubernetes-validate)")
    })
}

fn validate(version: &str, files: &[PathBuf]) -> (bool, String) {
    let out = Command::new(python())
        .args(["-m", "kubernetes_validate", "--strict", "-k", version])
        .args(files)
        .output()
        .expect("running kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "manifests missing in {}", dir.display());
    files
}

#[test]
fn kubernetes_manifests_validate() {
    let files = manifests();
    for v in VERSIONS {
        let (ok, text) = validate(v, &files);
        print!("{text}");
        assert!(
            ok,
            "deploy/kubernetes does not validate against {v}:\n{text}"
        );
        for f in &files {
            let name = f.file_name().unwrap().to_string_lossy();
            assert!(text.contains(&*name), "{name} was not checked:\n{text}");
        }
    }
}

/// The validator is not a rubber stamp: the DaemonSet with one field
/// misspelt fails.
#[test]
fn kubernetes_validator_refuses_a_misspelt_field() {
    let ds = manifests()
        .into_iter()
        .find(|p| p.ends_with("daemonset.yaml"))
        .expect("daemonset.yaml");
    let text = std::fs::read_to_string(&ds).unwrap();
    assert!(text.contains("hostPath:"));
    let dir = std::env::temp_dir().join(format!("forkd-k8s-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("daemonset.yaml");
    std::fs::write(&bad, text.replacen("hostPath:", "hostPth:", 1)).unwrap();
    let (ok, out) = validate(VERSIONS[1], &[bad]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!ok, "a misspelt field passed:\n{out}");
    assert!(out.contains("hostPth"), "{out}");
}

/// The ConfigMap's `poold.toml` block scalar, dedented.
fn configmap_poold_toml() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/configmap.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines().skip_while(|l| l.trim() != "poold.toml: |");
    let key = lines
        .next()
        .expect("configmap.yaml has a poold.toml: | block");
    let key_indent = key.len() - key.trim_start().len();
    let mut body = Vec::new();
    let mut indent = None;
    for l in lines {
        let this = l.len() - l.trim_start().len();
        if !l.trim().is_empty() && this <= key_indent {
            break;
        }
        let i = *indent.get_or_insert(this);
        body.push(l.get(i..).unwrap_or(""));
    }
    body.join("\n")
}

/// Kubernetes' schemas see `poold.toml` as an opaque string: poold's own
/// parser and checks must accept it (an unknown key is an error there).
#[test]
fn configmap_poold_toml_is_a_config_poold_accepts() {
    let toml = configmap_poold_toml();
    assert!(toml.contains("tls_cert"), "{toml}");
    let dir = tempfile_dir();
    let file = dir.join("poold.toml");
    std::fs::write(&file, &toml).unwrap();
    let cfg = poold::config::Config::load(Some(&file))
        .unwrap_or_else(|e| panic!("deploy/kubernetes/configmap.yaml poold.toml: {e:#}\n{toml}"));
    let _ = std::fs::remove_dir_all(&dir);
    cfg.validate()
        .unwrap_or_else(|e| panic!("deploy/kubernetes/configmap.yaml poold.toml: {e:#}"));
    assert!(cfg.tls_cert.is_some() && cfg.token_file.is_some());
    assert!(cfg.pools.contains_key("py"));
}

fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "forkd-k8s-cfg-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
