//! [`CudaDriver`]: [`VmmDriver`] over libcuda's VMM API, loaded with `dlopen` (feature
//! `cuda`). Own `#[repr(C)]` types for the few cuda.h structs it passes; one device
//! (the context's current one) per driver.
//!
//! Not run yet: it compiles on CPU machines, and needs the H200 to be tested. Copies are
//! synchronous (`cuMemcpyDtoH_v2`/`cuMemcpyHtoD_v2`) into whatever buffer the caller
//! gives; the pinned, two-stream copies of the prototype are still to come.

use std::ffi::{c_int, c_ulonglong, c_void};
use std::path::Path;

use libloading::Library;
use thiserror::Error;

use crate::driver::{DevicePtr, DriverCall, DriverError, PhysHandle, VmmDriver};

type CuResult = c_int;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MemLocation {
    /// `CU_MEM_LOCATION_TYPE_DEVICE` = 1.
    kind: c_int,
    id: c_int,
}

/// `CUmemAllocationProp` (`allocFlags` spelled out).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AllocationProp {
    /// `CU_MEM_ALLOCATION_TYPE_PINNED` = 1.
    kind: c_int,
    /// `CU_MEM_HANDLE_TYPE_NONE` = 0.
    requested_handle_types: c_int,
    location: MemLocation,
    win32_handle_meta_data: *mut c_void,
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AccessDesc {
    location: MemLocation,
    /// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` = 3.
    flags: c_int,
}

const LOCATION_DEVICE: c_int = 1;
const ALLOCATION_PINNED: c_int = 1;
const ACCESS_READWRITE: c_int = 3;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
const GRANULARITY_MINIMUM: c_int = 0;

type FnGetDevice = unsafe extern "C" fn(*mut c_int) -> CuResult;
type FnGranularity = unsafe extern "C" fn(*mut usize, *const AllocationProp, c_int) -> CuResult;
type FnReserve =
    unsafe extern "C" fn(*mut DevicePtr, usize, usize, DevicePtr, c_ulonglong) -> CuResult;
type FnCreate =
    unsafe extern "C" fn(*mut c_ulonglong, usize, *const AllocationProp, c_ulonglong) -> CuResult;
type FnMap = unsafe extern "C" fn(DevicePtr, usize, usize, c_ulonglong, c_ulonglong) -> CuResult;
type FnSetAccess = unsafe extern "C" fn(DevicePtr, usize, *const AccessDesc, usize) -> CuResult;
type FnUnmap = unsafe extern "C" fn(DevicePtr, usize) -> CuResult;
type FnRelease = unsafe extern "C" fn(c_ulonglong) -> CuResult;
type FnAddressFree = unsafe extern "C" fn(DevicePtr, usize) -> CuResult;
type FnDtoH = unsafe extern "C" fn(*mut c_void, DevicePtr, usize) -> CuResult;
type FnHtoD = unsafe extern "C" fn(DevicePtr, *const c_void, usize) -> CuResult;
type FnSync = unsafe extern "C" fn() -> CuResult;

/// Loading errors.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("cannot load {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("{path} has no symbol {symbol}")]
    MissingSymbol { path: String, symbol: &'static str },
    #[error("cuCtxGetDevice failed with code {0} (no current context?)")]
    NoDevice(c_int),
}

/// The VMM API of one libcuda. See the module docs.
pub struct CudaDriver {
    device: c_int,
    granularity: FnGranularity,
    reserve: FnReserve,
    create: FnCreate,
    map: FnMap,
    set_access: FnSetAccess,
    unmap: FnUnmap,
    release: FnRelease,
    address_free: FnAddressFree,
    dtoh: FnDtoH,
    htod: FnHtoD,
    sync: FnSync,
    _lib: Library,
}

// SAFETY: the driver API is thread-safe; the struct holds only function pointers into
// the loaded library, which it keeps alive.
unsafe impl Send for CudaDriver {}
unsafe impl Sync for CudaDriver {}

/// Copies a function pointer out of the library.
///
/// # Safety
/// `T` must be the symbol's real function pointer type, and the pointer must not
/// outlive `lib`.
unsafe fn sym<T: Copy>(lib: &Library, path: &str, name: &'static str) -> Result<T, LoadError> {
    match lib.get::<T>(name.as_bytes()) {
        Ok(s) => Ok(*s),
        Err(_) => Err(LoadError::MissingSymbol {
            path: path.to_string(),
            symbol: name,
        }),
    }
}

impl CudaDriver {
    /// Loads `path` (e.g. `libcuda.so.1`) and binds to the calling thread's current
    /// device, which must have a context.
    pub fn load(path: &Path) -> Result<CudaDriver, LoadError> {
        let shown = path.display().to_string();
        // SAFETY: loading libcuda runs its constructors, which is what the driver expects.
        let lib = unsafe { Library::new(path) }.map_err(|e| LoadError::Load {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        // SAFETY: the types match cuda.h's prototypes of these symbols.
        unsafe {
            let get_device: FnGetDevice = sym(&lib, &shown, "cuCtxGetDevice")?;
            let mut device = 0;
            let rc = get_device(&mut device);
            if rc != 0 {
                return Err(LoadError::NoDevice(rc));
            }
            Ok(CudaDriver {
                device,
                granularity: sym(&lib, &shown, "cuMemGetAllocationGranularity")?,
                reserve: sym(&lib, &shown, "cuMemAddressReserve")?,
                create: sym(&lib, &shown, "cuMemCreate")?,
                map: sym(&lib, &shown, "cuMemMap")?,
                set_access: sym(&lib, &shown, "cuMemSetAccess")?,
                unmap: sym(&lib, &shown, "cuMemUnmap")?,
                release: sym(&lib, &shown, "cuMemRelease")?,
                address_free: sym(&lib, &shown, "cuMemAddressFree")?,
                dtoh: sym(&lib, &shown, "cuMemcpyDtoH_v2")?,
                htod: sym(&lib, &shown, "cuMemcpyHtoD_v2")?,
                sync: sym(&lib, &shown, "cuCtxSynchronize")?,
                _lib: lib,
            })
        }
    }

    fn location(&self) -> MemLocation {
        MemLocation {
            kind: LOCATION_DEVICE,
            id: self.device,
        }
    }

    fn prop(&self) -> AllocationProp {
        AllocationProp {
            kind: ALLOCATION_PINNED,
            requested_handle_types: 0,
            location: self.location(),
            win32_handle_meta_data: std::ptr::null_mut(),
            compression_type: 0,
            gpu_direct_rdma_capable: 0,
            usage: 0,
            reserved: [0; 4],
        }
    }
}

fn check(call: DriverCall, rc: CuResult) -> Result<(), DriverError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(DriverError { call, code: rc })
    }
}

/// A size for the C API; sizes the hook passes always fit in `usize` on 64-bit Linux.
fn csize(call: DriverCall, size: u64) -> Result<usize, DriverError> {
    usize::try_from(size).map_err(|_| DriverError {
        call,
        code: crate::driver::CUDA_ERROR_INVALID_VALUE,
    })
}

// SAFETY (all methods): arguments follow cuda.h's contracts; out-pointers point to
// live locals; host buffers are valid for their full length.
impl VmmDriver for CudaDriver {
    fn granularity(&self) -> Result<u64, DriverError> {
        let mut g = 0usize;
        let prop = self.prop();
        let rc = unsafe { (self.granularity)(&mut g, &prop, GRANULARITY_MINIMUM) };
        check(DriverCall::Granularity, rc).map(|()| g as u64)
    }

    fn reserve(&self, size: u64, fixed: Option<DevicePtr>) -> Result<DevicePtr, DriverError> {
        let call = DriverCall::AddressReserve;
        let mut va: DevicePtr = 0;
        let rc = unsafe { (self.reserve)(&mut va, csize(call, size)?, 0, fixed.unwrap_or(0), 0) };
        check(call, rc)?;
        Ok(va)
    }

    fn create(&self, size: u64) -> Result<PhysHandle, DriverError> {
        let call = DriverCall::Create;
        let mut handle: c_ulonglong = 0;
        let prop = self.prop();
        let rc = unsafe { (self.create)(&mut handle, csize(call, size)?, &prop, 0) };
        check(call, rc).map(|()| PhysHandle(handle))
    }

    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle) -> Result<(), DriverError> {
        let call = DriverCall::Map;
        check(call, unsafe {
            (self.map)(va, csize(call, size)?, 0, handle.0, 0)
        })
    }

    fn set_access(&self, va: DevicePtr, size: u64) -> Result<(), DriverError> {
        let call = DriverCall::SetAccess;
        let desc = AccessDesc {
            location: self.location(),
            flags: ACCESS_READWRITE,
        };
        check(call, unsafe {
            (self.set_access)(va, csize(call, size)?, &desc, 1)
        })
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> Result<(), DriverError> {
        let call = DriverCall::Unmap;
        check(call, unsafe { (self.unmap)(va, csize(call, size)?) })
    }

    fn release(&self, handle: PhysHandle) -> Result<(), DriverError> {
        check(DriverCall::Release, unsafe { (self.release)(handle.0) })
    }

    fn free_va(&self, va: DevicePtr, size: u64) -> Result<(), DriverError> {
        let call = DriverCall::AddressFree;
        check(call, unsafe { (self.address_free)(va, csize(call, size)?) })
    }

    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DriverError> {
        let rc = unsafe { (self.dtoh)(dst.as_mut_ptr().cast(), src, dst.len()) };
        check(DriverCall::CopyToHost, rc)
    }

    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DriverError> {
        let rc = unsafe { (self.htod)(dst, src.as_ptr().cast(), src.len()) };
        check(DriverCall::CopyFromHost, rc)
    }

    fn synchronize(&self) -> Result<(), DriverError> {
        check(DriverCall::Synchronize, unsafe { (self.sync)() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_layouts_match_cuda_h() {
        assert_eq!(std::mem::size_of::<MemLocation>(), 8);
        assert_eq!(std::mem::size_of::<AllocationProp>(), 32);
        assert_eq!(
            std::mem::offset_of!(AllocationProp, win32_handle_meta_data),
            16
        );
        assert_eq!(std::mem::offset_of!(AllocationProp, compression_type), 24);
        assert_eq!(std::mem::size_of::<AccessDesc>(), 12);
    }

    #[test]
    fn missing_library_is_a_load_error() {
        let err = CudaDriver::load(Path::new("/nonexistent/libcuda.so.1"))
            .err()
            .unwrap();
        assert!(matches!(err, LoadError::Load { .. }), "{err}");
    }
}
