//! [`CudaDriver`]: [`VmmDriver`] over libcuda's VMM API, loaded with `dlopen` (feature
//! `cuda`). Own `#[repr(C)]` types for the few cuda.h structs it passes; one device
//! (the context's current one) per driver.
//!
//! The fast path's copies are async (`cuMemcpyDtoHAsync_v2`/`HtoDAsync_v2`) on copy
//! streams made at first use and destroyed by [`VmmDriver::end_copies`], so a
//! checkpoint never sees them; their host memory is the image's staging pools, pinned
//! with `cuMemHostRegister_v2` by the caller. Without the stream functions, async
//! copies run synchronously at issue; without `cuMemHostRegister_v2`,
//! `register_host` reports `CUDA_ERROR_NOT_SUPPORTED` and copies use pageable memory.
//!
//! The control thread has no current context: every call first makes the context the
//! driver was created in current on a thread that has none.
//!
//! Tested on CPU against tests/fake-libcuda through the interposition layer; not run
//! on a GPU yet.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use gpu_state::image::gpuhash::{hashable, ChunkSums, LANES, SEGMENT_WORDS};

use libloading::Library;
use thiserror::Error;

use crate::driver::{
    DevicePtr, DriverCall, PhysHandle, VmmDriver, VmmError, CUDA_ERROR_NOT_SUPPORTED,
};

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
type FnDtoD = unsafe extern "C" fn(DevicePtr, DevicePtr, usize) -> CuResult;
type FnMemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
type FnSync = unsafe extern "C" fn() -> CuResult;
/// `CU_MEMHOSTREGISTER_READ_ONLY`: the device only reads the memory.
const CU_MEMHOSTREGISTER_READ_ONLY: c_uint = 0x08;
type FnHostRegister = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult;
type FnHostUnregister = unsafe extern "C" fn(*mut c_void) -> CuResult;
type FnStreamCreate = unsafe extern "C" fn(*mut Stream, c_uint) -> CuResult;
type FnStreamSync = unsafe extern "C" fn(Stream) -> CuResult;
type FnDtoHAsync = unsafe extern "C" fn(*mut c_void, DevicePtr, usize, Stream) -> CuResult;
type FnHtoDAsync = unsafe extern "C" fn(DevicePtr, *const c_void, usize, Stream) -> CuResult;

type FnModuleLoadData = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CuResult;
type FnModuleGetFunction =
    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> CuResult;
type FnModuleUnload = unsafe extern "C" fn(*mut c_void) -> CuResult;
#[allow(clippy::type_complexity)]
type FnLaunchKernel = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Stream,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CuResult;
type FnMemAlloc = unsafe extern "C" fn(*mut DevicePtr, usize) -> CuResult;
type FnMemFree = unsafe extern "C" fn(DevicePtr) -> CuResult;
type FnMemsetD8Async = unsafe extern "C" fn(DevicePtr, u8, usize, Stream) -> CuResult;
type FnExport = unsafe extern "C" fn(*mut c_void, c_ulonglong, c_int, c_ulonglong) -> CuResult;
type FnImport = unsafe extern "C" fn(*mut c_ulonglong, *mut c_void, c_int) -> CuResult;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_TYPE_POSIX_FD: c_int = 1;

/// The gh1 kernel (`hook/kernels/gpuhash.cu`, built to PTX by `build-ptx.sh`),
/// NUL-terminated for `cuModuleLoadData`; the driver JIT-compiles it at first use.
const GH1_PTX: &str = concat!(include_str!("../kernels/gpuhash.ptx"), "\0");
const GH1_ENTRY: &std::ffi::CStr = c"gpucr_gh1";

/// `CUstream`.
type Stream = *mut c_void;

/// `CU_STREAM_NON_BLOCKING`: the copy streams do not wait for the legacy stream.
const STREAM_NON_BLOCKING: c_uint = 1;
/// Most copy streams one driver makes.
pub const MAX_STREAMS: usize = 64;

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

/// The functions of async copies on streams (all present, or none used).
#[derive(Clone, Copy)]
struct StreamFns {
    stream_create: FnStreamCreate,
    stream_sync: FnStreamSync,
    stream_destroy: FnStreamSync,
    dtoh_async: FnDtoHAsync,
    htod_async: FnHtoDAsync,
}

/// Host memory registration (both present, or none used).
#[derive(Clone, Copy)]
struct RegisterFns {
    register: FnHostRegister,
    unregister: FnHostUnregister,
}

/// What hashing on the device needs (all present, or no device hash).
#[derive(Clone, Copy)]
struct HashFns {
    load: FnModuleLoadData,
    get_function: FnModuleGetFunction,
    unload: FnModuleUnload,
    launch: FnLaunchKernel,
    alloc: FnMemAlloc,
    free: FnMemFree,
    memset: FnMemsetD8Async,
}

/// Exporting and importing physical memory as fds (both present, or no keeping).
#[derive(Clone, Copy)]
struct ShareFns {
    export: FnExport,
    import: FnImport,
}

/// The loaded gh1 module and its kernel (`CUmodule`, `CUfunction`).
struct Kernel {
    module: *mut c_void,
    function: *mut c_void,
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
    dtod: Option<FnDtoD>,
    mem_info: Option<FnMemInfo>,
    sync: FnSync,
    async_fns: Option<StreamFns>,
    register_fns: Option<RegisterFns>,
    hash_fns: Option<HashFns>,
    share_fns: Option<ShareFns>,
    /// New physical memory is made exportable (POSIX fd): off until
    /// [`CudaDriver::set_exportable`], and off for good after the driver refused once.
    exportable: AtomicBool,
    /// The gh1 kernel, loaded at the first device hash, unloaded by `end_copies`.
    kernel: Mutex<Option<Kernel>>,
    /// Loading the kernel failed once: no more tries (logged then).
    kernel_failed: AtomicBool,
    /// Copy streams, made at first use, destroyed by `end_copies`.
    streams: Mutex<Vec<Stream>>,
    _lib: Option<Library>,
}

// SAFETY: the driver API is thread-safe; the struct holds function pointers into the
// loaded library (kept alive by it or by the process), the context handle, and stream
// handles kept under the `streams` mutex.
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
    fn register_with(&self, ptr: *mut u8, len: usize, flags: c_uint) -> Result<(), VmmError> {
        let call = DriverCall::RegisterHost;
        let f = supported(call, self.register_fns)?;
        self.bind();
        check(call, unsafe { (f.register)(ptr.cast(), len, flags) })
    }

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
        let async_fns = (|| {
            Some(StreamFns {
                stream_create: want(resolve, "cuStreamCreate")?,
                stream_sync: want(resolve, "cuStreamSynchronize")?,
                stream_destroy: want(resolve, "cuStreamDestroy_v2")?,
                dtoh_async: want(resolve, "cuMemcpyDtoHAsync_v2")?,
                htod_async: want(resolve, "cuMemcpyHtoDAsync_v2")?,
            })
        })();
        let register_fns = (|| {
            Some(RegisterFns {
                register: want(resolve, "cuMemHostRegister_v2")?,
                unregister: want(resolve, "cuMemHostUnregister")?,
            })
        })();
        let hash_fns = (|| {
            Some(HashFns {
                load: want(resolve, "cuModuleLoadData")?,
                get_function: want(resolve, "cuModuleGetFunction")?,
                unload: want(resolve, "cuModuleUnload")?,
                launch: want(resolve, "cuLaunchKernel")?,
                alloc: want(resolve, "cuMemAlloc_v2")?,
                free: want(resolve, "cuMemFree_v2")?,
                memset: want(resolve, "cuMemsetD8Async")?,
            })
        })();
        let share_fns = (|| {
            Some(ShareFns {
                export: want(resolve, "cuMemExportToShareableHandle")?,
                import: want(resolve, "cuMemImportFromShareableHandle")?,
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
            dtod: want(resolve, "cuMemcpyDtoD_v2"),
            mem_info: want(resolve, "cuMemGetInfo_v2"),
            sync: need(resolve, "cuCtxSynchronize")?,
            async_fns,
            register_fns,
            hash_fns,
            share_fns,
            exportable: AtomicBool::new(false),
            kernel: Mutex::new(None),
            kernel_failed: AtomicBool::new(false),
            streams: Mutex::new(Vec::new()),
            _lib: None,
        })
    }

    /// The device the driver allocates on.
    pub fn device(&self) -> c_int {
        self.device
    }

    /// Makes physical memory created from now on exportable as a POSIX fd (what
    /// [`VmmDriver::export`] needs), when this libcuda can export at all.
    pub fn set_exportable(&self, on: bool) {
        self.exportable
            .store(on && self.share_fns.is_some(), Ordering::Relaxed);
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

    /// Loads the gh1 module (the driver JIT-compiles the PTX) and finds its kernel.
    fn load_kernel(&self, h: &HashFns) -> Result<Kernel, VmmError> {
        let call = DriverCall::Hash;
        let mut module = std::ptr::null_mut();
        // SAFETY: NUL-terminated PTX text; out-pointer to a local.
        check(call, unsafe {
            (h.load)(&mut module, GH1_PTX.as_ptr().cast())
        })?;
        let mut function = std::ptr::null_mut();
        // SAFETY: the module just loaded; a NUL-terminated name.
        let rc = unsafe { (h.get_function)(&mut function, module, GH1_ENTRY.as_ptr()) };
        if rc != 0 {
            // SAFETY: our module, unused.
            unsafe { (h.unload)(module) };
            return Err(VmmError { call, code: rc });
        }
        Ok(Kernel { module, function })
    }

    /// Copy stream `index`, made (with those before it) at first use.
    fn stream(&self, f: &StreamFns, call: DriverCall, index: usize) -> Result<Stream, VmmError> {
        if index >= MAX_STREAMS {
            return Err(VmmError {
                call,
                code: crate::driver::CUDA_ERROR_INVALID_VALUE,
            });
        }
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        while streams.len() <= index {
            let mut s = std::ptr::null_mut();
            // SAFETY: out-pointer to a local.
            check(call, unsafe {
                (f.stream_create)(&mut s, STREAM_NON_BLOCKING)
            })?;
            streams.push(s);
        }
        Ok(streams[index])
    }
}

/// Optional driver functions `f`, or `CUDA_ERROR_NOT_SUPPORTED` for `call` when this
/// libcuda lacks them.
fn supported<T>(call: DriverCall, f: Option<T>) -> Result<T, VmmError> {
    f.ok_or(VmmError {
        call,
        code: CUDA_ERROR_NOT_SUPPORTED,
    })
}

fn check(call: DriverCall, rc: CuResult) -> Result<(), VmmError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(VmmError { call, code: rc })
    }
}

/// A size for the C API; sizes the hook passes always fit in `usize` on 64-bit Linux.
fn csize(call: DriverCall, size: u64) -> Result<usize, VmmError> {
    usize::try_from(size).map_err(|_| VmmError {
        call,
        code: crate::driver::CUDA_ERROR_INVALID_VALUE,
    })
}

// SAFETY (all methods): arguments follow cuda.h's contracts; out-pointers point to
// live locals; host buffers are valid for their full length.
impl VmmDriver for CudaDriver {
    fn granularity(&self) -> Result<u64, VmmError> {
        self.bind();
        let mut g = 0usize;
        let prop = self.prop();
        let rc = unsafe { (self.granularity)(&mut g, &prop, GRANULARITY_MINIMUM) };
        check(DriverCall::Granularity, rc).map(|()| g as u64)
    }

    fn reserve(&self, size: u64, fixed: Option<DevicePtr>) -> Result<DevicePtr, VmmError> {
        self.bind();
        let call = DriverCall::AddressReserve;
        let mut va: DevicePtr = 0;
        let rc = unsafe { (self.reserve)(&mut va, csize(call, size)?, 0, fixed.unwrap_or(0), 0) };
        check(call, rc)?;
        Ok(va)
    }

    fn create(&self, size: u64) -> Result<PhysHandle, VmmError> {
        self.bind();
        let call = DriverCall::Create;
        let size = csize(call, size)?;
        let mut handle: c_ulonglong = 0;
        let mut prop = self.prop();
        if self.exportable.load(Ordering::Relaxed) {
            prop.requested_handle_types = HANDLE_TYPE_POSIX_FD;
            let rc = unsafe { (self.create)(&mut handle, size, &prop, 0) };
            if rc == 0 || rc == crate::driver::CUDA_ERROR_OUT_OF_MEMORY {
                return check(call, rc).map(|()| PhysHandle(handle));
            }
            // This GPU or driver makes no exportable memory: plain memory from now on
            // (a leave-running checkpoint then copies it back in instead of keeping it).
            self.exportable.store(false, Ordering::Relaxed);
            tracing::warn!(
                code = rc,
                "exportable device memory refused; allocating plain memory"
            );
            prop.requested_handle_types = 0;
        }
        let rc = unsafe { (self.create)(&mut handle, size, &prop, 0) };
        check(call, rc).map(|()| PhysHandle(handle))
    }

    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle) -> Result<(), VmmError> {
        self.bind();
        let call = DriverCall::Map;
        check(call, unsafe {
            (self.map)(va, csize(call, size)?, 0, handle.0, 0)
        })
    }

    fn set_access(&self, va: DevicePtr, size: u64) -> Result<(), VmmError> {
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

    fn unmap(&self, va: DevicePtr, size: u64) -> Result<(), VmmError> {
        self.bind();
        let call = DriverCall::Unmap;
        check(call, unsafe { (self.unmap)(va, csize(call, size)?) })
    }

    fn release(&self, handle: PhysHandle) -> Result<(), VmmError> {
        self.bind();
        check(DriverCall::Release, unsafe { (self.release)(handle.0) })
    }

    fn free_va(&self, va: DevicePtr, size: u64) -> Result<(), VmmError> {
        self.bind();
        let call = DriverCall::AddressFree;
        check(call, unsafe { (self.address_free)(va, csize(call, size)?) })
    }

    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), VmmError> {
        self.bind();
        let rc = unsafe { (self.dtoh)(dst.as_mut_ptr().cast(), src, dst.len()) };
        check(DriverCall::CopyToHost, rc)
    }

    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<(), VmmError> {
        self.bind();
        let rc = unsafe { (self.htod)(dst, src.as_ptr().cast(), src.len()) };
        check(DriverCall::CopyFromHost, rc)
    }

    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, len: u64) -> Result<(), VmmError> {
        let call = DriverCall::CopyDevice;
        let dtod = supported(call, self.dtod)?;
        self.bind();
        check(call, unsafe { dtod(dst, src, csize(call, len)?) })?;
        // cuMemcpyDtoD returns before a device-to-device copy is done: wait, or the
        // caller unmaps memory the copy still reads (an illegal address, seen on a GPU,
        // and the context is lost).
        check(call, unsafe { (self.sync)() })
    }

    fn device_ordinal(&self) -> Option<i32> {
        Some(self.device)
    }

    fn free_memory(&self) -> Result<Option<u64>, VmmError> {
        let Some(f) = self.mem_info else {
            return Ok(None);
        };
        self.bind();
        let (mut free, mut total) = (0usize, 0usize);
        check(DriverCall::MemInfo, unsafe { f(&mut free, &mut total) })?;
        Ok(Some(free as u64))
    }

    fn register_host(&self, ptr: *mut u8, len: usize) -> Result<(), VmmError> {
        // Flags 0: pinned for this context only, no device mapping needed.
        self.register_with(ptr, len, 0)
    }

    fn register_host_read_only(&self, ptr: *const u8, len: usize) -> Result<(), VmmError> {
        // A PROT_READ mapping cannot be pinned for writing.
        self.register_with(ptr.cast_mut(), len, CU_MEMHOSTREGISTER_READ_ONLY)
    }

    fn unregister_host(&self, ptr: *mut u8) -> Result<(), VmmError> {
        let call = DriverCall::UnregisterHost;
        let f = supported(call, self.register_fns)?;
        self.bind();
        check(call, unsafe { (f.unregister)(ptr.cast()) })
    }

    unsafe fn copy_to_host_async(
        &self,
        src: DevicePtr,
        dst: *mut u8,
        len: usize,
        stream: usize,
    ) -> Result<(), VmmError> {
        self.bind();
        let call = DriverCall::CopyToHost;
        let Some(f) = self.async_fns else {
            return check(call, (self.dtoh)(dst.cast(), src, len));
        };
        let s = self.stream(&f, call, stream)?;
        check(call, (f.dtoh_async)(dst.cast(), src, len, s))
    }

    unsafe fn copy_from_host_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: usize,
    ) -> Result<(), VmmError> {
        self.bind();
        let call = DriverCall::CopyFromHost;
        let Some(f) = self.async_fns else {
            return check(call, (self.htod)(dst, src.cast(), len));
        };
        let s = self.stream(&f, call, stream)?;
        check(call, (f.htod_async)(dst, src.cast(), len, s))
    }

    fn wait(&self, stream: usize) -> Result<(), VmmError> {
        let Some(f) = self.async_fns else {
            return Ok(());
        };
        let s = {
            let streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
            match streams.get(stream) {
                Some(s) => *s,
                // Never made: nothing was issued on it.
                None => return Ok(()),
            }
        };
        self.bind();
        check(DriverCall::Wait, unsafe { (f.stream_sync)(s) })
    }

    fn synchronize(&self) -> Result<(), VmmError> {
        self.bind();
        check(DriverCall::Synchronize, unsafe { (self.sync)() })
    }

    fn chunk_sums(
        &self,
        regions: &[(DevicePtr, u64)],
        chunk: u64,
    ) -> Result<Option<Vec<Vec<ChunkSums>>>, VmmError> {
        let (Some(h), Some(f)) = (self.hash_fns, self.async_fns) else {
            return Ok(None);
        };
        // gh1 reads whole words; VMM allocations are granularity multiples anyway.
        if chunk == 0 || !hashable(chunk) || regions.iter().any(|r| !hashable(r.1)) {
            return Ok(None);
        }
        self.bind();
        let mut kernel = self.kernel.lock().unwrap_or_else(|p| p.into_inner());
        if kernel.is_none() {
            if self.kernel_failed.load(Ordering::Relaxed) {
                return Ok(None);
            }
            match self.load_kernel(&h) {
                Ok(k) => *kernel = Some(k),
                Err(e) => {
                    self.kernel_failed.store(true, Ordering::Relaxed);
                    tracing::warn!(error = %e, "cannot load the hash kernel; hashing on the CPU");
                    return Ok(None);
                }
            }
        }
        let function = kernel.as_ref().expect("just loaded").function;
        let counts: Vec<u64> = regions.iter().map(|r| r.1.div_ceil(chunk)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return Ok(Some(regions.iter().map(|_| Vec::new()).collect()));
        }
        let call = DriverCall::Hash;
        let bytes = csize(call, total * 24)?;
        let stream = self.stream(&f, call, 0)?;
        let mut out: DevicePtr = 0;
        // SAFETY: out-pointer to a local; freed below on every path.
        check(call, unsafe { (h.alloc)(&mut out, bytes) })?;
        let result = (|| {
            // SAFETY: `out` is `bytes` long; the stream is ours.
            check(call, unsafe { (h.memset)(out, 0, bytes, stream) })?;
            let chunk_words = chunk / 8;
            let segs = chunk_words.div_ceil(SEGMENT_WORDS as u64);
            let mut at = 0u64;
            for (&(va, len), &n) in regions.iter().zip(&counts) {
                if n > 0 {
                    let blocks = c_uint::try_from(n * segs).map_err(|_| VmmError {
                        call,
                        code: crate::driver::CUDA_ERROR_INVALID_VALUE,
                    })?;
                    let (mut base, mut words, mut cw, mut sg, mut dst) =
                        (va, len / 8, chunk_words, segs, out + at * 24);
                    let mut params: [*mut c_void; 5] = [
                        (&mut base as *mut u64).cast(),
                        (&mut words as *mut u64).cast(),
                        (&mut cw as *mut u64).cast(),
                        (&mut sg as *mut u64).cast(),
                        (&mut dst as *mut u64).cast(),
                    ];
                    // SAFETY: the kernel's five u64 parameters, by address; the region is
                    // mapped device memory of `len` bytes; `dst` has room for `n` chunks.
                    check(call, unsafe {
                        (h.launch)(
                            function,
                            blocks,
                            1,
                            1,
                            LANES as c_uint,
                            1,
                            1,
                            0,
                            stream,
                            params.as_mut_ptr(),
                            std::ptr::null_mut(),
                        )
                    })?;
                }
                at += n;
            }
            // SAFETY: our stream.
            check(call, unsafe { (f.stream_sync)(stream) })?;
            let mut host = vec![0u64; total as usize * 3];
            // SAFETY: `host` holds `bytes` bytes; the kernels are done.
            check(call, unsafe {
                (self.dtoh)(host.as_mut_ptr().cast(), out, bytes)
            })?;
            let mut sums = host.chunks_exact(3).map(|w| ChunkSums {
                a: w[0],
                b: w[1],
                or: w[2],
            });
            Ok(counts
                .iter()
                .map(|&n| sums.by_ref().take(n as usize).collect())
                .collect())
        })();
        // SAFETY: allocated above; the stream was synchronized (or failed, and then
        // cuMemFree waits for the device itself).
        unsafe { (h.free)(out) };
        result.map(Some)
    }

    fn export(&self, handle: PhysHandle) -> Result<Option<OwnedFd>, VmmError> {
        let Some(f) = self.share_fns else {
            return Ok(None);
        };
        self.bind();
        let mut fd: c_int = -1;
        check(DriverCall::Export, unsafe {
            (f.export)(
                (&mut fd as *mut c_int).cast(),
                handle.0,
                HANDLE_TYPE_POSIX_FD,
                0,
            )
        })?;
        // SAFETY: the driver just opened this fd for us.
        Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn import(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle, VmmError> {
        let call = DriverCall::Import;
        let f = supported(call, self.share_fns)?;
        self.bind();
        let mut handle: c_ulonglong = 0;
        // The POSIX fd is passed as the pointer-sized value itself.
        let os_handle = fd.as_raw_fd() as usize as *mut c_void;
        check(call, unsafe {
            (f.import)(&mut handle, os_handle, HANDLE_TYPE_POSIX_FD)
        })?;
        Ok(PhysHandle(handle))
    }

    fn end_copies(&self) {
        if let (Some(k), Some(h)) = (
            self.kernel.lock().unwrap_or_else(|p| p.into_inner()).take(),
            self.hash_fns,
        ) {
            self.bind();
            // SAFETY: our module; nothing launches from it after this.
            unsafe { (h.unload)(k.module) };
        }
        let streams = std::mem::take(&mut *self.streams.lock().unwrap_or_else(|p| p.into_inner()));
        if let (false, Some(f)) = (streams.is_empty(), self.async_fns) {
            self.bind();
            for s in streams {
                // SAFETY: streams made by this driver; nothing uses them after.
                unsafe {
                    (f.stream_sync)(s);
                    (f.stream_destroy)(s);
                }
            }
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
