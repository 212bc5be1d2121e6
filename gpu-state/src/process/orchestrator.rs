//! [`GpuProcessSet`]: drives every CUDA process of a container through the driver's
//! steps together, with a deadline per step and rollback to RUNNING on failure.
//!
//! Each step runs on all processes at once (one thread per process): locking the
//! ranks of a job one by one can hang the later ones (cuda-checkpoint #30). A driver
//! call cannot be cancelled, so a call that misses its deadline is left running; its
//! process is reported and kept out of later calls until the call returns.

use std::collections::HashSet;
use std::fmt;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::driver::{CheckpointApi, GpuPair, ProcessState, Step, CUDA_13_0};
use crate::error::DriverError;
use crate::inventory::Inventory;

use super::{plan, rss_kib, GpuCheckpointRecord, GpuProcess, Plan};

/// Deadlines per step. The lock timeout is also handed to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTimeouts {
    pub lock: Duration,
    /// Checkpoint copies device memory to host memory at the driver's speed, so this
    /// step grows with the memory (figures: docs/BENCHMARKS.md).
    pub checkpoint: Duration,
    pub restore: Duration,
    pub unlock: Duration,
    /// `get_state` and `get_restore_thread_id`.
    pub query: Duration,
    /// Extra wait, on top of the driver's own lock timeout, and for late calls during rollback.
    pub grace: Duration,
}

impl Default for StepTimeouts {
    fn default() -> Self {
        Self {
            lock: Duration::from_secs(10),
            checkpoint: Duration::from_secs(600),
            restore: Duration::from_secs(600),
            unlock: Duration::from_secs(30),
            query: Duration::from_secs(10),
            grace: Duration::from_secs(5),
        }
    }
}

/// Why one process failed one step.
#[derive(Debug, Clone)]
pub enum FailureKind {
    Driver(DriverError),
    TimedOut { after: Duration },
    InvalidState { state: ProcessState },
    StillInFlight { step: Step },
}

#[derive(Debug, Clone)]
pub struct Failure {
    pub pid: u32,
    pub step: Step,
    pub kind: FailureKind,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (pid, step) = (self.pid, self.step);
        match &self.kind {
            FailureKind::Driver(e) => write!(f, "{e}"),
            FailureKind::TimedOut { after } => write!(
                f,
                "{step} of pid {pid} did not return within {after:?}; its GPU state is unknown"
            ),
            FailureKind::InvalidState { state } => {
                write!(f, "pid {pid} is {state}, {step} cannot start from there")
            }
            FailureKind::StillInFlight { step: earlier } => write!(
                f,
                "pid {pid}: an earlier {earlier} is still running in the driver, so {step} was not attempted"
            ),
        }
    }
}

/// A list of failures, shown joined by "; ".
#[derive(Debug, Clone, Default)]
pub struct Failures(pub Vec<Failure>);

impl fmt::Display for Failures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, fail) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{fail}")?;
        }
        Ok(())
    }
}

/// What rollback achieved.
#[derive(Debug, Clone, Default)]
pub struct RollbackReport {
    pub processes: usize,
    /// Errors met while rolling back.
    pub failures: Failures,
    /// Processes that are not RUNNING afterwards (pid, last known state).
    pub left: Vec<(u32, ProcessState)>,
}

impl RollbackReport {
    /// Every process is RUNNING again.
    pub fn is_clean(&self) -> bool {
        self.left.is_empty()
    }
}

impl fmt::Display for RollbackReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clean() {
            return write!(
                f,
                "rolled back: all {} CUDA processes are RUNNING",
                self.processes
            );
        }
        f.write_str("ROLLBACK INCOMPLETE: ")?;
        for (i, (pid, state)) in self.left.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(
                f,
                "pid {pid} could not be brought back to RUNNING (left {state})"
            )?;
        }
        if !self.failures.0.is_empty() {
            write!(f, " [{}]", self.failures)?;
        }
        f.write_str(
            "; these processes stay paused on the GPU: restore/unlock them by hand or restart them",
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OrchestrationError {
    /// A step failed for some processes; every process was then rolled back.
    #[error("{step} failed: {failures}; {rollback}")]
    StepFailed {
        step: Step,
        failures: Failures,
        rollback: RollbackReport,
    },
    /// The step could not start (nothing was changed).
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error("{step} of pid {pid} did not return within {after:?} during discovery")]
    QueryTimedOut {
        pid: u32,
        step: Step,
        after: Duration,
    },
}

impl OrchestrationError {
    /// Pids left in a state other than RUNNING (empty when rollback was clean).
    pub fn unrecovered_pids(&self) -> Vec<u32> {
        match self {
            OrchestrationError::StepFailed { rollback, .. } => {
                rollback.left.iter().map(|(p, _)| *p).collect()
            }
            _ => Vec::new(),
        }
    }
}

/// A call running on its own thread.
struct Call<T> {
    pid: u32,
    step: Step,
    started: SystemTime,
    t0: Instant,
    rx: Receiver<Result<T, DriverError>>,
}

fn spawn_call<T, F>(api: &Arc<dyn CheckpointApi>, pid: u32, step: Step, f: F) -> Call<T>
where
    T: Send + 'static,
    F: FnOnce(&dyn CheckpointApi, u32) -> Result<T, DriverError> + Send + 'static,
{
    let (tx, rx) = mpsc::sync_channel(1);
    let call = Call {
        pid,
        step,
        started: SystemTime::now(),
        t0: Instant::now(),
        rx,
    };
    let spawned = std::thread::Builder::new()
        .name(format!("gpucr-{step}-{pid}"))
        .spawn({
            let tx = tx.clone();
            let api = Arc::clone(api);
            move || {
                let _ = tx.send(f(&*api, pid));
            }
        });
    if let Err(e) = spawned {
        // Without a thread we cannot enforce the deadline; report it as a failure.
        tracing::error!(pid, %step, error = %e, "cannot spawn a thread for the driver call");
        let _ = tx.send(Err(DriverError::NoAnswer {
            reason: format!("cannot spawn a thread for the call: {e}"),
        }));
    }
    call
}

/// A call and its result; `None` when it missed the deadline.
type Waited<T> = (Call<T>, Option<Result<T, DriverError>>);

/// Waits for all calls until `deadline`; `None` marks a call that missed it.
fn wait_all<T>(calls: Vec<Call<T>>, deadline: Instant) -> Vec<Waited<T>> {
    calls
        .into_iter()
        .map(|c| {
            let left = deadline.saturating_duration_since(Instant::now());
            let r = match c.rx.recv_timeout(left) {
                Ok(r) => Some(r),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => Some(Err(DriverError::NoAnswer {
                    reason: "the call's thread panicked".into(),
                })),
            };
            (c, r)
        })
        .collect()
}

/// The CUDA processes of one container and the orchestration over them.
pub struct GpuProcessSet {
    api: Arc<dyn CheckpointApi>,
    processes: Vec<GpuProcess>,
    timeouts: StepTimeouts,
    /// Pairs of the last `restore_all`, reused if rollback retries a restore.
    gpu_pairs: Vec<GpuPair>,
    /// Calls that missed their deadline and may still change a process's state.
    in_flight: Vec<Call<()>>,
}

impl fmt::Debug for GpuProcessSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuProcessSet")
            .field("processes", &self.processes)
            .field("timeouts", &self.timeouts)
            .finish()
    }
}

impl GpuProcessSet {
    /// Finds which of `pids` are CUDA processes (GetRestoreThreadId succeeds) and
    /// their current state. Non-CUDA pids are dropped.
    pub fn discover(
        api: Arc<dyn CheckpointApi>,
        pids: &[u32],
        timeouts: StepTimeouts,
    ) -> Result<Self, OrchestrationError> {
        let deadline = Instant::now() + timeouts.query;
        let calls = pids
            .iter()
            .map(|&pid| {
                spawn_call(&api, pid, Step::GetRestoreThreadId, |api, pid| {
                    let tid = match api.get_restore_thread_id(pid) {
                        Ok(tid) => tid,
                        Err(e) => {
                            tracing::debug!(pid, error = %e, "not a CUDA process");
                            return Ok(None);
                        }
                    };
                    Ok(Some((tid, api.get_state(pid)?)))
                })
            })
            .collect();
        let mut processes = Vec::new();
        for (call, result) in wait_all(calls, deadline) {
            match result {
                None => {
                    return Err(OrchestrationError::QueryTimedOut {
                        pid: call.pid,
                        step: call.step,
                        after: timeouts.query,
                    })
                }
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(None)) => {}
                Some(Ok(Some((tid, state)))) => {
                    tracing::info!(pid = call.pid, restore_tid = tid, %state, "CUDA process");
                    processes.push(GpuProcess::new(call.pid, tid, state));
                }
            }
        }
        Ok(Self {
            api,
            processes,
            timeouts,
            gpu_pairs: Vec::new(),
            in_flight: Vec::new(),
        })
    }

    pub fn processes(&self) -> &[GpuProcess] {
        &self.processes
    }

    pub fn pids(&self) -> Vec<u32> {
        self.processes.iter().map(|p| p.pid).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.processes.is_empty()
    }

    /// RUNNING → LOCKED for every process; `timeout` goes to the driver too.
    pub fn lock_all(&mut self, timeout: Duration) -> Result<(), OrchestrationError> {
        self.step_or_rollback(Step::Lock, timeout)
    }

    /// LOCKED → CHECKPOINTED for every process.
    pub fn checkpoint_all(&mut self) -> Result<(), OrchestrationError> {
        self.step_or_rollback(Step::Checkpoint, self.timeouts.checkpoint)
    }

    /// CHECKPOINTED → LOCKED, remapping GPUs by `gpu_pairs` (13.0+ drivers only).
    pub fn restore_all(&mut self, gpu_pairs: &[GpuPair]) -> Result<(), OrchestrationError> {
        if !gpu_pairs.is_empty() {
            let driver_version = self.api.driver_version()?;
            if driver_version < CUDA_13_0 {
                return Err(DriverError::GpuPairsUnsupported { driver_version }.into());
            }
        }
        self.gpu_pairs = gpu_pairs.to_vec();
        self.step_or_rollback(Step::Restore, self.timeouts.restore)
    }

    /// LOCKED → RUNNING for every process.
    pub fn unlock_all(&mut self) -> Result<(), OrchestrationError> {
        self.step_or_rollback(Step::Unlock, self.timeouts.unlock)
    }

    /// `restore_all` then `unlock_all`: what a dump that leaves the container running
    /// (or that failed in CRIU) needs afterwards.
    pub fn resume_all(&mut self, gpu_pairs: &[GpuPair]) -> Result<(), OrchestrationError> {
        self.restore_all(gpu_pairs)?;
        self.unlock_all()
    }

    /// The JSON record of this set, to be saved next to the CRIU images.
    pub fn record(&self, inventory: Option<Inventory>) -> GpuCheckpointRecord {
        GpuCheckpointRecord::new(
            self.api.driver_version().ok(),
            inventory,
            self.processes.clone(),
        )
    }

    fn step_or_rollback(
        &mut self,
        step: Step,
        timeout: Duration,
    ) -> Result<(), OrchestrationError> {
        let failures = self.run_step(step, timeout, &HashSet::new());
        if failures.is_empty() {
            return Ok(());
        }
        tracing::warn!(%step, failures = %Failures(failures.clone()), "step failed, rolling back");
        let rollback = self.rollback();
        if rollback.is_clean() {
            tracing::info!(%rollback);
        } else {
            tracing::error!(%rollback);
        }
        Err(OrchestrationError::StepFailed {
            step,
            failures: Failures(failures),
            rollback,
        })
    }

    /// Runs `step` on every process it applies to, in parallel, until the deadline.
    fn run_step(&mut self, step: Step, timeout: Duration, exclude: &HashSet<u32>) -> Vec<Failure> {
        let busy: HashSet<u32> = self.in_flight.iter().map(|c| c.pid).collect();
        let mut failures = Vec::new();
        let mut calls = Vec::new();
        let pairs = Arc::new(self.gpu_pairs.clone());
        for p in &mut self.processes {
            if exclude.contains(&p.pid) {
                continue;
            }
            match plan(step, p.state) {
                Plan::Skip => continue,
                Plan::Invalid => {
                    failures.push(Failure {
                        pid: p.pid,
                        step,
                        kind: FailureKind::InvalidState { state: p.state },
                    });
                    continue;
                }
                Plan::Act => {}
            }
            if let Some(c) = self.in_flight.iter().find(|c| c.pid == p.pid) {
                failures.push(Failure {
                    pid: p.pid,
                    step,
                    kind: FailureKind::StillInFlight { step: c.step },
                });
                continue;
            }
            debug_assert!(!busy.contains(&p.pid));
            if step == Step::Checkpoint {
                p.rss_before_checkpoint_kib = rss_kib(p.pid);
            }
            let pairs = Arc::clone(&pairs);
            calls.push(spawn_call(
                &self.api,
                p.pid,
                step,
                move |api, pid| match step {
                    Step::Lock => api.lock(pid, Some(timeout)),
                    Step::Checkpoint => api.checkpoint(pid),
                    Step::Restore => api.restore(pid, &pairs),
                    _ => api.unlock(pid),
                },
            ));
        }
        // The driver enforces the lock timeout itself; our deadline only catches a hang.
        let guard = if step == Step::Lock {
            timeout + self.timeouts.grace
        } else {
            timeout
        };
        for (call, result) in wait_all(calls, Instant::now() + guard) {
            let Some(p) = self.processes.iter_mut().find(|p| p.pid == call.pid) else {
                continue;
            };
            match result {
                Some(r) => {
                    p.finish(step, call.started, call.t0.elapsed(), &r);
                    if step == Step::Checkpoint && r.is_ok() {
                        p.rss_after_checkpoint_kib = rss_kib(p.pid);
                    }
                    tracing::debug!(pid = p.pid, %step, ok = r.is_ok(), took = ?call.t0.elapsed());
                    if let Err(e) = r {
                        failures.push(Failure {
                            pid: p.pid,
                            step,
                            kind: FailureKind::Driver(e),
                        });
                    }
                }
                None => {
                    p.timed_out(step, call.started, call.t0.elapsed());
                    failures.push(Failure {
                        pid: p.pid,
                        step,
                        kind: FailureKind::TimedOut { after: guard },
                    });
                    self.in_flight.push(call);
                }
            }
        }
        failures
    }

    /// Brings every process back to RUNNING: restores what is CHECKPOINTED and unlocks
    /// what is LOCKED, going by the driver's own view of each process.
    pub fn rollback(&mut self) -> RollbackReport {
        let mut failures = self.settle_in_flight();
        let stuck: HashSet<u32> = self.in_flight.iter().map(|c| c.pid).collect();
        failures.extend(self.refresh_states(&stuck));
        failures.extend(self.run_step(Step::Restore, self.timeouts.restore, &stuck));
        failures.extend(self.run_step(Step::Unlock, self.timeouts.unlock, &stuck));
        let left = self
            .processes
            .iter()
            .filter(|p| p.state != ProcessState::Running || stuck.contains(&p.pid))
            .map(|p| (p.pid, p.state))
            .collect();
        RollbackReport {
            processes: self.processes.len(),
            failures: Failures(failures),
            left,
        }
    }

    /// Gives calls that missed their deadline a last chance to finish.
    fn settle_in_flight(&mut self) -> Vec<Failure> {
        let calls = std::mem::take(&mut self.in_flight);
        let mut failures = Vec::new();
        for (call, result) in wait_all(calls, Instant::now() + self.timeouts.grace) {
            let Some(p) = self.processes.iter_mut().find(|p| p.pid == call.pid) else {
                continue;
            };
            match result {
                Some(r) => {
                    tracing::info!(pid = p.pid, step = %call.step, ok = r.is_ok(), "late driver call returned");
                    p.finish(call.step, call.started, call.t0.elapsed(), &r);
                }
                None => {
                    failures.push(Failure {
                        pid: p.pid,
                        step: call.step,
                        kind: FailureKind::StillInFlight { step: call.step },
                    });
                    self.in_flight.push(call);
                }
            }
        }
        failures
    }

    /// Asks the driver for each process's state; our bookkeeping may be stale after
    /// a timeout or a failed call.
    fn refresh_states(&mut self, exclude: &HashSet<u32>) -> Vec<Failure> {
        let calls = self
            .processes
            .iter()
            .filter(|p| !exclude.contains(&p.pid))
            .map(|p| {
                spawn_call(&self.api, p.pid, Step::GetState, |api, pid| {
                    api.get_state(pid)
                })
            })
            .collect();
        let mut failures = Vec::new();
        for (call, result) in wait_all(calls, Instant::now() + self.timeouts.query) {
            let Some(p) = self.processes.iter_mut().find(|p| p.pid == call.pid) else {
                continue;
            };
            match result {
                Some(Ok(state)) => {
                    if state != p.state {
                        tracing::info!(pid = p.pid, ours = %p.state, driver = %state, "state corrected from the driver");
                    }
                    p.state = state;
                }
                Some(Err(e)) => {
                    tracing::warn!(pid = p.pid, error = %e, "cannot query state; keeping ours")
                }
                None => failures.push(Failure {
                    pid: p.pid,
                    step: Step::GetState,
                    kind: FailureKind::TimedOut {
                        after: self.timeouts.query,
                    },
                }),
            }
        }
        failures
    }
}
