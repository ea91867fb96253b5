//! A real poold for tests: its own data dir (sharing the test data dir's
//! kernel and images), started as the real binary on a free port, killed
//! with SIGKILL or SIGTERM, and cleaned up completely (every QEMU it left,
//! its forkd-fs mount, its directory) when dropped.

use crate::{bin, paths};
use forkd_api::{Client, Method};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A data dir of its own for one poold.
pub struct Home {
    pub dir: PathBuf,
}

impl Default for Home {
    fn default() -> Home {
        Home::new()
    }
}

impl Home {
    /// `/tmp/fdt-<random>` with `kernel` and `images` linked from the test
    /// data dir (short, so unix socket paths stay under 108 bytes).
    pub fn new() -> Home {
        let base = paths();
        let dir = PathBuf::from(format!("/tmp/fdt-{}", forkd_snapshot::random_hex(4)));
        std::fs::create_dir_all(&dir).unwrap();
        for sub in ["kernel", "images"] {
            std::os::unix::fs::symlink(base.home.join(sub), dir.join(sub)).unwrap();
        }
        Home { dir }
    }

    /// QEMU processes whose command line names this data dir.
    /// Removes the networks (namespace, host link) of every VM recorded
    /// here. poold reconciles its networks when it starts again; a test's
    /// data dir is deleted instead, so this does it for the last poold.
    fn teardown_networks(&self) {
        let Ok(dirs) = std::fs::read_dir(self.dir.join("run/vms")) else {
            return;
        };
        for d in dirs.flatten() {
            if let Ok(rec) = forkd_vmm::VmDir::new(d.path()).read_record() {
                // Only while its namespace still exists: once poold tore
                // it down, the slot (and its host link name) may already
                // belong to another daemon's child.
                if let Some(net) = rec.net.filter(|n| forkd_net::netns_path(&n.netns).exists()) {
                    let _ = forkd_net::teardown(&net);
                }
            }
        }
    }

    pub fn qemu_pids(&self) -> Vec<u32> {
        let needle = self.dir.to_string_lossy().to_string();
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let cmd = String::from_utf8_lossy(&cmd);
            if !(cmd.starts_with("qemu-system") && cmd.contains(&needle)) {
                continue;
            }
            // Only this home's QEMUs: reading another process's stat can
            // block for as long as that process is stuck (a hung FUSE
            // fault), and so would every test's teardown.
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| {
                    s.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('Z')
                })
                .unwrap_or(true);
            if !zombie {
                out.push(pid);
            }
        }
        out
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        let pids = self.qemu_pids();
        for &pid in &pids {
            let _ = nix_kill(pid);
        }
        // A cgroup cannot be removed while a killed QEMU is still exiting
        // (a 1 GiB guest takes seconds to free): wait for them first, or
        // their groups leak.
        let deadline = Instant::now() + Duration::from_secs(10);
        while pids
            .iter()
            .any(|p| Path::new(&format!("/proc/{p}")).exists())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        // poold leaves its sandboxes' cgroups for a restart to adopt; no
        // poold will restart on this home.
        if let Ok(h) = forkd_vmm::Hierarchy::detect() {
            let vms = forkd_snapshot::Paths::new(&self.dir).vms_dir();
            for e in std::fs::read_dir(vms).into_iter().flatten().flatten() {
                h.remove(&e.file_name().to_string_lossy());
            }
        }
        self.teardown_networks();
        let _ = forkd_fs_unmount(&self.dir.join("mnt"));
        // FORKD_TEST_KEEP=1 keeps the data dir (logs, store, audit) for a
        // post-mortem of a failed run.
        if std::env::var_os("FORKD_TEST_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn nix_kill(pid: u32) -> std::io::Result<()> {
    // SAFETY: kill(2) on a pid; no memory is touched.
    if unsafe { libc::kill(pid as i32, libc::SIGKILL) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn forkd_fs_unmount(mnt: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match forkd_fs::unmount(mnt) {
            Ok(()) => return Ok(()),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(_) => return forkd_fs::unmount_lazy(mnt),
        }
    }
}

/// A running poold process.
pub struct Poold {
    pub child: Child,
    pub url: String,
    pub client: Client,
    pub home: PathBuf,
    /// The E2B API and sandbox-plane URLs, when started with `--e2b-bind`.
    pub e2b: Option<(String, String)>,
}

impl Poold {
    /// Starts poold on `home` with extra flags and waits until it serves.
    pub fn start(home: &Path, args: &[&str], token: Option<&str>) -> Poold {
        match Poold::try_start(home, args, token) {
            Ok(p) => p,
            Err(e) => panic!("starting poold: {e}"),
        }
    }

    /// Like [`Poold::start`], but a failure to start is returned with what
    /// poold printed.
    pub fn try_start(home: &Path, args: &[&str], token: Option<&str>) -> Result<Poold, String> {
        Poold::try_start_env(home, args, token, &[])
    }

    /// [`Poold::start`] with extra environment variables.
    pub fn start_env(
        home: &Path,
        args: &[&str],
        token: Option<&str>,
        env: &[(&str, &str)],
    ) -> Poold {
        match Poold::try_start_env(home, args, token, env) {
            Ok(p) => p,
            Err(e) => panic!("starting poold: {e}"),
        }
    }

    /// [`Poold::try_start`] with extra environment variables.
    pub fn try_start_env(
        home: &Path,
        args: &[&str],
        token: Option<&str>,
        env: &[(&str, &str)],
    ) -> Result<Poold, String> {
        Poold::try_start_cmd(Command::new(bin("poold")), home, args, token, env)
    }

    /// Starts poold inside network namespace `netns` (a node of its own:
    /// its listeners, its children's links and its `table inet forkd` all
    /// live there); give it `--bind` with the namespace's address.
    pub fn start_in_netns(home: &Path, netns: &str, args: &[&str], token: Option<&str>) -> Poold {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{netns}"))
            .arg("--")
            .arg(bin("poold"));
        match Poold::try_start_cmd(cmd, home, args, token, &[]) {
            Ok(p) => p,
            Err(e) => panic!("starting poold in {netns}: {e}"),
        }
    }

    fn try_start_cmd(
        mut cmd: Command,
        home: &Path,
        args: &[&str],
        token: Option<&str>,
        env: &[(&str, &str)],
    ) -> Result<Poold, String> {
        cmd.envs(env.iter().copied());
        if !args.contains(&"--bind") {
            cmd.args(["--bind", "127.0.0.1:0"]);
        }
        let mut child = cmd
            .args(args)
            .env("FORKD_HOME", home)
            .env("POOLD_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let Some(url) = line.trim().strip_prefix("poold listening on ") else {
            let out = child.wait_with_output().unwrap();
            return Err(format!("{line}{}", String::from_utf8_lossy(&out.stderr)));
        };
        let url = url.to_string();
        // "poold E2B API on http://A sandboxes on http://B"
        let e2b = if args.contains(&"--e2b-bind") {
            let mut l = String::new();
            stdout.read_line(&mut l).unwrap();
            let w: Vec<&str> = l.split_whitespace().collect();
            match (w.get(4), w.get(7)) {
                (Some(a), Some(b)) => Some((a.to_string(), b.to_string())),
                _ => return Err(format!("no E2B listener line: {l:?}")),
            }
        } else {
            None
        };
        let client = Client::new(&url, token.map(String::from)).unwrap();
        Ok(Poold {
            child,
            url,
            client,
            home: home.to_path_buf(),
            e2b,
        })
    }

    /// What poold has written to stderr so far (its log, `POOLD_LOG=warn`),
    /// without waiting for more.
    pub fn stderr_now(&mut self) -> String {
        use std::io::Read;
        use std::os::unix::io::AsRawFd;
        let Some(err) = self.child.stderr.as_mut() else {
            return String::new();
        };
        // SAFETY: fcntl on a pipe fd we own.
        unsafe {
            let fd = err.as_raw_fd();
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        let mut out = Vec::new();
        let mut buf = [0u8; 8192];
        while let Ok(n) = err.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Sends one raw HTTP/1.1 request with the given `Host` header over TCP
    /// (the CLI client always sends the right one); returns the status and
    /// the body.
    pub fn raw_get(&self, path: &str, host: Option<&str>) -> (u16, String) {
        use std::io::{Read, Write};
        let addr = self
            .url
            .strip_prefix("http://")
            .expect("raw_get needs a TCP poold");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let host = host.map_or(String::new(), |h| format!("Host: {h}\r\n"));
        write!(s, "GET {path} HTTP/1.1\r\n{host}Connection: close\r\n\r\n").unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        let status = resp
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no HTTP status in {resp:?}"));
        let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        (status, body.to_string())
    }

    /// Sends a POST without waiting for the answer; the connection stays
    /// open while the returned stream lives.
    pub fn post_in_background(&self, path: &str, body: &str) -> std::net::TcpStream {
        use std::io::Write;
        let addr = self.url.strip_prefix("http://").expect("a TCP poold");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A request; returns the status and the JSON body (Null if empty).
    pub async fn req(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let (st, bytes) = self.client.send(method, path, body).await.unwrap();
        let v = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
        };
        (st.as_u16(), v)
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.req(Method::GET, path, None).await
    }
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.req(Method::POST, path, Some(body)).await
    }
    pub async fn put(&self, path: &str, body: Value) -> (u16, Value) {
        self.req(Method::PUT, path, Some(body)).await
    }
    pub async fn delete(&self, path: &str) -> (u16, Value) {
        self.req(Method::DELETE, path, None).await
    }

    /// Creates a snapshot of `image` through the API; panics unless 201.
    pub async fn snapshot(&self, tag: &str, image: &str, mem_mib: u64) -> Value {
        let (st, v) = self
            .post(
                "/v1/snapshots",
                serde_json::json!({"tag": tag, "image": image, "mem_mib": mem_mib}),
            )
            .await;
        assert_eq!(st, 201, "creating snapshot {tag}: {v}");
        v
    }

    /// A metric's value (sum over label sets matching `labels`).
    pub async fn metric(&self, name: &str, labels: &str) -> f64 {
        let (_, body) = self
            .client
            .send(Method::GET, "/metrics", None)
            .await
            .unwrap();
        String::from_utf8_lossy(&body)
            .lines()
            .filter(|l| l.starts_with(name) && l.contains(labels))
            .filter(|l| {
                let rest = &l[name.len()..];
                rest.starts_with('{') || rest.starts_with(' ')
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Waits until the pool of `tag` has `ready` children.
    pub async fn wait_pool(&self, tag: &str, ready: u64) {
        self.wait_pool_until(tag, |p| {
            p["ready"].as_u64() == Some(ready) && p["in_flight"].as_u64() == Some(0)
        })
        .await;
    }

    /// Waits until the status of `tag`'s pool satisfies `done`; returns it.
    pub async fn wait_pool_until(&self, tag: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let (_, p) = self.get(&format!("/v1/pools/{tag}")).await;
            if done(&p) {
                return p;
            }
            assert!(Instant::now() < deadline, "pool {tag} stuck at {p}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Poold {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `id` fields of a JSON list (sandboxes, snapshots).
pub fn ids(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect()
}
