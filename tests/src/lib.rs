//! Shared helpers for the end-to-end tests: the test data dir, a runtime
//! that outlives individual tests, VMs booted once per test binary, and the
//! built binaries.
//!
//! Tests need a prepared data dir (kernel, initramfs, images); `scripts/test.sh`
//! makes one and points `FORKD_HOME` at it.

pub mod daemon;
pub mod gateway;
pub mod netns;
pub mod s3;

use forkd_snapshot::boot::{cold_boot, BootSpec};
use forkd_snapshot::images::Image;
use forkd_snapshot::Paths;
use forkd_vmm::{AccelChoice, Lifetime, Machine, Memory, Vm};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use tokio::runtime::Runtime;

/// The data dir prepared by scripts/test.sh.
pub fn paths() -> Paths {
    let p = Paths::from_env();
    assert!(
        p.initramfs().exists(),
        "no guest initramfs in {}: run the tests with scripts/test.sh (it prepares FORKD_HOME)",
        p.home.display()
    );
    p
}

/// One runtime for the whole test binary: VM channels live on it, so a VM
/// booted by one test can be used by another.
pub fn rt() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

/// Runs a future on the shared runtime.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    rt().block_on(f)
}

/// Loads a built image.
pub fn image(name: &str) -> Image {
    Image::load(&paths().images_dir(), name)
        .unwrap_or_else(|e| panic!("{e:#} (scripts/test.sh builds the test images)"))
}

/// The machine tests use: TCG unless FORKD_ACCEL says otherwise.
pub fn machine(mem_mib: u64) -> Machine {
    let accel = AccelChoice::from_env().unwrap().resolve().unwrap();
    Machine::new(accel, mem_mib, 1)
}

/// Boots a fresh, ephemeral VM from `image_name`.
pub async fn boot(image_name: &str, mem_mib: u64) -> Vm {
    let img = image(image_name);
    cold_boot(
        &paths(),
        BootSpec {
            id: format!("test-{image_name}-{}", forkd_snapshot::random_hex(4)),
            rootfs: img.rootfs(),
            kernel: None,
            machine: machine(mem_mib),
            memory: Memory::Anonymous,
            hostname: "forkd-test".into(),
            lifetime: Lifetime::Ephemeral,
            volumes: Vec::new(),
        },
    )
    .await
    .unwrap_or_else(|e| panic!("booting {image_name}: {e:#}"))
}

/// A VM booted once per test binary and shared by its tests. It dies with
/// the test process (ephemeral VMs get PR_SET_PDEATHSIG).
pub fn shared_vm(image_name: &str) -> Arc<Vm> {
    static VMS: OnceLock<Mutex<HashMap<String, Arc<Vm>>>> = OnceLock::new();
    let map = VMS.get_or_init(Default::default);
    let mut guard = map.lock().unwrap();
    if let Some(vm) = guard.get(image_name) {
        return vm.clone();
    }
    let vm = Arc::new(block_on(boot(image_name, 512)));
    guard.insert(image_name.to_string(), vm.clone());
    vm
}

/// A binary built by this workspace (same profile as the test).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let p = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join(name);
    assert!(
        p.exists(),
        "{} is not built: run `cargo build --workspace` first (scripts/test.sh does)",
        p.display()
    );
    p
}

/// A snapshot taken once per test binary from `image_name` (with the warm
/// interpreter's imports done), shared by its tests. Returns its tag.
pub fn shared_snapshot(image_name: &str, mem_mib: u64, eval_warmup: Option<&str>) -> String {
    static SNAPS: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let map = SNAPS.get_or_init(Default::default);
    let mut guard = map.lock().unwrap();
    if let Some(tag) = guard.get(image_name) {
        return tag.clone();
    }
    let tag = format!("t-{image_name}-{}", forkd_snapshot::random_hex(4));
    block_on(create_snapshot(&tag, image_name, mem_mib, eval_warmup));
    guard.insert(image_name.to_string(), tag.clone());
    tag
}

/// Takes a snapshot of a fresh `image_name` guest under `tag`.
pub async fn create_snapshot(
    tag: &str,
    image_name: &str,
    mem_mib: u64,
    eval_warmup: Option<&str>,
) -> forkd_snapshot::create::Created {
    use forkd_snapshot::create::{create, CreateSpec, ImageSource};
    let m = machine(mem_mib);
    create(
        &paths(),
        CreateSpec {
            net: false,
            tag: tag.to_string(),
            image: ImageSource::Named(image_name.to_string()),
            mem_mib,
            vcpus: 1,
            accel: m.accel,
            warmup_cmd: None,
            eval_warmup: eval_warmup.map(String::from),
            replace_tag: false,
            lifetime: Lifetime::Ephemeral,
            verbose: false,
            volumes: Vec::new(),
            ca: None,
        },
    )
    .await
    .unwrap_or_else(|e| panic!("snapshot of {image_name}: {e:#}"))
}

/// The snapshot `tag` as children see it (mounting forkd-fs if needed).
pub async fn source(tag: &str) -> forkd_snapshot::restore::Source {
    let mount = forkd_snapshot::ensure_mount_async(&paths()).await.unwrap();
    forkd_snapshot::restore::Source::resolve(&mount.mountpoint, tag)
        .unwrap_or_else(|e| panic!("{tag}: {e:#}"))
}

/// Forks `n` ephemeral children of `tag`.
pub async fn fork(tag: &str, n: usize) -> Vec<forkd_snapshot::fork::Child> {
    let src = source(tag).await;
    forkd_snapshot::fork::fork(&paths(), &src, n, 4, Lifetime::Ephemeral)
        .await
        .unwrap_or_else(|e| panic!("forking {n} of {tag}: {e:#}"))
        .children
}

/// Serves `127.0.0.1:<ephemeral>` on the host, carrying each accepted
/// connection to `port` in the guest through its own agent tunnel (what
/// poold's sandbox plane does for E2B's `get_host(port)`); for clients that
/// need a URL (an HTTP client, the E2B SDK). Returns the address; the
/// forwarder lives as long as the runtime.
pub async fn forward(agent: forkd_vmm::AgentClient, port: u16) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = l.accept().await else {
                return;
            };
            let agent = agent.clone();
            tokio::spawn(async move {
                match agent.open_tunnel(port).await {
                    Ok(mut t) => {
                        let _ = tokio::io::copy_bidirectional(&mut sock, &mut t).await;
                    }
                    Err(e) => eprintln!("forward to guest port {port}: {e}"),
                }
            });
        }
    });
    addr
}
