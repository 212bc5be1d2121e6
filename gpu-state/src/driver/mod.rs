//! A safe API over the CUDA driver's `cuCheckpointProcess*` calls.
//!
//! [`CudaDriver`] `dlopen`s `libcuda.so.1` (or `$GPUCR_LIBCUDA`) at run time, so gpucr
//! builds and runs on machines without NVIDIA's driver; [`CudaDriver::probe`] then says
//! "no driver" instead of failing. The caller needs no `cuInit` (measured on r580).
//! Orchestration code talks to the [`CheckpointApi`] trait so tests can swap in a fake.

mod ffi;
mod result;

use std::ffi::c_void;
use std::fmt;
use std::os::raw::c_int;
use std::path::Path;
use std::time::Duration;

use libloading::Library;
use serde::{Deserialize, Serialize};

pub use ffi::{
    CuCheckpointCheckpointArgs, CuCheckpointGpuPair, CuCheckpointLockArgs,
    CuCheckpointRestoreArgsV12, CuCheckpointRestoreArgsV13, CuCheckpointUnlockArgs, CuUuid,
    CUDA_13_0,
};
pub use result::CuError;

use crate::error::DriverError;

/// Environment variable that overrides where libcuda is loaded from (tests point it at
/// the fake).
pub const LIBCUDA_ENV: &str = "GPUCR_LIBCUDA";
/// The soname the driver installs.
pub const LIBCUDA_DEFAULT: &str = "libcuda.so.1";

/// `CUprocessState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    Failed,
}

impl ProcessState {
    fn from_raw(pid: u32, raw: c_int) -> Result<Self, DriverError> {
        match raw {
            0 => Ok(ProcessState::Running),
            1 => Ok(ProcessState::Locked),
            2 => Ok(ProcessState::Checkpointed),
            3 => Ok(ProcessState::Failed),
            raw => Err(DriverError::UnknownState { pid, raw }),
        }
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProcessState::Running => "RUNNING",
            ProcessState::Locked => "LOCKED",
            ProcessState::Checkpointed => "CHECKPOINTED",
            ProcessState::Failed => "FAILED",
        })
    }
}

/// One driver call; named in errors and timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    DriverGetVersion,
    GetState,
    GetRestoreThreadId,
    Lock,
    Checkpoint,
    Restore,
    Unlock,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::DriverGetVersion => "driver-version",
            Step::GetState => "get-state",
            Step::GetRestoreThreadId => "get-restore-thread-id",
            Step::Lock => "lock",
            Step::Checkpoint => "checkpoint",
            Step::Restore => "restore",
            Step::Unlock => "unlock",
        })
    }
}

/// A GPU UUID, written as nvidia-smi does: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GpuUuid(pub [u8; 16]);

impl GpuUuid {
    /// Parses `GPU-<hex with dashes>` (the `GPU-` prefix is optional).
    pub fn parse(text: &str) -> Option<Self> {
        let hex: Vec<u8> = text
            .trim()
            .trim_start_matches("GPU-")
            .bytes()
            .filter(|b| *b != b'-')
            .collect();
        if hex.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, pair) in hex.chunks(2).enumerate() {
            let s = std::str::from_utf8(pair).ok()?;
            out[i] = u8::from_str_radix(s, 16).ok()?;
        }
        Some(GpuUuid(out))
    }
}

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU-")?;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Which GPU a checkpointed GPU becomes on restore (CUDA 13.0+).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuPair {
    pub old: GpuUuid,
    pub new: GpuUuid,
}

impl GpuPair {
    /// The pairs for the driver's restore from old→new UUID texts: none when every GPU stays
    /// (unless `always`), else all of them (the driver wants every GPU once a GPU changes).
    pub fn for_restore<'a>(
        uuids: impl IntoIterator<Item = (&'a str, &'a str)> + Clone,
        always: bool,
    ) -> Result<Vec<GpuPair>, String> {
        if !always && uuids.clone().into_iter().all(|(old, new)| old == new) {
            return Ok(Vec::new());
        }
        let parse = |s: &str| GpuUuid::parse(s).ok_or_else(|| format!("{s:?} is not a GPU UUID"));
        uuids
            .into_iter()
            .map(|(old, new)| {
                Ok(GpuPair {
                    old: parse(old)?,
                    new: parse(new)?,
                })
            })
            .collect()
    }
}

/// The driver calls gpucr needs. Implemented by [`CudaDriver`] and by test fakes.
pub trait CheckpointApi: Send + Sync {
    /// `cuDriverGetVersion`, e.g. 12080 or 13000.
    fn driver_version(&self) -> Result<i32, DriverError>;
    fn get_state(&self, pid: u32) -> Result<ProcessState, DriverError>;
    /// Succeeds only for CUDA processes, which is how gpucr tells them apart.
    fn get_restore_thread_id(&self, pid: u32) -> Result<u32, DriverError>;
    /// RUNNING → LOCKED. `None` waits forever; on timeout the process stays RUNNING.
    fn lock(&self, pid: u32, timeout: Option<Duration>) -> Result<(), DriverError>;
    /// LOCKED → CHECKPOINTED: device memory moves into the process's host memory.
    fn checkpoint(&self, pid: u32) -> Result<(), DriverError>;
    /// CHECKPOINTED → LOCKED. Non-empty `gpu_pairs` need a 13.0+ driver.
    fn restore(&self, pid: u32, gpu_pairs: &[GpuPair]) -> Result<(), DriverError>;
    /// LOCKED → RUNNING.
    fn unlock(&self, pid: u32) -> Result<(), DriverError>;
}

/// libcuda's checkpoint entry points, loaded at run time.
pub struct CudaDriver {
    path: String,
    version: i32,
    get_state: ffi::FnGetState,
    get_restore_tid: ffi::FnGetRestoreThreadId,
    lock: ffi::FnLock,
    checkpoint: ffi::FnCheckpoint,
    restore: ffi::FnRestore,
    unlock: ffi::FnUnlock,
    // Keeps the function pointers above valid; dropped last.
    _lib: Library,
}

impl fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDriver")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

impl CudaDriver {
    /// Loads libcuda from `$GPUCR_LIBCUDA` or the default soname. `Ok(None)` means this
    /// machine has no CUDA driver, which is not an error for a caller that probes.
    pub fn probe() -> Result<Option<CudaDriver>, DriverError> {
        match Self::load() {
            Ok(d) => Ok(Some(d)),
            Err(DriverError::NoDriver { reason }) => {
                tracing::debug!(%reason, "no CUDA driver");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Like [`probe`](Self::probe) but a missing driver is [`DriverError::NoDriver`].
    pub fn load() -> Result<CudaDriver, DriverError> {
        match std::env::var_os(LIBCUDA_ENV) {
            Some(p) if !p.is_empty() => Self::load_from(Path::new(&p)),
            _ => Self::load_from(Path::new(LIBCUDA_DEFAULT)),
        }
    }

    /// Loads a specific library. A bare soname goes through the loader's search path.
    pub fn load_from(path: &Path) -> Result<CudaDriver, DriverError> {
        let shown = path.display().to_string();
        let explicit = path.components().count() > 1;
        if explicit && !path.exists() {
            return Err(DriverError::NoDriver {
                reason: format!("{shown} does not exist"),
            });
        }
        // SAFETY: loading libcuda runs its constructors, which is what the driver expects.
        let lib = unsafe { Library::new(path) }.map_err(|e| {
            if explicit {
                DriverError::Load {
                    path: shown.clone(),
                    reason: e.to_string(),
                }
            } else {
                // The loader found nothing by that name: a machine without the driver.
                DriverError::NoDriver {
                    reason: e.to_string(),
                }
            }
        })?;
        // SAFETY: the types match cuda.h's prototypes of these symbols.
        unsafe {
            let get_version: ffi::FnDriverGetVersion = sym(&lib, &shown, "cuDriverGetVersion")?;
            let mut version: c_int = 0;
            let rc = get_version(&mut version);
            if rc != 0 {
                tracing::warn!(rc, "cuDriverGetVersion failed; assuming the 12.8 layout");
                version = 0;
            }
            let driver = CudaDriver {
                version,
                get_state: sym(&lib, &shown, "cuCheckpointProcessGetState")?,
                get_restore_tid: sym(&lib, &shown, "cuCheckpointProcessGetRestoreThreadId")?,
                lock: sym(&lib, &shown, "cuCheckpointProcessLock")?,
                checkpoint: sym(&lib, &shown, "cuCheckpointProcessCheckpoint")?,
                restore: sym(&lib, &shown, "cuCheckpointProcessRestore")?,
                unlock: sym(&lib, &shown, "cuCheckpointProcessUnlock")?,
                path: shown,
                _lib: lib,
            };
            tracing::debug!(path = %driver.path, version, "loaded CUDA driver");
            Ok(driver)
        }
    }

    /// Where the driver was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether this driver's RestoreArgs carries GPU pairs.
    pub fn supports_gpu_pairs(&self) -> bool {
        self.version >= CUDA_13_0
    }
}

/// Copies a function pointer out of the library.
///
/// # Safety
/// `T` must be the symbol's real function pointer type, and the pointer must not
/// outlive `lib`.
unsafe fn sym<T: Copy>(lib: &Library, path: &str, name: &'static str) -> Result<T, DriverError> {
    match lib.get::<T>(name) {
        Ok(s) => Ok(*s),
        Err(_) => Err(DriverError::MissingSymbol {
            path: path.to_string(),
            symbol: name,
        }),
    }
}

fn check(step: Step, pid: u32, rc: ffi::CuResult) -> Result<(), DriverError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(DriverError::Cuda {
            step,
            pid,
            code: CuError(rc),
        })
    }
}

/// Converts a host pid for the C API; pids always fit in `int` on Linux.
fn cpid(pid: u32) -> c_int {
    c_int::try_from(pid).unwrap_or(c_int::MAX)
}

impl CheckpointApi for CudaDriver {
    fn driver_version(&self) -> Result<i32, DriverError> {
        Ok(self.version)
    }

    fn get_state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        let mut raw: c_int = -1;
        // SAFETY: valid out-pointer; the function pointer lives as long as self._lib.
        check(Step::GetState, pid, unsafe {
            (self.get_state)(cpid(pid), &mut raw)
        })?;
        ProcessState::from_raw(pid, raw)
    }

    fn get_restore_thread_id(&self, pid: u32) -> Result<u32, DriverError> {
        let mut tid: c_int = 0;
        // SAFETY: as above.
        check(Step::GetRestoreThreadId, pid, unsafe {
            (self.get_restore_tid)(cpid(pid), &mut tid)
        })?;
        Ok(u32::try_from(tid).unwrap_or(0))
    }

    fn lock(&self, pid: u32, timeout: Option<Duration>) -> Result<(), DriverError> {
        let mut args = CuCheckpointLockArgs {
            timeout_ms: lock_timeout_ms(timeout),
            ..Default::default()
        };
        // SAFETY: args is a zeroed 64-byte CUcheckpointLockArgs.
        check(Step::Lock, pid, unsafe {
            (self.lock)(cpid(pid), &mut args)
        })
    }

    fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        let mut args = CuCheckpointCheckpointArgs::default();
        // SAFETY: zeroed args, valid on every driver version.
        check(Step::Checkpoint, pid, unsafe {
            (self.checkpoint)(cpid(pid), &mut args)
        })
    }

    fn restore(&self, pid: u32, gpu_pairs: &[GpuPair]) -> Result<(), DriverError> {
        if !self.supports_gpu_pairs() {
            if !gpu_pairs.is_empty() {
                return Err(DriverError::GpuPairsUnsupported {
                    driver_version: self.version,
                });
            }
            let mut args = CuCheckpointRestoreArgsV12::default();
            // SAFETY: the 12.x layout, all reserved zero.
            return check(Step::Restore, pid, unsafe {
                (self.restore)(
                    cpid(pid),
                    (&mut args as *mut CuCheckpointRestoreArgsV12).cast(),
                )
            });
        }
        let mut pairs: Vec<CuCheckpointGpuPair> = gpu_pairs
            .iter()
            .map(|p| CuCheckpointGpuPair {
                old_uuid: CuUuid { bytes: p.old.0 },
                new_uuid: CuUuid { bytes: p.new.0 },
            })
            .collect();
        let mut args = CuCheckpointRestoreArgsV13::default();
        if !pairs.is_empty() {
            args.gpu_pairs = pairs.as_mut_ptr();
            args.gpu_pairs_count = u32::try_from(pairs.len()).unwrap_or(u32::MAX);
        }
        let args_ptr: *mut c_void = (&mut args as *mut CuCheckpointRestoreArgsV13).cast();
        // SAFETY: the 13.0 layout; `pairs` outlives the call.
        check(Step::Restore, pid, unsafe {
            (self.restore)(cpid(pid), args_ptr)
        })
    }

    fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        let mut args = CuCheckpointUnlockArgs::default();
        // SAFETY: zeroed args.
        check(Step::Unlock, pid, unsafe {
            (self.unlock)(cpid(pid), &mut args)
        })
    }
}

/// The driver's `timeoutMs`: 0 means "wait forever", so a tiny non-zero timeout
/// becomes 1 ms rather than infinity.
fn lock_timeout_ms(timeout: Option<Duration>) -> u32 {
    match timeout {
        None => 0,
        Some(t) => u32::try_from(t.as_millis()).unwrap_or(u32::MAX).max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_round_trip() {
        let text = "GPU-5b1d3e7a-0c2f-4a8e-9d61-3f2b7c8e9a01";
        let u = GpuUuid::parse(text).unwrap();
        assert_eq!(u.to_string(), text);
        assert!(GpuUuid::parse("GPU-123").is_none());
    }

    #[test]
    fn lock_timeout_zero_is_not_infinite() {
        assert_eq!(lock_timeout_ms(None), 0);
        assert_eq!(lock_timeout_ms(Some(Duration::ZERO)), 1);
        assert_eq!(lock_timeout_ms(Some(Duration::from_secs(10))), 10_000);
    }

    #[test]
    fn args_are_64_bytes() {
        use std::mem::size_of;
        assert_eq!(size_of::<CuCheckpointLockArgs>(), 64);
        assert_eq!(size_of::<CuCheckpointCheckpointArgs>(), 64);
        assert_eq!(size_of::<CuCheckpointUnlockArgs>(), 64);
        assert_eq!(size_of::<CuCheckpointRestoreArgsV12>(), 64);
        assert_eq!(size_of::<CuCheckpointRestoreArgsV13>(), 64);
        assert_eq!(size_of::<CuCheckpointGpuPair>(), 32);
    }

    #[test]
    fn error_names() {
        assert_eq!(CuError(304).name(), "CUDA_ERROR_OPERATING_SYSTEM");
        assert_eq!(CuError(401).to_string(), "401 CUDA_ERROR_ILLEGAL_STATE");
        assert_eq!(CuError(12345).name(), "CUDA_ERROR_12345");
    }
}
