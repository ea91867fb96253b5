//! The recipes beyond numpy (docs/recipes.md), through a real poold: each
//! image is built from Debian packages by `forkd image build --if-changed`
//! (a no-op once built), snapshotted warm, and forked into two children
//! that use the warm state and stay isolated from each other.

use forkd_e2e::daemon::{ids, Home, Poold};
use forkd_e2e::{bin, block_on, paths};
use serde_json::{json, Value};

/// Builds recipe `name` into the test data dir unless it is built already.
fn build_image(name: &str) {
    let t = std::time::Instant::now();
    let st = std::process::Command::new(bin("forkd"))
        .args(["image", "build", "--recipe", name, "--if-changed"])
        .env("FORKD_HOME", &paths().home)
        .status()
        .unwrap();
    assert!(st.success(), "forkd image build --recipe {name} failed");
    eprintln!("image {name}: ready in {:.1} s", t.elapsed().as_secs_f64());
}

/// Creates snapshot `tag` of `image` with `extra` fields and forks two
/// children from it; returns their ids.
async fn warm_pair(p: &Poold, tag: &str, image: &str, extra: Value) -> Vec<String> {
    let mut body = json!({"tag": tag, "image": image, "mem_mib": 512});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let t = std::time::Instant::now();
    let (st, v) = p.post("/v1/snapshots", body).await;
    assert_eq!(st, 201, "snapshot of {image}: {v}");
    eprintln!("snapshot {tag}: {:.1} s", t.elapsed().as_secs_f64());
    let (st, v) = p
        .post("/v1/sandboxes", json!({"snapshot_tag": tag, "n": 2}))
        .await;
    assert_eq!(st, 201, "spawn from {tag}: {v}");
    let kids = ids(&v);
    assert_eq!(kids.len(), 2);
    kids
}

/// Runs `argv` in sandbox `id`; returns (exit code, stdout, stderr).
async fn run(p: &Poold, id: &str, argv: &[&str]) -> (i64, String, String) {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"args": argv, "timeout_secs": 120}),
        )
        .await;
    assert_eq!(st, 200, "exec {argv:?}: {v}");
    (
        v["exit_code"].as_i64().unwrap(),
        v["stdout"].as_str().unwrap().to_string(),
        v["stderr"].as_str().unwrap().to_string(),
    )
}

/// Runs a shell command that must succeed; returns its trimmed stdout.
async fn sh(p: &Poold, id: &str, cmd: &str) -> String {
    let (code, out, err) = run(p, id, &["sh", "-c", cmd]).await;
    assert_eq!(code, 0, "{cmd}: {out}{err}");
    out.trim().to_string()
}

async fn eval(p: &Poold, id: &str, code: &str) -> Value {
    let (st, v) = p
        .post(
            &format!("/v1/sandboxes/{id}/eval"),
            json!({"code": code, "timeout_secs": 120}),
        )
        .await;
    assert_eq!(st, 200, "eval {code}: {v}");
    v
}

/// `result_json` of a successful eval, decoded.
async fn eval_json(p: &Poold, id: &str, code: &str) -> Value {
    let v = eval(p, id, code).await;
    assert_eq!(v["exit_code"], 0, "{code}: {v}");
    let text = v["result_json"]
        .as_str()
        .unwrap_or_else(|| panic!("{code}: no result_json in {v}"));
    serde_json::from_str(text).unwrap()
}

/// nodejs: eval runs in the warm Node process (forkd's Node mode). The
/// parent's warm-up defines a global; both children see it through eval,
/// get `result_json`, and keep their own changes.
#[test]
fn nodejs_children_eval_in_the_warm_node_process() {
    build_image("nodejs");
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        // The warm-up draws from OpenSSL and fills Node's caches of its
        // output, so children would repeat them unless reseeded.
        let warmup = "globalThis.warm = {pid: process.pid, squares: [1, 2, 3].map((x) => x * x), \
                      gz: zlib.gzipSync('warm').length, bytes: crypto.randomBytes(8).toString('hex'), \
                      uuid: crypto.randomUUID(), int: crypto.randomInt(2 ** 40)}; 'ok'";
        let kids = warm_pair(&p, "node", "nodejs", json!({"eval_warmup": warmup})).await;
        let mut pids = Vec::new();
        for k in &kids {
            let (_, ping) = p.post(&format!("/v1/sandboxes/{k}/ping"), json!({})).await;
            assert_eq!(ping["agent_lang"], "node", "{ping}");
            assert!(ping["node_version"].is_string(), "{ping}");
            let warm = eval_json(&p, k, "warm").await;
            assert_eq!(warm["squares"], json!([1, 4, 9]));
            assert!(warm["gz"].as_u64().unwrap() > 0, "{warm}");
            // The very process the parent warmed, not a fresh one.
            assert_eq!(eval_json(&p, k, "process.pid").await, warm["pid"]);
            pids.push(warm["pid"].clone());
        }
        assert_eq!(pids[0], pids[1]);
        // Declarations persist within a child and stay out of its sibling.
        eval_json(&p, &kids[0], "let mine = 'a'; mine").await;
        assert_eq!(eval_json(&p, &kids[0], "mine + 'b'").await, "ab");
        assert_eq!(
            eval_json(&p, &kids[1], "typeof mine").await,
            json!("undefined")
        );
        // Output, awaited Promises, values without a JSON form, errors.
        let v = eval(&p, &kids[1], "console.log('out'); Promise.resolve({n: 5})").await;
        assert_eq!(v["stdout"], "out\n", "{v}");
        assert_eq!(v["result_json"], r#"{"n":5}"#, "{v}");
        let v = eval(&p, &kids[1], "10n ** 20n").await;
        assert_eq!(v["result"], "100000000000000000000n", "{v}");
        assert!(v.get("result_json").is_none(), "{v}");
        let v = eval(&p, &kids[1], "null.x").await;
        assert_eq!(v["exit_code"], 1, "{v}");
        let err = v["error"].as_str().unwrap();
        assert!(err.starts_with("TypeError: "), "{v}");
        assert!(v["traceback"].as_str().unwrap().contains("<eval-"), "{v}");
        // Each child's generators are reseeded at hand-out: Math.random,
        // OpenSSL (randomBytes, webcrypto, a TLS-grade key) and the UUID and
        // randomInt caches Node fills from it.
        let draws = "[Math.random(), crypto.randomBytes(16).toString('hex'), \
                     crypto.webcrypto.getRandomValues(new Uint32Array(4)).join(), crypto.randomUUID(), \
                     crypto.randomInt(2 ** 40), \
                     crypto.generateKeyPairSync('x25519').publicKey.export({type: 'spki', format: 'der'}).toString('hex')]";
        let a = eval_json(&p, &kids[0], draws).await;
        let b = eval_json(&p, &kids[1], draws).await;
        let names = [
            "Math.random",
            "randomBytes",
            "getRandomValues",
            "randomUUID",
            "randomInt",
            "x25519 key",
        ];
        for (i, name) in names.iter().enumerate() {
            assert_ne!(a[i], b[i], "{name} repeats across siblings: {a} {b}");
        }
    });
}

/// postgres-fixture: the parent's server is running with a fixture loaded
/// when the snapshot is taken; each child answers SQL on its first request
/// after hand-out, and a write in one child is not seen in the other.
#[test]
fn postgres_fixture_children_answer_sql_at_once() {
    build_image("postgres-fixture");
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    let psql = ["runuser", "-u", "postgres", "--", "psql", "-qtAc"];
    block_on(async {
        let load = "until pg_isready -q; do sleep 0.2; done; \
                    runuser -u postgres -- psql -qc \"create table fixture(id int primary key, name text); \
                    insert into fixture select g, md5(g::text) from generate_series(1, 1000) g\"";
        let kids = warm_pair(&p, "pg", "postgres-fixture", json!({"warmup": load})).await;
        let count = "select count(*) from fixture";
        for k in &kids {
            // The first request after hand-out: no server start, no wait.
            let (code, out, err) = run(&p, k, &[&psql[..], &[count]].concat()).await;
            assert_eq!((code, out.trim()), (0, "1000"), "{err}");
        }
        let insert = "insert into fixture values (5000, 'only in the first child')";
        let (code, _, err) = run(&p, &kids[0], &[&psql[..], &[insert]].concat()).await;
        assert_eq!(code, 0, "{err}");
        let (_, out, _) = run(&p, &kids[0], &[&psql[..], &[count]].concat()).await;
        assert_eq!(out.trim(), "1001");
        let (_, out, _) = run(&p, &kids[1], &[&psql[..], &[count]].concat()).await;
        assert_eq!(out.trim(), "1000", "the sibling's insert leaked");
        // Backends fork from the warm postmaster after hand-out, and
        // OpenSSL reseeds from the (reseeded) kernel in a new process.
        let uuid = "select gen_random_uuid()";
        let (_, a, _) = run(&p, &kids[0], &[&psql[..], &[uuid]].concat()).await;
        let (_, b, _) = run(&p, &kids[1], &[&psql[..], &[uuid]].concat()).await;
        assert_ne!(a, b, "gen_random_uuid repeats across siblings");
    });
}

/// coding-agent: the parent's warm-up makes a git repository with a C
/// program in it; each child commits and compiles in its own disk, and
/// neither sees the other's work.
#[test]
fn coding_agent_children_commit_and_compile_apart() {
    build_image("coding-agent");
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let setup = "set -e; mkdir -p /srv/proj; cd /srv/proj; git init -q -b main; \
                     git config --global user.email agent@forkd.invalid; git config --global user.name agent; \
                     printf '#include <stdio.h>\\nint main(void){puts(\"v1\");return 0;}\\n' > main.c; \
                     git add main.c; git commit -qm v1";
        let kids = warm_pair(&p, "code", "coding-agent", json!({"warmup": setup})).await;
        for (i, k) in kids.iter().enumerate() {
            let msg = format!("child {i}");
            let cmd = format!(
                "set -e; cd /srv/proj; test \"$(git log --format=%s)\" = v1; \
                 sed -i 's/v1/{msg}/' main.c; git commit -qam '{msg}'; \
                 cc -O1 -o /tmp/prog main.c; /tmp/prog"
            );
            assert_eq!(sh(&p, k, &cmd).await, msg);
        }
        for (i, k) in kids.iter().enumerate() {
            let log = sh(&p, k, "cd /srv/proj && git log --format=%s | tr '\\n' ,").await;
            assert_eq!(log, format!("child {i},v1,"), "history of child {i}");
        }
        // The warm interpreter is there too (python3).
        let v = eval(&p, &kids[0], "import subprocess; subprocess.run(['git', '--version'], capture_output=True).stdout.decode().split()[0]").await;
        assert_eq!(v["result"], "'git'", "{v}");
    });
}

/// Runs `code` in the kernel with run_cell in sandbox `id`; returns the
/// cell (stdout, outputs, error, status...) as JSON.
async fn cell(p: &Poold, id: &str, code: &str) -> Value {
    let call = format!("import json; print(json.dumps(run_cell({code:?})))");
    let v = eval(p, id, &call).await;
    assert_eq!(v["exit_code"], 0, "run_cell({code:?}): {v}");
    serde_json::from_str(v["stdout"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("run_cell({code:?}): {e}: {v}"))
}

/// The text/plain of a cell's only output (its execute_result).
fn plain(cell: &Value) -> &str {
    assert_eq!(cell["status"], "ok", "{cell}");
    cell["outputs"][0]["text/plain"]
        .as_str()
        .unwrap_or_else(|| panic!("no text/plain output: {cell}"))
}

/// jupyter-kernel: the parent's warm interpreter started an IPython kernel
/// and connected to it; the warm-up defined a variable in the kernel. Each
/// child runs cells at once over the same (cloned) ZeroMQ connections, sees
/// the variable, keeps its own, and draws its own random numbers in the
/// kernel, Python's and OpenSSL's (reseeded at hand-out through
/// forkd_kernel.forkd_reseed).
#[test]
fn jupyter_kernel_children_run_cells_in_the_warm_kernel() {
    build_image("jupyter-kernel");
    let home = Home::new();
    let p = Poold::start(&home.dir, &[], None);
    block_on(async {
        let warmup = "c = run_cell('import os, random, ssl; ssl.RAND_bytes(16); \
                      warm = {\"kernel_pid\": os.getpid(), \
                      \"squares\": [i * i for i in range(4)]}'); \
                      assert c['status'] == 'ok', c; 'ok'";
        let kids = warm_pair(&p, "jup", "jupyter-kernel", json!({"eval_warmup": warmup})).await;
        let mut pids = Vec::new();
        for k in &kids {
            // The first cell after hand-out: the kernel the parent started.
            let t = std::time::Instant::now();
            let c = cell(&p, k, "warm['squares']").await;
            assert_eq!(plain(&c), "[0, 1, 4, 9]");
            eprintln!(
                "{k}: first cell (kernel reseed included) {:.0} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
            pids.push(plain(&cell(&p, k, "warm['kernel_pid']").await).to_string());
        }
        assert_eq!(pids[0], pids[1], "not the parent's kernel");
        // A cell's streams and its execute_result.
        let c = cell(&p, &kids[0], "print('out'); mine = 'a'; mine + 'b'").await;
        assert_eq!(c["stdout"], "out\n", "{c}");
        assert_eq!(plain(&c), "'ab'");
        // The child continues the parent's count (the warm-up ran cell 1,
        // this child two cells since); the hand-out reseed added none.
        assert_eq!(c["execution_count"], 4, "{c}");
        // An exception comes back as the cell's error.
        let c = cell(&p, &kids[0], "1 / 0").await;
        assert_eq!(c["status"], "error", "{c}");
        assert_eq!(c["error"]["ename"], "ZeroDivisionError", "{c}");
        assert!(
            !c["error"]["traceback"].as_array().unwrap().is_empty(),
            "{c}"
        );
        // Isolation: the first child's variable is not in its sibling.
        let c = cell(&p, &kids[1], "mine").await;
        assert_eq!(c["error"]["ename"], "NameError", "{c}");
        assert_eq!(plain(&cell(&p, &kids[0], "mine").await), "'a'");
        // Randomness in the kernel differs between siblings (the parent's
        // kernel imported `random` before the snapshot).
        let a = plain(&cell(&p, &kids[0], "random.getrandbits(64)").await).to_string();
        let b = plain(&cell(&p, &kids[1], "random.getrandbits(64)").await).to_string();
        assert_ne!(a, b, "the kernel's random is shared by siblings");
        // So does OpenSSL's generator in the kernel (used before the
        // snapshot, so its state was cloned with the VM).
        let a = plain(&cell(&p, &kids[0], "ssl.RAND_bytes(8).hex()").await).to_string();
        let b = plain(&cell(&p, &kids[1], "ssl.RAND_bytes(8).hex()").await).to_string();
        assert_ne!(a, b, "the kernel's OpenSSL generator is shared by siblings");
    });
}
