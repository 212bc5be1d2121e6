//! The fast path: freeze → copy every tracked allocation out into a GPU state image →
//! release the physical memory (keeping the VA ranges); then remap (new physical
//! memory at the same VAs) → copy in from the image → thaw.
//!
//! Copies are pipelined (see "Copy path" in the README): copy-out DMAs device memory
//! straight into the [`ImageWriter`]'s staging buffers (pinned once per image through
//! [`VmmDriver::register_host`]) on `streams` copy streams, while the writer's workers
//! hash and store the chunks already copied; copy-in has reader threads fill a pinned
//! [`StagingPool`] (read, decompress, CRC) while the filled buffers go to the device on
//! the copy streams. Host memory stays bounded by the two pools; nothing holds a copy
//! of all device memory, and no DMA outlives its buffer ([`InFlight`]).
//!
//! Cut by mechanism, one layer below the verbs (release-undo and refill reuse the fill
//! engine, so a cut by verb would import in a circle): `options` (the `GPUCR_HOOK_*`
//! variables), `dma` (pinning, copies in flight, direct windows, fd room), `copy_out`
//! (device → image), `fill` (image → device), `memory` (release, keep, reattach, remap,
//! snapshot) and `helpers` (copy-in helpers). This file holds [`FastPath`], freeze and
//! thaw, and the [`Engine`] impl. The tests in `tests/` follow the same seams.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpu_state::image::{AllocationTags, ImageError, StagingPin};
use thiserror::Error;

use crate::alloc::{AllocError, AllocState, Allocation, Allocator, Unsupported};
use crate::control::Engine;
use crate::driver::{DevicePtr, VmmDriver, VmmError};
use crate::gate::{Gate, GateError};
use crate::helper::{AheadJob, Helpers};
use crate::prepared::Prepared;
use crate::protocol::{
    CheckpointState, CopyInReport, CopyOutReport, HookStatus, MemoryReport, PrepareReport,
    SnapshotReport, WarmReport,
};
use crate::snapshot::{Snapshot, SnapshotError};

mod copy_out;
mod dma;
mod fill;
mod helpers;
mod memory;
mod options;

use dma::DriverPin;
pub use dma::FdRoomError;
pub use memory::KeepError;
pub use options::*;

/// Fast path errors.
#[derive(Debug, Error)]
pub enum FastPathError {
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error(transparent)]
    Driver(#[from] VmmError),
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
    #[error("after the copy-in, allocation {va:#x} at offset {offset:#x} does not match the gh1 digest in {}: the image or the copy is damaged; restore from another checkpoint", image.display())]
    DeviceCheck {
        va: DevicePtr,
        offset: u64,
        image: PathBuf,
    },
    #[error("Reattach: {0}; Remap and CopyIn instead")]
    NotKept(String),
    #[error("no snapshot: {0}")]
    NoSnapshot(&'static str),
    #[error("device memory cannot be kept on the GPU")]
    NotKeepable(#[source] KeepError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error("copy-out not prepared: {0}; the CopyOut copies through staging buffers")]
    NotPrepared(String),
    #[error("the GPU check of the copied-in memory could not run (the hash kernel failed after the copy-in had begun); treat the restored memory as unchecked")]
    DeviceCheckUnavailable,
}

/// The fast path over one process's allocations and gate.
pub struct FastPath<D: VmmDriver> {
    allocator: Arc<Allocator<D>>,
    gate: Arc<Gate>,
    opts: FastPathOptions,
    /// The last image copied out, to undo a release that failed half-way.
    last_image: Mutex<Option<PathBuf>>,
    /// Memory exported by the last Release with `keep`: each address and its fd's
    /// identity, so Reattach maps back exactly that memory.
    kept: Mutex<BTreeMap<DevicePtr, Option<(u64, u64)>>>,
    /// The snapshot of a Snapshot verb, until written or dropped.
    snapshot: Mutex<Option<Snapshot>>,
    /// A CopyOut readied by Prepare, until that CopyOut or another verb.
    prepared: Mutex<Option<Prepared<D>>>,
    /// Copy-in helpers started by Warm, until the copy-in (or Thaw) lets them go.
    helpers: Mutex<Option<Helpers>>,
    /// Threads reaping helpers that were let go; joined at the next freeze, so no
    /// helper is left when anything dumps this process.
    reapers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl<D: VmmDriver + 'static> FastPath<D> {
    pub fn new(allocator: Arc<Allocator<D>>, gate: Arc<Gate>, opts: FastPathOptions) -> Self {
        FastPath {
            allocator,
            gate,
            opts,
            last_image: Mutex::new(None),
            kept: Mutex::new(BTreeMap::new()),
            snapshot: Mutex::new(None),
            prepared: Mutex::new(None),
            helpers: Mutex::new(None),
            reapers: Mutex::new(Vec::new()),
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

    /// What pins staging pools, unless pinning is off.
    fn pin(&self) -> Option<Arc<dyn StagingPin>> {
        let pin = DriverPin(self.allocator.driver().clone());
        self.opts.pin.then(|| Arc::new(pin) as Arc<dyn StagingPin>)
    }

    fn tags(&self) -> AllocationTags {
        AllocationTags {
            pid: self.opts.pid,
            ..AllocationTags::default()
        }
    }

    /// Stops new GPU work, waits for the work in flight and synchronizes the device.
    pub fn freeze(&self) -> Result<(), FastPathError> {
        self.let_helpers_go();
        for reaper in std::mem::take(&mut *lock(&self.reapers)) {
            let _ = reaper.join();
        }
        self.gate.freeze(self.opts.freeze_timeout)?;
        if let Err(e) = self.driver().synchronize() {
            self.gate.thaw()?;
            return Err(e.into());
        }
        Ok(())
    }

    /// Lets GPU work go on; refused while any allocation has no physical memory.
    pub fn thaw(&self) -> Result<(), FastPathError> {
        self.let_helpers_go();
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

/// Locks, also after a panic elsewhere (the data stays usable).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<D: VmmDriver + 'static> Engine for FastPath<D> {
    type Error = FastPathError;

    fn freeze(&self) -> Result<(), FastPathError> {
        FastPath::freeze(self)
    }
    fn copy_out(&self, dir: &Path, parent: Option<&Path>) -> Result<CopyOutReport, FastPathError> {
        let result = FastPath::copy_out(self, dir, parent);
        self.driver().end_copies();
        result
    }
    fn release(&self, keep: bool) -> Result<(MemoryReport, Vec<OwnedFd>), FastPathError> {
        // A failed release refills memory from the image.
        let result = FastPath::release(self, keep);
        self.driver().end_copies();
        result
    }
    fn remap(&self) -> Result<MemoryReport, FastPathError> {
        FastPath::remap(self)
    }
    fn reattach(
        &self,
        held: &[DevicePtr],
        fds: Vec<OwnedFd>,
    ) -> Result<MemoryReport, FastPathError> {
        FastPath::reattach(self, held, fds)
    }
    fn copy_in(&self, dir: &Path) -> Result<CopyInReport, FastPathError> {
        let result = FastPath::copy_in(self, dir);
        self.driver().end_copies();
        result
    }
    // A prepared CopyOut is for the CopyOut that follows the Freeze; anything else
    // drops it (its mapping of a host file must not reach CRIU's dump).
    fn thaw(&self) -> Result<(), FastPathError> {
        self.drop_prepared();
        FastPath::thaw(self)
    }
    fn snapshot(&self) -> Result<(SnapshotReport, Vec<OwnedFd>), FastPathError> {
        self.drop_prepared();
        FastPath::snapshot(self)
    }
    fn write_snapshot(
        &self,
        dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, FastPathError> {
        let result = FastPath::write_snapshot(self, dir, parent);
        self.driver().end_copies();
        result
    }
    fn drop_snapshot(&self) -> Result<(), FastPathError> {
        FastPath::drop_snapshot(self);
        Ok(())
    }
    fn prepare(&self, dir: &Path, parent: Option<&Path>) -> Result<PrepareReport, FastPathError> {
        FastPath::prepare(self, dir, parent)
    }
    fn prepared(&self) -> bool {
        self.is_prepared()
    }
    fn warm(&self, image_dir: Option<&Path>) -> Result<WarmReport, FastPathError> {
        FastPath::warm(self, image_dir)
    }
    fn adopt_helpers(
        &self,
        jobs: Vec<AheadJob>,
        socks: Vec<OwnedFd>,
    ) -> Result<WarmReport, FastPathError> {
        FastPath::adopt_helpers(self, jobs, socks)
    }

    fn drop_prepared(&self) {
        FastPath::drop_prepared(self)
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
            snapshot_bytes: self
                .snapshot
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map_or(0, Snapshot::size),
            unsupported: table.unsupported().to_vec(),
        }
    }
}

#[cfg(test)]
mod tests;
