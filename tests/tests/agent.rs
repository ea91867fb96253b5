//! The agent, end to end, in a real `minimal` guest under TCG: exec (exit
//! codes, signals, env, cwd, stdin, timeouts, big output, concurrency,
//! streaming), files, and malformed frames.

use forkd_e2e::{block_on, shared_vm};
use rand::{Rng, RngCore, SeedableRng};
use rootfs_init::protocol::{ErrorKind, ExecSpec, FileKind, Reply};
use std::time::{Duration, Instant};

fn sh(cmd: &str) -> ExecSpec {
    ExecSpec {
        shell: Some(cmd.into()),
        ..Default::default()
    }
}

#[test]
fn exit_codes_and_signals() {
    let vm = shared_vm("minimal");
    block_on(async {
        let r = vm.agent.exec(sh("exit 42"), &[]).await.unwrap();
        assert_eq!((r.result.exit_code, r.result.signal), (Some(42), None));
        let r = vm.agent.exec(sh("kill -TERM $$"), &[]).await.unwrap();
        assert_eq!((r.result.exit_code, r.result.signal), (None, Some(15)));
        assert_eq!(r.result.status_code(), 143);
        let argv = ExecSpec {
            argv: Some(vec!["/bin/echo".into(), "a b".into(), "$HOME".into()]),
            ..Default::default()
        };
        let r = vm.agent.exec(argv, &[]).await.unwrap();
        assert_eq!(&r.stdout[..], b"a b $HOME\n", "argv is not shell-expanded");
    });
}

#[test]
fn missing_command_is_a_clear_error() {
    let vm = shared_vm("minimal");
    block_on(async {
        let spec = ExecSpec {
            argv: Some(vec!["/no/such/binary".into()]),
            ..Default::default()
        };
        let e = vm.agent.exec(spec, &[]).await.unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("command not found: /no/such/binary"), "{msg}");
        let spec = ExecSpec {
            cwd: Some("/no/such/dir".into()),
            ..sh("true")
        };
        let msg = vm.agent.exec(spec, &[]).await.unwrap_err().to_string();
        assert!(msg.contains("cwd /no/such/dir"), "{msg}");
    });
}

#[test]
fn env_cwd_and_stdin() {
    let vm = shared_vm("minimal");
    block_on(async {
        let mut spec = sh("echo \"$FOO|$(pwd)|$PATH\"; cat");
        spec.env.insert("FOO".into(), "bar baz".into());
        spec.cwd = Some("/etc".into());
        let r = vm.agent.exec(spec, b"from stdin\n").await.unwrap();
        let out = String::from_utf8_lossy(&r.stdout);
        assert!(out.starts_with("bar baz|/etc|/usr/local/sbin"), "{out}");
        assert!(out.ends_with("from stdin\n"), "{out}");
        let mut clear = sh("echo \"[$HOME]\"");
        clear.clear_env = true;
        let r = vm.agent.exec(clear, &[]).await.unwrap();
        assert_eq!(&r.stdout[..], b"[]\n");
    });
}

#[test]
fn timeout_kills_the_whole_process_group() {
    let vm = shared_vm("minimal");
    block_on(async {
        let mut spec = sh("sleep 300 & echo $! > /tmp/bg.pid; sleep 300");
        spec.timeout_ms = Some(1500);
        let t = Instant::now();
        let r = vm.agent.exec(spec, &[]).await.unwrap();
        assert!(r.result.timed_out);
        assert_eq!(r.result.signal, Some(9));
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "took {:?}",
            t.elapsed()
        );
        // The background sleep was in the same process group, so it is gone too.
        let r = vm
            .agent
            .exec(
                sh("p=$(cat /tmp/bg.pid); if [ -d /proc/$p ]; then echo alive; else echo gone; fi"),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "gone");
    });
}

#[test]
fn one_mib_of_output_arrives_intact_and_in_order() {
    let vm = shared_vm("minimal");
    block_on(async {
        // 131072 numbered 8-byte lines = 1 MiB.
        let r = vm
            .agent
            .exec(sh("seq -w 0 131071 | sed 's/^/x/'"), &[])
            .await
            .unwrap();
        assert_eq!(r.stdout.len(), 131072 * 8);
        for (i, line) in r.stdout.split(|b| *b == b'\n').take(131072).enumerate() {
            assert_eq!(line, format!("x{i:06}").as_bytes(), "line {i}");
        }
        // The same through the streaming form, reassembled from chunks.
        let (_, mut rx) = vm
            .agent
            .exec_stream(sh("seq -w 0 131071 | sed 's/^/x/'"), &[])
            .unwrap();
        let mut got = Vec::new();
        let mut chunks = 0;
        while let Some((reply, payload)) = rx.recv().await {
            match reply {
                Reply::Stdout => {
                    chunks += 1;
                    got.extend_from_slice(&payload)
                }
                Reply::Ok { .. } => break,
                Reply::Error { error } => panic!("{error}"),
                _ => {}
            }
        }
        assert_eq!(got, r.stdout.to_vec());
        assert!(chunks > 1, "output should arrive in several chunks");
    });
}

#[test]
fn output_limit_truncates_and_says_so() {
    let vm = shared_vm("minimal");
    block_on(async {
        let mut spec = sh("head -c 100000 /dev/zero");
        spec.output_limit = Some(1000);
        let r = vm.agent.exec(spec, &[]).await.unwrap();
        assert_eq!(r.stdout.len(), 1000);
        assert!(r.result.stdout_truncated);
    });
}

#[test]
fn streaming_exec_with_stdin_and_signal() {
    let vm = shared_vm("minimal");
    block_on(async {
        let spec = ExecSpec {
            stdin_open: true,
            ..sh("while read l; do echo \"got $l\"; done; echo done")
        };
        let (id, mut rx) = vm.agent.exec_stream(spec, b"one\n").unwrap();
        vm.agent.stdin(id, b"two\n", true).await.unwrap();
        let mut out = Vec::new();
        while let Some((reply, payload)) = rx.recv().await {
            match reply {
                Reply::Stdout => out.extend_from_slice(&payload),
                Reply::Ok { result } => {
                    assert_eq!(result["exit_code"], 0);
                    break;
                }
                Reply::Error { error } => panic!("{error}"),
                _ => {}
            }
        }
        assert_eq!(String::from_utf8_lossy(&out), "got one\ngot two\ndone\n");

        let (id, mut rx) = vm.agent.exec_stream(sh("sleep 300"), &[]).unwrap();
        assert!(matches!(rx.recv().await, Some((Reply::Started { .. }, _))));
        vm.agent.signal(id, 15).await.unwrap();
        loop {
            match rx.recv().await {
                Some((Reply::Ok { result }, _)) => {
                    assert_eq!(result["signal"], 15);
                    break;
                }
                Some(_) => {}
                None => panic!("stream ended without a result"),
            }
        }
    });
}

#[test]
fn ten_concurrent_requests_on_one_agent() {
    let vm = shared_vm("minimal");
    block_on(async {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..10 {
            let agent = vm.agent.clone();
            tasks.push(tokio::spawn(async move {
                let r = agent
                    .exec(sh(&format!("sleep 1; echo {i}")), &[])
                    .await
                    .unwrap();
                assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), i.to_string());
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        // Ten 1-second sleeps in parallel, not in series.
        assert!(
            t.elapsed() < Duration::from_secs(9),
            "requests were serialised: {:?}",
            t.elapsed()
        );
    });
}

#[test]
fn file_round_trip_of_random_binary_data() {
    let vm = shared_vm("minimal");
    block_on(async {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for size in [0usize, 1, 4095, 65536, 3 << 20] {
            let mut data = vec![0u8; size];
            rng.fill_bytes(&mut data);
            let path = format!("/root/files/blob-{size}.bin");
            let st = vm
                .agent
                .write_file(&path, &data, Some(0o640), false)
                .await
                .unwrap();
            assert_eq!(
                (st.size, st.mode, st.kind),
                (size as u64, 0o640, FileKind::File)
            );
            let (r, back) = vm.agent.read_file(&path, 0, None).await.unwrap();
            assert_eq!(r.size, size as u64);
            assert!(back[..] == data[..], "content of {path} differs");
        }
        // Ranged read, append, and the guest's own view of the bytes.
        let (_, part) = vm
            .agent
            .read_file("/root/files/blob-65536.bin", 100, Some(10))
            .await
            .unwrap();
        assert_eq!(part.len(), 10);
        vm.agent
            .write_file("/root/files/log", b"a", None, false)
            .await
            .unwrap();
        vm.agent
            .write_file("/root/files/log", b"b", None, true)
            .await
            .unwrap();
        let r = vm.agent.exec(sh("cat /root/files/log"), &[]).await.unwrap();
        assert_eq!(&r.stdout[..], b"ab");
        let n = rng.gen_range(1..1000);
        let _ = n;
    });
}

#[test]
fn list_stat_mkdir_remove() {
    let vm = shared_vm("minimal");
    block_on(async {
        vm.agent.mkdir("/srv/a/b/c", true).await.unwrap();
        vm.agent
            .write_file("/srv/a/f.txt", b"hello", None, false)
            .await
            .unwrap();
        let l = vm.agent.list("/srv/a").await.unwrap();
        let names: Vec<_> = l
            .entries
            .iter()
            .map(|e| (e.name.as_str(), e.kind))
            .collect();
        assert_eq!(names, vec![("b", FileKind::Dir), ("f.txt", FileKind::File)]);
        let st = vm.agent.stat("/srv/a/f.txt").await.unwrap();
        assert_eq!(st.size, 5);
        let e = vm.agent.remove("/srv/a", false).await.unwrap_err();
        assert!(e.to_string().contains("directory_not_empty"), "{e}");
        vm.agent.remove("/srv/a", true).await.unwrap();
        assert!(vm.agent.stat("/srv/a").await.is_err());
    });
}

#[test]
fn clear_errors_for_missing_files_and_bad_paths() {
    use forkd_vmm::CallError;
    let vm = shared_vm("minimal");
    block_on(async {
        let kind = |e: CallError| match e {
            CallError::Agent(a) => (a.kind, a.message),
            other => panic!("expected an agent error, got {other}"),
        };
        let (k, m) = kind(
            vm.agent
                .read_file("/no/such/file", 0, None)
                .await
                .unwrap_err(),
        );
        assert_eq!(k, ErrorKind::NotFound);
        assert!(m.contains("/no/such/file"), "{m}");
        let (k, m) = kind(vm.agent.stat("relative/path").await.unwrap_err());
        assert_eq!(k, ErrorKind::BadRequest);
        assert!(m.contains("must be absolute"), "{m}");
        let (k, _) = kind(vm.agent.read_file("/etc", 0, None).await.unwrap_err());
        assert_eq!(k, ErrorKind::IsADirectory);
        let (k, _) = kind(
            vm.agent
                .write_file("/proc/nope/x", b"", None, false)
                .await
                .unwrap_err(),
        );
        assert!(
            matches!(
                k,
                ErrorKind::NotFound | ErrorKind::Io | ErrorKind::PermissionDenied
            ),
            "{k}"
        );
        let (k, _) = kind(vm.agent.remove("/", true).await.unwrap_err());
        assert_eq!(k, ErrorKind::BadRequest);
    });
}

/// Random bytes on the channel never crash or wedge the agent: it answers
/// with errors or skips them, and a valid request afterwards still works.
/// Uses its own VM so the garbage cannot disturb the other tests' requests.
#[test]
fn agent_survives_malformed_frames() {
    block_on(async {
        let vm = forkd_e2e::boot("minimal", 256).await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(99);
        for round in 0..30 {
            let mut junk = vec![0u8; rng.gen_range(1..20_000)];
            rng.fill_bytes(&mut junk);
            if round % 3 == 0 {
                // A valid magic followed by absurd lengths.
                junk.splice(0..0, *b"FKD1\xff\xff\xff\x7f\x00\x00\x00\x00");
            }
            if round % 4 == 0 {
                // A well-framed header that is not JSON, and one that is JSON
                // but not a request.
                let mut f = bytes::BytesMut::new();
                rootfs_init::protocol::frame::encode(b"{not json", b"", &mut f);
                rootfs_init::protocol::frame::encode(
                    br#"{"id":5,"op":"launch_missiles"}"#,
                    b"x",
                    &mut f,
                );
                junk.extend_from_slice(&f);
            }
            vm.agent.send_raw(&junk).expect("channel open");
            let p = vm.agent.ping(Duration::from_secs(30)).await;
            assert!(
                p.is_ok(),
                "agent stopped answering after round {round}: {p:?}"
            );
        }
        let r = vm.agent.exec(sh("echo still fine"), &[]).await.unwrap();
        assert_eq!(&r.stdout[..], b"still fine\n");
        vm.destroy().await;
    });
}
