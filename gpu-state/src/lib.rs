//! gpu-state: everything gpucr knows about GPU state.
//!
//! - `driver`: a safe API over the CUDA driver's `cuCheckpointProcess*` calls (dlopen of libcuda).
