//! One checkpoint's writes: chunks first, create-if-absent, then the manifest, last and
//! atomically. The writer holds the store's lock shared for its whole life, so `gc` (which
//! holds it exclusive) never sees a chunk that is written but not yet referenced.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};

use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::manifest::{ChunkRef, Manifest, MANIFEST_FORMAT, MANIFEST_VERSION};
use crate::store::{publish, sync_dir, write_synced, Store, MANIFESTS};

/// What one [`Writer::put_chunk`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Put {
    pub chunk: ChunkRef,
    /// `false`: the store already held these bytes (nothing was written).
    pub written: bool,
}

pub struct Writer<'s> {
    store: &'s Store,
    _lock: Flock<File>,
    /// Shared by the threads of one checkpoint's writes (`put_chunk_as` takes `&self`).
    written_bytes: AtomicU64,
}

impl Store {
    /// Starts a checkpoint's writes (blocks while a gc runs).
    pub fn writer(&self) -> Result<Writer<'_>> {
        Ok(Writer {
            store: self,
            _lock: self.lock(FlockArg::LockShared)?,
            written_bytes: AtomicU64::new(0),
        })
    }
}

impl Writer<'_> {
    /// Stores `bytes` under their digest unless the store holds them already.
    pub fn put_chunk(&self, bytes: &[u8]) -> Result<Put> {
        self.put_chunk_as(Digest::of(bytes), bytes)
    }

    /// [`Self::put_chunk`] for a caller that has hashed `bytes` already (e.g. while copying
    /// them); `digest` must be BLAKE3 of `bytes`. Several threads may put at once.
    pub fn put_chunk_as(&self, digest: Digest, bytes: &[u8]) -> Result<Put> {
        let put = store_chunk(self.store, digest, bytes)?;
        if put.written {
            self.count_written(put.chunk.len);
        }
        Ok(put)
    }

    pub(crate) fn store(&self) -> &Store {
        self.store
    }

    pub(crate) fn count_written(&self, bytes: u64) {
        self.written_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes this writer added to the store (chunks it found present are not counted;
    /// adopted slices it made pointers for are).
    pub fn written_bytes(&self) -> u64 {
        self.written_bytes.load(Ordering::Relaxed)
    }

    /// Publishes manifest `name` listing `chunks`, after making every chunk durable. Every
    /// chunk must be in the store; the name must be new.
    pub fn publish(
        self,
        name: &str,
        chunks: Vec<ChunkRef>,
        meta: serde_json::Value,
    ) -> Result<Manifest> {
        let path = self.store.manifest_path(name)?;
        let manifest = Manifest {
            format: MANIFEST_FORMAT.into(),
            version: MANIFEST_VERSION,
            name: name.to_string(),
            store_id: self.store.id().to_string(),
            created_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or_default(),
            chunks,
            meta,
        };
        self.store.require_chunks(&manifest)?;
        // One syncfs makes every chunk durable before the manifest that names them is.
        let root = File::open(self.store.root())
            .map_err(crate::error::io("cannot open", self.store.root()))?;
        nix::unistd::syncfs(&root)
            .map_err(|e| crate::error::io("cannot sync", self.store.root())(e.into()))?;
        let tmp = self.store.tmp_path();
        write_synced(
            &tmp,
            &serde_json::to_vec(&manifest).expect("manifest serialises"),
        )?;
        if !publish(&tmp, &path)? {
            return Err(StoreError::ManifestExists {
                name: name.to_string(),
            });
        }
        sync_dir(path.parent().unwrap_or(&self.store.root().join(MANIFESTS)))?;
        tracing::debug!(manifest = name, chunks = manifest.chunks.len(), "published");
        Ok(manifest)
    }
}

/// A chunk's bytes into `store` unless present; the caller holds a [`Writer`] (its lock).
pub(crate) fn store_chunk(store: &Store, digest: Digest, bytes: &[u8]) -> Result<Put> {
    let chunk = ChunkRef {
        digest,
        len: bytes.len() as u64,
    };
    if store.has_chunk(&chunk) {
        return Ok(Put {
            chunk,
            written: false,
        });
    }
    // Not synced one by one: `publish` syncs the filesystem once before the manifest.
    let tmp = store.tmp_path();
    std::fs::write(&tmp, bytes).map_err(crate::error::io("cannot write chunk", &tmp))?;
    let written = publish(&tmp, &store.chunk_path(&digest))?;
    Ok(Put { chunk, written })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_bytes_are_written_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let w = store.writer().unwrap();
        let a = w.put_chunk(b"weights").unwrap();
        let b = w.put_chunk(b"weights").unwrap();
        assert!(a.written && !b.written);
        assert_eq!(w.written_bytes(), 7);
        let m = w
            .publish(
                "c1/1",
                vec![a.chunk, b.chunk],
                serde_json::json!({"pid": 7}),
            )
            .unwrap();
        assert_eq!(m.logical_bytes(), 14);
        assert_eq!(store.manifest("c1/1").unwrap(), m);
        assert_eq!(store.read_chunk(&a.chunk).unwrap(), b"weights");
        // A second checkpoint of the same bytes writes nothing.
        let w = store.writer().unwrap();
        assert!(!w.put_chunk(b"weights").unwrap().written);
        assert_eq!(w.written_bytes(), 0);
    }

    #[test]
    fn manifests_are_immutable_and_need_their_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let w = store.writer().unwrap();
        let c = w.put_chunk(b"x").unwrap().chunk;
        w.publish("c/1", vec![c], serde_json::Value::Null).unwrap();
        let w = store.writer().unwrap();
        let err = w
            .publish("c/1", vec![c], serde_json::Value::Null)
            .unwrap_err();
        assert!(matches!(err, StoreError::ManifestExists { .. }), "{err}");
        let ghost = ChunkRef {
            digest: Digest::of(b"never stored"),
            len: 12,
        };
        let w = store.writer().unwrap();
        let err = w
            .publish("c/2", vec![ghost], serde_json::Value::Null)
            .unwrap_err();
        assert!(matches!(err, StoreError::ChunkMissing { .. }), "{err}");
        assert!(store.manifest("c/2").is_err());
    }
}
