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
    // Every call below needs the process's restore thread running: CRIU holds the restored
    // tasks stopped here, and even GetState waits for that thread (it hangs while the
    // thread is stopped).
    let r = with_restore_thread(tid as i32, || {
        let state = driver.get_state(upid).map_err(|e| e.to_string())?;
        let (restore, unlock) = match state {
            ProcessState::Checkpointed => (true, true),
            ProcessState::Locked => (false, true),
            ProcessState::Running => return Ok(()),
            ProcessState::Failed => {
                return Err(format!("the driver reports CUDA process {pid} FAILED"));
            }
        };
        criu::log(
            Level::Info,
            &format!("resuming CUDA process {pid} from {state} (restore thread {tid})"),
        );
        if restore {
            driver
                .restore(upid, &plugin.gpu_pairs)
                .map_err(|e| e.to_string())?;
        }
        if unlock {
            driver.unlock(upid).map_err(|e| e.to_string())?;
        }
        Ok::<(), String>(())
    });
    match r {
        Ok(()) => 0,
        Err(msg) => {
            criu::log(
                Level::Error,
                &format!("RESUME_DEVICES_LATE: pid {pid}: {msg}"),
            );
            -1
        }
    }
}
