//! forkd-agent: the guest's service. It serves the framed protocol on the
//! virtio-serial port named [`AGENT_PORT_NAME`], and forkd's line protocol on
//! TCP :8888 for compatibility.

pub mod ca;
pub mod compat;
pub mod config;
pub mod eval;
pub mod exec;
pub mod files;
pub mod identity;
pub mod port;
pub mod server;
pub mod tunnel;
pub mod users;
pub mod watch;
pub mod xattrs;

use crate::protocol::{FrameDecoder, AGENT_PORT_NAME};
use anyhow::Context;
use server::{Agent, Outbox};
use std::sync::Arc;
use std::time::Duration;

/// Entry point of the forkd-agent binary.
pub fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let cfg = config::AgentConfig::load();
    // Before the warm interpreter starts, so it inherits them too.
    ca::restore_env();
    eval::install_native_helpers();
    let interp = eval::Interpreter::new(
        cfg.lang,
        cfg.interpreter(),
        &cfg.warmup_imports,
        cfg.warmup_code.as_deref(),
    );
    let agent = Agent::new(interp.clone());
    tokio::spawn(async move { interp.start().await });
    if let Some(argv) = cfg.warmup_cmd.clone() {
        spawn_warmup_cmd(argv);
    }
    if cfg.compat_port != 0 {
        tokio::spawn(compat::serve(agent.clone(), cfg.compat_port));
    }
    let path = wait_for_port().await?;
    eprintln!("forkd-agent {}: serving {}", crate::VERSION, path.display());
    serve_port(agent, &path).await
}

/// The port appears once virtio_console has probed; give it a few seconds.
async fn wait_for_port() -> anyhow::Result<std::path::PathBuf> {
    let mut last = None;
    for _ in 0..100 {
        match port::find(AGENT_PORT_NAME) {
            Ok(p) if p.exists() => return Ok(p),
            Ok(p) => last = Some(anyhow::anyhow!("{} has no device node", p.display())),
            Err(e) => last = Some(e.into()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(last.unwrap()).context("agent port not found")
}

/// Serves the port forever, surviving host disconnects and garbage.
async fn serve_port(agent: Arc<Agent>, path: &std::path::Path) -> anyhow::Result<()> {
    let port =
        Arc::new(port::Port::open(path).with_context(|| format!("opening {}", path.display()))?);
    let (outbox, mut rx) = Outbox::new();
    let wport = port.clone();
    tokio::spawn(async move {
        while let Some(f) = rx.recv().await {
            let mut r = wport.write_all(&f.head).await;
            if r.is_ok() && !f.payload.is_empty() {
                r = wport.write_all(&f.payload).await;
            }
            if let Err(e) = r {
                eprintln!("forkd-agent: write to port: {e}");
            }
        }
    });
    let mut dec = FrameDecoder::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut connected = false;
    loop {
        match port.read(&mut buf).await {
            Ok(0) => {
                // Host not connected: drop any partial frame and wait for it.
                // Its tunnels will never be closed by it: close them now.
                if std::mem::take(&mut connected) {
                    agent.tunnels.abort_all();
                }
                dec.reset();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(n) => {
                connected = true;
                dec.extend(&buf[..n]);
                agent.pump(&mut dec, &outbox);
            }
            Err(e) => {
                eprintln!("forkd-agent: read from port: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// forkd's FORKD_WARMUP_CMD: a long-lived helper started with the agent.
fn spawn_warmup_cmd(argv: Vec<String>) {
    if argv.is_empty() {
        return;
    }
    match std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .spawn()
    {
        Ok(c) => eprintln!("forkd-agent: started warm-up command pid {}", c.id()),
        Err(e) => eprintln!("forkd-agent: warm-up command {:?}: {e}", argv[0]),
    }
}
