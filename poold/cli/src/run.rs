//! `forkd run --image NAME -- CMD...`: boot a throwaway VM, run one command
//! with its output streamed, exit with its status, clean up.

use anyhow::{bail, Result};
use clap::Args;
use forkd_snapshot::boot::{cold_boot, BootSpec};
use forkd_snapshot::images::Image;
use forkd_snapshot::Paths;
use forkd_vmm::AccelChoice;
use forkd_vmm::{AgentClient, Lifetime, Machine, Memory};
use rootfs_init::protocol::{ExecResult, ExecSpec, Reply};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::Instant;
use tokio::io::AsyncReadExt;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Image to boot (see `forkd image ls`).
    #[arg(long, default_value = "minimal")]
    pub image: String,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 512)]
    pub mem: u64,
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// auto picks KVM only where it can run a Linux guest.
    #[arg(long, env = "FORKD_ACCEL", default_value = "auto")]
    pub accel: AccelChoice,
    /// Extra environment for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Working directory in the guest.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Kill the command (and its process group) after this many seconds.
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Print boot and run timings to stderr.
    #[arg(long, short)]
    pub verbose: bool,
    /// Mount a host folder: HOST:GUEST[:ro|rw] (repeatable; docs/volumes.md).
    #[arg(long = "volume", value_name = "HOST:GUEST[:ro|rw]")]
    pub volumes: Vec<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

/// Runs the command; returns its shell-style status.
pub async fn run(paths: &Paths, a: RunArgs) -> Result<i32> {
    let env = parse_env(&a.env)?;
    if a.mem < 64 || a.vcpus == 0 || a.vcpus > 64 {
        bail!("--mem must be at least 64 MiB and --vcpus 1-64");
    }
    forkd_vmm::check_qemu()?;
    forkd_vmm::sweep(&paths.vms_dir()).await;
    let image = Image::load(&paths.images_dir(), &a.image)?;
    let mut machine = Machine::new(a.accel.resolve()?, a.mem, a.vcpus);
    let volumes = local_volumes(&a.volumes)?;
    machine.volumes = volumes.len() as u32;
    let t0 = Instant::now();
    let id = format!("run-{}", forkd_snapshot::random_hex(6));
    // vhost-user needs RAM virtiofsd can map: a shared file on tmpfs,
    // removed once QEMU has it mapped.
    let mut ram_dir = forkd_snapshot::restore::RamDir(None);
    let memory = if volumes.is_empty() {
        Memory::Anonymous
    } else {
        let dir = forkd_snapshot::restore::shared_ram_dir(&id);
        forkd_vmm::private::create_dir_all(&dir)?;
        ram_dir.0 = Some(dir.clone());
        Memory::Shared(dir.join("memory.bin"))
    };
    let vm = cold_boot(
        paths,
        BootSpec {
            id: id.clone(),
            rootfs: image.rootfs(),
            kernel: None,
            machine,
            memory,
            hostname: "forkd".into(),
            lifetime: Lifetime::Ephemeral,
            volumes,
        },
    )
    .await;
    drop(ram_dir);
    let vm = vm?;
    let booted = t0.elapsed();
    let spec = ExecSpec {
        argv: Some(a.cmd.clone()),
        env,
        cwd: a.cwd.clone(),
        timeout_ms: a.timeout.map(|s| (s * 1000.0) as u64),
        stdin_open: !std::io::stdin().is_terminal(),
        ..Default::default()
    };
    let outcome = tokio::select! {
        r = stream_exec(&vm.agent, spec) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    let ran = t0.elapsed() - booted;
    vm.destroy().await;
    let result = outcome?;
    if a.verbose {
        eprintln!(
            "forkd: boot {:.0} ms, command {:.0} ms, status {}",
            booted.as_secs_f64() * 1e3,
            ran.as_secs_f64() * 1e3,
            result.status_code()
        );
    }
    if result.timed_out {
        eprintln!("forkd: command timed out and was killed");
    }
    Ok(result.status_code())
}

/// Streams the command's output to ours and forwards our stdin to it.
async fn stream_exec(agent: &AgentClient, spec: ExecSpec) -> Result<ExecResult> {
    let forward_stdin = spec.stdin_open;
    let (id, mut rx) = agent.exec_stream(spec, &[])?;
    if forward_stdin {
        let agent = agent.clone();
        tokio::spawn(async move {
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stdin.read(&mut buf).await {
                    Ok(0) | Err(_) => {
                        let _ = agent.stdin(id, &[], true).await;
                        return;
                    }
                    Ok(n) => {
                        if agent.stdin(id, &buf[..n], false).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }
    while let Some((reply, payload)) = rx.recv().await {
        match reply {
            Reply::Stdout => {
                let mut o = std::io::stdout().lock();
                o.write_all(&payload)?;
                o.flush()?;
            }
            Reply::Stderr => {
                let mut e = std::io::stderr().lock();
                e.write_all(&payload)?;
                e.flush()?;
            }
            Reply::Started { .. } | Reply::Watch { .. } => {}
            Reply::Ok { result } => return Ok(serde_json::from_value(result)?),
            Reply::Error { error } => bail!("{error}"),
        }
    }
    bail!("the agent channel closed before the command finished")
}

fn parse_env(items: &[String]) -> Result<BTreeMap<String, String>> {
    items
        .iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => bail!("bad --env {kv:?}: expected KEY=VALUE"),
        })
        .collect()
}

/// `--volume HOST:GUEST[:ro|rw]` values for a VM this CLI starts itself
/// (as root, so no `volume_roots`): parsed, host paths resolved and
/// required to be directories, the list checked.
pub fn local_volumes(args: &[String]) -> Result<Vec<forkd_vmm::Volume>> {
    let vols = args
        .iter()
        .map(|s| {
            let mut v = forkd_vmm::Volume::parse(s)?;
            v.host_path = std::path::absolute(&v.host_path)?;
            v.canonical()
        })
        .collect::<Result<Vec<_>>>()?;
    forkd_vmm::volume::check_list(&vols)?;
    Ok(vols)
}
