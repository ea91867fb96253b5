//! A real S3 server for the hub tests: s3s-fs on a free loopback port,
//! one bucket, static credentials (docs/hub.md).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const KEY: &str = "forkdlazykey";
pub const SECRET: &str = "forkd-lazy-secret-0123456789";
pub const BUCKET: &str = "lazy";

/// The s3s-fs binary: $FORKD_TEST_S3S_FS, else /usr/local/bin/s3s-fs.
pub fn s3s_fs() -> PathBuf {
    let p = std::env::var_os("FORKD_TEST_S3S_FS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/bin/s3s-fs"));
    assert!(
        p.is_file(),
        "s3s-fs (the S3 test server) is not installed at {}: cargo install s3s-fs --version 0.14.1 --features binary --locked --root /usr/local",
        p.display()
    );
    p
}

/// A real S3 server on a free loopback port; killed when dropped.
pub struct S3 {
    child: Option<Child>,
    /// Where s3s-fs keeps the buckets (one directory each).
    pub root: PathBuf,
    /// Its loopback port.
    pub port: u16,
}

impl S3 {
    pub fn start() -> S3 {
        let root = PathBuf::from(format!("/tmp/fdt-s3-{}", forkd_snapshot::random_hex(4)));
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut s = S3 {
            child: None,
            root,
            port,
        };
        s.run();
        s
    }

    pub fn run(&mut self) {
        let child = Command::new(s3s_fs())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", KEY, "--secret-key", SECRET])
            .arg(&self.root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting s3s-fs");
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "s3s-fs did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL: the hub is gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{BUCKET}/{prefix}")
    }

    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET.into()),
            ("AWS_REGION", "us-east-1".into()),
            (
                "AWS_ENDPOINT_URL",
                format!("http://127.0.0.1:{}", self.port),
            ),
        ]
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
