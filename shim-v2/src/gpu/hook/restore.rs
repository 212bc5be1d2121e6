//! The hook's part of a restore: each restored process gets its memory back from the
//! image, with the copy-in helpers the shim started for it.

use std::path::Path;
use std::time::Instant;

use gpucr_hook::control::socket_path;
use gpucr_hook::protocol::{CheckpointState, Verb};

use super::conn::Conn;
use super::give_back::Moved;
use super::{HookError, HookProcess, HookRecord, Result};
use crate::gpu::restore_helpers::RestoreHelpers;

/// Restore, after the driver's restore and unlock: each process of `record` (named by
/// its namespace pid, which CRIU kept) gets its memory back from the image and runs,
/// with the copy-in helpers `helpers` started for it (handed over by Warm; a refused
/// Warm only costs their share being staged). Returns how many.
pub fn copy_in_restored(
    id: &str,
    socket_dir: &Path,
    image: &Path,
    record: &HookRecord,
    helpers: &mut RestoreHelpers,
) -> Result<usize> {
    for p in &record.processes {
        let process = HookProcess {
            host_pid: p.ns_pid,
            ns_pid: p.ns_pid,
            socket: socket_path(socket_dir, p.ns_pid),
        };
        let mut conn = Conn::open(&process)?;
        let status = conn.status()?;
        // Snapshotted: checkpointed with a snapshot, whose image was written before the
        // checkpoint completed.
        if !matches!(
            status.state,
            CheckpointState::Released | CheckpointState::Snapshotted
        ) {
            return Err(HookError::Unexpected {
                pid: p.ns_pid,
                verb: Verb::Status,
                outcome: format!(
                    "state {:?} after a restore (Released expected)",
                    status.state
                ),
            });
        }
        if let Some(h) = helpers.take(p.ns_pid) {
            match conn.warm_helpers(h) {
                Ok(report) => tracing::info!(
                    id,
                    ns_pid = p.ns_pid,
                    helpers = report.helpers,
                    bytes = report.ahead_bytes,
                    "copy-in helpers handed to the hook"
                ),
                Err(e) => tracing::warn!(id, ns_pid = p.ns_pid, error = %e,
                    "copy-in helpers not handed over; the copy-in stages everything"),
            }
        }
        let mut moved = Moved {
            process,
            // Released, or Snapshotted: a snapshot checkpoint's image is complete.
            state: status.state,
            unwritten: false,
            record: p.clone(),
            held: Vec::new(),
            fds: Vec::new(),
            // Held since the dump; counted here from the give-back.
            frozen_at: Instant::now(),
        };
        moved.give_back(id, image, &mut conn)?;
        tracing::info!(
            id,
            ns_pid = p.ns_pid,
            "restored process's device memory copied in"
        );
    }
    Ok(record.processes.len())
}
