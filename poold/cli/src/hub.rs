//! `forkd push|pull|pack|unpack` and `forkd hub serve|bench`: the snapshot
//! hub from the command line (see docs/hub.md).

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use forkd_hub::{self as hub, bench, pack, server, Hub, PullOptions, PushOptions};
use forkd_layers::{Store, StoreOptions};
use forkd_snapshot::mib;
use forkd_snapshot::Paths;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Options every transfer takes.
#[derive(Args, Debug, Clone)]
pub struct TransferArgs {
    /// Bearer token for an HTTP hub (first line of the file; default $FORKD_HUB_TOKEN).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Concurrent object transfers (default: 4 for file hubs, 16 for HTTP and S3).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
}

#[derive(Args, Debug)]
pub struct PushArgs {
    /// Snapshot tag (or id) in the local store.
    pub tag: String,
    /// file:///DIR, http(s)://HOST:PORT or s3://BUCKET/PREFIX.
    pub hub: String,
    /// Tag to set on the hub (default: TAG).
    #[arg(long = "as", value_name = "HUBTAG")]
    pub as_tag: Option<String>,
    /// Layout of a hub that is still empty: 2 (packs, default) or 1 (one
    /// object per chunk, for clients from before layouts). A hub with
    /// objects keeps its own.
    #[arg(long)]
    pub layout: Option<u32>,
    #[command(flatten)]
    pub transfer: TransferArgs,
}

#[derive(Args, Debug)]
pub struct PullArgs {
    /// file:///DIR, http(s)://HOST:PORT or s3://BUCKET/PREFIX.
    pub hub: String,
    /// Tag (or snapshot id) on the hub.
    pub tag: String,
    /// Local tag to set (default: TAG).
    #[arg(long = "as", value_name = "NEWTAG")]
    pub as_tag: Option<String>,
    /// Move the local tag if it points at another snapshot.
    #[arg(long)]
    pub force: bool,
    /// Refuse, before transferring, a snapshot whose QEMU version or machine differs from this host.
    #[arg(long)]
    pub strict: bool,
    /// Fetch only the records and manifests: forkd-fs fetches chunks when
    /// children read them (the working set first) and fills the rest in
    /// the background.
    #[arg(long)]
    pub lazy: bool,
    #[command(flatten)]
    pub transfer: TransferArgs,
}

#[derive(Args, Debug)]
pub struct PackArgs {
    /// Snapshot tag (or id) in the local store.
    pub tag: String,
    /// The pack file to write.
    #[arg(long, short)]
    pub output: PathBuf,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
}

#[derive(Args, Debug)]
pub struct UnpackArgs {
    /// A pack written by `forkd pack`.
    pub file: PathBuf,
    /// Local tag to set (default: the tag the pack was made from).
    #[arg(long = "as", value_name = "NEWTAG")]
    pub as_tag: Option<String>,
    /// Move the local tag if it points at another snapshot.
    #[arg(long)]
    pub force: bool,
    /// Refuse a snapshot whose QEMU version or machine differs from this host.
    #[arg(long)]
    pub strict: bool,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
}

#[derive(Subcommand, Debug)]
pub enum HubCmd {
    /// Serve a hub directory over HTTP for push and pull.
    Serve {
        /// The hub directory (created if missing).
        dir: PathBuf,
        /// Address to listen on; a non-loopback address needs --token-file.
        #[arg(long, default_value = "127.0.0.1:7443")]
        bind: SocketAddr,
        /// File whose first line is the bearer token clients must present.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Refuse every write (serve pulls only).
        #[arg(long)]
        read_only: bool,
    },
    /// Measure push/pull throughput and bytes moved for a base and a chain head.
    Bench {
        /// The base snapshot (tag or id).
        #[arg(long, required_unless_present_any = ["lazy", "propagate"])]
        base: Option<String>,
        /// A descendant of the base (tag or id).
        #[arg(long, required_unless_present_any = ["lazy", "propagate"])]
        head: Option<String>,
        /// Hub to use: a URL, or `serve` for a scratch `forkd hub serve` on
        /// 127.0.0.1 (default: a scratch file:// hub).
        #[arg(long)]
        hub: Option<String>,
        /// Also write the results (every step's figures) as JSON here (for
        /// scripts/plot-benchmarks.py).
        #[arg(long)]
        json: Option<PathBuf>,
        /// Instead: time from "host B has never seen TAG" to its first
        /// child answering, lazy pull vs full pull, over an S3 hub (s3s-fs)
        /// in network namespaces, shaped and unshaped.
        #[arg(long, value_name = "TAG", conflicts_with_all = ["base", "head"])]
        lazy: Option<String>,
        /// Instead: time from a push of TAG to a child answering on each of
        /// `--nodes` hosts (network namespaces, each its own shaped link)
        /// that pull it lazily at once.
        #[arg(long, value_name = "TAG", conflicts_with_all = ["base", "head", "lazy"])]
        propagate: Option<String>,
        #[command(flatten)]
        lazy_opts: Box<forkd_hub::lazybench::Args>,
        #[command(flatten)]
        transfer: TransferArgs,
    },
    /// Turn a layout-1 hub (one object per chunk) into layout 2 (packs), in
    /// place; a killed migration resumes.
    Migrate {
        /// file:///DIR or s3://BUCKET/PREFIX (an HTTP hub: migrate its directory on its host).
        hub: String,
        /// Delete the layout-1 chunk objects afterwards (clients from before
        /// layouts can then no longer pull).
        #[arg(long)]
        prune: bool,
        #[command(flatten)]
        transfer: TransferArgs,
    },
}

fn open_store(paths: &Paths) -> Result<Arc<Store>> {
    let dir = paths.store_dir();
    let opts = StoreOptions {
        lock_timeout: forkd_snapshot::store::LOCK_TIMEOUT,
        ..StoreOptions::default()
    };
    let store = Store::open(&dir, opts)
        .with_context(|| format!("opening the layer store at {}", dir.display()))?;
    Ok(Arc::new(store))
}

pub async fn push(paths: &Paths, a: PushArgs) -> Result<()> {
    // A view, not the store: a push only reads, and poold's writers (a
    // snapshot, a pull) need not wait for it.
    let view = forkd_snapshot::store::open_view(paths)?;
    let hub = Hub::open(&a.hub, hub::read_token(a.transfer.token_file.as_ref())?)?;
    let opts = PushOptions {
        hub_tag: a.as_tag,
        jobs: a.transfer.jobs,
        quiet: a.transfer.quiet,
        layout: a.layout,
        pack_bytes: None,
        on_publish: Some(Arc::new(|p: &hub::Published| {
            // Its own line, as it happens: other hosts may pull from here.
            if p.late_packs > 0 {
                println!(
                    "published after {:.2}s; {} packs ({}) still uploading",
                    p.after.as_secs_f64(),
                    p.late_packs,
                    mib(p.late_bytes)
                );
            }
        })),
    };
    let r = hub::push(view.view(), &a.tag, &hub, &opts).await?;
    println!("pushed {} to {}: {}", a.tag, hub.describe(), r.summary());
    Ok(())
}

pub async fn pull(paths: &Paths, a: PullArgs) -> Result<()> {
    let store = open_store(paths)?;
    let hub = Hub::open(&a.hub, hub::read_token(a.transfer.token_file.as_ref())?)?;
    let opts = PullOptions {
        as_tag: a.as_tag,
        force: a.force,
        strict: a.strict,
        jobs: a.transfer.jobs,
        quiet: a.transfer.quiet,
        on_chunks: None,
        lazy: a.lazy,
    };
    // A lazy snapshot is served by forkd-fs, which needs only the store to
    // exist: it starts while the pull's requests are on the wire, so the
    // working set begins to arrive as soon as the pull commits.
    let mount = a.lazy.then(|| {
        let p = paths.clone();
        tokio::task::spawn_blocking(move || forkd_snapshot::ensure_mount(&p))
    });
    let pulled = hub::pull(store.clone(), &hub, &a.tag, &opts).await;
    // The store's write turn is not held while the mount finishes.
    drop(store);
    let mounted = match mount {
        Some(m) => m.await.context("the mount task panicked")?.map(drop),
        None => Ok(()),
    };
    // A failed pull is the error to report, whatever the mount did.
    let r = pulled?;
    mounted?;
    if a.lazy {
        let p = paths.clone();
        let head = r.snapshot;
        hub::blocking(move || hub::lazy::start_filling(&p, Some(head))).await?;
    }
    print_pull(&a.tag, &hub, &r);
    Ok(())
}

fn print_pull(what: &str, hub: &Hub, r: &hub::TransferReport) {
    println!(
        "pulled {what} (snapshot {}) from {}: {}",
        r.snapshot,
        hub.describe(),
        r.summary()
    );
}

pub async fn pack(paths: &Paths, a: PackArgs) -> Result<()> {
    let store = open_store(paths)?;
    let rec = store
        .resolve(&a.tag)?
        .with_context(|| format!("no snapshot or tag '{}' in the local store", a.tag))?;
    let tag = store.tag(&a.tag)?.is_some().then(|| a.tag.clone());
    let out = a.output.clone();
    let quiet = a.quiet;
    let summary = hub::blocking(move || {
        let progress = forkd_snapshot::Progress::new("pack", quiet);
        let s = pack::write_pack(&store, &rec.id, tag.as_deref(), &out, &progress);
        progress.finish();
        s
    })
    .await?;
    println!(
        "packed {} into {}: {} snapshot records, {} manifests, {} chunks, {}",
        a.tag,
        a.output.display(),
        summary.snapshots,
        summary.manifests,
        summary.chunks,
        mib(summary.bytes)
    );
    Ok(())
}

pub async fn unpack(paths: &Paths, a: UnpackArgs) -> Result<()> {
    let store = open_store(paths)?;
    let hub = Hub::open_pack(&a.file)?;
    let Hub::Pack(reader) = &hub else {
        unreachable!("open_pack returns a pack")
    };
    let as_tag = a.as_tag.or_else(|| reader.tag.clone());
    let head = reader.snapshot.to_string();
    let opts = PullOptions {
        as_tag,
        force: a.force,
        strict: a.strict,
        jobs: None,
        quiet: a.quiet,
        on_chunks: None,
        lazy: false,
    };
    let r = hub::pull(store, &hub, &head, &opts).await?;
    print_pull(&a.file.display().to_string(), &hub, &r);
    Ok(())
}

pub async fn run(paths: &Paths, cmd: HubCmd) -> Result<()> {
    match cmd {
        HubCmd::Serve {
            dir,
            bind,
            token_file,
            read_only,
        } => {
            let token = match &token_file {
                Some(f) => {
                    warn_if_readable(f);
                    hub::read_token(Some(f))?
                }
                None => None,
            };
            let dir = std::path::absolute(&dir)
                .with_context(|| format!("resolving {}", dir.display()))?;
            let shown = dir.clone();
            let opts = server::ServeOptions {
                dir,
                bind,
                token,
                read_only,
            };
            server::serve(opts, |addr| {
                println!(
                    "forkd hub: serving {} on http://{addr}{}",
                    shown.display(),
                    if read_only { " (read-only)" } else { "" }
                );
            })
            .await
        }
        HubCmd::Migrate {
            hub,
            prune,
            transfer,
        } => {
            let h = Hub::open(&hub, hub::read_token(transfer.token_file.as_ref())?)?;
            let r = hub::migrate::migrate(&h, &paths.store_dir(), prune, transfer.jobs).await?;
            println!("migrated {}: {}", h.describe(), r.summary());
            Ok(())
        }
        HubCmd::Bench {
            propagate: Some(tag),
            lazy_opts,
            json,
            ..
        } => {
            let r = forkd_hub::lazybench::propagate::run(paths, &tag, &lazy_opts).await?;
            print!("{}", r.render());
            if let Some(path) = &json {
                r.write(path, std::env::args().collect())?;
                println!("\nreport written to {}", path.display());
            }
            Ok(())
        }
        HubCmd::Bench {
            lazy: Some(tag),
            lazy_opts,
            json,
            ..
        } => {
            let r = forkd_hub::lazybench::run(paths, &tag, &lazy_opts).await?;
            print!("{}", r.render());
            if let Some(path) = &json {
                r.write(path, std::env::args().collect())?;
                println!("\nreport written to {}", path.display());
            }
            Ok(())
        }
        HubCmd::Bench {
            base,
            head,
            hub,
            json,
            transfer,
            ..
        } => {
            let (base, head) = (base.unwrap_or_default(), head.unwrap_or_default());
            let store = open_store(paths)?;
            let opts = bench::BenchOptions {
                base: base.clone(),
                head: head.clone(),
                hub,
                token: hub::read_token(transfer.token_file.as_ref())?,
                jobs: transfer.jobs,
                work_dir: paths.staging_dir(),
            };
            let result = bench::run(store, &opts).await?;
            print!("{}", result.render());
            if let Some(path) = &json {
                result
                    .json_report(&base, &head, std::env::args().collect())
                    .write(path)?;
                println!("\nreport written to {}", path.display());
            }
            Ok(())
        }
    }
}

/// Tokens belong in files only their owner can read.
fn warn_if_readable(f: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(m) = std::fs::metadata(f) {
        if m.permissions().mode() & 0o077 != 0 {
            eprintln!(
                "warning: token file {} is readable by other users; chmod 600 it",
                f.display()
            );
        }
    }
}
