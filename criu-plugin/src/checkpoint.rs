//! Dump side: PAUSE_DEVICES (lock), CHECKPOINT_DEVICES (checkpoint) and the
//! end-of-dump cleanup.

use std::time::Duration;

use gpu_state::process::discovery::is_cuda_candidate;
use gpu_state::{CheckpointApi, ProcessState};

use crate::isolated::IsolatedDriver;

use crate::criu::{self, Level};
use crate::state::{self, Tracked};
use crate::{final_state, ptrace, ENOTSUP, PLUGIN_NAME};

/// Lock timeout handed to the driver (`$GPUCR_LOCK_TIMEOUT_MS`, default 10 s like
/// CRIU's own default `--timeout`).
fn lock_timeout() -> Duration {
    let ms = std::env::var("GPUCR_LOCK_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    Duration::from_millis(ms)
}

/// Called for each task before CRIU stops it.
pub fn pause_devices(pid: i32) -> i32 {
    let mut guard = state::get();
    let Some(plugin) = guard.as_mut() else {
        return ENOTSUP;
    };
    let Some(driver) = plugin.driver.as_ref() else {
        return ENOTSUP;
    };
    if plugin.shim.covers(pid) {
        criu::log(
            Level::Info,
            &format!("CUDA process {pid} was quiesced by the gpucr shim: leaving it to the shim"),
        );
        return ENOTSUP;
    }
    let upid = pid as u32;
    // Most tasks map nothing of NVIDIA's: no driver call (each is a child process) for them.
    if !is_cuda_candidate(upid) {
        return ENOTSUP;
    }
    let Ok(tid) = driver.get_restore_thread_id(upid) else {
        criu::log(Level::Debug, &format!("pid {pid} is not a CUDA process"));
        return ENOTSUP;
    };
    // CRIU sees host ids; a restore thread id from another pid namespace would make the
    // ptrace calls around CHECKPOINT_DEVICES hit the wrong thread and the driver wait forever.
    if !std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
        criu::log(
            Level::Error,
            &format!(
                "pid {pid}: the driver names thread {tid} as its CUDA restore thread, but \
                 /proc/{pid}/task/{tid} does not exist (a pid namespace mismatch?)"
            ),
        );
        return -1;
    }
    let initial = match driver.get_state(upid) {
        Ok(s) => s,
        Err(e) => {
            criu::log(Level::Error, &format!("pid {pid}: {e}"));
            return -1;
        }
    };
    if !plugin.inventory_added {
        if criu::add_inventory_plugin(PLUGIN_NAME).is_err() {
            criu::log(
                Level::Error,
                "cannot add the CUDA plugin to the inventory image",
            );
            return -1;
        }
        plugin.inventory_added = true;
        record_gpus();
    }
    if initial == ProcessState::Running {
        criu::log(
            Level::Info,
            &format!("locking CUDA process {pid} (restore thread {tid})"),
        );
        if let Err(e) = driver.lock(upid, Some(lock_timeout())) {
            criu::log(Level::Error, &format!("PAUSE_DEVICES: {e}"));
            // A lock that landed after all must not outlive the failed dump.
            if matches!(driver.get_state(upid), Ok(ProcessState::Locked)) {
                let _ = driver.unlock(upid);
            }
            return -1;
        }
    } else {
        criu::log(
            Level::Info,
            &format!("CUDA process {pid} is already {initial}; leaving it so"),
        );
    }
    plugin.tracked.push(Tracked {
        pid,
        restore_tid: tid as i32,
        initial,
        checkpointed: false,
    });
    0
}

/// Called for each task once the whole tree is stopped.
pub fn checkpoint_devices(pid: i32) -> i32 {
    let mut guard = state::get();
    let Some(plugin) = guard.as_mut() else {
        return ENOTSUP;
    };
    let Some(driver) = plugin.driver.as_ref() else {
        return ENOTSUP;
    };
    let shim_owned = plugin.shim.covers(pid);
    let Some(t) = plugin.tracked.iter_mut().find(|t| t.pid == pid) else {
        if shim_owned {
            return ENOTSUP;
        }
        if is_cuda_candidate(pid as u32) && driver.get_restore_thread_id(pid as u32).is_ok() {
            // A CUDA process we did not pause (it initialised CUDA after seize).
            criu::log(
                Level::Error,
                &format!("CUDA process {pid} was not locked before the freeze"),
            );
            return -1;
        }
        return ENOTSUP;
    };
    if t.initial == ProcessState::Checkpointed {
        return 0;
    }
    criu::log(
        Level::Info,
        &format!(
            "checkpointing CUDA process {pid} (restore thread {} resumed for the call)",
            t.restore_tid
        ),
    );
    let t0 = std::time::Instant::now();
    let r = with_restore_thread(t.restore_tid, || driver.checkpoint(pid as u32));
    match r {
        Ok(()) => {
            criu::log(
                Level::Info,
                &format!(
                    "checkpointed CUDA process {pid} in {:.2} s",
                    t0.elapsed().as_secs_f64()
                ),
            );
            t.checkpointed = true;
            0
        }
        Err(msg) => {
            criu::log(Level::Error, &format!("CHECKPOINT_DEVICES: {msg}"));
            -1
        }
    }
}

/// Runs `f` while the restore thread `tid` is allowed to run.
pub fn with_restore_thread<E: std::fmt::Display>(
    tid: i32,
    f: impl FnOnce() -> Result<(), E>,
) -> Result<(), String> {
    let resumed =
        ptrace::resume(tid).map_err(|e| format!("cannot resume the CUDA restore thread: {e}"))?;
    let r = f().map_err(|e| e.to_string());
    let stopped = resumed
        .stop()
        .map_err(|e| format!("cannot stop the CUDA restore thread again: {e}"));
    r.and(stopped)
}

/// `exit(DUMP, ret)`: puts every process we touched back to its initial state unless
/// CRIU is about to kill it.
pub fn finish_dump(ret: i32) {
    let mut guard = state::get();
    let Some(plugin) = guard.as_mut() else { return };
    let tracked = std::mem::take(&mut plugin.tracked);
    let Some(driver) = plugin.driver.as_ref() else {
        return;
    };
    if tracked.is_empty() {
        return;
    }
    let (alive, why) = final_state::tasks_stay_alive(ret);
    if !alive {
        criu::log(
            Level::Info,
            &format!(
                "leaving {} CUDA processes checkpointed: {why}",
                tracked.len()
            ),
        );
        return;
    }
    criu::log(
        Level::Info,
        &format!("resuming {} CUDA processes: {why}", tracked.len()),
    );
    for t in tracked {
        if let Err(msg) = back_to_initial(driver, &t) {
            criu::log(
                Level::Error,
                &format!("pid {} may stay paused on the GPU: {msg}", t.pid),
            );
        }
    }
}

fn back_to_initial(driver: &IsolatedDriver, t: &Tracked) -> Result<(), String> {
    let pid = t.pid as u32;
    let restore = t.checkpointed && t.initial != ProcessState::Checkpointed;
    let unlock = t.initial == ProcessState::Running;
    if !restore && !unlock {
        return Ok(());
    }
    criu::log(
        Level::Info,
        &format!(
            "pid {pid}: restore={restore} unlock={unlock} (restore thread {})",
            t.restore_tid
        ),
    );
    with_restore_thread(t.restore_tid, || {
        if restore {
            driver.restore(pid, &[])?;
        }
        if unlock {
            driver.unlock(pid)?;
        }
        Ok::<(), gpu_state::DriverError>(())
    })
}

/// Records this host's GPUs in the image, for restores elsewhere (see `gpus`). Without the
/// record a restore cannot pair GPUs; the dump itself is still good.
fn record_gpus() {
    let Some(dir) = crate::gpus::image_dir() else {
        criu::log(
            Level::Warn,
            "no image directory from CRIU: GPUs not recorded",
        );
        return;
    };
    // procfs, not NVML: NVML starts threads, and a multi-threaded CRIU cannot setns.
    let inventory = gpu_state::inventory::Inventory::gather_procfs();
    match crate::gpus::save(&dir, &inventory) {
        Ok(()) => criu::log(
            Level::Info,
            &format!(
                "recorded {} GPUs (driver {}) in {}",
                inventory.gpus.len(),
                inventory.driver_version.as_deref().unwrap_or("unknown"),
                crate::gpus::FILE
            ),
        ),
        Err(e) => criu::log(
            Level::Warn,
            &format!("{e}; a restore elsewhere cannot pair GPUs"),
        ),
    }
}
