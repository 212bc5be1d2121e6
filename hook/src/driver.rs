//! [`VmmDriver`]: what the hook needs from the CUDA driver's virtual memory management
//! (VMM) API, in our own minimal types (no CUDA headers).
//!
//! `CudaDriver` (feature `cuda`) is the real implementation; unit tests use
//! `FakeDriver` (tests or feature `fake`). Every method takes `&self`: the
//! driver is shared by the application's threads and the control thread.

use std::os::fd::{BorrowedFd, OwnedFd};

use gpu_state::image::gpuhash::ChunkSums;
use thiserror::Error;

/// A device virtual address (`CUdeviceptr`).
pub type DevicePtr = u64;

/// A physical allocation (`CUmemGenericAllocationHandle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysHandle(pub u64);

/// The driver call that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverCall {
    Granularity,
    AddressReserve,
    Create,
    Map,
    SetAccess,
    Unmap,
    Release,
    AddressFree,
    CopyToHost,
    CopyFromHost,
    Synchronize,
    /// Waiting for a copy stream (`cuStreamSynchronize`).
    Wait,
    RegisterHost,
    UnregisterHost,
    /// Hashing chunks on the device (module load, kernel launch, its small buffer).
    Hash,
    /// `cuMemExportToShareableHandle` (a POSIX fd).
    Export,
    /// `cuMemImportFromShareableHandle`.
    Import,
    /// `cuMemcpyDtoD_v2`.
    CopyDevice,
    /// `cuMemGetInfo_v2`.
    MemInfo,
}

/// A failed driver call: which call and the driver's result code (`CUresult`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("CUDA driver call {call:?} failed with code {code}")]
pub struct VmmError {
    pub call: DriverCall,
    pub code: i32,
}

/// `CUDA_ERROR_INVALID_VALUE`.
pub const CUDA_ERROR_INVALID_VALUE: i32 = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;

/// The VMM calls the hook makes. Sizes passed to `reserve`, `create`, `map`, `unmap`,
/// `set_access` and `free_va` are multiples of [`granularity`](Self::granularity).
pub trait VmmDriver: Send + Sync {
    /// The allocation granularity of the current device (`cuMemGetAllocationGranularity`).
    fn granularity(&self) -> Result<u64, VmmError>;
    /// Reserves a virtual address range (`cuMemAddressReserve`); `fixed` asks for that
    /// exact address (a hint to the real driver, honoured or refused by the fake).
    fn reserve(&self, size: u64, fixed: Option<DevicePtr>) -> Result<DevicePtr, VmmError>;
    /// Creates physical memory of `size` bytes on the current device (`cuMemCreate`).
    fn create(&self, size: u64) -> Result<PhysHandle, VmmError>;
    /// Maps `handle` at `va` (`cuMemMap`).
    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle) -> Result<(), VmmError>;
    /// Grants the current device read/write access (`cuMemSetAccess`).
    fn set_access(&self, va: DevicePtr, size: u64) -> Result<(), VmmError>;
    /// Unmaps a mapped range (`cuMemUnmap`).
    fn unmap(&self, va: DevicePtr, size: u64) -> Result<(), VmmError>;
    /// Releases physical memory (`cuMemRelease`).
    fn release(&self, handle: PhysHandle) -> Result<(), VmmError>;
    /// Frees a virtual address reservation (`cuMemAddressFree`).
    fn free_va(&self, va: DevicePtr, size: u64) -> Result<(), VmmError>;
    /// Copies `dst.len()` bytes from device address `src` (`cuMemcpyDtoH`).
    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), VmmError>;
    /// Copies `src` to device address `dst` (`cuMemcpyHtoD`).
    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<(), VmmError>;
    /// Waits for all work on the device (`cuCtxSynchronize`).
    fn synchronize(&self) -> Result<(), VmmError>;
    /// Pins `len` bytes of host memory at `ptr` for DMA (`cuMemHostRegister_v2`).
    fn register_host(&self, ptr: *mut u8, len: usize) -> Result<(), VmmError>;
    /// Pins `len` bytes of read-only host memory (e.g. a `PROT_READ` mapping of an image
    /// file) as a source of host-to-device copies (`cuMemHostRegister_v2` with
    /// `CU_MEMHOSTREGISTER_READ_ONLY`); undone by [`unregister_host`](Self::unregister_host).
    fn register_host_read_only(&self, ptr: *const u8, len: usize) -> Result<(), VmmError> {
        self.register_host(ptr.cast_mut(), len)
    }
    /// Unpins memory registered at `ptr` (`cuMemHostUnregister`).
    fn unregister_host(&self, ptr: *mut u8) -> Result<(), VmmError>;
    /// Starts copying `len` bytes from device address `src` to host memory at `dst` on
    /// copy stream `stream` (`cuMemcpyDtoHAsync_v2`); copies on one stream run in order.
    ///
    /// # Safety
    /// `dst` must stay valid for `len` bytes, and untouched by anyone else, until
    /// [`wait`](Self::wait) on `stream` returns.
    unsafe fn copy_to_host_async(
        &self,
        src: DevicePtr,
        dst: *mut u8,
        len: usize,
        stream: usize,
    ) -> Result<(), VmmError>;
    /// Starts copying `len` bytes from host memory at `src` to device address `dst` on
    /// copy stream `stream` (`cuMemcpyHtoDAsync_v2`).
    ///
    /// # Safety
    /// `src` must stay valid and unchanged for `len` bytes until [`wait`](Self::wait)
    /// on `stream` returns.
    unsafe fn copy_from_host_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: usize,
    ) -> Result<(), VmmError>;
    /// Waits for every copy issued on `stream` (`cuStreamSynchronize`). When it returns,
    /// also with an error, none of them touches host memory any more.
    fn wait(&self, stream: usize) -> Result<(), VmmError>;
    /// gh1 sums ([`gpu_state::image::gpuhash`]) of every `chunk`-byte piece of each region
    /// `(va, len)`, in order (a region's last piece may be shorter), computed on the
    /// device before anything is copied. `Ok(None)`: this driver cannot (the copy-out then
    /// hashes on the CPU after copying).
    fn chunk_sums(
        &self,
        regions: &[(DevicePtr, u64)],
        chunk: u64,
    ) -> Result<Option<Vec<Vec<ChunkSums>>>, VmmError> {
        let _ = (regions, chunk);
        Ok(None)
    }
    /// A copy-out or copy-in finished: resources held for copies (streams, the hash
    /// kernel's module) can go, so a checkpoint does not carry them.
    fn end_copies(&self) {}
    /// Exports the physical memory `handle` as a file descriptor
    /// (`cuMemExportToShareableHandle`, POSIX fd). Whoever holds the fd keeps the memory
    /// alive after this process releases its handle: the shim holds it across the
    /// driver's checkpoint of a leave-running checkpoint, and [`import`](Self::import)
    /// brings it back without a copy. `Ok(None)`: this driver cannot export.
    fn export(&self, handle: PhysHandle) -> Result<Option<OwnedFd>, VmmError> {
        let _ = handle;
        Ok(None)
    }
    /// Copies `len` bytes from device address `src` to device address `dst` and returns
    /// when the copy is done (`cuMemcpyDtoD_v2`, which alone does not wait, then
    /// `cuCtxSynchronize`).
    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, len: u64) -> Result<(), VmmError> {
        let _ = (dst, src, len);
        Err(VmmError {
            call: DriverCall::CopyDevice,
            code: CUDA_ERROR_NOT_SUPPORTED,
        })
    }
    /// The CUDA device ordinal of this driver's context (what a copy-in helper opens);
    /// `None` when it has none (fakes).
    fn device_ordinal(&self) -> Option<i32> {
        None
    }
    /// Bytes of device memory free now (`cuMemGetInfo_v2`); `None` when the driver
    /// cannot say.
    fn free_memory(&self) -> Result<Option<u64>, VmmError> {
        Ok(None)
    }
    /// A handle to memory exported by [`export`](Self::export), possibly by an earlier
    /// life of this process (`cuMemImportFromShareableHandle`).
    fn import(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle, VmmError> {
        let _ = fd;
        Err(VmmError {
            call: DriverCall::Import,
            code: CUDA_ERROR_NOT_SUPPORTED,
        })
    }
}

/// The identity of an fd's open file (device, inode): the same after the fd travelled
/// to another process and back.
pub fn fd_identity(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    let st = nix::sys::stat::fstat(fd).ok()?;
    Some((st.st_dev, st.st_ino))
}

/// `value` rounded up to a multiple of `align` (a power of two or any non-zero value);
/// `None` on overflow.
pub fn round_up(value: u64, align: u64) -> Option<u64> {
    if align == 0 {
        return None;
    }
    value.checked_add(align - 1).map(|v| v / align * align)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_up_rounds_and_detects_overflow() {
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(4097, 4096), Some(8192));
        assert_eq!(round_up(7, 3), Some(9));
        assert_eq!(round_up(u64::MAX, 4096), None);
        assert_eq!(round_up(5, 0), None);
    }
}
