//! `CUresult` codes the checkpoint API can return, with names from cuda.h and a hint
//! for the operator.

/// A failed `CUresult`, kept as the raw number so codes we do not know still show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CuError(pub i32);

impl CuError {
    pub const INVALID_VALUE: CuError = CuError(1);
    pub const OUT_OF_MEMORY: CuError = CuError(2);
    pub const NOT_INITIALIZED: CuError = CuError(3);
    pub const OPERATING_SYSTEM: CuError = CuError(304);
    pub const ILLEGAL_STATE: CuError = CuError(401);
    pub const NOT_FOUND: CuError = CuError(500);
    pub const NOT_READY: CuError = CuError(600);
    pub const NOT_PERMITTED: CuError = CuError(800);
    pub const NOT_SUPPORTED: CuError = CuError(801);
    pub const TIMEOUT: CuError = CuError(909);
    pub const UNKNOWN: CuError = CuError(999);

    /// The cuda.h name, or `CUDA_ERROR_<n>` for a code this table lacks.
    pub fn name(self) -> String {
        let known = match self.0 {
            1 => "CUDA_ERROR_INVALID_VALUE",
            2 => "CUDA_ERROR_OUT_OF_MEMORY",
            3 => "CUDA_ERROR_NOT_INITIALIZED",
            4 => "CUDA_ERROR_DEINITIALIZED",
            34 => "CUDA_ERROR_STUB_LIBRARY",
            46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
            100 => "CUDA_ERROR_NO_DEVICE",
            101 => "CUDA_ERROR_INVALID_DEVICE",
            304 => "CUDA_ERROR_OPERATING_SYSTEM",
            400 => "CUDA_ERROR_INVALID_HANDLE",
            401 => "CUDA_ERROR_ILLEGAL_STATE",
            500 => "CUDA_ERROR_NOT_FOUND",
            600 => "CUDA_ERROR_NOT_READY",
            800 => "CUDA_ERROR_NOT_PERMITTED",
            801 => "CUDA_ERROR_NOT_SUPPORTED",
            802 => "CUDA_ERROR_SYSTEM_NOT_READY",
            803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
            909 => "CUDA_ERROR_TIMEOUT",
            999 => "CUDA_ERROR_UNKNOWN",
            _ => return format!("CUDA_ERROR_{}", self.0),
        };
        known.to_string()
    }

    /// What an operator should try next.
    pub fn hint(self) -> &'static str {
        match self.0 {
            1 => "the pid is not a CUDA process or an argument was rejected; check the pid and, for GPU remapping, that the pairs cover every checkpointed GPU",
            2 => "the GPU lacks free memory for this process's device memory; free GPU memory (stop other workloads) and retry",
            3 => "the process has not initialised CUDA (yet); retry once it has called cuInit",
            304 => "the driver hit an OS-level failure; a process whose restore ran out of memory is known to stay stuck here (cuda-checkpoint #44) and must be restarted",
            401 => "the process is not in the state this step needs (e.g. unlock of a CHECKPOINTED process); query its state and run the missing step",
            600 => "the process could not be locked in time (busy or waiting on another rank); retry with a longer lock timeout or quiesce the workload",
            800 => "not permitted; run as root or with CAP_SYS_PTRACE over the target",
            801 => "this driver or GPU does not support checkpointing (needs r570+, no MIG/MPS)",
            909 => "the driver timed out; retry with a longer timeout",
            _ => "see the driver's message in dmesg and the CUDA checkpoint documentation",
        }
    }
}

impl std::fmt::Display for CuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.0, self.name())
    }
}
