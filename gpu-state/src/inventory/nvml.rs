//! GPUs from NVML (`libnvidia-ml.so.1`, loaded at run time): adds memory to what
//! procfs offers.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use libloading::Library;

use super::{GpuInfo, Inventory, InventorySource};

/// Overrides where NVML is loaded from.
pub const LIBNVML_ENV: &str = "GPUCR_LIBNVML";
const LIBNVML_DEFAULT: &str = "libnvidia-ml.so.1";

type Device = *mut c_void;

#[repr(C)]
#[derive(Default)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

/// Queries NVML; `None` if it is absent or fails (the caller falls back to procfs).
pub fn read() -> Option<Inventory> {
    let path = std::env::var(LIBNVML_ENV).unwrap_or_else(|_| LIBNVML_DEFAULT.to_string());
    // SAFETY: NVML's constructors are safe to run; it is the vendor library.
    let lib = match unsafe { Library::new(&path) } {
        Ok(l) => l,
        Err(e) => {
            tracing::debug!(%path, error = %e, "no NVML");
            return None;
        }
    };
    // SAFETY: the prototypes match nvml.h.
    unsafe { query(&lib) }
}

unsafe fn query(lib: &Library) -> Option<Inventory> {
    let init = *lib
        .get::<unsafe extern "C" fn() -> c_int>("nvmlInit_v2")
        .ok()?;
    let shutdown = *lib
        .get::<unsafe extern "C" fn() -> c_int>("nvmlShutdown")
        .ok()?;
    let driver = *lib
        .get::<unsafe extern "C" fn(*mut c_char, c_uint) -> c_int>("nvmlSystemGetDriverVersion")
        .ok()?;
    let count = *lib
        .get::<unsafe extern "C" fn(*mut c_uint) -> c_int>("nvmlDeviceGetCount_v2")
        .ok()?;
    let handle = *lib
        .get::<unsafe extern "C" fn(c_uint, *mut Device) -> c_int>("nvmlDeviceGetHandleByIndex_v2")
        .ok()?;
    let name = *lib
        .get::<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_int>("nvmlDeviceGetName")
        .ok()?;
    let uuid = *lib
        .get::<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_int>("nvmlDeviceGetUUID")
        .ok()?;
    let memory = *lib
        .get::<unsafe extern "C" fn(Device, *mut Memory) -> c_int>("nvmlDeviceGetMemoryInfo")
        .ok()?;

    let rc = init();
    if rc != 0 {
        tracing::debug!(rc, "nvmlInit_v2 failed");
        return None;
    }
    let text = |f: &dyn Fn(*mut c_char, c_uint) -> c_int| {
        let mut buf = [0 as c_char; 96];
        (f(buf.as_mut_ptr(), buf.len() as c_uint) == 0)
            .then(|| CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned())
    };
    let driver_version = text(&|p, n| driver(p, n));
    let mut n: c_uint = 0;
    let mut gpus = Vec::new();
    if count(&mut n) == 0 {
        for i in 0..n {
            let mut dev: Device = std::ptr::null_mut();
            if handle(i, &mut dev) != 0 {
                continue;
            }
            let mut mem = Memory::default();
            let mem_ok = memory(dev, &mut mem) == 0;
            gpus.push(GpuInfo {
                index: i,
                model: text(&|p, n| name(dev, p, n)).unwrap_or_default(),
                uuid: text(&|p, n| uuid(dev, p, n)).unwrap_or_default(),
                bus_id: None,
                memory_total_bytes: mem_ok.then_some(mem.total),
                memory_free_bytes: mem_ok.then_some(mem.free),
            });
        }
    }
    shutdown();
    Some(Inventory {
        driver_version,
        source: InventorySource::Nvml,
        gpus,
    })
}
