//! `forkd snapshot create|ls|info|rm`.

use anyhow::{anyhow, bail, Result};
use clap::{Args, Subcommand};
use forkd_snapshot::create::{create, CreateSpec, ImageSource};
use forkd_snapshot::delete::{delete, Dependents};
use forkd_snapshot::info::detail;
use forkd_snapshot::mib;
use forkd_snapshot::Paths;
use forkd_vmm::AccelChoice;
use forkd_vmm::Lifetime;

#[derive(Subcommand, Debug)]
pub enum SnapshotCmd {
    /// Boot a parent from an image, warm it up, and snapshot it into the store.
    Create(CreateArgs),
    /// List tagged snapshots.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a snapshot's chain, files, per-link stored bytes and VM config.
    Info {
        /// Tag or snapshot id.
        tag: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Restore a child of BASE, run a command in it, and snapshot the result
    /// as a child of BASE (a chain link that stores only what changed).
    Diff {
        /// The snapshot to start from (tag or id).
        #[arg(long)]
        from: String,
        /// Tag for the new snapshot.
        #[arg(long)]
        tag: String,
        /// Shell command to run first (must exit 0).
        #[arg(long)]
        exec: String,
        /// Seconds the command may run.
        #[arg(long, default_value_t = 600.0)]
        timeout: f64,
    },
    /// Delete a snapshot (refused while running children map it).
    Rm {
        /// Tag or snapshot id.
        tag: String,
        /// Also delete every snapshot derived from it.
        #[arg(long, conflicts_with = "force")]
        cascade: bool,
        /// Delete it even though snapshots derive from it (they stay usable).
        #[arg(long)]
        force: bool,
    },
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Tag for the new snapshot (1-64 of A-Z a-z 0-9 _ -).
    #[arg(long)]
    pub tag: String,
    /// Image to boot (see `forkd image ls`).
    #[arg(long)]
    pub image: String,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 512)]
    pub mem: u64,
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// auto picks KVM only where it can run a Linux guest.
    #[arg(long, env = "FORKD_ACCEL", default_value = "auto")]
    pub accel: AccelChoice,
    /// Shell command to run in the parent before the snapshot (must exit 0).
    #[arg(long)]
    pub warmup: Option<String>,
    /// Python to run in the warm interpreter before the snapshot (e.g. "import numpy").
    #[arg(long)]
    pub eval_warmup: Option<String>,
    /// Move the tag if it already names a snapshot.
    #[arg(long)]
    pub force: bool,
    /// Give the guest a NIC, so its children get a network each
    /// (docs/network.md). The default for python images.
    #[arg(long, conflicts_with = "no_net")]
    pub net: bool,
    /// No NIC: children are reached only through the agent.
    #[arg(long)]
    pub no_net: bool,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
    /// Mount a host folder in the parent: HOST:GUEST[:ro|rw] (repeatable).
    /// Children get it too, unless their spawn rebinds it (docs/volumes.md).
    #[arg(long = "volume", value_name = "HOST:GUEST[:ro|rw]")]
    pub volumes: Vec<String>,
    /// PEM file of extra CA certificates the parent (its warm-up) and every
    /// child trust, e.g. a TLS-inspecting proxy's (docs/network.md).
    #[arg(long = "ca-cert", value_name = "PEM")]
    pub ca_cert: Option<std::path::PathBuf>,
}

pub async fn run(paths: &Paths, cmd: SnapshotCmd) -> Result<i32> {
    match cmd {
        SnapshotCmd::Create(a) => create_cmd(paths, a).await,
        SnapshotCmd::Ls { json } => ls(paths, json).await,
        SnapshotCmd::Info { tag, json } => info(paths, tag, json).await,
        SnapshotCmd::Diff {
            from,
            tag,
            exec,
            timeout,
        } => diff(paths, &from, &tag, &exec, timeout).await,
        SnapshotCmd::Rm {
            tag,
            cascade,
            force,
        } => {
            let deps = Dependents::from_flags(cascade, force);
            let p = paths.clone();
            // Deleting releases references; the GC right after frees the
            // space (a chunk another snapshot uses is never freed).
            let (reports, gc) = forkd_snapshot::store::with_rw(paths, move |store| {
                let reports = delete(&p, store, &tag, deps)?;
                Ok((reports, store.gc()?))
            })
            .await?;
            for r in reports {
                println!(
                    "deleted snapshot {}{} ({} of chunks released)",
                    r.id,
                    if r.tags_removed.is_empty() {
                        String::new()
                    } else {
                        format!(" [{}]", r.tags_removed.join(", "))
                    },
                    mib(r.stored_bytes_released)
                );
            }
            println!("store GC reclaimed {} of disk", mib(gc.bytes_reclaimed));
            for p in gc.problems {
                eprintln!("warning: store GC: {p} (run `forkd store verify`)");
            }
            Ok(0)
        }
    }
}

async fn create_cmd(paths: &Paths, a: CreateArgs) -> Result<i32> {
    let net = forkd_snapshot::create::default_net(&a.image, a.net, a.no_net);
    let spec = CreateSpec {
        tag: a.tag,
        net,
        image: ImageSource::Named(a.image),
        mem_mib: a.mem,
        vcpus: a.vcpus,
        accel: a.accel.resolve()?,
        warmup_cmd: a.warmup,
        eval_warmup: a.eval_warmup,
        replace_tag: a.force,
        lifetime: Lifetime::Ephemeral,
        verbose: !a.quiet,
        volumes: super::run::local_volumes(&a.volumes)?,
        ca: a
            .ca_cert
            .as_deref()
            .map(forkd_snapshot::ca::CaBundle::read)
            .transpose()?,
    };
    let tag = spec.tag.clone();
    let c = tokio::select! {
        r = create(paths, spec) => r?,
        _ = tokio::signal::ctrl_c() => bail!("interrupted; nothing was committed"),
    };
    let t = &c.timings;
    println!(
        "snapshot {tag} = {} (memory {}, disk {}; {} new in the store)",
        c.record.id,
        mib(c.record.files["memory.bin"].size),
        mib(c.record.files["rootfs.img"].size),
        mib(c.new_stored_bytes)
    );
    println!(
        "boot {} ms, warm-up {} ms, pause+save {} ms, ingest {} ms, total {} ms",
        t.boot_ms, t.warmup_ms, t.save_ms, t.ingest_ms, t.total_ms
    );
    Ok(0)
}

async fn ls(paths: &Paths, json: bool) -> Result<i32> {
    let rows = forkd_snapshot::store::with_rw(paths, |store| {
        let mut rows = Vec::new();
        for (tag, id) in store.tags()? {
            let rec = store
                .snapshot(&id)?
                .ok_or_else(|| anyhow!("tag {tag} names missing snapshot {id}"))?;
            let parent = rec.parent.map(|p| forkd_snapshot::info::label(store, &p));
            let res = forkd_snapshot::info::residency(store, &rec)?;
            rows.push((tag, rec, parent, res));
        }
        Ok(rows)
    })
    .await?;
    if json {
        let v: Vec<_> = rows
            .iter()
            .map(|(tag, rec, parent, res)| {
                serde_json::json!({
                    "tag": tag, "id": rec.id.to_string(), "parent": parent,
                    "created_at_unix": rec.created_at_unix,
                    "image": rec.config.get("image"),
                    "memory_bytes": rec.files.get("memory.bin").map(|f| f.size),
                    "local_bytes": res.local_bytes, "remote_bytes": res.remote_bytes,
                    "lazy_source": res.source,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    println!(
        "{:<24} {:<32}  {:<24} {:<14} {:>9} {:>9} {:>9}  CREATED",
        "TAG", "ID", "PARENT", "IMAGE", "MEMORY", "LOCAL", "REMOTE"
    );
    for (tag, rec, parent, res) in &rows {
        println!(
            "{:<24} {:<32}  {:<24} {:<14} {:>9} {:>9} {:>9}  {}",
            tag,
            rec.id.to_string(),
            parent.as_deref().unwrap_or("-"),
            rec.config
                .get("image")
                .and_then(|v| v.as_str())
                .unwrap_or("-"),
            rec.files
                .get("memory.bin")
                .map_or("-".into(), |f| format!("{}M", f.size >> 20)),
            format!("{:.1}M", res.local_bytes as f64 / (1 << 20) as f64),
            format!("{:.1}M", res.remote_bytes as f64 / (1 << 20) as f64),
            forkd_snapshot::format_unix(rec.created_at_unix)
        );
    }
    Ok(0)
}

async fn info(paths: &Paths, tag: String, json: bool) -> Result<i32> {
    let d = forkd_snapshot::store::with_rw(paths, move |store| {
        let rec = store
            .resolve(&tag)?
            .ok_or_else(|| anyhow!("no snapshot {tag:?} (see `forkd snapshot ls`)"))?;
        detail(store, &rec)
    })
    .await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&d)?);
        return Ok(0);
    }
    println!("id:          {}", d.id);
    println!("tags:        {}", d.tags.join(", "));
    println!(
        "created:     {}",
        forkd_snapshot::format_unix(d.created_at_unix)
    );
    println!("chain depth: {}", d.chain_depth);
    for (i, l) in d
        .ancestors
        .iter()
        .chain(std::iter::once(&d.this))
        .enumerate()
    {
        println!(
            "  {i:>3}  {:<32}  {:<20} stores {} ({} raw)",
            l.id,
            l.tags.join(","),
            mib(l.unique_stored_bytes),
            mib(l.unique_raw_bytes)
        );
    }
    println!(
        "dependents:  {}",
        if d.dependents.is_empty() {
            "-".into()
        } else {
            d.dependents.join(", ")
        }
    );
    for (name, f) in &d.files {
        println!(
            "file {name:<11} {} ({} zero)",
            mib(f.size),
            mib(f.zero_bytes)
        );
    }
    let r = &d.residency;
    println!(
        "stored:      {} local, {} remote ({} of {} chunks local){}",
        mib(r.local_bytes),
        mib(r.remote_bytes),
        r.local_chunks,
        r.chunks,
        r.source
            .as_ref()
            .map_or(String::new(), |s| format!("; lazy, filling from {s}"))
    );
    match (r.working_set_chunks, r.working_set_local) {
        (Some(n), Some(l)) => println!(
            "working set: {n} chunks ({}), {l} local",
            mib(r.working_set_bytes.unwrap_or(0))
        ),
        _ => println!("working set: not recorded yet (its first restore records it)"),
    }
    println!("config:      {}", d.config);
    if !d.lineage.is_empty() {
        println!("lineage:     {}", serde_json::to_string(&d.lineage)?);
    }
    Ok(0)
}

/// `forkd snapshot diff`: a child of `from` runs `cmd`, then is branched.
async fn diff(paths: &Paths, from: &str, tag: &str, cmd: &str, timeout: f64) -> Result<i32> {
    use forkd_snapshot::{branch, restore};
    forkd_layers::validate_tag(tag)?;
    forkd_vmm::check_qemu()?;
    forkd_vmm::sweep(&paths.vms_dir()).await;
    let mount = forkd_snapshot::ensure_mount_async(paths).await?.mountpoint;
    let parent = restore::read_record(&mount, from)?;
    let src = restore::Source::new(&mount, &parent)?;
    let id = format!("diff-{}", forkd_snapshot::random_hex(6));
    let mut t = restore::ChildTimings::default();
    let mut vm = restore::restore_paused(paths, &src, &id, Lifetime::Ephemeral, &mut t).await?;
    let result = async {
        let bare = restore::Identity::Bare;
        let now = std::time::Instant::now();
        restore::hand_out(&mut vm, &id, bare, None, None, now, &mut t).await?;
        eprintln!("==> running {cmd:?} in a child of {from}");
        let out = vm
            .agent
            .exec(
                rootfs_init::protocol::ExecSpec {
                    shell: Some(cmd.to_string()),
                    timeout_ms: Some((timeout * 1000.0) as u64),
                    ..Default::default()
                },
                &[],
            )
            .await?;
        eprint!("{}", String::from_utf8_lossy(&out.stdout));
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        if out.result.status_code() != 0 {
            bail!(
                "the command exited with status {}; nothing was snapshotted",
                out.result.status_code()
            );
        }
        eprintln!("==> snapshotting the result as {tag}");
        let mut lineage = std::collections::BTreeMap::new();
        lineage.insert("derived_by".into(), serde_json::json!("snapshot diff"));
        lineage.insert("exec".into(), serde_json::json!(cmd));
        branch::branch(
            paths,
            &mount,
            &vm,
            &parent,
            tag,
            branch::Mode::Live,
            lineage,
        )
        .await
    }
    .await;
    vm.destroy().await;
    let b = result?;
    println!(
        "snapshot {tag} = {} (child of {from}; {} new in the store; pause {:.1} ms, {} ms in all)",
        b.record.id,
        mib(b.new_stored_bytes),
        b.pause_ms,
        b.total_ms
    );
    Ok(0)
}
