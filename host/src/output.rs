//! Output files (PNG, GGUF) that appear complete or not at all.
//!
//! [`OutputFile::create`] runs before any work: it refuses a target that is
//! a folder, a device node, a FIFO or anything else that is not a regular
//! file (writing is done by renaming a new file over the target, which
//! would replace such a node, `/dev/null` included when run as root), and it
//! creates the temporary file in the target's folder right away, so an
//! unwritable folder fails in the first second rather than after the work.
//! [`OutputFile::commit`] fills, flushes, syncs and renames it into place;
//! dropping an uncommitted `OutputFile` (an error, a cancellation, a panic)
//! removes the temporary file.

use anyhow::{anyhow, bail, Context as _};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A target path and its temporary file beside it.
pub struct OutputFile {
    path: PathBuf,
    tmp: tempfile::NamedTempFile,
    _pending: Pending,
}

/// Temporary files of live [`OutputFile`]s, for [`remove_pending`].
static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Keeps a temporary file listed in [`PENDING`] while its `OutputFile` lives.
struct Pending(PathBuf);

impl Drop for Pending {
    fn drop(&mut self) {
        let mut l = PENDING.lock().unwrap_or_else(|p| p.into_inner());
        l.retain(|p| p != &self.0);
    }
}

/// Removes the temporary files of every live [`OutputFile`]: for a process
/// about to end without unwinding (ggml's abort, see `rpc.rs`), where their
/// destructors will not run. Never blocks: if the list is locked at that
/// moment, nothing is removed.
pub fn remove_pending() {
    if let Ok(l) = PENDING.try_lock() {
        for p in l.iter() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// What kind of file system object `m` is, for an error line.
fn kind(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "a folder"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

fn check_target(path: &Path) -> anyhow::Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => bail!(
            "--output: {} is {}; give the path of a new or regular file",
            path.display(),
            kind(&m)
        ),
        _ => Ok(()),
    }
}

impl OutputFile {
    /// Checks `path` and opens its temporary file (see the module docs).
    pub fn create(path: &Path) -> anyhow::Result<OutputFile> {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            bail!("--output: folder {} does not exist", dir.display());
        }
        check_target(path)?;
        let tmp = tempfile::Builder::new()
            .prefix(".sdhost-")
            .suffix(".partial")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .tempfile_in(dir)
            .map_err(|e| anyhow!("--output: cannot write in folder {}: {e}", dir.display()))?;
        let pending = Pending(tmp.path().to_path_buf());
        PENDING
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(pending.0.clone());
        Ok(OutputFile {
            path: path.to_path_buf(),
            tmp,
            _pending: pending,
        })
    }

    /// The target path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `write` fills the file; then it is flushed, synced and renamed over
    /// the target. On any failure the temporary file is removed.
    pub fn commit(
        mut self,
        write: impl FnOnce(&mut std::io::BufWriter<&mut std::fs::File>) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let what = || format!("writing {}", self.path.display());
        {
            let mut w = std::io::BufWriter::new(self.tmp.as_file_mut());
            write(&mut w)?;
            w.flush().with_context(what)?;
        }
        self.tmp.as_file().sync_all().with_context(what)?;
        // The target may have changed during the work.
        check_target(&self.path)?;
        let path = self.path.clone();
        self.tmp
            .persist(&path)
            .map_err(|e| anyhow!("writing {}: {}", path.display(), e.error))?;
        Ok(())
    }
}
