//! The shared store: where chunks go so that another node can restore a checkpoint. Any
//! `object_store` backend (a filesystem other nodes mount, S3-compatible object storage); the
//! objects are laid out as a local store's files (`chunks/ab/<digest>`,
//! `manifests/<name>.json`), written create-if-absent, the manifest last.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::manifest::{check_name, ChunkRef, Manifest};
use crate::mapped::MappedOut;
use crate::progress::{NoProgress, Progress};
use crate::store::{publish, write_synced, Store};
use crate::writer::Writer;

/// Chunks in flight at once when none is given.
pub const DEFAULT_PARALLEL: usize = 16;

#[derive(Debug, Clone)]
pub struct Remote {
    objects: Arc<dyn ObjectStore>,
    /// What the operator configured (a path or URL), for messages.
    label: String,
    /// A shared store on a mounted filesystem: its directory, whose chunk files a pull reads
    /// straight into place (`object_store` would read each into a buffer of its own first).
    dir: Option<std::path::PathBuf>,
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
            dir: None,
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
        Ok(Remote {
            dir: Some(dir.to_path_buf()),
            ..Remote::new(Arc::new(fs), dir.display().to_string())
        })
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
        self.pull_files_with(local, name, &[], parallel, progress)
            .await
    }

    /// [`Self::pull_with`] for a manifest that lists `files` (each one's size and number of
    /// chunks, in order: [`crate::DirRef::file_layout`]). A file none of whose chunks this
    /// node has is pulled into a new pack laid out as the file, so a restore links it in place
    /// instead of copying it again ([`crate::dir::materialize_placed`]); the other chunks
    /// become chunk files.
    pub async fn pull_files_with(
        &self,
        local: &Store,
        name: &str,
        files: &[(u64, usize)],
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
        let fetched = async {
            // Held until every chunk is in: gc cannot take what no manifest names yet.
            let writer = local.writer()?;
            let (packs, rest) = plan_packs(local, &manifest, files, missing)?;
            self.fill_packs(&writer, packs, parallel, progress, &mut t)
                .await?;
            self.fetch_chunks(&writer, rest, parallel, progress, &mut t)
                .await
        }
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

    /// Gets `missing` chunks, checks each against its digest and puts it in the writer's store.
    async fn fetch_chunks(
        &self,
        writer: &Writer<'_>,
        missing: Vec<ChunkRef>,
        parallel: usize,
        progress: &dyn Progress,
        t: &mut Transfer,
    ) -> Result<()> {
        let local = writer.store();
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

    /// Fills every pack of `packs`, chunk by chunk, each checked against its digest and then
    /// published (a pointer), `parallel` at once. From a filesystem the chunk files are read
    /// straight into the pack and checked there; from object storage each body is checked and
    /// copied in. On error the packs and the pointers made so far stay for `gc`, like an
    /// adoption's.
    async fn fill_packs(
        &self,
        writer: &Writer<'_>,
        packs: Vec<PackFill>,
        parallel: usize,
        progress: &dyn Progress,
        t: &mut Transfer,
    ) -> Result<()> {
        let counts: Vec<usize> = packs.iter().map(|p| p.chunks.len()).collect();
        let jobs = crate::slices::interleaved(&counts);
        let local = writer.store();
        let new_bytes = AtomicU64::new(0);
        // One chunk: `fill` puts its checked bytes at their place in the pack; then its pointer.
        let place = |(p, i): (usize, usize), fill: &dyn Fn(&ChunkRef, &mut [u8]) -> Result<()>| {
            let pack = &packs[p];
            let c = pack.chunks[i];
            let offset = pack.offsets[i];
            // SAFETY: each job runs once, and one pack's chunk ranges are disjoint.
            let dst = unsafe { pack.map.range(offset as usize, c.len as usize) }.map_err(
                crate::error::io("cannot allocate room (is the store full?) in", &pack.path),
            )?;
            fill(&c, dst)?;
            if local.point(&c, &pack.name, offset)? {
                new_bytes.fetch_add(c.len, Ordering::Relaxed);
            }
            progress.advance(c.len);
            Ok::<_, StoreError>(())
        };
        match &self.dir {
            Some(root) => {
                let from_file = |c: &ChunkRef, dst: &mut [u8]| {
                    let path = root.join(chunk_object(&c.digest).as_ref());
                    let f = File::open(&path)
                        .map_err(crate::error::io("cannot open the shared chunk", &path))?;
                    if f.metadata().map(|m| m.len()).ok() != Some(c.len) {
                        // `check` names what is there: its digest and length.
                        let all = std::fs::read(&path)
                            .map_err(crate::error::io("cannot read the shared chunk", &path))?;
                        return c.check(&all, path);
                    }
                    f.read_exact_at(dst, 0)
                        .map_err(crate::error::io("cannot read the shared chunk", &path))?;
                    c.check(dst, path)
                };
                on_threads(|| {
                    crate::slices::parallel(
                        jobs.len(),
                        parallel,
                        || (),
                        |_, j| place(jobs[j], &from_file),
                    )
                })?;
            }
            None => {
                // Bodies come `parallel` at a time; each batch is checked and copied on as
                // many threads.
                let packs = &packs;
                let mut gets = futures::stream::iter(jobs.iter().copied())
                    .map(|(p, i)| async move {
                        let object = chunk_object(&packs[p].chunks[i].digest);
                        let bytes = self.get(&object).await?;
                        Ok::<_, StoreError>(((p, i), bytes, self.objects_label(&object)))
                    })
                    .buffer_unordered(parallel.max(1));
                let mut batch = Vec::with_capacity(parallel.max(1));
                loop {
                    let next = gets.try_next().await?;
                    let last = next.is_none();
                    batch.extend(next);
                    if batch.len() < parallel.max(1) && !last {
                        continue;
                    }
                    on_threads(|| {
                        crate::slices::parallel(
                            batch.len(),
                            parallel,
                            || (),
                            |_, k| {
                                let (job, bytes, label) = &batch[k];
                                place(*job, &|c, dst| {
                                    c.check(bytes, label.as_str())?;
                                    dst.copy_from_slice(bytes);
                                    Ok(())
                                })
                            },
                        )
                    })?;
                    batch.clear();
                    if last {
                        break;
                    }
                }
            }
        }
        writer.count_written(new_bytes.into_inner());
        for pack in &packs {
            t.chunks += pack.chunks.len() as u64;
            t.bytes += pack.chunks.iter().map(|c| c.len).sum::<u64>();
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

/// A file a pull writes as a new pack: its chunks at their offsets in the file.
struct PackFill {
    name: String,
    path: std::path::PathBuf,
    map: MappedOut,
    chunks: Vec<ChunkRef>,
    offsets: Vec<u64>,
}

/// Which files of `manifest` (sizes `files`) a pull writes as new packs, and the chunks of
/// `missing` left to fetch one by one. A file qualifies when every chunk of it is missing and
/// named nowhere earlier in the manifest (one place per pointer); a kernel that cannot map the pack (no `MADV_POPULATE_WRITE`) leaves it to the
/// chunk files.
fn plan_packs(
    local: &Store,
    manifest: &Manifest,
    files: &[(u64, usize)],
    missing: Vec<ChunkRef>,
) -> Result<(Vec<PackFill>, Vec<ChunkRef>)> {
    if files.is_empty() || files.iter().map(|f| f.1).sum::<usize>() != manifest.chunks.len() {
        return Ok((Vec::new(), missing));
    }
    let wanted: HashSet<Digest> = missing.iter().map(|c| c.digest).collect();
    let (mut seen, mut packed) = (HashSet::new(), HashSet::new());
    let mut packs = Vec::new();
    let mut at = 0;
    for &(size, n) in files {
        let chunks = &manifest.chunks[at..at + n];
        at += n;
        let mut own = HashSet::new();
        let fresh = n > 0
            && chunks.iter().map(|c| c.len).sum::<u64>() == size
            && chunks.iter().all(|c| {
                wanted.contains(&c.digest) && !seen.contains(&c.digest) && own.insert(c.digest)
            });
        seen.extend(chunks.iter().map(|c| c.digest));
        if !fresh {
            continue;
        }
        if packs.is_empty() {
            local.raise_for_packs()?;
        }
        let name = Store::new_pack_name();
        let path = local.pack_path(&name);
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(crate::error::io("cannot create", &path))?;
        file.set_len(size)
            .map_err(crate::error::io("cannot size", &path))?;
        match MappedOut::new(&file, size as usize) {
            Ok(map) => {
                packed.extend(own);
                packs.push(PackFill {
                    name,
                    path,
                    map,
                    chunks: chunks.to_vec(),
                    offsets: crate::dir::offsets(chunks),
                });
            }
            Err(_) => {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    let rest = missing
        .into_iter()
        .filter(|c| !packed.contains(&c.digest))
        .collect();
    Ok((packs, rest))
}

/// Runs blocking `work` from async code; on a multi-threaded runtime the worker first hands
/// its other tasks on.
fn on_threads<T>(work: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
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
    use crate::dir::CHUNK_SIZE;

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

    /// Node A's checkpoint directory by reference, pushed; node B's store, empty.
    fn pushed(remote: &Remote, root: &std::path::Path) -> (Store, std::path::PathBuf, Vec<u8>) {
        use crate::dir::tests::{opts, pattern};
        let node_a = Store::open(root.join("a")).unwrap();
        let image = root.join("image");
        std::fs::create_dir(&image).unwrap();
        let data = pattern(2 * CHUNK_SIZE as usize + 5, 3);
        std::fs::write(image.join("gpu-hook.7.data-000.bin"), &data).unwrap();
        // CRIU's pages repeat the data's second slice: that chunk is named twice.
        let pages = [
            &data[CHUNK_SIZE as usize..2 * CHUNK_SIZE as usize],
            b"pages",
        ]
        .concat();
        std::fs::write(image.join("pages-1.img"), &pages).unwrap();
        crate::dir::ingest(&node_a, &image, "c/1", &opts()).unwrap();
        rt().block_on(remote.push(&node_a, "c/1", 4)).unwrap();
        (Store::open(root.join("b")).unwrap(), image, data)
    }

    #[test]
    fn a_pull_by_files_writes_a_pack_a_restore_links_in_place() {
        for memory in [false, true] {
            let root = tempfile::tempdir().unwrap();
            let remote = if memory {
                Remote::new(Arc::new(object_store::memory::InMemory::new()), "memory")
            } else {
                Remote::filesystem(root.path().join("shared")).unwrap()
            };
            let (node_b, image, data) = pushed(&remote, root.path());
            let r = crate::DirRef::read(&image).unwrap().unwrap();
            let progress = crate::progress::Counting::default();
            let t = rt()
                .block_on(remote.pull_files_with(
                    &node_b,
                    &r.manifest,
                    &r.file_layout(),
                    3,
                    &progress,
                ))
                .unwrap();
            // Three chunks of the data file, and the pages' own last one.
            assert_eq!((t.chunks, t.chunks_present), (4, 0), "memory: {memory}");
            assert_eq!(progress.done.into_inner(), t.bytes);
            let m = node_b.manifest(&r.manifest).unwrap();
            node_b.require_chunks(&m).unwrap();
            assert!(node_b.validate(2).unwrap().is_clean());
            // The data file came as one pack: put back into a stage, it is linked, not copied.
            let stage = node_b.stage().unwrap();
            let placed = stage.path().join("7/data-000.bin");
            let place = |name: &str| (name == "gpu-hook.7.data-000.bin").then(|| placed.clone());
            let put = crate::dir::materialize_placed(&node_b, &image, 2, &NoProgress, &place)
                .unwrap()
                .unwrap();
            assert_eq!(put.linked_bytes, data.len() as u64, "memory: {memory}");
            assert_eq!(std::fs::read(&placed).unwrap(), data);
        }
    }

    #[test]
    fn a_damaged_chunk_pulled_into_a_pack_is_refused_and_nothing_is_published() {
        let root = tempfile::tempdir().unwrap();
        let remote = Remote::filesystem(root.path().join("shared")).unwrap();
        let (node_b, image, data) = pushed(&remote, root.path());
        let r = crate::DirRef::read(&image).unwrap().unwrap();
        let first = Digest::of(&data[..CHUNK_SIZE as usize]).to_hex();
        let path = root
            .path()
            .join(format!("shared/chunks/{}/{first}", &first[..2]));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[100] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let err = rt()
            .block_on(remote.pull_files_with(
                &node_b,
                &r.manifest,
                &r.file_layout(),
                2,
                &NoProgress,
            ))
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::ChunkDamaged { path: p, .. } if *p == path),
            "{err}"
        );
        assert!(node_b.manifest(&r.manifest).is_err());
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
