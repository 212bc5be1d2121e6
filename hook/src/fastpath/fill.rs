//! Image → device: copy-in, warm and the fill engine that release-undo and refill reuse.

use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use gpu_state::image::gpuhash::{self, ChunkDigest};
use gpu_state::image::{AllocId, ImageError, ImageReader, Location, MappedImage, StagingPool};

use super::dma::{plan_windows, InFlight, Windows};
use super::helpers::Shared;
use super::options::MapReads;
use super::{lock, FastPath, FastPathError};
use crate::alloc::{AllocState, Allocation};
use crate::driver::{DevicePtr, VmmDriver, VmmError};
use crate::protocol::{CopyInReport, CopyProfile, WarmReport};

/// One chunk a copy-out moves: allocation `id` at device address `va`, `len` bytes
/// from `offset`.
pub(super) struct ChunkTodo {
    pub(super) id: AllocId,
    pub(super) va: DevicePtr,
    pub(super) offset: u64,
    pub(super) len: u64,
}

/// Why the direct copy-in stopped.
pub(super) enum DirectInError {
    Driver(VmmError),
    /// A chunk failed its check.
    Corrupt(ImageError),
}

impl From<VmmError> for DirectInError {
    fn from(e: VmmError) -> Self {
        DirectInError::Driver(e)
    }
}

impl<D: VmmDriver + 'static> FastPath<D> {
    /// Fills every allocation from the image at `image_dir`, which must hold exactly
    /// the tracked allocations.
    pub fn copy_in(&self, image_dir: &Path) -> Result<CopyInReport, FastPathError> {
        let start = Instant::now();
        let allocs = self.movable()?;
        let mut reader = ImageReader::open(image_dir)?;
        let plan = self.match_image(&reader, &allocs, true)?;
        // Chunks hashed on the GPU at copy-out are checked there after the copy (one
        // kernel pass), not by the CPU reading every byte on the way in.
        let device_check = self.opts.device_hash
            && reader.has_gpu_hashes()
            && matches!(
                self.driver()
                    .chunk_sums(&[], reader.manifest().chunk_size.max(8)),
                Ok(Some(_))
            );
        if device_check {
            reader.defer_gpu_hashed_checks();
        }
        let direct = self.fill_direct(&reader, &allocs, &plan)?;
        // Only the staged readers read through the map.
        let mut mapped_reads = false;
        let mut helpers = Vec::new();
        let (bytes, staging_bytes, mut profile) = match direct {
            Some(done) => done,
            None => {
                mapped_reads = self.map_for_reads(&mut reader);
                let (work, targets) = Self::chunk_work(&reader, &allocs, &plan);
                // Helpers only take chunks the GPU check below covers.
                let shared = if device_check {
                    self.hand_out(&reader, &allocs, &work)
                } else {
                    self.let_helpers_go();
                    Shared::default()
                };
                let mine: Vec<usize> = (0..work.len())
                    .filter(|i| shared.taken.get(*i) != Some(&true))
                    .collect();
                let staged = self.fill(&reader, &work, &targets, &mine, start);
                // Waited for also when the staging failed: they DMA into our memory.
                let (reports, failed, reapers) = shared.wait();
                lock(&self.reapers).extend(reapers);
                helpers = reports;
                let (staging_bytes, profile) = staged?;
                if !failed.is_empty() {
                    tracing::warn!(
                        chunks = failed.len(),
                        "a copy-in helper failed; staging its share"
                    );
                    self.fill(&reader, &work, &targets, &failed, Instant::now())?;
                }
                let bytes = allocs.iter().map(|a| a.size).sum();
                (bytes, staging_bytes, profile)
            }
        };
        if device_check {
            let t = Instant::now();
            self.check_on_device(&reader, &allocs, &plan)?;
            profile.device_hash = t.elapsed().as_secs_f64();
        }
        let report = CopyInReport {
            allocations: allocs.len(),
            bytes,
            staging_bytes,
            seconds: start.elapsed().as_secs_f64(),
            profile,
            mapped_reads,
            helpers,
        };
        tracing::info!(?report, dir = %image_dir.display(), "device memory copied in");
        Ok(report)
    }

    /// Starts the copy-in helpers (Warm): they make their CUDA contexts while the
    /// driver restores this process. None without `copy_in_helpers` and a helper path,
    /// or when they cannot start (the copy-in then stages everything). With the image
    /// the copy-in will read, each helper also gets its job now and pins its share of
    /// the image ahead of the copy-in (see [`crate::helper`]). Makes no CUDA call: the
    /// driver may hold this process checkpointed.
    pub fn warm(&self, image_dir: Option<&Path>) -> Result<WarmReport, FastPathError> {
        let mut slot = lock(&self.helpers);
        if slot.is_none() {
            *slot = self.spawn_helpers();
        }
        let Some(helpers) = slot.as_mut() else {
            return Ok(WarmReport::default());
        };
        // A second Warm changes nothing: the same helpers, the same jobs.
        let sent: u64 = helpers
            .list_mut()
            .iter()
            .filter_map(|h| h.ahead.as_ref().map(|a| a.job.bytes))
            .sum();
        let ahead_bytes = match image_dir {
            Some(dir) if sent == 0 => self.send_ahead(helpers, dir).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "copy-in helpers get their jobs at the copy-in");
                0
            }),
            _ => sent,
        };
        Ok(WarmReport {
            helpers: helpers.len(),
            ahead_bytes,
        })
    }

    /// Maps the image's data files for the staged readers as `map_reads` says; whether
    /// they are mapped (a failure is logged, and the readers use `read(2)`).
    pub(super) fn map_for_reads(&self, reader: &mut ImageReader) -> bool {
        self.opts.map_reads != MapReads::Off
            && reader
                .map_data_files(self.opts.map_reads == MapReads::HugePages)
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "cannot map the image; copy-in reads it with read(2)");
                    false
                })
    }

    /// After a copy-in with deferred checks: hashes the allocations on the GPU and
    /// compares every chunk that has a gh1 digest (and every zero chunk) with the image.
    pub(super) fn check_on_device(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        plan: &[AllocId],
    ) -> Result<(), FastPathError> {
        let chunk = reader.manifest().chunk_size;
        let pairs: Vec<_> = allocs
            .iter()
            .zip(plan)
            .filter(|(a, _)| gpuhash::hashable(a.size) && gpuhash::hashable(chunk))
            .collect();
        let regions: Vec<_> = pairs.iter().map(|(a, _)| (a.va, a.size)).collect();
        let sums = self
            .driver()
            .chunk_sums(&regions, chunk)?
            .ok_or(FastPathError::DeviceCheckUnavailable)?;
        for ((alloc, id), sums) in pairs.into_iter().zip(sums) {
            let chunks = &reader.allocations()[id.0].chunks;
            if sums.len() != chunks.len() {
                return Err(FastPathError::DeviceCheckUnavailable);
            }
            for (c, s) in chunks.iter().zip(sums) {
                let expected = match (c.at, c.gpu_hash) {
                    (Location::Zero, _) => ChunkDigest::Zero,
                    (_, Some(h)) => ChunkDigest::Hash(h),
                    // CRC-checked on the CPU on the way in.
                    (_, None) => continue,
                };
                if s.digest(c.len) != expected {
                    return Err(FastPathError::DeviceCheck {
                        va: alloc.va,
                        offset: c.offset,
                        image: reader.dir().to_path_buf(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Every chunk of `allocs` as (image allocation, chunk index), and its device address.
    pub(super) fn chunk_work(
        reader: &ImageReader,
        allocs: &[Allocation],
        plan: &[AllocId],
    ) -> (Vec<(AllocId, usize)>, Vec<DevicePtr>) {
        let chunk = reader.manifest().chunk_size as usize;
        let mut work = Vec::new();
        let mut targets = Vec::new();
        for (alloc, id) in allocs.iter().zip(plan) {
            for index in 0..reader.allocations()[id.0].chunks.len() {
                work.push((*id, index));
                targets.push(alloc.va + (index * chunk) as u64);
            }
        }
        (work, targets)
    }

    /// The direct copy-in (`direct`, image on tmpfs, raw chunks): the image's data files
    /// mapped read-only, verifier threads check each chunk's CRC where it lies while the
    /// control thread DMAs the verified chunks straight from the mapping (registered
    /// read-only in windows, in file order) on the copy streams; zero chunks come from
    /// one zeroed pinned buffer. `None` when not used or a registration failed (then
    /// nothing is registered or in flight, and the staged path runs). Returns the bytes
    /// copied, the bytes of host buffers used and where the control thread waited.
    pub(super) fn fill_direct(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        plan: &[AllocId],
    ) -> Result<Option<(u64, u64, CopyProfile)>, FastPathError> {
        if !self.opts.direct {
            return Ok(None);
        }
        if !self.opts.pin {
            tracing::info!("direct copy-in not used: pinning is off");
            return Ok(None);
        }
        if let Some(why) = reader.direct_refusal() {
            tracing::info!(reason = %why, "direct copy-in not used");
            return Ok(None);
        }
        let (work, targets) = Self::chunk_work(reader, allocs, plan);
        let bytes = allocs.iter().map(|a| a.size).sum();
        if work.is_empty() {
            return Ok(Some((bytes, 0, CopyProfile::default())));
        }
        let mapped = reader.map_chunks(&work)?;
        // Zero chunks first, then file by file in offset order, so windows only move on.
        let mut order: Vec<usize> = (0..work.len()).collect();
        order.sort_by_key(|&i| mapped.chunk(i).at.map_or((0, 0), |(m, o)| (m + 1, o)));
        let chunk = reader.manifest().chunk_size as usize;
        let zeros = mapped.chunk(order[0]).at.is_none();
        let zero_pool = if zeros {
            Some(StagingPool::new(1, chunk, self.pin())?)
        } else {
            None
        };
        // Never written: the pool is zeroed.
        let mut zero_buf = zero_pool.as_ref().map(|p| p.acquire());
        let zero_ptr = zero_buf
            .as_mut()
            .map_or(std::ptr::null(), |b| b.as_mut_ptr().cast_const());

        // Verdicts by position in `order`, filled by the verifiers ahead of the copies.
        let verdicts: Mutex<Vec<Option<Result<(), ImageError>>>> =
            Mutex::new((0..order.len()).map(|_| None).collect());
        let ready = std::sync::Condvar::new();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let copied = std::thread::scope(|scope| {
            for _ in 0..self.opts.read_threads.clamp(1, order.len()) {
                scope.spawn(|| loop {
                    let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if k >= order.len() || stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    let verdict = mapped.verify(order[k]);
                    verdicts.lock().unwrap_or_else(|p| p.into_inner())[k] = Some(verdict);
                    ready.notify_all();
                });
            }
            let result = self.copy_mapped(scope, &mapped, &order, &targets, zero_ptr, |k| {
                let mut v = verdicts.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(verdict) = v[k].take() {
                        return verdict;
                    }
                    v = ready.wait(v).unwrap_or_else(|p| p.into_inner());
                }
            });
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            result
        });
        let profile = match copied {
            Ok(Some(profile)) => profile,
            Ok(None) => return Ok(None),
            Err(DirectInError::Driver(e)) => return Err(e.into()),
            Err(DirectInError::Corrupt(e)) => return Err(e.into()),
        };
        self.driver().synchronize()?;
        drop(zero_buf);
        tracing::debug!(chunks = order.len(), "direct copy-in");
        Ok(Some((bytes, if zeros { chunk as u64 } else { 0 }, profile)))
    }

    /// The control thread's part of [`fill_direct`](Self::fill_direct): for each chunk
    /// in `order`, waits for its verdict (`verified(k)`), moves the registered window
    /// along and issues its copy. `Ok(None)`: a registration failed, nothing is left
    /// registered or in flight; else where it waited.
    pub(super) fn copy_mapped<'s, 'd>(
        &'d self,
        scope: &'s std::thread::Scope<'s, 'd>,
        mapped: &MappedImage,
        order: &[usize],
        targets: &[DevicePtr],
        zero: *const u8,
        verified: impl Fn(usize) -> Result<(), ImageError>,
    ) -> Result<Option<CopyProfile>, DirectInError> {
        // Where each chunk lies (`None`: zero, or a file not mapped, which `verify`
        // refuses before any copy).
        let source = |i: usize| {
            let c = mapped.chunk(i);
            let (map, offset) = c.at?;
            let region = mapped.region(map)?;
            Some((region.base as usize + offset as usize, c.len, map))
        };
        let (list, of) = plan_windows(order.iter().map(|&i| source(i)), self.opts.direct_window);
        // Declared before `flight`: unregistered only after every copy is waited for.
        let mut windows = Windows::start(scope, self.driver(), list, true);
        let mut flight: InFlight<D, ()> = InFlight::new(self.driver(), self.opts.streams);
        let mut profile = CopyProfile::default();
        for (k, &i) in order.iter().enumerate() {
            let t = Instant::now();
            let verdict = verified(k);
            profile.verify_wait += t.elapsed().as_secs_f64();
            verdict.map_err(DirectInError::Corrupt)?;
            let c = mapped.chunk(i);
            let (mut target, mut len) = (targets[i], c.len);
            let src = match (c.at, source(i), of[k]) {
                (None, _, _) => zero,
                (Some(_), Some((addr, _, _)), Some((w, head))) => {
                    if windows.current() != Some(w) {
                        while flight.complete_oldest()?.is_some() {}
                        if let Err(e) = windows.enter(w) {
                            tracing::warn!(error = %e, "cannot register the mapped image; copy-in goes through staging");
                            return Ok(None);
                        }
                    }
                    if head > 0 {
                        // Less than a page, in the previous window's last page: a plain
                        // synchronous copy.
                        // SAFETY: inside the mapping, which nobody writes.
                        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, head) };
                        self.driver().copy_from_host(target, bytes)?;
                        target += head as u64;
                        len -= head;
                    }
                    (addr + head) as *const u8
                }
                _ => {
                    return Err(DirectInError::Corrupt(ImageError::Worker(format!(
                        "chunk {i} lies in no mapped file"
                    ))))
                }
            };
            if len == 0 {
                continue;
            }
            flight.start((), |_, stream| {
                // SAFETY: the mapping (or zero buffer) outlives `flight`, and nobody
                // writes it.
                unsafe { self.driver().copy_from_host_async(target, src, len, stream) }
            })?;
        }
        while flight.complete_oldest()?.is_some() {}
        profile.dma_wait = flight.waited.as_secs_f64();
        profile.register_wait = windows.waited.as_secs_f64();
        Ok(Some(profile))
    }

    /// Copies each allocation's image data in: reader threads fill a pinned staging
    /// pool (read, decompress, CRC) while filled buffers go to the device on up to
    /// `streams` copy streams. Returns the bytes copied, the pool's size and where the
    /// copying thread waited (`buffer_wait`: for the readers); `setup` is the time from
    /// `start` to the first read.
    pub(super) fn fill(
        &self,
        reader: &ImageReader,
        all_work: &[(AllocId, usize)],
        all_targets: &[DevicePtr],
        items: &[usize],
        start: Instant,
    ) -> Result<(u64, CopyProfile), FastPathError> {
        let chunk = reader.manifest().chunk_size as usize;
        let work: Vec<_> = items.iter().map(|&i| all_work[i]).collect();
        let targets: Vec<_> = items.iter().map(|&i| all_targets[i]).collect();
        if work.is_empty() {
            return Ok((0, CopyProfile::default()));
        }
        let count = (self.opts.copy_in_staging / chunk).max(2);
        let pool = StagingPool::new(count, chunk, self.pin())?;
        // The sink keeps at most `count - 1` buffers, so the readers always have one.
        let mut flight = InFlight::new(self.driver(), self.opts.streams.min(count - 1));
        let t = Instant::now();
        let setup = start.elapsed().as_secs_f64();
        let read = reader.read_chunks_staged(
            &work,
            &pool,
            self.opts.read_threads,
            |i, buf, len| -> Result<(), FastPathError> {
                flight.start(buf, |buf, stream| {
                    // SAFETY: the buffer stays in `flight`, unchanged, until its stream
                    // is waited for.
                    unsafe {
                        self.driver()
                            .copy_from_host_async(targets[i], buf.as_ptr(), len, stream)
                    }
                })?;
                Ok(())
            },
        );
        let reading = t.elapsed().as_secs_f64();
        let dma_while_reading = flight.waited.as_secs_f64();
        let mut drained = Ok(());
        while drained.is_ok() {
            match flight.complete_oldest() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => drained = Err(e),
            }
        }
        let profile = CopyProfile {
            dma_wait: flight.waited.as_secs_f64(),
            buffer_wait: (reading - dma_while_reading).max(0.0),
            setup,
            ..CopyProfile::default()
        };
        drop(flight);
        read?;
        drained?;
        self.driver().synchronize()?;
        tracing::debug!(
            pinned = pool.is_pinned(),
            buffers = count,
            "copy-in staging"
        );
        Ok(((count * chunk) as u64, profile))
    }

    /// The image allocation of each of `allocs`, checked before anything is copied;
    /// with `exact`, the image must not hold allocations this process does not track.
    pub(super) fn match_image(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        exact: bool,
    ) -> Result<Vec<AllocId>, FastPathError> {
        if let Some(alloc) = allocs.iter().find(|a| a.state != AllocState::Mapped) {
            return Err(FastPathError::NotMapped {
                va: alloc.va,
                state: alloc.state,
            });
        }
        self.plan_in_image(reader, allocs, exact)
    }

    /// The image allocation of each of `allocs` (by address, this process's, of the
    /// same size), whatever their state; with `exact`, as in [`Self::match_image`].
    pub(super) fn plan_in_image(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        exact: bool,
    ) -> Result<Vec<AllocId>, FastPathError> {
        let mut plan = Vec::with_capacity(allocs.len());
        for alloc in allocs {
            let id = reader
                .find(alloc.va, self.opts.pid)
                .ok_or(FastPathError::NotInImage { va: alloc.va })?;
            let image = reader.allocations()[id.0].size;
            if image != alloc.size {
                return Err(FastPathError::SizeMismatch {
                    va: alloc.va,
                    tracked: alloc.size,
                    image,
                });
            }
            plan.push(id);
        }
        let extra = reader
            .allocations()
            .iter()
            .find(|a| a.tags.pid == self.opts.pid && !allocs.iter().any(|t| t.va == a.va));
        if let (true, Some(extra)) = (exact, extra) {
            return Err(FastPathError::NotTracked { va: extra.va });
        }
        Ok(plan)
    }
}
