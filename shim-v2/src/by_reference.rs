//! Checkpoints by reference (the gpucr store, `store/`): after a checkpoint is sealed, its
//! large files (CRIU's pages, the hook's GPU state data) go into the node's store as chunks
//! and the image keeps `gpucr-store.json` naming them, so what containerd tars and kubelet
//! archives is megabytes. A restore puts them back at Create, before the image check, pulling
//! what this node lacks from the shared store; anything missing refuses the restore with
//! nothing created.
//!
//! Modes, per container ([`MODE_ANNOTATION`]), per RuntimeClass (its runtime options) or
//! per node ([`MODE_ENV`]); `store_config` resolves them with the store's location:
//! - `inline` (default): the image is self-contained, as without a store.
//! - `local`: this node's store ([`STORE_ENV`]); restorable on this node only, and the
//!   reference says which node (`gpucr export` makes it self-contained again).
//! - `shared`: also pushed to the shared store [`SHARED_ENV`] (a directory other nodes mount,
//!   or `s3://BUCKET[/PREFIX]`), from which another node's restore pulls it.
//!
//! The store's location is the node's (containerd's config or environment), never a pod's:
//! a pod's annotations choose only the mode.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use gpucr_store::{
    dir, DirRef, IngestOptions, LogProgress, RefMode, Remote, Stage, Store, TakenAhead,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store_config::{StoreConfig, SHARED_OPTION};

/// Annotation: `inline`, `local` or `shared`.
pub const MODE_ANNOTATION: &str = "io.gpucr.store";
/// Shim environment: the node's default mode (else `inline`).
pub const MODE_ENV: &str = "GPUCR_STORE_MODE";
/// Shim environment: the node's store (the `gpucr` CLI reads the same variable).
pub const STORE_ENV: &str = "GPUCR_STORE";
pub const DEFAULT_STORE: &str = "/var/lib/gpucr/store";
/// Shim environment: the shared store, a path or `s3://BUCKET[/PREFIX]` (credentials from
/// the `AWS_*` variables).
pub const SHARED_ENV: &str = "GPUCR_STORE_SHARED";
/// Shim environment: files below this many bytes stay in the image (default 1 MiB).
pub const MIN_BYTES_ENV: &str = "GPUCR_STORE_MIN_BYTES";
/// Chunks in flight to or from the shared store.
const PARALLEL: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Inline,
    Local,
    Shared,
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

/// For a checkpoint by reference of a container with the hook: a stage in the store, linked
/// as the image's `gpu-hook` directory, so the hook writes its GPU state onto the store's
/// filesystem and the store takes it in place (no second write). Keep it until
/// [`give_to_store`] is done; dropped, it removes what was not taken. `None` (inline, or the
/// store cannot be opened: the copy into the store still works) leaves the image as it is.
pub fn stage_for_hook(id: &str, image: &Path, cfg: &StoreConfig) -> Option<Stage> {
    if cfg.mode == Mode::Inline {
        return None;
    }
    let link = image.join(crate::gpu::hook::IMAGE_DIR);
    let staged = Store::open(&cfg.dir)
        .and_then(|store| store.stage())
        .map_err(|e| e.to_string())
        .and_then(|stage| {
            std::os::unix::fs::symlink(stage.path(), &link)
                .map(|()| stage)
                .map_err(|e| format!("linking {}: {e}", link.display()))
        });
    match staged {
        Ok(stage) => Some(stage),
        Err(e) => {
            tracing::warn!(%id, store = %cfg.dir_label(), "the hook's images are written into \
                the image and copied into the store after: {e}");
            None
        }
    }
}

/// The hook's finished images being taken into the store while the checkpoint goes on (the
/// driver's lock, CRIU's dump and the give-back take about as long as hashing 16 GiB):
/// [`give_to_store`] waits for it and uses what it took.
pub struct Ahead(tokio::task::JoinHandle<gpucr_store::Result<TakenAhead>>);

/// Starts taking the files of `stage` (the hook's copy-out is done: they are final) into the
/// store, on half the node's threads: CRIU's dump runs beside it, and BLAKE3 over 17 GB in
/// the GPU host's /dev/shm took 1.03 s on 8 threads and 1.42 s on 16 (b3sum, 2026-12-04).
pub fn take_ahead(id: &str, stage: &Stage, cfg: &StoreConfig) -> Ahead {
    let (root, store_at, min) = (stage.path().to_path_buf(), cfg.dir.clone(), cfg.min_bytes);
    let progress = LogProgress::new(id, format!("ahead into the store {}", cfg.dir.display()));
    let threads = (threads() / 2).max(1);
    Ahead(tokio::task::spawn_blocking(move || {
        let store = Store::open(&store_at)?;
        gpucr_store::take_ahead(&store, &root, min, threads, &progress)
    }))
}

impl Ahead {
    /// What was taken; nothing (the ingest does it all) when taking failed.
    async fn taken(self, id: &str) -> TakenAhead {
        let started = Instant::now();
        let taken = match self.0.await {
            Ok(taken) => taken.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match taken {
            Ok(t) => {
                tracing::info!(%id, files = t.len(), bytes = t.bytes(), new = t.new_bytes(),
                    waited_ms = started.elapsed().as_millis() as u64,
                    "the hook's images were taken into the store during the dump");
                t
            }
            Err(e) => {
                tracing::warn!(%id, "taking the hook's images in ahead: {e}; the ingest \
                    takes them");
                TakenAhead::default()
            }
        }
    }
}

/// Gives a sealed image's large files to the store (mode `local` or `shared`), with what
/// `ahead` took of them already. The image stays self-contained when this fails before its
/// reference is written; the error says what failed, for the checkpoint's.
pub async fn give_to_store(
    id: &str,
    image: &Path,
    cfg: &StoreConfig,
    ahead: Option<Ahead>,
) -> std::result::Result<(), String> {
    let mode = cfg.mode;
    let ref_mode = match mode {
        Mode::Inline => return Ok(()),
        Mode::Local => RefMode::Local,
        Mode::Shared => RefMode::Shared,
    };
    let shared_at = cfg.shared().map(str::to_string);
    let remote = match (mode, &shared_at) {
        (Mode::Shared, None) => {
            return Err(format!(
                "{}, and this node has no shared store: set {SHARED_OPTION} in the runtime's \
                 options or {SHARED_ENV} in containerd's environment (a directory other nodes \
                 mount, or s3://BUCKET/PREFIX)",
                cfg.mode_from.named("shared")
            ))
        }
        (Mode::Shared, Some(at)) => Some(Remote::open(at).map_err(|e| e.to_string())?),
        _ => None,
    };
    let started = Instant::now();
    let name = format!(
        "{}/{}",
        sanitize(id),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or_default()
    );
    let (at, name2) = (image.to_path_buf(), name.clone());
    let opts = IngestOptions {
        min_size: cfg.min_bytes,
        mode: ref_mode,
        shared: shared_at.clone().filter(|_| mode == Mode::Shared),
        threads: threads(),
        adopt: true,
        // CRIU's pages shift between dumps: cut by content, they dedup all the same.
        cut_by_content: dir::criu_pages,
    };
    let store_at = cfg.dir.clone();
    let progress = LogProgress::new(id, format!("into the store {}", cfg.dir.display()));
    let (runtime, id2) = (tokio::runtime::Handle::current(), id.to_string());
    let (store, ingested) = crate::gpu::blocking("store", move || {
        let store = Store::open(&store_at)?;
        // CRIU's files go in first, while the hook's are still being taken in.
        let taken = || match ahead {
            Some(a) => runtime.block_on(a.taken(&id2)),
            None => TakenAhead::default(),
        };
        let ingested = dir::ingest_ahead(&store, &at, &name2, &opts, &progress, taken)?;
        Ok::<_, gpucr_store::StoreError>((store, ingested))
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("the store: {e}"))?;
    let (ingested, reclaim) = ingested;
    // The duplicates' pages are freed after the answer (a second of a 10 GB unchanged image).
    tokio::task::spawn_blocking(move || reclaim.run());
    crate::metrics::note_store(id, |b| b.written += ingested.written_bytes);
    tracing::info!(%id, manifest = %name, store = %store.root().display(),
        bytes = ingested.dir_ref.bytes(), written = ingested.written_bytes,
        taken_in_place = ingested.adopted_bytes, chunks = ingested.chunks,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "checkpoint by reference: its large files are in the store");
    if let Some(remote) = remote {
        let progress = LogProgress::new(id, format!("pushing to {}", remote.label()));
        let t = remote
            .push_with(&store, &name, PARALLEL, &progress)
            .await
            .map_err(|e| format!("pushing to the shared store: {e}"))?;
        crate::metrics::note_store(id, |b| b.pushed += t.bytes);
        tracing::info!(%id, manifest = %name, shared = %remote.label(), sent = t.bytes,
            present = t.chunks_present, elapsed_ms = started.elapsed().as_millis() as u64,
            "pushed to the shared store");
    }
    Ok(())
}

/// At Create: puts a by-reference image's files back from the store, pulling what this
/// node lacks from the shared store first. Nothing of the image changes when a chunk is
/// missing.
///
/// The hook's images go into a stage in the store, linked as the image's `gpu-hook`: a data
/// file the store took in whole is a link to its pack there, read in place by the copy-in
/// (on tmpfs, the helpers register those pages for DMA). The stage must outlive the copy-in
/// (the restore plan holds it); the image keeps `gpucr-store.json`, so it can be restored
/// again after.
pub async fn resolve(id: &str, image: &Path, cfg: &StoreConfig) -> Result<Option<Arc<Stage>>> {
    let refuse = |msg: String| Error::Restore {
        id: id.to_string(),
        image: image.to_path_buf(),
        msg,
    };
    let Some(r) = DirRef::read(image).map_err(|e| refuse(e.to_string()))? else {
        return Ok(None);
    };
    let started = Instant::now();
    let store =
        Store::open(&cfg.dir).map_err(|e| refuse(format!("the store {}: {e}", cfg.dir_label())))?;
    let whole = store
        .manifest(&r.manifest)
        .is_ok_and(|m| store.missing_chunks(&m).is_empty());
    if !whole {
        match (cfg.shared(), r.mode) {
            (Some(at), _) => {
                let remote = Remote::open(at).map_err(|e| refuse(e.to_string()))?;
                tracing::info!(%id, manifest = %r.manifest, shared = %remote.label(),
                    bytes = r.bytes(), "pulling the checkpoint's chunks from the shared store");
                let progress = LogProgress::new(id, format!("pulling from {}", remote.label()));
                let pulled = remote
                    .pull_files_with(&store, &r.manifest, &r.file_layout(), PARALLEL, &progress)
                    .await;
                crate::metrics::note_store(id, |b| b.pulled += progress.done());
                let t = pulled.map_err(|e| {
                    // A local checkpoint is in its node's store only.
                    let hint = match r.mode {
                        RefMode::Local => format!(
                            "; it was taken by reference to the store of node {:?} (mode \
                                 local): restore it there, or make it self-contained there \
                                 with `gpucr export DIR`",
                            r.node
                        ),
                        RefMode::Shared => String::new(),
                    };
                    refuse(format!(
                        "the checkpoint's data is not in this node's store {} and cannot \
                         be pulled from the shared store: {e}{hint}",
                        cfg.dir_label()
                    ))
                })?;
                tracing::info!(%id, manifest = %r.manifest, fetched = t.bytes,
                    present = t.chunks_present, elapsed_ms = started.elapsed().as_millis() as u64,
                    "pulled from the shared store");
            }
            (None, RefMode::Local) => {
                return Err(refuse(format!(
                    "the checkpoint is by reference to the store of node {:?} (mode local) and \
                     this node's store {} lacks {}: restore it on that node (and in a pod of \
                     the same runtime class), make it self-contained there (`gpucr export \
                     DIR`), or checkpoint with {MODE_ANNOTATION}=shared",
                    r.node,
                    cfg.dir_label(),
                    r.manifest
                )))
            }
            (None, RefMode::Shared) => {
                return Err(refuse(format!(
                    "the checkpoint's data is in the shared store {} and this node has none \
                     configured: set {SHARED_OPTION} in the runtime's options or {SHARED_ENV} \
                     in containerd's environment",
                    r.shared.as_deref().unwrap_or("(unnamed)")
                )))
            }
        }
    }
    let stage = hook_stage(id, &store, image, &r);
    let at = image.to_path_buf();
    let progress = LogProgress::new(id, format!("back from the store {}", cfg.dir.display()));
    let staged = stage.as_ref().map(|s| s.path().to_path_buf());
    let put = crate::gpu::blocking("store", move || {
        let place = |name: &str| {
            let (pid, file) = crate::layout::unfolded_name(name)?;
            Some(staged.as_ref()?.join(pid).join(file))
        };
        let m = dir::materialize_placed(&store, &at, threads(), &progress, &place)?;
        if let Some(root) = &staged {
            link_hook_images(&at, root).map_err(gpucr_store::error::io(
                "cannot link the hook's images from",
                &at,
            ))?;
        }
        Ok::<_, gpucr_store::StoreError>(m)
    })
    .await?
    .map_err(|e| refuse(format!("the checkpoint's data: {e}")))?;
    let linked = put.as_ref().map_or(0, |m| m.linked_bytes);
    tracing::info!(%id, manifest = %r.manifest, bytes = r.bytes(), read_in_place = linked,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "the checkpoint's files are back from the store");
    Ok(stage.map(Arc::new))
}

/// A stage for the hook's images of a restore, when the image has some and no `gpu-hook`
/// directory of its own; `None` puts them back into the image as before.
fn hook_stage(id: &str, store: &Store, image: &Path, r: &DirRef) -> Option<Stage> {
    let hooked = r
        .files
        .iter()
        .any(|f| crate::layout::unfolded_name(&f.name).is_some());
    let own = image.join(crate::gpu::hook::IMAGE_DIR);
    let own_dir = own.symlink_metadata().is_ok_and(|m| m.is_dir());
    if !hooked || own_dir {
        return None;
    }
    store
        .stage()
        .inspect_err(|e| {
            tracing::warn!(%id, "the hook's images are copied into the image: {e}");
        })
        .ok()
}

/// Copies the hook's small files (the large ones are placed already) from the image's top
/// level into `root/<ns pid>/`, and links `gpu-hook` to `root` (replacing an earlier
/// restore's link).
fn link_hook_images(image: &Path, root: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(image)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((pid, file)) = crate::layout::unfolded_name(&name) else {
            continue;
        };
        if !e.file_type()?.is_file() {
            continue;
        }
        let to = root.join(pid).join(file);
        if !to.exists() {
            std::fs::create_dir_all(root.join(pid))?;
            std::fs::copy(e.path(), &to)?;
        }
    }
    let link = image.join(crate::gpu::hook::IMAGE_DIR);
    if link.symlink_metadata().is_ok() {
        std::fs::remove_file(&link)?;
    }
    std::os::unix::fs::symlink(root, &link)
}

/// A store manifest name's first segment from a container id.
fn sanitize(id: &str) -> String {
    let s: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    match s.trim_start_matches('.') {
        "" => "container".to_string(),
        t => t.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_names_are_made_from_any_id() {
        assert_eq!(sanitize("ctr-1.a_b"), "ctr-1.a_b");
        assert_eq!(sanitize("a/b:c"), "a_b_c");
        assert_eq!(sanitize("..x"), "x");
        assert_eq!(sanitize(""), "container");
    }
}
