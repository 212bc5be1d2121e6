//! The container's init process: what its state machine guards.

use std::path::PathBuf;

use crate::{io::ProcessIo, process::state::InitState, runc::RestoreOpts};

/// Guarded by `Container::init` (a tokio mutex held across one transition, so two verbs on
/// the same task never interleave; exits take it too, after the verb).
pub struct InitProcess {
    pub state: InitState,
    pub pid: u32,
    pub io: ProcessIo,
    /// Armed by Create with a checkpoint; consumed by Start.
    pub restore: Option<RestoreOpts>,
    /// The checkpoint image a restore came from, for the TaskCreate event and logs.
    pub checkpoint: Option<PathBuf>,
    /// Old→new GPU pairs for the driver's restore when the container moved GPUs.
    pub gpu_pairs: Vec<gpu_state::GpuPair>,
    /// CUDA processes the checkpoint's GPU record holds: a restore must find them all.
    pub gpu_processes: usize,
}

impl InitProcess {
    pub fn created(pid: u32, io: ProcessIo) -> Self {
        InitProcess {
            state: InitState::Created,
            pid,
            io,
            restore: None,
            checkpoint: None,
            gpu_pairs: Vec::new(),
            gpu_processes: 0,
        }
    }

    pub fn armed_restore(
        restore: RestoreOpts,
        gpu_pairs: Vec<gpu_state::GpuPair>,
        gpu_processes: usize,
    ) -> Self {
        InitProcess {
            state: InitState::CreatedCheckpoint,
            pid: 0,
            io: ProcessIo::default(),
            checkpoint: Some(restore.checkpoint.image_path.clone()),
            restore: Some(restore),
            gpu_pairs,
            gpu_processes,
        }
    }
}
