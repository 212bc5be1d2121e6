//! The shared store: where chunks go so that another node can restore a checkpoint. Any
//! `object_store` backend (a filesystem other nodes mount, S3-compatible object storage); the
//! objects are laid out as a local store's files (`chunks/ab/<digest>`,
//! `manifests/<name>.json`), written create-if-absent, the manifest last.

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::manifest::{check_name, ChunkRef, Manifest};
use crate::progress::{NoProgress, Progress};
use crate::store::{publish, write_synced, Store};

/// Chunks in flight at once when none is given.
pub const DEFAULT_PARALLEL: usize = 16;

#[derive(Debug, Clone)]
pub struct Remote {
    objects: Arc<dyn ObjectStore>,
    /// What the operator configured (a path or URL), for messages.
    label: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transfer {
    pub chunks: u64,
    /// Bytes that crossed to or from the shared store (chunks it or we already had are not).
    pub bytes: u64,
    pub chunks_present: u64,
}

impl Remote {
    pub fn new(objects: Arc<dyn ObjectStore>, label: impl Into<String>) -> Self {
        Remote {
            objects,
            label: label.into(),
        }
    }

    /// A shared store on a filesystem (NFS, a cluster filesystem) mounted at `dir`.
    pub fn filesystem(dir: impl AsRef<std::path::Path>) -> Result<Self> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(crate::error::io(
            "cannot create the shared store directory",
            dir,
        ))?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
            .map_err(|e| remote_err(dir.display().to_string(), "cannot open", e))?;
        Ok(Remote::new(Arc::new(fs), dir.display().to_string()))
    }

    /// An S3-compatible bucket: `s3://BUCKET[/PREFIX]`. Endpoint, region and credentials come
    /// from the usual `AWS_*` environment (`AWS_ENDPOINT`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ALLOW_HTTP` for a plain-HTTP endpoint).
    pub fn s3(url: &str) -> Result<Self> {
        let rest = url.strip_prefix("s3://").unwrap_or(url);
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let s3 = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .build()
            .map_err(|e| remote_err(url.to_string(), "cannot configure", e))?;
        let objects: Arc<dyn ObjectStore> = if prefix.trim_matches('/').is_empty() {
            Arc::new(s3)
        } else {
            Arc::new(object_store::prefix::PrefixStore::new(
                s3,
                prefix.trim_matches('/'),
            ))
        };
        Ok(Remote::new(objects, url))
    }

    /// `s3://…` ([`Self::s3`]), else a directory ([`Self::filesystem`]).
    pub fn open(location: &str) -> Result<Self> {
        if location.starts_with("s3://") {
            Self::s3(location)
        } else {
            Self::filesystem(location)
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Copies manifest `name` and every chunk it needs from `local` to the shared store,
    /// `parallel` chunks at a time; chunks the shared store has are skipped.
    pub async fn push(&self, local: &Store, name: &str, parallel: usize) -> Result<Transfer> {
        self.push_with(local, name, parallel, &NoProgress).await
    }

    /// [`Self::push`], telling `progress` of every chunk (those already there included).
    pub async fn push_with(
        &self,
        local: &Store,
        name: &str,
        parallel: usize,
        progress: &dyn Progress,
    ) -> Result<Transfer> {
        let manifest = local.manifest(name)?;
        local.require_chunks(&manifest)?;
        let mut unique = unique(&manifest);
        unique.sort_by_key(|c| std::cmp::Reverse(c.len));
        progress.start(unique.iter().map(|c| c.len).sum());
        let t = self.push_chunks(local, unique, parallel, progress).await;
        progress.finish();
        let t = t?;
        let path = local.manifest_path(name)?;
        let body = std::fs::read(&path).map_err(crate::error::io("cannot read manifest", &path))?;
        self.put_new(&manifest_object(name), body).await?;
        tracing::info!(manifest = name, shared = %self.label, chunks = t.chunks, bytes = t.bytes, "pushed");
        Ok(t)
    }

    async fn push_chunks(
        &self,
        local: &Store,
        unique: Vec<ChunkRef>,
        parallel: usize,
        progress: &dyn Progress,
    ) -> Result<Transfer> {
        let mut t = Transfer::default();
        let mut puts = futures::stream::iter(unique)
            .map(|c| async move {
                // On the blocking pool: `parallel` reads at once, not one after another.
                let store = local.clone();
                let bytes = blocking(&self.label, move || store.read_chunk(&c)).await?;
                let created = self.put_new(&chunk_object(&c.digest), bytes).await?;
                Ok::<_, StoreError>((c, created))
            })
            .buffer_unordered(parallel.max(1));
        while let Some((c, created)) = puts.try_next().await? {
            t.chunks += 1;
            if created {
                t.bytes += c.len;
            } else {
                t.chunks_present += 1;
            }
            progress.advance(c.len);
        }
        Ok(t)
    }

    /// Fetches manifest `name` from the shared store into `local`, with the chunks `local`
    /// lacks, `parallel` at a time, each checked against its digest before it is stored.
    /// The manifest is published locally last, so a failed pull leaves no usable half.
    pub async fn pull(&self, local: &Store, name: &str, parallel: usize) -> Result<Transfer> {
        self.pull_with(local, name, parallel, &NoProgress).await
    }

    /// [`Self::pull`], telling `progress` of the missing chunks' bytes as they arrive.
    pub async fn pull_with(
        &self,
        local: &Store,
        name: &str,
        parallel: usize,
        progress: &dyn Progress,
    ) -> Result<Transfer> {
        check_name(name)?;
        let location = manifest_object(name);
        let body = self.get(&location).await.map_err(|e| match e {
            StoreError::Remote { source, .. }
                if matches!(*source, object_store::Error::NotFound { .. }) =>
            {
                StoreError::ManifestMissing {
                    name: name.to_string(),
                    root: self.label.clone().into(),
                }
            }
            e => e,
        })?;
        let manifest = Manifest::parse(std::path::Path::new(location.as_ref()), &body)?;
        let mut t = Transfer::default();
        let missing = local.missing_chunks(&manifest);
        t.chunks_present = unique(&manifest).len() as u64 - missing.len() as u64;
        progress.start(missing.iter().map(|c| c.len).sum());
        let fetched = self
            .fetch_chunks(local, missing, parallel, progress, &mut t)
            .await;
        progress.finish();
        fetched?;
        local.require_chunks(&manifest)?;
        let target = local.manifest_path(name)?;
        if !target.exists() {
            let tmp = local.tmp_path();
            write_synced(&tmp, &body)?;
            publish(&tmp, &target)?;
        }
        Ok(t)
    }

    /// Gets `missing` chunks, checks each against its digest and puts it in `local`.
    async fn fetch_chunks(
        &self,
        local: &Store,
        missing: Vec<ChunkRef>,
        parallel: usize,
        progress: &dyn Progress,
        t: &mut Transfer,
    ) -> Result<()> {
        // Held until every chunk is in: gc cannot take what is not yet named by the manifest.
        let writer = local.writer()?;
        let mut gets = futures::stream::iter(missing)
            .map(|c| async move {
                let bytes = self.get(&chunk_object(&c.digest)).await?;
                let path = format!("{}/{}", self.label, chunk_object(&c.digest));
                // Checked and written on the blocking pool, `parallel` at once.
                let store = local.clone();
                let put = blocking(&self.label, move || {
                    c.check(&bytes, path)?;
                    crate::writer::store_chunk(&store, c.digest, &bytes)
                })
                .await?;
                Ok((c, put))
            })
            .buffer_unordered(parallel.max(1));
        while let Some((c, put)) = gets.try_next().await? {
            if put.written {
                writer.count_written(c.len);
            }
            t.chunks += 1;
            t.bytes += c.len;
            progress.advance(c.len);
        }
        Ok(())
    }

    /// Writes an object unless it exists. Objects are immutable and chunks content-addressed,
    /// so one already there holds the same bytes. A store without conditional writes gets a
    /// look first, then a plain write (two racing writers then write the same bytes).
    async fn put_new(&self, location: &ObjectPath, bytes: Vec<u8>) -> Result<bool> {
        match self.objects.head(location).await {
            Ok(_) => return Ok(false),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => {
                return Err(remote_err(
                    self.objects_label(location),
                    "cannot look up",
                    e,
                ))
            }
        }
        let payload = PutPayload::from(bytes);
        let create = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .objects
            .put_opts(location, payload.clone(), create)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(object_store::Error::NotImplemented { .. }) => self
                .objects
                .put(location, payload)
                .await
                .map(|_| true)
                .map_err(|e| remote_err(self.objects_label(location), "cannot write", e)),
            Err(e) => Err(remote_err(self.objects_label(location), "cannot write", e)),
        }
    }

    async fn get(&self, location: &ObjectPath) -> Result<Vec<u8>> {
        let read = async { self.objects.get(location).await?.bytes().await };
        read.await
            .map(|b| b.to_vec())
            .map_err(|e| remote_err(self.objects_label(location), "cannot read", e))
    }

    fn objects_label(&self, location: &ObjectPath) -> String {
        format!("{}/{location}", self.label)
    }
}

/// Runs `work` on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    label: &str,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| StoreError::Io {
            what: "a transfer's worker failed",
            path: label.into(),
            source: std::io::Error::other(e),
        })?
}

fn unique(manifest: &Manifest) -> Vec<ChunkRef> {
    let mut seen = std::collections::HashSet::new();
    manifest
        .chunks
        .iter()
        .filter(|c| seen.insert(c.digest))
        .copied()
        .collect()
}

fn chunk_object(d: &Digest) -> ObjectPath {
    let hex = d.to_hex();
    ObjectPath::from(format!("chunks/{}/{hex}", &hex[..2]))
}

fn manifest_object(name: &str) -> ObjectPath {
    ObjectPath::from(format!("manifests/{name}.json"))
}

fn remote_err(location: String, what: &'static str, e: object_store::Error) -> StoreError {
    StoreError::Remote {
        what,
        location,
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_second_node_pulls_what_the_first_pushed() {
        let (a, b, shared) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let node_a = Store::open(a.path()).unwrap();
        let node_b = Store::open(b.path()).unwrap();
        let remote = Remote::filesystem(shared.path()).unwrap();
        let w = node_a.writer().unwrap();
        let refs: Vec<_> = [&b"layer0"[..], b"layer1", b"layer0"]
            .iter()
            .map(|c| w.put_chunk(c).unwrap().chunk)
            .collect();
        let m = w.publish("ctr/1", refs, serde_json::Value::Null).unwrap();
        let rt = rt();
        let pushed = rt.block_on(remote.push(&node_a, "ctr/1", 4)).unwrap();
        assert_eq!((pushed.chunks, pushed.bytes), (2, 12));
        // Pushing again sends nothing new.
        let again = rt.block_on(remote.push(&node_a, "ctr/1", 4)).unwrap();
        assert_eq!((again.bytes, again.chunks_present), (0, 2));

        // Node B already has one chunk (the same model): only the other crosses.
        let w = node_b.writer().unwrap();
        w.put_chunk(b"layer0").unwrap();
        drop(w);
        let progress = crate::progress::Counting::default();
        let pulled = rt
            .block_on(remote.pull_with(&node_b, "ctr/1", 4, &progress))
            .unwrap();
        assert_eq!(
            (pulled.chunks, pulled.bytes, pulled.chunks_present),
            (1, 6, 1)
        );
        // Only what crossed is the pull's work.
        assert_eq!(progress.total.into_inner(), 6);
        assert_eq!(progress.done.into_inner(), 6);
        assert!(progress.finished.into_inner());
        assert_eq!(node_b.manifest("ctr/1").unwrap(), m);
        node_b.require_chunks(&m).unwrap();
    }

    #[test]
    fn a_damaged_shared_chunk_is_refused_and_nothing_is_published() {
        let (a, b, shared) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let node_a = Store::open(a.path()).unwrap();
        let node_b = Store::open(b.path()).unwrap();
        let remote = Remote::filesystem(shared.path()).unwrap();
        let w = node_a.writer().unwrap();
        let c = w.put_chunk(b"weights").unwrap().chunk;
        w.publish("ctr/1", vec![c], serde_json::Value::Null)
            .unwrap();
        let rt = rt();
        rt.block_on(remote.push(&node_a, "ctr/1", 1)).unwrap();
        let hex = c.digest.to_hex();
        std::fs::write(
            shared.path().join(format!("chunks/{}/{hex}", &hex[..2])),
            b"weighTs",
        )
        .unwrap();
        let err = rt.block_on(remote.pull(&node_b, "ctr/1", 1)).unwrap_err();
        assert!(matches!(err, StoreError::ChunkDamaged { .. }), "{err}");
        assert!(node_b.manifest("ctr/1").is_err());
        let err = rt
            .block_on(remote.pull(&node_b, "ctr/none", 1))
            .unwrap_err();
        assert!(matches!(err, StoreError::ManifestMissing { .. }), "{err}");
    }
}
