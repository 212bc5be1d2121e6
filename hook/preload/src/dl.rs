//! The dynamic loader side: the real `dlsym` (found with `dlvsym`, because `dlsym` in
//! this library is our own), libcuda's handle, and our exported `dlsym`, which hands
//! out our wrappers for `cu*` names looked up on libcuda's handle (PyTorch resolves
//! about 230 driver functions that way).
//!
//! Real driver functions are always looked up on libcuda's handle, which searches
//! libcuda and its dependencies only, never this preloaded library: a lookup through
//! `RTLD_DEFAULT` or `RTLD_NEXT` could find our own wrapper and recurse.
//!
//! Limitation: a `dlsym(RTLD_NEXT, ..)` by the application is answered by the real
//! `dlsym` called from here, so "next" is counted from this library, not from the
//! caller. For callers loaded before us (the executable) that is the same; a library
//! loaded after us that wraps a symbol with `RTLD_NEXT` would find itself.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicPtr, Ordering};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static LIBCUDA: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The soname applications and the CUDA runtime load.
const LIBCUDA_NAME: &CStr = c"libcuda.so.1";

/// glibc's `dlsym`: `GLIBC_2.34` where libdl moved into libc, `GLIBC_2.2.5` (x86_64's
/// base version) before.
pub(crate) fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p.is_null() {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
            // SAFETY: dlvsym with constant C strings; RTLD_NEXT skips this library.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                REAL_DLSYM.store(p, Ordering::Release);
                break;
            }
        }
    }
    // SAFETY: glibc's dlsym has this signature.
    (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) })
}

/// libcuda's handle if it is loaded already (nothing is loaded here).
pub(crate) fn libcuda_loaded() -> Option<*mut c_void> {
    let p = LIBCUDA.load(Ordering::Acquire);
    if !p.is_null() {
        return Some(p);
    }
    // SAFETY: RTLD_NOLOAD only returns an already loaded object's handle.
    let h = unsafe { libc::dlopen(LIBCUDA_NAME.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if h.is_null() {
        return None;
    }
    LIBCUDA.store(h, Ordering::Release);
    Some(h)
}

/// libcuda's handle, loading it when the application has not yet (it called a `cu*`
/// function, so it expects the driver).
pub(crate) fn libcuda() -> Option<*mut c_void> {
    if let Some(h) = libcuda_loaded() {
        return Some(h);
    }
    // SAFETY: loading the driver runs its constructors, as the application's own
    // dlopen would.
    let h = unsafe { libc::dlopen(LIBCUDA_NAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return None;
    }
    LIBCUDA.store(h, Ordering::Release);
    Some(h)
}

/// The real driver function `name` (NUL-terminated), or null.
pub(crate) fn real_cu(name: &CStr) -> *mut c_void {
    match (real_dlsym(), libcuda()) {
        // SAFETY: a live handle and a C string.
        (Some(dlsym), Some(h)) => unsafe { dlsym(h, name.as_ptr()) },
        _ => std::ptr::null_mut(),
    }
}

/// `dlsym`: the real lookup, then our wrapper instead when `name` is a driver
/// function we wrap and `handle` is libcuda's.
///
/// # Safety
/// As `dlsym(3)`.
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let Some(real) = real_dlsym() else {
        return std::ptr::null_mut();
    };
    let found = real(handle, name);
    if found.is_null() || name.is_null() {
        return found;
    }
    let name = CStr::from_ptr(name);
    if !name.to_bytes().starts_with(b"cu") || libcuda_loaded() != Some(handle) {
        return found;
    }
    match name.to_str().ok().and_then(super::wrappers::entry) {
        Some((wrapper, _)) => wrapper,
        None => found,
    }
}
