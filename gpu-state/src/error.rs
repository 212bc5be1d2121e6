//! Typed errors of gpu-state, each with a message an operator can act on.

use std::path::PathBuf;

use crate::driver::{CuError, Step};

/// Loading or calling libcuda's checkpoint API.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DriverError {
    /// No libcuda on this machine. Callers that only probe see `Ok(None)` from
    /// [`crate::driver::CudaDriver::probe`] instead.
    #[error("no CUDA driver: {reason}")]
    NoDriver { reason: String },

    #[error("cannot load {path}: {reason}; point GPUCR_LIBCUDA at a working libcuda.so.1")]
    Load { path: String, reason: String },

    #[error(
        "{path} lacks {symbol}: the CUDA checkpoint API needs driver r570 (CUDA 12.8) or newer"
    )]
    MissingSymbol { path: String, symbol: &'static str },

    #[error("{step} of pid {pid} failed: CUDA error {code}: {hint}", hint = code.hint())]
    Cuda { step: Step, pid: u32, code: CuError },

    #[error("GPU remapping needs a CUDA 13.0 (r580) or newer driver; this one reports version {driver_version}")]
    GpuPairsUnsupported { driver_version: i32 },

    #[error("cuCheckpointProcessGetState returned unknown state {raw} for pid {pid}")]
    UnknownState { pid: u32, raw: i32 },

    /// The call was made (in a thread or child process) but no result came back.
    #[error("no answer from the CUDA driver: {reason}")]
    NoAnswer { reason: String },
}

impl DriverError {
    /// The CUDA error code, when the driver returned one.
    pub fn cuda_code(&self) -> Option<CuError> {
        match self {
            DriverError::Cuda { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Reading a container's processes from its cgroup.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no cgroup entry usable to find the container's processes")]
    NoCgroup { path: PathBuf },
    #[error("{path}: line {line:?} is not a pid")]
    BadPid { path: PathBuf, line: String },
}

/// Saving or loading the JSON record of a GPU checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a gpucr GPU record: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}
