//! [`CudaDriver`]: [`VmmDriver`] over libcuda's VMM API, loaded with `dlopen` (feature
//! `cuda`). Own `#[repr(C)]` types for the few cuda.h structs it passes; one device
//! (the context's current one) per driver.
//!
//! Copies go through two pinned host buffers on two streams (one piece copies by DMA
//! while the CPU moves the other between its pinned buffer and the caller's slice);
//! the buffers and streams live only between the first copy and
//! [`VmmDriver::end_copies`], so a checkpoint never sees them. When the pinned calls are
//! missing or fail, copies fall back to synchronous `cuMemcpyDtoH_v2`/`HtoD_v2`.
//!
//! The control thread has no current context: every call first makes the context the
//! driver was created in current on a thread that has none.
//!
//! Tested on CPU against tests/fake-libcuda through the interposition layer; not run
//! on a GPU yet.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::path::Path;
use std::sync::Mutex;

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
type FnGetCtx = unsafe extern "C" fn(*mut *mut c_void) -> CuResult;
type FnSetCtx = unsafe extern "C" fn(*mut c_void) -> CuResult;
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
type FnHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult;
type FnFreeHost = unsafe extern "C" fn(*mut c_void) -> CuResult;
type FnStreamCreate = unsafe extern "C" fn(*mut Stream, c_uint) -> CuResult;
type FnStreamSync = unsafe extern "C" fn(Stream) -> CuResult;
type FnDtoHAsync = unsafe extern "C" fn(*mut c_void, DevicePtr, usize, Stream) -> CuResult;
type FnHtoDAsync = unsafe extern "C" fn(DevicePtr, *const c_void, usize, Stream) -> CuResult;

/// `CUstream`.
type Stream = *mut c_void;

/// Bytes of each of the two pinned staging buffers.
pub const PINNED_BUFFER: usize = 32 << 20;
/// Smallest piece a copy is split into (smaller pieces cost more in launches than the
/// overlap gains).
const MIN_PIECE: usize = 1 << 20;
/// `CU_STREAM_NON_BLOCKING`: the copy streams do not wait for the legacy stream.
const STREAM_NON_BLOCKING: c_uint = 1;

/// Loading errors.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("cannot load {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("libcuda has no symbol {symbol}")]
    MissingSymbol { symbol: &'static str },
    #[error("cuCtxGetDevice failed with code {0} (no current context?)")]
    NoDevice(c_int),
    #[error("cuCtxGetCurrent failed with code {0}")]
    NoContext(c_int),
}

/// The functions of the pinned two-stream copies (all present, or none used).
#[derive(Clone, Copy)]
struct PinnedFns {
    host_alloc: FnHostAlloc,
    free_host: FnFreeHost,
    stream_create: FnStreamCreate,
    stream_sync: FnStreamSync,
    stream_destroy: FnStreamSync,
    dtoh_async: FnDtoHAsync,
    htod_async: FnHtoDAsync,
}

/// Two pinned buffers and two streams, alive between the first copy and `end_copies`.
struct Staging {
    buffers: [*mut u8; 2],
    streams: [Stream; 2],
}

/// The VMM API of one libcuda. See the module docs.
pub struct CudaDriver {
    device: c_int,
    /// The context current when the driver was made (`CUcontext`).
    ctx: *mut c_void,
    get_ctx: FnGetCtx,
    set_ctx: FnSetCtx,
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
    pinned: Option<PinnedFns>,
    staging: Mutex<Option<Staging>>,
    _lib: Option<Library>,
}

// SAFETY: the driver API is thread-safe; the struct holds function pointers into the
// loaded library (kept alive by it or by the process), the context handle, and pinned
// buffers used only under the `staging` mutex.
unsafe impl Send for CudaDriver {}
unsafe impl Sync for CudaDriver {}

/// Looks a driver function up by name; `None` when absent.
pub type Resolve<'a> = &'a dyn Fn(&'static str) -> Option<*mut c_void>;

/// A required function pointer.
///
/// # Safety
/// `T` must be the symbol's real function pointer type.
unsafe fn need<T: Copy>(resolve: Resolve<'_>, name: &'static str) -> Result<T, LoadError> {
    want(resolve, name).ok_or(LoadError::MissingSymbol { symbol: name })
}

/// An optional function pointer.
///
/// # Safety
/// As [`need`].
unsafe fn want<T: Copy>(resolve: Resolve<'_>, name: &'static str) -> Option<T> {
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    let p = resolve(name).filter(|p| !p.is_null())?;
    Some(std::mem::transmute_copy::<*mut c_void, T>(&p))
}

impl CudaDriver {
    /// Loads `path` (e.g. `libcuda.so.1`) and binds to the calling thread's current
    /// context and its device. Not for use inside the preloaded hook, where `dlsym`
    /// is our own (see [`CudaDriver::from_resolver`]).
    pub fn load(path: &Path) -> Result<CudaDriver, LoadError> {
        let shown = path.display().to_string();
        // SAFETY: loading libcuda runs its constructors, which is what the driver expects.
        let lib = unsafe { Library::new(path) }.map_err(|e| LoadError::Load {
            path: shown,
            reason: e.to_string(),
        })?;
        let resolve = |name: &'static str| {
            // SAFETY: only the address is read; it is typed by `need`/`want`.
            unsafe { lib.get::<*mut c_void>(name.as_bytes()) }
                .ok()
                .map(|s| *s)
        };
        // SAFETY: the resolver returns libcuda's own functions.
        let mut driver = unsafe { CudaDriver::from_resolver(&resolve) }?;
        driver._lib = Some(lib);
        Ok(driver)
    }

    /// Binds to the calling thread's current context and its device, with functions
    /// from `resolve`.
    ///
    /// # Safety
    /// `resolve` must return libcuda's functions of those names (never wrappers that
    /// could block on the freeze gate), alive for the driver's lifetime.
    pub unsafe fn from_resolver(resolve: Resolve<'_>) -> Result<CudaDriver, LoadError> {
        let get_device: FnGetDevice = need(resolve, "cuCtxGetDevice")?;
        let get_ctx: FnGetCtx = need(resolve, "cuCtxGetCurrent")?;
        let mut device = 0;
        let rc = get_device(&mut device);
        if rc != 0 {
            return Err(LoadError::NoDevice(rc));
        }
        let mut ctx = std::ptr::null_mut();
        let rc = get_ctx(&mut ctx);
        if rc != 0 {
            return Err(LoadError::NoContext(rc));
        }
        let pinned = (|| {
            Some(PinnedFns {
                host_alloc: want(resolve, "cuMemHostAlloc")?,
                free_host: want(resolve, "cuMemFreeHost")?,
                stream_create: want(resolve, "cuStreamCreate")?,
                stream_sync: want(resolve, "cuStreamSynchronize")?,
                stream_destroy: want(resolve, "cuStreamDestroy_v2")?,
                dtoh_async: want(resolve, "cuMemcpyDtoHAsync_v2")?,
                htod_async: want(resolve, "cuMemcpyHtoDAsync_v2")?,
            })
        })();
        Ok(CudaDriver {
            device,
            ctx,
            get_ctx,
            set_ctx: need(resolve, "cuCtxSetCurrent")?,
            granularity: need(resolve, "cuMemGetAllocationGranularity")?,
            reserve: need(resolve, "cuMemAddressReserve")?,
            create: need(resolve, "cuMemCreate")?,
            map: need(resolve, "cuMemMap")?,
            set_access: need(resolve, "cuMemSetAccess")?,
            unmap: need(resolve, "cuMemUnmap")?,
            release: need(resolve, "cuMemRelease")?,
            address_free: need(resolve, "cuMemAddressFree")?,
            dtoh: need(resolve, "cuMemcpyDtoH_v2")?,
            htod: need(resolve, "cuMemcpyHtoD_v2")?,
            sync: need(resolve, "cuCtxSynchronize")?,
            pinned,
            staging: Mutex::new(None),
            _lib: None,
        })
    }

    /// The device the driver allocates on.
    pub fn device(&self) -> c_int {
        self.device
    }

    /// Makes the driver's context current on a thread that has none (the control
    /// thread); a thread with a context keeps its own.
    fn bind(&self) {
        let mut cur = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the context handle came from the driver.
        unsafe {
            if (self.get_ctx)(&mut cur) == 0 && cur.is_null() {
                let rc = (self.set_ctx)(self.ctx);
                if rc != 0 {
                    tracing::warn!(code = rc, "cuCtxSetCurrent failed on the control thread");
                }
            }
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

    /// The staging buffers and streams, made on first use; `None` (synchronous
    /// copies) when the pinned functions are missing or fail.
    fn staging<'a>(&self, slot: &'a mut Option<Staging>) -> Option<(&'a Staging, PinnedFns)> {
        let f = self.pinned?;
        if slot.is_none() {
            let mut st = Staging {
                buffers: [std::ptr::null_mut(); 2],
                streams: [std::ptr::null_mut(); 2],
            };
            let mut ok = true;
            for i in 0..2 {
                let mut p = std::ptr::null_mut();
                // SAFETY: out-pointers to locals.
                unsafe {
                    ok &= (f.host_alloc)(&mut p, PINNED_BUFFER, 0) == 0;
                    st.buffers[i] = p.cast();
                    ok &= (f.stream_create)(&mut st.streams[i], STREAM_NON_BLOCKING) == 0;
                }
            }
            if !ok {
                tracing::warn!("pinned staging unavailable; copying synchronously");
                free_staging(&f, &st);
                return None;
            }
            *slot = Some(st);
        }
        slot.as_ref().map(|st| (st, f))
    }
}

/// Frees whatever of `st` was made.
fn free_staging(f: &PinnedFns, st: &Staging) {
    // SAFETY: handles made by the driver (null ones skipped); nothing uses them after.
    unsafe {
        for s in st.streams.iter().filter(|s| !s.is_null()) {
            (f.stream_sync)(*s);
            (f.stream_destroy)(*s);
        }
        for b in st.buffers.iter().filter(|b| !b.is_null()) {
            (f.free_host)(b.cast());
        }
    }
}

/// The pieces a copy of `len` bytes is split into: at least two when it is large
/// enough to overlap, at most one pinned buffer each.
fn piece_size(len: usize) -> usize {
    len.div_ceil(2).clamp(MIN_PIECE, PINNED_BUFFER)
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
        self.bind();
        let mut g = 0usize;
        let prop = self.prop();
        let rc = unsafe { (self.granularity)(&mut g, &prop, GRANULARITY_MINIMUM) };
        check(DriverCall::Granularity, rc).map(|()| g as u64)
    }

    fn reserve(&self, size: u64, fixed: Option<DevicePtr>) -> Result<DevicePtr, DriverError> {
        self.bind();
        let call = DriverCall::AddressReserve;
        let mut va: DevicePtr = 0;
        let rc = unsafe { (self.reserve)(&mut va, csize(call, size)?, 0, fixed.unwrap_or(0), 0) };
        check(call, rc)?;
        Ok(va)
    }

    fn create(&self, size: u64) -> Result<PhysHandle, DriverError> {
        self.bind();
        let call = DriverCall::Create;
        let mut handle: c_ulonglong = 0;
        let prop = self.prop();
        let rc = unsafe { (self.create)(&mut handle, csize(call, size)?, &prop, 0) };
        check(call, rc).map(|()| PhysHandle(handle))
    }

    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle) -> Result<(), DriverError> {
        self.bind();
        let call = DriverCall::Map;
        check(call, unsafe {
            (self.map)(va, csize(call, size)?, 0, handle.0, 0)
        })
    }

    fn set_access(&self, va: DevicePtr, size: u64) -> Result<(), DriverError> {
        self.bind();
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
        self.bind();
        let call = DriverCall::Unmap;
        check(call, unsafe { (self.unmap)(va, csize(call, size)?) })
    }

    fn release(&self, handle: PhysHandle) -> Result<(), DriverError> {
        self.bind();
        check(DriverCall::Release, unsafe { (self.release)(handle.0) })
    }

    fn free_va(&self, va: DevicePtr, size: u64) -> Result<(), DriverError> {
        self.bind();
        let call = DriverCall::AddressFree;
        check(call, unsafe { (self.address_free)(va, csize(call, size)?) })
    }

    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DriverError> {
        self.bind();
        let call = DriverCall::CopyToHost;
        let mut slot = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Some((st, f)) = self.staging(&mut slot) else {
            let rc = unsafe { (self.dtoh)(dst.as_mut_ptr().cast(), src, dst.len()) };
            return check(call, rc);
        };
        let piece = piece_size(dst.len());
        let pieces: Vec<(usize, usize)> = (0..dst.len())
            .step_by(piece)
            .map(|off| (off, piece.min(dst.len() - off)))
            .collect();
        let issue = |i: usize| {
            let (off, len) = pieces[i];
            let b = i % 2;
            unsafe { (f.dtoh_async)(st.buffers[b].cast(), src + off as u64, len, st.streams[b]) }
        };
        let result = (|| {
            for i in 0..pieces.len().min(2) {
                check(call, issue(i))?;
            }
            for (i, &(off, len)) in pieces.iter().enumerate() {
                let b = i % 2;
                check(call, unsafe { (f.stream_sync)(st.streams[b]) })?;
                // The other stream's DMA runs while this piece moves to the caller.
                let from = unsafe { std::slice::from_raw_parts(st.buffers[b], len) };
                dst[off..off + len].copy_from_slice(from);
                if i + 2 < pieces.len() {
                    check(call, issue(i + 2))?;
                }
            }
            Ok(())
        })();
        if result.is_err() {
            // No DMA may still write into the buffers after we return.
            for s in st.streams {
                unsafe { (f.stream_sync)(s) };
            }
        }
        result
    }

    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DriverError> {
        self.bind();
        let call = DriverCall::CopyFromHost;
        let mut slot = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Some((st, f)) = self.staging(&mut slot) else {
            let rc = unsafe { (self.htod)(dst, src.as_ptr().cast(), src.len()) };
            return check(call, rc);
        };
        let piece = piece_size(src.len());
        let mut result = Ok(());
        for (i, off) in (0..src.len()).step_by(piece).enumerate() {
            let len = piece.min(src.len() - off);
            let b = i % 2;
            if i >= 2 {
                // The buffer's previous piece must have left before it is refilled.
                result = check(call, unsafe { (f.stream_sync)(st.streams[b]) });
                if result.is_err() {
                    break;
                }
            }
            let to = unsafe { std::slice::from_raw_parts_mut(st.buffers[b], len) };
            to.copy_from_slice(&src[off..off + len]);
            let rc = unsafe {
                (f.htod_async)(
                    dst + off as u64,
                    st.buffers[b].cast_const().cast(),
                    len,
                    st.streams[b],
                )
            };
            result = check(call, rc);
            if result.is_err() {
                break;
            }
        }
        for s in st.streams {
            let rc = unsafe { (f.stream_sync)(s) };
            if result.is_ok() {
                result = check(call, rc);
            }
        }
        result
    }

    fn synchronize(&self) -> Result<(), DriverError> {
        self.bind();
        check(DriverCall::Synchronize, unsafe { (self.sync)() })
    }

    fn end_copies(&self) {
        let mut slot = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if let (Some(st), Some(f)) = (slot.take(), self.pinned) {
            self.bind();
            free_staging(&f, &st);
        }
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
