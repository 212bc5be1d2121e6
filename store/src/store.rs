//! Opening a store and reading from it.

use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::error::{io, Result, StoreError};
use crate::manifest::{check_name, ChunkRef, Manifest};

const IDENTITY: &str = "STORE";
const LOCK: &str = "store.lock";
pub(crate) const CHUNKS: &str = "chunks";
pub(crate) const MANIFESTS: &str = "manifests";
pub(crate) const TMP: &str = "tmp";
pub(crate) const PACKS: &str = "packs";
const STORE_FORMAT: &str = "gpucr-store";
/// 2: chunks may be pointers into packs (`pack.rs`); a store is raised to 2 by its first pack,
/// so a gpucr that reads only version 1 refuses it rather than misreading the pointers.
const STORE_VERSION: u32 = 2;
const FIRST_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Identity {
    format: String,
    version: u32,
    id: String,
}

/// A store on a local (or locally mounted) filesystem.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    id: String,
}

impl Store {
    /// Opens the store at `root`, creating it when `root` is missing or empty.
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        fs::create_dir_all(&root).map_err(io("cannot create the store directory", &root))?;
        let ident = root.join(IDENTITY);
        if !ident.exists() {
            let foreign = fs::read_dir(&root)
                .map_err(io("cannot list the store directory", &root))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name())
                .find(|n| {
                    ![CHUNKS, MANIFESTS, TMP, PACKS, LOCK].contains(&n.to_str().unwrap_or(""))
                });
            if let Some(name) = foreign {
                return Err(StoreError::NotAStore {
                    path: root,
                    reason: format!("it holds {name:?} but no {IDENTITY} file"),
                });
            }
            for dir in [CHUNKS, MANIFESTS, TMP] {
                let p = root.join(dir);
                fs::create_dir_all(&p).map_err(io("cannot create", &p))?;
            }
            // Version 1 until a pack needs 2 (`raise_for_packs`): older gpucrs read it.
            let body = serde_json::to_vec(&Identity {
                format: STORE_FORMAT.into(),
                version: FIRST_VERSION,
                id: random_hex(),
            })
            .expect("identity serialises");
            let tmp = root.join(TMP).join(unique_name());
            write_synced(&tmp, &body)?;
            // Two first opens at once: the first link wins and both read its identity.
            publish(&tmp, &ident)?;
        }
        let text = fs::read(&ident).map_err(io("cannot read", &ident))?;
        let not_a_store = |reason: String| StoreError::NotAStore {
            path: root.clone(),
            reason,
        };
        let id: Identity = serde_json::from_slice(&text)
            .map_err(|e| not_a_store(format!("{IDENTITY} is damaged: {e}")))?;
        if id.format != STORE_FORMAT || id.version > STORE_VERSION {
            return Err(not_a_store(format!(
                "{IDENTITY} says format {:?} version {}; this gpucr reads {STORE_FORMAT:?} up to \
                 version {STORE_VERSION}",
                id.format, id.version
            )));
        }
        for dir in [CHUNKS, MANIFESTS, TMP, PACKS] {
            let p = root.join(dir);
            fs::create_dir_all(&p).map_err(io("cannot create", &p))?;
        }
        Ok(Store { root, id: id.id })
    }

    /// Raises the identity to the version that has packs, once, before the first pack.
    pub(crate) fn raise_for_packs(&self) -> Result<()> {
        let ident = self.root.join(IDENTITY);
        let text = fs::read(&ident).map_err(io("cannot read", &ident))?;
        let mut id: Identity =
            serde_json::from_slice(&text).map_err(|e| StoreError::NotAStore {
                path: self.root.clone(),
                reason: format!("{IDENTITY} is damaged: {e}"),
            })?;
        if id.version >= STORE_VERSION {
            return Ok(());
        }
        id.version = STORE_VERSION;
        let tmp = self.tmp_path();
        write_synced(&tmp, &serde_json::to_vec(&id).expect("identity serialises"))?;
        fs::rename(&tmp, &ident).map_err(io("cannot replace", &ident))?;
        sync_dir(&self.root)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The store's identity (32 hex digits), recorded in every manifest it publishes.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where a chunk's bytes are: a plain file, usable in place (mmap, registration for DMA).
    pub fn chunk_path(&self, digest: &Digest) -> PathBuf {
        let hex = digest.to_hex();
        self.root.join(CHUNKS).join(&hex[..2]).join(hex)
    }

    /// Whether the chunk is present with its length, as a file of its own or in a pack (its
    /// bytes are checked by [`Self::read_chunk`] and [`Self::validate`], not here).
    pub fn has_chunk(&self, chunk: &ChunkRef) -> bool {
        self.locate(chunk).is_some()
    }

    /// Where the chunk's bytes are: `len` bytes of a plain file from `offset`, usable in place
    /// (read, `copy_file_range`, mmap); `None` when it is missing.
    pub fn locate(&self, chunk: &ChunkRef) -> Option<Located> {
        let path = self.chunk_path(&chunk.digest);
        if fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == chunk.len) {
            return Some(Located { path, offset: 0 });
        }
        crate::pack::locate_packed(self, chunk)
    }

    /// The chunk's bytes, checked against its digest.
    pub fn read_chunk(&self, chunk: &ChunkRef) -> Result<Vec<u8>> {
        let Some(at) = self.locate(chunk) else {
            return Err(self.missing(chunk));
        };
        let path = at.path;
        let mut bytes = vec![0u8; chunk.len as usize];
        let f = File::open(&path).map_err(io("cannot open chunk", &path))?;
        let got =
            read_at_most(&f, &mut bytes, at.offset).map_err(io("cannot read chunk", &path))?;
        bytes.truncate(got);
        chunk.check(&bytes, path)?;
        Ok(bytes)
    }

    /// The chunks of `manifest` that are not present (with their length), each once: what a
    /// restore must fetch before anything is created.
    pub fn missing_chunks(&self, manifest: &Manifest) -> Vec<ChunkRef> {
        let mut seen = std::collections::HashSet::new();
        manifest
            .chunks
            .iter()
            .filter(|c| seen.insert(c.digest) && !self.has_chunk(c))
            .copied()
            .collect()
    }

    /// `Ok` when every chunk of `manifest` is present, else the first missing one (the error
    /// says how to make the checkpoint whole).
    pub fn require_chunks(&self, manifest: &Manifest) -> Result<()> {
        match self.missing_chunks(manifest).first() {
            None => Ok(()),
            Some(c) => Err(self.missing(c)),
        }
    }

    pub(crate) fn missing(&self, chunk: &ChunkRef) -> StoreError {
        StoreError::ChunkMissing {
            digest: chunk.digest,
            len: chunk.len,
            root: self.root.clone(),
        }
    }

    pub(crate) fn manifest_path(&self, name: &str) -> Result<PathBuf> {
        check_name(name)?;
        Ok(self.root.join(MANIFESTS).join(format!("{name}.json")))
    }

    /// The published manifest `name`.
    pub fn manifest(&self, name: &str) -> Result<Manifest> {
        let path = self.manifest_path(name)?;
        match fs::read(&path) {
            Ok(bytes) => Manifest::parse(&path, &bytes),
            Err(e) if e.kind() == ErrorKind::NotFound => Err(StoreError::ManifestMissing {
                name: name.to_string(),
                root: self.root.clone(),
            }),
            Err(e) => Err(io("cannot read manifest", &path)(e)),
        }
    }

    /// Every published manifest, by name.
    pub fn manifests(&self) -> Result<Vec<Manifest>> {
        let mut out = Vec::new();
        let mut dirs = vec![self.root.join(MANIFESTS)];
        while let Some(dir) = dirs.pop() {
            for entry in fs::read_dir(&dir).map_err(io("cannot list", &dir))? {
                let entry = entry.map_err(io("cannot list", &dir))?;
                let path = entry.path();
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if name.starts_with('.') {
                    continue;
                }
                if entry
                    .file_type()
                    .map_err(io("cannot stat", &path))?
                    .is_dir()
                {
                    dirs.push(path);
                } else if name.ends_with(".json") {
                    let bytes = fs::read(&path).map_err(io("cannot read manifest", &path))?;
                    out.push(Manifest::parse(&path, &bytes)?);
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Writers hold it shared from their first chunk to their manifest; gc holds it exclusive.
    pub(crate) fn lock(&self, arg: FlockArg) -> Result<Flock<File>> {
        lock_file(&self.root.join(LOCK), arg)
    }

    pub(crate) fn tmp_path(&self) -> PathBuf {
        self.root.join(TMP).join(unique_name())
    }
}

/// Where a chunk's bytes are ([`Store::locate`]): `path` from `offset`, the chunk's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub path: PathBuf,
    pub offset: u64,
}

/// Reads into `buf` from `offset` until it is full or the file ends; how many bytes came.
pub(crate) fn read_at_most(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// An flock of the file at `path` (created if absent), held until the value is dropped; for
/// the store, the event log and the shims' metrics textfile.
pub fn lock_file(path: &Path, arg: FlockArg) -> Result<Flock<File>> {
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io("cannot open the lock file", path))?;
    Flock::lock(file, arg).map_err(|(_, errno)| {
        io("cannot lock", path)(std::io::Error::from_raw_os_error(errno as i32))
    })
}

/// Writes `bytes` to a new file at `path` and fsyncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(io("cannot create", path))?;
    f.write_all(bytes).map_err(io("cannot write", path))?;
    f.sync_all().map_err(io("cannot sync", path))
}

/// Gives the finished file `tmp` its final name `target` unless `target` exists (immutable
/// objects: a hard link fails rather than replace). `true` when this call created it.
pub(crate) fn publish(tmp: &Path, target: &Path) -> Result<bool> {
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent).map_err(io("cannot create", parent))?;
    }
    let created = match fs::hard_link(tmp, target) {
        Ok(()) => true,
        Err(e) if e.kind() == ErrorKind::AlreadyExists => false,
        Err(e) => {
            let _ = fs::remove_file(tmp);
            return Err(io("cannot publish", target)(e));
        }
    };
    fs::remove_file(tmp).map_err(io("cannot remove", tmp))?;
    Ok(created)
}

/// fsyncs a directory, so a name published in it survives a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    let f = File::open(dir).map_err(io("cannot open", dir))?;
    nix::unistd::fsync(f.as_fd()).map_err(|e| io("cannot sync", dir)(e.into()))
}

pub(crate) fn unique_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        &random_hex()[..8]
    )
}

fn random_hex() -> String {
    let mut bytes = [0u8; 16];
    if File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_err()
    {
        // No /dev/urandom (a bare chroot): the time and pid still make a name unique here.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        bytes = (t ^ ((std::process::id() as u128) << 64)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_creates_once_and_keeps_the_identity() {
        let dir = tempfile::tempdir().unwrap();
        let a = Store::open(dir.path()).unwrap();
        let b = Store::open(dir.path()).unwrap();
        assert_eq!(a.id(), b.id());
        assert_eq!(a.id().len(), 32);
    }

    #[test]
    fn a_directory_with_other_files_is_not_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("precious"), b"x").unwrap();
        let err = Store::open(dir.path()).unwrap_err();
        assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
        assert!(err.to_string().contains("precious"), "{err}");
    }
}
