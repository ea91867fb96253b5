//! The `code-interpreter` image end to end: a snapshot taken once its
//! default contexts are warm, forked children, and E2B's code-interpreter
//! HTTP protocol (docs/recipes.md, "code-interpreter") spoken by a real
//! HTTP client through the agent's tunnel to guest port 49999, with no
//! guest network and no poold. The unmodified `e2b-code-interpreter` SDK
//! runs against one child too when the test Python has it.
//!
//! Needs the image: `forkd image build --recipe code-interpreter` (the
//! test builds it when it is missing or its recipe changed).

use base64::Engine;
use forkd_e2e::{bin, block_on, create_snapshot, fork, forward, paths};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const PORT: u16 = 49999;

fn build_image() {
    let t = Instant::now();
    let st = std::process::Command::new(bin("forkd"))
        .args([
            "image",
            "build",
            "--recipe",
            "code-interpreter",
            "--if-changed",
        ])
        .env("FORKD_HOME", &paths().home)
        .status()
        .unwrap();
    assert!(
        st.success(),
        "forkd image build --recipe code-interpreter failed"
    );
    eprintln!(
        "image code-interpreter: ready in {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

/// The children the tests share: a snapshot whose warm-up left a marker
/// in the warm kernel, and three children of it. The last is the warm
/// kernel test's alone: a cell of another test that restarts a context
/// (a slow interrupt) must not cost it the marker.
struct Children {
    urls: Vec<SocketAddr>,
    _vms: Vec<forkd_snapshot::fork::Child>,
}

fn children() -> &'static Children {
    static C: OnceLock<Children> = OnceLock::new();
    C.get_or_init(|| {
        build_image();
        block_on(async {
            let tag = format!("t-ci-{}", forkd_snapshot::random_hex(4));
            let t = Instant::now();
            create_snapshot(
                &tag,
                "code-interpreter",
                1024,
                Some("forkd_ci_hook.run('warm_marker = 6 * 7')"),
            )
            .await;
            eprintln!("snapshot {tag}: {:.1} s", t.elapsed().as_secs_f64());
            let kids = fork(&tag, 3).await;
            let mut urls = Vec::new();
            for k in &kids {
                urls.push(forward(k.vm.agent.clone(), PORT).await);
            }
            Children { urls, _vms: kids }
        })
    })
}

fn client() -> reqwest::Client {
    forkd_api::http_builder()
        .http1_only()
        .timeout(Duration::from_secs(600))
        .build()
        .unwrap()
}

/// One cell: every NDJSON line of its response.
async fn execute(url: SocketAddr, body: Value) -> Vec<Value> {
    let r = client()
        .post(format!("http://{url}/execute"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    let text = r.text().await.unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(
        lines.last().map(|l| l["type"].clone()),
        Some(json!("end_of_execution")),
        "{lines:?}"
    );
    lines
}

async fn run(url: SocketAddr, code: &str) -> Vec<Value> {
    execute(url, json!({"code": code})).await
}

fn of_type<'a>(lines: &'a [Value], t: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["type"] == t).collect()
}

fn stdout(lines: &[Value]) -> String {
    of_type(lines, "stdout")
        .iter()
        .map(|l| l["text"].as_str().unwrap())
        .collect()
}

fn main_text(lines: &[Value]) -> Option<String> {
    of_type(lines, "result")
        .iter()
        .find(|r| r["is_main_result"] == true)
        .and_then(|r| r["text"].as_str().map(String::from))
}

/// Every number in a nested JSON array, in order (ints and floats alike).
fn numbers(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(numbers).collect(),
        v => v.as_f64().into_iter().collect(),
    }
}

fn error(lines: &[Value]) -> Option<&Value> {
    of_type(lines, "error").into_iter().next()
}

#[test]
fn the_first_cell_of_a_child_runs_in_the_snapshots_warm_kernel() {
    let c = children();
    block_on(async {
        let t = Instant::now();
        let lines = run(c.urls[2], "warm_marker").await;
        eprintln!(
            "first cell of a forked child: {:.0} ms through the tunnel",
            t.elapsed().as_secs_f64() * 1000.0
        );
        assert_eq!(main_text(&lines).as_deref(), Some("42"), "{lines:?}");
        // As E2B: user `user` in /home/user.
        let lines = run(
            c.urls[0],
            "import os, pwd; (pwd.getpwuid(os.getuid()).pw_name, os.getcwd())",
        )
        .await;
        assert_eq!(main_text(&lines).as_deref(), Some("('user', '/home/user')"));
        // Each child's generators were reseeded at hand-out: siblings differ.
        let draw = "import random, os; (random.random(), os.urandom(8).hex())";
        let a = main_text(&run(c.urls[0], draw).await);
        let b = main_text(&run(c.urls[1], draw).await);
        assert_ne!(a, b, "sibling kernels drew the same numbers");
        let js = json!({"code": "[Math.random(), require('crypto').randomBytes(8).toString('hex')]", "language": "javascript"});
        let a = main_text(&execute(c.urls[0], js.clone()).await);
        let b = main_text(&execute(c.urls[1], js).await);
        assert_ne!(a, b, "sibling JavaScript contexts drew the same numbers");
    });
}

#[test]
fn results_errors_and_execution_counts_as_e2b_sends_them() {
    let c = children();
    block_on(async {
        let url = c.urls[1];
        let lines = run(url, "x = 40\nprint('side effect')\nx + 2").await;
        assert_eq!(stdout(&lines), "side effect\n");
        assert_eq!(main_text(&lines).as_deref(), Some("42"));
        let n1 = of_type(&lines, "number_of_executions")[0]["execution_count"]
            .as_i64()
            .unwrap();
        let lines = run(url, "'a string'").await;
        assert_eq!(
            main_text(&lines).as_deref(),
            Some("a string"),
            "quotes stripped"
        );
        let n2 = of_type(&lines, "number_of_executions")[0]["execution_count"]
            .as_i64()
            .unwrap();
        assert_eq!(n2, n1 + 1);

        let lines = run(url, "1 / 0").await;
        let e = error(&lines).expect("an error line");
        assert_eq!(e["name"], "ZeroDivisionError");
        assert_eq!(e["value"], "division by zero");
        assert!(e["traceback"].as_str().unwrap().contains("1 / 0"), "{e}");

        let lines = run(
            url,
            "from IPython.display import display, HTML, Markdown, Latex\n\
             display(HTML('<b>bold</b>'))\n\
             display(Markdown('# title'))\n\
             display(Latex(r'$x^2$'))\n\
             {'k': [1, 2]}",
        )
        .await;
        let results = of_type(&lines, "result");
        assert_eq!(results.len(), 4, "{lines:?}");
        assert_eq!(results[0]["html"], "<b>bold</b>");
        assert_eq!(results[0]["is_main_result"], false);
        assert_eq!(results[1]["markdown"], "# title");
        assert_eq!(results[2]["latex"], "$x^2$");
        assert_eq!(results[3]["json"], json!({"k": [1, 2]}));
        assert_eq!(results[3]["is_main_result"], true);

        let lines = run(
            url,
            "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})",
        )
        .await;
        let r = of_type(&lines, "result")[0];
        assert!(r["html"].as_str().unwrap().contains("<table"), "{r}");
        assert_eq!(numbers(&r["data"]["a"]), [1.0, 2.0]);
        assert_eq!(r["data"]["b"], json!(["x", "y"]));
    });
}

#[test]
fn a_matplotlib_chart_arrives_as_a_png_with_its_chart_data() {
    let c = children();
    block_on(async {
        let lines = run(
            c.urls[0],
            "import matplotlib.pyplot as plt\n\
             plt.plot([1, 2, 3], [4, 5, 6], label='growth')\n\
             plt.title('Growth'); plt.xlabel('day'); plt.ylabel('size')\n\
             plt.show()",
        )
        .await;
        let r = of_type(&lines, "result")
            .into_iter()
            .find(|r| r.get("png").is_some_and(|p| p.is_string()))
            .unwrap_or_else(|| panic!("no PNG result: {lines:?}"));
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["png"].as_str().unwrap().replace('\n', ""))
            .unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(png.len() > 5000, "a {}-byte PNG", png.len());
        let chart = &r["chart"];
        assert_eq!(chart["type"], "line", "{chart}");
        assert_eq!(chart["title"], "Growth");
        assert_eq!(
            (chart["x_label"].clone(), chart["y_label"].clone()),
            (json!("day"), json!("size"))
        );
        assert_eq!(chart["elements"][0]["label"], "growth");
        assert_eq!(
            numbers(&chart["elements"][0]["points"]),
            [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
        );

        let lines = run(
            c.urls[0],
            "fig, ax = plt.subplots()\nax.bar(['a', 'b'], [3, 5], label='n')\nplt.show()",
        )
        .await;
        let r = of_type(&lines, "result")
            .into_iter()
            .find(|r| r.get("chart").is_some())
            .unwrap();
        assert_eq!(r["chart"]["type"], "bar");
        let bars: Vec<(String, String, f64)> = r["chart"]["elements"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                (
                    b["label"].as_str().unwrap().into(),
                    b["group"].as_str().unwrap().into(),
                    b["value"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            bars,
            [("a".into(), "n".into(), 3.0), ("b".into(), "n".into(), 5.0)]
        );
    });
}

#[test]
fn output_streams_while_the_cell_runs() {
    let c = children();
    block_on(async {
        // The cell prints, then waits for a file only this test creates
        // after it has seen that print: buffered output would never arrive.
        let marker = format!("/tmp/go-{}", forkd_snapshot::random_hex(4));
        let code = format!(
            "import os, time\nprint('first', flush=True)\n\
             while not os.path.exists({marker:?}): time.sleep(0.05)\nprint('second')"
        );
        let mut r = client()
            .post(format!("http://{}/execute", c.urls[1]))
            .json(&json!({"code": code}))
            .send()
            .await
            .unwrap();
        let mut seen = String::new();
        while !seen.contains("first") {
            let chunk = tokio::time::timeout(Duration::from_secs(120), r.chunk())
                .await
                .expect("the first print never arrived while the cell ran")
                .unwrap()
                .expect("the response ended before the first print");
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
        assert!(!seen.contains("end_of_execution"));
        let kid = &children()._vms[1];
        kid.vm
            .agent
            .write_file(&marker, b"", None, false)
            .await
            .unwrap();
        while let Some(chunk) = r.chunk().await.unwrap() {
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
        assert!(seen.contains("second"), "{seen}");
        assert!(
            seen.trim_end().ends_with(r#"{"type": "end_of_execution"}"#),
            "{seen}"
        );
    });
}

#[test]
fn a_cell_is_interrupted_when_its_client_leaves_or_its_time_ends() {
    let c = children();
    block_on(async {
        let url = c.urls[0];
        run(url, "stay = 'kept'").await;
        // The client leaves mid-cell (what E2B's SDK does at its timeout).
        let mut r = client()
            .post(format!("http://{url}/execute"))
            .json(&json!({"code": "import time\nprint('sleeping', flush=True)\ntime.sleep(3600)"}))
            .send()
            .await
            .unwrap();
        let mut seen = String::new();
        while !seen.contains("sleeping") {
            let chunk = r.chunk().await.unwrap().expect("ended early");
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
        drop(r);
        // The next cell does not wait behind the hour-long one, and the
        // kernel kept its state.
        let t = Instant::now();
        let lines = tokio::time::timeout(Duration::from_secs(300), run(url, "stay"))
            .await
            .expect("the next cell waited behind the abandoned one");
        assert_eq!(main_text(&lines).as_deref(), Some("kept"));
        eprintln!(
            "next cell after a client left: {:.1} s",
            t.elapsed().as_secs_f64()
        );

        // forkd's `timeout` (seconds): the cell is interrupted then, and
        // the kernel keeps its state. In order: a plain cell; a time that
        // ends before the kernel has taken the cell (ipykernel ignores
        // SIGINT between requests; a loaded host can be that late), so the
        // interrupt waits for the cell instead of being dropped; a cell
        // that ignores SIGINT when its time ends, so the interrupt goes
        // again once it can be caught; os.system, which ignores it while
        // its command runs (the command, in the kernel's process group,
        // gets the first and ends, and the cell is interrupted after it).
        let sleep = "import time; time.sleep(3600)";
        for (code, timeout) in [
            (sleep, json!(2)),
            (sleep, json!(0.001)),
            ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(3)\nsignal.signal(signal.SIGINT, signal.default_int_handler)\ntime.sleep(3600)", json!(1)),
            ("import os, time\nos.system('sleep 3600')\ntime.sleep(3600)", json!(1)),
        ] {
            let lines = execute(url, json!({"code": code, "timeout": timeout})).await;
            assert_eq!(
                error(&lines).unwrap()["name"],
                "KeyboardInterrupt",
                "{code} (timeout {timeout}): {lines:?}"
            );
        }
        let lines = run(url, "stay").await;
        assert_eq!(main_text(&lines).as_deref(), Some("kept"));
        // Raw bodies: a 401-digit integer is valid JSON that no f64 holds.
        let huge = format!("1{}", "0".repeat(400));
        for bad in ["\"soon\"", "\"5\"", "-1", "0", "true", &huge] {
            let r = client()
                .post(format!("http://{url}/execute"))
                .header("content-type", "application/json")
                .body(format!(r#"{{"code": "1", "timeout": {bad}}}"#))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400, "timeout {bad}");
            assert!(r.text().await.unwrap().contains("timeout must be"));
        }
        // JavaScript and bash cells stop the same way.
        let lines = execute(
            url,
            json!({"code": "while (true) {}", "language": "javascript", "timeout": 2}),
        )
        .await;
        assert!(
            error(&lines).unwrap()["value"]
                .as_str()
                .unwrap()
                .contains("interrupted"),
            "{lines:?}"
        );
        let lines = execute(
            url,
            json!({"code": "sleep 3600", "language": "bash", "timeout": 2}),
        )
        .await;
        assert_eq!(error(&lines).unwrap()["value"], "130", "{lines:?}");
        let lines = execute(url, json!({"code": "echo alive", "language": "bash"})).await;
        assert_eq!(stdout(&lines), "alive\n");
    });
}

#[test]
fn contexts_languages_envs_and_cwd() {
    let c = children();
    block_on(async {
        let url = c.urls[1];
        let http = client();
        let list: Vec<Value> = http
            .get(format!("http://{url}/contexts"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let langs: Vec<_> = list
            .iter()
            .map(|c| c["language"].as_str().unwrap())
            .collect();
        assert!(
            langs.contains(&"python") && langs.contains(&"javascript"),
            "{list:?}"
        );

        let ctx: Value = http
            .post(format!("http://{url}/contexts"))
            .json(&json!({"language": "python", "cwd": "/tmp"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            (ctx["language"].clone(), ctx["cwd"].clone()),
            (json!("python"), json!("/tmp"))
        );
        let id = ctx["id"].as_str().unwrap().to_string();
        let lines = execute(
            url,
            json!({"code": "import os; y = 1; os.getcwd()", "context_id": id}),
        )
        .await;
        assert_eq!(main_text(&lines).as_deref(), Some("/tmp"));
        let st = http
            .post(format!("http://{url}/contexts/{id}/restart"))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(st, 200);
        let lines = execute(url, json!({"code": "y", "context_id": id})).await;
        let e = error(&lines).unwrap();
        assert_eq!(
            (e["name"].clone(), e["value"].clone()),
            (json!("NameError"), json!("name 'y' is not defined"))
        );
        let st = http
            .delete(format!("http://{url}/contexts/{id}"))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(st, 200);
        let r = http
            .post(format!("http://{url}/execute"))
            .json(&json!({"code": "1", "context_id": id}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
        let r = http
            .post(format!("http://{url}/execute"))
            .json(&json!({"code": "1", "context_id": "x", "language": "python"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);

        // JavaScript (Node) and bash, as `user` in /home/user.
        let lines = execute(url, json!({"code": "const v = [1, 2].map((x) => x * 2); console.log('js'); v", "language": "javascript"})).await;
        assert_eq!(stdout(&lines), "js\n");
        assert_eq!(main_text(&lines).as_deref(), Some("[ 2, 4 ]"));
        let lines = execute(url, json!({"code": "v.length", "language": "js"})).await;
        assert_eq!(
            main_text(&lines).as_deref(),
            Some("2"),
            "declarations persist"
        );
        let lines = execute(
            url,
            json!({"code": "echo $HOME $(whoami) $(pwd); cd /tmp", "language": "bash"}),
        )
        .await;
        assert_eq!(stdout(&lines), "/home/user user /home/user\n");
        let lines = execute(url, json!({"code": "pwd; false", "language": "bash"})).await;
        assert_eq!(stdout(&lines), "/tmp\n", "cd persists");
        assert_eq!(error(&lines).unwrap()["value"], "1");

        // Per-call envs are set for the cell only; the sandbox's envs
        // (forkd's /forkd/envs, from E2B's create) are there for every cell.
        let st = http
            .post(format!("http://{url}/forkd/envs"))
            .json(&json!({"env_vars": {"SBX": "from-create", "FOO": "global"}}))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(st, 200);
        let lines = execute(
            url,
            json!({"code": "echo $FOO $SBX", "language": "bash", "env_vars": {"FOO": "bar"}}),
        )
        .await;
        assert_eq!(stdout(&lines), "bar from-create\n");
        let lines = execute(
            url,
            json!({"code": "echo ${FOO:-unset} $SBX", "language": "bash"}),
        )
        .await;
        assert_eq!(stdout(&lines), "global from-create\n");
        let lines = execute(
            url,
            json!({"code": "import os; os.environ.get('ONLY')", "env_vars": {"ONLY": "once"}}),
        )
        .await;
        assert_eq!(main_text(&lines).as_deref(), Some("once"));
        let lines = run(
            url,
            "import os; (os.environ.get('ONLY'), os.environ['SBX'])",
        )
        .await;
        assert_eq!(main_text(&lines).as_deref(), Some("(None, 'from-create')"));
        let lines = execute(
            url,
            json!({"code": "process.env.SBX", "language": "javascript"}),
        )
        .await;
        assert_eq!(main_text(&lines).as_deref(), Some("from-create"));
    });
}

/// The unmodified `e2b-code-interpreter` SDK (tests/python/requirements.txt)
/// pointed at one child: E2B_DEBUG makes `Sandbox.create()` local, and
/// E2B_SANDBOX_URL is what its `_jupyter_url` uses for /execute and
/// /contexts. Skipped without the test venv (scripts/test.sh makes it).
#[test]
fn the_e2b_code_interpreter_sdk_runs_code_in_a_child() {
    let Some(python) = std::env::var_os("FORKD_TEST_PYTHON").filter(|p| !p.is_empty()) else {
        eprintln!("skipped: FORKD_TEST_PYTHON is not set (scripts/test.sh sets it)");
        return;
    };
    let c = children();
    let script = r#"
import sys
from e2b import TimeoutException
from e2b_code_interpreter import Sandbox

sbx = Sandbox.create()
seen = []
ex = sbx.run_code("print('hello'); 6 * 7", on_stdout=lambda m: seen.append(m.line))
assert ex.text == "42", ex
assert ex.logs.stdout == ["hello\n"], ex.logs
assert seen == ["hello\n"], seen
ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.show()")
png = [r for r in ex.results if r.png]
assert png and png[0].chart is not None and png[0].chart.type == "line", ex.results
assert [list(p) for p in png[0].chart.elements[0].points] == [[1, 3], [2, 4]], png[0].chart.to_dict()
ex = sbx.run_code("1 / 0")
assert ex.error.name == "ZeroDivisionError", ex.error
try:
    sbx.run_code("import time; time.sleep(3600)", timeout=3)
    raise AssertionError("no timeout")
except TimeoutException:
    pass
assert sbx.run_code("1 + 1", timeout=300).text == "2"
assert sbx.run_code("console.log('js'); 1 + 2", language="javascript").text == "3"
assert sbx.run_code("echo $FOO", language="bash", envs={"FOO": "bar"}).logs.stdout == ["bar\n"]
ctx = sbx.create_code_context(cwd="/tmp")
assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
assert ctx.id in [c.id for c in sbx.list_code_contexts()]
sbx.restart_code_context(ctx)
sbx.remove_code_context(ctx)
assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
print("SDK OK")
"#;
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .env("E2B_DEBUG", "true")
        .env("E2B_API_KEY", "e2b_0000")
        .env("E2B_SANDBOX_URL", format!("http://{}", c.urls[0]))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("SDK OK"), "{text}");
}
