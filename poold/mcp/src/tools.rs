//! The MCP tools: one per thing an agent does with sandboxes, each a thin
//! translation to poold's `/v1` API (docs/api.md).
//!
//! Invariants:
//! - input schemas come from the typed `*Input` structs below (schemars);
//!   their doc comments are what the client's model reads, so they say
//!   what a field means and its default;
//! - a successful call answers structured JSON (an object: lists are
//!   wrapped, e.g. `{"sandboxes": [...]}`) and the same JSON as text;
//! - anything poold refuses becomes a tool error (`isError: true`) whose
//!   text is poold's message (`poold answered 404: sandbox "sb-…" not
//!   found`), so the model can read what was wrong and what to do next;
//!   a command that runs and fails is not a tool error (its exit code is
//!   in the result);
//! - ids, tags and guest paths are checked before they go into a URL;
//! - `exec` keeps at most [`MAX_KEPT_OUTPUT`] bytes of each stream for its
//!   result, whatever the guest prints (the rest is counted, not kept).

use base64::Engine;
use forkd_api::{Client, Method};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, Implementation, NotificationMetaObject, ProgressNotificationParam,
    ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, RoleServer, ServerHandler};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Output `exec` keeps per stream (stdout, stderr) for its final result.
/// Output past it still streams as progress notifications.
pub const MAX_KEPT_OUTPUT: usize = 1 << 20;

/// A tool's answer: structured JSON, or the error text the model reads.
type ToolResult = Result<CallToolResult, String>;

/// The MCP server: a [`Client`] of one poold and the tool table.
#[derive(Clone)]
pub struct Forkd {
    client: Client,
    tool_router: ToolRouter<Forkd>,
}

/// `spawn`'s input.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpawnInput {
    /// Tag of the snapshot to start the sandboxes from (see `list_snapshots`).
    pub snapshot_tag: String,
    /// How many sandboxes, 1 to 1000 (default 1).
    pub n: Option<usize>,
    /// Memory limit per sandbox, MiB (default: poold's configured default).
    pub memory_limit_mib: Option<u64>,
    /// CPU quota per sandbox in CPUs, e.g. 0.5 (default: poold's).
    pub cpus: Option<f64>,
    /// Kill the sandboxes automatically after this many seconds.
    pub ttl_secs: Option<u64>,
}

/// `exec`'s input.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecInput {
    /// Sandbox id (`sb-…`).
    pub sandbox_id: String,
    /// A shell command line (run with `sh -c`). Give this or `args`.
    pub cmd: Option<String>,
    /// The program and its arguments, run without a shell. Give this or `cmd`.
    pub args: Option<Vec<String>>,
    /// Seconds before the command's process group is killed (default 30).
    pub timeout_secs: Option<f64>,
    /// Working directory in the guest (absolute).
    pub cwd: Option<String>,
    /// Environment variables added for the command.
    pub env: Option<BTreeMap<String, String>>,
    /// Text fed to the command's standard input.
    pub stdin: Option<String>,
}

/// `eval`'s input.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EvalInput {
    /// Sandbox id (`sb-…`).
    pub sandbox_id: String,
    /// Python source: statements and/or a final expression whose repr() is
    /// returned. State persists between calls in the same sandbox.
    pub code: String,
    /// Seconds before the evaluation is abandoned (default 300).
    pub timeout_secs: Option<f64>,
}

/// Input naming one sandbox.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxInput {
    /// Sandbox id (`sb-…`).
    pub sandbox_id: String,
}

/// `read_file`'s input.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileInput {
    /// Sandbox id (`sb-…`).
    pub sandbox_id: String,
    /// Absolute path in the guest.
    pub path: String,
    /// Byte offset to start at (default 0).
    pub offset: Option<u64>,
    /// Most bytes to read (default: the whole file, up to 32 MiB).
    pub len: Option<u64>,
}

/// `write_file`'s input.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileInput {
    /// Sandbox id (`sb-…`).
    pub sandbox_id: String,
    /// Absolute path in the guest; missing parent directories are created.
    pub path: String,
    /// The file's content.
    pub content: String,
    /// How `content` is encoded: `utf-8` (default) or `base64` (binary).
    pub encoding: Option<Encoding>,
    /// Octal permission bits, e.g. `0755` (default 0644).
    pub mode: Option<String>,
    /// Append to the file instead of replacing it.
    pub append: Option<bool>,
}

/// How file content travels in a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
pub enum Encoding {
    /// Text.
    #[serde(rename = "utf-8")]
    Utf8,
    /// Bytes, base64-encoded.
    #[serde(rename = "base64")]
    Base64,
}

/// `list_files`' input.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesInput {
    /// Sandbox id (`sb-…`).
    pub sandbox_id: String,
    /// Absolute path of a directory in the guest.
    pub path: String,
}

/// `branch`'s input.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BranchInput {
    /// Sandbox id (`sb-…`).
    pub sandbox_id: String,
    /// Tag for the new snapshot (default: `branch-<id>-<unix time>-<hex>`).
    pub tag: Option<String>,
    /// `live` (default: the sandbox keeps running, paused for milliseconds),
    /// `diff` (the same here) or `full` (stopped for the whole copy).
    pub mode: Option<String>,
}

/// Input naming one snapshot.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotInput {
    /// Snapshot tag.
    pub tag: String,
}

/// `set_pool`'s input.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SetPoolInput {
    /// Tag of the snapshot whose children the pool keeps ready.
    pub tag: String,
    /// Paused children to keep ready (0 to 1000; 0 with max_ready 0 empties it).
    pub min_ready: usize,
    /// Upper bound on ready children (default: min_ready).
    pub max_ready: Option<usize>,
    /// Warm each child once before parking it (default true).
    pub warm: Option<bool>,
}

#[tool_router]
impl Forkd {
    /// A server answering through `client`.
    pub fn new(client: Client) -> Forkd {
        Forkd {
            client,
            tool_router: Self::tool_router(),
        }
    }

    /// Start sandboxes from a snapshot.
    #[tool(
        description = "Start sandboxes (microVMs) from a warm snapshot; they are ready in milliseconds. Answers {\"sandboxes\": [SandboxInfo]} with each sandbox's id."
    )]
    async fn spawn(&self, Parameters(p): Parameters<SpawnInput>) -> ToolResult {
        let mut body = json!({"snapshot_tag": p.snapshot_tag, "n": p.n.unwrap_or(1)});
        set(&mut body, "memory_limit_mib", p.memory_limit_mib);
        set(&mut body, "cpus", p.cpus);
        set(&mut body, "ttl_secs", p.ttl_secs);
        let made: Value = self
            .client
            .post("/v1/sandboxes", body)
            .await
            .map_err(text)?;
        Ok(structured(json!({ "sandboxes": made })))
    }

    /// Run a command, streaming its output as progress notifications.
    #[tool(
        description = "Run a command in a sandbox. Give `cmd` (a shell line) or `args`. Output streams as progress notifications when the request has a progress token; the result has stdout, stderr, exit_code, timed_out. A non-zero exit is a result, not a tool error."
    )]
    async fn exec(
        &self,
        Parameters(p): Parameters<ExecInput>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let id = segment(&p.sandbox_id)?;
        let mut body = json!({});
        match (p.cmd, p.args) {
            (Some(c), None) => body["cmd"] = json!(c),
            (None, Some(a)) if !a.is_empty() => body["args"] = json!(a),
            (Some(_), Some(_)) => return Err("give cmd or args, not both".into()),
            _ => return Err("give cmd (a shell line) or args (a non-empty list)".into()),
        }
        set(&mut body, "timeout_secs", p.timeout_secs);
        set(&mut body, "cwd", p.cwd);
        set(&mut body, "env", p.env);
        set(&mut body, "stdin", p.stdin);
        let mut lines = self
            .client
            .post_lines(&format!("/v1/sandboxes/{id}/exec/stream"), body)
            .await
            .map_err(text)?;
        let progress = ctx.meta.get_progress_token();
        let (mut out, mut err) = (Kept::default(), Kept::default());
        let mut seen: u64 = 0;
        while let Some(line) = lines.next().await.map_err(text)? {
            match line["type"].as_str() {
                Some(stream @ ("stdout" | "stderr")) => {
                    let data = line["data"].as_str().unwrap_or_default();
                    let kept = if stream == "stdout" {
                        &mut out
                    } else {
                        &mut err
                    };
                    kept.push(data);
                    seen += data.len() as u64;
                    if let Some(token) = &progress {
                        let mut meta = serde_json::Map::new();
                        meta.insert("stream".into(), json!(stream));
                        let mut n = ProgressNotificationParam::new(token.clone(), seen as f64)
                            .with_message(data);
                        n.meta = Some(NotificationMetaObject::from(meta));
                        // A client that went away ends the call below.
                        let _ = ctx.peer.notify_progress(n).await;
                    }
                }
                Some("exit") => {
                    return Ok(structured(json!({
                        "stdout": out.text,
                        "stderr": err.text,
                        "exit_code": line["exit_code"],
                        "signal": line["signal"],
                        "timed_out": line["timed_out"],
                        "duration_ms": line["duration_ms"],
                        "stdout_dropped_bytes": out.dropped,
                        "stderr_dropped_bytes": err.dropped,
                    })))
                }
                Some("error") => {
                    return Err(format!(
                        "the command failed in the sandbox: {}",
                        line["error"].as_str().unwrap_or("unknown error")
                    ))
                }
                _ => {}
            }
        }
        Err("poold's answer ended before the command's exit status; is the sandbox still there? (list_sandboxes)".into())
    }

    /// Evaluate Python in the sandbox's warm interpreter.
    #[tool(
        description = "Evaluate Python in a sandbox's warm interpreter (state persists between calls). Answers result (repr of the final expression), stdout, stderr, and error/traceback when the code raised."
    )]
    async fn eval(&self, Parameters(p): Parameters<EvalInput>) -> ToolResult {
        let id = segment(&p.sandbox_id)?;
        let mut body = json!({ "code": p.code });
        set(&mut body, "timeout_secs", p.timeout_secs);
        let r: Value = self
            .client
            .post(&format!("/v1/sandboxes/{id}/eval"), body)
            .await
            .map_err(text)?;
        Ok(structured(r))
    }

    /// Read a file from a sandbox.
    #[tool(
        description = "Read a file in a sandbox. Answers content as text when it is UTF-8 (encoding \"utf-8\"), else base64 (encoding \"base64\")."
    )]
    async fn read_file(&self, Parameters(p): Parameters<ReadFileInput>) -> ToolResult {
        let id = segment(&p.sandbox_id)?;
        let mut q = format!("path={}", guest_path(&p.path)?);
        if let Some(o) = p.offset {
            q += &format!("&offset={o}");
        }
        if let Some(l) = p.len {
            q += &format!("&len={l}");
        }
        let bytes = self
            .raw(Method::GET, &format!("/v1/sandboxes/{id}/files?{q}"), None)
            .await?;
        let (encoding, content) = match std::str::from_utf8(&bytes) {
            Ok(s) => ("utf-8", s.to_string()),
            Err(_) => (
                "base64",
                base64::engine::general_purpose::STANDARD.encode(&bytes),
            ),
        };
        Ok(structured(json!({
            "path": p.path,
            "bytes": bytes.len(),
            "encoding": encoding,
            "content": content,
        })))
    }

    /// Write a file into a sandbox.
    #[tool(
        description = "Write a file in a sandbox (atomically, creating parent directories). Answers the file's stat."
    )]
    async fn write_file(&self, Parameters(p): Parameters<WriteFileInput>) -> ToolResult {
        let id = segment(&p.sandbox_id)?;
        let data = match p.encoding.unwrap_or(Encoding::Utf8) {
            Encoding::Utf8 => p.content.into_bytes(),
            Encoding::Base64 => base64::engine::general_purpose::STANDARD
                .decode(p.content.trim())
                .map_err(|e| format!("content is not valid base64: {e}"))?,
        };
        let mut q = format!("path={}", guest_path(&p.path)?);
        if let Some(m) = &p.mode {
            if m.is_empty() || !m.bytes().all(|b| (b'0'..=b'7').contains(&b)) || m.len() > 5 {
                return Err(format!("mode {m:?} is not an octal mode such as 0644"));
            }
            q += &format!("&mode={m}");
        }
        if p.append == Some(true) {
            q += "&append=true";
        }
        let bytes = self
            .raw(
                Method::PUT,
                &format!("/v1/sandboxes/{id}/files?{q}"),
                Some(data),
            )
            .await?;
        Ok(structured(parse_json(&bytes)?))
    }

    /// List a directory in a sandbox.
    #[tool(
        description = "List a directory in a sandbox. Answers {\"entries\": [{name, kind, size, mode, mtime_unix}]}."
    )]
    async fn list_files(&self, Parameters(p): Parameters<ListFilesInput>) -> ToolResult {
        let id = segment(&p.sandbox_id)?;
        let path = guest_path(&p.path)?;
        let v: Value = self
            .client
            .get(&format!("/v1/sandboxes/{id}/files/list?path={path}"))
            .await
            .map_err(text)?;
        Ok(structured(v))
    }

    /// Snapshot a running sandbox.
    #[tool(
        description = "Branch a running sandbox: snapshot it (memory and disk) under a new tag that `spawn` can start sandboxes from. The sandbox keeps running. Answers the new snapshot's SnapshotInfo."
    )]
    async fn branch(&self, Parameters(p): Parameters<BranchInput>) -> ToolResult {
        let id = segment(&p.sandbox_id)?;
        let mut body = json!({ "mode": p.mode.unwrap_or_else(|| "live".into()) });
        set(&mut body, "tag", p.tag);
        let v: Value = self
            .client
            .post(&format!("/v1/sandboxes/{id}/branch"), body)
            .await
            .map_err(text)?;
        Ok(structured(v))
    }

    /// Destroy a sandbox.
    #[tool(description = "Kill a sandbox: its VM, disk and memory are gone.")]
    async fn kill(&self, Parameters(p): Parameters<SandboxInput>) -> ToolResult {
        let id = segment(&p.sandbox_id)?;
        self.client
            .delete(&format!("/v1/sandboxes/{id}"))
            .await
            .map_err(text)?;
        Ok(structured(json!({ "killed": id })))
    }

    /// The sandboxes poold runs.
    #[tool(description = "List running sandboxes. Answers {\"sandboxes\": [SandboxInfo]}.")]
    async fn list_sandboxes(&self) -> ToolResult {
        let v: Value = self.client.get("/v1/sandboxes").await.map_err(text)?;
        Ok(structured(json!({ "sandboxes": v })))
    }

    /// The snapshots poold has.
    #[tool(
        description = "List snapshots sandboxes can be spawned from. Answers {\"snapshots\": [SnapshotInfo]}."
    )]
    async fn list_snapshots(&self) -> ToolResult {
        let v: Value = self.client.get("/v1/snapshots").await.map_err(text)?;
        Ok(structured(json!({ "snapshots": v })))
    }

    /// One snapshot in detail.
    #[tool(
        description = "Details of one snapshot: sizes, parent chain, what each link stores, the config it was made with."
    )]
    async fn snapshot_info(&self, Parameters(p): Parameters<SnapshotInput>) -> ToolResult {
        let tag = segment(&p.tag)?;
        let v: Value = self
            .client
            .get(&format!("/v1/snapshots/{tag}/info"))
            .await
            .map_err(text)?;
        Ok(structured(v))
    }

    /// The warm pools.
    #[tool(
        description = "List warm pools (paused sandboxes kept ready per snapshot). Answers {\"pools\": [{tag, min_ready, max_ready, warm, warm_eval, page_out, keep_resident, ready, resident, in_flight, hits, misses}]}."
    )]
    async fn list_pools(&self) -> ToolResult {
        let v: Value = self.client.get("/v1/pools").await.map_err(text)?;
        Ok(structured(json!({ "pools": v })))
    }

    /// Size a warm pool.
    #[tool(
        description = "Set how many paused sandboxes of a snapshot poold keeps ready, so spawns from it are pool hits. Answers the pool's status."
    )]
    async fn set_pool(&self, Parameters(p): Parameters<SetPoolInput>) -> ToolResult {
        let tag = segment(&p.tag)?;
        let mut body = json!({ "min_ready": p.min_ready });
        set(&mut body, "max_ready", p.max_ready);
        set(&mut body, "warm", p.warm);
        let v: Value = self
            .client
            .put(&format!("/v1/pools/{tag}"), body)
            .await
            .map_err(text)?;
        Ok(structured(v))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Forkd {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("forkd", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "forkd runs sandboxes: microVMs started in milliseconds from warm snapshots. \
                 list_snapshots, then spawn from one; exec commands and eval Python in the \
                 sandbox; read_file/write_file/list_files move files; branch snapshots a running \
                 sandbox so new ones can start from its state; kill it when done.",
            )
    }
}

impl Forkd {
    /// A request whose answer is bytes rather than JSON.
    async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Vec<u8>, String> {
        let (status, bytes) = match body {
            Some(b) => self.client.send_bytes(method, path, b).await,
            None => self.client.send(method, path, None).await,
        }
        .map_err(text)?;
        if !status.is_success() {
            let msg = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|v| v["error"].as_str().map(String::from))
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string());
            return Err(format!("poold answered {}: {msg}", status.as_u16()));
        }
        Ok(bytes.to_vec())
    }
}

/// One stream's output kept for the result: the first
/// [`MAX_KEPT_OUTPUT`] bytes, and how many more there were.
#[derive(Default)]
struct Kept {
    text: String,
    dropped: u64,
}

impl Kept {
    fn push(&mut self, s: &str) {
        let room = MAX_KEPT_OUTPUT.saturating_sub(self.text.len());
        let mut take = s.len().min(room);
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        self.text.push_str(&s[..take]);
        self.dropped += (s.len() - take) as u64;
    }
}

/// Sets `body[key]` when `v` is given.
fn set<T: serde::Serialize>(body: &mut Value, key: &str, v: Option<T>) {
    if let Some(v) = v {
        body[key] = json!(v);
    }
}

/// A successful result: `v` as structured content (and as text).
fn structured(v: Value) -> CallToolResult {
    CallToolResult::structured(v)
}

/// An error as the text of a tool error.
fn text(e: anyhow::Error) -> String {
    format!("{e:#}")
}

fn parse_json(bytes: &[u8]) -> Result<Value, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("poold's answer is not JSON: {e}"))
}

/// A sandbox id or tag as one URL path segment: `[A-Za-z0-9_-]{1,64}`,
/// so it cannot change the path.
pub fn segment(s: &str) -> Result<&str, String> {
    if s.is_empty()
        || s.len() > 64
        || !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!(
            "{s:?} is not a valid sandbox id or tag (1-64 of A-Z a-z 0-9 _ -)"
        ));
    }
    Ok(s)
}

/// A guest path, checked (absolute, no NUL) and percent-encoded for a
/// query string.
pub fn guest_path(p: &str) -> Result<String, String> {
    if !p.starts_with('/') || p.contains('\0') {
        return Err(format!(
            "path {p:?} must be absolute (start with '/') and contain no NUL"
        ));
    }
    Ok(query_escape(p))
}

/// Percent-encodes everything but RFC 3986's unreserved characters and `/`.
fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_paths_cannot_escape_their_url_part() {
        assert!(segment("sb-0123abc").is_ok());
        for bad in ["", "../x", "a/b", "a?b", "a b", &"x".repeat(65)] {
            assert!(segment(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            guest_path("/tmp/a b&c=d#e").unwrap(),
            "/tmp/a%20b%26c%3Dd%23e"
        );
        assert_eq!(guest_path("/é").unwrap(), "/%C3%A9");
        assert!(guest_path("tmp/x").is_err());
        assert!(guest_path("/a\0b").is_err());
    }

    #[test]
    fn kept_output_is_bounded_and_counts_what_it_drops() {
        let mut k = Kept::default();
        k.push(&"a".repeat(MAX_KEPT_OUTPUT - 1));
        k.push("éé");
        assert_eq!(k.text.len(), MAX_KEPT_OUTPUT - 1, "no half character");
        assert_eq!(k.dropped, 4);
        // The byte of room left takes the next character that fits.
        k.push("xyz");
        assert_eq!(k.text.len(), MAX_KEPT_OUTPUT);
        assert_eq!(k.dropped, 6);
    }

    #[test]
    fn every_tool_is_listed_with_an_object_schema() {
        let f = Forkd::new(Client::new("http://127.0.0.1:1", None).unwrap());
        let tools = f.tool_router.list_all();
        let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "branch",
                "eval",
                "exec",
                "kill",
                "list_files",
                "list_pools",
                "list_sandboxes",
                "list_snapshots",
                "read_file",
                "set_pool",
                "snapshot_info",
                "spawn",
                "write_file"
            ]
        );
        for t in &tools {
            assert_eq!(
                t.input_schema.get("type"),
                Some(&json!("object")),
                "{}",
                t.name
            );
        }
        let exec = tools.iter().find(|t| t.name == "exec").unwrap();
        let props = exec.input_schema["properties"].as_object().unwrap();
        assert!(props.contains_key("sandbox_id") && props.contains_key("cmd"));
    }

    #[tokio::test]
    async fn an_unreachable_poold_is_a_tool_error_that_says_so() {
        let f = Forkd::new(Client::new("http://127.0.0.1:1", None).unwrap());
        let e = f.list_sandboxes().await.unwrap_err();
        assert!(e.contains("is poold running?"), "{e}");
    }
}
