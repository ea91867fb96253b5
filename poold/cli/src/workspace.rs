//! `forkd workspace create|suspend|resume|list|get|delete`: named sandboxes
//! that suspend to a snapshot and resume from it (docs/workspaces.md),
//! through a running poold (`$FORKD_URL`, `$FORKD_TOKEN`).

use super::sandbox::{path_part, SandboxSettings};
use anyhow::Result;
use clap::{Args, Subcommand};
use forkd_api::{Client, CreateWorkspaceBody, WorkspaceInfo};
use serde_json::json;

#[derive(Subcommand, Debug)]
pub enum WorkspaceCmd {
    /// Create a workspace: a sandbox from SNAPSHOT that can be suspended and resumed.
    Create(CreateArgs),
    /// Store the workspace's state (only what changed) and stop its sandbox.
    Suspend { name: String },
    /// Start the workspace again from its latest state, with its settings.
    Resume { name: String },
    /// List workspaces.
    #[command(alias = "ls")]
    List {
        #[arg(long)]
        json: bool,
    },
    /// Show one workspace as JSON.
    Get { name: String },
    /// Delete a workspace: its sandbox and its states (the source snapshot stays).
    #[command(alias = "rm")]
    Delete { name: String },
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// The workspace's name.
    pub name: String,
    /// Tag of the snapshot to start from.
    #[arg(long)]
    pub tag: String,
    #[command(flatten)]
    pub settings: SandboxSettings,
    /// Print the JSON answer.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(cmd: WorkspaceCmd) -> Result<i32> {
    let c = Client::from_env()?;
    let path =
        |name: &str| -> Result<String> { Ok(format!("/v1/workspaces/{}", path_part(name)?)) };
    match cmd {
        WorkspaceCmd::Create(a) => {
            let mut body = json!({"name": a.name, "snapshot_tag": a.tag});
            a.settings.apply(&mut body)?;
            // The API's own type checks the body's shape before it is sent.
            let body: CreateWorkspaceBody = serde_json::from_value(body)?;
            let w: WorkspaceInfo = c
                .post("/v1/workspaces", serde_json::to_value(body)?)
                .await?;
            show(&w, a.json)?;
        }
        WorkspaceCmd::Suspend { name } => {
            let w: WorkspaceInfo = c
                .post(&format!("{}/suspend", path(&name)?), json!({}))
                .await?;
            println!(
                "suspended {} into {}{}",
                w.name,
                w.current_state_tag.as_deref().unwrap_or("-"),
                w.last_suspend_stored_bytes
                    .map(|b| format!(" ({} new in the store)", forkd_snapshot::mib(b)))
                    .unwrap_or_default()
            );
        }
        WorkspaceCmd::Resume { name } => {
            let w: WorkspaceInfo = c
                .post(&format!("{}/resume", path(&name)?), json!({}))
                .await?;
            show(&w, false)?;
        }
        WorkspaceCmd::List { json } => {
            let all: Vec<WorkspaceInfo> = c.get("/v1/workspaces").await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
                return Ok(0);
            }
            println!(
                "{:<24} {:<10} {:<28} {:<24}  LAST ACTIVE",
                "NAME", "STATUS", "SANDBOX", "STATE"
            );
            for w in &all {
                println!(
                    "{:<24} {:<10} {:<28} {:<24}  {}",
                    w.name,
                    w.status,
                    w.live_sandbox_id.as_deref().unwrap_or("-"),
                    w.current_state_tag.as_deref().unwrap_or("-"),
                    forkd_snapshot::format_unix(w.last_active_unix)
                );
            }
        }
        WorkspaceCmd::Get { name } => {
            let w: WorkspaceInfo = c.get(&path(&name)?).await?;
            show(&w, true)?;
        }
        WorkspaceCmd::Delete { name } => {
            c.delete(&path(&name)?).await?;
            println!("deleted workspace {name}");
        }
    }
    Ok(0)
}

fn show(w: &WorkspaceInfo, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(w)?);
    } else {
        println!(
            "{}\t{}\t{}",
            w.name,
            w.status,
            w.live_sandbox_id.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}
