//! The memory half of the fake driver: contexts, plain and VMM allocations, copies,
//! streams and one built-in kernel, all on the CPU. Device pointers are host addresses,
//! so a test program can read "device memory" directly.
//!
//! VMM physical memory is a memfd; a reservation is a `PROT_NONE` mapping; `cuMemMap`
//! maps the memfd over it (`MAP_FIXED | MAP_SHARED`), `cuMemSetAccess` makes it
//! readable and writable, `cuMemUnmap` puts `PROT_NONE` anonymous memory back. So a
//! released allocation shows in `/proc/<pid>/maps` as `---p`, and `cuMemAlloc_v2` (a
//! plain anonymous mapping) is told apart from VMM allocations in the log.
//!
//! Memory calls need a current context (`cuCtxSetCurrent` of the primary context), as
//! with the real driver: 201 INVALID_CONTEXT otherwise. Each call is appended to
//! `$GPUCR_FAKE_CUDA_MEM_LOG` (when set) as `<function> <args> -> <rc>`.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::fs::OpenOptions;
use std::io::Write;
use std::sync::Mutex;

use crate::{INVALID_VALUE, SUCCESS};

type CuResult = c_int;
type DevicePtr = c_ulonglong;

const OUT_OF_MEMORY: CuResult = 2;
const INVALID_CONTEXT: CuResult = 201;
const NOT_FOUND: CuResult = 500;

/// 2 MiB, like current NVIDIA GPUs.
pub const GRANULARITY: usize = 2 << 20;
/// The primary context's handle (any non-null value).
const PRIMARY_CTX: usize = 0xC7C7_0000;

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

#[derive(Default)]
struct Tables {
    /// memfds of `cuMemCreate`, by handle.
    physical: BTreeMap<u64, (c_int, usize)>,
    /// Handles made by `cuMemImportFromShareableHandle`: not exported again, as with the
    /// real driver on the H200.
    imported: std::collections::BTreeSet<u64>,
    next_handle: u64,
    /// Plain mappings (`cuMemAlloc_v2`, managed, host, pool): address → size.
    plain: BTreeMap<usize, usize>,
    next_stream: usize,
}

impl Tables {
    /// A new physical-memory handle for the memfd `fd` of `size` bytes.
    fn add_physical(&mut self, fd: c_int, size: usize, imported: bool) -> u64 {
        self.next_handle += 1;
        self.physical.insert(self.next_handle, (fd, size));
        if imported {
            self.imported.insert(self.next_handle);
        }
        self.next_handle
    }
}

static TABLES: Mutex<Option<Tables>> = Mutex::new(None);

fn with_tables<T>(f: impl FnOnce(&mut Tables) -> T) -> T {
    let mut guard = TABLES.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(Tables::default))
}

fn log(line: std::fmt::Arguments<'_>, rc: CuResult) -> CuResult {
    if let Some(path) = std::env::var_os("GPUCR_FAKE_CUDA_MEM_LOG") {
        if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
            let _ = f.write_all(format!("{line} -> {rc}\n").as_bytes());
        }
    }
    rc
}

fn has_context() -> bool {
    CURRENT.with(|c| c.get()) != 0
}

macro_rules! need_ctx {
    ($what:literal) => {
        if !has_context() {
            return log(format_args!($what), INVALID_CONTEXT);
        }
    };
}

/// An anonymous read/write mapping of `size` bytes (at least one page).
fn map_plain(size: usize) -> Option<usize> {
    // SAFETY: a fresh anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    with_tables(|t| t.plain.insert(p as usize, size.max(1)));
    Some(p as usize)
}

fn unmap_plain(addr: usize) -> bool {
    let Some(size) = with_tables(|t| t.plain.remove(&addr)) else {
        return false;
    };
    // SAFETY: `addr` is a mapping of `size` bytes this module created.
    unsafe { libc::munmap(addr as *mut c_void, size) };
    true
}

/// # Safety
/// `out` is NULL or valid for a write.
unsafe fn alloc_plain(what: &str, out: *mut DevicePtr, size: usize) -> CuResult {
    if out.is_null() || size == 0 {
        return log(format_args!("{what} {size}"), INVALID_VALUE);
    }
    match map_plain(size) {
        Some(p) => {
            *out = p as DevicePtr;
            log(format_args!("{what} {p:#x} {size}"), SUCCESS)
        }
        None => log(format_args!("{what} {size}"), OUT_OF_MEMORY),
    }
}

#[no_mangle]
pub extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CuResult {
    if dev.is_null() || ordinal != 0 {
        return INVALID_VALUE;
    }
    // SAFETY: checked non-null; the caller passes a valid out-pointer.
    unsafe { *dev = ordinal };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CuResult {
    if ctx.is_null() || dev != 0 {
        return INVALID_VALUE;
    }
    // SAFETY: as above.
    unsafe { *ctx = PRIMARY_CTX as *mut c_void };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CuResult {
    CURRENT.with(|c| c.set(ctx as usize));
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CuResult {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: as above.
    unsafe { *ctx = CURRENT.with(|c| c.get()) as *mut c_void };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CuResult {
    if dev.is_null() {
        return INVALID_VALUE;
    }
    if !has_context() {
        return INVALID_CONTEXT;
    }
    // SAFETY: as above.
    unsafe { *dev = 0 };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    need_ctx!("cuCtxSynchronize");
    log(format_args!("cuCtxSynchronize"), SUCCESS)
}

/// # Safety
/// `g` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    g: *mut usize,
    _prop: *const c_void,
    _option: c_int,
) -> CuResult {
    need_ctx!("cuMemGetAllocationGranularity");
    if g.is_null() {
        return INVALID_VALUE;
    }
    *g = GRANULARITY;
    SUCCESS
}

/// # Safety
/// `ptr` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut DevicePtr,
    size: usize,
    _alignment: usize,
    addr: DevicePtr,
    _flags: c_ulonglong,
) -> CuResult {
    need_ctx!("cuMemAddressReserve");
    if ptr.is_null() || size == 0 || size & (GRANULARITY - 1) != 0 {
        return log(format_args!("cuMemAddressReserve {size}"), INVALID_VALUE);
    }
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // The hint first (honoured when free), else anywhere, aligned to the granularity.
    if addr != 0 {
        let p = libc::mmap(
            addr as *mut c_void,
            size,
            libc::PROT_NONE,
            flags | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        );
        if p != libc::MAP_FAILED {
            *ptr = p as DevicePtr;
            return log(
                format_args!("cuMemAddressReserve {p:p} {size} fixed"),
                SUCCESS,
            );
        }
    }
    let span = size + GRANULARITY;
    let p = libc::mmap(std::ptr::null_mut(), span, libc::PROT_NONE, flags, -1, 0);
    if p == libc::MAP_FAILED {
        return log(format_args!("cuMemAddressReserve {size}"), OUT_OF_MEMORY);
    }
    let start = p as usize;
    let aligned = start.next_multiple_of(GRANULARITY);
    if aligned > start {
        libc::munmap(p, aligned - start);
    }
    let tail = start + span - (aligned + size);
    if tail > 0 {
        libc::munmap((aligned + size) as *mut c_void, tail);
    }
    *ptr = aligned as DevicePtr;
    log(
        format_args!("cuMemAddressReserve {aligned:#x} {size}"),
        SUCCESS,
    )
}

#[no_mangle]
pub extern "C" fn cuMemAddressFree(ptr: DevicePtr, size: usize) -> CuResult {
    need_ctx!("cuMemAddressFree");
    // SAFETY: the caller frees a reservation it made.
    let rc = unsafe { libc::munmap(ptr as *mut c_void, size) };
    log(
        format_args!("cuMemAddressFree {ptr:#x} {size}"),
        if rc == 0 { SUCCESS } else { INVALID_VALUE },
    )
}

/// # Safety
/// `handle` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut c_ulonglong,
    size: usize,
    _prop: *const c_void,
    _flags: c_ulonglong,
) -> CuResult {
    need_ctx!("cuMemCreate");
    if handle.is_null() || size == 0 || size & (GRANULARITY - 1) != 0 {
        return log(format_args!("cuMemCreate {size}"), INVALID_VALUE);
    }
    let fd = libc::memfd_create(c"fake-cuda-physical".as_ptr(), libc::MFD_CLOEXEC);
    if fd < 0 || libc::ftruncate(fd, size as libc::off_t) != 0 {
        if fd >= 0 {
            libc::close(fd);
        }
        return log(format_args!("cuMemCreate {size}"), OUT_OF_MEMORY);
    }
    let h = with_tables(|t| t.add_physical(fd, size, false));
    *handle = h;
    log(format_args!("cuMemCreate {size} handle={h}"), SUCCESS)
}

/// Free and total "device memory": `$GPUCR_FAKE_CUDA_MEM_TOTAL` bytes (default 64 GiB)
/// less the physical memory this process holds.
///
/// # Safety
/// `free` and `total` valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    need_ctx!("cuMemGetInfo_v2");
    if free.is_null() || total.is_null() {
        return log(format_args!("cuMemGetInfo_v2"), INVALID_VALUE);
    }
    let all = std::env::var("GPUCR_FAKE_CUDA_MEM_TOTAL")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(64 << 30);
    let used: usize = with_tables(|t| t.physical.values().map(|(_, size)| size).sum());
    *total = all;
    *free = all.saturating_sub(used);
    log(format_args!("cuMemGetInfo_v2 free={}", *free), SUCCESS)
}

#[no_mangle]
pub extern "C" fn cuMemRelease(handle: c_ulonglong) -> CuResult {
    need_ctx!("cuMemRelease");
    match with_tables(|t| {
        t.imported.remove(&handle);
        t.physical.remove(&handle)
    }) {
        Some((fd, _)) => {
            // SAFETY: our memfd; mappings of it stay valid after close, like the driver's
            // deferred release.
            unsafe { libc::close(fd) };
            log(format_args!("cuMemRelease {handle}"), SUCCESS)
        }
        None => log(format_args!("cuMemRelease {handle}"), INVALID_VALUE),
    }
}

/// `cuMemExportToShareableHandle` with a POSIX fd: a duplicate of the memfd, which keeps
/// the memory alive after `cuMemRelease`, as the driver's exported fd does.
///
/// # Safety
/// `out` valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    out: *mut c_void,
    handle: c_ulonglong,
    kind: c_int,
    _flags: c_ulonglong,
) -> CuResult {
    need_ctx!("cuMemExportToShareableHandle");
    let found = with_tables(|t| {
        t.physical
            .get(&handle)
            .copied()
            .filter(|_| !t.imported.contains(&handle))
    });
    // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only.
    let Some((fd, _)) = found.filter(|_| !out.is_null() && kind == 1) else {
        return log(
            format_args!("cuMemExportToShareableHandle {handle}"),
            INVALID_VALUE,
        );
    };
    let dup = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0);
    if dup < 0 {
        return log(
            format_args!("cuMemExportToShareableHandle {handle}"),
            OUT_OF_MEMORY,
        );
    }
    *out.cast::<c_int>() = dup;
    log(
        format_args!("cuMemExportToShareableHandle {handle} fd={dup}"),
        SUCCESS,
    )
}

/// `cuMemImportFromShareableHandle` of a POSIX fd (passed as the pointer's value): a new
/// handle on a duplicate of it.
///
/// # Safety
/// `handle` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut c_ulonglong,
    os_handle: *mut c_void,
    kind: c_int,
) -> CuResult {
    need_ctx!("cuMemImportFromShareableHandle");
    let fd = os_handle as usize as c_int;
    let mut st: libc::stat = std::mem::zeroed();
    if handle.is_null() || kind != 1 || libc::fstat(fd, &mut st) != 0 || st.st_size <= 0 {
        return log(
            format_args!("cuMemImportFromShareableHandle fd={fd}"),
            INVALID_VALUE,
        );
    }
    let dup = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0);
    if dup < 0 {
        return log(
            format_args!("cuMemImportFromShareableHandle fd={fd}"),
            OUT_OF_MEMORY,
        );
    }
    let h = with_tables(|t| t.add_physical(dup, st.st_size as usize, true));
    *handle = h;
    log(
        format_args!("cuMemImportFromShareableHandle fd={fd} handle={h}"),
        SUCCESS,
    )
}

#[no_mangle]
pub extern "C" fn cuMemMap(
    ptr: DevicePtr,
    size: usize,
    offset: usize,
    handle: c_ulonglong,
    _flags: c_ulonglong,
) -> CuResult {
    need_ctx!("cuMemMap");
    let Some((fd, phys)) = with_tables(|t| t.physical.get(&handle).copied()) else {
        return log(format_args!("cuMemMap {ptr:#x} {size}"), INVALID_VALUE);
    };
    if offset + size > phys {
        return log(format_args!("cuMemMap {ptr:#x} {size}"), INVALID_VALUE);
    }
    // SAFETY: replaces part of a PROT_NONE reservation the caller made.
    let p = unsafe {
        libc::mmap(
            ptr as *mut c_void,
            size,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            offset as libc::off_t,
        )
    };
    let rc = if p == libc::MAP_FAILED {
        OUT_OF_MEMORY
    } else {
        SUCCESS
    };
    log(format_args!("cuMemMap {ptr:#x} {size} handle={handle}"), rc)
}

#[no_mangle]
pub extern "C" fn cuMemSetAccess(
    ptr: DevicePtr,
    size: usize,
    desc: *const c_void,
    count: usize,
) -> CuResult {
    need_ctx!("cuMemSetAccess");
    if desc.is_null() || count == 0 {
        return log(
            format_args!("cuMemSetAccess {ptr:#x} {size}"),
            INVALID_VALUE,
        );
    }
    // SAFETY: the range is a mapping made by cuMemMap.
    let rc =
        unsafe { libc::mprotect(ptr as *mut c_void, size, libc::PROT_READ | libc::PROT_WRITE) };
    log(
        format_args!("cuMemSetAccess {ptr:#x} {size}"),
        if rc == 0 { SUCCESS } else { INVALID_VALUE },
    )
}

#[no_mangle]
pub extern "C" fn cuMemUnmap(ptr: DevicePtr, size: usize) -> CuResult {
    need_ctx!("cuMemUnmap");
    // SAFETY: turns a mapped range back into a PROT_NONE reservation.
    let p = unsafe {
        libc::mmap(
            ptr as *mut c_void,
            size,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    log(
        format_args!("cuMemUnmap {ptr:#x} {size}"),
        if p == libc::MAP_FAILED {
            INVALID_VALUE
        } else {
            SUCCESS
        },
    )
}

/// # Safety
/// `dptr` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, size: usize) -> CuResult {
    need_ctx!("cuMemAlloc_v2");
    alloc_plain("cuMemAlloc_v2", dptr, size)
}

/// # Safety
/// Out-pointers valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut DevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: c_uint,
) -> CuResult {
    need_ctx!("cuMemAllocPitch_v2");
    if pitch.is_null() || !matches!(element, 4 | 8 | 16) {
        return INVALID_VALUE;
    }
    let p = width.next_multiple_of(512);
    *pitch = p;
    alloc_plain("cuMemAllocPitch_v2", dptr, p * height)
}

/// # Safety
/// `dptr` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevicePtr,
    size: usize,
    _flags: c_uint,
) -> CuResult {
    need_ctx!("cuMemAllocManaged");
    alloc_plain("cuMemAllocManaged", dptr, size)
}

/// # Safety
/// `dptr` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut DevicePtr,
    size: usize,
    _stream: *mut c_void,
) -> CuResult {
    need_ctx!("cuMemAllocAsync");
    alloc_plain("cuMemAllocAsync", dptr, size)
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> CuResult {
    need_ctx!("cuMemFree_v2");
    let rc = if unmap_plain(dptr as usize) {
        SUCCESS
    } else {
        INVALID_VALUE
    };
    log(format_args!("cuMemFree_v2 {dptr:#x}"), rc)
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(dptr: DevicePtr, _stream: *mut c_void) -> CuResult {
    need_ctx!("cuMemFreeAsync");
    let rc = if unmap_plain(dptr as usize) {
        SUCCESS
    } else {
        INVALID_VALUE
    };
    log(format_args!("cuMemFreeAsync {dptr:#x}"), rc)
}

/// # Safety
/// `handle` points to 64 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut u8, dptr: DevicePtr) -> CuResult {
    need_ctx!("cuIpcGetMemHandle");
    if handle.is_null() {
        return INVALID_VALUE;
    }
    std::ptr::write_bytes(handle, 0, 64);
    handle.cast::<u64>().write_unaligned(dptr);
    log(format_args!("cuIpcGetMemHandle {dptr:#x}"), SUCCESS)
}

/// # Safety
/// `p` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    p: *mut *mut c_void,
    size: usize,
    _flags: c_uint,
) -> CuResult {
    need_ctx!("cuMemHostAlloc");
    if p.is_null() || size == 0 {
        return INVALID_VALUE;
    }
    match map_plain(size) {
        Some(a) => {
            *p = a as *mut c_void;
            log(format_args!("cuMemHostAlloc {a:#x} {size}"), SUCCESS)
        }
        None => OUT_OF_MEMORY,
    }
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CuResult {
    need_ctx!("cuMemFreeHost");
    let rc = if unmap_plain(p as usize) {
        SUCCESS
    } else {
        INVALID_VALUE
    };
    log(format_args!("cuMemFreeHost {p:p}"), rc)
}

/// Host ranges registered with `cuMemHostRegister_v2` (start → length).
static REGISTERED: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());
const HOST_MEMORY_ALREADY_REGISTERED: CuResult = 712;
const HOST_MEMORY_NOT_REGISTERED: CuResult = 713;

/// Pins nothing (all host memory is "device" memory here); records the range so that a
/// test sees every registration undone.
#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, size: usize, _flags: c_uint) -> CuResult {
    need_ctx!("cuMemHostRegister_v2");
    let mut registered = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    let rc = if p.is_null() || size == 0 {
        INVALID_VALUE
    } else {
        match registered.entry(p as usize) {
            std::collections::btree_map::Entry::Occupied(_) => HOST_MEMORY_ALREADY_REGISTERED,
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(size);
                SUCCESS
            }
        }
    };
    log(format_args!("cuMemHostRegister_v2 {p:p} {size}"), rc)
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CuResult {
    need_ctx!("cuMemHostUnregister");
    let removed = REGISTERED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(p as usize));
    let rc = if removed.is_some() {
        SUCCESS
    } else {
        HOST_MEMORY_NOT_REGISTERED
    };
    log(format_args!("cuMemHostUnregister {p:p}"), rc)
}

/// # Safety
/// `stream` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) -> CuResult {
    need_ctx!("cuStreamCreate");
    if stream.is_null() {
        return INVALID_VALUE;
    }
    let s = with_tables(|t| {
        t.next_stream += 1;
        t.next_stream
    });
    *stream = (0x5_0000 + s) as *mut c_void;
    log(format_args!("cuStreamCreate {s}"), SUCCESS)
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(_stream: *mut c_void) -> CuResult {
    need_ctx!("cuStreamSynchronize");
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CuResult {
    need_ctx!("cuStreamDestroy_v2");
    log(format_args!("cuStreamDestroy_v2 {stream:p}"), SUCCESS)
}

/// Copies `n` bytes between host addresses (device pointers are host addresses here).
///
/// # Safety
/// Both ranges valid for `n` bytes.
unsafe fn copy(what: &str, dst: usize, src: usize, n: usize) -> CuResult {
    need_ctx!("copy");
    if n > 0 && (dst == 0 || src == 0) {
        return log(format_args!("{what} {n}"), INVALID_VALUE);
    }
    std::ptr::copy(src as *const u8, dst as *mut u8, n);
    if n >= 1 << 20 {
        // Large copies only: a chunked copy-out would flood the log.
        log(format_args!("{what} {n}"), SUCCESS);
    }
    SUCCESS
}

/// # Safety
/// Valid ranges.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: DevicePtr, n: usize) -> CuResult {
    copy("cuMemcpyDtoH_v2", dst as usize, src as usize, n)
}

/// # Safety
/// Valid ranges.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: DevicePtr, src: *const c_void, n: usize) -> CuResult {
    copy("cuMemcpyHtoD_v2", dst as usize, src as usize, n)
}

/// # Safety
/// Valid ranges.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: DevicePtr, src: DevicePtr, n: usize) -> CuResult {
    copy("cuMemcpyDtoD_v2", dst as usize, src as usize, n)
}

/// # Safety
/// Valid ranges.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: DevicePtr,
    n: usize,
    _s: *mut c_void,
) -> CuResult {
    copy("cuMemcpyDtoHAsync_v2", dst as usize, src as usize, n)
}

/// # Safety
/// Valid ranges.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: DevicePtr,
    src: *const c_void,
    n: usize,
    _s: *mut c_void,
) -> CuResult {
    copy("cuMemcpyHtoDAsync_v2", dst as usize, src as usize, n)
}

/// # Safety
/// Valid ranges.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: DevicePtr,
    src: DevicePtr,
    n: usize,
    _s: *mut c_void,
) -> CuResult {
    copy("cuMemcpyDtoDAsync_v2", dst as usize, src as usize, n)
}

/// The per-thread-default-stream twin of `cuMemcpyDtoH_v2` (same behaviour here).
///
/// # Safety
/// Valid ranges.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2_ptds(
    dst: *mut c_void,
    src: DevicePtr,
    n: usize,
) -> CuResult {
    copy("cuMemcpyDtoH_v2_ptds", dst as usize, src as usize, n)
}

/// # Safety
/// Valid range.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: DevicePtr, value: u8, n: usize) -> CuResult {
    need_ctx!("cuMemsetD8_v2");
    std::ptr::write_bytes(dst as *mut u8, value, n);
    SUCCESS
}

/// The built-in "kernel": `kernelParams[0]` points to a device pointer,
/// `kernelParams[1]` to a byte count (`size_t`); adds 1 to every byte.
///
/// # Safety
/// `params` as described.
unsafe fn add_one_kernel(what: &str, params: *mut *mut c_void) -> CuResult {
    need_ctx!("cuLaunchKernel");
    if params.is_null() {
        return log(format_args!("{what}"), INVALID_VALUE);
    }
    let ptr = *(*params as *const DevicePtr) as *mut u8;
    let n = *(*params.add(1) as *const usize);
    for i in 0..n {
        let b = ptr.add(i);
        *b = (*b).wrapping_add(1);
    }
    log(format_args!("{what} {:#x} {n}", ptr as usize), SUCCESS)
}

/// # Safety
/// `params` as in [`add_one_kernel`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    _f: *mut c_void,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _stream: *mut c_void,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    add_one_kernel("cuLaunchKernel", params)
}

/// # Safety
/// `params` as in [`add_one_kernel`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
    _f: *mut c_void,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _stream: *mut c_void,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    add_one_kernel("cuLaunchKernel_ptsz", params)
}

/// Our exports by name, for `cuGetProcAddress` (never `dlsym`: an interposer would
/// hand back its own wrappers).
fn export(name: &str) -> Option<*mut c_void> {
    macro_rules! table {
        ($($f:ident),* $(,)?) => {
            match name {
                $(stringify!($f) => Some($f as *const () as *mut c_void),)*
                _ => None,
            }
        };
    }
    table!(
        cuInit,
        cuDriverGetVersion,
        cuGetProcAddress,
        cuGetProcAddress_v2,
        cuDeviceGet,
        cuDevicePrimaryCtxRetain,
        cuCtxSetCurrent,
        cuCtxGetCurrent,
        cuCtxGetDevice,
        cuCtxSynchronize,
        cuMemGetAllocationGranularity,
        cuMemAddressReserve,
        cuMemAddressFree,
        cuMemCreate,
        cuMemExportToShareableHandle,
        cuMemImportFromShareableHandle,
        cuMemRelease,
        cuMemGetInfo_v2,
        cuMemMap,
        cuMemSetAccess,
        cuMemUnmap,
        cuMemAlloc_v2,
        cuMemAllocPitch_v2,
        cuMemAllocManaged,
        cuMemAllocAsync,
        cuMemFree_v2,
        cuMemFreeAsync,
        cuIpcGetMemHandle,
        cuMemHostAlloc,
        cuMemFreeHost,
        cuMemHostRegister_v2,
        cuMemHostUnregister,
        cuStreamCreate,
        cuStreamSynchronize,
        cuStreamDestroy_v2,
        cuMemcpyDtoH_v2,
        cuMemcpyHtoD_v2,
        cuMemcpyDtoD_v2,
        cuMemcpyDtoHAsync_v2,
        cuMemcpyHtoDAsync_v2,
        cuMemcpyDtoDAsync_v2,
        cuMemcpyDtoH_v2_ptds,
        cuMemsetD8_v2,
        cuLaunchKernel,
        cuLaunchKernel_ptsz,
    )
}

use crate::{cuDriverGetVersion, cuInit};

/// Resolves `symbol` like the driver: the newest ABI (`_v2`) of the name, and with
/// flag 2 (`CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`) its `_ptds`/`_ptsz` twin
/// when there is one. `cuGetProcAddress` below version 12000 is the 4-argument one.
///
/// # Safety
/// `symbol` a C string, `pfn` valid for a write.
unsafe fn get_proc(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    if symbol.is_null() || pfn.is_null() {
        return INVALID_VALUE;
    }
    let name = CStr::from_ptr(symbol).to_string_lossy().into_owned();
    let mut candidates = Vec::new();
    if flags & 2 != 0 {
        for suffix in ["_v2_ptds", "_v2_ptsz", "_ptds", "_ptsz"] {
            candidates.push(format!("{name}{suffix}"));
        }
    }
    if !(name == "cuGetProcAddress" && version < 12000) {
        candidates.push(format!("{name}_v2"));
    }
    candidates.push(name.clone());
    let found = candidates.iter().find_map(|c| export(c));
    let rc = match found {
        Some(f) => {
            *pfn = f;
            SUCCESS
        }
        None => {
            *pfn = std::ptr::null_mut();
            NOT_FOUND
        }
    };
    log(
        format_args!("cuGetProcAddress {name} {version} {flags}"),
        rc,
    )
}

/// # Safety
/// As [`get_proc`].
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    get_proc(symbol, pfn, version, flags)
}

/// # Safety
/// As [`get_proc`]; `status` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    let rc = get_proc(symbol, pfn, version, flags);
    if !status.is_null() {
        // CU_GET_PROC_ADDRESS_SUCCESS = 0, SYMBOL_NOT_FOUND = 1.
        *status = if rc == SUCCESS { 0 } else { 1 };
    }
    rc
}
