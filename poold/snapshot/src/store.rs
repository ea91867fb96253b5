//! Access to the layer store from the CLI and the daemon.
//!
//! RocksDB allows one read-write opener per store. Neither the CLI nor poold
//! keeps the store open for writing between operations: each write (create a
//! snapshot, delete one, GC) opens it, does its work and closes it, waiting
//! for the lock while another forkd process writes. So `forkd snapshot create`
//! works while poold runs, and the two never fail on each other's lock; a
//! long ingest only makes the other writer wait. Readers that live long (the
//! daemon, forkd-fs) use RocksDB secondary views instead, and so does a
//! long read that ends, a push to a hub ([`open_view`]): it must not make
//! every writer wait for a slow link.

use crate::paths::Paths;
use anyhow::{Context, Result};
use forkd_layers::{Store, StoreOptions, StoreReader, StoreView};
use std::path::PathBuf;
use std::time::Duration;

/// How long a writer waits for another forkd process to release the store.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(300);

/// The store open read-write, and this process's turn to write.
///
/// RocksDB's lock file only keeps *other* processes out, and two opens in
/// one process race on its files; so writers in one process also take turns
/// on a process-wide mutex, held as long as this value lives.
pub struct RwStore {
    store: std::sync::Arc<Store>,
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl RwStore {
    /// The store as an `Arc`, for work that wants one (a hub transfer run
    /// on this thread). Use it only while this value lives: this process's
    /// turn to write ends when it is dropped.
    pub fn shared(&self) -> std::sync::Arc<Store> {
        self.store.clone()
    }
}

impl std::ops::Deref for RwStore {
    type Target = Store;
    fn deref(&self) -> &Store {
        &self.store
    }
}

/// Opens the store read-write, waiting up to [`LOCK_TIMEOUT`] for other
/// processes and for this process's other writers. Blocking: call from a
/// blocking context.
pub fn open_rw(paths: &Paths) -> Result<RwStore> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let dir = paths.store_dir();
    let opts = StoreOptions {
        lock_timeout: LOCK_TIMEOUT,
        ..StoreOptions::default()
    };
    let store = Store::open(&dir, opts)
        .with_context(|| format!("opening the layer store at {}", dir.display()))?;
    Ok(RwStore {
        store: std::sync::Arc::new(store),
        _turn: turn,
    })
}

/// A long-lived read-only view (RocksDB secondary) private to one process,
/// kept in `secondary_dir`. Call `catch_up` before reads that must see the
/// latest writes of other processes.
pub fn open_reader(paths: &Paths, secondary_dir: PathBuf) -> Result<StoreReader> {
    let dir = paths.store_dir();
    if !dir.join("db").is_dir() {
        // A secondary needs an existing store: create an empty one.
        drop(open_rw(paths)?);
    }
    forkd_vmm::private::create_dir_all(&secondary_dir)
        .with_context(|| format!("creating {}", secondary_dir.display()))?;
    StoreReader::open_secondary(&dir, &secondary_dir).with_context(|| {
        format!(
            "opening a read view of the layer store at {}",
            dir.display()
        )
    })
}

/// A read-only view of the store for one long read (a push to a hub), kept
/// in a staging directory of its own that goes with it (and, should the
/// process be killed, with the next staging sweep).
///
/// Unlike [`open_rw`] it takes no turn: snapshot creates, pulls and GC go
/// on while it reads. It sees the store as it was when opened; a chunk GC
/// moves meanwhile is found again (the view catches up and retries), and
/// one GC deleted (its snapshot deleted meanwhile) is an error.
pub struct ReadView {
    // Dropped before the directory it lives in.
    reader: StoreReader,
    _dir: crate::staging::Staging,
}

impl ReadView {
    /// A clonable read handle, valid while this value lives.
    pub fn view(&self) -> StoreView {
        self.reader.view()
    }
}

/// Opens a [`ReadView`]. Blocking: call from a blocking context.
pub fn open_view(paths: &Paths) -> Result<ReadView> {
    let dir = crate::staging::Staging::create(&paths.staging_dir(), "view")?;
    let reader = open_reader(paths, dir.join("secondary"))?;
    Ok(ReadView { reader, _dir: dir })
}

/// Runs `f` with the store open read-write on a blocking thread.
pub async fn with_rw<T, F>(paths: &Paths, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(&Store) -> Result<T> + Send + 'static,
{
    let paths = paths.clone();
    tokio::task::spawn_blocking(move || {
        let store = open_rw(&paths)?;
        f(&store)
    })
    .await
    .context("store task panicked")?
}
