//! A checkpoint directory by reference: its large files' bytes go into the store as chunks,
//! and the directory keeps [`REF_FILE`], which names the store manifest that lists them. What
//! containerd tars (and kubelet archives) is then the small files; a restore puts the large
//! ones back from the store ([`materialize`]) before anything reads the directory.
//!
//! `gpucr export DIR` is [`materialize`] (a self-contained directory again, for copying or
//! `ctr image push`); `gpucr import DIR` is [`ingest`].
//!
//! Files are cut into [`CHUNK_SIZE`] slices at fixed offsets, so equal bytes at equal offsets
//! (unchanged weights in a second checkpoint, replicas of one model) are equal chunks, written
//! once.

use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ahead::TakenAhead;
use crate::digest::Digest;
use crate::error::{io, Result, StoreError};
use crate::manifest::{ChunkRef, Manifest};
use crate::mapped::MappedOut;
use crate::progress::{NoProgress, Progress};
use crate::slices::{for_each_range, interleaved, parallel};
use crate::store::{sync_dir, write_synced, Located, Store};

/// The reference a by-reference checkpoint directory keeps in place of its large files.
pub const REF_FILE: &str = "gpucr-store.json";
pub const REF_FORMAT: &str = "gpucr-store-ref";
pub const REF_VERSION: u32 = 2;
/// The version written when no file is cut by content (what gpucr before version 2 reads).
const REF_VERSION_FIXED: u32 = 1;
/// The slice size: the checkpoint manifest's hash chunk (`shim-v2/src/manifest.rs`), so one
/// chunk's digest is also that manifest's hash of the same bytes.
pub const CHUNK_SIZE: u64 = 8 << 20;

/// Where a by-reference checkpoint's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RefMode {
    /// The writing node's store only: restorable on that node.
    Local,
    /// Also pushed to a shared store other nodes reach.
    Shared,
}

/// [`REF_FILE`]'s content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DirRef {
    pub format: String,
    pub version: u32,
    pub mode: RefMode,
    /// The store that holds the manifest (its `STORE` id) and the node it is on.
    pub store_id: String,
    pub node: String,
    /// The store manifest listing every chunk, file by file in `files` order.
    pub manifest: String,
    /// The shared store it was pushed to (a path or URL, as configured there), if any.
    #[serde(default)]
    pub shared: Option<String>,
    pub files: Vec<FileRef>,
}

/// One file the directory gave to the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRef {
    pub name: String,
    pub size: u64,
    /// How many chunks, when the file was cut by content ([`crate::cuts`]); else it is cut in
    /// [`CHUNK_SIZE`] slices (reference version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<usize>,
}

impl FileRef {
    fn chunks(&self) -> usize {
        self.chunks
            .unwrap_or_else(|| self.size.div_ceil(CHUNK_SIZE) as usize)
    }
}

/// Where each of a file's chunks starts in it.
pub(crate) fn offsets(chunks: &[ChunkRef]) -> Vec<u64> {
    chunks
        .iter()
        .scan(0, |at, c| {
            let here = *at;
            *at += c.len;
            Some(here)
        })
        .collect()
}

impl DirRef {
    /// The bytes of every file given to the store.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// Its files' sizes and chunk counts, in order: how the store manifest's chunks divide
    /// among them (for [`crate::Remote::pull_files_with`]).
    pub fn file_layout(&self) -> Vec<(u64, usize)> {
        self.files.iter().map(|f| (f.size, f.chunks())).collect()
    }

    /// Reads `dir`'s reference; `Ok(None)` when the directory is self-contained.
    pub fn read(dir: &Path) -> Result<Option<DirRef>> {
        let path = dir.join(REF_FILE);
        let text = match fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("cannot read", &path)(e)),
        };
        let bad = |reason: String| StoreError::BadManifest {
            path: path.clone(),
            reason,
        };
        let r: DirRef = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        if r.format != REF_FORMAT {
            return Err(bad(format!("format {:?} is not {REF_FORMAT:?}", r.format)));
        }
        if r.version > REF_VERSION {
            return Err(bad(format!(
                "version {} is newer than this gpucr reads ({REF_VERSION}); upgrade gpucr",
                r.version
            )));
        }
        Ok(Some(r))
    }
}

/// What [`ingest`] gives to the store.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Files of at least this many bytes go to the store; smaller ones stay in the directory.
    pub min_size: u64,
    pub mode: RefMode,
    /// Recorded in the reference for messages on other nodes (the caller pushes).
    pub shared: Option<String>,
    /// Threads hashing and writing chunks.
    pub threads: usize,
    /// Take files on the store's filesystem in without copying them (packs, see
    /// [`crate::pack`]); else every file is copied into chunks.
    pub adopt: bool,
    /// Files (by name) cut by content rather than in fixed slices: those whose bytes shift
    /// between two checkpoints ([`crate::cuts`]; gpucr's shim: CRIU's pages).
    pub cut_by_content: fn(&str) -> bool,
}

/// [`IngestOptions::cut_by_content`] for none.
pub fn no_file(_: &str) -> bool {
    false
}

/// [`IngestOptions::cut_by_content`] for CRIU's page images (`pages-<n>.img`).
pub fn criu_pages(name: &str) -> bool {
    name.starts_with("pages-") && name.ends_with(".img")
}

/// What [`ingest`] did.
#[derive(Debug, Clone)]
pub struct Ingested {
    pub dir_ref: DirRef,
    /// Bytes this ingest added to the store (the rest were there already).
    pub written_bytes: u64,
    /// Of those, the bytes taken in place (adopted) rather than copied.
    pub adopted_bytes: u64,
    pub chunks: usize,
}

/// One large file of the directory: where its bytes really are (a link's target).
struct Large {
    file: FileRef,
    real: PathBuf,
    linked: bool,
}

/// Gives `dir`'s large files to `store` under manifest `name`, writes [`REF_FILE`] and only
/// then removes the files. On any error before the reference is durable the directory is
/// unchanged (the chunks already written stay, unreferenced, for `gc`).
///
/// A symbolic link in `dir` stands for its target (the shim links the hook's images, written
/// into a [`crate::Stage`], this way): a small one is replaced by a copy, a large one is taken
/// in and its target removed with it. Files on the store's filesystem are adopted (no byte
/// copied) when `opts.adopt`.
pub fn ingest(store: &Store, dir: &Path, name: &str, opts: &IngestOptions) -> Result<Ingested> {
    ingest_with(store, dir, name, opts, &NoProgress)
}

/// [`ingest`], telling `progress` of the large files' bytes as they are hashed and stored.
pub fn ingest_with(
    store: &Store,
    dir: &Path,
    name: &str,
    opts: &IngestOptions,
    progress: &dyn Progress,
) -> Result<Ingested> {
    let (ingested, reclaim) = ingest_ahead(store, dir, name, opts, progress, TakenAhead::default)?;
    reclaim.run();
    Ok(ingested)
}

/// The packs' duplicate slices an ingest leaves to free ([`crate::Adopted::reclaim`]): freeing
/// 10 GB of tmpfs pages takes about a second, which a caller may spend after it has answered.
/// Dropped without [`Reclaim::run`], the bytes stay allocated (nothing reads them) until their
/// pack goes.
#[derive(Debug, Default)]
pub struct Reclaim(Vec<crate::Adopted>);

impl Reclaim {
    pub fn run(self) {
        for a in &self.0 {
            a.reclaim();
        }
    }
}

/// [`ingest_with`], using what [`crate::take_ahead`] took of these files already (a file
/// changed since refuses the ingest, the directory unchanged), leaving the duplicates' freeing
/// to the caller. `ahead` gives what was taken (it may wait for the taking to end): it is
/// called once the files that are no links into a stage (CRIU's, never taken ahead) are in,
/// so those go in while the taking finishes.
pub fn ingest_ahead(
    store: &Store,
    dir: &Path,
    name: &str,
    opts: &IngestOptions,
    progress: &dyn Progress,
    ahead: impl FnOnce() -> TakenAhead,
) -> Result<(Ingested, Reclaim)> {
    if dir.join(REF_FILE).exists() {
        return Err(StoreError::BadManifest {
            path: dir.join(REF_FILE),
            reason: "the directory is by reference already".into(),
        });
    }
    let mut large = Vec::new();
    for entry in fs::read_dir(dir).map_err(io("cannot list", dir))? {
        let entry = entry.map_err(io("cannot list", dir))?;
        let path = entry.path();
        let Some(fname) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let linked = entry.file_type().is_ok_and(|t| t.is_symlink());
        let real = if linked {
            fs::canonicalize(&path).map_err(io("cannot follow", &path))?
        } else {
            path.clone()
        };
        let md = fs::metadata(&real).map_err(io("cannot stat", &real))?;
        if !md.is_file() {
            continue;
        }
        if md.len() >= opts.min_size.max(1) {
            let file = FileRef {
                name: fname,
                size: md.len(),
                chunks: None,
            };
            large.push(Large { file, real, linked });
        } else if linked {
            // Same bytes under the same name: the directory must be whole without the link.
            let tmp = dir.join(format!(".{fname}.gpucr-tmp"));
            fs::copy(&real, &tmp).map_err(io("cannot copy", &real))?;
            fs::rename(&tmp, &path).map_err(io("cannot replace", &path))?;
        }
    }
    large.sort_by(|a, b| a.file.name.cmp(&b.file.name));
    let writer = store.writer()?;
    // Each file's chunks, in the files' order whatever order they go in.
    let mut per_file: Vec<Vec<ChunkRef>> = vec![Vec::new(); large.len()];
    let mut adopted = Vec::new();
    progress.start(large.iter().map(|l| l.file.size).sum());
    let mut early_bytes = 0;
    let mut ahead = Some(ahead);
    let mut taken = TakenAhead::default();
    let mut order: Vec<usize> = (0..large.len()).collect();
    order.sort_by_key(|&i| large[i].linked);
    let put = order.into_iter().try_for_each(|i| {
        let l = &mut large[i];
        if l.linked {
            if let Some(wait) = ahead.take() {
                taken = wait();
            }
        }
        let md = fs::metadata(&l.real).map_err(io("cannot stat", &l.real))?;
        let chunks = &mut per_file[i];
        if let Some(a) = taken.take(store, &l.real, &md, l.file.size)? {
            progress.advance(l.file.size);
            early_bytes += a.new_bytes;
            chunks.extend_from_slice(&a.chunks);
            adopted.push(a);
            return Ok(());
        }
        let file = File::open(&l.real).map_err(io("cannot open", &l.real))?;
        let cuts = if (opts.cut_by_content)(&l.file.name) {
            let cuts = crate::cuts::by_content(&file, &l.real, l.file.size, opts.threads)?;
            l.file.chunks = Some(cuts.len());
            cuts
        } else {
            crate::slices::fixed(l.file.size, CHUNK_SIZE)
        };
        if opts.adopt && store.can_adopt(&l.real) {
            let a = writer.adopt_cut(&l.real, &cuts, opts.threads, progress)?;
            chunks.extend_from_slice(&a.chunks);
            adopted.push(a);
        } else {
            chunks.extend(put_file(
                &writer,
                &file,
                &l.real,
                &cuts,
                opts.threads,
                progress,
            )?);
        }
        debug_assert_eq!(chunks.len(), l.file.chunks());
        Ok::<_, StoreError>(())
    });
    progress.finish();
    // Taken and not used (the files changed, or an error came first): theirs for gc.
    drop(ahead.map(|wait| wait()));
    put?;
    let chunks: Vec<ChunkRef> = per_file.concat();
    let files: Vec<FileRef> = large.iter().map(|l| l.file.clone()).collect();
    let written_bytes = writer.written_bytes() + early_bytes;
    let adopted_bytes = adopted.iter().map(|a| a.new_bytes).sum();
    // What `gpucr ls` shows beside the sizes: the mode and where the bytes are.
    let meta = serde_json::json!({
        "files": files, "chunk_size": CHUNK_SIZE, "mode": opts.mode, "node": hostname(),
        "shared": opts.shared,
    });
    let manifest = writer.publish(name, chunks, meta)?;
    let dir_ref = DirRef {
        format: REF_FORMAT.into(),
        version: if files.iter().any(|f| f.chunks.is_some()) {
            REF_VERSION
        } else {
            REF_VERSION_FIXED
        },
        mode: opts.mode,
        store_id: store.id().to_string(),
        node: hostname(),
        manifest: name.to_string(),
        shared: opts.shared.clone(),
        files,
    };
    let tmp = dir.join(format!(".{REF_FILE}.tmp"));
    write_synced(
        &tmp,
        &serde_json::to_vec_pretty(&dir_ref).expect("reference serialises"),
    )?;
    let path = dir.join(REF_FILE);
    fs::rename(&tmp, &path).map_err(io("cannot publish", &path))?;
    sync_dir(dir)?;
    for l in &large {
        let p = dir.join(&l.file.name);
        fs::remove_file(&p).map_err(io("cannot remove", &p))?;
        if l.linked {
            fs::remove_file(&l.real).map_err(io("cannot remove", &l.real))?;
        }
    }
    // Only now, with no other name left, may the packs' duplicate slices read as zeros.
    let ingested = Ingested {
        dir_ref,
        written_bytes,
        adopted_bytes,
        chunks: manifest.chunks.len(),
    };
    Ok((ingested, Reclaim(adopted)))
}

/// Hashes and puts the chunks `cuts` of `file` on `threads` threads; their references in
/// order.
fn put_file(
    writer: &crate::writer::Writer<'_>,
    file: &File,
    path: &Path,
    cuts: &[(u64, u64)],
    threads: usize,
    progress: &dyn Progress,
) -> Result<Vec<ChunkRef>> {
    for_each_range(file, path, cuts, threads, progress, |_, bytes| {
        Ok(writer.put_chunk_as(Digest::of(bytes), bytes)?.chunk)
    })
}

/// Puts `dir`'s referenced files back from `store` (each written under a temporary name and
/// renamed into place) and removes [`REF_FILE`]: the directory is self-contained again.
/// `Ok(None)`: it was already. Every chunk must be present (a caller pulls missing ones from
/// a shared store first); nothing in `dir` changes when one is not.
pub fn materialize(store: &Store, dir: &Path, threads: usize) -> Result<Option<DirRef>> {
    materialize_with(store, dir, threads, &NoProgress)
}

/// [`materialize`], telling `progress` of the files' bytes as they are put back.
pub fn materialize_with(
    store: &Store,
    dir: &Path,
    threads: usize,
    progress: &dyn Progress,
) -> Result<Option<DirRef>> {
    Ok(materialize_placed(store, dir, threads, progress, &|_| None)?.map(|m| m.dir_ref))
}

/// What [`materialize_placed`] did.
#[derive(Debug, Clone)]
pub struct Materialized {
    pub dir_ref: DirRef,
    /// Bytes put back by a hard link to a pack rather than copied.
    pub linked_bytes: u64,
    /// Files put where `place` said, not in the directory.
    pub placed: usize,
}

/// [`materialize_with`], putting each file for which `place(name)` gives a path there instead
/// of into `dir` (its parent is created). Such a file, when its chunks are one pack's slices in
/// order (a file the store took in whole) and the place is on the store's filesystem, is a hard
/// link to the pack: read in place, no byte copied. The caller must not write to it. When any
/// file was placed elsewhere, [`REF_FILE`] stays, so that the directory can be materialized
/// again after the placed files are gone.
pub fn materialize_placed(
    store: &Store,
    dir: &Path,
    threads: usize,
    progress: &dyn Progress,
    place: &dyn Fn(&str) -> Option<PathBuf>,
) -> Result<Option<Materialized>> {
    let Some(r) = DirRef::read(dir)? else {
        return Ok(None);
    };
    let manifest = store.manifest(&r.manifest)?;
    check_matches(&r, &manifest, &dir.join(REF_FILE))?;
    store.require_chunks(&manifest)?;
    progress.start(r.bytes());
    let filled = fill_files(store, dir, &r, &manifest, threads, progress, place);
    progress.finish();
    let (linked_bytes, placed) = filled?;
    if placed == 0 {
        let path = dir.join(REF_FILE);
        fs::remove_file(&path).map_err(io("cannot remove", &path))?;
    }
    Ok(Some(Materialized {
        dir_ref: r,
        linked_bytes,
        placed,
    }))
}

/// Every file of `r` back under its name (or where `place` says), each written under a
/// temporary name first; the bytes linked rather than copied, and how many were placed. The
/// copies of all files go on together, the threads spread over them: one file after another,
/// 16 threads each, filled 3.4 GB/s on the GPU host's tmpfs (2026-12-07), where a file's page
/// allocations serialise.
fn fill_files(
    store: &Store,
    dir: &Path,
    r: &DirRef,
    manifest: &Manifest,
    threads: usize,
    progress: &dyn Progress,
    place: &dyn Fn(&str) -> Option<PathBuf>,
) -> Result<(u64, usize)> {
    let (mut at, mut linked, mut placed) = (0, 0, 0);
    // (temporary name, final name) of every file, and the copies to make.
    let mut names: Vec<(PathBuf, PathBuf)> = Vec::new();
    let mut copies: Vec<Refill> = Vec::new();
    let made = r.files.iter().try_for_each(|f| {
        let chunks = &manifest.chunks[at..at + f.chunks()];
        at += f.chunks();
        let elsewhere = place(&f.name);
        // Links only where the caller owns the name (a stage): a file in `dir` may be edited
        // or taken in again, and must not share the pack's bytes.
        let may_link = elsewhere.is_some();
        let target = match elsewhere {
            Some(t) => {
                placed += 1;
                t
            }
            None => dir.join(&f.name),
        };
        let parent = target.parent().unwrap_or(dir).to_path_buf();
        fs::create_dir_all(&parent).map_err(io("cannot create", &parent))?;
        let tmp = parent.join(format!(
            ".{}.gpucr-tmp",
            target.file_name().unwrap_or_default().to_string_lossy()
        ));
        let _ = fs::remove_file(&tmp);
        names.push((tmp.clone(), target));
        let pack = whole_pack(store, chunks, f.size)
            .filter(|_| may_link && store.same_filesystem(&parent));
        match &pack {
            Some(pack) => {
                fs::hard_link(pack, &tmp).map_err(io("cannot link", pack))?;
                linked += f.size;
                progress.advance(f.size);
            }
            None => copies.push(Refill::create(tmp, f.size, chunks)?),
        }
        Ok::<_, StoreError>(())
    });
    let filled = made.and_then(|()| fill(store, &copies, threads, progress));
    if let Err(e) = filled {
        for (tmp, _) in &names {
            let _ = fs::remove_file(tmp);
        }
        return Err(e);
    }
    for (tmp, target) in &names {
        fs::rename(tmp, target).map_err(io("cannot rename into place", target))?;
    }
    Ok((linked, placed))
}

/// One file being written back from its chunks.
struct Refill<'m> {
    path: PathBuf,
    out: File,
    /// A shared mapping to read the chunks into, where the file maps.
    mapped: Option<MappedOut>,
    chunks: &'m [ChunkRef],
    offsets: Vec<u64>,
}

impl<'m> Refill<'m> {
    fn create(path: PathBuf, size: u64, chunks: &'m [ChunkRef]) -> Result<Refill<'m>> {
        let out = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io("cannot create", &path))?;
        out.set_len(size).map_err(io("cannot size", &path))?;
        let mapped = (size > 0)
            .then(|| MappedOut::new(&out, size as usize).ok())
            .flatten();
        Ok(Refill {
            path,
            out,
            mapped,
            chunks,
            offsets: offsets(chunks),
        })
    }
}

/// Writes every chunk of `copies` at its offset on `threads` threads, chunk `i` of every file
/// before chunk `i + 1` of any: read into the file's shared mapping (in parallel even on
/// tmpfs, see `mapped`), or, where it cannot be mapped and populated, by `copy_file_range`.
fn fill(
    store: &Store,
    copies: &[Refill<'_>],
    threads: usize,
    progress: &dyn Progress,
) -> Result<()> {
    let counts: Vec<usize> = copies.iter().map(|c| c.chunks.len()).collect();
    let jobs = interleaved(&counts);
    parallel(
        jobs.len(),
        threads,
        || (),
        |_, j| {
            let (n, i) = jobs[j];
            let c = &copies[n];
            let chunk = &c.chunks[i];
            let offset = c.offsets[i];
            match (store.locate(chunk), &c.mapped) {
                (None, _) => Err(store.missing(chunk)),
                (Some(src), Some(map)) => read_chunk_into(&src, map, offset, chunk.len, &c.path),
                (Some(src), None) => copy_chunk(&src, &c.out, offset, chunk.len),
            }?;
            progress.advance(chunk.len);
            Ok(())
        },
    )?;
    Ok(())
}

/// The pack that holds a file's `chunks` as its own slices, in order, and is `size` long.
fn whole_pack(store: &Store, chunks: &[ChunkRef], size: u64) -> Option<PathBuf> {
    let packs = store.root().join(crate::store::PACKS);
    let mut pack: Option<PathBuf> = None;
    for (c, offset) in chunks.iter().zip(offsets(chunks)) {
        let at = store.locate(c)?;
        if at.offset != offset || !at.path.starts_with(&packs) {
            return None;
        }
        match &pack {
            Some(p) if *p != at.path => return None,
            Some(_) => {}
            None => pack = Some(at.path),
        }
    }
    pack.filter(|p| fs::metadata(p).is_ok_and(|m| m.len() == size))
}

/// The manifest lists exactly the reference's files, slice by slice.
fn check_matches(r: &DirRef, m: &Manifest, path: &Path) -> Result<()> {
    let bad = |reason: String| StoreError::BadManifest {
        path: path.to_path_buf(),
        reason,
    };
    let want: usize = r.files.iter().map(FileRef::chunks).sum();
    if want != m.chunks.len() {
        return Err(bad(format!(
            "its files need {want} chunks, store manifest {} lists {}",
            r.manifest,
            m.chunks.len()
        )));
    }
    let mut at = 0;
    for f in &r.files {
        let len: u64 = m.chunks[at..at + f.chunks()].iter().map(|c| c.len).sum();
        at += f.chunks();
        if len != f.size {
            return Err(bad(format!(
                "{} is {} bytes, its chunks in {} are {len}",
                f.name, f.size, r.manifest
            )));
        }
    }
    Ok(())
}

/// Reads the chunk at `at` into `map` at `offset`.
fn read_chunk_into(at: &Located, map: &MappedOut, offset: u64, len: u64, out: &Path) -> Result<()> {
    let f = File::open(&at.path).map_err(io("cannot open chunk", &at.path))?;
    // SAFETY: each chunk's range is handed to one thread only.
    let dst = unsafe { map.range(offset as usize, len as usize) }
        .map_err(io("cannot allocate room (is its filesystem full?) in", out))?;
    f.read_exact_at(dst, at.offset)
        .map_err(io("cannot read chunk", &at.path))
}

fn copy_chunk(at: &Located, out: &File, offset: u64, len: u64) -> Result<()> {
    let src = &at.path;
    let f = File::open(src).map_err(io("cannot open chunk", src))?;
    let (mut off_in, mut off_out, mut left) = (at.offset as i64, offset as i64, len as usize);
    while left > 0 {
        match nix::fcntl::copy_file_range(&f, Some(&mut off_in), out, Some(&mut off_out), left) {
            Ok(0) => break,
            Ok(n) => left -= n,
            Err(nix::errno::Errno::EINTR) => continue,
            // Across filesystems on old kernels, or a filesystem without it.
            Err(_) => {
                let mut buf = vec![0u8; left];
                f.read_exact_at(&mut buf, off_in as u64)
                    .map_err(io("cannot read chunk", src))?;
                out.write_all_at(&buf, off_out as u64)
                    .map_err(io("cannot write", src))?;
                left = 0;
            }
        }
    }
    if left > 0 {
        return Err(io("chunk is shorter than its reference", src)(
            std::io::ErrorKind::UnexpectedEof.into(),
        ));
    }
    Ok(())
}

fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn opts() -> IngestOptions {
        IngestOptions {
            min_size: 1 << 20,
            mode: RefMode::Local,
            shared: None,
            threads: 3,
            adopt: false,
            cut_by_content: no_file,
        }
    }

    /// Bytes that do not repeat at any 8 MiB stride (no slice equals another).
    pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len as u64)
            .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ seed)
            .collect()
    }

    #[test]
    fn large_files_go_to_the_store_and_come_back() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let big = pattern(20 << 20, 1);
        let other = pattern((3 << 20) + 5, 2);
        std::fs::write(dir.path().join("pages-1.img"), &big).unwrap();
        std::fs::write(dir.path().join("gpu-hook.7.data-000.bin"), &other).unwrap();
        std::fs::write(dir.path().join("inventory.img"), b"small").unwrap();
        let progress = crate::progress::Counting::default();
        let got = ingest_with(&store, dir.path(), "c1/1", &opts(), &progress).unwrap();
        let logical = (big.len() + other.len()) as u64;
        assert_eq!(progress.total.into_inner(), logical);
        assert_eq!(progress.done.into_inner(), logical);
        assert_eq!(got.dir_ref.files.len(), 2);
        assert_eq!(got.chunks, 3 + 1);
        assert!(!dir.path().join("pages-1.img").exists());
        assert!(dir.path().join("inventory.img").exists());
        assert_eq!(DirRef::read(dir.path()).unwrap().unwrap(), got.dir_ref);

        let progress = crate::progress::Counting::default();
        let r = materialize_with(&store, dir.path(), 2, &progress)
            .unwrap()
            .unwrap();
        assert_eq!(r.bytes(), logical);
        assert_eq!(progress.done.into_inner(), logical);
        assert_eq!(std::fs::read(dir.path().join("pages-1.img")).unwrap(), big);
        assert_eq!(
            std::fs::read(dir.path().join("gpu-hook.7.data-000.bin")).unwrap(),
            other
        );
        assert!(!dir.path().join(REF_FILE).exists());
        assert!(materialize(&store, dir.path(), 2).unwrap().is_none());
    }

    #[test]
    fn a_second_checkpoint_writes_only_what_changed() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let mut bytes = pattern(32 << 20, 3);
        let first = tempfile::tempdir().unwrap();
        std::fs::write(first.path().join("pages-1.img"), &bytes).unwrap();
        let a = ingest(&store, first.path(), "c1/1", &opts()).unwrap();
        assert_eq!(a.written_bytes, 32 << 20);
        // One byte changed in the third 8 MiB slice: one chunk is new.
        bytes[(16 << 20) + 9] ^= 0xff;
        let second = tempfile::tempdir().unwrap();
        std::fs::write(second.path().join("pages-1.img"), &bytes).unwrap();
        let b = ingest(&store, second.path(), "c1/2", &opts()).unwrap();
        assert_eq!(b.written_bytes, 8 << 20);
        materialize(&store, second.path(), 4).unwrap();
        assert_eq!(
            std::fs::read(second.path().join("pages-1.img")).unwrap(),
            bytes
        );
    }

    /// Bytes with no period (xorshift), like a process's pages.
    pub(crate) fn noise(len: usize, mut x: u64) -> Vec<u8> {
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn criu_pages_cut_by_content_dedup_after_a_shift() {
        for adopt in [false, true] {
            let root = tempfile::tempdir().unwrap();
            let store = Store::open(root.path().join("store")).unwrap();
            let opts = IngestOptions {
                adopt,
                cut_by_content: criu_pages,
                ..opts()
            };
            let pages = noise(40 << 20, 5);
            let first = root.path().join("one");
            std::fs::create_dir(&first).unwrap();
            std::fs::write(first.join("pages-1.img"), &pages).unwrap();
            let a = ingest(&store, &first, "c/1", &opts).unwrap();
            assert_eq!(a.written_bytes, 40 << 20);
            let r = DirRef::read(&first).unwrap().unwrap();
            assert_eq!((r.version, r.files[0].chunks), (2, Some(a.chunks)));
            // A heap grown by three pages near the start shifts everything after it.
            let shifted = [
                &pages[..(1 << 20) + 123],
                &[1u8; 3 * 4096],
                &pages[(1 << 20) + 123..],
            ]
            .concat();
            let second = root.path().join("two");
            std::fs::create_dir(&second).unwrap();
            std::fs::write(second.join("pages-1.img"), &shifted).unwrap();
            let b = ingest(&store, &second, "c/2", &opts).unwrap();
            assert!(
                b.written_bytes < 10 << 20,
                "adopt {adopt}: {} of {} bytes new",
                b.written_bytes,
                shifted.len()
            );
            materialize(&store, &second, 3).unwrap();
            assert_eq!(std::fs::read(second.join("pages-1.img")).unwrap(), shifted);
            materialize(&store, &first, 3).unwrap();
            assert_eq!(std::fs::read(first.join("pages-1.img")).unwrap(), pages);
        }
    }

    #[test]
    fn staged_files_are_adopted_through_their_links_and_gc_frees_their_packs() {
        let root = tempfile::tempdir().unwrap();
        let store = Store::open(root.path().join("store")).unwrap();
        let stage = store.stage().unwrap();
        // The hook's image in the stage, linked from the checkpoint directory (as the shim
        // folds it); CRIU's pages in the directory itself, on the same filesystem.
        let data = pattern(24 << 20, 5);
        let staged = stage.path().join("7");
        std::fs::create_dir(&staged).unwrap();
        std::fs::write(staged.join("data-000.bin"), &data).unwrap();
        std::fs::write(staged.join("manifest.json"), b"{}").unwrap();
        let dir = root.path().join("image");
        std::fs::create_dir(&dir).unwrap();
        for f in ["data-000.bin", "manifest.json"] {
            std::os::unix::fs::symlink(staged.join(f), dir.join(format!("gpu-hook.7.{f}")))
                .unwrap();
        }
        let pages = pattern(9 << 20, 6);
        std::fs::write(dir.join("pages-1.img"), &pages).unwrap();
        let opts = IngestOptions {
            adopt: true,
            ..opts()
        };
        let got = ingest(&store, &dir, "c/1", &opts).unwrap();
        let logical = (data.len() + pages.len()) as u64;
        assert_eq!(got.written_bytes, logical);
        assert_eq!(got.adopted_bytes, logical, "nothing copied");
        // The small linked file is a file of the directory now; the large ones are gone,
        // the hook's from the stage too.
        let small = dir.join("gpu-hook.7.manifest.json");
        assert!(!small.symlink_metadata().unwrap().is_symlink());
        assert_eq!(std::fs::read(&small).unwrap(), b"{}");
        assert!(!staged.join("data-000.bin").exists());
        assert!(!dir.join("pages-1.img").exists());
        assert!(store.validate(2).unwrap().is_clean());

        // A second checkpoint, one slice of the hook's data changed: 8 MiB new.
        let mut changed = data.clone();
        changed[(8 << 20) + 1] ^= 1;
        std::fs::write(staged.join("data-000.bin"), &changed).unwrap();
        let dir2 = root.path().join("image2");
        std::fs::create_dir(&dir2).unwrap();
        std::os::unix::fs::symlink(
            staged.join("data-000.bin"),
            dir2.join("gpu-hook.7.data-000.bin"),
        )
        .unwrap();
        let got2 = ingest(&store, &dir2, "c/2", &opts).unwrap();
        assert_eq!(got2.written_bytes, 8 << 20);
        drop(stage);

        // Put back with the hook's file in a stage: one pack holds it whole, so it is linked.
        let stage = store.stage().unwrap();
        let place = |name: &str| {
            (name == "gpu-hook.7.data-000.bin").then(|| stage.path().join("7/data-000.bin"))
        };
        let m = materialize_placed(&store, &dir, 2, &NoProgress, &place)
            .unwrap()
            .unwrap();
        // Only the placed file: CRIU's pages in the directory are copied.
        assert_eq!((m.linked_bytes, m.placed), (data.len() as u64, 1));
        let placed = stage.path().join("7/data-000.bin");
        assert_eq!(std::fs::read(&placed).unwrap(), data);
        assert_eq!(std::fs::read(dir.join("pages-1.img")).unwrap(), pages);
        // The reference stays: with the stage gone, the directory can be put back again.
        assert!(dir.join(REF_FILE).exists());
        drop(stage);
        assert!(!placed.exists());
        for (d, want) in [(&dir, &data), (&dir2, &changed)] {
            materialize(&store, d, 2).unwrap();
            assert_eq!(
                &std::fs::read(d.join("gpu-hook.7.data-000.bin")).unwrap(),
                want
            );
            assert!(!d.join(REF_FILE).exists());
        }

        // The first checkpoint let go: its pages' pack goes, the hook's keeps what c/2 names.
        let report = store
            .gc(&crate::Retention {
                keep_last: 1,
                pinned: Default::default(),
            })
            .unwrap();
        assert_eq!(report.manifests_removed, vec!["c/1".to_string()]);
        assert_eq!(report.packs_removed, 1);
        assert_eq!(report.chunks_removed, 2 + 1);
        let m = store.manifest("c/2").unwrap();
        store.require_chunks(&m).unwrap();
        assert!(store.validate(2).unwrap().is_clean());
        assert!(report.bytes_freed >= 8 << 20, "{report:?}");
    }

    #[test]
    fn a_chunk_is_copied_where_the_file_cannot_be_mapped() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("pack");
        std::fs::write(&src, pattern(3 << 20, 7)).unwrap();
        let out = File::create(dir.path().join("out")).unwrap();
        out.set_len(2 << 20).unwrap();
        let at = Located {
            path: src.clone(),
            offset: 1 << 20,
        };
        copy_chunk(&at, &out, 1 << 20, 1 << 20).unwrap();
        let got = std::fs::read(dir.path().join("out")).unwrap();
        assert_eq!(&got[1 << 20..], &pattern(3 << 20, 7)[1 << 20..2 << 20]);
        assert!(got[..1 << 20].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_missing_chunk_changes_nothing() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pages-1.img"), pattern(10 << 20, 4)).unwrap();
        ingest(&store, dir.path(), "c1/1", &opts()).unwrap();
        let m = store.manifest("c1/1").unwrap();
        std::fs::remove_file(store.chunk_path(&m.chunks[1].digest)).unwrap();
        let before: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        let e = materialize(&store, dir.path(), 2).unwrap_err();
        assert!(matches!(e, StoreError::ChunkMissing { .. }), "{e}");
        let after: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(before.len(), after.len());
        assert!(dir.path().join(REF_FILE).exists());
    }
}
