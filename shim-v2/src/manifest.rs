//! `gpucr-checkpoint.json`: what a checkpoint image holds, and the check a restore makes of
//! it before anything is created.
//!
//! The manifest lists every file of the image with its size and, per 8 MiB chunk, a BLAKE3
//! hash, so a truncated or damaged byte anywhere (CRIU's memory pages are most of a GPU
//! process's image) is refused at Create, naming the file and the offset. The hook's GPU state
//! images carry their own per-chunk hashes (gpu-state's FORMAT.md), which the restore checks
//! through `HookRecord::validate`; their large data files are listed here by size only, so no
//! byte is hashed twice.
//!
//! Chunks are hashed on several threads (`hash_threads`): the check costs a read of the image
//! at several GB/s, not a pass of one core.

use std::{
    collections::BTreeMap,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
};

use gpu_state::image::ContentHash;
use serde::{Deserialize, Serialize};

use crate::{
    error::{Error, IoContext, Result},
    gpu::hook as gpu_hook,
    layout,
};

/// The image check's file (listed with the image's other records in `records`).
pub const MANIFEST: &str = "gpucr-checkpoint.json";
/// 2: per-chunk BLAKE3 of every file. 1 (older gpucr): small files by FNV-1a, large by size.
const MANIFEST_VERSION: u32 = 2;
/// The unit a damaged byte is located to.
pub const CHUNK_SIZE: u64 = 8 << 20;
/// Hook data files above this size are covered by the hook image's own chunk hashes.
const HOOK_VERIFIES_ABOVE: u64 = 1 << 20;

#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub version: u32,
    pub container_id: String,
    pub created_at: String,
    pub leave_running: bool,
    pub dump_ms: u64,
    /// Bytes per hashed chunk (0 in version 1).
    #[serde(default)]
    pub chunk_size: u64,
    pub files: BTreeMap<String, FileEntry>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub size: u64,
    /// Version 1 only: a checksum of files up to 1 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fnv1a64: Option<String>,
    /// One hash per `chunk_size` bytes; empty for a file checked by its own format.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blake3: Vec<ContentHash>,
}

/// A file of the image as found on disk, under its manifest name.
#[derive(Debug)]
struct Found {
    path: PathBuf,
    size: u64,
}

/// The image's files (the top level, and the hook's images under `gpu-hook/` or folded).
fn scan(dir: &Path) -> Result<BTreeMap<String, Found>> {
    let mut files = BTreeMap::new();
    scan_into(dir, "", &mut files)?;
    Ok(files)
}

fn scan_into(dir: &Path, prefix: &str, files: &mut BTreeMap<String, Found>) -> Result<()> {
    for e in std::fs::read_dir(dir).ctx(|| format!("reading {}", dir.display()))? {
        let e = e.ctx(|| format!("reading {}", dir.display()))?;
        let name = format!("{prefix}{}", e.file_name().to_string_lossy());
        // Followed: a checkpoint by reference links the hook's files from the store's stage.
        let md = std::fs::metadata(e.path()).ctx(|| format!("stat {name}"))?;
        if md.is_dir() && (name == gpu_hook::IMAGE_DIR || !prefix.is_empty()) {
            scan_into(&e.path(), &format!("{name}/"), files)?;
            continue;
        }
        if !md.is_file() || name == MANIFEST {
            continue;
        }
        // The hook's images by their folded names, in either layout (see `layout`).
        files.insert(
            layout::manifest_name(&name),
            Found {
                path: e.path(),
                size: md.len(),
            },
        );
    }
    Ok(())
}

/// Whether the manifest hashes this file (the hook's large files check themselves).
fn hashed(name: &str, size: u64) -> bool {
    layout::unfolded_name(name).is_none() || size <= HOOK_VERIFIES_ABOVE
}

/// Threads for hashing: the machine's, at most 16 (past that the disk is the limit).
pub fn hash_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get().min(16))
}

fn chunks_of(size: u64) -> u64 {
    size.div_ceil(CHUNK_SIZE)
}

/// A chunk to hash: file index, chunk index.
type Job = (usize, u64);

/// Hashes every chunk of `files` on `threads` threads. With `want`, stops at the first chunk
/// (in file and offset order) whose hash differs and returns it as `Err(job)`; the hashes of
/// every chunk otherwise. Jobs are taken in order, so every chunk before a mismatch was checked
/// and the mismatch reported is the first one.
fn hash_chunks(
    files: &[&Found],
    want: Option<&[&[ContentHash]]>,
    threads: usize,
) -> Result<std::result::Result<Vec<Vec<ContentHash>>, Job>> {
    let jobs: Vec<Job> = files
        .iter()
        .enumerate()
        .flat_map(|(f, found)| (0..chunks_of(found.size)).map(move |c| (f, c)))
        .collect();
    let next = AtomicUsize::new(0);
    let first_bad = AtomicUsize::new(usize::MAX);
    let results: Vec<Result<Vec<(usize, ContentHash)>>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.clamp(1, jobs.len().max(1)))
            .map(|_| {
                s.spawn(|| {
                    let mut buf = vec![0u8; CHUNK_SIZE as usize];
                    let mut done = Vec::new();
                    let mut open: Option<(usize, std::fs::File)> = None;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= jobs.len() || i > first_bad.load(Ordering::Relaxed) {
                            return Ok(done);
                        }
                        let (f, c) = jobs[i];
                        let found = files[f];
                        if open.as_ref().is_none_or(|(of, _)| *of != f) {
                            let file = std::fs::File::open(&found.path)
                                .ctx(|| format!("opening {}", found.path.display()))?;
                            open = Some((f, file));
                        }
                        let file = &open.as_ref().expect("opened above").1;
                        let offset = c * CHUNK_SIZE;
                        let len = (found.size - offset).min(CHUNK_SIZE) as usize;
                        file.read_exact_at(&mut buf[..len], offset)
                            .ctx(|| format!("reading {}", found.path.display()))?;
                        let hash = ContentHash::of(&buf[..len]);
                        if let Some(want) = want {
                            if want[f].get(c as usize) != Some(&hash) {
                                first_bad.fetch_min(i, Ordering::Relaxed);
                            }
                        }
                        done.push((i, hash));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("hash worker panicked"))
            .collect()
    });
    let mut hashes: Vec<Vec<ContentHash>> = files
        .iter()
        .map(|f| Vec::with_capacity(chunks_of(f.size) as usize))
        .collect();
    let mut all = Vec::with_capacity(jobs.len());
    for r in results {
        all.extend(r?);
    }
    let bad = first_bad.load(Ordering::Relaxed);
    if bad != usize::MAX {
        return Ok(Err(jobs[bad]));
    }
    all.sort_unstable_by_key(|(i, _)| *i);
    for (i, hash) in all {
        hashes[jobs[i].0].push(hash);
    }
    Ok(Ok(hashes))
}

/// The manifest's entries for the files found: sizes, and chunk hashes where `hashed`.
fn seal(found: &BTreeMap<String, Found>, threads: usize) -> Result<BTreeMap<String, FileEntry>> {
    let to_hash: Vec<(&String, &Found)> = found
        .iter()
        .filter(|(name, f)| hashed(name, f.size))
        .collect();
    let files: Vec<&Found> = to_hash.iter().map(|(_, f)| *f).collect();
    let hashes = hash_chunks(&files, None, threads)?.expect("nothing to compare against");
    let mut hashes: BTreeMap<&String, Vec<ContentHash>> =
        to_hash.iter().map(|(name, _)| *name).zip(hashes).collect();
    Ok(found
        .iter()
        .map(|(name, f)| {
            let entry = FileEntry {
                size: f.size,
                fnv1a64: None,
                blake3: hashes.remove(name).unwrap_or_default(),
            };
            (name.clone(), entry)
        })
        .collect())
}

/// Writes `gpucr-checkpoint.json`: every file of the image with its size and chunk hashes.
/// Written last: an image without it is incomplete.
pub fn write_manifest(id: &str, image: &Path, leave_running: bool, dump_ms: u64) -> Result<()> {
    let manifest = Manifest {
        version: MANIFEST_VERSION,
        container_id: id.to_string(),
        created_at: unix_seconds_now(),
        leave_running,
        dump_ms,
        chunk_size: CHUNK_SIZE,
        files: seal(&scan(image)?, hash_threads())?,
    };
    let path = image.join(MANIFEST);
    let tmp = image.join(format!(".{MANIFEST}.tmp"));
    let text = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
    std::fs::write(&tmp, text).ctx(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).ctx(|| format!("renaming {} into place", tmp.display()))
}

fn unix_seconds_now() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}", d.as_secs())
}

fn fnv1a64(data: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in data {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// The id of the container the image was checkpointed from (none without gpucr's manifest).
pub fn checkpointed_id(image: &Path) -> Option<String> {
    let text = std::fs::read_to_string(image.join(MANIFEST)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["container_id"].as_str().map(str::to_owned)
}

/// Bytes of the image's top-level files: what CRIU reads in a restore (the hook's images
/// under `gpu-hook/` are not CRIU's).
pub fn image_bytes(image: &Path) -> u64 {
    std::fs::read_dir(image)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Refuses an image that is missing, not a CRIU image, or does not match its manifest:
/// every file present at its size, every hashed chunk at its hash (the hook's images are
/// checked through their own hashes by `Records::read_checked`, which calls this first).
/// Reads the whole image; blocks (call it off the async runtime).
pub fn validate_image(id: &str, image: &Path) -> Result<()> {
    let refuse = |msg: String| Error::Restore {
        id: id.to_string(),
        image: image.to_path_buf(),
        msg,
    };
    if !image.is_dir() {
        return Err(refuse(
            "the checkpoint directory does not exist (was the checkpoint taken, and is the path \
             on this node?)"
                .into(),
        ));
    }
    if !image.join("inventory.img").is_file() {
        return Err(refuse(
            "no inventory.img: this is not a CRIU checkpoint image, or it is incomplete".into(),
        ));
    }
    let manifest_path = image.join(MANIFEST);
    if !manifest_path.exists() {
        // An image from another tool (plain runc, podman): CRIU checks it itself.
        return Ok(());
    }
    let text = std::fs::read_to_string(&manifest_path)
        .map_err(|e| refuse(format!("cannot read {MANIFEST}: {e}")))?;
    let manifest: Manifest =
        serde_json::from_str(&text).map_err(|e| refuse(format!("{MANIFEST} is damaged: {e}")))?;
    if manifest.version > MANIFEST_VERSION {
        return Err(refuse(format!(
            "{MANIFEST} version {} is newer than this gpucr understands ({MANIFEST_VERSION}); \
             upgrade gpucr",
            manifest.version
        )));
    }
    if manifest.version >= 2 && manifest.chunk_size != CHUNK_SIZE {
        return Err(refuse(format!(
            "{MANIFEST} hashes {}-byte chunks, this gpucr {CHUNK_SIZE}-byte ones; restore it \
             with the gpucr that wrote it",
            manifest.chunk_size
        )));
    }
    let found = scan(image)?;
    let mut sizes_ok = Vec::with_capacity(manifest.files.len());
    for (name, want) in &manifest.files {
        let got = match found.get(&layout::manifest_name(name)) {
            None => return Err(refuse(format!("file {name} is missing from the image"))),
            Some(got) => got,
        };
        if got.size != want.size {
            return Err(refuse(format!(
                "file {name} is {} bytes, the checkpoint wrote {} (truncated or damaged)",
                got.size, want.size
            )));
        }
        if let Some(fnv) = &want.fnv1a64 {
            let data =
                std::fs::read(&got.path).map_err(|e| refuse(format!("reading {name}: {e}")))?;
            if &fnv1a64(&data) != fnv {
                return Err(refuse(format!(
                    "file {name} does not match its checksum (damaged)"
                )));
            }
        }
        if !want.blake3.is_empty() || (manifest.version >= 2 && hashed(name, want.size)) {
            sizes_ok.push((name, got, want.blake3.as_slice()));
        }
    }
    if manifest.version < 2 {
        tracing::warn!(%id, image = %image.display(), "the checkpoint's manifest is version {}, \
            from an older gpucr: files over 1 MiB are checked by size only", manifest.version);
    }
    let files: Vec<&Found> = sizes_ok.iter().map(|(_, f, _)| *f).collect();
    let want: Vec<&[ContentHash]> = sizes_ok.iter().map(|(_, _, w)| *w).collect();
    let started = std::time::Instant::now();
    if let Err((f, c)) = hash_chunks(&files, Some(&want), hash_threads())? {
        let offset = c * CHUNK_SIZE;
        let end = (offset + CHUNK_SIZE).min(files[f].size);
        return Err(refuse(format!(
            "file {} is damaged at byte offset {offset} (bytes {offset}..{end} do not match \
             the BLAKE3 hash the checkpoint wrote); take a new checkpoint or copy the image \
             again",
            sizes_ok[f].0
        )));
    }
    let bytes: u64 = files.iter().map(|f| f.size).sum();
    tracing::info!(%id, bytes, elapsed_ms = started.elapsed().as_millis() as u64,
        "checkpoint image verified against its manifest");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image_with_manifest() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("inventory.img"), b"inv").unwrap();
        std::fs::write(dir.path().join("pages-1.img"), vec![7u8; 4096]).unwrap();
        write_manifest("c", dir.path(), true, 1).unwrap();
        dir
    }

    #[test]
    fn a_whole_image_passes() {
        let dir = image_with_manifest();
        validate_image("c", dir.path()).unwrap();
    }

    #[test]
    fn missing_truncated_and_damaged_images_are_refused() {
        let e = validate_image("c", Path::new("/nonexistent/ckpt")).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");

        let empty = tempfile::tempdir().unwrap();
        let e = validate_image("c", empty.path()).unwrap_err();
        assert!(e.to_string().contains("inventory.img"), "{e}");

        let dir = image_with_manifest();
        std::fs::write(dir.path().join("pages-1.img"), vec![7u8; 100]).unwrap();
        let e = validate_image("c", dir.path()).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");

        let dir = image_with_manifest();
        std::fs::write(dir.path().join("pages-1.img"), vec![8u8; 4096]).unwrap();
        let e = validate_image("c", dir.path()).unwrap_err();
        assert!(e.to_string().contains("damaged at byte offset 0"), "{e}");

        let dir = image_with_manifest();
        std::fs::remove_file(dir.path().join("pages-1.img")).unwrap();
        let e = validate_image("c", dir.path()).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");

        let dir = image_with_manifest();
        std::fs::write(dir.path().join(MANIFEST), b"{not json").unwrap();
        let e = validate_image("c", dir.path()).unwrap_err();
        assert!(e.to_string().contains("damaged"), "{e}");
    }

    #[test]
    fn one_byte_in_a_large_file_is_found_with_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("inventory.img"), b"inv").unwrap();
        let size = 3 * CHUNK_SIZE + 12345;
        let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let pages = dir.path().join("pages-1.img");
        std::fs::write(&pages, &data).unwrap();
        write_manifest("c", dir.path(), false, 1).unwrap();
        validate_image("c", dir.path()).unwrap();
        let m: Manifest =
            serde_json::from_slice(&std::fs::read(dir.path().join(MANIFEST)).unwrap()).unwrap();
        assert_eq!(m.files["pages-1.img"].blake3.len(), 4);

        // Damage in the last (short) chunk and in the second: the first damaged is named.
        for at in [3 * CHUNK_SIZE + 100, CHUNK_SIZE + 7] {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&pages)
                .unwrap();
            f.write_all_at(&[data[at as usize] ^ 1], at).unwrap();
            let e = validate_image("c", dir.path()).unwrap_err().to_string();
            let chunk = at / CHUNK_SIZE * CHUNK_SIZE;
            assert!(
                e.contains("pages-1.img") && e.contains(&format!("byte offset {chunk} ")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_version_1_manifest_is_still_accepted() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("inventory.img"), b"inv").unwrap();
        std::fs::write(dir.path().join("pages-1.img"), vec![7u8; 4096]).unwrap();
        let v1 = serde_json::json!({
            "version": 1, "container_id": "c", "created_at": "0", "leave_running": true,
            "dump_ms": 1, "files": {
                "inventory.img": {"size": 3, "fnv1a64": fnv1a64(b"inv")},
                "pages-1.img": {"size": 4096, "fnv1a64": fnv1a64(&[7u8; 4096])}
            }
        });
        std::fs::write(dir.path().join(MANIFEST), v1.to_string()).unwrap();
        validate_image("c", dir.path()).unwrap();
        std::fs::write(dir.path().join("pages-1.img"), vec![8u8; 4096]).unwrap();
        let e = validate_image("c", dir.path()).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
    }

    #[test]
    fn the_hook_images_are_in_the_manifest() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("inventory.img"), b"inv").unwrap();
        let hook_dir = dir.path().join(gpu_hook::IMAGE_DIR).join("7");
        std::fs::create_dir_all(&hook_dir).unwrap();
        std::fs::write(hook_dir.join("data-0.bin"), vec![1u8; 100]).unwrap();
        std::fs::write(hook_dir.join("data-1.bin"), vec![1u8; 2 << 20]).unwrap();
        std::fs::create_dir(dir.path().join("other")).unwrap();
        std::fs::write(dir.path().join("other/x"), b"x").unwrap();
        let files = scan(dir.path()).unwrap();
        assert!(files.contains_key("gpu-hook.7.data-0.bin"), "{files:?}");
        assert!(!files.contains_key("other/x"));
        write_manifest("c", dir.path(), true, 1).unwrap();
        let m: Manifest =
            serde_json::from_slice(&std::fs::read(dir.path().join(MANIFEST)).unwrap()).unwrap();
        assert_eq!(m.files["gpu-hook.7.data-0.bin"].blake3.len(), 1);
        assert!(
            m.files["gpu-hook.7.data-1.bin"].blake3.is_empty(),
            "the hook's large files are its own to check"
        );
        validate_image("c", dir.path()).unwrap();
        // Folded flat (as a checkpoint leaves it) and unfolded again: the same manifest.
        layout::fold(dir.path()).unwrap();
        validate_image("c", dir.path()).unwrap();
        layout::unfold(dir.path()).unwrap();
        validate_image("c", dir.path()).unwrap();
        std::fs::write(hook_dir.join("data-0.bin"), vec![1u8; 10]).unwrap();
        let e = validate_image("c", dir.path()).unwrap_err();
        assert!(e.to_string().contains("gpu-hook.7.data-0.bin"), "{e}");
    }
}
