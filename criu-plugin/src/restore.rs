//! Restore side: RESUME_DEVICES_LATE brings each restored CUDA process back to RUNNING.

use gpu_state::{CheckpointApi, ProcessState};

use crate::checkpoint::with_restore_thread;
use crate::criu::{self, Level};
use crate::{state, ENOTSUP};

/// Called for each restored task, still stopped, before CRIU lets it go.
pub fn resume_devices_late(pid: i32) -> i32 {
    let guard = state::get();
    let Some(plugin) = guard.as_ref() else {
        return ENOTSUP;
    };
    let Some(driver) = plugin.driver.as_ref() else {
        return ENOTSUP;
    };
    let upid = pid as u32;
    if !gpu_state::process::discovery::is_cuda_candidate(upid) {
        return ENOTSUP;
    }
    let Ok(tid) = driver.get_restore_thread_id(upid) else {
        return ENOTSUP;
    };
    let state = match driver.get_state(upid) {
        Ok(s) => s,
        Err(e) => {
            criu::log(Level::Error, &format!("pid {pid}: {e}"));
            return -1;
        }
    };
    let (restore, unlock) = match state {
        ProcessState::Checkpointed => (true, true),
        ProcessState::Locked => (false, true),
        ProcessState::Running => return 0,
        ProcessState::Failed => {
            criu::log(
                Level::Error,
                &format!("the driver reports CUDA process {pid} FAILED"),
            );
            return -1;
        }
    };
    criu::log(
        Level::Info,
        &format!("resuming CUDA process {pid} from {state}"),
    );
    let r = with_restore_thread(tid as i32, || {
        if restore {
            driver.restore(upid, &plugin.gpu_pairs)?;
        }
        if unlock {
            driver.unlock(upid)?;
        }
        Ok::<(), gpu_state::DriverError>(())
    });
    match r {
        Ok(()) => 0,
        Err(msg) => {
            criu::log(Level::Error, &format!("RESUME_DEVICES_LATE: {msg}"));
            -1
        }
    }
}
