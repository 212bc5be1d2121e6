//! GpuProcessSet over an in-process CheckpointApi: orchestration without any library.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_state::driver::CuError;
use gpu_state::process::StepTimeouts;
use gpu_state::{CheckpointApi, DriverError, GpuPair, GpuProcessSet, ProcessState, Step};

/// Driver-like state per pid; `fail_lock` makes that pid's lock fail.
#[derive(Default)]
struct Mem {
    states: Mutex<HashMap<u32, ProcessState>>,
    fail_lock: Option<u32>,
}

impl Mem {
    fn go(
        &self,
        pid: u32,
        step: Step,
        from: ProcessState,
        to: ProcessState,
    ) -> Result<(), DriverError> {
        let mut s = self.states.lock().unwrap();
        let cur = s.get_mut(&pid).ok_or(DriverError::Cuda {
            step,
            pid,
            code: CuError::INVALID_VALUE,
        })?;
        if *cur != from {
            return Err(DriverError::Cuda {
                step,
                pid,
                code: CuError::ILLEGAL_STATE,
            });
        }
        *cur = to;
        Ok(())
    }
}

impl CheckpointApi for Mem {
    fn driver_version(&self) -> Result<i32, DriverError> {
        Ok(13000)
    }
    fn get_state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        let s = self.states.lock().unwrap();
        s.get(&pid).copied().ok_or(DriverError::Cuda {
            step: Step::GetState,
            pid,
            code: CuError::INVALID_VALUE,
        })
    }
    fn get_restore_thread_id(&self, pid: u32) -> Result<u32, DriverError> {
        self.get_state(pid).map(|_| pid)
    }
    fn lock(&self, pid: u32, _t: Option<Duration>) -> Result<(), DriverError> {
        if self.fail_lock == Some(pid) {
            return Err(DriverError::Cuda {
                step: Step::Lock,
                pid,
                code: CuError::NOT_READY,
            });
        }
        self.go(pid, Step::Lock, ProcessState::Running, ProcessState::Locked)
    }
    fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        self.go(
            pid,
            Step::Checkpoint,
            ProcessState::Locked,
            ProcessState::Checkpointed,
        )
    }
    fn restore(&self, pid: u32, _p: &[GpuPair]) -> Result<(), DriverError> {
        self.go(
            pid,
            Step::Restore,
            ProcessState::Checkpointed,
            ProcessState::Locked,
        )
    }
    fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        self.go(
            pid,
            Step::Unlock,
            ProcessState::Locked,
            ProcessState::Running,
        )
    }
}

#[test]
fn lock_failure_rolls_back_in_process() {
    let mem = Arc::new(Mem {
        fail_lock: Some(3),
        ..Default::default()
    });
    mem.states
        .lock()
        .unwrap()
        .extend((1..=4).map(|p| (p, ProcessState::Running)));
    let mut set =
        GpuProcessSet::discover(mem.clone(), &[1, 2, 3, 4, 99], StepTimeouts::default()).unwrap();
    assert_eq!(set.pids(), vec![1, 2, 3, 4]);
    let err = set.lock_all(Duration::from_secs(1)).unwrap_err();
    assert!(
        err.to_string().contains("600 CUDA_ERROR_NOT_READY"),
        "{err}"
    );
    assert!(err.unrecovered_pids().is_empty(), "{err}");
    assert!(mem
        .states
        .lock()
        .unwrap()
        .values()
        .all(|s| *s == ProcessState::Running));
    assert!(set
        .processes()
        .iter()
        .all(|p| p.state == ProcessState::Running));
}
