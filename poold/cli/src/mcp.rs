//! `forkd mcp`: the MCP server (crate `forkd-mcp`) over stdio, or over
//! streamable HTTP with `--http ADDR`. A client of poold like the other
//! sandbox commands ($FORKD_URL, $FORKD_TOKEN).

use anyhow::Result;
use clap::Args;
use forkd_api::Client;
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct McpArgs {
    /// Serve streamable HTTP at http://ADDR/mcp instead of stdio
    /// (e.g. 127.0.0.1:8890; off loopback it needs --token-file).
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// File holding the bearer token HTTP clients must send.
    #[arg(long, value_name = "FILE", requires = "http")]
    pub token_file: Option<PathBuf>,
    /// Accept this `Host` name over HTTP besides loopback and the bound
    /// address (repeatable).
    #[arg(long = "allow-host", value_name = "NAME", requires = "http")]
    pub allow_host: Vec<String>,
    /// Accept requests carrying this browser `Origin`
    /// (scheme://host:port; repeatable). None by default.
    #[arg(long = "allow-origin", value_name = "ORIGIN", requires = "http")]
    pub allow_origin: Vec<String>,
}

pub async fn run(a: McpArgs) -> Result<i32> {
    let client = Client::from_env()?;
    let Some(bind) = a.http else {
        forkd_mcp::serve_stdio(client).await?;
        return Ok(0);
    };
    let token = match &a.token_file {
        Some(f) => {
            let t = forkd_hub::auth::read_token_file(f)?;
            forkd_hub::auth::check_token(&t)?;
            Some(t)
        }
        None => None,
    };
    let opts = forkd_mcp::HttpOptions {
        bind,
        token,
        allow_hosts: a.allow_host,
        allow_origins: a.allow_origin,
    };
    forkd_mcp::serve_http(client, opts, |addr| {
        println!("forkd mcp listening on http://{addr}/mcp");
    })
    .await?;
    Ok(0)
}
