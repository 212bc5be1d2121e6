//! Device → image: chunks out, device digests, Prepare and image writing.

use std::collections::HashSet;

use std::path::Path;
use std::time::Instant;

use gpu_state::image::gpuhash::{self, ChunkDigest};
use gpu_state::image::{
    AllocId, DirectChunk, DirectRegion, ImageError, ImageWriter, NoDirect, StagedChunk,
};

use super::dma::{plan_windows, InFlight, Windows};
use super::fill::ChunkTodo;
use super::{FastPath, FastPathError};
use crate::alloc::{AllocState, Allocation};
use crate::driver::{DevicePtr, VmmDriver, VmmError};
use crate::prepared::{Prepared, Registered, Target};
use crate::protocol::{CopyOutReport, CopyProfile, PrepareReport};

/// A chunk whose copy-out is in flight: into a staging buffer or straight into the
/// direct data file.
pub(super) enum Pending {
    Staged(StagedChunk),
    Direct(DirectChunk),
}

impl Pending {
    pub(super) fn target(&mut self) -> (*mut u8, usize) {
        match self {
            Pending::Staged(c) => (c.as_mut_ptr(), c.len()),
            Pending::Direct(c) => (c.as_mut_ptr(), c.len()),
        }
    }

    pub(super) fn commit(self, writer: &mut ImageWriter) -> Result<(), ImageError> {
        match self {
            Pending::Staged(c) => writer.commit(c),
            Pending::Direct(c) => writer.commit_direct(c),
        }
    }
}

impl<D: VmmDriver + 'static> FastPath<D> {
    /// The copy-out's loop: every chunk DMA'd into a staging buffer or, with `region`,
    /// straight into its place in the direct data file (registered window by window on
    /// a helper thread of `scope`), committed to the writer when its copy is done.
    /// Returns the bytes copied, the windows registered and where the loop waited.
    pub(super) fn copy_chunks_out<'s, 'd>(
        &'d self,
        scope: &'s std::thread::Scope<'s, 'd>,
        writer: &mut ImageWriter,
        todo: &[ChunkTodo],
        region: Option<DirectRegion>,
        registered: Option<&Registered<D>>,
    ) -> Result<(u64, usize, CopyProfile), FastPathError> {
        let mut plan = None;
        if let Some(region) = region.filter(|_| registered.is_none()) {
            let mut spans = Vec::new();
            for c in todo {
                let (at, len) = writer.direct_place(c.id, c.offset)?;
                spans.push(Some((region.base as usize + at as usize, len, 0)));
            }
            plan = Some(plan_windows(spans, self.opts.direct_window));
        }
        // Unregistered (after the copies are waited for) before the writer can go.
        let mut windows = plan
            .as_mut()
            .map(|(w, _)| Windows::start(scope, self.driver(), std::mem::take(w), false));
        let of = plan.map(|(_, of)| of).unwrap_or_default();
        let mut windows_used = 0;
        let mut profile = CopyProfile::default();
        // Declared after the windows: dropped first, so every copy is waited for before
        // a buffer or window can go.
        let mut flight: InFlight<D, Pending> = InFlight::new(
            self.driver(),
            self.opts.streams.min(writer.options().max_in_flight),
        );
        let mut bytes = 0;
        for (n, c) in todo.iter().enumerate() {
            let (id, offset) = (&c.id, c.offset);
            // Only stage when a buffer can be had without waiting on our own copies.
            if flight.is_full() {
                if let Some(done) = flight.complete_oldest()? {
                    done.commit(writer)?;
                }
            }
            let mut pending = None;
            if registered.is_some() {
                // Prepared: every place is registered already; a chunk left no place
                // (unchanged at the Prepare, changed since) is staged.
                if writer.has_direct_place(*id, offset) {
                    pending = Some(Pending::Direct(writer.stage_direct(*id, offset)?));
                }
            } else if let Some(win) = windows.as_mut() {
                // Direct places are page aligned: no head.
                let (k, _) = of[n].expect("every chunk has a window");
                if win.current() != Some(k) {
                    // No copy may still target the window that goes.
                    while let Some(done) = flight.complete_oldest()? {
                        done.commit(writer)?;
                    }
                    if let Err(e) = win.enter(k) {
                        tracing::warn!(error = %e, "cannot register the direct data file; the rest goes through staging");
                        windows_used = win.registered;
                        profile.register_wait = win.waited.as_secs_f64();
                        windows = None;
                        writer.trim_direct(writer.direct_place(*id, offset)?.0)?;
                    }
                }
                if windows.is_some() {
                    pending = Some(Pending::Direct(writer.stage_direct(*id, offset)?));
                }
            }
            let pending = match pending {
                Some(p) => p,
                None => {
                    let t = Instant::now();
                    let staged = writer.stage(*id, offset)?;
                    profile.buffer_wait += t.elapsed().as_secs_f64();
                    Pending::Staged(staged)
                }
            };
            let done = flight.start(pending, |pending, stream| {
                let (dst, len) = pending.target();
                // SAFETY: the staged buffer or direct range stays in `flight` (the
                // writer and the windows outlive it) until its stream is waited for.
                unsafe {
                    self.driver()
                        .copy_to_host_async(c.va + offset, dst, len, stream)
                }
            })?;
            if let Some(done) = done {
                done.commit(writer)?;
            }
            bytes += c.len;
        }
        while let Some(done) = flight.complete_oldest()? {
            done.commit(writer)?;
        }
        profile.dma_wait = flight.waited.as_secs_f64();
        drop(flight);
        if let Some(w) = &windows {
            windows_used = w.registered;
            profile.register_wait = w.waited.as_secs_f64();
        }
        if let Some(r) = registered {
            windows_used = r.windows();
        }
        Ok((bytes, windows_used, profile))
    }

    /// The chunks to copy, in order. With the device hash (option and driver), every
    /// chunk is hashed on the GPU first and [`ImageWriter::resolve`]d: zero chunks and
    /// chunks the parent image stores are recorded without a copy. Without it, or when
    /// hashing fails (logged), every chunk is copied and hashed on the CPU. The flag says
    /// whether the device hash was used.
    pub(super) fn resolve_chunks(
        &self,
        writer: &mut ImageWriter,
        sources: &[(Allocation, DevicePtr)],
        ids: &[AllocId],
    ) -> Result<(Vec<ChunkTodo>, bool), FastPathError> {
        // The writer's: an incremental image's is its parent's.
        let chunk = writer.chunk_size() as u64;
        let all = |c: &mut Vec<ChunkTodo>, (a, src): &(Allocation, DevicePtr), id: AllocId| {
            for offset in (0..a.size).step_by(chunk as usize) {
                c.push(ChunkTodo {
                    id,
                    va: *src,
                    offset,
                    len: chunk.min(a.size - offset),
                });
            }
        };
        let mut todo = Vec::new();
        let regions: Vec<_> = sources.iter().map(|(a, src)| (*src, a.size)).collect();
        let Some(digests) = self.device_digests(&regions, chunk)? else {
            for (source, id) in sources.iter().zip(ids) {
                all(&mut todo, source, *id);
            }
            return Ok((todo, false));
        };
        for ((source, id), digests) in sources.iter().zip(ids).zip(digests) {
            let (a, src) = source;
            let Some(digests) = digests else {
                all(&mut todo, source, *id);
                continue;
            };
            for (i, d) in digests.into_iter().enumerate() {
                let offset = i as u64 * chunk;
                let len = chunk.min(a.size - offset);
                if writer.resolve(*id, offset, d)? {
                    todo.push(ChunkTodo {
                        id: *id,
                        va: *src,
                        offset,
                        len,
                    });
                }
            }
        }
        Ok((todo, true))
    }

    /// Every chunk's gh1 digest, hashed on the GPU, of each of `sources` (device address
    /// and size): per source its digests in order, or `None` for a source gh1 cannot hash
    /// (its size); `None` for all when the device hash is off or failed (logged).
    pub(super) fn device_digests(
        &self,
        sources: &[(DevicePtr, u64)],
        chunk: u64,
    ) -> Result<Option<Vec<Option<Vec<ChunkDigest>>>>, FastPathError> {
        // gh1 hashes whole words: an allocation of another size (a plain cuMemAlloc can
        // ask for any) is hashed on the CPU.
        let hashable = |size: u64| gpuhash::hashable(size) && gpuhash::hashable(chunk);
        let regions: Vec<_> = sources
            .iter()
            .copied()
            .filter(|&(_, size)| hashable(size))
            .collect();
        if !self.opts.device_hash || regions.is_empty() {
            return Ok(None);
        }
        let sums = match self.driver().chunk_sums(&regions, chunk) {
            Ok(Some(sums)) => sums,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::warn!(error = %e, "hashing on the GPU failed; hashing on the CPU after the copy");
                return Ok(None);
            }
        };
        // The driver answers one list of sums per region, one sum per chunk.
        let malformed = || {
            FastPathError::Driver(VmmError {
                call: crate::driver::DriverCall::Hash,
                code: crate::driver::CUDA_ERROR_INVALID_VALUE,
            })
        };
        let mut sums = sums.into_iter();
        let mut out = Vec::with_capacity(sources.len());
        for &(_, size) in sources {
            if !hashable(size) {
                out.push(None);
                continue;
            }
            let sums = sums.next().ok_or_else(malformed)?;
            if sums.len() as u64 != size.div_ceil(chunk) {
                return Err(malformed());
            }
            let digests = sums
                .into_iter()
                .enumerate()
                .map(|(i, s)| s.digest(chunk.min(size - i as u64 * chunk)))
                .collect();
            out.push(Some(digests));
        }
        Ok(Some(out))
    }

    /// The mapped direct data file when direct copy-out is asked for and possible.
    pub(super) fn direct_region(
        &self,
        writer: &mut ImageWriter,
    ) -> Result<Option<DirectRegion>, FastPathError> {
        if !self.opts.direct {
            return Ok(None);
        }
        if !self.opts.pin {
            tracing::info!("direct copy-out not used: pinning is off");
            return Ok(None);
        }
        if let Some(why) = writer.direct_refusal() {
            if why != NoDirect::Empty {
                tracing::info!(reason = %why, "direct copy-out not used");
            }
            return Ok(None);
        }
        Ok(Some(writer.start_direct()?))
    }

    /// Writes every allocation into a new image at `image_dir`: device-to-host DMA of
    /// up to `streams` chunks at a time straight into the writer's pinned staging
    /// buffers, each handed to the writer's workers as soon as its copy is done.
    /// A CopyOut readied by [`FastPath::prepare`] is used when it names the same image
    /// and the allocations did not change since.
    pub fn copy_out(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, FastPathError> {
        let sources: Vec<_> = self
            .mapped()?
            .into_iter()
            .map(|a| {
                let va = a.va;
                (a, va)
            })
            .collect();
        let prepared = self.take_prepared(image_dir, parent, &sources);
        self.write_image(image_dir, parent, &sources, prepared)
    }

    /// Readies a CopyOut into `image_dir` while the workload runs: the image's writer
    /// with its direct data file (every chunk's place) allocated on tmpfs and registered
    /// for DMA. Replaces an earlier one. Refused, nothing held, where the image cannot
    /// take direct copies.
    pub fn prepare(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
    ) -> Result<PrepareReport, FastPathError> {
        self.drop_prepared();
        if !self.opts.prepare {
            return Err(FastPathError::NotPrepared(
                "turned off in this process (GPUCR_HOOK_PREPARE=0)".into(),
            ));
        }
        if !self.opts.pin {
            return Err(FastPathError::NotPrepared("pinning is off".into()));
        }
        let since = Instant::now();
        let target = Target::of(image_dir, parent).map_err(|e| {
            FastPathError::NotPrepared(format!("cannot identify the image's directory: {e}"))
        })?;
        let allocs = self.mapped()?;
        let (mut writer, ids) = self.new_writer(image_dir, parent, &allocs)?;
        if let Some(why) = writer.direct_refusal() {
            return Err(FastPathError::NotPrepared(why.to_string()));
        }
        let skip = match parent {
            Some(_) => self.unchanged_now(&writer, &allocs, &ids)?,
            None => HashSet::new(),
        };
        let region = writer.start_direct_without(|id, i| skip.contains(&(id, i)))?;
        let allocate_seconds = since.elapsed().as_secs_f64();
        let t = Instant::now();
        let registered = Registered::register(
            self.allocator.driver(),
            region.base,
            region.len,
            self.opts.direct_window,
        )?;
        let report = PrepareReport {
            bytes: region.len as u64,
            windows: registered.windows(),
            allocate_seconds,
            register_seconds: t.elapsed().as_secs_f64(),
        };
        tracing::info!(?report, dir = %image_dir.display(), "copy-out prepared");
        *self.prepared.lock().unwrap_or_else(|p| p.into_inner()) = Some(Prepared {
            registered,
            writer,
            target,
            layout: allocs.iter().map(|a| (a.va, a.size)).collect(),
            ids,
            region: (region.base as usize, region.len),
            since,
        });
        Ok(report)
    }

    /// A writer for a new image at `image_dir` with `allocs` begun, in order.
    pub(super) fn new_writer<'a>(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
        allocs: impl IntoIterator<Item = &'a Allocation>,
    ) -> Result<(ImageWriter, Vec<AllocId>), FastPathError> {
        let mut writer =
            ImageWriter::create_with_pin(image_dir, parent, self.opts.image, self.pin())?;
        let ids = allocs
            .into_iter()
            .map(|a| writer.begin_allocation(a.va, a.size, self.tags()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((writer, ids))
    }

    /// Whether a prepared CopyOut is held.
    pub fn is_prepared(&self) -> bool {
        self.prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Drops a prepared CopyOut, if any: its windows unregistered, its unfinished image
    /// removed.
    pub fn drop_prepared(&self) {
        let prepared = self
            .prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(p) = prepared {
            tracing::info!(
                bytes = p.region.1,
                age_seconds = p.since.elapsed().as_secs_f64(),
                "prepared copy-out dropped"
            );
        }
    }

    /// For an incremental Prepare: the chunks (allocation, index) the GPU hash finds zero
    /// or in the parent chain now, left no place in the data file. Laying out all of them
    /// would allocate and pin the whole image for the few chunks that change, slower than
    /// staging them (docs/BENCHMARKS.md). The CopyOut
    /// hashes again when frozen: a chunk that changed meanwhile is staged, one that went
    /// back has its place punched.
    pub(super) fn unchanged_now(
        &self,
        writer: &ImageWriter,
        allocs: &[Allocation],
        ids: &[AllocId],
    ) -> Result<HashSet<(AllocId, usize)>, FastPathError> {
        let regions: Vec<_> = allocs.iter().map(|a| (a.va, a.size)).collect();
        let chunk = writer.chunk_size() as u64;
        let Some(digests) = self.device_digests(&regions, chunk)? else {
            return Err(FastPathError::NotPrepared(
                "an incremental copy-out needs the GPU hash to know what changed".into(),
            ));
        };
        let (mut skip, mut total) = (HashSet::new(), 0);
        for ((a, id), digests) in allocs.iter().zip(ids).zip(digests) {
            total += a.size.div_ceil(chunk) as usize;
            for (i, d) in digests.into_iter().flatten().enumerate() {
                if writer.would_resolve(d, chunk.min(a.size - i as u64 * chunk)) {
                    skip.insert((*id, i));
                }
            }
        }
        if skip.len() == total {
            return Err(FastPathError::NotPrepared(
                "nothing changed since the parent (GPU hash): the CopyOut only hashes".into(),
            ));
        }
        Ok(skip)
    }

    /// The prepared CopyOut if it is for this image and these allocations; any other is
    /// dropped (logged).
    pub(super) fn take_prepared(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
        sources: &[(Allocation, DevicePtr)],
    ) -> Option<Prepared<D>> {
        let p = self
            .prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let why = match Target::of(image_dir, parent) {
            Err(e) => format!("cannot identify the image's directory: {e}"),
            Ok(t) if t != p.target => "prepared for another image".into(),
            Ok(_)
                if !sources
                    .iter()
                    .map(|(a, _)| (a.va, a.size))
                    .eq(p.layout.iter().copied()) =>
            {
                "the allocations changed since the Prepare".into()
            }
            Ok(_) => return Some(p),
        };
        tracing::info!(reason = %why, "prepared copy-out not used");
        None
    }

    /// Every tracked allocation, refusing if any is not mapped (or cannot be moved).
    pub(super) fn mapped(&self) -> Result<Vec<Allocation>, FastPathError> {
        let allocs = self.movable()?;
        if let Some(alloc) = allocs.iter().find(|a| a.state != AllocState::Mapped) {
            return Err(FastPathError::NotMapped {
                va: alloc.va,
                state: alloc.state,
            });
        }
        Ok(allocs)
    }

    /// The copy-out proper: each allocation of `sources` recorded as it is, its bytes
    /// read at the address paired with it (its own, or its copy in a snapshot).
    pub(super) fn write_image(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
        sources: &[(Allocation, DevicePtr)],
        prepared: Option<Prepared<D>>,
    ) -> Result<CopyOutReport, FastPathError> {
        let start = Instant::now();
        // Bindings drop in reverse order: `registered` (unpinning) before `writer`
        // (unmapping the data file) on every path.
        let (mut writer, ids, registered, prepared_region) = match prepared {
            Some(p) => {
                let region = p.region();
                (p.writer, p.ids, Some(p.registered), Some(region))
            }
            None => {
                let (writer, ids) =
                    self.new_writer(image_dir, parent, sources.iter().map(|(a, _)| a))?;
                (writer, ids, None, None)
            }
        };
        let staged_at = start.elapsed().as_secs_f64();
        let chunk_bytes = writer.chunk_size() as u64;
        let t = Instant::now();
        let (todo, hashed) = self.resolve_chunks(&mut writer, sources, &ids)?;
        let hash_seconds = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let region = match prepared_region {
            Some(r) => Some(r),
            None => self.direct_region(&mut writer)?,
        };
        let direct_seconds = t.elapsed().as_secs_f64();
        let (copied, windows, mut profile) = std::thread::scope(|scope| {
            self.copy_chunks_out(scope, &mut writer, &todo, region, registered.as_ref())
        })?;
        profile.device_hash = hash_seconds;
        profile.setup = staged_at + direct_seconds;
        let bytes = sources.iter().map(|(a, _)| a.size).sum();
        let stats = writer.stats();
        let t = Instant::now();
        let prepared = registered.is_some();
        drop(registered);
        profile.unregister = t.elapsed().as_secs_f64();
        let t = Instant::now();
        writer.finish()?;
        profile.finish = t.elapsed().as_secs_f64();
        *self.last_image.lock().unwrap_or_else(|p| p.into_inner()) = Some(image_dir.to_path_buf());
        let report = CopyOutReport {
            allocations: sources.len(),
            bytes,
            peak_staging_bytes: stats.peak_in_flight as u64 * chunk_bytes,
            seconds: start.elapsed().as_secs_f64(),
            profile,
            copied_bytes: copied,
            zero_chunks: stats.resolved_zero,
            parent_chunks: stats.resolved_parent,
        };
        tracing::info!(
            ?report,
            dir = %image_dir.display(),
            device_hash = hashed,
            pinned = stats.staging_pinned,
            direct = region.is_some(),
            prepared,
            direct_windows = windows,
            setup_seconds = staged_at,
            "device memory copied out"
        );
        Ok(report)
    }
}
