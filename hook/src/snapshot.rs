//! A snapshot of device memory on the device: every allocation copied device to device
//! (at device memory speed, far faster than any copy to the host) into one region of new
//! memory, so a leave-running checkpoint can let the workload run again before the image
//! is written.
//!
//! The region is exportable memory: across the driver's checkpoint it is released and
//! held by the shim as an fd (the driver moves none of it) while the allocations' own
//! memory is freed; reattached, it refills new memory for them device to device, and is
//! written into the image after the thaw, while the workload runs. It is not an
//! allocation of the application: it is never in the [`crate::alloc::AllocTable`], and it
//! is freed once written.

use std::os::fd::{BorrowedFd, OwnedFd};

use thiserror::Error;

use crate::alloc::{map_accessible, Allocation};
use crate::driver::{DevicePtr, PhysHandle, VmmDriver, VmmError};

/// Why no snapshot was taken (nothing changed: the caller copies out while frozen).
#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error(
        "not enough free device memory for a snapshot: {need} bytes needed, {free} free, \
         {headroom} kept free for the workload"
    )]
    NoRoom { need: u64, free: u64, headroom: u64 },
    #[error("no device memory to snapshot")]
    Empty,
    #[error(transparent)]
    Driver(#[from] VmmError),
}

/// One allocation's place in the snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The allocation as it was when the snapshot was taken.
    pub alloc: Allocation,
    /// Where its copy starts in the snapshot region.
    pub offset: u64,
}

/// The snapshot region: a VA reservation, and its memory while mapped.
#[derive(Debug)]
pub struct Snapshot {
    va: DevicePtr,
    size: u64,
    /// `None` while released (the shim holds its fd) or after a restore elsewhere.
    handle: Option<PhysHandle>,
    parts: Vec<Part>,
}

impl Snapshot {
    /// Copies every allocation of `allocs` (mapped) into new memory, device to device.
    /// Refused when the copy would leave less than `headroom` bytes of the device free
    /// (the workload may allocate while the snapshot is written); the driver's answer is
    /// the last word when it cannot say how much is free.
    pub fn take<D: VmmDriver>(
        driver: &D,
        allocs: &[Allocation],
        headroom: u64,
    ) -> Result<Snapshot, SnapshotError> {
        let mut parts = Vec::with_capacity(allocs.len());
        let mut size = 0;
        for a in allocs {
            parts.push(Part {
                alloc: a.clone(),
                offset: size,
            });
            size += a.mapped_size;
        }
        if size == 0 {
            return Err(SnapshotError::Empty);
        }
        if let Some(free) = driver.free_memory()? {
            if free < size.saturating_add(headroom) {
                return Err(SnapshotError::NoRoom {
                    need: size,
                    free,
                    headroom,
                });
            }
        }
        let va = driver.reserve(size, None)?;
        let mut snap = Snapshot {
            va,
            size,
            handle: None,
            parts,
        };
        if let Err(e) = snap.fill(driver) {
            snap.free(driver);
            return Err(e.into());
        }
        Ok(snap)
    }

    fn fill<D: VmmDriver>(&mut self, driver: &D) -> Result<(), VmmError> {
        self.map(driver, driver.create(self.size)?)?;
        for p in &self.parts {
            driver.copy_device(self.va + p.offset, p.alloc.va, p.alloc.size)?;
        }
        Ok(())
    }

    /// Maps `handle` accessible over the region; on failure `handle` is released.
    fn map<D: VmmDriver>(&mut self, driver: &D, handle: PhysHandle) -> Result<(), VmmError> {
        map_accessible(driver, self.va, self.size, handle)?;
        self.handle = Some(handle);
        Ok(())
    }

    /// The region's address: it names the snapshot's fd among the kept memory.
    pub fn va(&self) -> DevicePtr {
        self.va
    }

    /// Bytes of device memory the snapshot holds (the allocations, granularity-rounded).
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn is_mapped(&self) -> bool {
        self.handle.is_some()
    }

    /// The allocations as they were, each with the address its copy is at now.
    pub fn sources(&self) -> Vec<(Allocation, DevicePtr)> {
        self.parts
            .iter()
            .map(|p| (p.alloc.clone(), self.va + p.offset))
            .collect()
    }

    /// The region's memory as an fd (`None`: released, or the driver cannot export).
    pub fn export<D: VmmDriver>(&self, driver: &D) -> Result<Option<OwnedFd>, VmmError> {
        match self.handle {
            Some(h) => driver.export(h),
            None => Ok(None),
        }
    }

    /// Unmaps and releases the region's memory; the VA stays reserved. Whoever holds
    /// its exported fd keeps the contents.
    pub fn release<D: VmmDriver>(&mut self, driver: &D) -> Result<(), VmmError> {
        if let Some(h) = self.handle {
            driver.unmap(self.va, self.size)?;
            self.handle = None;
            driver.release(h)?;
        }
        Ok(())
    }

    /// Maps the memory of `fd` (exported before the release) over the region again.
    pub fn reattach<D: VmmDriver>(
        &mut self,
        driver: &D,
        fd: BorrowedFd<'_>,
    ) -> Result<(), VmmError> {
        if self.handle.is_some() {
            return Ok(());
        }
        let h = driver.import(fd)?;
        self.map(driver, h)
    }

    /// Frees the memory (when mapped) and the VA range. Best effort: failures are logged.
    pub fn free<D: VmmDriver>(mut self, driver: &D) {
        if let Err(e) = self.release(driver) {
            tracing::warn!(va = self.va, error = %e, "releasing the snapshot's memory");
        }
        if let Err(e) = driver.free_va(self.va, self.size) {
            tracing::warn!(va = self.va, error = %e, "freeing the snapshot's address range");
        }
    }
}
