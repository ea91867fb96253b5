//! PID 1's main loop: reap every zombie, keep forkd-agent running, and power
//! off or reboot on request.
//!
//! Signals (busybox init's convention, which forkd-agent uses):
//! SIGUSR2 = power off, SIGTERM or SIGINT = reboot.

use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::process::Command;
use std::time::{Duration, Instant};

/// Where forkd-init puts the agent binary in the guest's root.
pub const AGENT_PATH: &str = "/run/forkd/forkd-agent";

/// What the loop ends with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Power the VM off (SIGUSR2, or the agent's `shutdown`).
    PowerOff,
    /// Reboot (SIGTERM or SIGINT).
    Reboot,
}

/// Runs until a power-off or reboot signal arrives.
pub fn run() -> Ending {
    let mut set = SigSet::empty();
    for s in [
        Signal::SIGCHLD,
        Signal::SIGUSR2,
        Signal::SIGTERM,
        Signal::SIGINT,
    ] {
        set.add(s);
    }
    set.thread_block().expect("block signals in PID 1");
    let mut agent: Option<Pid> = None;
    let mut next_start = Instant::now();
    let mut backoff = Duration::from_millis(200);
    loop {
        if agent.is_none() && Instant::now() >= next_start {
            agent = start_agent();
            next_start = Instant::now() + backoff;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
        // Signals wake PID 1 (SIGCHLD for every exit); a timeout is needed
        // only while an agent restart waits out its backoff. Polling would
        // wake an idle guest's vCPU for nothing (twice a second, before).
        let timeout = agent
            .is_none()
            .then(|| next_start.saturating_duration_since(Instant::now()));
        match wait_signal(&set, timeout) {
            Some(Signal::SIGUSR2) => return Ending::PowerOff,
            Some(Signal::SIGTERM) | Some(Signal::SIGINT) => return Ending::Reboot,
            _ => {}
        }
        for (pid, status) in reap() {
            if Some(pid) == agent {
                eprintln!("forkd-init: forkd-agent exited ({status:?}); restarting");
                agent = None;
            }
        }
    }
}

fn start_agent() -> Option<Pid> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(AGENT_PATH);
    cmd.env(
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    );
    // SAFETY: unblock_all_signals only calls async-signal-safe functions.
    // PID 1 blocks signals for sigtimedwait; the agent must not inherit that.
    unsafe { cmd.pre_exec(crate::unblock_all_signals) };
    match cmd.spawn() {
        Ok(child) => Some(Pid::from_raw(child.id() as i32)),
        Err(e) => {
            eprintln!("forkd-init: cannot start {AGENT_PATH}: {e}");
            None
        }
    }
}

/// Waits for a signal of `set`, at most `timeout` (None: until one comes).
fn wait_signal(set: &SigSet, timeout: Option<Duration>) -> Option<Signal> {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs() as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
    // SAFETY: `set` is a valid sigset; `ts_ptr` is null or points to `ts`,
    // which outlives the call.
    let sig = unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), ts_ptr) };
    Signal::try_from(sig).ok()
}

/// Reaps every exited child without blocking.
fn reap() -> Vec<(Pid, WaitStatus)> {
    let mut out = Vec::new();
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return out,
            Ok(st) => {
                if let Some(pid) = st.pid() {
                    out.push((pid, st));
                }
            }
        }
    }
}

/// Stops every process, syncs and remounts the root read-only, then powers
/// off or reboots. Never returns.
pub fn shut_down(how: Ending) -> ! {
    use nix::sys::signal::kill;
    eprintln!("forkd-init: {how:?}");
    let _ = kill(Pid::from_raw(-1), Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        reap();
        if matches!(
            waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)),
            Err(nix::errno::Errno::ECHILD)
        ) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    reap();
    nix::unistd::sync();
    let _ = nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        nix::mount::MsFlags::MS_REMOUNT | nix::mount::MsFlags::MS_RDONLY,
        None::<&str>,
    );
    let mode = match how {
        Ending::PowerOff => nix::sys::reboot::RebootMode::RB_POWER_OFF,
        Ending::Reboot => nix::sys::reboot::RebootMode::RB_AUTOBOOT,
    };
    let _ = nix::sys::reboot::reboot(mode);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}
