//! `watch`: a directory (recursive: its whole tree) watched with inotify,
//! its events streamed to the host until `unwatch`, the directory's removal
//! or the end of the host's channel (docs/agent-protocol.md, "watch").
//!
//! Invariants:
//! - at most [`MAX_WATCHES`] watches run at once, each its own inotify
//!   instance, closed when the watch ends, however it ends;
//! - a watch is registered in channel order (before the next frame is
//!   decoded), so an `unwatch` sent after it always finds it;
//! - a recursive watch covers at most [`MAX_WATCHED_DIRS`] directories:
//!   more at the start is an error, more later is reported as `lost`;
//! - the agent queues nothing for a slow host: it reads inotify only as
//!   fast as the channel takes frames, and the kernel's bounded queue
//!   absorbs the rest (its overflow, `IN_Q_OVERFLOW`, is reported as `lost`);
//! - a watch whose channel closed (the host went away) ends.

use super::files;
use super::server::Outbox;
use super::users;
use crate::protocol::{
    AgentError, ErrorKind, Reply, WatchEvent, WatchKind, WatchResult, MAX_WATCHED_DIRS,
    MAX_WATCHES, WATCH_BATCH,
};
use bytes::Bytes;
use nix::sys::inotify::{AddWatchFlags as F, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

/// The running watches, by the id of their `watch` request.
#[derive(Default)]
pub struct Watches {
    running: Mutex<HashMap<u64, oneshot::Sender<()>>>,
}

/// An inotify instance as tokio's `AsyncFd` wants it.
struct Fd(Inotify);

impl std::os::fd::AsRawFd for Fd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.0.as_fd().as_raw_fd()
    }
}

/// What a watch asks of a directory and what is under it.
fn mask() -> F {
    F::IN_CREATE
        | F::IN_MODIFY
        | F::IN_DELETE
        | F::IN_MOVED_FROM
        | F::IN_MOVED_TO
        | F::IN_ATTRIB
        | F::IN_DELETE_SELF
        | F::IN_MOVE_SELF
        | F::IN_ONLYDIR
}

impl Watches {
    /// Registers watch `id` (in channel order); the receiver fires on its
    /// `unwatch`.
    pub fn reserve(&self, id: u64) -> Result<oneshot::Receiver<()>, AgentError> {
        let mut running = self.running.lock().unwrap();
        if running.len() >= MAX_WATCHES {
            return Err(AgentError::new(
                ErrorKind::BadRequest,
                format!("{MAX_WATCHES} watches are running already: stop one first"),
            ));
        }
        let (tx, rx) = oneshot::channel();
        running.insert(id, tx);
        Ok(rx)
    }

    /// How many watches are running.
    pub fn running(&self) -> usize {
        self.running.lock().unwrap().len()
    }

    /// Ends watch `target`.
    pub fn unwatch(&self, target: u64) -> Result<(), AgentError> {
        match self.running.lock().unwrap().remove(&target) {
            Some(tx) => {
                let _ = tx.send(());
                Ok(())
            }
            None => Err(AgentError::new(
                ErrorKind::NotFound,
                format!("no watch {target} is running"),
            )),
        }
    }

    /// Runs watch `id` (reserved) to its end, answering on `outbox`.
    pub async fn run(
        &self,
        id: u64,
        path: String,
        user: Option<String>,
        recursive: bool,
        stop: oneshot::Receiver<()>,
        outbox: Outbox,
    ) {
        let tree = files::blocking(move || Tree::open(&path, user.as_deref(), recursive)).await;
        let end = match tree {
            Err(error) => Some(Reply::Error { error }),
            Ok(tree) => tree.stream(id, stop, &outbox).await,
        };
        // Gone from the table before its end is told: a host that starts
        // another watch on hearing it never finds this one counted.
        self.running.lock().unwrap().remove(&id);
        if let Some(end) = end {
            outbox.send(id, end, Bytes::new()).await;
        }
    }
}

/// One watch's inotify instance and the directories it covers.
struct Tree {
    inotify: Inotify,
    /// Each watched directory, relative to the root (`""`: the root).
    dirs: HashMap<WatchDescriptor, String>,
    /// The watched directory's absolute path.
    root: String,
    recursive: bool,
}

impl Tree {
    /// Watches `path` (and, `recursive`, every directory under it).
    fn open(path: &str, user: Option<&str>, recursive: bool) -> Result<Tree, AgentError> {
        let u = users::lookup_opt(user)?;
        let root = users::resolve_path(path, u.as_ref())?;
        let meta = std::fs::metadata(&root).map_err(|e| AgentError::io(&root, &e))?;
        if !meta.is_dir() {
            return Err(AgentError::new(
                ErrorKind::NotADirectory,
                format!("{root}: not a directory (only directories can be watched)"),
            ));
        }
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| inotify_error(&root, e))?;
        let mut dirs = HashMap::new();
        if watch_dirs(&inotify, &mut dirs, &root, "", recursive)? {
            return Err(AgentError::new(
                ErrorKind::BadRequest,
                format!(
                    "{root}: more than {MAX_WATCHED_DIRS} directories to watch; watch a smaller tree"
                ),
            ));
        }
        Ok(Tree {
            inotify,
            dirs,
            root,
            recursive,
        })
    }

    /// Streams events to `outbox` until `stop`, the root's removal or the
    /// channel's end; the final reply (none when the channel is gone).
    async fn stream(
        self,
        id: u64,
        mut stop: oneshot::Receiver<()>,
        outbox: &Outbox,
    ) -> Option<Reply> {
        let Tree {
            inotify,
            mut dirs,
            root,
            recursive,
        } = self;
        // SAFETY: the instance is moved into the AsyncFd, which owns it
        // (and its fd) until it is dropped.
        let fd = match unsafe { AsyncFd::register_with_interest(Fd(inotify), Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
        {
            Ok(fd) => fd,
            Err(e) => {
                let error = AgentError::io(&root, &e);
                return Some(Reply::Error { error });
            }
        };
        let mut tree = Lens {
            dirs: &mut dirs,
            root: &root,
            recursive,
        };
        outbox
            .send(id, Reply::Started { pid: 0 }, Bytes::new())
            .await;
        let mut result = WatchResult::default();
        loop {
            let raw = tokio::select! {
                _ = &mut stop => break,
                _ = outbox.closed() => return None,
                r = read(&fd) => r,
            };
            let raw = match raw {
                Ok(raw) => raw,
                Err(e) => {
                    let error = AgentError::io(&root, &e);
                    return Some(Reply::Error { error });
                }
            };
            let (events, lost, gone) = tree.translate(&fd.get_ref().0, raw);
            result.events += events.len() as u64;
            send_events(id, events, lost, outbox).await;
            if gone {
                result.gone = true;
                break;
            }
        }
        let result = serde_json::to_value(&result).expect("results serialise");
        Some(Reply::Ok { result })
    }
}

/// The part of a [`Tree`] that turns inotify events into watch events.
struct Lens<'a> {
    dirs: &'a mut HashMap<WatchDescriptor, String>,
    root: &'a str,
    recursive: bool,
}

impl Lens<'_> {
    /// The watch events of `raw`, whether some were lost, and whether the
    /// root is gone. New directories of a recursive watch are watched.
    fn translate(
        &mut self,
        inotify: &Inotify,
        raw: Vec<InotifyEvent>,
    ) -> (Vec<WatchEvent>, bool, bool) {
        let (mut out, mut lost, mut gone) = (Vec::new(), false, false);
        for ev in raw {
            if ev.mask.contains(F::IN_Q_OVERFLOW) {
                lost = true;
                continue;
            }
            let Some(dir) = self.dirs.get(&ev.wd).cloned() else {
                continue;
            };
            if ev.mask.contains(F::IN_IGNORED) {
                self.dirs.remove(&ev.wd);
                gone |= dir.is_empty();
                continue;
            }
            let is_self = ev.mask.intersects(F::IN_DELETE_SELF | F::IN_MOVE_SELF);
            if is_self && !dir.is_empty() {
                // Its parent reported it already, by name.
                continue;
            }
            let name = match &ev.name {
                Some(n) => join(&dir, &n.to_string_lossy()),
                None => dir.clone(),
            };
            let new_dir =
                ev.mask.contains(F::IN_ISDIR) && ev.mask.intersects(F::IN_CREATE | F::IN_MOVED_TO);
            if self.recursive && new_dir {
                lost |= self.watch_new(inotify, &name);
            }
            for kind in kinds(ev.mask) {
                out.push(WatchEvent {
                    name: name.clone(),
                    kind,
                });
            }
            if is_self {
                gone = true;
            }
        }
        (out, lost, gone)
    }

    /// Watches new directory `rel` and everything under it; true when
    /// some of it could not be watched.
    fn watch_new(&mut self, inotify: &Inotify, rel: &str) -> bool {
        watch_dirs(inotify, self.dirs, self.root, rel, true).unwrap_or(true)
    }
}

/// Watches directory `rel` of `root` and, `deep`, every directory under
/// it (symlinks are not followed), recording each in `dirs`; true when
/// [`MAX_WATCHED_DIRS`] stopped it short. A directory below `rel` that
/// vanished meanwhile is skipped.
fn watch_dirs(
    inotify: &Inotify,
    dirs: &mut HashMap<WatchDescriptor, String>,
    root: &str,
    rel: &str,
    deep: bool,
) -> Result<bool, AgentError> {
    let mut todo = vec![rel.to_string()];
    while let Some(dir) = todo.pop() {
        if dirs.len() >= MAX_WATCHED_DIRS {
            return Ok(true);
        }
        let path = if dir.is_empty() {
            root.to_string()
        } else {
            format!("{}/{dir}", root.trim_end_matches('/'))
        };
        match inotify.add_watch(path.as_str(), mask()) {
            Ok(wd) => {
                dirs.insert(wd, dir.clone());
            }
            Err(nix::errno::Errno::ENOENT) if dir != rel => continue,
            Err(e) => return Err(inotify_error(&path, e)),
        }
        if !deep {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(&path) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(join(&dir, &entry.file_name().to_string_lossy()));
            }
        }
    }
    Ok(false)
}

/// The next events of `fd`, waiting for them.
async fn read(fd: &AsyncFd<Fd>) -> std::io::Result<Vec<InotifyEvent>> {
    loop {
        let mut guard = fd.readable().await?;
        match guard.try_io(|inner| {
            inner
                .get_ref()
                .0
                .read_events()
                .map_err(std::io::Error::from)
        }) {
            Ok(r) => return r,
            Err(_would_block) => continue,
        }
    }
}

/// Sends `events` in frames of at most [`WATCH_BATCH`]; `lost` goes on the
/// first (a lone frame when there are no events).
async fn send_events(id: u64, events: Vec<WatchEvent>, mut lost: bool, outbox: &Outbox) {
    if events.is_empty() && !lost {
        return;
    }
    let mut rest = events.as_slice();
    loop {
        let (now, later) = rest.split_at(rest.len().min(WATCH_BATCH));
        let body = Reply::Watch {
            events: now.to_vec(),
            lost,
        };
        outbox.send(id, body, Bytes::new()).await;
        lost = false;
        if later.is_empty() {
            return;
        }
        rest = later;
    }
}

/// envd's event types for one inotify mask (one event may be several).
fn kinds(mask: F) -> Vec<WatchKind> {
    let mut out = Vec::new();
    if mask.intersects(F::IN_CREATE | F::IN_MOVED_TO) {
        out.push(WatchKind::Create);
    }
    if mask.intersects(F::IN_MOVED_FROM | F::IN_MOVE_SELF) {
        out.push(WatchKind::Rename);
    }
    if mask.contains(F::IN_ATTRIB) {
        out.push(WatchKind::Chmod);
    }
    if mask.contains(F::IN_MODIFY) {
        out.push(WatchKind::Write);
    }
    if mask.intersects(F::IN_DELETE | F::IN_DELETE_SELF) {
        out.push(WatchKind::Remove);
    }
    out
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

fn inotify_error(path: &str, e: nix::errno::Errno) -> AgentError {
    match e {
        nix::errno::Errno::ENOSPC | nix::errno::Errno::EMFILE => AgentError::new(
            ErrorKind::BadRequest,
            format!(
                "{path}: the guest's inotify limits are reached \
                 (fs.inotify.max_user_watches / max_user_instances): {e}"
            ),
        ),
        e => AgentError::io(path, &std::io::Error::from(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{FrameDecoder, ReplyHeader};
    use tokio::sync::mpsc;

    /// Runs a watch on `dir` with an outbox whose frames the test reads.
    fn start(
        watches: &std::sync::Arc<Watches>,
        id: u64,
        dir: &str,
        recursive: bool,
    ) -> mpsc::Receiver<super::super::server::OutFrame> {
        let (outbox, rx) = Outbox::new();
        let stop = watches.reserve(id).unwrap();
        let w = watches.clone();
        let dir = dir.to_string();
        tokio::spawn(async move { w.run(id, dir, None, recursive, stop, outbox).await });
        rx
    }

    async fn next(rx: &mut mpsc::Receiver<super::super::server::OutFrame>) -> Reply {
        let f = tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv())
            .await
            .expect("a frame within 10 s")
            .expect("outbox open");
        let mut dec = FrameDecoder::new();
        dec.extend(&f.head);
        let frame = dec.next_frame().unwrap().unwrap();
        let h: ReplyHeader = serde_json::from_slice(&frame.header).unwrap();
        h.body
    }

    /// The events of a watch, read a frame at a time.
    struct Seen {
        rx: mpsc::Receiver<super::super::server::OutFrame>,
        pending: std::collections::VecDeque<WatchEvent>,
    }

    impl Seen {
        /// Consumes events up to and including one named `name` of `kind`.
        async fn until(&mut self, name: &str, kind: WatchKind) {
            loop {
                while let Some(e) = self.pending.pop_front() {
                    if e.name == name && e.kind == kind {
                        return;
                    }
                }
                match next(&mut self.rx).await {
                    Reply::Watch { events, .. } => self.pending.extend(events),
                    other => panic!("unexpected {other:?} waiting for {kind:?} {name}"),
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn recursive_watch_sees_writes_in_new_directories_and_ends_on_unwatch() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_str().unwrap().to_string();
        std::fs::create_dir(tmp.path().join("old")).unwrap();
        let watches = std::sync::Arc::new(Watches::default());
        let mut rx = start(&watches, 7, &root, true);
        assert_eq!(next(&mut rx).await, Reply::Started { pid: 0 });
        let mut seen = Seen {
            rx,
            pending: Default::default(),
        };

        std::fs::write(tmp.path().join("old/a.txt"), b"x").unwrap();
        seen.until("old/a.txt", WatchKind::Create).await;
        seen.until("old/a.txt", WatchKind::Write).await;
        std::fs::create_dir_all(tmp.path().join("new/deeper")).unwrap();
        seen.until("new", WatchKind::Create).await;
        // The new directory is watched from its creation on.
        std::fs::write(tmp.path().join("new/deeper/b.txt"), b"y").unwrap();
        seen.until("new/deeper/b.txt", WatchKind::Create).await;
        std::fs::rename(tmp.path().join("old/a.txt"), tmp.path().join("c.txt")).unwrap();
        seen.until("old/a.txt", WatchKind::Rename).await;
        seen.until("c.txt", WatchKind::Create).await;
        std::fs::remove_file(tmp.path().join("c.txt")).unwrap();
        seen.until("c.txt", WatchKind::Remove).await;

        watches.unwatch(7).unwrap();
        let end = loop {
            match next(&mut seen.rx).await {
                Reply::Watch { .. } => {}
                other => break other,
            }
        };
        let Reply::Ok { result } = end else {
            panic!("watch ended with {end:?}");
        };
        let r: WatchResult = serde_json::from_value(result).unwrap();
        assert!(r.events >= 7 && !r.gone, "{r:?}");
        assert!(watches.running.lock().unwrap().is_empty());
        assert_eq!(watches.unwatch(7).unwrap_err().kind, ErrorKind::NotFound);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_plain_watch_ignores_subdirectories_and_ends_when_its_directory_goes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("w");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let watches = std::sync::Arc::new(Watches::default());
        let mut rx = start(&watches, 1, dir.to_str().unwrap(), false);
        assert_eq!(next(&mut rx).await, Reply::Started { pid: 0 });
        std::fs::write(dir.join("sub/hidden.txt"), b"x").unwrap();
        std::fs::write(dir.join("seen.txt"), b"x").unwrap();
        // The first events are about seen.txt: sub/ is not watched.
        match next(&mut rx).await {
            Reply::Watch { events, .. } => assert_eq!(events[0].name, "seen.txt", "{events:?}"),
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
        let end = loop {
            match next(&mut rx).await {
                Reply::Watch { events, .. } => {
                    assert!(
                        events.iter().all(|e| !e.name.starts_with("sub/")),
                        "{events:?}"
                    )
                }
                other => break other,
            }
        };
        let Reply::Ok { result } = end else {
            panic!("watch ended with {end:?}");
        };
        assert!(serde_json::from_value::<WatchResult>(result).unwrap().gone);
        assert!(watches.running.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn watching_a_file_or_a_missing_path_is_refused_and_the_count_is_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let watches = std::sync::Arc::new(Watches::default());
        for (path, kind) in [
            (file.to_str().unwrap().to_string(), ErrorKind::NotADirectory),
            (
                format!("{}/missing", tmp.path().display()),
                ErrorKind::NotFound,
            ),
        ] {
            let mut rx = start(&watches, 2, &path, false);
            match next(&mut rx).await {
                Reply::Error { error } => assert_eq!(error.kind, kind, "{error}"),
                other => panic!("{other:?}"),
            }
        }
        for id in 0..MAX_WATCHES as u64 {
            watches.reserve(100 + id).unwrap();
        }
        assert_eq!(watches.reserve(1).unwrap_err().kind, ErrorKind::BadRequest);
    }
}
