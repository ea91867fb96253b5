//! What the E2B front-end stands on, end to end in a real `minimal` guest
//! under TCG, driven through forkd-vmm's agent client (no poold): exec and
//! files as a user, `entry` (owners, modes, resolved symlinks), TCP tunnels
//! to guest ports (HTTP, large transfers both ways, many at once, the
//! guest closing mid-stream, the window holding a fast guest back), and
//! terminals a second request attaches to (docs/agent-protocol.md).

use forkd_e2e::{block_on, shared_vm};
use forkd_vmm::{AgentClient, CallError, TUNNEL_WINDOW};
use rand::{RngCore, SeedableRng};
use rootfs_init::protocol::{ErrorKind, ExecSpec, FileKind, PtySize, Reply, WriteHow};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn sh(cmd: &str) -> ExecSpec {
    ExecSpec {
        shell: Some(cmd.into()),
        ..Default::default()
    }
}

async fn out(agent: &AgentClient, spec: ExecSpec) -> String {
    let r = agent.exec(spec, &[]).await.unwrap();
    assert_eq!(
        r.result.exit_code,
        Some(0),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8_lossy(&r.stdout).into_owned()
}

/// Adds account `tester` (uid 4321, also in group `extra` 4400) to the
/// busybox guest once; the image has only root.
async fn tester(agent: &AgentClient) {
    let script = "grep -q '^tester:' /etc/passwd || { \
        echo 'tester:x:4321:4321::/home/tester:/bin/sh' >> /etc/passwd; \
        echo 'tester:x:4321:' >> /etc/group; echo 'extra:x:4400:tester' >> /etc/group; \
        mkdir -p /home/tester && chown 4321:4321 /home/tester; }";
    out(agent, sh(script)).await;
}

#[test]
fn exec_as_a_user_gets_its_ids_groups_home_and_env() {
    let vm = shared_vm("minimal");
    block_on(async {
        let a = &vm.agent;
        tester(a).await;
        let spec = ExecSpec {
            user: Some("tester".into()),
            ..sh("echo $(id -u) $(id -g) \"$(id -G)\" $HOME $USER $LOGNAME $(pwd)")
        };
        assert_eq!(
            out(a, spec).await,
            "4321 4321 4321 4400 /home/tester tester tester /home/tester\n"
        );
        // By uid too; an explicit cwd (relative: under the home) and env win.
        let mut spec = ExecSpec {
            user: Some("4321".into()),
            cwd: Some("/tmp".into()),
            ..sh("echo $(id -un) $(pwd) $HOME")
        };
        spec.env.insert("HOME".into(), "/elsewhere".into());
        assert_eq!(out(a, spec).await, "tester /tmp /elsewhere\n");
        // Root stays the default, with HOME=/root and cwd /.
        assert_eq!(
            out(a, sh("echo $(id -u) $HOME $(pwd)")).await,
            "0 /root /\n"
        );
        // A user the guest does not have is refused, never run as root.
        let e = a
            .exec(
                ExecSpec {
                    user: Some("nobody-here".into()),
                    ..sh("id")
                },
                &[],
            )
            .await
            .unwrap_err();
        match e {
            CallError::Agent(e) => {
                assert_eq!(e.kind, ErrorKind::NotFound);
                assert!(e.message.contains("nobody-here"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        // A user's process cannot do what root can.
        let r = a
            .exec(
                ExecSpec {
                    user: Some("tester".into()),
                    ..sh("echo x > /etc/forbidden")
                },
                &[],
            )
            .await
            .unwrap();
        assert_ne!(r.result.exit_code, Some(0));
    });
}

#[test]
fn files_for_a_user_are_its_own_and_entries_say_so() {
    let vm = shared_vm("minimal");
    block_on(async {
        let a = &vm.agent;
        tester(a).await;
        let u = Some("tester");
        // A relative path is under the home; new parents are the user's.
        let st = a
            .write_file_as(
                "proj/src/main.py",
                b"print(1)\n",
                None,
                WriteHow::Atomic,
                u,
                None,
            )
            .await
            .unwrap();
        assert_eq!(st.path, "/home/tester/proj/src/main.py");
        assert_eq!((st.uid, st.gid, st.mode), (4321, 4321, 0o644));
        let e = a.entry("proj", u).await.unwrap();
        assert_eq!((e.owner.as_str(), e.group.as_str()), ("tester", "tester"));
        assert_eq!(
            (e.kind, e.permissions()),
            (FileKind::Dir, "drwxr-xr-x".into())
        );
        let st = a.mkdir_as("~/deep/er", true, u).await.unwrap();
        assert_eq!((st.path.as_str(), st.uid), ("/home/tester/deep/er", 4321));
        // Root writes stay root's, as forkd's /v1 has always done.
        let st = a
            .write_file("/home/tester/rootfile", b"r", None, false)
            .await
            .unwrap();
        assert_eq!(st.uid, 0);
        let (_, data) = a
            .read_file_as("proj/src/main.py", 0, None, u)
            .await
            .unwrap();
        assert_eq!(&data[..], b"print(1)\n");

        // A symlink reports its text and its absolute, resolved target.
        out(
            a,
            sh(
                "cd /home/tester && ln -sf proj/src/main.py link && ln -sf nowhere dangling \
                && touch -d '2024-05-06 07:08:09' proj/src/main.py",
            ),
        )
        .await;
        let l = a.entry("link", u).await.unwrap();
        assert_eq!(l.kind, FileKind::Symlink);
        assert_eq!(l.target_kind, Some(FileKind::File));
        assert_eq!(l.symlink_target.as_deref(), Some("proj/src/main.py"));
        assert_eq!(
            l.symlink_resolved.as_deref(),
            Some("/home/tester/proj/src/main.py")
        );
        assert_eq!(l.owner, "root", "ln ran as root");
        let d = a.entry("/home/tester/dangling", None).await.unwrap();
        assert_eq!(d.target_kind, None);
        let f = a
            .entry("/home/tester/proj/src/main.py", None)
            .await
            .unwrap();
        let want = 1714979289; // 2024-05-06T07:08:09Z
        assert_eq!(f.mtime_unix, want);
        let all = a.list_entries("/home/tester", 3, None).await.unwrap();
        let names: Vec<_> = all.iter().map(|e| e.path.as_str()).collect();
        for p in [
            "/home/tester/proj",
            "/home/tester/proj/src",
            "/home/tester/proj/src/main.py",
            "/home/tester/link",
        ] {
            assert!(names.contains(&p), "{p} in {names:?}");
        }
        let e = a.entry("nope.txt", u).await.unwrap_err();
        assert!(e.to_string().contains("/home/tester/nope.txt"), "{e}");
        a.remove_as("proj", true, u).await.unwrap();
        assert!(a.entry("/home/tester/proj", None).await.is_err());
    });
}

/// Starts a server in the guest (a command run in the background) and
/// waits until its port accepts connections through a tunnel.
async fn serve(agent: &AgentClient, cmd: &str, port: u16) {
    out(agent, sh(&format!("({cmd}) >/dev/null 2>&1 &"))).await;
    let t = Instant::now();
    loop {
        match agent.open_tunnel(port).await {
            Ok(_) => return,
            Err(CallError::Agent(e)) if e.kind == ErrorKind::NotFound => {
                assert!(t.elapsed() < Duration::from_secs(60), "port {port}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("port {port}: {e}"),
        }
    }
}

/// One HTTP/1.0 request through a tunnel; the whole response.
async fn http_get(agent: &AgentClient, port: u16, path: &str) -> String {
    let mut t = agent.open_tunnel(port).await.unwrap();
    let req = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    t.write_all(req.as_bytes()).await.unwrap();
    let mut resp = Vec::new();
    t.read_to_end(&mut resp).await.unwrap();
    String::from_utf8_lossy(&resp).into_owned()
}

#[test]
fn http_through_tunnels_one_and_many_at_once() {
    let vm = shared_vm("minimal");
    block_on(async {
        let a = &vm.agent;
        out(
            a,
            sh("mkdir -p /www && echo 'hello from the guest' > /www/index.html"),
        )
        .await;
        serve(a, "httpd -f -p 127.0.0.1:8080 -h /www", 8080).await;
        let resp = http_get(a, 8080, "/index.html").await;
        assert!(resp.starts_with("HTTP/1.1 200 OK"), "{resp}");
        assert!(resp.ends_with("hello from the guest\n"), "{resp}");

        // Nothing listening: a clear not_found, naming the port.
        match a.open_tunnel(8099).await {
            Err(CallError::Agent(e)) => {
                assert_eq!(e.kind, ErrorKind::NotFound);
                assert!(e.message.contains("8099"), "{e}");
            }
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("a tunnel to a closed port opened"),
        }

        // 32 requests at once, each on its own tunnel.
        let mut tasks = Vec::new();
        for i in 0..32 {
            let a = a.clone();
            tasks.push(tokio::spawn(async move {
                let r = http_get(&a, 8080, "/index.html").await;
                assert!(r.ends_with("hello from the guest\n"), "request {i}: {r}");
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        a.ping(Duration::from_secs(10)).await.unwrap();
    });
}

#[test]
fn large_transfers_both_ways_keep_every_byte() {
    let vm = shared_vm("minimal");
    block_on(async {
        let a = &vm.agent;
        // Guest → host: 24 MiB of random bytes the guest serves.
        let mut data = vec![0u8; 24 << 20];
        rand::rngs::StdRng::seed_from_u64(34).fill_bytes(&mut data);
        for (i, part) in data.chunks(8 << 20).enumerate() {
            a.write_file("/tmp/big.bin", part, None, i > 0)
                .await
                .unwrap();
        }
        serve(a, "nc -ll -p 9001 -e cat /tmp/big.bin", 9001).await;
        let t0 = Instant::now();
        let mut t = a.open_tunnel(9001).await.unwrap();
        let mut got = Vec::new();
        t.read_to_end(&mut got).await.unwrap();
        let secs = t0.elapsed().as_secs_f64();
        assert_eq!(got.len(), data.len());
        assert!(got == data, "the guest's bytes arrived changed");
        eprintln!("guest -> host: {} MiB in {secs:.2} s", data.len() >> 20);

        // Host → guest: 24 MiB the guest hashes at our end of stream,
        // while we read its answer on the same connection.
        serve(a, "nc -ll -p 9002 -e sha256sum", 9002).await;
        let mut t = a.open_tunnel(9002).await.unwrap();
        let t0 = Instant::now();
        t.write_all(&data).await.unwrap();
        t.shutdown().await.unwrap();
        let mut answer = String::new();
        t.read_to_string(&mut answer).await.unwrap();
        let secs = t0.elapsed().as_secs_f64();
        let local = out(a, sh("sha256sum /tmp/big.bin")).await;
        assert_eq!(
            answer.split_whitespace().next(),
            local.split_whitespace().next(),
            "the guest hashed other bytes than we sent"
        );
        eprintln!("host -> guest: {} MiB in {secs:.2} s", data.len() >> 20);

        // Both ways at once: an echo server, 8 MiB through it.
        serve(a, "nc -ll -p 9003 -e cat", 9003).await;
        let t = a.open_tunnel(9003).await.unwrap();
        let (mut rd, mut wr) = tokio::io::split(t);
        let send = data[..8 << 20].to_vec();
        let writer = tokio::spawn(async move {
            wr.write_all(&send).await.unwrap();
            wr.shutdown().await.unwrap();
        });
        let mut echoed = Vec::new();
        rd.read_to_end(&mut echoed).await.unwrap();
        writer.await.unwrap();
        assert!(echoed == data[..8 << 20], "echo differs");
    });
}

#[test]
fn a_fast_guest_is_held_to_the_window_and_a_closing_guest_ends_the_stream() {
    let vm = shared_vm("minimal");
    block_on(async {
        let a = &vm.agent;
        // An endless stream: while we do not read, the agent stops
        // reading the socket, and we hold at most a window of it.
        serve(a, "nc -ll -p 9004 -e cat /dev/zero", 9004).await;
        let mut t = a.open_tunnel(9004).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            t.buffered() <= TUNNEL_WINDOW as usize,
            "{} bytes buffered over a window of {TUNNEL_WINDOW}",
            t.buffered()
        );
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0;
        while n < 4 << 20 {
            n += t.read(&mut buf).await.unwrap();
        }
        assert!(t.buffered() <= TUNNEL_WINDOW as usize);
        drop(t); // aborts it in the guest

        // The guest closes mid-stream (after 100 000 bytes) while we are
        // still writing: we read its bytes and its end of stream, and our
        // writes then fail instead of hanging.
        serve(a, "nc -ll -p 9005 -e head -c 100000 /dev/zero", 9005).await;
        let mut t = a.open_tunnel(9005).await.unwrap();
        let mut got = Vec::new();
        t.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), 100000);
        let chunk = vec![1u8; 64 << 10];
        let t0 = Instant::now();
        let failed = loop {
            if let Err(e) = t.write_all(&chunk).await {
                break e;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "writes never failed"
            );
        };
        assert_eq!(failed.kind(), std::io::ErrorKind::BrokenPipe, "{failed}");

        // Dropped tunnels leave nothing behind in the agent.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let open = out(
                a,
                sh("netstat -tn 2>/dev/null | grep -c ':900[45] .*ESTABLISHED' || true"),
            )
            .await;
            if open.trim() == "0" {
                break;
            }
            assert!(Instant::now() < deadline, "connections left: {open}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        a.ping(Duration::from_secs(10)).await.unwrap();
    });
}

async fn until_output(rx: &mut forkd_vmm::Events, buf: &mut Vec<u8>, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !String::from_utf8_lossy(buf).contains(text) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some((Reply::Stdout, p))) => buf.extend_from_slice(&p),
            Ok(Some((Reply::Ok { .. } | Reply::Error { .. }, _))) | Ok(None) => {
                panic!("ended before {text:?}: {}", String::from_utf8_lossy(buf))
            }
            Ok(Some(_)) => {}
            Err(_) => panic!("no {text:?} in {}", String::from_utf8_lossy(buf)),
        }
    }
}

#[test]
fn a_terminal_as_a_user_that_a_second_request_attaches_to() {
    let vm = shared_vm("minimal");
    block_on(async {
        let a = &vm.agent;
        tester(a).await;
        let spec = ExecSpec {
            argv: Some(vec!["/bin/sh".into()]),
            pty: Some(PtySize { rows: 24, cols: 80 }),
            user: Some("tester".into()),
            ..Default::default()
        };
        let (id, mut first) = a.exec_stream_as(spec, &[]).await.unwrap();
        let pid = match first.recv().await {
            Some((Reply::Started { pid }, _)) => pid,
            other => panic!("{other:?}"),
        };
        let execs = a.list_execs().await.unwrap();
        let me = execs.iter().find(|e| e.id == id).expect("listed");
        assert_eq!(me.pid, pid);
        assert_eq!(me.user.as_deref(), Some("tester"));
        assert_eq!(me.cwd, "/home/tester");
        assert_eq!(me.pty, Some(PtySize { rows: 24, cols: 80 }));

        // A second request follows the same terminal.
        let (aid, mut second) = a.attach(pid).await.unwrap();
        assert!(matches!(second.recv().await, Some((Reply::Started { pid: p }, _)) if p == pid));
        a.stdin(aid, b"echo me=$(id -un) tty=$(stat -c %U $(tty))\n", false)
            .await
            .unwrap();
        let (mut b1, mut b2) = (Vec::new(), Vec::new());
        until_output(&mut first, &mut b1, "me=tester tty=tester").await;
        until_output(&mut second, &mut b2, "me=tester tty=tester").await;
        // A resize through the attach reaches the terminal.
        a.resize(
            aid,
            PtySize {
                rows: 40,
                cols: 100,
            },
        )
        .await
        .unwrap();
        a.stdin(id, b"stty size\n", false).await.unwrap();
        until_output(&mut second, &mut b2, "40 100").await;
        // Ending it: both requests get the final reply.
        a.stdin(aid, b"exit 7\n", false).await.unwrap();
        for rx in [&mut first, &mut second] {
            loop {
                match rx.recv().await {
                    Some((Reply::Ok { result }, _)) => {
                        assert_eq!(result["exit_code"], 7);
                        break;
                    }
                    Some((Reply::Error { error }, _)) => panic!("{error}"),
                    Some(_) => {}
                    None => panic!("no final reply"),
                }
            }
        }
        assert!(a.list_execs().await.unwrap().iter().all(|e| e.id != id));
        match a.attach(pid).await {
            Ok((_, mut rx)) => match rx.recv().await {
                Some((Reply::Error { error }, _)) => assert_eq!(error.kind, ErrorKind::NotFound),
                other => panic!("{other:?}"),
            },
            Err(e) => panic!("{e}"),
        }
    });
}

/// The image behind E2B's `base` template: what agents shell out to, as
/// `user` with passwordless sudo.
#[test]
fn e2b_base_has_what_agents_shell_out_to() {
    let st = std::process::Command::new(forkd_e2e::bin("forkd"))
        .args(["image", "build", "--recipe", "e2b-base", "--if-changed"])
        .env("FORKD_HOME", &forkd_e2e::paths().home)
        .status()
        .unwrap();
    assert!(st.success(), "forkd image build --recipe e2b-base failed");
    let vm = shared_vm("e2b-base");
    block_on(async {
        let a = &vm.agent;
        let spec = ExecSpec {
            user: Some("user".into()),
            ..sh(
                "set -e; id -un; pwd; sudo -n id -u; git --version >/dev/null; \
                  curl --version >/dev/null; python3 -m pip --version >/dev/null; \
                  node --version >/dev/null; printf 'int main(){return 3;}' > t.c; \
                  gcc t.c -o t; ./t || echo built:$?",
            )
        };
        assert_eq!(out(a, spec).await, "user\n/home/user\n0\nbuilt:3\n");
        let e = a.entry("t.c", Some("user")).await.unwrap();
        assert_eq!(
            (e.owner.as_str(), e.path.as_str()),
            ("user", "/home/user/t.c")
        );
    });
}
