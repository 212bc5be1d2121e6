//! The GPU layer's errors (`crate::Error::Gpu` carries them), apart from the driver path's
//! code so that the shim's error type and the driver path do not import each other.

use gpu_state::{CompatibilityError, DriverError, OrchestrationError, RecordError};

/// The driver path's errors, each with gpu-state's own as its source.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "the container uses NVIDIA devices but libcuda.so.1 cannot be loaded on this host \
         (install the NVIDIA driver r570+ or set GPUCR_LIBCUDA)"
    )]
    NoLibcuda,
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// Finding the CUDA processes among the candidates.
    #[error(transparent)]
    Discover(OrchestrationError),
    /// A step on every CUDA process (gpu-state rolled them back).
    #[error("{step}: {source}")]
    Step {
        step: &'static str,
        #[source]
        source: OrchestrationError,
    },
    #[error("writing GPU record: {0}")]
    WriteRecord(#[source] RecordError),
    #[error("the image's GPU record is damaged: {0}")]
    DamagedRecord(#[source] RecordError),
    /// This host cannot take the checkpoint's GPU state.
    #[error(transparent)]
    Incompatible(#[from] CompatibilityError),
    /// The checkpoint's CUDA processes were not all found after CRIU's restore.
    #[error(
        "the checkpoint holds GPU state of {expected} CUDA processes, but only {found} \
         were found after CRIU's restore: their device memory cannot be given back"
    )]
    Missing { expected: usize, found: usize },
    /// A blocking worker of the GPU layer (`what`: GPU or hook) panicked.
    #[error("{what} worker panicked: {source}")]
    Panicked {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
}

impl GpuError {
    pub(crate) fn step(step: &'static str) -> impl FnOnce(OrchestrationError) -> GpuError {
        move |source| GpuError::Step { step, source }
    }

    /// A worker's panic, as the error of what it ran.
    pub fn panicked(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> GpuError {
        move |source| GpuError::Panicked { what, source }
    }
}
