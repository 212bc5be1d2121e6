//! The exported driver functions. Gated pass-throughs (launches, copies, memsets) come
//! from one signature list; allocation, free, `cuGetProcAddress` and the calls that
//! make memory unmovable are written out.
//!
//! Every wrapper forwards to its own real twin (`cuMemcpyDtoH_v2_ptds` to the real
//! `cuMemcpyDtoH_v2_ptds`, never to another variant), held in a [`Real`] slot per
//! exported name.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use super::{
    config, gate_guard, hook, hook_for_current_device, hook_or_init, note, CuResult, Real,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS,
};
use gpucr_hook::alloc::{AllocError, UnsupportedKind};

type DevicePtr = u64;
type Ptr = *mut c_void;
type PtrPtr = *mut *mut c_void;

/// Calls the real twin through `slot`, or answers NOT_FOUND when libcuda lacks it.
macro_rules! forward {
    ($slot:expr, fn($($ty:ty),*) $(, $arg:expr)* $(,)?) => {{
        let p = $slot.get();
        if p.is_null() {
            CUDA_ERROR_NOT_FOUND
        } else {
            // SAFETY: the slot holds libcuda's function of this name, whose prototype
            // in cuda.h is this one.
            let f = std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CuResult>(p);
            f($($arg),*)
        }
    }};
}

/// Gated pass-throughs: the call holds the freeze gate while it runs in the driver.
macro_rules! gated {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[allow(non_snake_case)]
            mod $name {
                pub(crate) static REAL: super::Real =
                    super::Real::new(match std::ffi::CStr::from_bytes_with_nul(
                        concat!(stringify!($name), "\0").as_bytes(),
                    ) {
                        Ok(c) => c,
                        Err(_) => panic!("bad name"),
                    });
            }

            /// Gated pass-through.
            ///
            /// # Safety
            /// As the driver function of this name.
            #[no_mangle]
            #[allow(clippy::too_many_arguments)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> CuResult {
                let _work = gate_guard();
                forward!($name::REAL, fn($($ty),*), $($arg),*)
            }
        )*

        fn gated_entry(name: &str) -> Option<(Ptr, &'static Real)> {
            match name {
                $(stringify!($name) => Some(($name as *const () as Ptr, &$name::REAL)),)*
                _ => None,
            }
        }

        const GATED_NAMES: &[&str] = &[$(stringify!($name)),*];
    };
}

/// Slots for the hand-written wrappers below.
macro_rules! special {
    ($($name:ident),* $(,)?) => {
        mod slot {
            $(
                #[allow(non_upper_case_globals)]
                pub(crate) static $name: super::Real =
                    super::Real::new(match std::ffi::CStr::from_bytes_with_nul(
                        concat!(stringify!($name), "\0").as_bytes(),
                    ) {
                        Ok(c) => c,
                        Err(_) => panic!("bad name"),
                    });
            )*
        }

        fn special_entry(name: &str) -> Option<(Ptr, &'static Real)> {
            match name {
                $(stringify!($name) => Some(($name as *const () as Ptr, &slot::$name)),)*
                _ => None,
            }
        }

        const SPECIAL_NAMES: &[&str] = &[$(stringify!($name)),*];
    };
}

gated! {
    cuLaunchKernel(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: Ptr, params: PtrPtr, extra: PtrPtr);
    cuLaunchKernel_ptsz(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: Ptr, params: PtrPtr, extra: PtrPtr);
    cuLaunchKernelEx(config: *const c_void, f: Ptr, params: PtrPtr, extra: PtrPtr);
    cuLaunchKernelEx_ptsz(config: *const c_void, f: Ptr, params: PtrPtr, extra: PtrPtr);
    cuLaunchCooperativeKernel(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: Ptr, params: PtrPtr);
    cuLaunchCooperativeKernel_ptsz(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: Ptr, params: PtrPtr);
    cuGraphLaunch(exec: Ptr, stream: Ptr);
    cuGraphLaunch_ptsz(exec: Ptr, stream: Ptr);
    cuMemcpy(dst: DevicePtr, src: DevicePtr, n: usize);
    cuMemcpy_ptds(dst: DevicePtr, src: DevicePtr, n: usize);
    cuMemcpyAsync(dst: DevicePtr, src: DevicePtr, n: usize, stream: Ptr);
    cuMemcpyAsync_ptsz(dst: DevicePtr, src: DevicePtr, n: usize, stream: Ptr);
    cuMemcpyPeer(dst: DevicePtr, dst_ctx: Ptr, src: DevicePtr, src_ctx: Ptr, n: usize);
    cuMemcpyPeer_ptds(dst: DevicePtr, dst_ctx: Ptr, src: DevicePtr, src_ctx: Ptr, n: usize);
    cuMemcpyPeerAsync(dst: DevicePtr, dst_ctx: Ptr, src: DevicePtr, src_ctx: Ptr, n: usize, stream: Ptr);
    cuMemcpyPeerAsync_ptsz(dst: DevicePtr, dst_ctx: Ptr, src: DevicePtr, src_ctx: Ptr, n: usize, stream: Ptr);
    cuMemcpyHtoD_v2(dst: DevicePtr, src: *const c_void, n: usize);
    cuMemcpyHtoD_v2_ptds(dst: DevicePtr, src: *const c_void, n: usize);
    cuMemcpyDtoH_v2(dst: Ptr, src: DevicePtr, n: usize);
    cuMemcpyDtoH_v2_ptds(dst: Ptr, src: DevicePtr, n: usize);
    cuMemcpyDtoD_v2(dst: DevicePtr, src: DevicePtr, n: usize);
    cuMemcpyDtoD_v2_ptds(dst: DevicePtr, src: DevicePtr, n: usize);
    cuMemcpyHtoDAsync_v2(dst: DevicePtr, src: *const c_void, n: usize, stream: Ptr);
    cuMemcpyHtoDAsync_v2_ptsz(dst: DevicePtr, src: *const c_void, n: usize, stream: Ptr);
    cuMemcpyDtoHAsync_v2(dst: Ptr, src: DevicePtr, n: usize, stream: Ptr);
    cuMemcpyDtoHAsync_v2_ptsz(dst: Ptr, src: DevicePtr, n: usize, stream: Ptr);
    cuMemcpyDtoDAsync_v2(dst: DevicePtr, src: DevicePtr, n: usize, stream: Ptr);
    cuMemcpyDtoDAsync_v2_ptsz(dst: DevicePtr, src: DevicePtr, n: usize, stream: Ptr);
    cuMemcpy2D_v2(copy: *const c_void);
    cuMemcpy2D_v2_ptds(copy: *const c_void);
    cuMemcpy2DUnaligned_v2(copy: *const c_void);
    cuMemcpy2DUnaligned_v2_ptds(copy: *const c_void);
    cuMemcpy2DAsync_v2(copy: *const c_void, stream: Ptr);
    cuMemcpy2DAsync_v2_ptsz(copy: *const c_void, stream: Ptr);
    cuMemcpy3D_v2(copy: *const c_void);
    cuMemcpy3D_v2_ptds(copy: *const c_void);
    cuMemcpy3DAsync_v2(copy: *const c_void, stream: Ptr);
    cuMemcpy3DAsync_v2_ptsz(copy: *const c_void, stream: Ptr);
    cuMemsetD8_v2(dst: DevicePtr, value: u8, n: usize);
    cuMemsetD8_v2_ptds(dst: DevicePtr, value: u8, n: usize);
    cuMemsetD16_v2(dst: DevicePtr, value: u16, n: usize);
    cuMemsetD16_v2_ptds(dst: DevicePtr, value: u16, n: usize);
    cuMemsetD32_v2(dst: DevicePtr, value: u32, n: usize);
    cuMemsetD32_v2_ptds(dst: DevicePtr, value: u32, n: usize);
    cuMemsetD8Async(dst: DevicePtr, value: u8, n: usize, stream: Ptr);
    cuMemsetD8Async_ptsz(dst: DevicePtr, value: u8, n: usize, stream: Ptr);
    cuMemsetD16Async(dst: DevicePtr, value: u16, n: usize, stream: Ptr);
    cuMemsetD16Async_ptsz(dst: DevicePtr, value: u16, n: usize, stream: Ptr);
    cuMemsetD32Async(dst: DevicePtr, value: u32, n: usize, stream: Ptr);
    cuMemsetD32Async_ptsz(dst: DevicePtr, value: u32, n: usize, stream: Ptr);
    cuMemsetD2D8_v2(dst: DevicePtr, pitch: usize, value: u8, width: usize, height: usize);
    cuMemsetD2D8_v2_ptds(dst: DevicePtr, pitch: usize, value: u8, width: usize, height: usize);
    cuMemsetD2D16_v2(dst: DevicePtr, pitch: usize, value: u16, width: usize, height: usize);
    cuMemsetD2D16_v2_ptds(dst: DevicePtr, pitch: usize, value: u16, width: usize, height: usize);
    cuMemsetD2D32_v2(dst: DevicePtr, pitch: usize, value: u32, width: usize, height: usize);
    cuMemsetD2D32_v2_ptds(dst: DevicePtr, pitch: usize, value: u32, width: usize, height: usize);
    cuMemsetD2D8Async(dst: DevicePtr, pitch: usize, value: u8, width: usize, height: usize, stream: Ptr);
    cuMemsetD2D8Async_ptsz(dst: DevicePtr, pitch: usize, value: u8, width: usize, height: usize, stream: Ptr);
    cuMemsetD2D16Async(dst: DevicePtr, pitch: usize, value: u16, width: usize, height: usize, stream: Ptr);
    cuMemsetD2D16Async_ptsz(dst: DevicePtr, pitch: usize, value: u16, width: usize, height: usize, stream: Ptr);
    cuMemsetD2D32Async(dst: DevicePtr, pitch: usize, value: u32, width: usize, height: usize, stream: Ptr);
    cuMemsetD2D32Async_ptsz(dst: DevicePtr, pitch: usize, value: u32, width: usize, height: usize, stream: Ptr);
}

special!(
    cuInit,
    cuGetProcAddress,
    cuGetProcAddress_v2,
    cuMemAlloc_v2,
    cuMemAllocPitch_v2,
    cuMemFree_v2,
    cuMemAllocManaged,
    cuMemAllocAsync,
    cuMemAllocAsync_ptsz,
    cuMemAllocFromPoolAsync,
    cuMemAllocFromPoolAsync_ptsz,
    cuMemFreeAsync,
    cuMemFreeAsync_ptsz,
    cuIpcGetMemHandle,
);

/// Our wrapper of the exported driver function `name` and its real twin's slot.
pub(crate) fn entry(name: &str) -> Option<(Ptr, &'static Real)> {
    gated_entry(name).or_else(|| special_entry(name))
}

/// The family a versioned name belongs to, as `cuGetProcAddress` is asked for it:
/// `cuMemcpyDtoH_v2_ptds` → `cuMemcpyDtoH`.
fn base_name(name: &str) -> &str {
    let name = name
        .strip_suffix("_ptds")
        .or_else(|| name.strip_suffix("_ptsz"))
        .unwrap_or(name);
    name.strip_suffix("_v2").unwrap_or(name)
}

fn per_thread(name: &str) -> bool {
    name.ends_with("_ptds") || name.ends_with("_ptsz")
}

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
const PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// After the real `cuGetProcAddress` put `*pfn`: our wrapper of the same variant when
/// we wrap `symbol`. The variant is the exported twin whose address the driver gave;
/// when it gave an address no export has, the flags and version pick the variant and
/// its slot takes the driver's pointer.
///
/// # Safety
/// `symbol` a C string, `pfn` valid, `*pfn` the driver's answer.
unsafe fn wrap_proc(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    let Ok(symbol) = CStr::from_ptr(symbol).to_str() else {
        return;
    };
    let real = *pfn;
    let base = base_name(symbol);
    let family: Vec<&str> = GATED_NAMES
        .iter()
        .chain(SPECIAL_NAMES)
        .copied()
        .filter(|n| base_name(n) == base)
        .collect();
    if family.is_empty() {
        return;
    }
    // Already ours (a driver whose own lookup finds the preloaded names): keeping it
    // is right, storing it in a slot would make the wrapper call itself.
    if family
        .iter()
        .any(|n| entry(n).is_some_and(|(w, _)| w == real))
    {
        return;
    }
    for name in &family {
        if let Some((wrapper, slot)) = entry(name) {
            if slot.get() == real {
                *pfn = wrapper;
                return;
            }
        }
    }
    // The ABI changed at cuGetProcAddress_v2 (12.0) and at the _v2 memory functions
    // (3.2); older requests keep the driver's pointer.
    let want_pt = flags & PER_THREAD_DEFAULT_STREAM != 0;
    let pick = if base == "cuGetProcAddress" {
        Some(if version >= 12000 {
            "cuGetProcAddress_v2"
        } else {
            "cuGetProcAddress"
        })
    } else if version < 3020 && family.iter().any(|n| n.contains("_v2")) {
        None
    } else {
        family
            .iter()
            .copied()
            .rev()
            .find(|n| per_thread(n) == want_pt)
    };
    let Some((wrapper, slot)) = pick.and_then(entry) else {
        note(format_args!(
            "cuGetProcAddress({symbol}, {version}, {flags}) not wrapped"
        ));
        return;
    };
    note(format_args!(
        "cuGetProcAddress({symbol}, {version}, {flags}) gave no exported address; wrapped as {}",
        pick.unwrap_or_default()
    ));
    slot.set(real);
    *pfn = wrapper;
}

/// # Safety
/// As the driver's `cuGetProcAddress` (12.x: `cuGetProcAddress` of CUDA 11.3–11.8).
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    let rc = forward!(
        slot::cuGetProcAddress,
        fn(*const c_char, PtrPtr, c_int, u64),
        symbol,
        pfn,
        version,
        flags
    );
    if rc == CUDA_SUCCESS && !symbol.is_null() && !pfn.is_null() && !(*pfn).is_null() {
        wrap_proc(symbol, pfn, version, flags);
    }
    rc
}

/// # Safety
/// As the driver's `cuGetProcAddress_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    let rc = forward!(
        slot::cuGetProcAddress_v2,
        fn(*const c_char, PtrPtr, c_int, u64, *mut c_int),
        symbol,
        pfn,
        version,
        flags,
        status
    );
    if rc == CUDA_SUCCESS && !symbol.is_null() && !pfn.is_null() && !(*pfn).is_null() {
        wrap_proc(symbol, pfn, version, flags);
    }
    rc
}

/// # Safety
/// As the driver's `cuInit`.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CuResult {
    // Reads the environment and registers the fork handler early.
    let _ = config();
    forward!(slot::cuInit, fn(c_uint), flags)
}

/// # Safety
/// As the driver's `cuMemAlloc_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, size: usize) -> CuResult {
    if !dptr.is_null() && size > 0 {
        if let Some(hook) = hook_for_current_device() {
            match hook.alloc(size as u64) {
                Ok(va) => {
                    *dptr = va;
                    return CUDA_SUCCESS;
                }
                // The driver's own allocation is left to the driver's checkpoint.
                Err(e) => note(format_args!("cuMemAlloc({size}) not backed by VMM: {e}")),
            }
        }
    }
    let _work = gate_guard();
    forward!(slot::cuMemAlloc_v2, fn(*mut DevicePtr, usize), dptr, size)
}

/// # Safety
/// As the driver's `cuMemAllocPitch_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut DevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: c_uint,
) -> CuResult {
    if !dptr.is_null() && !pitch.is_null() {
        if let Some(hook) = hook_for_current_device() {
            match hook.alloc_pitch(width as u64, height as u64, element) {
                Ok((va, p)) => {
                    *dptr = va;
                    *pitch = p as usize;
                    return CUDA_SUCCESS;
                }
                // Bad arguments get the driver's own error below.
                Err(e) => note(format_args!("cuMemAllocPitch not backed by VMM: {e}")),
            }
        }
    }
    let _work = gate_guard();
    forward!(
        slot::cuMemAllocPitch_v2,
        fn(*mut DevicePtr, *mut usize, usize, usize, c_uint),
        dptr,
        pitch,
        width,
        height,
        element
    )
}

/// # Safety
/// As the driver's `cuMemFree_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> CuResult {
    let _work = gate_guard();
    if let Some(hook) = hook() {
        match hook.free(dptr) {
            Ok(()) => return CUDA_SUCCESS,
            Err(AllocError::NotFound { .. }) => hook.forget_unsupported(dptr),
            Err(AllocError::Driver(e)) => return e.code,
            Err(_) => return CUDA_ERROR_INVALID_VALUE,
        }
    }
    forward!(slot::cuMemFree_v2, fn(DevicePtr), dptr)
}

/// Records `kind` at `*dptr` after the driver made it.
///
/// # Safety
/// `dptr` valid when `rc` is success.
unsafe fn record(
    rc: CuResult,
    kind: UnsupportedKind,
    dptr: *mut DevicePtr,
    size: usize,
) -> CuResult {
    if rc == CUDA_SUCCESS && !dptr.is_null() {
        if let Some(hook) = hook_or_init() {
            hook.record_unsupported(kind, *dptr, size as u64);
        }
    }
    rc
}

/// Managed memory is the driver's; the hook reports it so the shim uses the driver path.
///
/// # Safety
/// As the driver's `cuMemAllocManaged`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevicePtr,
    size: usize,
    flags: c_uint,
) -> CuResult {
    let rc = {
        let _work = gate_guard();
        forward!(
            slot::cuMemAllocManaged,
            fn(*mut DevicePtr, usize, c_uint),
            dptr,
            size,
            flags
        )
    };
    record(rc, UnsupportedKind::Managed, dptr, size)
}

/// # Safety
/// As the driver's `cuMemAllocAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut DevicePtr,
    size: usize,
    stream: Ptr,
) -> CuResult {
    let rc = {
        let _work = gate_guard();
        forward!(
            slot::cuMemAllocAsync,
            fn(*mut DevicePtr, usize, Ptr),
            dptr,
            size,
            stream
        )
    };
    record(rc, UnsupportedKind::PoolAllocation, dptr, size)
}

/// # Safety
/// As the driver's `cuMemAllocAsync_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut DevicePtr,
    size: usize,
    stream: Ptr,
) -> CuResult {
    let rc = {
        let _work = gate_guard();
        forward!(
            slot::cuMemAllocAsync_ptsz,
            fn(*mut DevicePtr, usize, Ptr),
            dptr,
            size,
            stream
        )
    };
    record(rc, UnsupportedKind::PoolAllocation, dptr, size)
}

/// # Safety
/// As the driver's `cuMemAllocFromPoolAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut DevicePtr,
    size: usize,
    pool: Ptr,
    stream: Ptr,
) -> CuResult {
    let rc = {
        let _work = gate_guard();
        forward!(
            slot::cuMemAllocFromPoolAsync,
            fn(*mut DevicePtr, usize, Ptr, Ptr),
            dptr,
            size,
            pool,
            stream
        )
    };
    record(rc, UnsupportedKind::PoolAllocation, dptr, size)
}

/// # Safety
/// As the driver's `cuMemAllocFromPoolAsync_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut DevicePtr,
    size: usize,
    pool: Ptr,
    stream: Ptr,
) -> CuResult {
    let rc = {
        let _work = gate_guard();
        forward!(
            slot::cuMemAllocFromPoolAsync_ptsz,
            fn(*mut DevicePtr, usize, Ptr, Ptr),
            dptr,
            size,
            pool,
            stream
        )
    };
    record(rc, UnsupportedKind::PoolAllocation, dptr, size)
}

/// Frees our allocation after the stream's work is done (stream order kept by
/// waiting), else forwards.
///
/// # Safety
/// As the driver's `cuMemFreeAsync`.
unsafe fn free_async(real: &Real, dptr: DevicePtr, stream: Ptr) -> CuResult {
    let _work = gate_guard();
    if let Some(hook) = hook() {
        if hook.allocator().get(dptr).is_some() {
            static STREAM_SYNC: Real = Real::new(c"cuStreamSynchronize");
            static CTX_SYNC: Real = Real::new(c"cuCtxSynchronize");
            // The default stream (legacy or per-thread) is covered by the context.
            let rc = if stream.is_null() {
                forward!(CTX_SYNC, fn())
            } else {
                forward!(STREAM_SYNC, fn(Ptr), stream)
            };
            if rc != CUDA_SUCCESS {
                return rc;
            }
            return match hook.free(dptr) {
                Ok(()) => CUDA_SUCCESS,
                Err(AllocError::Driver(e)) => e.code,
                Err(_) => CUDA_ERROR_INVALID_VALUE,
            };
        }
        hook.forget_unsupported(dptr);
    }
    forward!(real, fn(DevicePtr, Ptr), dptr, stream)
}

/// # Safety
/// As the driver's `cuMemFreeAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: DevicePtr, stream: Ptr) -> CuResult {
    free_async(&slot::cuMemFreeAsync, dptr, stream)
}

/// # Safety
/// As the driver's `cuMemFreeAsync_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: DevicePtr, stream: Ptr) -> CuResult {
    free_async(&slot::cuMemFreeAsync_ptsz, dptr, stream)
}

/// Memory shared with another process cannot be released under it: reported.
///
/// # Safety
/// As the driver's `cuIpcGetMemHandle` (`handle`: a 64-byte `CUipcMemHandle`).
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: Ptr, dptr: DevicePtr) -> CuResult {
    let rc = forward!(slot::cuIpcGetMemHandle, fn(Ptr, DevicePtr), handle, dptr);
    if rc == CUDA_SUCCESS {
        if let Some(hook) = hook_or_init() {
            let (va, size) = hook
                .allocator()
                .find(dptr)
                .map_or((dptr, 0), |a| (a.va, a.size));
            hook.record_unsupported(UnsupportedKind::IpcHandle, va, size);
        }
    }
    rc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_names() {
        assert_eq!(base_name("cuMemcpyDtoH_v2_ptds"), "cuMemcpyDtoH");
        assert_eq!(base_name("cuLaunchKernel_ptsz"), "cuLaunchKernel");
        assert_eq!(base_name("cuGetProcAddress_v2"), "cuGetProcAddress");
        assert_eq!(base_name("cuMemAlloc_v2"), "cuMemAlloc");
        assert!(per_thread("cuMemsetD8Async_ptsz"));
    }
}
