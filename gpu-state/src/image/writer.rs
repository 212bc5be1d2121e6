//! [`ImageWriter`]: streams allocations into a new image, atomically published by
//! [`ImageWriter::finish`]. Dropping a writer without `finish` leaves nothing behind.
//!
//! Chunks go through the writer's [`StagingPool`] (allocated, and pinned when asked,
//! once per image): [`ImageWriter::stage`] hands out the buffer of one chunk, which the
//! caller fills however it likes (a DMA engine writing into it while other chunks are
//! compressed), and [`ImageWriter::commit`] gives it to the workers.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::atomic::{create_temp_dir, fsync_path, publish, random_id, remove_stale_temps};
use super::direct::{is_tmpfs, DirectMap, DIRECT_ALIGN, DIRECT_ALLOC_ALIGN, DIRECT_FILE};
use super::error::ImageError;
use super::gpuhash::ChunkDigest;
use super::layer::ParentChunk;
use super::manifest::Compression;
use super::manifest::{
    Allocation, AllocationTags, Chunk, ChunkKey, ContentHash, DataFile, GpuHash, ImageId, Location,
    Manifest, ParentRef, FORMAT_NAME, FORMAT_VERSION, FORMAT_VERSION_BLAKE3_ONLY, MANIFEST_FILE,
    MANIFEST_SUM_FILE,
};
use super::pipeline::{Done, Job, JobData, Pipeline, Placed};
use super::reader::ImageReader;
use super::staging::{StagingBuf, StagingPin, StagingPool};
use super::{AllocId, ImageOptions};

/// How many staging buffers the writer used: the observable memory bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterStats {
    /// The configured limit ([`ImageOptions::max_in_flight`]).
    pub max_in_flight: usize,
    /// Most staging buffers handed out at one time.
    pub peak_in_flight: usize,
    /// Staging buffers alive now (each `chunk_size` bytes; all allocated at create).
    pub buffers_allocated: usize,
    /// Whether the staging buffers are pinned for DMA.
    pub staging_pinned: bool,
    /// Chunks [`resolve`](ImageWriter::resolve)d as all zero: never copied.
    pub resolved_zero: usize,
    /// Chunks resolved as stored by the parent chain: never copied.
    pub resolved_parent: usize,
}

/// One chunk's staging buffer between [`ImageWriter::stage`] and
/// [`ImageWriter::commit`]. Dropping it uncommitted gives the buffer back; the chunk
/// then stays unwritten.
#[derive(Debug)]
pub struct StagedChunk {
    alloc: AllocId,
    index: usize,
    offset: u64,
    len: usize,
    buf: StagingBuf,
}

impl StagedChunk {
    /// Where the chunk's bytes go (e.g. a device-to-host DMA's destination): valid for
    /// [`len`](Self::len) bytes while this value lives.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.buf.as_mut_ptr()
    }

    /// The chunk's bytes.
    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }

    /// The chunk's length (shorter than the chunk size only at an allocation's end).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunk's offset in its allocation.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn alloc(&self) -> AllocId {
        self.alloc
    }
}

/// One chunk's place in the direct data file between [`ImageWriter::stage_direct`] and
/// [`ImageWriter::commit_direct`]. Dropping it uncommitted leaves the chunk unwritten.
#[derive(Debug)]
pub struct DirectChunk {
    alloc: AllocId,
    index: usize,
    offset: u64,
    len: usize,
    at: u64,
    ptr: *mut u8,
}

impl DirectChunk {
    /// Where the chunk's bytes go: valid for [`len`](Self::len) bytes while the writer
    /// lives (inside [`DirectRegion`]).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunk's offset in its allocation.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The chunk's offset in the direct data file (page aligned).
    pub fn file_offset(&self) -> u64 {
        self.at
    }
}

/// The mapped direct data file: what a DMA engine registers (in windows or whole).
#[derive(Debug, Clone, Copy)]
pub struct DirectRegion {
    pub base: *mut u8,
    pub len: usize,
}

/// Why an image cannot be written directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoDirect {
    /// Chunks are compressed, so they cannot sit in the file as the DMA left them.
    Compressed,
    /// The image directory is not on tmpfs: a shared mapping of the file could not be
    /// registered for DMA, and its page cache is not the image.
    NotTmpfs,
    /// Nothing left to write.
    Empty,
    AlreadyDirect,
}

impl std::fmt::Display for NoDirect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NoDirect::Compressed => "the image is compressed",
            NoDirect::NotTmpfs => "the image directory is not on tmpfs",
            NoDirect::Empty => "no chunks to write",
            NoDirect::AlreadyDirect => "the direct data file exists already",
        })
    }
}

struct AllocState {
    va: u64,
    size: u64,
    tags: AllocationTags,
    submitted: Vec<bool>,
    done: Vec<Option<Done>>,
    /// gh1 digests of chunks resolved before their copy (see `resolve`).
    known: Vec<Option<GpuHash>>,
    /// Each chunk's offset in the direct data file (empty without one).
    direct_at: Vec<u64>,
}

/// `direct_at` of a chunk left no place (see `start_direct_without`).
const NO_PLACE: u64 = u64::MAX;

struct Direct {
    map: Arc<DirectMap>,
    /// Its index in the manifest's files (after the workers' files).
    file: u32,
    /// Places of chunks resolved after the file was made (no copy): given back at
    /// [`finish`](ImageWriter::finish), adjacent ones in one go.
    unused: Vec<(u64, u64)>,
}

/// Writes one GPU state image. See the module docs for the protocol.
pub struct ImageWriter {
    target: PathBuf,
    temp: PathBuf,
    opts: ImageOptions,
    id: ImageId,
    parent: Option<ParentRef>,
    allocations: Vec<AllocState>,
    /// `(pid, va)` → end, to refuse overlapping allocations.
    ranges: BTreeMap<(Option<u32>, u64), u64>,
    pipeline: Option<Pipeline>,
    direct: Option<Direct>,
    /// The parent chain's chunks hashed on the GPU, for [`resolve`](Self::resolve).
    parent_gpu: HashMap<GpuHash, ParentChunk>,
    resolved_zero: usize,
    resolved_parent: usize,
}

impl ImageWriter {
    /// Starts an image that will appear at `dir` when finished. `dir` must not exist;
    /// with `parent`, chunks the parent chain already stores are referenced, not stored.
    pub fn create(
        dir: &Path,
        parent: Option<&Path>,
        opts: ImageOptions,
    ) -> Result<ImageWriter, ImageError> {
        Self::create_with_pin(dir, parent, opts, None)
    }

    /// Like [`create`](Self::create), with the staging pool (`max_in_flight` ×
    /// `chunk_size` bytes) pinned by `pin` once, at the first staged chunk (on that
    /// thread), and unpinned when the writer and every staged chunk are gone.
    pub fn create_with_pin(
        dir: &Path,
        parent: Option<&Path>,
        opts: ImageOptions,
        pin: Option<Arc<dyn StagingPin>>,
    ) -> Result<ImageWriter, ImageError> {
        opts.check()?;
        if dir.exists() {
            return Err(ImageError::AlreadyExists {
                path: dir.to_path_buf(),
            });
        }
        remove_stale_temps(dir)?;
        let mut opts = opts;
        let (parent_ref, parent_hashes) = match parent {
            Some(parent_dir) => {
                let chain = ImageReader::open(parent_dir)?;
                opts = with_chunk_size(opts, chain.manifest().chunk_size as usize)?;
                let parent_ref = ParentRef {
                    id: chain.manifest().id,
                    manifest_blake3: chain.manifest_hash(),
                    path: parent_path_from(dir, parent_dir),
                };
                (Some(parent_ref), chain.stored_hashes())
            }
            None => (None, HashMap::new()),
        };
        let parent_gpu = parent_hashes
            .iter()
            .filter_map(|(k, p)| match k {
                ChunkKey::Gpu(h) => Some((*h, *p)),
                ChunkKey::Blake3(_) => None,
            })
            .collect();
        // Pinned at the first staged chunk: a direct copy-out may never need it.
        let pool = StagingPool::new_deferred(opts.max_in_flight, opts.chunk_size, pin)?;
        let temp = create_temp_dir(dir)?;
        let pipeline = Pipeline::start(&temp, &opts, pool, parent_hashes)
            .map_err(|e| ImageError::io(&temp, e));
        let pipeline = match pipeline {
            Ok(p) => p,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&temp);
                return Err(e);
            }
        };
        tracing::debug!(dir = %dir.display(), temp = %temp.display(), "GPU state image write started");
        Ok(ImageWriter {
            target: dir.to_path_buf(),
            temp,
            opts,
            id: random_id(),
            parent: parent_ref,
            allocations: Vec::new(),
            ranges: BTreeMap::new(),
            pipeline: Some(pipeline),
            direct: None,
            parent_gpu,
            resolved_zero: 0,
            resolved_parent: 0,
        })
    }

    /// Declares an allocation of `size` bytes at device address `va`. Allocations
    /// with the same `pid` tag must not overlap.
    pub fn begin_allocation(
        &mut self,
        va: u64,
        size: u64,
        tags: AllocationTags,
    ) -> Result<AllocId, ImageError> {
        let end = va
            .checked_add(size)
            .ok_or_else(|| ImageError::Usage(format!("allocation {va:#x} + {size} overflows")))?;
        let key = (tags.pid, va);
        let before = self.ranges.range(..=key).next_back();
        let after = self.ranges.range(key..).next();
        let clash = before.is_some_and(|(k, e)| k.0 == tags.pid && (k.1 == va || *e > va))
            || after.is_some_and(|(k, _)| k.0 == tags.pid && (k.1 == va || k.1 < end));
        if clash {
            return Err(ImageError::Usage(format!(
                "allocation {va:#x} ({size} bytes, pid {:?}) overlaps one already written",
                tags.pid
            )));
        }
        self.ranges.insert(key, end);
        let chunks = size.div_ceil(self.opts.chunk_size as u64) as usize;
        self.allocations.push(AllocState {
            va,
            size,
            tags,
            submitted: vec![false; chunks],
            done: (0..chunks).map(|_| None).collect(),
            known: vec![None; chunks],
            direct_at: Vec::new(),
        });
        Ok(AllocId(self.allocations.len() - 1))
    }

    /// Writes the chunk at `offset` (a multiple of the chunk size) of `alloc`; `data`
    /// is the whole chunk (shorter only for an allocation's last chunk).
    pub fn write_chunk(
        &mut self,
        alloc: AllocId,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ImageError> {
        let (_, len) = self.slot(alloc, offset)?;
        if data.len() != len {
            return Err(ImageError::Usage(format!(
                "chunk at {offset:#x} must be {len} bytes, got {}",
                data.len()
            )));
        }
        self.write_chunk_with(alloc, offset, |buf| {
            buf.copy_from_slice(data);
            Ok(())
        })
    }

    /// Like [`write_chunk`](Self::write_chunk), but `fill` writes the chunk straight into
    /// a staging buffer (e.g. a device-to-host copy), avoiding one copy.
    pub fn write_chunk_with<F>(
        &mut self,
        alloc: AllocId,
        offset: u64,
        fill: F,
    ) -> Result<(), ImageError>
    where
        F: FnOnce(&mut [u8]) -> std::io::Result<()>,
    {
        let mut staged = self.stage(alloc, offset)?;
        if let Err(e) = fill(staged.data_mut()) {
            return Err(ImageError::io(&self.target, e));
        }
        self.commit(staged)
    }

    /// The staging buffer for the chunk at `offset` (a multiple of the chunk size) of
    /// `alloc`; blocks while all staging buffers are in use. Fill it, then
    /// [`commit`](Self::commit) it.
    pub fn stage(&mut self, alloc: AllocId, offset: u64) -> Result<StagedChunk, ImageError> {
        let (index, len) = self.slot(alloc, offset)?;
        let buf = self.acquire()?;
        Ok(StagedChunk {
            alloc,
            index,
            offset,
            len,
            buf,
        })
    }

    /// Tells the writer a chunk's identity before its bytes are copied (`digest` from
    /// the GPU, see [`gpuhash`](super::gpuhash)). A zero chunk, or one the parent chain
    /// stores with that digest, is recorded now and needs no copy: `false`. Otherwise the
    /// digest is kept for the chunk, whose bytes then go through [`stage`](Self::stage)
    /// or [`stage_direct`](Self::stage_direct) as usual (the workers only CRC them): `true`.
    /// Best called before [`start_direct`](Self::start_direct), which then leaves
    /// resolved chunks no place; after it, their places are given back at the finish.
    pub fn resolve(
        &mut self,
        alloc: AllocId,
        offset: u64,
        digest: ChunkDigest,
    ) -> Result<bool, ImageError> {
        let (index, len) = self.slot(alloc, offset)?;
        let mut done = Done {
            alloc: alloc.0,
            index,
            crc32c: None,
            blake3: None,
            gpu_hash: None,
            placed: Placed::Final(Location::Zero),
        };
        match digest {
            ChunkDigest::Zero => self.resolved_zero += 1,
            ChunkDigest::Hash(h) => match self.parent_chunk(&h, len as u64) {
                Some(p) => {
                    done.crc32c = Some(p.crc32c);
                    done.gpu_hash = Some(h);
                    done.placed = Placed::Final(Location::Parent { image: p.image });
                    self.resolved_parent += 1;
                }
                _ => {
                    self.allocations[alloc.0].known[index] = Some(h);
                    return Ok(true);
                }
            },
        }
        self.allocations[alloc.0].submitted[index] = true;
        // Not submitted before: a place laid out for it is its own (none when its
        // allocation was begun after the file was made).
        let place = self.allocations[alloc.0]
            .direct_at
            .get(index)
            .filter(|&&at| at != NO_PLACE);
        if let (Some(direct), Some(&at)) = (&mut self.direct, place) {
            direct
                .unused
                .push((at, (len as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN));
        }
        self.record(done);
        Ok(false)
    }

    /// Hands a filled chunk to the workers.
    pub fn commit(&mut self, staged: StagedChunk) -> Result<(), ImageError> {
        // Refuses a chunk written meanwhile (two stages of one chunk).
        self.slot(staged.alloc, staged.offset)?;
        self.submit(staged.alloc, staged.index, staged.buf, staged.len)
    }

    /// Hands a filled staging buffer to the workers.
    pub(crate) fn submit(
        &mut self,
        alloc: AllocId,
        index: usize,
        buf: StagingBuf,
        len: usize,
    ) -> Result<(), ImageError> {
        self.allocations[alloc.0].submitted[index] = true;
        let job = Job {
            alloc: alloc.0,
            index,
            data: JobData::Staged(buf),
            len,
            known: self.allocations[alloc.0].known[index],
        };
        self.pipeline_mut()
            .submit(job)
            .map_err(ImageError::Worker)?;
        self.collect();
        Ok(())
    }

    /// Why [`start_direct`](Self::start_direct) would refuse, or `None` when it can go.
    pub fn direct_refusal(&self) -> Option<NoDirect> {
        if self.direct.is_some() {
            Some(NoDirect::AlreadyDirect)
        } else if self.opts.compression != Compression::None {
            Some(NoDirect::Compressed)
        } else if !is_tmpfs(&self.temp) {
            Some(NoDirect::NotTmpfs)
        } else if self
            .allocations
            .iter()
            .all(|a| a.submitted.iter().all(|s| *s))
        {
            Some(NoDirect::Empty)
        } else {
            None
        }
    }

    /// Creates the direct data file: one page-aligned place for every chunk of the
    /// allocations begun so far that is not written yet, allocated and mapped shared. The
    /// places of an allocation with at least [`DIRECT_ALLOC_ALIGN`] of them start on that
    /// boundary.
    /// Chunks then go through [`stage_direct`](Self::stage_direct) (DMA straight into
    /// the file) and [`commit_direct`](Self::commit_direct) (the workers check, hash and
    /// punch out what is not stored). Staged chunks may still be mixed in.
    pub fn start_direct(&mut self) -> Result<DirectRegion, ImageError> {
        self.start_direct_without(|_, _| false)
    }

    /// [`start_direct`](Self::start_direct), leaving no place to the chunks `skip` names
    /// (allocation, chunk index): e.g. those a GPU hash taken before the freeze says the
    /// parent holds. Such a chunk is resolved without a copy, or goes through
    /// [`stage`](Self::stage) ([`has_direct_place`](Self::has_direct_place) tells).
    pub fn start_direct_without(
        &mut self,
        skip: impl Fn(AllocId, usize) -> bool,
    ) -> Result<DirectRegion, ImageError> {
        if let Some(why) = self.direct_refusal() {
            return Err(ImageError::Usage(format!("no direct data file: {why}")));
        }
        let chunk_size = self.opts.chunk_size as u64;
        let mut total = 0u64;
        let mut padding = Vec::new();
        for (a, state) in self.allocations.iter_mut().enumerate() {
            // Only allocations with a slice's worth of places: the padding of a small one
            // would cost more than its dedup saves.
            let placed: u64 = (0..state.submitted.len())
                .filter(|&i| !state.submitted[i] && !skip(AllocId(a), i))
                .map(|i| chunk_size.min(state.size - i as u64 * chunk_size))
                .sum();
            let start = total.next_multiple_of(DIRECT_ALLOC_ALIGN);
            if placed >= DIRECT_ALLOC_ALIGN && start > total {
                padding.push((total, start - total));
                total = start;
            }
            state.direct_at = (0..state.submitted.len())
                .map(|i| {
                    if skip(AllocId(a), i) {
                        return NO_PLACE;
                    }
                    let at = total;
                    if !state.submitted[i] {
                        let len = chunk_size.min(state.size - i as u64 * chunk_size);
                        total += len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
                    }
                    at
                })
                .collect();
        }
        let path = self.temp.join(DIRECT_FILE);
        let len = usize::try_from(total)
            .map_err(|_| ImageError::Usage(format!("direct data file of {total} bytes")))?;
        let map = DirectMap::create(&path, len).map_err(|e| ImageError::io(&path, e))?;
        let region = DirectRegion {
            base: map.base(),
            len: map.len(),
        };
        self.direct = Some(Direct {
            map: Arc::new(map),
            file: self.opts.threads as u32,
            // The padding is punched out at the finish, like places left unused.
            unused: padding,
        });
        tracing::debug!(bytes = len, "direct data file mapped");
        Ok(region)
    }

    /// The place in the direct data file of the chunk at `offset` of `alloc`: DMA into
    /// it, then [`commit_direct`](Self::commit_direct) it.
    pub fn stage_direct(&mut self, alloc: AllocId, offset: u64) -> Result<DirectChunk, ImageError> {
        let (at, len) = self.direct_place(alloc, offset)?;
        let index = (offset / self.opts.chunk_size as u64) as usize;
        let direct = self
            .direct
            .as_ref()
            .ok_or_else(|| ImageError::Usage("no direct data file".into()))?;
        // SAFETY: `at + len` lies inside the mapping (laid out by `start_direct`).
        let ptr = unsafe { direct.map.base().add(at as usize) };
        Ok(DirectChunk {
            alloc,
            index,
            offset,
            len,
            at,
            ptr,
        })
    }

    /// Where the chunk at `offset` of `alloc` goes in the direct data file, and its
    /// length (to plan registrations before the copies).
    pub fn direct_place(&self, alloc: AllocId, offset: u64) -> Result<(u64, usize), ImageError> {
        let (index, len) = self.slot(alloc, offset)?;
        if self.direct.is_none() {
            return Err(ImageError::Usage("no direct data file".into()));
        }
        let at = *self.allocations[alloc.0]
            .direct_at
            .get(index)
            .ok_or_else(|| ImageError::Usage("allocation begun after start_direct".into()))?;
        if at == NO_PLACE {
            return Err(ImageError::Usage(
                "a chunk left no place in the direct data file".into(),
            ));
        }
        Ok((at, len))
    }

    /// Whether the chunk at `offset` of `alloc` has a place in the direct data file.
    pub fn has_direct_place(&self, alloc: AllocId, offset: u64) -> bool {
        self.direct.is_some()
            && self.slot(alloc, offset).is_ok_and(|(index, _)| {
                self.allocations[alloc.0]
                    .direct_at
                    .get(index)
                    .is_some_and(|&at| at != NO_PLACE)
            })
    }

    /// Whether [`resolve`](Self::resolve) would record a chunk of `len` bytes with
    /// `digest` without a copy (zero, or stored by the parent chain). Changes nothing.
    pub fn would_resolve(&self, digest: ChunkDigest, len: u64) -> bool {
        match digest {
            ChunkDigest::Zero => true,
            ChunkDigest::Hash(h) => self.parent_chunk(&h, len).is_some(),
        }
    }

    /// The parent chain's chunk with gh1 digest `h`, if it has `len` bytes.
    fn parent_chunk(&self, h: &GpuHash, len: u64) -> Option<&ParentChunk> {
        self.parent_gpu.get(h).filter(|p| p.len == len)
    }

    /// Gives back the pages of the direct data file from `from` (a chunk's place) on:
    /// the caller sends no more chunks there (e.g. it fell back to staging), so they need
    /// not hold tmpfs memory until [`finish`](Self::finish) cuts the file.
    pub fn trim_direct(&self, from: u64) -> Result<(), ImageError> {
        let direct = self
            .direct
            .as_ref()
            .ok_or_else(|| ImageError::Usage("no direct data file".into()))?;
        let len = (direct.map.len() as u64).saturating_sub(from) as usize;
        if len > 0 {
            let path = self.temp.join(DIRECT_FILE);
            direct
                .map
                .punch(from, len)
                .map_err(|e| ImageError::io(&path, e))?;
        }
        Ok(())
    }

    /// Hands a chunk whose bytes are in the direct data file to the workers.
    pub fn commit_direct(&mut self, chunk: DirectChunk) -> Result<(), ImageError> {
        self.slot(chunk.alloc, chunk.offset)?;
        let direct = self
            .direct
            .as_ref()
            .ok_or_else(|| ImageError::Usage("no direct data file".into()))?;
        let data = JobData::Direct {
            map: direct.map.clone(),
            at: chunk.at,
            file: direct.file,
        };
        self.allocations[chunk.alloc.0].submitted[chunk.index] = true;
        let job = Job {
            alloc: chunk.alloc.0,
            index: chunk.index,
            data,
            len: chunk.len,
            known: self.allocations[chunk.alloc.0].known[chunk.index],
        };
        self.pipeline_mut()
            .submit(job)
            .map_err(ImageError::Worker)?;
        self.collect();
        Ok(())
    }

    /// A [`std::io::Write`] sink that writes `alloc` from offset 0 in order.
    pub fn allocation_writer(
        &mut self,
        alloc: AllocId,
    ) -> Result<super::sink::AllocationSink<'_>, ImageError> {
        self.slot(alloc, 0)
            .or_else(|e| match self.allocations.get(alloc.0) {
                Some(state) if state.size == 0 => Ok((0, 0)),
                _ => Err(e),
            })?;
        Ok(super::sink::AllocationSink::new(self, alloc))
    }

    /// Staging buffer use so far.
    pub fn stats(&self) -> WriterStats {
        let pool = self.pipeline.as_ref().map(Pipeline::pool);
        WriterStats {
            max_in_flight: self.opts.max_in_flight,
            peak_in_flight: pool.map_or(0, |p| p.peak_in_use()),
            buffers_allocated: pool.map_or(0, |p| p.count()),
            staging_pinned: pool.is_some_and(|p| p.is_pinned()),
            resolved_zero: self.resolved_zero,
            resolved_parent: self.resolved_parent,
        }
    }

    /// The chunk size in use (an incremental image's is its parent's).
    pub fn chunk_size(&self) -> usize {
        self.opts.chunk_size
    }

    /// The options in use: those given, or with a parent its chunk size and as many
    /// staging buffers as fit the same bytes.
    pub fn options(&self) -> ImageOptions {
        self.opts
    }

    /// Waits for all chunks, writes the manifest, fsyncs and publishes the image.
    pub fn finish(mut self) -> Result<Manifest, ImageError> {
        for state in &self.allocations {
            if let Some(i) = state.submitted.iter().position(|s| !s) {
                return Err(ImageError::MissingChunks {
                    image: self.target.clone(),
                    va: state.va,
                    offset: i as u64 * self.opts.chunk_size as u64,
                });
            }
        }
        let pipeline = self.pipeline.take().expect("pipeline present until finish");
        let mut finished = pipeline.finish().map_err(ImageError::Worker)?;
        for done in finished.done {
            self.record(done);
        }
        if let Some(direct) = self.direct.take() {
            // The file ends after its last stored chunk; the rest are holes.
            let end = finished
                .stored
                .values()
                .filter_map(|l| match l {
                    Some(Location::Data {
                        file,
                        offset,
                        stored_len,
                        ..
                    }) if *file == direct.file => Some(offset + stored_len),
                    _ => None,
                })
                .max()
                .unwrap_or(0);
            let path = self.temp.join(DIRECT_FILE);
            let mut unused = direct.unused;
            unused.sort_unstable();
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for (at, len) in unused {
                match runs.last_mut() {
                    Some(run) if run.0 + run.1 == at => run.1 += len,
                    _ => runs.push((at, len)),
                }
            }
            for (at, len) in runs.into_iter().filter(|&(at, _)| at < end) {
                direct
                    .map
                    .punch(at, len.min(end - at) as usize)
                    .map_err(|e| ImageError::io(&path, e))?;
            }
            direct
                .map
                .finish(end)
                .map_err(|e| ImageError::io(&path, e))?;
            finished.files.push(DataFile {
                name: DIRECT_FILE.to_string(),
                size: end,
            });
        }
        let mut manifest = self.build_manifest(&finished.files, &finished.stored)?;
        self.drop_empty_files(&mut manifest)?;
        manifest
            .validate()
            .map_err(|reason| ImageError::Worker(format!("built an invalid manifest: {reason}")))?;
        let bytes = manifest.to_json();
        let sum = format!("{}\n", ContentHash::of(&bytes).to_hex());
        for (name, content) in [
            (MANIFEST_FILE, bytes.as_slice()),
            (MANIFEST_SUM_FILE, sum.as_bytes()),
        ] {
            let path = self.temp.join(name);
            std::fs::write(&path, content).map_err(|e| ImageError::io(&path, e))?;
            fsync_path(&path)?;
        }
        publish(&self.temp, &self.target)?;
        tracing::info!(dir = %self.target.display(), id = %manifest.id, "GPU state image written");
        Ok(manifest)
    }

    /// Removes data files no chunk went to (a worker that stored nothing) and numbers
    /// the rest `data-000.bin`, `data-001.bin`, … without gaps.
    fn drop_empty_files(&self, manifest: &mut Manifest) -> Result<(), ImageError> {
        let mut new_index = Vec::with_capacity(manifest.files.len());
        let mut kept = Vec::new();
        for file in std::mem::take(&mut manifest.files) {
            let path = self.temp.join(&file.name);
            if file.size == 0 {
                std::fs::remove_file(&path).map_err(|e| ImageError::io(&path, e))?;
                new_index.push(None);
                continue;
            }
            let name = format!("data-{:03}.bin", kept.len());
            if name != file.name {
                let to = self.temp.join(&name);
                std::fs::rename(&path, &to).map_err(|e| ImageError::io(&to, e))?;
            }
            new_index.push(Some(kept.len() as u32));
            kept.push(DataFile {
                name,
                size: file.size,
            });
        }
        manifest.files = kept;
        for alloc in &mut manifest.allocations {
            for chunk in &mut alloc.chunks {
                if let Location::Data { file, .. } = &mut chunk.at {
                    *file = new_index[*file as usize].expect("a file a chunk is in is not empty");
                }
            }
        }
        Ok(())
    }

    fn build_manifest(
        &mut self,
        files: &[DataFile],
        stored: &HashMap<ChunkKey, Option<Location>>,
    ) -> Result<Manifest, ImageError> {
        let chunk_size = self.opts.chunk_size as u64;
        let mut allocations = Vec::with_capacity(self.allocations.len());
        for state in self.allocations.drain(..) {
            let mut chunks = Vec::with_capacity(state.done.len());
            for (i, done) in state.done.into_iter().enumerate() {
                let done = done.ok_or_else(|| {
                    ImageError::Worker(format!(
                        "no result for chunk {i} of allocation {:#x}",
                        state.va
                    ))
                })?;
                let at = match done.placed {
                    Placed::Final(location) => location,
                    Placed::SameAs(hash) => {
                        stored.get(&hash).copied().flatten().ok_or_else(|| {
                            ImageError::Worker(format!("chunk {} was never stored", hash.to_hex()))
                        })?
                    }
                };
                let offset = i as u64 * chunk_size;
                chunks.push(Chunk {
                    offset,
                    len: chunk_size.min(state.size - offset),
                    crc32c: done.crc32c,
                    blake3: done.blake3,
                    gpu_hash: done.gpu_hash,
                    at,
                });
            }
            allocations.push(Allocation {
                va: state.va,
                size: state.size,
                tags: state.tags,
                chunks,
            });
        }
        let gpu_hashed = allocations
            .iter()
            .any(|a: &Allocation| a.chunks.iter().any(|c| c.gpu_hash.is_some()));
        Ok(Manifest {
            format: FORMAT_NAME.to_string(),
            // Older readers still read images without gh1 digests.
            version: if gpu_hashed {
                FORMAT_VERSION
            } else {
                FORMAT_VERSION_BLAKE3_ONLY
            },
            id: self.id,
            chunk_size,
            compression: self.opts.compression,
            parent: self.parent.clone(),
            files: files.to_vec(),
            allocations,
        })
    }

    pub(crate) fn slot(&self, alloc: AllocId, offset: u64) -> Result<(usize, usize), ImageError> {
        let state = self
            .allocations
            .get(alloc.0)
            .ok_or_else(|| ImageError::Usage(format!("unknown allocation id {}", alloc.0)))?;
        let chunk_size = self.opts.chunk_size as u64;
        // `is_multiple_of` needs Rust 1.87; the workspace's rust-version is 1.85.
        #[allow(clippy::manual_is_multiple_of)]
        let unaligned = offset % chunk_size != 0;
        if unaligned || offset >= state.size {
            return Err(ImageError::Usage(format!(
                "offset {offset:#x} is not a chunk start inside allocation {:#x} ({} bytes)",
                state.va, state.size
            )));
        }
        let index = (offset / chunk_size) as usize;
        if state.submitted[index] {
            return Err(ImageError::Usage(format!(
                "chunk at {offset:#x} of allocation {:#x} was already written",
                state.va
            )));
        }
        Ok((index, chunk_size.min(state.size - offset) as usize))
    }

    pub(crate) fn acquire(&mut self) -> Result<StagingBuf, ImageError> {
        self.pipeline_mut().acquire().map_err(ImageError::Worker)
    }

    pub(crate) fn pipeline_mut(&mut self) -> &mut Pipeline {
        self.pipeline
            .as_mut()
            .expect("pipeline present until finish")
    }

    pub(crate) fn allocation_size(&self, alloc: AllocId) -> u64 {
        self.allocations[alloc.0].size
    }

    /// Takes finished chunk records off the result queue.
    fn collect(&mut self) {
        for done in self.pipeline_mut().ready() {
            self.record(done);
        }
    }

    fn record(&mut self, done: Done) {
        let (alloc, index) = (done.alloc, done.index);
        self.allocations[alloc].done[index] = Some(done);
    }
}

impl Drop for ImageWriter {
    fn drop(&mut self) {
        if let Some(pipeline) = self.pipeline.take() {
            drop(pipeline);
            if let Err(e) = std::fs::remove_dir_all(&self.temp) {
                tracing::warn!(temp = %self.temp.display(), error = %e, "cannot remove an abandoned GPU state image");
            } else {
                tracing::warn!(dir = %self.target.display(), "GPU state image abandoned before finish; nothing was published");
            }
        } else if self.temp.exists() {
            // finish() failed after the pipeline ended: the temporary directory stays unpublished.
            let _ = std::fs::remove_dir_all(&self.temp);
        }
    }
}

/// The parent's path as recorded: relative to the new image's directory when both
/// resolve, absolute otherwise.
fn parent_path_from(image: &Path, parent: &Path) -> String {
    let image_abs = image
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .canonicalize()
        .ok()
        .and_then(|p| image.file_name().map(|n| p.join(n)));
    let parent_abs = parent.canonicalize().ok();
    match (image_abs, parent_abs) {
        (Some(from), Some(to)) => relative(&from, &to).to_string_lossy().into_owned(),
        (_, Some(to)) => to.to_string_lossy().into_owned(),
        _ => parent.to_string_lossy().into_owned(),
    }
}

/// `to` as seen from directory `from` (both absolute).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<_> = from.components().collect();
    let to: Vec<_> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..from.len() {
        out.push("..");
    }
    for part in &to[common..] {
        out.push(part);
    }
    out
}

/// `opts` with chunks of `chunk` bytes: an incremental image takes its parent's chunk
/// size (chunks of another size never match, so every one would be stored again, e.g.
/// against a parent written before a change of the default), keeping the staging pool's
/// bytes (at least two buffers).
fn with_chunk_size(opts: ImageOptions, chunk: usize) -> Result<ImageOptions, ImageError> {
    if chunk == opts.chunk_size {
        return Ok(opts);
    }
    let pool = opts.max_in_flight.saturating_mul(opts.chunk_size);
    let adopted = ImageOptions {
        chunk_size: chunk,
        max_in_flight: (pool / chunk.max(1)).max(2),
        ..opts
    };
    adopted.check()?;
    tracing::info!(
        chunk,
        wanted = opts.chunk_size,
        "the parent image's chunk size is used for an incremental image"
    );
    Ok(adopted)
}
