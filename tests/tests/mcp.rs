//! `forkd mcp` driven by a real MCP client (the official Python SDK,
//! tests/python/mcp_client.py) against a real poold with real guests:
//! spawn → exec (streamed) → eval → files → branch → kill, over stdio and
//! over streamable HTTP. Also: poold serves its OpenAPI document, behind
//! the token, and it is valid OpenAPI.

use forkd_e2e::bin;
use forkd_e2e::block_on;
use forkd_e2e::daemon::{Home, Poold};
use std::path::PathBuf;
use std::process::Command;

/// The interpreter with the pinned client libraries (scripts/test.sh).
fn python() -> PathBuf {
    let p = std::env::var("FORKD_TEST_PYTHON").expect(
        "FORKD_TEST_PYTHON is not set: run the tests with scripts/test.sh (it builds the venv of tests/python/requirements.txt)",
    );
    PathBuf::from(p)
}

fn run_client(p: &Poold, token: &str, tag: &str, mode: &str) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/mcp_client.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(mode)
        .env("FORKD_BIN", bin("forkd"))
        .env("FORKD_URL", &p.url)
        .env("FORKD_TOKEN", token)
        .env("MCP_TEST_TAG", tag)
        .output()
        .expect("running the MCP client");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "the MCP client ({mode}) failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(&format!("mcp_client {mode}: ok")),
        "{stdout}"
    );
}

#[test]
fn an_mcp_client_spawns_execs_evals_branches_and_kills() {
    let home = Home::new();
    let token = format!("tok-{}", forkd_snapshot::random_hex(16));
    let token_file = home.dir.join("token");
    std::fs::write(&token_file, &token).unwrap();
    let p = Poold::start(
        &home.dir,
        &["--token-file", token_file.to_str().unwrap()],
        Some(&token),
    );
    block_on(p.snapshot("py", "python-numpy", 256));
    run_client(&p, &token, "py", "stdio");
    run_client(&p, &token, "py", "http");
    // Nothing left running: the client killed what it spawned.
    let (st, v) = block_on(p.get("/v1/sandboxes"));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v, serde_json::json!([]), "sandboxes left behind");
}

#[test]
fn poold_serves_its_openapi_document_behind_the_token() {
    let home = Home::new();
    let token = format!("tok-{}", forkd_snapshot::random_hex(16));
    let token_file = home.dir.join("token");
    std::fs::write(&token_file, &token).unwrap();
    let p = Poold::start(
        &home.dir,
        &["--token-file", token_file.to_str().unwrap()],
        Some(&token),
    );
    let doc = block_on(async {
        let (st, doc) = p.get("/openapi.json").await;
        assert_eq!(st, 200, "{doc}");
        assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
        for path in [
            "/v1/sandboxes",
            "/v1/sandboxes/{id}/exec/stream",
            "/healthz",
        ] {
            assert!(doc["paths"].get(path).is_some(), "{path} missing");
        }
        let anon = forkd_api::Client::new(&p.url, None).unwrap();
        let (st, _) = anon
            .send(forkd_api::Method::GET, "/openapi.json", None)
            .await
            .unwrap();
        assert_eq!(st.as_u16(), 401);
        doc
    });
    // A document clients can generate from: valid OpenAPI by the pinned
    // validator (openapi-spec-validator), not only well-formed JSON.
    let file = home.dir.join("openapi.json");
    std::fs::write(&file, serde_json::to_vec(&doc).unwrap()).unwrap();
    let out = Command::new(python())
        .args([
            "-c",
            "import json, sys\n\
             from openapi_spec_validator import validate\n\
             validate(json.load(open(sys.argv[1])))\n\
             print('valid')",
        ])
        .arg(&file)
        .output()
        .expect("running openapi-spec-validator");
    assert!(
        out.status.success(),
        "poold's /openapi.json is not valid OpenAPI: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
