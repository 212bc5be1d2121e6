//! CUDA processes and their checkpoint state machine.
//!
//! - [`GpuProcess`]: one CUDA process, its state and the timed history of every step.
//! - [`GpuProcessSet`]: the orchestrator the shim uses: `discover` → `lock_all` →
//!   `checkpoint_all` → (CRIU) → `restore_all` → `unlock_all`, rolling every process
//!   back to RUNNING when a step fails.
//! - [`discovery`]: a container's pids from its cgroup.
//! - [`GpuCheckpointRecord`]: the JSON written next to the CRIU images.

pub mod discovery;
mod orchestrator;
mod record;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::driver::{ProcessState, Step};
use crate::error::DriverError;

pub use discovery::ProcessSource;
pub use orchestrator::{
    Failure, FailureKind, Failures, GpuProcessSet, OrchestrationError, RollbackReport, StepTimeouts,
};
pub use record::{GpuCheckpointRecord, RECORD_FILE_NAME, RECORD_FORMAT_VERSION};

/// What a step does to a process in a given state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// The step applies: call the driver.
    Act,
    /// Already where the step leads (or the step does not concern it): nothing to do.
    Skip,
    /// The step cannot start from this state.
    Invalid,
}

/// The driver's transition table: where `step` takes a process, and from where.
pub fn edge(step: Step) -> Option<(ProcessState, ProcessState)> {
    use ProcessState::*;
    match step {
        Step::Lock => Some((Running, Locked)),
        Step::Checkpoint => Some((Locked, Checkpointed)),
        Step::Restore => Some((Checkpointed, Locked)),
        Step::Unlock => Some((Locked, Running)),
        _ => None,
    }
}

/// Decides whether `step` should run on a process in `state`.
pub fn plan(step: Step, state: ProcessState) -> Plan {
    use ProcessState::*;
    match (step, state) {
        (_, Failed) => Plan::Invalid,
        (Step::Lock, Running) => Plan::Act,
        (Step::Lock, Locked | Checkpointed) => Plan::Skip,
        (Step::Checkpoint, Locked) => Plan::Act,
        (Step::Checkpoint, Checkpointed) => Plan::Skip,
        (Step::Checkpoint, Running) => Plan::Invalid,
        (Step::Restore, Checkpointed) => Plan::Act,
        (Step::Restore, Locked | Running) => Plan::Skip,
        (Step::Unlock, Locked) => Plan::Act,
        (Step::Unlock, Running) => Plan::Skip,
        (Step::Unlock, Checkpointed) => Plan::Invalid,
        _ => Plan::Skip,
    }
}

/// How one step ended for one process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "result")]
pub enum StepOutcome {
    Ok,
    Failed { code: Option<i32>, message: String },
    TimedOut,
}

/// One step on one process, with its timing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: Step,
    pub from: ProcessState,
    /// The state after the step (unchanged when it failed).
    pub to: ProcessState,
    pub started_unix_ms: u64,
    pub duration_ms: f64,
    #[serde(flatten)]
    pub outcome: StepOutcome,
}

/// One CUDA process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub restore_tid: u32,
    /// The driver's state when gpucr found the process.
    pub initial_state: ProcessState,
    /// What gpucr believes the state is now.
    pub state: ProcessState,
    pub steps: Vec<StepRecord>,
    /// `VmRSS` just before and after checkpoint: the driver copies device memory into
    /// the process's host memory, so the difference estimates its device memory.
    pub rss_before_checkpoint_kib: Option<u64>,
    pub rss_after_checkpoint_kib: Option<u64>,
}

impl GpuProcess {
    pub fn new(pid: u32, restore_tid: u32, state: ProcessState) -> Self {
        Self {
            pid,
            restore_tid,
            initial_state: state,
            state,
            steps: Vec::new(),
            rss_before_checkpoint_kib: None,
            rss_after_checkpoint_kib: None,
        }
    }

    /// Estimated device memory of the process, from the RSS growth at checkpoint.
    pub fn device_memory_estimate_bytes(&self) -> Option<u64> {
        let (before, after) = (
            self.rss_before_checkpoint_kib?,
            self.rss_after_checkpoint_kib?,
        );
        Some(after.saturating_sub(before) * 1024)
    }

    /// Records a finished step and moves the state along the table on success.
    pub fn finish(
        &mut self,
        step: Step,
        started: SystemTime,
        took: Duration,
        result: &Result<(), DriverError>,
    ) {
        let from = self.state;
        let outcome = match result {
            Ok(()) => {
                if let Some((_, to)) = edge(step) {
                    self.state = to;
                }
                StepOutcome::Ok
            }
            Err(e) => StepOutcome::Failed {
                code: e.cuda_code().map(|c| c.0),
                message: e.to_string(),
            },
        };
        self.push(step, from, started, took, outcome);
    }

    /// Records a step that did not return in time; the state is then unknown, so it
    /// stays as it was until the driver is asked again.
    pub fn timed_out(&mut self, step: Step, started: SystemTime, took: Duration) {
        let from = self.state;
        self.push(step, from, started, took, StepOutcome::TimedOut);
    }

    fn push(
        &mut self,
        step: Step,
        from: ProcessState,
        started: SystemTime,
        took: Duration,
        outcome: StepOutcome,
    ) {
        self.steps.push(StepRecord {
            step,
            from,
            to: self.state,
            started_unix_ms: unix_ms(started),
            duration_ms: took.as_secs_f64() * 1000.0,
            outcome,
        });
    }
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// `VmRSS` of a process in KiB, if readable.
pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ProcessState::*;

    #[test]
    fn plan_table() {
        let steps = [Step::Lock, Step::Checkpoint, Step::Restore, Step::Unlock];
        let states = [Running, Locked, Checkpointed, Failed];
        let expect = [
            // Running, Locked, Checkpointed, Failed
            [Plan::Act, Plan::Skip, Plan::Skip, Plan::Invalid], // lock
            [Plan::Invalid, Plan::Act, Plan::Skip, Plan::Invalid], // checkpoint
            [Plan::Skip, Plan::Skip, Plan::Act, Plan::Invalid], // restore
            [Plan::Skip, Plan::Act, Plan::Invalid, Plan::Invalid], // unlock
        ];
        for (i, step) in steps.iter().enumerate() {
            for (j, state) in states.iter().enumerate() {
                assert_eq!(plan(*step, *state), expect[i][j], "{step} from {state}");
                if expect[i][j] == Plan::Act {
                    assert_eq!(edge(*step).unwrap().0, *state);
                }
            }
        }
    }

    #[test]
    fn finish_moves_state_only_on_success() {
        let mut p = GpuProcess::new(1, 1, Running);
        let now = SystemTime::now();
        let err = Err(DriverError::Cuda {
            step: Step::Lock,
            pid: 1,
            code: crate::driver::CuError::NOT_READY,
        });
        p.finish(Step::Lock, now, Duration::ZERO, &err);
        assert_eq!(p.state, Running);
        p.finish(Step::Lock, now, Duration::ZERO, &Ok(()));
        assert_eq!(p.state, Locked);
        assert_eq!(p.steps.len(), 2);
        assert!(matches!(
            p.steps[0].outcome,
            StepOutcome::Failed {
                code: Some(600),
                ..
            }
        ));
    }
}
