//! The forkd-fs mount, watched and healed (docs/design.md, "The mount,
//! healed").
//!
//! Every child maps its memory and reads its disk through the mount, so a
//! mount that stops serving stops the host: every spawn and refill fails
//! with ENOTCONN. [`watch_loop`] looks at it every [`CHECK_EVERY`], and at
//! once when an operation met ENOTCONN ([`suspect`]):
//! - live: nothing to do, but poold takes (and keeps) duplicates of the
//!   holder's connection and request arena from its keeper socket
//!   (`forkd_fs::keeper`), and watches the holder's process;
//! - its holder gone while poold keeps its connection (killed, OOM): the
//!   mount stays and its callers wait; a new holder adopts the connection
//!   and replays what the dead one had not answered. Nothing is lost;
//! - gone from the mount table (unmounted behind poold's back, `umount
//!   -l`): a new mount is started. The detached one keeps serving the files
//!   VMs have open, so every sandbox and pooled child lives on;
//! - dead (ENOTCONN: its connection aborted, or its holder killed before
//!   poold kept the connection, or an adoption failed) or hung: the
//!   connection is aborted, the mount detached and a new one started.
//!   Every VM that mapped the old connection (its QEMU maps a file of that
//!   device, read from `/proc/<pid>/maps`, or already died) dies at its
//!   next uncached page, so such
//!   pooled children are discarded (the pools refill on the new mount) and
//!   such sandboxes are destroyed and reported lost, not left listed as
//!   zombies. VMs of an earlier, detached mount are not touched;
//! - another filesystem mounted there, or a recovery that fails: reported
//!   (`/healthz` answers 503), retried at the next check.
//!
//! A verdict one look can get wrong waits for a second: a control socket
//! is quiet for the few hundred ms a worker restart takes, and `statfs`
//! can miss its deadline on a loaded host. "Hung" and "silent" act (abort
//! the connection, answer 503) only when the look [`CONFIRM_AFTER`] later
//! agrees; ENOTCONN and an empty mount table are facts and act at once.
//!
//! Invariants: this loop is the only thing that recovers the mount after
//! start (one recovery at a time); a kept connection is adopted only once
//! its holder's process is gone (`forkd_fs::keeper`); every recovery,
//! adoptions included, is counted
//! (`forkd_mount_recoveries_total{cause}`, `forkd_sandboxes_lost_total`)
//! and the last one kept in [`MountHealth`] for `/healthz` and `forkd
//! doctor`.

use crate::node::Node;
use crate::pool::Parked;
use crate::teardown::{destroy, discard_pooled};
use forkd_fs::mount::State;
use forkd_snapshot::unix_now;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the mount is looked at without a reason to.
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(2);

/// How soon a doubtful verdict is looked at again.
const CONFIRM_AFTER: Duration = Duration::from_millis(500);

/// What the last check found, and the last recovery.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MountHealth {
    /// Whether the mount served at the last check (or was recovered by it).
    pub ok: bool,
    /// When the mount was last checked (unix seconds; 0: not yet).
    pub checked_unix: u64,
    /// Why it is not serving, and what to do; None when it is.
    pub error: Option<String>,
    /// Recoveries since poold started.
    pub recoveries: u64,
    /// The last recovery, if any.
    pub last_recovery: Option<Recovery>,
    /// The holder whose connection poold keeps: its death is survived (a
    /// new holder adopts the connection). None: a holder death would lose
    /// every VM mapping the mount.
    pub kept_holder: Option<u32>,
}

/// One recovery of the mount.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    /// When it ended (unix seconds).
    pub at_unix: u64,
    /// What had happened to the mount.
    pub cause: Cause,
    /// From finding it broken to a new mount answering, ms.
    pub took_ms: u64,
    /// Sandboxes destroyed because the connection they mapped died.
    pub lost_sandboxes: Vec<String>,
    /// Pooled children discarded for the same reason (the pools refill).
    pub discarded_pooled: usize,
}

/// What had happened to a mount that needed recovering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Its holder died; the connection poold kept was adopted by a new
    /// holder, so every VM lives on.
    HolderDied,
    /// No longer in the mount table (unmounted behind poold's back); its
    /// connection, if it lives, still serves the VMs that use it.
    Unmounted,
    /// Its connection is gone (the holder died): ENOTCONN.
    Dead,
    /// Its daemon stopped answering; the connection was aborted.
    Hung,
}

impl Cause {
    fn as_str(self) -> &'static str {
        match self {
            Cause::HolderDied => "holder_died",
            Cause::Unmounted => "unmounted",
            Cause::Dead => "dead",
            Cause::Hung => "hung",
        }
    }

    /// Whether the VMs that mapped the old mount lost it.
    fn loses_vms(self) -> bool {
        matches!(self, Cause::Dead | Cause::Hung)
    }
}

/// What a look at the mount found.
#[derive(Debug)]
enum Verdict {
    /// Serving; its holder's pid.
    Live(Option<u32>),
    /// What happened, and the broken mount's device (`major:minor`) when
    /// it is still in the mount table.
    Broken(Cause, Option<String>),
    /// It serves files but its control socket does not answer.
    Silent(String),
    /// Not serving, and not something to recover by ourselves.
    Refused(String),
}

impl Verdict {
    /// Whether one look can be wrong about it (module doc).
    fn doubtful(&self) -> bool {
        matches!(self, Verdict::Broken(Cause::Hung, _) | Verdict::Silent(_))
    }
}

/// What the watch does with a verdict, given whether the previous look
/// was doubtful too.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Act on it.
    Act,
    /// Look again in [`CONFIRM_AFTER`] before acting.
    LookAgain,
}

fn step(v: &Verdict, doubted: bool) -> Step {
    if v.doubtful() && !doubted {
        Step::LookAgain
    } else {
        Step::Act
    }
}

/// Looks at the mount (blocking: control socket and statfs with timeouts).
fn look(n: &Node) -> anyhow::Result<Verdict> {
    let cfg = forkd_snapshot::mount_config(&n.paths)?;
    Ok(match forkd_fs::mount::state(&n.mount, &cfg.control())? {
        State::Live(st) => Verdict::Live(st.holder_pid),
        State::Free => Verdict::Broken(Cause::Unmounted, None),
        State::Stale { entry, hung } => {
            let cause = if hung { Cause::Hung } else { Cause::Dead };
            Verdict::Broken(cause, Some(entry.dev))
        }
        State::Silent => Verdict::Silent(format!(
            "the forkd-fs mount at {} serves files but its control socket {} does not answer; \
             unmount it (`forkd-fs unmount {}`) so poold can mount it again",
            n.mount.display(),
            cfg.control().display(),
            n.mount.display()
        )),
        State::Foreign(e) => Verdict::Refused(format!(
            "{} has a {} filesystem mounted over the layer store's mount; unmount it",
            n.mount.display(),
            e.fstype
        )),
    })
}

/// Wakes [`watch_loop`] when `err` says the mount is not connected: an
/// operation met a dead mount before the next periodic check did.
pub(crate) fn suspect(n: &Node, err: &str) {
    if err.contains("Transport endpoint is not connected") || err.contains("ENOTCONN") {
        n.mount_wake.notify_one();
    }
}

/// Checks the mount at once, then every [`CHECK_EVERY`] (or when woken),
/// and heals it.
pub(crate) async fn watch_loop(n: Arc<Node>) {
    let mut doubted = false;
    // The first look at once: poold keeps the holder's connection from then.
    let mut wait = Duration::ZERO;
    loop {
        tokio::select! {
            _ = n.mount_wake.notified() => {}
            _ = tokio::time::sleep(wait) => {}
        }
        let started = Instant::now();
        if adopt_if_holder_gone(&n, started).await {
            // Look at once: the new holder's connection is kept from then.
            (doubted, wait) = (false, Duration::ZERO);
            continue;
        }
        let verdict = look_async(&n).await;
        match step(&verdict, doubted) {
            Step::LookAgain => {
                tracing::debug!("the forkd-fs mount looks {verdict:?}; looking again");
                (doubted, wait) = (true, CONFIRM_AFTER);
            }
            Step::Act => {
                (doubted, wait) = (false, CHECK_EVERY);
                act(&n, verdict, started).await;
            }
        }
    }
}

async fn look_async(n: &Arc<Node>) -> Verdict {
    let n = n.clone();
    match tokio::task::spawn_blocking(move || look(&n)).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => Verdict::Refused(format!("checking the forkd-fs mount: {e:#}")),
        Err(e) => Verdict::Refused(format!("checking the forkd-fs mount: {e}")),
    }
}

async fn act(n: &Arc<Node>, verdict: Verdict, started: Instant) {
    match verdict {
        Verdict::Live(holder) => {
            record(n, |h| {
                h.ok = true;
                h.error = None;
            });
            if let Some(pid) = holder {
                keep_connection(n, pid).await;
            }
        }
        Verdict::Silent(why) | Verdict::Refused(why) => {
            tracing::error!("{why}");
            record(n, |h| {
                h.ok = false;
                h.error = Some(why);
            });
        }
        Verdict::Broken(cause, dev) => recover(n, cause, dev, started).await,
    }
}

fn record(n: &Node, f: impl FnOnce(&mut MountHealth)) {
    let mut h = n.mount_health.lock().unwrap();
    h.checked_unix = unix_now();
    f(&mut h);
}

/// Takes duplicates of holder `pid`'s connection and arena, unless poold
/// keeps them already, and wakes the watch the moment that process ends.
async fn keep_connection(n: &Arc<Node>, pid: u32) {
    let kept = n.keeper.lock().unwrap().as_ref().map(|k| k.info.holder_pid);
    if kept == Some(pid) {
        return;
    }
    let mount = n.mount.clone();
    match tokio::task::spawn_blocking(move || forkd_fs::keeper::fetch(&mount)).await {
        Ok(Ok(k)) if k.info.holder_pid == pid => {
            tracing::info!("keeping the forkd-fs connection of holder {pid}");
            *n.keeper.lock().unwrap() = Some(k);
            record(n, |h| h.kept_holder = Some(pid));
            wake_on_exit(n, pid);
        }
        Ok(Ok(k)) => tracing::debug!(
            "keeper socket answered for holder {}, not {pid}",
            k.info.holder_pid
        ),
        // A holder from before keepers, or one starting: its mount works,
        // it just does not outlive its holder.
        Ok(Err(e)) => tracing::debug!("not keeping the forkd-fs connection: {e:#}"),
        Err(e) => tracing::warn!("keeper task: {e}"),
    }
}

/// Wakes the watch when process `pid` exits (a pidfd, on its own thread),
/// so an adoption starts at once rather than at the next check.
fn wake_on_exit(n: &Arc<Node>, pid: u32) {
    let n = n.clone();
    let _ = std::thread::Builder::new()
        .name("forkd-fs-holder-watch".into())
        .spawn(move || {
            // SAFETY: pidfd_open takes a pid and flags and returns a new fd.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
            if fd < 0 {
                return; // the periodic check notices instead
            }
            // SAFETY: a new fd we own.
            let fd =
                unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
            let mut p = [nix::poll::PollFd::new(
                std::os::fd::AsFd::as_fd(&fd),
                nix::poll::PollFlags::POLLIN,
            )];
            while nix::poll::poll(&mut p, nix::poll::PollTimeout::NONE).is_err() {}
            n.mount_wake.notify_one();
        });
}

/// When the holder whose connection poold keeps is gone, starts a holder
/// that adopts it. True when one did; false when there was nothing to
/// adopt or the adoption failed (the kept connection is dropped, and the
/// look that follows recovers the mount).
async fn adopt_if_holder_gone(n: &Arc<Node>, started: Instant) -> bool {
    let kept = {
        let mut k = n.keeper.lock().unwrap();
        if !k
            .as_ref()
            .is_some_and(|k| forkd_fs::keeper::holder_gone(k.info.holder_pid))
        {
            return false;
        }
        k.take().expect("checked above")
    };
    record(n, |h| h.kept_holder = None);
    let dead = kept.info.holder_pid;
    tracing::warn!("the forkd-fs holder (pid {dead}) died; a new holder adopts its connection");
    let n2 = n.clone();
    let res = tokio::task::spawn_blocking(move || {
        let cfg = forkd_snapshot::mount_config(&n2.paths)?;
        // The connection is dropped here, after the new holder has its own
        // copy, or after it failed (the mount then dies: the look that
        // follows recovers it).
        forkd_fs::keeper::adopt(&cfg, &kept)
    })
    .await;
    match res {
        Ok(Ok(())) => {
            let took_ms = started.elapsed().as_millis() as u64;
            tracing::warn!(
                "a new forkd-fs holder serves the mount after {took_ms} ms; nothing was lost"
            );
            n.metrics
                .mount_recoveries
                .with_label_values(&[Cause::HolderDied.as_str()])
                .inc();
            record(n, |h| {
                h.ok = true;
                h.error = None;
                h.recoveries += 1;
                h.last_recovery = Some(Recovery {
                    at_unix: unix_now(),
                    cause: Cause::HolderDied,
                    took_ms,
                    lost_sandboxes: Vec::new(),
                    discarded_pooled: 0,
                });
            });
        }
        Ok(Err(e)) => {
            tracing::error!("adopting the dead holder's connection: {e:#}; looking at the mount");
            return false;
        }
        Err(e) => {
            tracing::error!("adoption task: {e}");
            return false;
        }
    }
    true
}

/// Mounts again; then, when the old connection died, lets go of every VM
/// that mapped it (`dev`).
async fn recover(n: &Arc<Node>, cause: Cause, dev: Option<String>, started: Instant) {
    tracing::warn!(
        "the forkd-fs mount at {} is {}; mounting it again",
        n.mount.display(),
        cause.as_str()
    );
    // Before the new mount: a child pooled after it maps the new one.
    let dead = dev
        .filter(|_| cause.loses_vms())
        .and_then(|d| parse_dev(&d));
    let (lost, discarded) = match dead {
        Some(dev) => {
            let pooled = n
                .pools
                .drain_where(|v| went_with(dev, v.is_alive(), Some(v.vm.pid())));
            let lost: Vec<String> = n
                .sandboxes
                .all()
                .iter()
                .filter(|s| went_with(dev, s.is_alive(), s.qemu_pid()))
                .map(|s| s.record().id)
                .collect();
            (lost, pooled)
        }
        None => (Vec::new(), Vec::new()),
    };
    let paths = n.paths.clone();
    let res = forkd_snapshot::ensure_mount_async(&paths).await;
    let discarded_pooled = discarded.len();
    discard_pooled(n, discarded);
    for id in &lost {
        tracing::warn!(
            "sandbox {id}: lost: the forkd-fs connection its memory and disk were mapped from died"
        );
        destroy(n, id).await;
    }
    n.metrics.sandboxes_lost.inc_by(lost.len() as u64);
    n.refill_wake.notify_one();
    match res {
        Ok(_) => {
            let took_ms = started.elapsed().as_millis() as u64;
            tracing::warn!(
                "the forkd-fs mount serves again after {took_ms} ms ({} sandboxes lost, {discarded_pooled} pooled children discarded)",
                lost.len()
            );
            n.metrics
                .mount_recoveries
                .with_label_values(&[cause.as_str()])
                .inc();
            record(n, |h| {
                h.ok = true;
                h.error = None;
                h.recoveries += 1;
                h.last_recovery = Some(Recovery {
                    at_unix: unix_now(),
                    cause,
                    took_ms,
                    lost_sandboxes: lost,
                    discarded_pooled,
                });
            });
        }
        Err(e) => {
            let why = format!(
                "the forkd-fs mount at {} is {} and mounting it again failed: {e:#}; \
                 see its log ({}), then restart poold",
                n.mount.display(),
                cause.as_str(),
                forkd_fs::mount::log_path(&forkd_fs::mount::default_control_socket(&n.mount))
                    .display()
            );
            tracing::error!("{why}");
            record(n, |h| {
                h.ok = false;
                h.error = Some(why);
            });
        }
    }
}

/// Whether a VM goes with the dead connection `dev`: its QEMU maps a file
/// of it, or already died (at its first page from that connection, most
/// likely) and has no maps left to read. Either way it cannot serve again.
fn went_with(dev: (u32, u32), alive: bool, qemu: Option<u32>) -> bool {
    !alive || qemu.is_some_and(|p| maps_device(p, dev))
}

/// `major:minor` as mountinfo writes it (decimal).
fn parse_dev(s: &str) -> Option<(u32, u32)> {
    let (a, b) = s.split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Whether process `pid` maps a file of device `dev` (`/proc/<pid>/maps`
/// writes devices as hexadecimal `major:minor`).
fn maps_device(pid: u32, dev: (u32, u32)) -> bool {
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return false;
    };
    maps.lines().any(|l| {
        l.split_whitespace().nth(3).is_some_and(|d| {
            d.split_once(':').is_some_and(|(a, b)| {
                u32::from_str_radix(a, 16).ok() == Some(dev.0)
                    && u32::from_str_radix(b, 16).ok() == Some(dev.1)
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device of this process's own binary, which it maps.
    fn own_binary_dev() -> (u32, u32) {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(std::fs::read_link("/proc/self/exe").unwrap()).unwrap();
        (
            nix::sys::stat::major(md.dev()) as u32,
            nix::sys::stat::minor(md.dev()) as u32,
        )
    }

    #[test]
    fn finds_a_mapping_of_a_device() {
        let dev = own_binary_dev();
        assert!(maps_device(std::process::id(), dev));
        assert!(!maps_device(std::process::id(), (dev.0, dev.1 + 1000)));
        assert!(!maps_device(u32::MAX, dev), "no such process");
        assert_eq!(parse_dev("0:45"), Some((0, 45)));
        assert_eq!(parse_dev("0"), None);
    }

    #[test]
    fn a_vm_that_died_before_the_scan_goes_with_the_connection() {
        let dev = own_binary_dev();
        let me = Some(std::process::id());
        assert!(went_with(dev, true, me), "maps the dead device");
        assert!(!went_with((dev.0, dev.1 + 1000), true, me), "maps another");
        // Its QEMU gone, its maps with it: lost, not left listed.
        assert!(went_with(dev, false, Some(u32::MAX)));
        assert!(went_with(dev, false, None));
    }

    #[test]
    fn hung_and_silent_act_only_when_a_second_look_agrees() {
        let hung = || Verdict::Broken(Cause::Hung, Some("0:45".into()));
        let silent = || Verdict::Silent("quiet".into());
        for v in [hung(), silent()] {
            assert_eq!(step(&v, false), Step::LookAgain, "{v:?}");
            assert_eq!(step(&v, true), Step::Act, "{v:?}");
        }
        // Facts act at once.
        for v in [
            Verdict::Live(Some(7)),
            Verdict::Broken(Cause::Dead, Some("0:45".into())),
            Verdict::Broken(Cause::Unmounted, None),
            Verdict::Refused("foreign".into()),
        ] {
            assert_eq!(step(&v, false), Step::Act, "{v:?}");
        }
    }
}
