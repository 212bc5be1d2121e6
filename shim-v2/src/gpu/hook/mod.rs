//! The shim's side of the hook's fast path (`libgpucr_hook.so`, see `hook/README.md`):
//! before the driver's lock, each CUDA process whose hook answers is frozen, its device
//! memory copied into `<image>/gpu-hook/<ns pid>/` (a GPU state image, written by the hook
//! into a directory passed as an fd: the hook cannot see host paths) and released, so the
//! driver's checkpoint only moves what is left. After the dump (leave-running), or on
//! any failure before it, every such process gets its memory back: Remap → CopyIn → Thaw
//! (or just Thaw, when nothing was released yet). A restored process does the same.
//!
//! A leave-running checkpoint asks the hook to keep the memory (`Release { keep }`): the
//! hook exports it and the shim holds the fds across the driver's checkpoint and the dump,
//! so the memory never leaves the GPU; giving it back is then Reattach → Thaw, no copy-in.
//! The image is written all the same; a failed Reattach falls back to Remap → CopyIn.
//!
//! With `snapshot` (leave-running, task not paused), the hook is asked to Snapshot instead
//! of CopyOut + Release: it copies its memory device to device into a snapshot, whose fd
//! this shim holds, and frees the memory itself. After the dump the process gets its
//! memory back from the snapshot (Reattach: device to device) and runs (Thaw), and only
//! then is the snapshot written into the image (WriteSnapshot), while the workload runs:
//! the pause no longer includes the copy to the host. A hook that cannot (no room on the device, memory not exportable) answers
//! with an error and the copy-out path is used. The snapshot's image is written before
//! the checkpoint completes; until then the shim's fds are the only copy of the state.
//!
//! A process whose hook does not answer, reports memory it cannot move, or fails before
//! anything was released is thawed and left to the driver path alone, with the reason
//! logged and recorded. Only a process whose memory was released and cannot be given
//! back fails the checkpoint (after every other process got its memory back).
//!
//! Calls are blocking (the hook's protocol is synchronous); callers run them on a
//! blocking thread. Processes are handled one after another.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpucr_hook::control::{socket_path, ControlError};
use gpucr_hook::protocol::{ErrorKind, Verb};
use thiserror::Error;

mod checkpoint;
mod conn;
mod give_back;
mod record;
mod restore;
pub mod spec;

pub use checkpoint::{copy_out, HookCheckpoint};
pub use record::{Fallback, HookRecord, ProcessRecord, IMAGE_DIR, RECORD_FILE};
pub use restore::copy_in_restored;

/// How long one verb may take (a copy of tens of GiB included).
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

/// Hook orchestration errors.
#[derive(Debug, Error)]
pub enum HookError {
    #[error("hook of pid {pid}: {source}")]
    Control {
        pid: u32,
        #[source]
        source: ControlError,
    },
    /// The hook answered with an error (its state unchanged).
    #[error("hook of pid {pid}: {verb:?} failed: {kind:?}: {message}")]
    Verb {
        pid: u32,
        verb: Verb,
        kind: ErrorKind,
        message: String,
    },
    #[error("hook of pid {pid}: {verb:?} answered {outcome}")]
    Unexpected {
        pid: u32,
        verb: Verb,
        outcome: String,
    },
    #[error("hook of pid {pid}: {what}: {source}")]
    Io {
        pid: u32,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the hook of pid {pid} released its device memory and could not get it back \
         ({cause}); the process stays frozen: kill it (its GPU state is lost) or restore \
         the container from a checkpoint"
    )]
    Stranded { pid: u32, cause: String },
    #[error("{path}: cannot {what}: {source}; take a new checkpoint")]
    RecordIo {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: damaged: {source}; take a new checkpoint")]
    RecordDamaged {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{path}: version {version} is newer than this gpucr understands ({understood}); \
         upgrade gpucr; take a new checkpoint"
    )]
    RecordVersion {
        path: PathBuf,
        version: u32,
        understood: u32,
    },
    #[error(
        "{path}: the GPU state image of pid {ns_pid} is damaged: {source}; take a new checkpoint"
    )]
    ImageDamaged {
        path: PathBuf,
        ns_pid: u32,
        #[source]
        source: Box<gpu_state::ImageError>,
    },
}

type Result<T, E = HookError> = std::result::Result<T, E>;

/// A container process with a hook socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookProcess {
    pub host_pid: u32,
    /// Its pid in the container's pid namespace: the hook names its socket with it, and
    /// CRIU keeps it, so it also names the process's image.
    pub ns_pid: u32,
    pub socket: PathBuf,
}

/// The pid of `host_pid` in its own (innermost) pid namespace (`NSpid` in its status).
pub fn ns_pid(host_pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{host_pid}/status")).ok()?;
    parse_ns_pid(&status)
}

fn parse_ns_pid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The processes among `host_pids` whose hook socket is in `socket_dir`.
pub fn find(socket_dir: &Path, host_pids: &[u32]) -> Vec<HookProcess> {
    host_pids
        .iter()
        .filter_map(|&host_pid| {
            let ns_pid = ns_pid(host_pid)?;
            let socket = socket_path(socket_dir, ns_pid);
            socket.exists().then_some(HookProcess {
                host_pid,
                ns_pid,
                socket,
            })
        })
        .collect()
}

fn ms_since(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

#[cfg(test)]
mod tests;
