//! [`ImageReader`]: opens and validates an image with its parent chain, and reads
//! allocations back, checking every chunk's CRC32C.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use super::direct::{is_tmpfs, ReadMap};
use super::error::{ChunkPlace, ImageError};
use super::layer::{chain_hashes, open_chain, Layer, ParentChunk};
use super::manifest::{
    Allocation, Chunk, ChunkKey, Codec, ContentHash, ImageId, Location, Manifest,
};
use super::staging::{StagingBuf, StagingPool};
use super::summary::Summary;
use super::writer::NoDirect;
use super::AllocId;

/// An image's data files mapped read-only (on tmpfs: the image's own pages), and where
/// each requested chunk lies in them, for DMA straight from the image
/// ([`ImageReader::map_chunks`]). Unmapped when dropped.
pub struct MappedImage {
    /// One per data file of the chain (`None`: empty, never read).
    maps: Vec<Option<ReadMap>>,
    chunks: Vec<MappedChunk>,
    image: std::path::PathBuf,
}

/// Where one requested chunk's bytes are.
#[derive(Debug, Clone)]
pub struct MappedChunk {
    /// Uncompressed length.
    pub len: usize,
    /// `(map, offset)`: the chunk's bytes in [`MappedImage::region`] `map`; `None` for a
    /// zero chunk.
    pub at: Option<(usize, u64)>,
    crc32c: Option<u32>,
    /// Checked by the caller on the GPU (see [`ImageReader::defer_gpu_hashed_checks`]).
    deferred: bool,
    place: ChunkPlace,
}

/// Where a stored chunk's bytes are: layer, data file of that layer, offset, encoding.
#[derive(Debug, Clone, Copy)]
struct Stored {
    layer: usize,
    file: usize,
    offset: u64,
    stored_len: u64,
    codec: Codec,
}

/// A chunk stored raw: data file `file` of [`ImageReader::data_files`], at `offset`,
/// `len` bytes; whether the manifest has its gh1 digest (checkable on the GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawPlace {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
    pub gpu_hashed: bool,
}

/// A mapped data file: base and length (what a DMA engine registers).
#[derive(Debug, Clone, Copy)]
pub struct MappedRegion {
    pub base: *const u8,
    pub len: usize,
}

impl MappedImage {
    /// The chunk requested at `i`.
    pub fn chunk(&self, i: usize) -> &MappedChunk {
        &self.chunks[i]
    }

    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Mapped data file `map`.
    pub fn region(&self, map: usize) -> Option<MappedRegion> {
        let m = self.maps.get(map)?.as_ref()?;
        Some(MappedRegion {
            base: m.base(),
            len: m.len(),
        })
    }

    /// Checks the CRC32C of chunk `i` where it lies (no copy).
    pub fn verify(&self, i: usize) -> Result<(), ImageError> {
        let chunk = &self.chunks[i];
        let corrupt = |reason: String| ImageError::CorruptChunk {
            image: self.image.clone(),
            place: chunk.place.clone(),
            reason,
        };
        let Some((map, offset)) = chunk.at else {
            return Ok(());
        };
        if chunk.deferred {
            return Ok(());
        }
        let bytes = self.maps[map]
            .as_ref()
            .and_then(|m| m.slice(offset, chunk.len))
            .ok_or_else(|| corrupt("the chunk lies outside its data file".into()))?;
        check_crc(chunk.crc32c, bytes).map_err(corrupt)
    }
}

/// `Err(reason)` unless `bytes` have the CRC32C the manifest recorded.
fn check_crc(recorded: Option<u32>, bytes: &[u8]) -> Result<(), String> {
    let crc = crc32c::crc32c(bytes);
    match recorded {
        Some(expected) if expected == crc => Ok(()),
        expected => Err(format!(
            "CRC32C mismatch (manifest {:#010x}, data {crc:#010x})",
            expected.unwrap_or_default()
        )),
    }
}

/// An open, validated image. Reads take `&self` and may run on several threads.
pub struct ImageReader {
    /// `layers[0]` is this image, then its parent, grandparent, …
    layers: Vec<Layer>,
    /// Chunks with a gh1 digest are not CRC-checked when read or mapped: the caller
    /// checks them on the GPU after copying.
    defer_gpu_hashed: bool,
}

impl ImageReader {
    /// Opens `dir` and its parent chain (at the recorded paths) and validates every
    /// manifest, data file size and parent link. Chunk data is checked as it is read
    /// (or by [`verify`](Self::verify)).
    pub fn open(dir: &Path) -> Result<ImageReader, ImageError> {
        Ok(ImageReader {
            layers: open_chain(dir, None)?,
            defer_gpu_hashed: false,
        })
    }

    /// Like [`open`](Self::open), with the parent image at `parent` instead of the
    /// recorded path (its id and manifest checksum must still match).
    pub fn open_with_parent(dir: &Path, parent: &Path) -> Result<ImageReader, ImageError> {
        Ok(ImageReader {
            layers: open_chain(dir, Some(parent))?,
            defer_gpu_hashed: false,
        })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.layers[0].manifest
    }

    /// From now on, chunks that carry a gh1 digest (`gpu_hash`) are read and mapped
    /// without their CRC32C check: the caller promises to check them after copying them
    /// to the GPU, by hashing them there ([`gpuhash`](super::gpuhash)) — the CPU then never
    /// reads their bytes. [`verify`](Self::verify) still checks everything.
    pub fn defer_gpu_hashed_checks(&mut self) {
        self.defer_gpu_hashed = true;
    }

    /// Whether any chunk of this image carries a gh1 digest.
    pub fn has_gpu_hashes(&self) -> bool {
        self.allocations()
            .iter()
            .any(|a| a.chunks.iter().any(|c| c.gpu_hash.is_some()))
    }

    pub fn dir(&self) -> &Path {
        &self.layers[0].dir
    }

    /// BLAKE3 of this image's `manifest.json` (what a child image records).
    pub fn manifest_hash(&self) -> ContentHash {
        self.layers[0].manifest_hash
    }

    /// This image and its ancestors: directory and id, nearest first.
    pub fn chain(&self) -> Vec<(&Path, ImageId)> {
        self.layers
            .iter()
            .map(|l| (l.dir.as_path(), l.manifest.id))
            .collect()
    }

    pub fn allocations(&self) -> &[Allocation] {
        &self.manifest().allocations
    }

    /// The allocation at device address `va` with this `pid` tag.
    pub fn find(&self, va: u64, pid: Option<u32>) -> Option<AllocId> {
        self.allocations()
            .iter()
            .position(|a| a.va == va && a.tags.pid == pid)
            .map(AllocId)
    }

    /// A `Read` over the allocation's bytes; holds one chunk in memory. Errors are
    /// `io::Error`s wrapping an [`ImageError`] (`err.get_ref()` and downcast).
    pub fn read_allocation(&self, id: AllocId) -> Result<AllocationReader<'_>, ImageError> {
        self.alloc(id)?;
        Ok(AllocationReader {
            image: self,
            alloc: id.0,
            next_chunk: 0,
            chunk: Vec::new(),
            pos: 0,
            scratch: Vec::new(),
        })
    }

    /// Reads chunk `index` of allocation `id` into `buf` (at least the chunk's length);
    /// returns the chunk's length.
    pub fn read_chunk_into(
        &self,
        id: AllocId,
        index: usize,
        buf: &mut [u8],
    ) -> Result<usize, ImageError> {
        let alloc = self.alloc(id)?;
        let chunk = alloc.chunks.get(index).ok_or_else(|| {
            ImageError::Usage(format!("allocation {:#x} has no chunk {index}", alloc.va))
        })?;
        let len = chunk.len as usize;
        if buf.len() < len {
            return Err(ImageError::Usage(format!(
                "buffer of {} bytes for a {len}-byte chunk",
                buf.len()
            )));
        }
        self.load_chunk(id.0, index, &mut buf[..len], &mut Vec::new(), false)?;
        Ok(len)
    }

    /// Reads the whole allocation into `buf` (exactly its size) with `threads` threads.
    pub fn read_allocation_into(
        &self,
        id: AllocId,
        buf: &mut [u8],
        threads: usize,
    ) -> Result<(), ImageError> {
        let alloc = self.alloc(id)?;
        if buf.len() as u64 != alloc.size {
            return Err(ImageError::Usage(format!(
                "buffer of {} bytes for allocation {:#x} of {} bytes",
                buf.len(),
                alloc.va,
                alloc.size
            )));
        }
        let chunk_size = self.manifest().chunk_size as usize;
        let work = Mutex::new(buf.chunks_mut(chunk_size.max(1)).enumerate());
        self.parallel(threads, |scratch| loop {
            let next = work
                .lock()
                .map_err(|_| ImageError::Worker("poisoned".into()))?
                .next();
            let Some((index, out)) = next else {
                return Ok(());
            };
            self.load_chunk(id.0, index, out, scratch, false)?;
        })
    }

    /// Reads `chunks` (allocation, chunk index) on `threads` threads, each into a buffer
    /// of `pool` (read, decompressed and CRC-checked there), and hands every filled
    /// buffer to `sink` on the calling thread, in no particular order, with the index in
    /// `chunks` and the chunk's length. `sink` may keep buffers (e.g. while a DMA reads
    /// them) but must keep fewer than the pool has, or the readers starve. Stops at the
    /// first error, of a reader or of `sink`; buffers still in flight are dropped.
    pub fn read_chunks_staged<E, F>(
        &self,
        chunks: &[(AllocId, usize)],
        pool: &Arc<StagingPool>,
        threads: usize,
        mut sink: F,
    ) -> Result<(), E>
    where
        E: From<ImageError>,
        F: FnMut(usize, StagingBuf, usize) -> Result<(), E>,
    {
        for &(id, index) in chunks {
            let alloc = self.alloc(id)?;
            let chunk = alloc.chunks.get(index).ok_or_else(|| {
                ImageError::Usage(format!("allocation {:#x} has no chunk {index}", alloc.va))
            })?;
            if chunk.len as usize > pool.buf_size() {
                return Err(ImageError::Usage(format!(
                    "staging buffers of {} bytes for {}-byte chunks",
                    pool.buf_size(),
                    chunk.len
                ))
                .into());
            }
        }
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let (tx, rx) = mpsc::channel::<Result<(usize, StagingBuf, usize), ImageError>>();
            for _ in 0..threads.clamp(1, chunks.len().max(1)) {
                let tx = tx.clone();
                let (next, stop) = (&next, &stop);
                scope.spawn(move || {
                    let mut scratch = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= chunks.len() || stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let mut buf = pool.acquire();
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let (id, index) = chunks[i];
                        let len = self.allocations()[id.0].chunks[index].len as usize;
                        let msg = self
                            .load_chunk(
                                id.0,
                                index,
                                &mut buf[..len],
                                &mut scratch,
                                self.defer_gpu_hashed,
                            )
                            .map(|()| (i, buf, len));
                        let failed = msg.is_err();
                        if tx.send(msg).is_err() || failed {
                            return;
                        }
                    }
                });
            }
            drop(tx);
            let mut result = Ok(());
            // Drains until every reader is gone; after an error, buffers are only
            // dropped (back to the pool, so a reader waiting for one can see `stop`).
            for msg in rx {
                if result.is_err() {
                    continue;
                }
                let outcome = match msg {
                    Ok((i, buf, len)) => sink(i, buf, len),
                    Err(e) => Err(e.into()),
                };
                if let Err(e) = outcome {
                    stop.store(true, Ordering::Relaxed);
                    result = Err(e);
                }
            }
            result
        })
    }

    /// Why [`map_chunks`](Self::map_chunks) would refuse, or `None`: every image of the
    /// chain must be on tmpfs (mapping a disk file would read it through the page cache
    /// anyway, and its pages cannot be registered) and store chunks raw.
    pub fn direct_refusal(&self) -> Option<NoDirect> {
        for layer in &self.layers {
            if !is_tmpfs(&layer.dir) {
                return Some(NoDirect::NotTmpfs);
            }
            let compressed = layer.manifest.allocations.iter().any(|a| {
                a.chunks.iter().any(|c| {
                    matches!(
                        c.at,
                        Location::Data {
                            codec: Codec::Zstd,
                            ..
                        }
                    )
                })
            });
            if compressed {
                return Some(NoDirect::Compressed);
            }
        }
        None
    }

    /// Maps every data file of the chain read-only (page tables filled up front), so
    /// reads copy each chunk out of the page cache with `memcpy` (or decompress it from
    /// there) instead of `read(2)`. Only when every image of the chain is on tmpfs (a
    /// disk file reads better with readahead) and, with `huge_pages_only`, every data
    /// file is kept in huge pages (`st_blksize` of 2 MiB: a tmpfs mounted `huge=`): a
    /// copy-in bound by its readers gains a little from the mapping there, while on 4 KiB
    /// pages the page-table work makes it slower than `pread` (docs/BENCHMARKS.md).
    /// Returns whether the files are mapped.
    /// The image must not be truncated while mapped (a read past a file's end would
    /// fault): finished images are never written again, and the sizes were checked at
    /// open.
    pub fn map_data_files(&mut self, huge_pages_only: bool) -> Result<bool, ImageError> {
        use std::os::unix::fs::MetadataExt;
        if self.layers.iter().any(|l| !is_tmpfs(&l.dir)) {
            return Ok(false);
        }
        let huge = |file: &std::fs::File| file.metadata().is_ok_and(|m| m.blksize() >= 2 << 20);
        if huge_pages_only && !self.layers.iter().all(|l| l.files.iter().all(huge)) {
            return Ok(false);
        }
        for layer in &mut self.layers {
            if layer.maps.is_empty() {
                layer.maps = layer.map_files(huge_pages_only)?;
            }
        }
        Ok(true)
    }

    /// Maps every data file of the chain read-only and locates `chunks` (allocation,
    /// chunk index) in them. Checks nothing of the data: see [`MappedImage::verify`].
    pub fn map_chunks(&self, chunks: &[(AllocId, usize)]) -> Result<MappedImage, ImageError> {
        if let Some(why) = self.direct_refusal() {
            return Err(ImageError::Usage(format!("cannot map the image: {why}")));
        }
        let mut maps = Vec::new();
        let mut first = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            first.push(maps.len());
            maps.extend(layer.map_files(false)?);
        }
        let mut out = Vec::with_capacity(chunks.len());
        for &(id, index) in chunks {
            let (chunk, place, stored) = self.locate(id, index)?;
            out.push(MappedChunk {
                len: chunk.len as usize,
                at: stored.map(|s| (first[s.layer] + s.file, s.offset)),
                crc32c: chunk.crc32c,
                deferred: stored.is_some() && self.defer_gpu_hashed && chunk.gpu_hash.is_some(),
                place,
            });
        }
        Ok(MappedImage {
            maps,
            chunks: out,
            image: self.dir().to_path_buf(),
        })
    }

    /// Where chunk `index` of allocation `id` is stored: the chunk, its place (for
    /// errors) and `(layer, data file, offset)` of its stored bytes (`None`: a zero
    /// chunk), parent references resolved.
    fn locate(
        &self,
        id: AllocId,
        index: usize,
    ) -> Result<(&Chunk, ChunkPlace, Option<Stored>), ImageError> {
        let alloc = self.alloc(id)?;
        let chunk = alloc.chunks.get(index).ok_or_else(|| {
            ImageError::Usage(format!("allocation {:#x} has no chunk {index}", alloc.va))
        })?;
        let mut place = ChunkPlace {
            va: alloc.va,
            pid: alloc.tags.pid,
            offset: chunk.offset,
            file: std::path::PathBuf::new(),
            file_offset: 0,
        };
        let (layer, location) = match (chunk.at, chunk.key()) {
            (Location::Zero, _) => return Ok((chunk, place, None)),
            (Location::Parent { image }, Some(hash)) => self
                .layers
                .iter()
                .position(|l| l.manifest.id == image)
                .and_then(|i| self.layers[i].by_hash.get(&hash).map(|s| (i, s.location)))
                .ok_or_else(|| ImageError::Worker("parent reference not resolved".into()))?,
            (location, _) => (0, location),
        };
        let Location::Data {
            file,
            offset,
            stored_len,
            codec,
        } = location
        else {
            return Err(ImageError::Worker("chunk location is not data".into()));
        };
        let l = &self.layers[layer];
        place.file = l.dir.join(&l.manifest.files[file as usize].name);
        place.file_offset = offset;
        let stored = Stored {
            layer,
            file: file as usize,
            offset,
            stored_len,
            codec,
        };
        Ok((chunk, place, Some(stored)))
    }

    /// For each of `chunks`, where its bytes lie when they are stored raw (uncompressed)
    /// in a data file of the chain: what another process needs to DMA it from the
    /// file's pages. `None` for zero and compressed chunks.
    pub fn raw_places(
        &self,
        chunks: &[(AllocId, usize)],
    ) -> Result<Vec<Option<RawPlace>>, ImageError> {
        let mut first = Vec::with_capacity(self.layers.len());
        let mut n = 0;
        for layer in &self.layers {
            first.push(n);
            n += layer.files.len();
        }
        chunks
            .iter()
            .map(|&(id, index)| {
                let (chunk, _, stored) = self.locate(id, index)?;
                Ok(stored.filter(|s| s.codec == Codec::Raw).map(|s| RawPlace {
                    file: first[s.layer] + s.file,
                    offset: s.offset,
                    len: chunk.len,
                    gpu_hashed: chunk.gpu_hash.is_some(),
                }))
            })
            .collect()
    }

    /// The chain's data files in [`RawPlace::file`] order.
    pub fn data_files(&self) -> Vec<&std::fs::File> {
        self.layers.iter().flat_map(|l| l.files.iter()).collect()
    }

    /// Reads every chunk of every allocation and checks its CRC32C; returns the summary.
    /// On tmpfs the raw chunks are checked where they lie, mapped: no copy, about 1.5–2×
    /// the rate of reading them out (a restore checks every GPU byte before it starts).
    pub fn verify(&self, threads: usize) -> Result<Summary, ImageError> {
        let maps = if self.layers.iter().all(|l| is_tmpfs(&l.dir)) {
            self.layers
                .iter()
                .map(|l| l.map_files(false))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let work = Mutex::new(
            self.allocations()
                .iter()
                .enumerate()
                .flat_map(|(a, alloc)| (0..alloc.chunks.len()).map(move |i| (a, i))),
        );
        let chunk_size = self.manifest().chunk_size as usize;
        self.parallel(threads, |scratch| {
            let mut out = vec![0u8; chunk_size];
            loop {
                let next = work
                    .lock()
                    .map_err(|_| ImageError::Worker("poisoned".into()))?
                    .next();
                let Some((a, index)) = next else {
                    return Ok(());
                };
                if self.check_in_place(a, index, &maps)? {
                    continue;
                }
                let len = self.allocations()[a].chunks[index].len as usize;
                self.load_chunk(a, index, &mut out[..len], scratch, false)?;
            }
        })?;
        Ok(self.inspect())
    }

    /// Sizes and savings, from the manifest alone.
    pub fn inspect(&self) -> Summary {
        Summary::of(self.manifest(), self.layers.len() - 1)
    }

    /// Every hash the chain stores, with the image that stores it (for delta writers).
    pub(crate) fn stored_hashes(&self) -> HashMap<ChunkKey, ParentChunk> {
        chain_hashes(&self.layers)
    }

    fn alloc(&self, id: AllocId) -> Result<&Allocation, ImageError> {
        self.allocations().get(id.0).ok_or_else(|| {
            ImageError::Usage(format!(
                "no allocation {} in {}",
                id.0,
                self.dir().display()
            ))
        })
    }

    fn parallel<F>(&self, threads: usize, work: F) -> Result<(), ImageError>
    where
        F: Fn(&mut Vec<u8>) -> Result<(), ImageError> + Sync,
    {
        let threads = threads.max(1);
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| scope.spawn(|| work(&mut Vec::new())))
                .collect();
            let mut first = Ok(());
            for handle in handles {
                let result = handle
                    .join()
                    .unwrap_or_else(|_| Err(ImageError::Worker("a reader thread panicked".into())));
                if first.is_ok() {
                    first = result;
                }
            }
            first
        })
    }

    /// Decodes chunk `index` of allocation `a` into `out` (exactly its length).
    fn load_chunk(
        &self,
        a: usize,
        index: usize,
        out: &mut [u8],
        scratch: &mut Vec<u8>,
        defer_gpu_hashed: bool,
    ) -> Result<(), ImageError> {
        let (chunk, place, stored) = self.locate(AllocId(a), index)?;
        let Some(Stored {
            layer,
            file,
            offset,
            stored_len,
            codec,
        }) = stored
        else {
            out.fill(0);
            return Ok(());
        };
        let layer = &self.layers[layer];
        let corrupt = |reason: String| ImageError::CorruptChunk {
            image: self.dir().to_path_buf(),
            place: place.clone(),
            reason,
        };
        let read_error = |e: io::Error| match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                corrupt("the data file ends before the chunk (truncated)".into())
            }
            _ => ImageError::io(place.file.clone(), e),
        };
        let data = &layer.files[file];
        let mapped = match layer.mapped(file) {
            None => None,
            Some(map) => Some(map.slice(offset, stored_len as usize).ok_or_else(|| {
                corrupt("the data file ends before the chunk (truncated)".into())
            })?),
        };
        match (codec, mapped) {
            (Codec::Raw, Some(bytes)) if bytes.len() == out.len() => out.copy_from_slice(bytes),
            (Codec::Raw, _) => data.read_exact_at(out, offset).map_err(read_error)?,
            (Codec::Zstd, _) => {
                let frame = match mapped {
                    Some(bytes) => bytes,
                    None => {
                        scratch.resize(stored_len as usize, 0);
                        data.read_exact_at(scratch, offset).map_err(read_error)?;
                        &scratch[..]
                    }
                };
                let n = zstd::bulk::decompress_to_buffer(frame, out)
                    .map_err(|e| corrupt(format!("zstd frame does not decode: {e}")))?;
                if n != out.len() {
                    return Err(corrupt(format!(
                        "decoded {n} bytes, expected {}",
                        out.len()
                    )));
                }
            }
        }
        if defer_gpu_hashed && chunk.gpu_hash.is_some() {
            return Ok(());
        }
        check_crc(chunk.crc32c, out).map_err(corrupt)
    }

    /// Checks chunk `index` of allocation `a` where it lies in `maps` (per layer, per data
    /// file), without copying it; `Ok(false)` when it is not stored raw in a mapped file.
    fn check_in_place(
        &self,
        a: usize,
        index: usize,
        maps: &[Vec<Option<ReadMap>>],
    ) -> Result<bool, ImageError> {
        let (chunk, place, stored) = self.locate(AllocId(a), index)?;
        let Some(s) = stored else {
            return Ok(true); // a zero chunk: nothing stored to check
        };
        if s.codec != Codec::Raw {
            return Ok(false);
        }
        let Some(map) = maps.get(s.layer).and_then(|l| l.get(s.file)?.as_ref()) else {
            return Ok(false);
        };
        let corrupt = |reason: String| ImageError::CorruptChunk {
            image: self.dir().to_path_buf(),
            place: place.clone(),
            reason,
        };
        let bytes = map
            .slice(s.offset, s.stored_len as usize)
            .ok_or_else(|| corrupt("the data file ends before the chunk (truncated)".into()))?;
        check_crc(chunk.crc32c, bytes).map_err(corrupt)?;
        Ok(true)
    }
}

/// Streams one allocation, one verified chunk at a time.
pub struct AllocationReader<'r> {
    image: &'r ImageReader,
    alloc: usize,
    next_chunk: usize,
    chunk: Vec<u8>,
    pos: usize,
    scratch: Vec<u8>,
}

impl Read for AllocationReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.chunk.len() {
            let chunks = &self.image.allocations()[self.alloc].chunks;
            let Some(chunk) = chunks.get(self.next_chunk) else {
                return Ok(0);
            };
            self.chunk.resize(chunk.len as usize, 0);
            self.image
                .load_chunk(
                    self.alloc,
                    self.next_chunk,
                    &mut self.chunk,
                    &mut self.scratch,
                    false,
                )
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            self.next_chunk += 1;
            self.pos = 0;
        }
        let n = out.len().min(self.chunk.len() - self.pos);
        out[..n].copy_from_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
