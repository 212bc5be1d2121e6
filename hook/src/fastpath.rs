//! The fast path: freeze → copy every tracked allocation out into a GPU state image →
//! release the physical memory (keeping the VA ranges); then remap (new physical
//! memory at the same VAs) → copy in from the image → thaw.
//!
//! Host memory stays bounded: copy-out fills the [`ImageWriter`]'s staging buffers
//! directly (`write_chunk_with`, at most `max_in_flight` of them), copy-in goes through
//! one buffer of the image's chunk size. Nothing holds a copy of all device memory.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_state::image::{
    AllocId, AllocationTags, ImageError, ImageOptions, ImageReader, ImageWriter,
};
use thiserror::Error;

use crate::alloc::{AllocError, AllocState, Allocation, Allocator, Unsupported};
use crate::control::Engine;
use crate::driver::{DevicePtr, DriverError, VmmDriver};
use crate::gate::{Gate, GateError};
use crate::protocol::{CheckpointState, CopyInReport, CopyOutReport, HookStatus, MemoryReport};

/// Fast path errors.
#[derive(Debug, Error)]
pub enum FastPathError {
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error("GPU state image: {0}")]
    Image(#[from] ImageError),
    #[error("{} allocation(s) the hook cannot move (first: {:?}); use the driver path", .0.len(), .0.first())]
    UnsupportedMemory(Vec<Unsupported>),
    #[error("allocation {va:#x} is not in the image")]
    NotInImage { va: DevicePtr },
    #[error("image allocation {va:#x} is not tracked by this process")]
    NotTracked { va: DevicePtr },
    #[error("allocation {va:#x} is {tracked} bytes here and {image} bytes in the image")]
    SizeMismatch {
        va: DevicePtr,
        tracked: u64,
        image: u64,
    },
    #[error("allocation {va:#x} is {state:?}; copies need it mapped")]
    NotMapped { va: DevicePtr, state: AllocState },
    #[error("release of {va:#x} failed ({source}); {undo}")]
    ReleaseFailed {
        va: DevicePtr,
        #[source]
        source: AllocError,
        /// What happened to the allocations released before it.
        undo: String,
    },
    #[error("no copy-out image to restore released memory from")]
    NoImage,
    #[error("{count} allocation(s) have no physical memory; Remap and CopyIn before Thaw")]
    ReleasedMemory { count: usize },
}

/// How the fast path runs.
#[derive(Debug, Clone)]
pub struct FastPathOptions {
    /// How images are written (chunk size, compression, threads, staging buffers).
    pub image: ImageOptions,
    /// How long a freeze waits for GPU work in flight.
    pub freeze_timeout: Duration,
    /// The `pid` tag of the image's allocations (this process's PID, which CRIU keeps).
    pub pid: Option<u32>,
}

impl Default for FastPathOptions {
    fn default() -> Self {
        FastPathOptions {
            image: ImageOptions::default(),
            freeze_timeout: Duration::from_secs(30),
            pid: Some(std::process::id()),
        }
    }
}

/// The fast path over one process's allocations and gate.
pub struct FastPath<D> {
    allocator: Arc<Allocator<D>>,
    gate: Arc<Gate>,
    opts: FastPathOptions,
    /// The last image copied out, to undo a release that failed half-way.
    last_image: Mutex<Option<PathBuf>>,
}

impl<D: VmmDriver> FastPath<D> {
    pub fn new(allocator: Arc<Allocator<D>>, gate: Arc<Gate>, opts: FastPathOptions) -> Self {
        FastPath {
            allocator,
            gate,
            opts,
            last_image: Mutex::new(None),
        }
    }

    fn driver(&self) -> &D {
        self.allocator.driver()
    }

    /// Tracked allocations, refusing if any memory cannot be moved.
    fn movable(&self) -> Result<Vec<Allocation>, FastPathError> {
        let table = self.allocator.table();
        if !table.unsupported().is_empty() {
            return Err(FastPathError::UnsupportedMemory(
                table.unsupported().to_vec(),
            ));
        }
        Ok(table.iter().cloned().collect())
    }

    fn tags(&self) -> AllocationTags {
        AllocationTags {
            pid: self.opts.pid,
            ..AllocationTags::default()
        }
    }

    /// Stops new GPU work, waits for the work in flight and synchronizes the device.
    pub fn freeze(&self) -> Result<(), FastPathError> {
        self.gate.freeze(self.opts.freeze_timeout)?;
        if let Err(e) = self.driver().synchronize() {
            self.gate.thaw()?;
            return Err(e.into());
        }
        Ok(())
    }

    /// Writes every allocation into a new image at `image_dir`.
    pub fn copy_out(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, FastPathError> {
        let start = Instant::now();
        let allocs = self.movable()?;
        let mut writer = ImageWriter::create(image_dir, parent, self.opts.image)?;
        let mut bytes = 0;
        for alloc in &allocs {
            if alloc.state != AllocState::Mapped {
                return Err(FastPathError::NotMapped {
                    va: alloc.va,
                    state: alloc.state,
                });
            }
            let id = writer.begin_allocation(alloc.va, alloc.size, self.tags())?;
            self.copy_allocation_out(&mut writer, id, alloc)?;
            bytes += alloc.size;
        }
        let stats = writer.stats();
        writer.finish()?;
        *self.last_image.lock().unwrap_or_else(|p| p.into_inner()) = Some(image_dir.to_path_buf());
        let report = CopyOutReport {
            allocations: allocs.len(),
            bytes,
            peak_staging_bytes: stats.peak_in_flight as u64 * self.opts.image.chunk_size as u64,
            seconds: start.elapsed().as_secs_f64(),
        };
        tracing::info!(?report, dir = %image_dir.display(), "device memory copied out");
        Ok(report)
    }

    fn copy_allocation_out(
        &self,
        writer: &mut ImageWriter,
        id: AllocId,
        alloc: &Allocation,
    ) -> Result<(), FastPathError> {
        let chunk = writer.chunk_size() as u64;
        let mut offset = 0;
        while offset < alloc.size {
            let mut driver_error = None;
            let written = writer.write_chunk_with(id, offset, |buf| {
                self.driver()
                    .copy_to_host(alloc.va + offset, buf)
                    .map_err(|e| {
                        driver_error = Some(e.clone());
                        std::io::Error::other(e)
                    })
            });
            if let Some(e) = driver_error {
                return Err(e.into());
            }
            written?;
            offset += chunk;
        }
        Ok(())
    }

    /// Releases the physical memory of every mapped allocation; the VA ranges stay.
    /// All or nothing: when one fails, the ones released before it are re-mapped and
    /// refilled from the last copy-out image.
    pub fn release(&self) -> Result<MemoryReport, FastPathError> {
        let mut report = MemoryReport {
            allocations: 0,
            bytes: 0,
        };
        let mut released = Vec::new();
        for alloc in self
            .movable()?
            .into_iter()
            .filter(|a| a.state == AllocState::Mapped)
        {
            if let Err(source) = self.allocator.release(alloc.va) {
                // Unmapped but not released still counts: its memory is gone.
                if self.allocator.get(alloc.va).map(|a| a.state) == Some(AllocState::Released) {
                    released.push(alloc.clone());
                }
                let undo = match self.undo_release(&released) {
                    Ok(()) => format!("{} released allocation(s) restored", released.len()),
                    Err(e) => format!("restoring the released allocations failed: {e}"),
                };
                return Err(FastPathError::ReleaseFailed {
                    va: alloc.va,
                    source,
                    undo,
                });
            }
            report.allocations += 1;
            report.bytes += alloc.mapped_size;
            released.push(alloc);
        }
        Ok(report)
    }

    /// Re-maps `released` and refills them from the last copy-out image.
    fn undo_release(&self, released: &[Allocation]) -> Result<(), FastPathError> {
        if released.is_empty() {
            return Ok(());
        }
        let dir = self
            .last_image
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(FastPathError::NoImage)?;
        let reader = ImageReader::open(&dir)?;
        for alloc in released {
            self.allocator.remap(alloc.va)?;
        }
        let now: Vec<Allocation> = released
            .iter()
            .filter_map(|a| self.allocator.get(a.va))
            .collect();
        let plan = self.match_image(&reader, &now, false)?;
        self.fill(&reader, &now, &plan)?;
        Ok(())
    }

    /// Creates physical memory again at the VA of every released allocation.
    pub fn remap(&self) -> Result<MemoryReport, FastPathError> {
        self.for_each_in(AllocState::Released, |va| self.allocator.remap(va))
    }

    fn for_each_in(
        &self,
        state: AllocState,
        op: impl Fn(DevicePtr) -> Result<(), AllocError>,
    ) -> Result<MemoryReport, FastPathError> {
        let mut report = MemoryReport {
            allocations: 0,
            bytes: 0,
        };
        for alloc in self.movable()?.iter().filter(|a| a.state == state) {
            op(alloc.va)?;
            report.allocations += 1;
            report.bytes += alloc.mapped_size;
        }
        Ok(report)
    }

    /// Fills every allocation from the image at `image_dir`, which must hold exactly
    /// the tracked allocations.
    pub fn copy_in(&self, image_dir: &Path) -> Result<CopyInReport, FastPathError> {
        let start = Instant::now();
        let allocs = self.movable()?;
        let reader = ImageReader::open(image_dir)?;
        let plan = self.match_image(&reader, &allocs, true)?;
        let (bytes, staging_bytes) = self.fill(&reader, &allocs, &plan)?;
        let report = CopyInReport {
            allocations: allocs.len(),
            bytes,
            staging_bytes,
            seconds: start.elapsed().as_secs_f64(),
        };
        tracing::info!(?report, dir = %image_dir.display(), "device memory copied in");
        Ok(report)
    }

    /// Copies each allocation's image data in through one chunk-sized staging buffer;
    /// returns the bytes copied and the staging buffer's size.
    fn fill(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        plan: &[AllocId],
    ) -> Result<(u64, u64), FastPathError> {
        let chunk = reader.manifest().chunk_size;
        let mut staging = vec![0u8; chunk as usize];
        let mut bytes = 0;
        for (alloc, id) in allocs.iter().zip(plan) {
            let chunks = reader.allocations()[id.0].chunks.len();
            for index in 0..chunks {
                let len = reader.read_chunk_into(*id, index, &mut staging)?;
                self.driver()
                    .copy_from_host(alloc.va + index as u64 * chunk, &staging[..len])?;
            }
            bytes += alloc.size;
        }
        self.driver().synchronize()?;
        Ok((bytes, staging.len() as u64))
    }

    /// The image allocation of each of `allocs`, checked before anything is copied;
    /// with `exact`, the image must not hold allocations this process does not track.
    fn match_image(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        exact: bool,
    ) -> Result<Vec<AllocId>, FastPathError> {
        let mut plan = Vec::with_capacity(allocs.len());
        for alloc in allocs {
            if alloc.state != AllocState::Mapped {
                return Err(FastPathError::NotMapped {
                    va: alloc.va,
                    state: alloc.state,
                });
            }
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

    /// Lets GPU work go on; refused while any allocation has no physical memory.
    pub fn thaw(&self) -> Result<(), FastPathError> {
        let count = self
            .allocator
            .table()
            .iter()
            .filter(|a| a.state == AllocState::Released)
            .count();
        if count > 0 {
            return Err(FastPathError::ReleasedMemory { count });
        }
        Ok(self.gate.thaw()?)
    }
}

impl<D: VmmDriver> Engine for FastPath<D> {
    type Error = FastPathError;

    fn freeze(&self) -> Result<(), FastPathError> {
        FastPath::freeze(self)
    }
    fn copy_out(&self, dir: &Path, parent: Option<&Path>) -> Result<CopyOutReport, FastPathError> {
        let result = FastPath::copy_out(self, dir, parent);
        self.driver().end_copies();
        result
    }
    fn release(&self) -> Result<MemoryReport, FastPathError> {
        // A failed release refills memory from the image.
        let result = FastPath::release(self);
        self.driver().end_copies();
        result
    }
    fn remap(&self) -> Result<MemoryReport, FastPathError> {
        FastPath::remap(self)
    }
    fn copy_in(&self, dir: &Path) -> Result<CopyInReport, FastPathError> {
        let result = FastPath::copy_in(self, dir);
        self.driver().end_copies();
        result
    }
    fn thaw(&self) -> Result<(), FastPathError> {
        FastPath::thaw(self)
    }
    fn status(&self, state: CheckpointState) -> HookStatus {
        let table = self.allocator.table();
        HookStatus {
            pid: std::process::id(),
            state,
            gate: self.gate.state(),
            allocations: table.len(),
            bytes: table.total_bytes(),
            released: table
                .iter()
                .filter(|a| a.state == AllocState::Released)
                .count(),
            unsupported: table.unsupported().to_vec(),
        }
    }
}

#[cfg(test)]
#[path = "fastpath_tests.rs"]
mod tests;
