//! Files taken into the store without copying their bytes: packs.
//!
//! A file already on the store's filesystem (the hook's GPU state data, written into a
//! [`Stage`]; or a checkpoint directory on the same tmpfs) becomes a pack by a hard link:
//! `packs/<name>.pack`. Its 8 MiB slices are hashed; a slice whose digest the store lacks gets
//! a pointer, `chunks/ab/<hex>.at` (`{"pack","offset","len"}`), published create-if-absent
//! like a chunk; a slice the store holds already is a duplicate, punched out of the pack once
//! the caller has let go of the file's other name ([`Adopted::reclaim`]). So device memory the
//! hook wrote once is never written again, and a second checkpoint of unchanged memory keeps
//! nothing of its own.
//!
//! Pointers obey the chunk rules (immutable, named by the digest, removed only by `gc`), and a
//! pack lives while a pointer names it: `gc` removes the pointers no kept manifest names,
//! punches their ranges and removes a pack no pointer names.

use std::fs::{self, File};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::dir::CHUNK_SIZE;
use crate::error::{io, Result, StoreError};
use crate::manifest::ChunkRef;
use crate::progress::Progress;
use crate::slices::{fixed, for_each_range};
use crate::store::{publish, unique_name, write_synced, Located, Store, PACKS};
use crate::writer::Writer;

/// A pointer's name: its chunk's name and this.
pub(crate) const POINTER_SUFFIX: &str = ".at";
const PACK_SUFFIX: &str = ".pack";

/// A chunk that lives in a pack: `len` bytes of `packs/<pack>` from `offset`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Pointer {
    pub pack: String,
    pub offset: u64,
    pub len: u64,
}

impl Pointer {
    pub(crate) fn read(path: &Path) -> Option<Pointer> {
        let p: Pointer = serde_json::from_slice(&fs::read(path).ok()?).ok()?;
        // A pack's name, never a path out of `packs/`.
        let plain = !p.pack.is_empty()
            && p.pack.ends_with(PACK_SUFFIX)
            && !p.pack.starts_with('.')
            && !p.pack.contains('/');
        plain.then_some(p)
    }
}

impl Store {
    pub(crate) fn pointer_path(&self, digest: &Digest) -> PathBuf {
        let mut p = self.chunk_path(digest).into_os_string();
        p.push(POINTER_SUFFIX);
        p.into()
    }

    pub(crate) fn pack_path(&self, pack: &str) -> PathBuf {
        self.root().join(PACKS).join(pack)
    }

    /// A new pack's name (no file yet).
    pub(crate) fn new_pack_name() -> String {
        format!("{}{PACK_SUFFIX}", unique_name())
    }

    /// Publishes, create-if-absent, that `chunk` is its length of bytes of pack `pack` from
    /// `offset` (bytes the caller has checked against the digest); `false` when the store
    /// already had a pointer for it.
    pub(crate) fn point(&self, chunk: &ChunkRef, pack: &str, offset: u64) -> Result<bool> {
        let pointer = Pointer {
            pack: pack.to_string(),
            offset,
            len: chunk.len,
        };
        let tmp = self.tmp_path();
        write_synced(
            &tmp,
            &serde_json::to_vec(&pointer).expect("pointer serialises"),
        )?;
        publish(&tmp, &self.pointer_path(&chunk.digest))
    }

    /// Whether [`Writer::adopt`] can take the file at `path`: on the store's filesystem, with
    /// no other name.
    pub fn can_adopt(&self, path: &Path) -> bool {
        self.same_filesystem(path) && has_one_name(path)
    }

    /// Whether `path` is on the store's filesystem, where a hard link can reach it.
    pub fn same_filesystem(&self, path: &Path) -> bool {
        match (fs::metadata(path), fs::metadata(self.root().join(PACKS))) {
            (Ok(a), Ok(b)) => a.dev() == b.dev(),
            _ => false,
        }
    }

    /// A directory on the store's filesystem for files that will be adopted (the hook's GPU
    /// state images of one checkpoint). `gc` waits while it exists; it is removed when the
    /// value is dropped, with whatever was not adopted.
    pub fn stage(&self) -> Result<Stage> {
        let lock = self.lock(FlockArg::LockShared)?;
        let dir = self.tmp_path().with_extension("stage");
        fs::create_dir(&dir).map_err(io("cannot create", &dir))?;
        Ok(Stage { dir, _lock: lock })
    }
}

/// Whether the file at `path` has no other name. One with another (a pack's link, put back by
/// a restore) shares its bytes with the store already: taking it in again would punch what a
/// pointer names.
fn has_one_name(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.nlink() == 1)
}

/// A packed chunk's place, if its pointer and pack are there.
pub(crate) fn locate_packed(store: &Store, chunk: &ChunkRef) -> Option<Located> {
    let p = Pointer::read(&store.pointer_path(&chunk.digest))?;
    let path = store.pack_path(&p.pack);
    let fits = p.len == chunk.len
        && fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() >= p.offset + p.len);
    fits.then_some(Located {
        path,
        offset: p.offset,
    })
}

/// See [`Store::stage`].
#[derive(Debug)]
pub struct Stage {
    dir: PathBuf,
    _lock: Flock<File>,
}

impl Stage {
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A file [`Writer::adopt`] took: its chunks in order, and the ranges to punch once the file's
/// other names are gone.
#[derive(Debug)]
pub struct Adopted {
    pub chunks: Vec<ChunkRef>,
    /// Bytes of the slices the store did not hold before (now pointers into the pack).
    pub new_bytes: u64,
    pack: PathBuf,
    duplicates: Vec<(u64, u64)>,
    /// The pointers this adoption published.
    fresh: Vec<Digest>,
}

impl Adopted {
    /// Takes back what this adoption published: its pointers and its pack (the file's bytes
    /// are no longer those it hashed). A writer that found one of the pointers meanwhile
    /// finds it missing at its restore, as after a damaged chunk.
    pub(crate) fn withdraw(&self, store: &Store) {
        for d in &self.fresh {
            let _ = fs::remove_file(store.pointer_path(d));
        }
        let _ = fs::remove_file(&self.pack);
    }

    /// Frees the pack's duplicate slices (the store holds their bytes elsewhere), or the whole
    /// pack when every slice was one. Call it only after the adopted file's other names are
    /// removed: the punched ranges read as zeros. Best effort: a filesystem that cannot punch
    /// keeps the bytes, and `gc` tries again.
    pub fn reclaim(&self) {
        if self.new_bytes == 0 {
            let _ = fs::remove_file(&self.pack);
            return;
        }
        let Ok(f) = File::options().write(true).open(&self.pack) else {
            return;
        };
        for &(offset, len) in &self.duplicates {
            if let Err(e) = punch(&f, offset, len) {
                tracing::debug!(pack = %self.pack.display(), "cannot punch: {e}");
                return;
            }
        }
    }
}

/// Frees `len` bytes of `f` from `offset`; they read as zeros after, the size is kept.
pub(crate) fn punch(f: &File, offset: u64, len: u64) -> nix::Result<()> {
    use nix::fcntl::{fallocate, FallocateFlags};
    fallocate(
        f.as_fd(),
        FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
        offset as i64,
        len as i64,
    )
}

/// What became of one slice.
enum Slice {
    New(ChunkRef),
    Duplicate(ChunkRef, u64),
}

impl Writer<'_> {
    /// Takes the first `size` bytes of `path` (see [`Store::can_adopt`]) into the store
    /// without copying them: a hard link into `packs/`, a pointer for each slice the store
    /// lacks. The file itself is not changed; once the caller has removed it,
    /// [`Adopted::reclaim`] frees the duplicates. On error the pack and the pointers made so
    /// far stay for `gc` (another writer may already name them).
    pub fn adopt(
        &self,
        path: &Path,
        size: u64,
        threads: usize,
        progress: &dyn Progress,
    ) -> Result<Adopted> {
        self.adopt_cut(path, &fixed(size, CHUNK_SIZE), threads, progress)
    }

    /// [`Self::adopt`], the file cut at `cuts` (`(offset, len)`, adjacent from 0) rather than
    /// in [`CHUNK_SIZE`] slices.
    pub fn adopt_cut(
        &self,
        path: &Path,
        cuts: &[(u64, u64)],
        threads: usize,
        progress: &dyn Progress,
    ) -> Result<Adopted> {
        let store = self.store();
        if !has_one_name(path) {
            return Err(StoreError::Io {
                what: "cannot take in a file with several names",
                path: path.to_path_buf(),
                source: std::io::ErrorKind::AlreadyExists.into(),
            });
        }
        store.raise_for_packs()?;
        let name = Store::new_pack_name();
        let pack = store.pack_path(&name);
        fs::hard_link(path, &pack).map_err(io("cannot link into the store's packs", path))?;
        let file = File::open(&pack).map_err(io("cannot open", &pack))?;
        let new_bytes = AtomicU64::new(0);
        let slices = for_each_range(&file, path, cuts, threads, progress, |offset, bytes| {
            let chunk = ChunkRef {
                digest: Digest::of(bytes),
                len: bytes.len() as u64,
            };
            if store.has_chunk(&chunk) {
                return Ok(Slice::Duplicate(chunk, offset));
            }
            // Another writer may have stored the same bytes since: then ours are spare.
            if store.point(&chunk, &name, offset)? {
                new_bytes.fetch_add(chunk.len, Ordering::Relaxed);
                Ok(Slice::New(chunk))
            } else {
                Ok(Slice::Duplicate(chunk, offset))
            }
        })?;
        let new_bytes = new_bytes.into_inner();
        self.count_written(new_bytes);
        let mut adopted = Adopted {
            chunks: Vec::with_capacity(slices.len()),
            new_bytes,
            pack,
            duplicates: Vec::new(),
            fresh: Vec::new(),
        };
        for s in slices {
            match s {
                Slice::New(c) => {
                    adopted.chunks.push(c);
                    adopted.fresh.push(c.digest);
                }
                Slice::Duplicate(c, offset) => {
                    adopted.chunks.push(c);
                    adopted.duplicates.push((offset, c.len));
                }
            }
        }
        Ok(adopted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;

    fn slices(seed: u8, n: usize) -> Vec<u8> {
        (0..n * CHUNK_SIZE as usize)
            .map(|i| (i / CHUNK_SIZE as usize) as u8 ^ seed ^ (i % 251) as u8)
            .collect()
    }

    #[test]
    fn an_adopted_file_is_read_back_and_its_duplicates_are_freed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("store")).unwrap();
        let stage = store.stage().unwrap();
        let first = stage.path().join("a");
        let bytes = slices(1, 3);
        fs::write(&first, &bytes).unwrap();
        let w = store.writer().unwrap();
        let a = w.adopt(&first, bytes.len() as u64, 2, &NoProgress).unwrap();
        assert_eq!(a.new_bytes, bytes.len() as u64);
        assert_eq!(w.written_bytes(), a.new_bytes);
        w.publish("c/1", a.chunks.clone(), serde_json::Value::Null)
            .unwrap();
        fs::remove_file(&first).unwrap();
        a.reclaim();
        for (i, c) in a.chunks.iter().enumerate() {
            let at = store.locate(c).unwrap();
            assert!(at.path.starts_with(store.root().join(PACKS)));
            let want = &bytes[i * CHUNK_SIZE as usize..][..CHUNK_SIZE as usize];
            assert_eq!(store.read_chunk(c).unwrap(), want);
        }
        // The same bytes again, one slice changed: one pointer more, the rest punched.
        let mut again = bytes.clone();
        again[5] ^= 0xff;
        let second = stage.path().join("b");
        fs::write(&second, &again).unwrap();
        let w = store.writer().unwrap();
        let b = w
            .adopt(&second, again.len() as u64, 2, &NoProgress)
            .unwrap();
        assert_eq!(b.new_bytes, CHUNK_SIZE);
        w.publish("c/2", b.chunks.clone(), serde_json::Value::Null)
            .unwrap();
        fs::remove_file(&second).unwrap();
        b.reclaim();
        assert_eq!(store.read_chunk(&b.chunks[0]).unwrap()[5], again[5]);
        assert_eq!(store.read_chunk(&b.chunks[2]).unwrap(), &bytes[2 << 23..]);
        // tmpfs, ext4, xfs and btrfs free punched ranges: one slice is left.
        let kept = b.pack.metadata().unwrap().blocks() * 512;
        assert!(kept < 2 * CHUNK_SIZE, "{kept} bytes kept");
        // Unchanged: nothing of its own, the pack goes.
        let third = stage.path().join("c");
        fs::write(&third, &again).unwrap();
        let w = store.writer().unwrap();
        let c = w.adopt(&third, again.len() as u64, 2, &NoProgress).unwrap();
        assert_eq!((c.new_bytes, w.written_bytes()), (0, 0));
        fs::remove_file(&third).unwrap();
        c.reclaim();
        assert!(!c.pack.exists());
        let stage_dir = stage.path().to_path_buf();
        drop(stage);
        assert!(!stage_dir.exists());
    }
}
