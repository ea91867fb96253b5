//! BRANCH under TCG: a running child is snapshotted at one instant (memory
//! and disk), keeps running, can branch again and again; grandchildren see
//! the instant and nothing after it; a grandchild branches into depth 2.

use forkd_e2e::{block_on, fork, paths, shared_snapshot};
use forkd_snapshot::branch::{branch, Mode};
use forkd_snapshot::fork::destroy_all;
use forkd_vmm::Vm;
use std::collections::BTreeMap;
use std::time::Duration;

fn numpy_snapshot() -> String {
    shared_snapshot("python-numpy", 512, Some("import numpy"))
}

async fn eval(vm: &Vm, code: &str) -> String {
    let r = vm.agent.eval(code, Some(30_000)).await.unwrap();
    assert!(r.error.is_none(), "{code}: {r:?}");
    r.result.unwrap_or_default()
}

async fn read(vm: &Vm, path: &str) -> Option<String> {
    match vm.agent.read_file(path, 0, None).await {
        Ok((_, b)) => Some(String::from_utf8_lossy(&b).into_owned()),
        Err(_) => None,
    }
}

async fn write(vm: &Vm, path: &str, data: &str) {
    vm.agent
        .write_file(path, data.as_bytes(), None, false)
        .await
        .unwrap();
}

async fn record(tag: &str) -> forkd_layers::SnapshotRecord {
    forkd_snapshot::restore::read_record(&paths().mount_dir(), tag).unwrap()
}

async fn do_branch(
    vm: &Vm,
    parent_tag: &str,
    tag: &str,
    mode: Mode,
) -> forkd_snapshot::branch::Branched {
    let parent = record(parent_tag).await;
    branch(
        &paths(),
        &paths().mount_dir(),
        vm,
        &parent,
        tag,
        mode,
        BTreeMap::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("branch {tag}: {e:#}"))
}

#[test]
fn grandchildren_see_the_branch_instant_and_nothing_after() {
    let base = numpy_snapshot();
    let sfx = forkd_snapshot::random_hex(3);
    block_on(async {
        let mut src = fork(&base, 1).await;
        let s = &src[0].vm;
        eval(s, "marker = 'before'; blob = numpy.arange(1 << 20)").await;
        write(s, "/marker", "before").await;
        write(s, "/tmp/in-tmp", "before").await;

        let b_tag = format!("t-br-{sfx}");
        let b = do_branch(s, &base, &b_tag, Mode::Live).await;
        assert!(b.pause_ms > 0.0);
        assert_eq!(b.record.parent, Some(record(&base).await.id));

        // The source keeps running and moves on.
        eval(s, "marker = 'after'").await;
        write(s, "/marker", "after").await;
        write(s, "/after-file", "x").await;
        assert_eq!(eval(s, "marker").await, "'after'");

        let kids = fork(&b_tag, 3).await;
        for k in &kids {
            let g = &k.vm;
            assert_eq!(eval(g, "marker").await, "'before'");
            assert_eq!(
                eval(g, "int(blob.sum())").await,
                ((1u64 << 20) * ((1 << 20) - 1) / 2).to_string()
            );
            assert_eq!(read(g, "/marker").await.as_deref(), Some("before"));
            assert_eq!(read(g, "/tmp/in-tmp").await.as_deref(), Some("before"));
            assert_eq!(read(g, "/after-file").await, None);
        }

        // Only what differs is stored: the link is a small part of its parent.
        let (link, whole) = forkd_snapshot::store::with_rw(&paths(), {
            let (p, c) = (record(&base).await.id, b.record.id);
            move |st| {
                let d = st.diff(&p, &c)?;
                let whole: u64 = st.stats()?.live_stored_bytes;
                Ok((d.new_stored_bytes, whole))
            }
        })
        .await
        .unwrap();
        assert!(link < whole / 2, "link stores {link} of {whole} bytes");

        // A grandchild branches into depth 2, and children of that see both.
        let g = &kids[0].vm;
        eval(g, "depth = 2").await;
        write(g, "/depth", "2").await;
        let c_tag = format!("t-br2-{sfx}");
        let c = do_branch(g, &b_tag, &c_tag, Mode::Live).await;
        assert_eq!(c.record.parent, Some(b.record.id));
        let greats = fork(&c_tag, 1).await;
        let gg = &greats[0].vm;
        assert_eq!(eval(gg, "(marker, depth)").await, "('before', 2)");
        assert_eq!(read(gg, "/depth").await.as_deref(), Some("2"));
        assert_eq!(read(gg, "/marker").await.as_deref(), Some("before"));
        let depth = forkd_snapshot::store::with_rw(&paths(), move |st| {
            Ok(st.ancestors(&c.record.id)?.len())
        })
        .await
        .unwrap();
        assert_eq!(depth, 2);

        destroy_all(greats).await;
        destroy_all(kids).await;
        destroy_all(std::mem::take(&mut src)).await;
    });
}

#[test]
fn one_source_branches_five_times_in_a_row() {
    let base = numpy_snapshot();
    let sfx = forkd_snapshot::random_hex(3);
    block_on(async {
        let src = fork(&base, 1).await;
        let s = &src[0].vm;
        let mut tags = Vec::new();
        for i in 0..5 {
            eval(s, &format!("counter = {i}")).await;
            write(s, "/counter", &i.to_string()).await;
            let tag = format!("t-five-{sfx}-{i}");
            let mode = if i == 4 { Mode::Full } else { Mode::Live };
            let b = do_branch(s, &base, &tag, mode).await;
            assert!(b.pause_ms > 0.0, "{i}: pause {}", b.pause_ms);
            tags.push(tag);
        }
        // The source is still alive and answers.
        s.agent.ping(Duration::from_secs(10)).await.unwrap();
        assert_eq!(eval(s, "counter").await, "4");
        for (i, tag) in tags.iter().enumerate() {
            let k = fork(tag, 1).await;
            assert_eq!(eval(&k[0].vm, "counter").await, i.to_string());
            assert_eq!(
                read(&k[0].vm, "/counter").await.as_deref(),
                Some(&*i.to_string())
            );
            destroy_all(k).await;
        }
        destroy_all(src).await;
    });
}
