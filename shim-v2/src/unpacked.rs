//! containerd's own unpacked copy of a checkpoint, removed once the restore is done with it.
//!
//! For a restore from the content store (`ctr container restore`, `ctr task start
//! --checkpoint`), containerd 1.7 and 2.x unpack the checkpoint into
//! `$XDG_RUNTIME_DIR` (else `$TMPDIR`, else `/tmp`) as `ctrd-checkpoint<digits>`, hand that
//! path to the shim's Create, and never remove it. A GPU checkpoint holds the container's
//! device memory (10–140 GB), often on a tmpfs: every restore would leak that much host
//! memory. Nothing reads the copy after the restore (the content store keeps the
//! checkpoint), so the shim removes it then, or when the restore is refused or the task is
//! deleted without one. Only that exact shape of path is touched: CRI's `RestoreFromPath`
//! and `--image-path` restores name directories that are the user's.

use std::path::{Path, PathBuf};

/// `GPUCR_KEEP_UNPACKED_CHECKPOINTS=1` (in containerd's environment): keep them, e.g. to
/// look into a failed restore.
pub const KEEP_ENV: &str = "GPUCR_KEEP_UNPACKED_CHECKPOINTS";

const PREFIX: &str = "ctrd-checkpoint";

/// A checkpoint directory containerd unpacked for this restore; removed on drop.
#[derive(Debug)]
pub struct UnpackedCheckpoint {
    path: PathBuf,
    /// The removal [`UnpackedCheckpoint::remove_in_background`] started.
    removal: Option<tokio::task::JoinHandle<()>>,
}

impl UnpackedCheckpoint {
    /// `image` when it is containerd's unpacked copy, judged from this process's
    /// environment (the shim inherits containerd's).
    pub fn recognize(id: &str, image: &Path) -> Option<Self> {
        if std::env::var_os(KEEP_ENV).is_some_and(|v| v == "1") {
            return None;
        }
        let found = Self::recognize_in(image, &containerd_temp_dir());
        if let Some(u) = &found {
            tracing::debug!(id, image = %u.path.display(),
                "containerd's unpacked copy of the checkpoint: removed after the restore");
        }
        found
    }

    /// `image` when it is `<temp>/ctrd-checkpoint<digits>` and a directory (not a link).
    pub fn recognize_in(image: &Path, temp: &Path) -> Option<Self> {
        let digits = image.file_name()?.to_str()?.strip_prefix(PREFIX)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let parent = std::fs::canonicalize(image.parent()?).ok()?;
        if parent != std::fs::canonicalize(temp).ok()? {
            return None;
        }
        let meta = std::fs::symlink_metadata(image).ok()?;
        meta.is_dir().then(|| Self {
            path: image.to_path_buf(),
            removal: None,
        })
    }

    /// Starts removing it, off the runtime's workers, without waiting (after a successful
    /// restore: Start need not wait). Needs a tokio runtime.
    pub fn remove_in_background(&mut self) {
        if self.removal.is_none() && !self.path.as_os_str().is_empty() {
            let path = std::mem::take(&mut self.path);
            self.removal = Some(tokio::task::spawn_blocking(move || Self::remove(&path)));
        }
    }

    /// Removes it (or waits for the removal already started), off the runtime's workers: a
    /// shim about to exit (after a refused Create or a Delete) must not leave half of it.
    pub async fn discard(mut self) {
        self.remove_in_background();
        if let Some(removal) = self.removal.take() {
            let _ = removal.await;
        }
    }

    fn remove(path: &Path) {
        let started = std::time::Instant::now();
        match std::fs::remove_dir_all(path) {
            Ok(()) => tracing::info!(image = %path.display(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "removed containerd's unpacked copy of the checkpoint"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(image = %path.display(),
                "could not remove containerd's unpacked copy of the checkpoint: {e}"),
        }
    }
}

impl Drop for UnpackedCheckpoint {
    fn drop(&mut self) {
        let path = std::mem::take(&mut self.path);
        if path.as_os_str().is_empty() {
            return; // being removed, or discarded
        }
        // Freeing tens of GB of tmpfs pages takes a while: never on a runtime worker.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || Self::remove(&path));
            }
            Err(_) => Self::remove(&path),
        }
    }
}

/// The bundle's note of the copy a restore uses: a shim killed during the restore leaves
/// it to `shim delete` (another process), which containerd runs in the bundle.
const RECORD: &str = "gpucr-unpacked-checkpoint";

/// Notes `u` in the bundle, for [`discard_recorded`].
pub fn record(bundle: &Path, u: &UnpackedCheckpoint) {
    if let Err(e) = std::fs::write(bundle.join(RECORD), u.path.as_os_str().as_encoded_bytes()) {
        tracing::warn!(image = %u.path.display(),
            "no note of containerd's unpacked copy in the bundle (a shim killed during the \
             restore would leave it): {e}");
    }
}

/// `shim delete` after a dead shim: removes the copy its restore used. Safe because
/// containerd (1.7 and 2.x `services/tasks`) only reads it during the Create RPC that
/// passes it, never after, and made it with `MkdirTemp` for that one Create; the path is
/// checked for containerd's shape again, so a changed note cannot aim it elsewhere.
pub async fn discard_recorded(bundle: &Path) {
    if std::env::var_os(KEEP_ENV).is_some_and(|v| v == "1") {
        return;
    }
    discard_recorded_in(bundle, &containerd_temp_dir()).await
}

async fn discard_recorded_in(bundle: &Path, temp: &Path) {
    let note = bundle.join(RECORD);
    let Ok(bytes) = std::fs::read(&note) else {
        return;
    };
    let path = PathBuf::from(String::from_utf8_lossy(&bytes).into_owned());
    if let Some(u) = UnpackedCheckpoint::recognize_in(&path, temp) {
        tracing::info!(image = %path.display(), "removing the unpacked copy a dead shim's \
            restore used");
        u.discard().await;
    }
    let _ = std::fs::remove_file(note);
}

/// Where containerd's `os.MkdirTemp(os.Getenv("XDG_RUNTIME_DIR"), …)` puts its directory.
fn containerd_temp_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => std::env::temp_dir(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(name: &str) -> (tempfile::TempDir, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join(name);
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("pages-1.img"), b"x").unwrap();
        (t, p)
    }

    #[test]
    fn only_containerds_temp_copies_are_recognized() {
        let (t, p) = dir_with("ctrd-checkpoint3976110122");
        assert!(UnpackedCheckpoint::recognize_in(&p, t.path()).is_some());
        // Another directory than containerd's temp dir.
        let other = tempfile::tempdir().unwrap();
        assert!(UnpackedCheckpoint::recognize_in(&p, other.path()).is_none());
        // CRI's checkpoint directory and other names.
        for name in [
            "ctrd-checkpoint",
            "ctrd-checkpoint12a",
            "checkpoint123",
            "my-ckpt",
        ] {
            let (t, p) = dir_with(name);
            assert!(
                UnpackedCheckpoint::recognize_in(&p, t.path()).is_none(),
                "{name}"
            );
        }
        // A link of that name is not containerd's directory.
        let (t2, target) = dir_with("user-image");
        let link = t2.path().join("ctrd-checkpoint42");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(UnpackedCheckpoint::recognize_in(&link, t2.path()).is_none());
        // A file.
        let f = t2.path().join("ctrd-checkpoint43");
        std::fs::write(&f, b"").unwrap();
        assert!(UnpackedCheckpoint::recognize_in(&f, t2.path()).is_none());
    }

    #[test]
    fn dropped_copies_are_removed() {
        let (t, p) = dir_with("ctrd-checkpoint7");
        drop(UnpackedCheckpoint::recognize_in(&p, t.path()).unwrap());
        assert!(!p.exists());
        assert!(t.path().exists());
    }

    #[tokio::test]
    async fn discarded_copies_are_gone_when_discard_returns() {
        let (t, p) = dir_with("ctrd-checkpoint9");
        UnpackedCheckpoint::recognize_in(&p, t.path())
            .unwrap()
            .discard()
            .await;
        assert!(!p.exists());
    }

    #[tokio::test]
    async fn discard_waits_for_the_background_removal() {
        let (t, p) = dir_with("ctrd-checkpoint10");
        let mut u = UnpackedCheckpoint::recognize_in(&p, t.path()).unwrap();
        u.remove_in_background();
        u.discard().await;
        assert!(!p.exists());
    }

    #[tokio::test]
    async fn a_recorded_copy_is_removed_by_another_process_s_delete() {
        let (t, p) = dir_with("ctrd-checkpoint11");
        let bundle = tempfile::tempdir().unwrap();
        let u = UnpackedCheckpoint::recognize_in(&p, t.path()).unwrap();
        record(bundle.path(), &u);
        std::mem::forget(u); // the shim that noted it died
        discard_recorded_in(bundle.path(), t.path()).await;
        assert!(!p.exists());
        assert!(!bundle.path().join(RECORD).exists());
    }

    #[tokio::test]
    async fn dropped_on_a_runtime_they_are_removed_off_it() {
        let (t, p) = dir_with("ctrd-checkpoint8");
        drop(UnpackedCheckpoint::recognize_in(&p, t.path()).unwrap());
        for _ in 0..200 {
            if !p.exists() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("{} still there", p.display());
    }
}
