//! `libgpucr_hook.so`, the preload library: exported `cu*` functions with the driver's
//! ABI, `cuGetProcAddress` and `dlsym` handing those out, and the process's one [`Hook`]
//! (from the core crate, `gpucr-hook`) behind them.
//!
//! A package of its own so that nothing else links these `#[no_mangle]` symbols: the shim
//! depends on the core crate, and a workspace build must not give its binary `dlsym`.
//!
//! The hook is made lazily, by the first allocation call that finds the environment
//! enabled (`GPUCR_HOOK_SOCKET_DIR`) and a current context (VMM calls need one); until
//! then, and for ever when disabled, every wrapper is a pure pass-through. A failure
//! to make it is retried at the next allocation; the application never sees it.
//!
//! After `fork` the child runs without the hook (a `pthread_atfork` handler drops it):
//! the parent's CUDA context and control socket are not the child's, and a child that
//! `exec`s gets a fresh hook of its own through `LD_PRELOAD`.
//!
//! `GPUCR_HOOK_LOG=1` prints the hook's setup (and failures) on stderr.

mod dl;
mod wrappers;

use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use gpucr_hook::cuda::CudaDriver;
use gpucr_hook::fastpath::FastPathOptions;
use gpucr_hook::gate::GateGuard;
use gpucr_hook::hook::{Hook, HookConfig};

/// `CUresult`.
type CuResult = c_int;
const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_NOT_FOUND`: what a wrapper answers when libcuda lacks the function.
const CUDA_ERROR_NOT_FOUND: CuResult = 500;

static CONFIG: OnceLock<HookConfig> = OnceLock::new();
static HOOK: AtomicPtr<Hook<CudaDriver>> = AtomicPtr::new(std::ptr::null_mut());
static INIT: Mutex<()> = Mutex::new(());
/// Set in a forked child: no hook there.
static FORKED: AtomicBool = AtomicBool::new(false);

fn verbose() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var_os("GPUCR_HOOK_LOG").is_some_and(|v| v != "0"))
}

/// Prints a setup message on stderr when `GPUCR_HOOK_LOG` is set.
fn note(msg: std::fmt::Arguments<'_>) {
    if verbose() {
        eprintln!("gpucr-hook[{}]: {msg}", std::process::id());
    }
}

extern "C" fn forked_child() {
    FORKED.store(true, Ordering::SeqCst);
    HOOK.store(std::ptr::null_mut(), Ordering::SeqCst);
}

fn config() -> &'static HookConfig {
    CONFIG.get_or_init(|| {
        // SAFETY: registers a handler that only stores two atomics.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        HookConfig::from_env(|k| std::env::var_os(k))
    })
}

/// The hook, if it is made (never in a forked child).
fn hook() -> Option<&'static Hook<CudaDriver>> {
    let p = HOOK.load(Ordering::Acquire);
    // SAFETY: a non-null pointer is a leaked Box, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The hook, made now if enabled and possible.
fn hook_or_init() -> Option<&'static Hook<CudaDriver>> {
    if let Some(h) = hook() {
        return Some(h);
    }
    if FORKED.load(Ordering::SeqCst) {
        return None;
    }
    let HookConfig::Enabled { socket_dir } = config() else {
        return None;
    };
    let _once = INIT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = hook() {
        return Some(h);
    }
    let hook = match make_hook() {
        Ok(h) => Box::leak(Box::new(h)),
        Err(e) => {
            note(format_args!("not active yet: {e}"));
            tracing::debug!(error = %e, "gpucr hook not made yet");
            return None;
        }
    };
    match hook.serve(socket_dir) {
        Ok(path) => note(format_args!("serving {}", path.display())),
        Err(e) => note(format_args!("no control socket: {e}")),
    }
    HOOK.store(hook, Ordering::Release);
    Some(hook)
}

fn make_hook() -> Result<Hook<CudaDriver>, String> {
    let resolve = |name: &'static str| {
        let c = CString::new(name).ok()?;
        let p = dl::real_cu(&c);
        (!p.is_null()).then_some(p)
    };
    // SAFETY: real_cu looks functions up on libcuda's handle, never our wrappers.
    let driver = unsafe { CudaDriver::from_resolver(&resolve) }.map_err(|e| e.to_string())?;
    let device = driver.device();
    let opts = FastPathOptions::default();
    // Exportable memory lets a leave-running checkpoint keep it on the GPU (no copy-in).
    driver.set_exportable(opts.keep);
    let hook = Hook::new(Arc::new(driver), opts).map_err(|e| e.to_string())?;
    note(format_args!("active on device {device}"));
    Ok(hook)
}

/// The hook when the calling thread's current device is the one it allocates on
/// (memory of other devices goes to the driver, and the driver path moves it).
fn hook_for_current_device() -> Option<&'static Hook<CudaDriver>> {
    let hook = hook_or_init()?;
    static GET_DEVICE: Real = Real::new(c"cuCtxGetDevice");
    let f = GET_DEVICE.get();
    if f.is_null() {
        return None;
    }
    // SAFETY: cuCtxGetDevice(CUdevice*) from libcuda.
    let get: unsafe extern "C" fn(*mut c_int) -> CuResult = unsafe { std::mem::transmute(f) };
    let mut dev = -1;
    // SAFETY: out-pointer to a local.
    let rc = unsafe { get(&mut dev) };
    (rc == CUDA_SUCCESS && dev == hook.allocator().driver().device()).then_some(hook)
}

/// A guard on the freeze gate for GPU work, when the hook is active.
fn gate_guard() -> Option<GateGuard<'static>> {
    hook().map(|h| h.enter())
}

/// One real driver function, looked up in libcuda on first use. `cuGetProcAddress`
/// may store the pointer it was handed instead.
pub(crate) struct Real {
    name: &'static CStr,
    ptr: AtomicPtr<c_void>,
}

impl Real {
    pub(crate) const fn new(name: &'static CStr) -> Real {
        Real {
            name,
            ptr: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The function, or null when libcuda has none.
    pub(crate) fn get(&self) -> *mut c_void {
        let p = self.ptr.load(Ordering::Acquire);
        if !p.is_null() {
            return p;
        }
        let p = dl::real_cu(self.name);
        if !p.is_null() {
            self.ptr.store(p, Ordering::Release);
        }
        p
    }

    pub(crate) fn set(&self, p: *mut c_void) {
        self.ptr.store(p, Ordering::Release);
    }
}
