//! A `forkd-gateway` process for tests (docs/cluster.md).

use crate::bin;
use forkd_api::{Client, Method};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `forkd-gateway`.
pub struct Gateway {
    child: Child,
    pub url: String,
    pub client: Client,
    /// The E2B API and sandbox-plane URLs, when started with `--e2b-bind`.
    pub e2b: Option<(String, String)>,
    /// The token its clients send (`/v1` bearer, E2B API key).
    pub token: Option<String>,
}

impl Gateway {
    /// A gateway on loopback without tokens, in front of `nodes`
    /// (`(name, url)`).
    pub fn start(nodes: &[(&str, &str)]) -> Gateway {
        Gateway::start_with(nodes, &[], None)
    }

    /// With `args` added (`--token-file`, `--node-token-file`...) and the
    /// token its client sends.
    pub fn start_with(nodes: &[(&str, &str)], args: &[&str], token: Option<&str>) -> Gateway {
        let mut cmd = Command::new(bin("forkd-gateway"));
        cmd.args(args);
        cmd.args([
            "--bind",
            "127.0.0.1:0",
            "--poll-ms",
            "200",
            "--node-timeout-ms",
            "2000",
        ]);
        for (name, url) in nodes {
            cmd.args(["--node", &format!("{name}={url}")]);
        }
        let mut child = cmd
            .env("FORKD_GATEWAY_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        stdout.read_line(&mut line).unwrap();
        let url = line
            .trim()
            .strip_prefix("forkd-gateway listening on ")
            .unwrap_or_else(|| panic!("gateway did not start: {line:?}"))
            .to_string();
        // "forkd-gateway E2B API on http://A sandboxes on http://B"
        let e2b = args.contains(&"--e2b-bind").then(|| {
            let mut l = String::new();
            stdout.read_line(&mut l).unwrap();
            let w: Vec<&str> = l.split_whitespace().collect();
            match (w.get(4), w.get(7)) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => panic!("no E2B listener line: {l:?}"),
            }
        });
        let client = Client::new(&url, token.map(str::to_string)).unwrap();
        Gateway {
            child,
            url,
            client,
            e2b,
            token: token.map(str::to_string),
        }
    }

    pub async fn req(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let (st, bytes) = self.client.send(method, path, body).await.unwrap();
        let v = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
        (st.as_u16(), v)
    }

    /// `POST /v1/sandboxes/{id}/exec` of `args`.
    pub async fn exec(&self, id: &str, args: &[&str]) -> (u16, Value) {
        let path = format!("/v1/sandboxes/{id}/exec");
        self.req(Method::POST, &path, Some(json!({ "args": args })))
            .await
    }

    /// Waits until `GET /v1/nodes` satisfies `done`.
    pub async fn wait_nodes(&self, what: &str, done: impl Fn(&HashMap<String, String>) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (_, v) = self.req(Method::GET, "/v1/nodes", None).await;
            let states: HashMap<String, String> = v
                .as_array()
                .unwrap()
                .iter()
                .map(|n| {
                    let s = n["health"]["state"].as_str().unwrap_or("").to_string();
                    (n["name"].as_str().unwrap().to_string(), s)
                })
                .collect();
            if done(&states) {
                return;
            }
            assert!(Instant::now() < deadline, "nodes never {what}: {v}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
