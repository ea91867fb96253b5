//! The mount's journal: what a restarted worker must know to go on serving
//! the kernel's existing connection (see `holder`).
//!
//! The kernel keeps inode numbers and file handles a worker gave it; a new
//! worker must answer for them exactly as the old one would. So every
//! number handed out, and every change of the delete protocol's state, is
//! appended here *before* the kernel is told: an inode number reached the
//! kernel only if its line is in the file. A worker replays the file at
//! start, then rewrites it compacted.
//!
//! One JSON object per line. A kill -9 mid-append leaves at most a torn
//! last line, which replay skips (its number never reached the kernel).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use forkd_layers::SnapshotId;
use serde::{Deserialize, Serialize};

/// One journal line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Entry {
    /// A snapshot's directory got `ino` (its files follow it in order).
    Snapshot { ino: u64, id: SnapshotId },
    /// A tag's symlink got `ino`.
    Tag { ino: u64, name: String },
    /// File handle `fh` was opened on a file of `id`.
    Open { fh: u64, id: SnapshotId },
    /// File handle `fh` was released.
    Close { fh: u64 },
    /// `begin_delete(id)` hid the snapshot.
    Hide { id: SnapshotId },
    /// `end_delete(id, false)`: visible again.
    Unhide { id: SnapshotId },
    /// `end_delete(id, true)`: gone for the rest of the mount.
    Gone { id: SnapshotId },
}

/// Appends entries to the journal file.
pub struct Journal {
    path: PathBuf,
    file: Mutex<File>,
}

impl Journal {
    /// Starts an empty journal at `path` (a new mount).
    pub fn create(path: &Path) -> Result<()> {
        private_file(path)
            .with_context(|| format!("creating the mount journal {}", path.display()))?;
        Ok(())
    }

    /// Every whole entry of the journal at `path`, in order.
    pub fn load(path: &Path) -> Result<Vec<Entry>> {
        let f = File::open(path)
            .with_context(|| format!("opening the mount journal {}", path.display()))?;
        let mut out = Vec::new();
        for line in BufReader::new(f).lines() {
            let line = line.with_context(|| format!("reading {}", path.display()))?;
            match serde_json::from_str(&line) {
                Ok(e) => out.push(e),
                // A torn last line: its number never reached the kernel.
                Err(_) => tracing::warn!("{}: skipping a torn line", path.display()),
            }
        }
        Ok(out)
    }

    /// Rewrites the journal at `path` as `entries` (atomically) and opens
    /// it for appending.
    pub fn rewrite(path: &Path, entries: &[Entry]) -> Result<Journal> {
        let tmp = path.with_extension("journal.tmp");
        let mut f = private_file(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
        let mut buf = Vec::new();
        for e in entries {
            serde_json::to_writer(&mut buf, e)?;
            buf.push(b'\n');
        }
        f.write_all(&buf)?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("replacing the mount journal {}", path.display()))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Journal {
            path: path.to_path_buf(),
            file: Mutex::new(file),
        })
    }

    /// Appends one entry. A failure is logged: the worker goes on serving
    /// (only a later restart would miss the entry).
    pub fn append(&self, e: &Entry) {
        let mut line = serde_json::to_vec(e).unwrap_or_default();
        line.push(b'\n');
        if let Err(err) = self.file.lock().unwrap().write_all(&line) {
            tracing::error!(
                "appending to the mount journal {}: {err}; a worker restart may lose track of it",
                self.path.display()
            );
        }
    }
}

/// Creates (or truncates) a file only root reads.
fn private_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_skips_a_torn_tail() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.journal");
        Journal::create(&p).unwrap();
        let id = SnapshotId([7; 16]);
        let j = Journal::rewrite(&p, &[Entry::Snapshot { ino: 3, id }]).unwrap();
        j.append(&Entry::Tag {
            ino: 9,
            name: "py".into(),
        });
        j.append(&Entry::Open { fh: 1, id });
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"{\"close\":{\"fh\"")
            .unwrap();
        assert_eq!(
            Journal::load(&p).unwrap(),
            vec![
                Entry::Snapshot { ino: 3, id },
                Entry::Tag {
                    ino: 9,
                    name: "py".into()
                },
                Entry::Open { fh: 1, id },
            ]
        );
    }
}
