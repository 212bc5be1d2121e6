//! Allocation tracking and VA bookkeeping: every device allocation made through the hook
//! is a VMM reservation (reserve VA + create physical + map + set access), recorded in
//! an [`AllocTable`] so it can be released and re-mapped at the same address.
//!
//! The table is pure bookkeeping; [`Allocator`] pairs it with a [`VmmDriver`] and keeps
//! the two consistent (a failed driver call undoes the calls before it). What the hook
//! cannot move (managed memory, IPC handles) is recorded as [`Unsupported`] entries.

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::driver::{round_up, DevicePtr, PhysHandle, VmmDriver, VmmError};

/// Row alignment of pitch allocations (what `cuMemAllocPitch` returns on current GPUs).
pub const PITCH_ALIGN: u64 = 512;

/// Whether an allocation has physical memory behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllocState {
    /// Physical memory mapped and accessible.
    Mapped,
    /// Physical memory released; the VA range is still reserved.
    Released,
}

/// How the application asked for the allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllocKind {
    /// `cuMemAlloc`.
    Linear,
    /// `cuMemAllocPitch`: `height` rows of `pitch` bytes.
    Pitch { pitch: u64, height: u64 },
}

/// One tracked allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub va: DevicePtr,
    /// Bytes the application asked for (what is copied out and in).
    pub size: u64,
    /// `size` rounded up to the granularity: what is reserved, created and mapped.
    pub mapped_size: u64,
    /// The physical memory; `None` while released.
    pub handle: Option<PhysHandle>,
    pub state: AllocState,
    pub kind: AllocKind,
}

impl Allocation {
    /// Whether `addr` lies inside the allocation (interior pointers included).
    pub fn contains(&self, addr: DevicePtr) -> bool {
        addr >= self.va && addr - self.va < self.size.max(1)
    }
}

/// Memory the hook cannot release and re-map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UnsupportedKind {
    /// `cuMemAllocManaged` (unified memory).
    Managed,
    /// Memory exported with `cuIpcGetMemHandle` or opened with `cuIpcOpenMemHandle`.
    IpcHandle,
    /// A stream-ordered allocation from a pool the hook does not back.
    PoolAllocation,
}

/// An entry of the hook's "cannot handle" report: the shim uses the driver path for a
/// process that has any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unsupported {
    pub kind: UnsupportedKind,
    pub va: DevicePtr,
    pub size: u64,
}

/// Allocation errors.
#[derive(Debug, Error)]
pub enum AllocError {
    #[error("allocation of {size} bytes is empty or too large")]
    BadSize { size: u64 },
    #[error("pitch allocation {width}×{height} with element size {element} is invalid")]
    BadPitch {
        width: u64,
        height: u64,
        element: u32,
    },
    #[error("no allocation starts at {va:#x}")]
    NotFound { va: DevicePtr },
    #[error("allocation at {va:#x} is {state:?}, expected {expected:?}")]
    WrongState {
        va: DevicePtr,
        state: AllocState,
        expected: AllocState,
    },
    #[error(transparent)]
    Driver(#[from] VmmError),
}

/// The table of tracked allocations, keyed by start address.
#[derive(Debug, Default)]
pub struct AllocTable {
    entries: BTreeMap<DevicePtr, Allocation>,
    unsupported: Vec<Unsupported>,
}

impl AllocTable {
    /// Records an allocation.
    pub fn insert(&mut self, alloc: Allocation) {
        self.entries.insert(alloc.va, alloc);
    }

    /// Removes the allocation starting at `va`.
    pub fn remove(&mut self, va: DevicePtr) -> Option<Allocation> {
        self.entries.remove(&va)
    }

    /// The allocation starting at `va`.
    pub fn get(&self, va: DevicePtr) -> Option<&Allocation> {
        self.entries.get(&va)
    }

    fn get_mut(&mut self, va: DevicePtr) -> Option<&mut Allocation> {
        self.entries.get_mut(&va)
    }

    /// The allocation holding `addr`, also for an interior pointer.
    pub fn find(&self, addr: DevicePtr) -> Option<&Allocation> {
        self.entries
            .range(..=addr)
            .next_back()
            .map(|(_, a)| a)
            .filter(|a| a.contains(addr))
    }

    /// All allocations, by address.
    pub fn iter(&self) -> impl Iterator<Item = &Allocation> {
        self.entries.values()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sum of the application-visible sizes.
    pub fn total_bytes(&self) -> u64 {
        self.entries.values().map(|a| a.size).sum()
    }

    /// Records memory the hook cannot handle.
    pub fn record_unsupported(&mut self, entry: Unsupported) {
        self.unsupported.push(entry);
    }

    /// Forgets an unsupported entry (e.g. managed memory freed again).
    pub fn forget_unsupported(&mut self, va: DevicePtr) {
        self.unsupported.retain(|u| u.va != va);
    }

    /// Everything the hook cannot handle, in the order it was seen.
    pub fn unsupported(&self) -> &[Unsupported] {
        &self.unsupported
    }
}

/// Makes, frees, releases and re-maps allocations through a driver, keeping the table
/// consistent with it. One mutex guards the table; it is held across driver calls so a
/// free cannot race a release of the same allocation.
pub struct Allocator<D> {
    driver: Arc<D>,
    granularity: u64,
    table: Mutex<AllocTable>,
}

impl<D: VmmDriver> Allocator<D> {
    /// An allocator using the driver's granularity.
    pub fn new(driver: Arc<D>) -> Result<Allocator<D>, AllocError> {
        let granularity = driver.granularity()?;
        Ok(Allocator {
            driver,
            granularity,
            table: Mutex::new(AllocTable::default()),
        })
    }

    pub fn driver(&self) -> &Arc<D> {
        &self.driver
    }

    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// The table, locked.
    pub fn table(&self) -> MutexGuard<'_, AllocTable> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `cuMemAlloc`: `size` bytes backed by a VMM reservation.
    pub fn alloc(&self, size: u64) -> Result<DevicePtr, AllocError> {
        self.alloc_kind(size, AllocKind::Linear)
    }

    /// `cuMemAllocPitch`: `height` rows of `width` bytes, each row rounded up to
    /// [`PITCH_ALIGN`]; returns the address and the pitch.
    pub fn alloc_pitch(
        &self,
        width: u64,
        height: u64,
        element: u32,
    ) -> Result<(DevicePtr, u64), AllocError> {
        let bad = || AllocError::BadPitch {
            width,
            height,
            element,
        };
        if !matches!(element, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(bad());
        }
        let pitch = round_up(width, PITCH_ALIGN).ok_or_else(bad)?;
        let size = pitch.checked_mul(height).ok_or_else(bad)?;
        let va = self.alloc_kind(size, AllocKind::Pitch { pitch, height })?;
        Ok((va, pitch))
    }

    fn alloc_kind(&self, size: u64, kind: AllocKind) -> Result<DevicePtr, AllocError> {
        let mapped_size = round_up(size, self.granularity)
            .filter(|s| *s > 0)
            .ok_or(AllocError::BadSize { size })?;
        let va = self.driver.reserve(mapped_size, None)?;
        let handle = match self.back(va, mapped_size) {
            Ok(h) => h,
            Err(e) => {
                let _ = self.driver.free_va(va, mapped_size);
                return Err(e);
            }
        };
        self.table().insert(Allocation {
            va,
            size,
            mapped_size,
            handle: Some(handle),
            state: AllocState::Mapped,
            kind,
        });
        tracing::trace!(va, size, "device allocation");
        Ok(va)
    }

    /// Creates physical memory and maps it accessible at `va`; undoes on failure.
    fn back(&self, va: DevicePtr, size: u64) -> Result<PhysHandle, AllocError> {
        let handle = self.driver.create(size)?;
        self.map_accessible(va, size, handle)?;
        Ok(handle)
    }

    /// Maps `handle` accessible at `va`; on failure unmaps and releases `handle`.
    fn map_accessible(
        &self,
        va: DevicePtr,
        size: u64,
        handle: PhysHandle,
    ) -> Result<(), AllocError> {
        Ok(map_accessible(&*self.driver, va, size, handle)?)
    }

    /// `cuMemFree`: frees the allocation starting at `va` (mapped or released).
    pub fn free(&self, va: DevicePtr) -> Result<(), AllocError> {
        let mut table = self.table();
        let alloc = table.get(va).ok_or(AllocError::NotFound { va })?.clone();
        if let Some(handle) = alloc.handle {
            self.driver.unmap(va, alloc.mapped_size)?;
            self.driver.release(handle)?;
        }
        self.driver.free_va(va, alloc.mapped_size)?;
        table.remove(va);
        Ok(())
    }

    /// Unmaps and releases the physical memory of the allocation at `va`, keeping its
    /// VA reservation.
    pub fn release(&self, va: DevicePtr) -> Result<(), AllocError> {
        let mut table = self.table();
        let alloc = table.get_mut(va).ok_or(AllocError::NotFound { va })?;
        let handle = mapped_handle(alloc)?;
        self.driver.unmap(va, alloc.mapped_size)?;
        // From here the memory is gone for the application: record it even if the
        // release fails (the handle is then leaked, not reused).
        alloc.handle = None;
        alloc.state = AllocState::Released;
        self.driver.release(handle)?;
        Ok(())
    }

    /// Creates new physical memory for the released allocation at `va` and maps it at
    /// the same address.
    pub fn remap(&self, va: DevicePtr) -> Result<(), AllocError> {
        self.back_released(va, |driver, size| driver.create(size))
    }

    /// Maps the physical memory `handle` makes (given the size) accessible at the
    /// released allocation's `va`; on failure nothing changes.
    fn back_released(
        &self,
        va: DevicePtr,
        handle: impl FnOnce(&D, u64) -> Result<PhysHandle, VmmError>,
    ) -> Result<(), AllocError> {
        let mut table = self.table();
        let alloc = table.get_mut(va).ok_or(AllocError::NotFound { va })?;
        if alloc.state != AllocState::Released {
            return Err(AllocError::WrongState {
                va,
                state: alloc.state,
                expected: AllocState::Released,
            });
        }
        let h = handle(&self.driver, alloc.mapped_size)?;
        self.map_accessible(va, alloc.mapped_size, h)?;
        alloc.handle = Some(h);
        alloc.state = AllocState::Mapped;
        Ok(())
    }

    /// Exports the physical memory of the mapped allocation at `va` as an fd
    /// ([`VmmDriver::export`]); `None` when the driver cannot.
    pub fn export(&self, va: DevicePtr) -> Result<Option<OwnedFd>, AllocError> {
        let table = self.table();
        let alloc = table.get(va).ok_or(AllocError::NotFound { va })?;
        let handle = mapped_handle(alloc)?;
        Ok(self.driver.export(handle)?)
    }

    /// Maps the memory exported as `fd` (by [`Allocator::export`] before the release)
    /// back at `va`, the released allocation's own address: its contents, no copy.
    pub fn reattach(&self, va: DevicePtr, fd: BorrowedFd<'_>) -> Result<(), AllocError> {
        self.back_released(va, |driver, _| driver.import(fd))
    }

    /// Moves the mapped allocation at `va` onto new physical memory of its own, with a
    /// device-to-device copy: memory imported from an fd cannot be exported again, new
    /// memory can. Needs room on the device for one more copy of the allocation; on any
    /// failure the allocation stays on its old memory.
    pub fn renew(&self, va: DevicePtr) -> Result<(), AllocError> {
        let mut table = self.table();
        let alloc = table.get_mut(va).ok_or(AllocError::NotFound { va })?;
        let old = mapped_handle(alloc)?;
        let size = alloc.mapped_size;
        // The copy: new memory at a temporary address.
        let tmp = self.driver.reserve(size, None)?;
        let new = match self.back(tmp, size) {
            Ok(h) => h,
            Err(e) => {
                let _ = self.driver.free_va(tmp, size);
                return Err(e);
            }
        };
        let copied = self.driver.copy_device(tmp, va, size);
        let _ = self.driver.unmap(tmp, size);
        let _ = self.driver.free_va(tmp, size);
        if let Err(e) = copied {
            let _ = self.driver.release(new);
            return Err(e.into());
        }
        // The swap: the new memory at the allocation's address.
        if let Err(e) = self.driver.unmap(va, size) {
            let _ = self.driver.release(new);
            return Err(e.into());
        }
        if let Err(e) = self.map_accessible(va, size, new) {
            // `new` is gone; the old memory (still held: not through `map_accessible`,
            // which would release it on a failure) goes back at its address.
            self.driver.map(va, size, old)?;
            self.driver.set_access(va, size)?;
            return Err(e);
        }
        alloc.handle = Some(new);
        self.driver.release(old)?;
        Ok(())
    }

    /// Start addresses of all allocations, by address.
    pub fn addresses(&self) -> Vec<DevicePtr> {
        self.table().iter().map(|a| a.va).collect()
    }

    /// A copy of the allocation starting at `va`.
    pub fn get(&self, va: DevicePtr) -> Option<Allocation> {
        self.table().get(va).cloned()
    }

    /// A copy of the allocation holding `addr` (interior pointers included).
    pub fn find(&self, addr: DevicePtr) -> Option<Allocation> {
        self.table().find(addr).cloned()
    }

    /// Records memory the hook cannot handle.
    pub fn record_unsupported(&self, kind: UnsupportedKind, va: DevicePtr, size: u64) {
        tracing::debug!(?kind, va, size, "memory the hook cannot move");
        self.table()
            .record_unsupported(Unsupported { kind, va, size });
    }

    /// Everything the hook cannot handle.
    pub fn unsupported(&self) -> Vec<Unsupported> {
        self.table().unsupported().to_vec()
    }
}

/// Maps `handle` accessible at `va` through `driver`; on failure unmaps and releases
/// `handle` (allocations and the snapshot region alike).
pub(crate) fn map_accessible<D: VmmDriver>(
    driver: &D,
    va: DevicePtr,
    size: u64,
    handle: PhysHandle,
) -> Result<(), VmmError> {
    if let Err(e) = driver.map(va, size, handle) {
        let _ = driver.release(handle);
        return Err(e);
    }
    if let Err(e) = driver.set_access(va, size) {
        let _ = driver.unmap(va, size);
        let _ = driver.release(handle);
        return Err(e);
    }
    Ok(())
}

/// The physical memory of a mapped allocation; `WrongState` otherwise.
fn mapped_handle(alloc: &Allocation) -> Result<PhysHandle, AllocError> {
    match (alloc.state, alloc.handle) {
        (AllocState::Mapped, Some(handle)) => Ok(handle),
        (state, _) => Err(AllocError::WrongState {
            va: alloc.va,
            state,
            expected: AllocState::Mapped,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::DriverCall;
    use crate::fake::FakeDriver;

    const G: u64 = 64 << 10;

    fn setup() -> (Arc<FakeDriver>, Allocator<FakeDriver>) {
        let driver = Arc::new(FakeDriver::new(G, 64 * G));
        let allocator = Allocator::new(driver.clone()).unwrap();
        (driver, allocator)
    }

    #[test]
    fn alloc_rounds_to_granularity_and_tracks() {
        let (driver, a) = setup();
        let va = a.alloc(100).unwrap();
        let alloc = a.get(va).unwrap();
        assert_eq!((alloc.size, alloc.mapped_size), (100, G));
        assert_eq!(alloc.state, AllocState::Mapped);
        assert_eq!(alloc.kind, AllocKind::Linear);
        assert_eq!(driver.physical_bytes(), G);
        let va2 = a.alloc(G + 1).unwrap();
        assert_eq!(a.get(va2).unwrap().mapped_size, 2 * G);
        assert_eq!(a.table().total_bytes(), 100 + G + 1);
        assert!(matches!(a.alloc(0), Err(AllocError::BadSize { size: 0 })));
    }

    #[test]
    fn lookup_by_interior_pointer() {
        let (_, a) = setup();
        let va = a.alloc(1000).unwrap();
        let vb = a.alloc(10).unwrap();
        assert_eq!(a.find(va).unwrap().va, va);
        assert_eq!(a.find(va + 999).unwrap().va, va);
        assert!(
            a.find(va + 1000).is_none(),
            "the padding is not the allocation"
        );
        assert!(a.find(va - 1).is_none());
        assert_eq!(a.find(vb + 9).unwrap().va, vb);
    }

    #[test]
    fn free_returns_everything_to_the_driver() {
        let (driver, a) = setup();
        let va = a.alloc(3 * G).unwrap();
        a.free(va).unwrap();
        assert!(a.table().is_empty());
        assert_eq!(driver.physical_bytes(), 0);
        assert_eq!((driver.reservations(), driver.mappings()), (0, 0));
        assert!(matches!(a.free(va), Err(AllocError::NotFound { .. })));
        // A released allocation frees too (nothing to unmap).
        let vb = a.alloc(G).unwrap();
        a.release(vb).unwrap();
        a.free(vb).unwrap();
        assert_eq!(driver.reservations(), 0);
    }

    #[test]
    fn pitch_rows_are_rounded() {
        let (_, a) = setup();
        let (va, pitch) = a.alloc_pitch(1000, 3, 4).unwrap();
        assert_eq!(pitch, 1024);
        let alloc = a.get(va).unwrap();
        assert_eq!(alloc.size, 3 * 1024);
        assert_eq!(alloc.kind, AllocKind::Pitch { pitch, height: 3 });
        assert!(a.alloc_pitch(1000, 3, 3).is_err(), "element size 3");
        assert!(a.alloc_pitch(0, 3, 4).is_err());
        assert!(a.alloc_pitch(u64::MAX, 2, 4).is_err());
    }

    #[test]
    fn release_keeps_va_and_remap_uses_it() {
        let (driver, a) = setup();
        let va = a.alloc(2 * G).unwrap();
        a.release(va).unwrap();
        assert_eq!(a.get(va).unwrap().state, AllocState::Released);
        assert_eq!(driver.physical_bytes(), 0);
        assert_eq!(driver.reservations(), 1);
        assert!(matches!(a.release(va), Err(AllocError::WrongState { .. })));
        a.remap(va).unwrap();
        let alloc = a.get(va).unwrap();
        assert_eq!((alloc.va, alloc.state), (va, AllocState::Mapped));
        assert_eq!(driver.physical_bytes(), 2 * G);
        assert!(matches!(a.remap(va), Err(AllocError::WrongState { .. })));
    }

    #[test]
    fn failed_driver_calls_leave_nothing_behind() {
        let (driver, a) = setup();
        for call in [DriverCall::Create, DriverCall::Map, DriverCall::SetAccess] {
            driver.fail_next(call);
            let err = a.alloc(G).unwrap_err();
            assert!(matches!(err, AllocError::Driver(e) if e.call == call));
            assert_eq!(driver.physical_bytes(), 0, "{call:?}");
            assert_eq!(
                (driver.reservations(), driver.mappings()),
                (0, 0),
                "{call:?}"
            );
        }
        assert!(a.table().is_empty());
        // A failed remap leaves the allocation released, ready for another try.
        let va = a.alloc(G).unwrap();
        a.release(va).unwrap();
        driver.fail_next(DriverCall::Map);
        assert!(a.remap(va).is_err());
        assert_eq!(a.get(va).unwrap().state, AllocState::Released);
        assert_eq!(driver.physical_bytes(), 0);
        a.remap(va).unwrap();
    }

    #[test]
    fn unsupported_memory_is_reported() {
        let (_, a) = setup();
        a.record_unsupported(UnsupportedKind::Managed, 0x1000, 4096);
        a.record_unsupported(UnsupportedKind::IpcHandle, 0x9000, 8192);
        let report = a.unsupported();
        assert_eq!(report.len(), 2);
        assert_eq!(report[0].kind, UnsupportedKind::Managed);
        a.table().forget_unsupported(0x1000);
        assert_eq!(a.unsupported()[0].kind, UnsupportedKind::IpcHandle);
    }
}
