//! The container's init process: what its state machine guards.

use std::path::PathBuf;

use gpu_state::GpuPair;

use crate::{
    gpu::{
        driver::Quiesced,
        hook::{HookCheckpoint, HookRecord},
        restore_helpers::HelperChoice,
    },
    io::ProcessIo,
    process::state::InitState,
    records::Records,
    runc::RestoreOpts,
};

/// Guarded by `Container::init` (a tokio mutex held across one transition, so two verbs on
/// the same task never interleave; exits take it too, after the verb).
pub struct InitProcess {
    /// The state, with what only it holds (a restore's plan, what Resume finishes).
    pub phase: InitPhase,
    pub pid: u32,
    pub io: ProcessIo,
    /// The checkpoint image a restore came from, for the TaskCreate event and logs.
    pub checkpoint: Option<PathBuf>,
}

/// The init's state with what only that state holds: a restore's plan in
/// CreatedCheckpoint, as containerd keeps it (`createdCheckpointState{opts}`). The verb
/// tables (`process/state.rs`) answer on the plain [`InitState`] ([`InitPhase::state`]), and
/// know nothing of what a state holds.
pub enum InitPhase {
    Created,
    CreatedCheckpoint(Box<RestorePlan>),
    Running,
    /// What a checkpoint of the paused task left for Resume.
    Paused(Box<ForResume>),
    Stopped,
    Deleted,
}

impl InitPhase {
    pub fn state(&self) -> InitState {
        match self {
            InitPhase::Created => InitState::Created,
            InitPhase::CreatedCheckpoint(_) => InitState::CreatedCheckpoint,
            InitPhase::Running => InitState::Running,
            InitPhase::Paused(_) => InitState::Paused,
            InitPhase::Stopped => InitState::Stopped,
            InitPhase::Deleted => InitState::Deleted,
        }
    }

    /// Moves to `next`, a state [`InitState::next`] allowed; staying keeps what the state
    /// holds, leaving CreatedCheckpoint drops the plan.
    pub fn set(&mut self, next: InitState) {
        if self.state() == next {
            return;
        }
        *self = match next {
            InitState::Created => InitPhase::Created,
            // Only Create arms a restore: no verb leads into this state.
            InitState::CreatedCheckpoint => return,
            InitState::Running => InitPhase::Running,
            InitState::Paused => InitPhase::Paused(Default::default()),
            InitState::Stopped => InitPhase::Stopped,
            InitState::Deleted => InitPhase::Deleted,
        };
    }

    /// What a checkpoint left for Resume, when the task is paused.
    pub fn for_resume(&mut self) -> Option<&mut ForResume> {
        match self {
            InitPhase::Paused(later) => Some(later.as_mut()),
            _ => None,
        }
    }

    /// Keeps what a checkpoint of the paused task left for Resume (nothing is left by a
    /// checkpoint of a task in any other state).
    pub fn leave_for_resume(&mut self, later: ForResume) {
        if let Some(held) = self.for_resume() {
            held.keep(later);
        }
    }

    /// The restore Create planned, while it waits for Start.
    pub fn restore_plan(&self) -> Option<&RestorePlan> {
        match self {
            InitPhase::CreatedCheckpoint(plan) => Some(plan),
            _ => None,
        }
    }
}

/// A restore planned once, at Create (image checked, records read, this host fitted), and
/// carried to Start in the CreatedCheckpoint state.
#[derive(Debug, Clone)]
pub struct RestorePlan {
    /// `runc restore`'s options.
    pub opts: RestoreOpts,
    /// The image's hook and GPU records, read once after the image check.
    pub records: Records,
    /// Old→new GPU pairs for the driver's restore when the container moved GPUs.
    pub gpu_pairs: Vec<GpuPair>,
    /// Whether Start starts copy-in helpers for the hook's copy-in, and on which GPU.
    pub helpers: HelperChoice,
    /// Where a by-reference image's hook images are read in place (`by_reference::resolve`);
    /// removed when the plan goes.
    pub store_stage: Option<std::sync::Arc<gpucr_store::Stage>>,
}

impl RestorePlan {
    /// CUDA processes the checkpoint's GPU record holds: a restore must find them all.
    pub fn gpu_processes(&self) -> usize {
        self.records.gpu.as_ref().map_or(0, |r| r.processes.len())
    }

    /// What the driver restores (its estimate of the recorded device memory).
    pub fn driver_bytes(&self) -> u64 {
        self.records
            .gpu
            .as_ref()
            .map_or(0, |r| r.device_memory_estimate_bytes())
    }

    /// The hook's record when its processes moved memory: Start copies it in.
    pub fn hook_copy_in(&self) -> Option<&HookRecord> {
        self.records
            .hook
            .as_ref()
            .filter(|r| !r.processes.is_empty())
    }
}

/// What a checkpoint of a paused task leaves for Resume: the CUDA processes the driver
/// keeps LOCKED (their memory back, see `Container::resume_gpu`) and, behind them, the
/// processes whose hook still holds its memory released (given back after the unlock).
#[derive(Default)]
pub struct ForResume {
    pub locked: Option<Quiesced>,
    pub hook: Option<HookCheckpoint>,
}

impl ForResume {
    /// Keeps what `later` holds (a later checkpoint's replaces an earlier one's).
    pub fn keep(&mut self, later: ForResume) {
        if let Some(q) = later.locked {
            self.locked = Some(q);
        }
        if let Some(h) = later.hook {
            self.hook = Some(h);
        }
    }
}

impl InitProcess {
    pub fn created(pid: u32, io: ProcessIo) -> Self {
        InitProcess {
            phase: InitPhase::Created,
            pid,
            io,
            checkpoint: None,
        }
    }

    pub fn armed_restore(plan: RestorePlan) -> Self {
        InitProcess {
            checkpoint: Some(plan.opts.checkpoint.image_path.clone()),
            phase: InitPhase::CreatedCheckpoint(Box::new(plan)),
            pid: 0,
            io: ProcessIo::default(),
        }
    }

    /// The plain state, for the verb tables.
    pub fn state(&self) -> InitState {
        self.phase.state()
    }
}
