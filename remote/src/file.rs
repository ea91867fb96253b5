//! A hub in a local directory (`file:///dir`), also what `forkd hub serve`
//! serves from.
//!
//! Writes are atomic and durable: an object is written under a temporary
//! name in its final directory, fdatasync'd, then renamed into place; the
//! directories that gained names are fsync'd by [`FileHub::flush`], which
//! push calls before writing snapshot records and tags, so a record never
//! names objects a crash could lose. Reads never follow symlinks and check
//! an object's size before reading it.

use super::layout::Key;
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A hub directory. Cheap to clone.
#[derive(Clone)]
pub struct FileHub {
    inner: Arc<Inner>,
}

struct Inner {
    root: PathBuf,
    /// Directories that gained a name since the last flush.
    dirty: Mutex<BTreeSet<PathBuf>>,
}

impl FileHub {
    /// Opens the hub at `root` (an absolute path), creating it if needed.
    pub fn open(root: &Path) -> Result<FileHub> {
        if !root.is_absolute() {
            bail!("hub directory {} must be an absolute path", root.display());
        }
        std::fs::create_dir_all(root)
            .with_context(|| format!("creating hub directory {}", root.display()))?;
        Ok(FileHub {
            inner: Arc::new(Inner {
                root: root.to_path_buf(),
                dirty: Mutex::new(BTreeSet::new()),
            }),
        })
    }

    /// The hub directory.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Where `key` lives.
    pub fn path(&self, key: &Key) -> PathBuf {
        self.inner.root.join(key.path())
    }

    /// Reads an object; `None` if absent. Refuses symlinks, non-files and
    /// objects over the kind's size limit.
    pub fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        let path = self.path(key);
        let file = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        };
        let meta = file.metadata()?;
        if !meta.is_file() {
            bail!("{} is not a regular file", path.display());
        }
        if meta.len() > key.max_len() {
            bail!(
                "{key} at {} is {} bytes, over the {}-byte limit for its kind",
                path.display(),
                meta.len(),
                key.max_len()
            );
        }
        let mut buf = Vec::with_capacity(meta.len() as usize);
        file.take(key.max_len() + 1)
            .read_to_end(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if buf.len() as u64 > key.max_len() {
            bail!("{key} at {} grew past its size limit", path.display());
        }
        Ok(Some(buf))
    }

    /// Writes an object atomically (temporary name, fdatasync, rename).
    pub fn put(&self, key: &Key, data: &[u8]) -> Result<()> {
        let path = self.path(key);
        let dir = path.parent().expect("object paths have a parent");
        if !dir.is_dir() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let mut dirty = self.inner.dirty.lock().unwrap();
            let mut d = dir;
            while d != self.inner.root {
                d = d.parent().expect("inside the root");
                dirty.insert(d.to_path_buf());
            }
        }
        let tmp = dir.join(format!(".tmp-{}", crate::random_hex(8)));
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(data)?;
            f.sync_data()?;
            std::fs::rename(&tmp, &path)
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(e).with_context(|| format!("writing {}", path.display()));
        }
        self.inner.dirty.lock().unwrap().insert(dir.to_path_buf());
        Ok(())
    }

    /// Reads `len` bytes at `start` of an object; `None` if it is absent.
    /// Refuses a range past the object's end or over its kind's limit.
    pub fn get_range(&self, key: &Key, start: u64, len: u64) -> Result<Option<Vec<u8>>> {
        use std::os::unix::fs::FileExt;
        let path = self.path(key);
        let file = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        };
        let meta = file.metadata()?;
        let end = start.checked_add(len);
        if !meta.is_file() || end.is_none_or(|e| e > meta.len()) || len > key.max_len() {
            bail!(
                "{key} at {}: a read of {len} bytes at {start} does not fit the object ({} bytes)",
                path.display(),
                meta.len()
            );
        }
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, start)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(Some(buf))
    }

    /// Names of the objects directly in `dir` (`index`, `snapshots`, ...),
    /// as paths relative to the root; temporaries are skipped.
    pub fn list(&self, dir: &str) -> Result<Vec<String>> {
        let path = self.inner.root.join(dir);
        let rd = match std::fs::read_dir(&path) {
            Ok(rd) => rd,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("listing {}", path.display())),
        };
        let mut out = Vec::new();
        for e in rd {
            let e = e.with_context(|| format!("listing {}", path.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') && e.file_type().is_ok_and(|t| t.is_file()) {
                out.push(format!("{dir}/{name}"));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Removes an object (absent is fine).
    pub fn delete(&self, key: &Key) -> Result<()> {
        let path = self.path(key);
        match std::fs::remove_file(&path) {
            Ok(()) => {
                if let Some(d) = path.parent() {
                    self.inner.dirty.lock().unwrap().insert(d.to_path_buf());
                }
                Ok(())
            }
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
        }
    }

    /// For each key, whether the object exists (as a regular file).
    pub fn has(&self, keys: &[Key]) -> Vec<bool> {
        keys.iter()
            .map(|k| std::fs::symlink_metadata(self.path(k)).is_ok_and(|m| m.file_type().is_file()))
            .collect()
    }

    /// fsyncs every directory that gained a name since the last flush, so
    /// the objects written so far survive a crash.
    pub fn flush(&self) -> Result<()> {
        let dirs = std::mem::take(&mut *self.inner.dirty.lock().unwrap());
        // Deepest first: a name in a directory before the directory's own name.
        for d in dirs.iter().rev() {
            File::open(d)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("syncing directory {}", d.display()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkd_layers::ChunkId;

    #[test]
    fn put_get_has_and_limits() {
        let dir = tempfile::tempdir().unwrap();
        let hub = FileHub::open(dir.path()).unwrap();
        let k = Key::Chunk(ChunkId::of(b"a"));
        assert_eq!(hub.get(&k).unwrap(), None);
        hub.put(&k, b"hello").unwrap();
        hub.flush().unwrap();
        assert_eq!(hub.get(&k).unwrap().unwrap(), b"hello");
        assert_eq!(hub.has(&[k.clone(), Key::tag("t").unwrap()]), [true, false]);
        let t = Key::tag("t").unwrap();
        hub.put(&t, &vec![b'x'; 5000]).unwrap();
        assert!(hub.get(&t).unwrap_err().to_string().contains("limit"));
        // Symlinks are not followed.
        let s = Key::tag("s").unwrap();
        std::os::unix::fs::symlink("/etc/hostname", hub.path(&s)).unwrap();
        assert!(hub.get(&s).is_err());
        assert_eq!(hub.has(&[s]), [false]);
        assert!(FileHub::open(Path::new("relative/dir")).is_err());
    }
}
