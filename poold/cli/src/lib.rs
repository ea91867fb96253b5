//! The `forkd` command line. Each subcommand lives in its own module; errors
//! print as one line (`error: what: why`) without a backtrace.

pub mod bench;
pub mod doctor;
pub mod fork;
pub mod hub;
pub mod image;
pub mod mcp;
pub mod run;
pub mod sandbox;
pub mod shell;
pub mod snapshot;
pub mod store;
pub mod workspace;

use clap::{Parser, Subcommand};
use forkd_snapshot::Paths;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "forkd",
    version,
    about = "microVM sandboxes that fork from warm snapshots"
)]
pub struct Cli {
    /// Data dir (default /var/lib/forkd).
    #[arg(long, env = "FORKD_HOME", global = true)]
    pub home: Option<PathBuf>,
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Boot a fresh VM from an image, run one command in it, and exit with its status.
    Run(run::RunArgs),
    /// Build and list guest images.
    #[command(subcommand)]
    Image(image::ImageCmd),
    /// Create, list, inspect and delete warm snapshots.
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCmd),
    /// Restore N copy-on-write children from a snapshot and report per-phase timings.
    Fork(fork::ForkArgs),
    /// Upload a snapshot, and whatever of its parent chain the hub lacks, to a hub.
    Push(hub::PushArgs),
    /// Download a snapshot, and whatever of its parent chain is missing, from a hub.
    Pull(hub::PullArgs),
    /// Write a snapshot and its parent chain into one self-contained file.
    Pack(hub::PackArgs),
    /// Verify and import a file written by `forkd pack`.
    Unpack(hub::UnpackArgs),
    /// Serve a snapshot hub over HTTP, or benchmark hub transfers.
    #[command(subcommand)]
    Hub(hub::HubCmd),
    /// Inspect and maintain the layer store (stats, verify, gc, ls).
    #[command(subcommand)]
    Store(store::StoreCmd),
    /// Spawn sandboxes through poold ($FORKD_URL, $FORKD_TOKEN).
    Spawn(sandbox::SpawnArgs),
    /// List poold's sandboxes.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Delete sandboxes.
    Kill {
        ids: Vec<String>,
        /// Every sandbox poold runs.
        #[arg(long)]
        all: bool,
    },
    /// Run a command in a sandbox; exits with its status.
    Exec(sandbox::ExecArgs),
    /// An interactive terminal in a sandbox (a login shell, or CMD).
    Shell(shell::ShellArgs),
    /// Evaluate Python in a sandbox's warm interpreter.
    Eval { id: String, code: String },
    /// Snapshot a running sandbox (live: a pause of milliseconds).
    Branch(sandbox::BranchArgs),
    /// Show and size poold's warm pools.
    #[command(subcommand)]
    Pool(sandbox::PoolCmd),
    /// Serve poold's sandboxes as MCP tools (stdio, or streamable HTTP with --http).
    Mcp(mcp::McpArgs),
    /// Named sandboxes that suspend to a snapshot and resume (docs/workspaces.md).
    #[command(subcommand)]
    Workspace(workspace::WorkspaceCmd),
    /// Benchmarks (they print numbers; see docs/BENCHMARKS.md).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Check this host for what forkd needs (PASS/WARN/FAIL, each with a fix); exits 1 on a FAIL.
    Doctor(doctor::DoctorArgs),
}

impl Cli {
    fn paths(&self) -> Paths {
        match &self.home {
            Some(h) => Paths::new(h),
            None => Paths::from_env(),
        }
    }
}

/// Entry point of the `forkd` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return fail(&anyhow::anyhow!("starting the async runtime: {e}")),
    };
    let paths = cli.paths();
    let result = rt.block_on(async move {
        match cli.cmd {
            Command::Run(a) => run::run(&paths, a).await,
            Command::Image(c) => image::run(&paths, c).await.map(|()| 0),
            Command::Snapshot(c) => snapshot::run(&paths, c).await,
            Command::Fork(a) => fork::run(&paths, a).await,
            Command::Push(a) => hub::push(&paths, a).await.map(|()| 0),
            Command::Pull(a) => hub::pull(&paths, a).await.map(|()| 0),
            Command::Pack(a) => hub::pack(&paths, a).await.map(|()| 0),
            Command::Unpack(a) => hub::unpack(&paths, a).await.map(|()| 0),
            Command::Hub(c) => hub::run(&paths, c).await.map(|()| 0),
            Command::Store(c) => store::run(&paths, c).await,
            Command::Spawn(a) => sandbox::spawn(a).await,
            Command::Ls { json } => sandbox::ls(json).await,
            Command::Kill { ids, all } => sandbox::kill(ids, all).await,
            Command::Exec(a) => sandbox::exec(a).await,
            Command::Shell(a) => shell::shell(a).await,
            Command::Eval { id, code } => sandbox::eval(id, code).await,
            Command::Pool(c) => sandbox::pool(c).await,
            Command::Branch(a) => sandbox::branch(a).await,
            Command::Mcp(a) => mcp::run(a).await,
            Command::Workspace(c) => workspace::run(c).await,
            Command::Bench(c) => bench::run(&paths, c).await,
            Command::Doctor(a) => doctor::run(&paths, a).await,
        }
    });
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => fail(&e),
    }
}

fn fail(e: &anyhow::Error) -> ExitCode {
    eprintln!("error: {e:#}");
    ExitCode::FAILURE
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FORKD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
