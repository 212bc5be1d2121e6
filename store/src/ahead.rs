//! Large files taken into the store early: the hook's images are finished once its copy-out is
//! done, seconds before the checkpoint directory is sealed (the driver's lock, CRIU's dump and
//! the give-back come between), so the shim has them adopted ([`crate::pack`]) while those
//! run, and the directory's ingest ([`crate::dir::ingest_ahead`]) then uses what was taken
//! for each file still the same (inode, size and modification time) instead of hashing it
//! again.
//!
//! What was taken and no ingest uses (a checkpoint that failed) is a pack with pointers no
//! manifest names: `gc` removes them, as after any failed write.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{io, Result, StoreError};
use crate::pack::Adopted;
use crate::progress::Progress;
use crate::store::Store;

/// What [`take_ahead`] took, by file (device and inode).
#[derive(Debug, Default)]
pub struct TakenAhead {
    files: HashMap<(u64, u64), Early>,
}

#[derive(Debug)]
struct Early {
    path: PathBuf,
    len: u64,
    mtime: (i64, i64),
    adopted: Adopted,
}

fn key(md: &fs::Metadata) -> (u64, u64) {
    (md.dev(), md.ino())
}

impl TakenAhead {
    /// Bytes of the files taken (logical).
    pub fn bytes(&self) -> u64 {
        self.files.values().map(|e| e.len).sum()
    }

    /// Of those, the bytes the store did not hold before.
    pub fn new_bytes(&self) -> u64 {
        self.files.values().map(|e| e.adopted.new_bytes).sum()
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// What was taken of the file at `path` (`md` its metadata, links followed), if it was and
    /// its first `size` bytes are what was taken. A file changed since is an error: its pack
    /// is the same inode, so the pointers taken from it no longer name their bytes; they are
    /// withdrawn.
    pub(crate) fn take(
        &mut self,
        store: &Store,
        path: &Path,
        md: &fs::Metadata,
        size: u64,
    ) -> Result<Option<Adopted>> {
        let Some(early) = self.files.remove(&key(md)) else {
            return Ok(None);
        };
        if early.len == size && early.mtime == (md.mtime(), md.mtime_nsec()) {
            return Ok(Some(early.adopted));
        }
        tracing::error!(path = %early.path.display(), "changed after it was taken into the \
            store: its pointers are withdrawn");
        early.adopted.withdraw(store);
        Err(StoreError::ChangedAfterTaken {
            path: path.to_path_buf(),
        })
    }
}

/// Takes every regular file of at least `min_size` bytes under `root` (a [`crate::Stage`]
/// holding finished images; links are not followed) into `store` in place, on `threads`
/// threads. Files that cannot be adopted (another filesystem, several names) are left to the
/// ingest, which copies them.
pub fn take_ahead(
    store: &Store,
    root: &Path,
    min_size: u64,
    threads: usize,
    progress: &dyn Progress,
) -> Result<TakenAhead> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).map_err(io("cannot list", &dir))? {
            let entry = entry.map_err(io("cannot list", &dir))?;
            let path = entry.path();
            let md = fs::symlink_metadata(&path).map_err(io("cannot stat", &path))?;
            if md.is_dir() {
                dirs.push(path);
            } else if md.is_file() && md.len() >= min_size.max(1) && store.can_adopt(&path) {
                found.push((path, md));
            }
        }
    }
    progress.start(found.iter().map(|(_, md)| md.len()).sum());
    let writer = store.writer()?;
    let mut taken = TakenAhead::default();
    let all = found.into_iter().try_for_each(|(path, md)| {
        let adopted = writer.adopt(&path, md.len(), threads, progress)?;
        let early = Early {
            len: md.len(),
            mtime: (md.mtime(), md.mtime_nsec()),
            adopted,
            path,
        };
        taken.files.insert(key(&md), early);
        Ok::<_, StoreError>(())
    });
    progress.finish();
    all?;
    Ok(taken)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dir::tests::pattern as bytes;
    use crate::dir::{ingest_ahead, materialize, IngestOptions, CHUNK_SIZE};
    use crate::progress::NoProgress;

    fn opts() -> IngestOptions {
        IngestOptions {
            threads: 2,
            adopt: true,
            cut_by_content: crate::dir::no_file,
            ..crate::dir::tests::opts()
        }
    }

    /// A checkpoint directory whose `gpu-hook.1.data` links to a finished file in a stage.
    fn staged(store: &Store, data: &[u8]) -> (crate::Stage, tempfile::TempDir) {
        let stage = store.stage().unwrap();
        fs::create_dir(stage.path().join("1")).unwrap();
        let file = stage.path().join("1").join("data-000.bin");
        fs::write(&file, data).unwrap();
        let dir = tempfile::tempdir_in(store.root()).unwrap();
        std::os::unix::fs::symlink(&file, dir.path().join("gpu-hook.1.data")).unwrap();
        fs::write(dir.path().join("small"), b"small").unwrap();
        (stage, dir)
    }

    #[test]
    fn a_file_taken_ahead_is_not_hashed_again_and_comes_back() {
        let root = tempfile::tempdir().unwrap();
        let store = Store::open(root.path().join("store")).unwrap();
        let data = bytes(2 * CHUNK_SIZE as usize + 5, 1);
        let (stage, dir) = staged(&store, &data);
        let ahead = take_ahead(&store, stage.path(), 1 << 20, 2, &NoProgress).unwrap();
        assert_eq!((ahead.len(), ahead.bytes()), (1, data.len() as u64));
        assert_eq!(ahead.new_bytes(), data.len() as u64);
        let (got, reclaim) =
            ingest_ahead(&store, dir.path(), "c/1", &opts(), &NoProgress, || ahead).unwrap();
        reclaim.run();
        assert_eq!(got.chunks, 3);
        assert_eq!(
            (got.written_bytes, got.adopted_bytes),
            (data.len() as u64, data.len() as u64)
        );
        assert!(!dir.path().join("gpu-hook.1.data").exists());
        drop(stage);
        materialize(&store, dir.path(), 2).unwrap();
        assert_eq!(fs::read(dir.path().join("gpu-hook.1.data")).unwrap(), data);
    }

    #[test]
    fn a_file_changed_after_it_was_taken_refuses_the_ingest() {
        let root = tempfile::tempdir().unwrap();
        let store = Store::open(root.path().join("store")).unwrap();
        let data = bytes(CHUNK_SIZE as usize + 7, 2);
        let (stage, dir) = staged(&store, &data);
        let ahead = take_ahead(&store, stage.path(), 1 << 20, 2, &NoProgress).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let file = stage.path().join("1").join("data-000.bin");
        let f = fs::OpenOptions::new().write(true).open(&file).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"changed", 3).unwrap();
        drop(f);
        let e =
            ingest_ahead(&store, dir.path(), "c/1", &opts(), &NoProgress, || ahead).unwrap_err();
        assert!(matches!(e, StoreError::ChangedAfterTaken { .. }), "{e}");
        // Nothing changed in the directory, and the store names none of those bytes.
        assert!(dir.path().join("gpu-hook.1.data").exists());
        assert!(!dir.path().join(crate::dir::REF_FILE).exists());
        let first = crate::manifest::ChunkRef {
            digest: crate::Digest::of(&data[..CHUNK_SIZE as usize]),
            len: CHUNK_SIZE,
        };
        assert!(!store.has_chunk(&first));
    }
}
