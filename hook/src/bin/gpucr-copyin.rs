//! `gpucr-copyin`: a copy-in helper, started by the hook (see `gpucr_hook::helper`). It
//! makes its own CUDA context on the hook's device, says Ready, and takes one job: it
//! registers the job's stretches of the image's data files for DMA on 8 threads at once,
//! and when the Go comes maps the hook's allocations (imported memory fds) and copies
//! each piece as soon as its stretch is registered. It replies before it unpins (the
//! data is on the GPU by then), and exits once the hook closes its socket.

use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use gpucr_hook::cuda::CudaDriver;
use gpucr_hook::driver::{DevicePtr, PhysHandle, VmmDriver};
use gpucr_hook::helper::{
    helper_socket, next_go, next_job, say, stretches, HelperMsg, Job, ENV_DEVICE, ENV_DEVICE_UUID,
};

const REGISTRARS: usize = 8;
const STREAMS: usize = 4;
/// Largest single copy of pieces that follow each other.
const MAX_COPY: u64 = 256 << 20;

fn main() {
    if let Err(e) = run() {
        eprintln!("gpucr-copyin: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let mut sock = helper_socket()?;
    let t = Instant::now();
    let driver = match init() {
        Ok(d) => d,
        Err(e) => {
            let _ = say(&mut sock, &HelperMsg::Failed { message: e.clone() });
            return Err(e);
        }
    };
    say(
        &mut sock,
        &HelperMsg::Ready {
            init_s: t.elapsed().as_secs_f64(),
        },
    )?;
    // One job; the hook lets the helper go after it.
    if let Some((job, files)) = next_job(&mut sock)? {
        let mut held = Held::default();
        let reply = copy(&driver, &mut sock, &job, &files, &mut held);
        match reply {
            Ok(Some(msg)) => say(&mut sock, &msg)?,
            // The hook closed before its Go: the copy-in does not use this helper.
            Ok(None) => {}
            Err(e) => say(&mut sock, &HelperMsg::Failed { message: e })?,
        }
        held.release(&driver);
        // Until the hook closes (it may still be reading the reply).
        let _ = next_job(&mut sock);
    }
    driver.end_copies();
    Ok(())
}

type FnInit = unsafe extern "C" fn(c_uint) -> c_int;
type FnDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type FnRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type FnSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnDeviceGetUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;

/// The primary context of the device made current (the one whose UUID is
/// [`ENV_DEVICE_UUID`] — a helper of the shim's, on the host — else ordinal
/// [`ENV_DEVICE`], the hook's), and the driver over it.
fn init() -> Result<CudaDriver, String> {
    let uuid = match std::env::var(ENV_DEVICE_UUID) {
        Ok(text) => Some(
            gpu_state::GpuUuid::parse(&text)
                .ok_or_else(|| format!("{ENV_DEVICE_UUID}={text} is not a GPU UUID"))?,
        ),
        Err(_) => None,
    };
    let mut ordinal: c_int = std::env::var(ENV_DEVICE)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: libcuda's documented entry points with their C signatures; the library
    // stays loaded for the process's life (leaked).
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1")
            .map_err(|e| format!("cannot load libcuda.so.1: {e}"))?;
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        let sym = |name: &str| format!("libcuda has no {name}");
        let cu_init: libloading::Symbol<FnInit> = lib.get(b"cuInit").map_err(|_| sym("cuInit"))?;
        let device_get: libloading::Symbol<FnDeviceGet> =
            lib.get(b"cuDeviceGet").map_err(|_| sym("cuDeviceGet"))?;
        let retain: libloading::Symbol<FnRetain> = lib
            .get(b"cuDevicePrimaryCtxRetain")
            .map_err(|_| sym("cuDevicePrimaryCtxRetain"))?;
        let set_current: libloading::Symbol<FnSetCurrent> = lib
            .get(b"cuCtxSetCurrent")
            .map_err(|_| sym("cuCtxSetCurrent"))?;
        let rc = cu_init(0);
        if rc != 0 {
            return Err(format!("cuInit failed: {rc}"));
        }
        if let Some(uuid) = uuid {
            let count: libloading::Symbol<FnDeviceGetCount> = lib
                .get(b"cuDeviceGetCount")
                .map_err(|_| sym("cuDeviceGetCount"))?;
            let get_uuid: libloading::Symbol<FnDeviceGetUuid> = lib
                .get(b"cuDeviceGetUuid")
                .map_err(|_| sym("cuDeviceGetUuid"))?;
            let mut n = 0;
            let rc = count(&mut n);
            if rc != 0 {
                return Err(format!("cuDeviceGetCount failed: {rc}"));
            }
            ordinal = (0..n)
                .find(|&i| {
                    let mut bytes = [0u8; 16];
                    get_uuid(&mut bytes, i) == 0 && bytes == uuid.0
                })
                .ok_or_else(|| format!("no device of {n} has UUID {uuid}"))?;
        }
        let mut dev = 0;
        let rc = device_get(&mut dev, ordinal);
        if rc != 0 {
            return Err(format!("cuDeviceGet({ordinal}) failed: {rc}"));
        }
        let mut ctx = std::ptr::null_mut();
        let rc = retain(&mut ctx, dev);
        if rc != 0 {
            return Err(format!("cuDevicePrimaryCtxRetain failed: {rc}"));
        }
        let rc = set_current(ctx);
        if rc != 0 {
            return Err(format!("cuCtxSetCurrent failed: {rc}"));
        }
    }
    CudaDriver::load(Path::new("libcuda.so.1")).map_err(|e| e.to_string())
}

/// What a job mapped and pinned, given back after the reply.
#[derive(Default)]
struct Held {
    memory: Vec<(DevicePtr, u64, PhysHandle)>,
    /// Mapped stretches: (address, length, registered).
    windows: Vec<(usize, usize, bool)>,
}

impl Held {
    fn release(self, driver: &CudaDriver) {
        for &(ptr, len, registered) in &self.windows {
            if registered {
                let _ = driver.unregister_host(ptr as *mut u8);
            }
            // SAFETY: mapped by `copy` with this length; nothing uses it any more.
            unsafe { nix::libc::munmap(ptr as *mut c_void, len) };
        }
        for &(va, size, handle) in &self.memory {
            let _ = driver.unmap(va, size);
            let _ = driver.free_va(va, size);
            let _ = driver.release(handle);
        }
    }
}

/// Imports the job's memory (`memory`, in job order, each mapping `sizes` bytes) and
/// maps it into `held`; the addresses.
fn map_memory(
    driver: &CudaDriver,
    memory: &[OwnedFd],
    sizes: &[u64],
    held: &mut Held,
) -> Result<Vec<DevicePtr>, String> {
    let mut vas = Vec::with_capacity(memory.len());
    for (fd, &size) in memory.iter().zip(sizes) {
        let handle = driver.import(fd.as_fd()).map_err(|e| e.to_string())?;
        let va = match driver.reserve(size, None) {
            Ok(va) => va,
            Err(e) => {
                let _ = driver.release(handle);
                return Err(e.to_string());
            }
        };
        if let Err(e) = driver.map(va, size, handle) {
            let _ = driver.free_va(va, size);
            let _ = driver.release(handle);
            return Err(e.to_string());
        }
        held.memory.push((va, size, handle));
        driver.set_access(va, size).map_err(|e| e.to_string())?;
        vas.push(va);
    }
    Ok(vas)
}

/// Pins the job's stretches from now on, and once the Go comes copies them; `None`
/// when the hook closed instead of sending the Go.
fn copy(
    driver: &CudaDriver,
    sock: &mut UnixStream,
    job: &Job,
    files: &[OwnedFd],
    held: &mut Held,
) -> Result<Option<HelperMsg>, String> {
    let t_job = Instant::now();
    let sizes: Vec<u64> = files
        .iter()
        .map(|f| nix::sys::stat::fstat(f.as_fd()).map(|s| s.st_size as u64))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("fstat of a data file: {e}"))?;
    let stretches = stretches(job, &sizes)?;
    // Registrars map (populated) and pin stretches in order; the copies follow them.
    let next = AtomicUsize::new(0);
    let ptrs: Vec<AtomicUsize> = stretches.iter().map(|_| AtomicUsize::new(0)).collect();
    let ready: Vec<AtomicBool> = stretches.iter().map(|_| AtomicBool::new(false)).collect();
    let failed = AtomicBool::new(false);
    // Nanoseconds from the job to the last registrar's end.
    let pinned_ns = AtomicU64::new(0);
    let mut timing = (0.0, 0.0, 0.0); // ahead_s, setup_s, pin_wait_s
    let mut t_go = t_job;
    let copied = std::thread::scope(|scope| -> Result<Option<u64>, String> {
        let registrars: Vec<_> = (0..REGISTRARS.min(stretches.len()))
            .map(|_| {
                scope.spawn(|| -> Result<(), String> {
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= stretches.len() || failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        let s = &stretches[k];
                        let len = (s.end - s.start) as usize;
                        // SAFETY: a fresh read-only shared mapping of the file's pages,
                        // unmapped by Held.
                        let ptr = unsafe {
                            nix::libc::mmap(
                                std::ptr::null_mut(),
                                len,
                                nix::libc::PROT_READ,
                                nix::libc::MAP_SHARED | nix::libc::MAP_POPULATE,
                                files[s.file].as_raw_fd(),
                                s.start as nix::libc::off_t,
                            )
                        };
                        if ptr == nix::libc::MAP_FAILED {
                            failed.store(true, Ordering::Relaxed);
                            return Err(format!(
                                "mmap of data file {}: {}",
                                s.file,
                                std::io::Error::last_os_error()
                            ));
                        }
                        ptrs[k].store(ptr as usize, Ordering::Release);
                        if let Err(e) = driver.register_host_read_only(ptr as *const u8, len) {
                            failed.store(true, Ordering::Relaxed);
                            return Err(e.to_string());
                        }
                        ready[k].store(true, Ordering::Release);
                        pinned_ns.fetch_max(t_job.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let stop = |registrars: Vec<std::thread::ScopedJoinHandle<'_, Result<(), String>>>| {
            failed.store(true, Ordering::Relaxed);
            for r in registrars {
                let _ = r.join();
            }
        };
        let (memory, sizes) = match next_go(sock, job) {
            Ok(Some(go)) => go,
            Ok(None) => {
                stop(registrars);
                return Ok(None);
            }
            Err(e) => {
                stop(registrars);
                return Err(e);
            }
        };
        t_go = Instant::now();
        timing.0 = (t_go - t_job).as_secs_f64();
        let vas = match map_memory(driver, &memory, &sizes, held) {
            Ok(vas) => vas,
            Err(e) => {
                stop(registrars);
                return Err(e);
            }
        };
        timing.1 = t_go.elapsed().as_secs_f64();
        let mut bytes = 0;
        let mut q = 0;
        let mut result = Ok(());
        'outer: for (k, s) in stretches.iter().enumerate() {
            if !ready[k].load(Ordering::Acquire) {
                let w = Instant::now();
                while !ready[k].load(Ordering::Acquire) {
                    if failed.load(Ordering::Relaxed) {
                        break 'outer;
                    }
                    std::thread::yield_now();
                }
                timing.2 += w.elapsed().as_secs_f64();
            }
            // Pieces that follow each other in the file and in one allocation go as one
            // copy.
            let base = ptrs[k].load(Ordering::Acquire);
            let mut run: Option<(usize, u64, u64, u64)> = None; // alloc, alloc off, file off, len
            let issue = |run: (usize, u64, u64, u64), q: &mut usize| -> Result<(), String> {
                let (a, alloc_offset, file_offset, len) = run;
                let src = base + (file_offset - s.start) as usize;
                // SAFETY: the mapping stays (registered) until Held releases it, after
                // every stream was waited for below.
                unsafe {
                    driver.copy_from_host_async(
                        vas[a] + alloc_offset,
                        src as *const u8,
                        len as usize,
                        *q % STREAMS,
                    )
                }
                .map_err(|e| e.to_string())?;
                *q += 1;
                Ok(())
            };
            for &i in &s.pieces {
                let p = &job.pieces[i];
                if vas.get(p.alloc).is_none() {
                    result = Err("a piece names an allocation the job lacks".to_string());
                    break 'outer;
                }
                if p.alloc_offset
                    .checked_add(p.len)
                    .is_none_or(|e| e > job.allocs[p.alloc])
                {
                    result = Err("a piece lies past the end of its allocation".to_string());
                    break 'outer;
                }
                bytes += p.len;
                match run.as_mut() {
                    Some((a, ao, fo, len))
                        if *a == p.alloc
                            && *ao + *len == p.alloc_offset
                            && *fo + *len == p.file_offset
                            && *len + p.len <= MAX_COPY =>
                    {
                        *len += p.len
                    }
                    _ => {
                        if let Some(r) =
                            run.replace((p.alloc, p.alloc_offset, p.file_offset, p.len))
                        {
                            if let Err(e) = issue(r, &mut q) {
                                result = Err(e);
                                break 'outer;
                            }
                        }
                    }
                }
            }
            if let Some(r) = run {
                if let Err(e) = issue(r, &mut q) {
                    result = Err(e);
                    break 'outer;
                }
            }
        }
        failed.fetch_or(result.is_err(), Ordering::Relaxed);
        for s in 0..STREAMS {
            if let Err(e) = driver.wait(s) {
                result = result.and(Err(e.to_string()));
            }
        }
        for r in registrars {
            let r = r.join().map_err(|_| "a registrar panicked".to_string())?;
            result = result.and(r);
        }
        result.map(|()| Some(bytes))
    });
    // Every stretch mapped is unmapped by Held (and unpinned if pinned), also after a
    // failure.
    for ((s, p), r) in stretches.iter().zip(&ptrs).zip(&ready) {
        let ptr = p.load(Ordering::Acquire);
        if ptr != 0 {
            held.windows
                .push((ptr, (s.end - s.start) as usize, r.load(Ordering::Acquire)));
        }
    }
    let Some(copied) = copied? else {
        return Ok(None);
    };
    Ok(Some(HelperMsg::Done {
        bytes: copied,
        seconds: t_go.elapsed().as_secs_f64(),
        setup_s: timing.1,
        register_s: pinned_ns.load(Ordering::Relaxed) as f64 / 1e9,
        ahead_s: timing.0,
        pin_wait_s: timing.2,
    }))
}
