//! forkd's MCP server (`forkd mcp`): a running poold's sandboxes as Model
//! Context Protocol tools, so an MCP client (an AI agent's host) can spawn
//! sandboxes, run commands and Python in them, move files, branch and kill
//! them, and see snapshots and pools.
//!
//! It is a client of poold like the rest of the `forkd` CLI ($FORKD_URL,
//! $FORKD_TOKEN, through [`forkd_api::Client`]), not part of the daemon: it
//! holds no state of its own, and every tool call is one or a few poold
//! requests. poold stays the one place that validates and authorizes; the
//! tools check only what they put into a URL (ids, tags, guest paths).
//!
//! - [`tools`]: the tools, their input schemas and how answers map to
//!   results (a poold error is a tool error carrying poold's message);
//! - [`http`]: the streamable HTTP transport (`--http ADDR`), with the
//!   `Host`/`Origin` checks against DNS rebinding and a bearer token;
//! - [`serve_stdio`]: the stdio transport (stdout carries only protocol
//!   messages; logs go to stderr).
//!
//! Reference: docs/mcp.md.

#![warn(missing_docs)]

pub mod http;
pub mod tools;

pub use http::{serve_http, HttpOptions};
pub use tools::Forkd;

use anyhow::{Context, Result};
use rmcp::ServiceExt;

/// Serves MCP over stdin/stdout until the client closes stdin.
pub async fn serve_stdio(client: forkd_api::Client) -> Result<()> {
    let running = Forkd::new(client)
        .serve(rmcp::transport::stdio())
        .await
        .context("starting the MCP session on stdio")?;
    running.waiting().await.context("serving MCP on stdio")?;
    Ok(())
}
