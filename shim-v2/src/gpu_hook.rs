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

use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpucr_hook::control::{socket_path, ControlClient, ControlError};
use gpucr_hook::protocol::{
    CheckpointState, CopyInReport, HookStatus, Outcome, PrepareReport, Reply, Request,
    SnapshotReport, Verb, WarmReport,
};
use serde::{Deserialize, Serialize};

use crate::restore_helpers::{ProcessHelpers, RestoreHelpers};
use thiserror::Error;

/// The record of the hook's part of a checkpoint, next to `gpucr-gpu.json`.
pub const RECORD_FILE: &str = "gpucr-hook.json";
/// The directory of the per-process GPU state images inside a checkpoint image.
pub const IMAGE_DIR: &str = "gpu-hook";
const RECORD_VERSION: u32 = 1;
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
    #[error("hook of pid {pid}: {verb:?} failed: {message}")]
    Verb {
        pid: u32,
        verb: Verb,
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
    #[error("{path}: {msg}; take a new checkpoint")]
    Record { path: PathBuf, msg: String },
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

/// Connects to `socket` through an `O_PATH` descriptor of its directory
/// (`/proc/self/fd/<n>/<name>`): the bundle's path under containerd's state directory
/// (a 64-character CRI id in it) easily makes the socket's own path longer than a unix
/// socket address may be (108 bytes).
fn connect(socket: &Path) -> std::result::Result<ControlClient, ControlError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let (Some(dir), Some(name)) = (socket.parent(), socket.file_name()) else {
        return ControlClient::connect(socket);
    };
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|source| ControlError::Socket {
            path: socket.to_path_buf(),
            source,
        })?;
    let short = Path::new("/proc/self/fd")
        .join(dir.as_raw_fd().to_string())
        .join(name);
    ControlClient::connect(&short).map_err(|e| match e {
        ControlError::Socket { source, .. } => ControlError::Socket {
            path: socket.to_path_buf(),
            source,
        },
        other => other,
    })
}

/// One process's connection.
struct Conn {
    pid: u32,
    client: ControlClient,
}

impl Conn {
    fn open(p: &HookProcess) -> Result<Conn> {
        let control = |source| HookError::Control {
            pid: p.host_pid,
            source,
        };
        let client = connect(&p.socket).map_err(control)?;
        client
            .set_timeout(Some(CALL_TIMEOUT))
            .map_err(|e| control(ControlError::Frame(e.into())))?;
        Ok(Conn {
            pid: p.host_pid,
            client,
        })
    }

    fn reply(
        &self,
        verb: Verb,
        reply: std::result::Result<Reply, ControlError>,
    ) -> Result<Outcome> {
        match reply.map_err(|source| HookError::Control {
            pid: self.pid,
            source,
        })? {
            Reply::Ok(outcome) => Ok(outcome),
            Reply::Error(e) => Err(HookError::Verb {
                pid: self.pid,
                verb,
                message: format!("{:?}: {}", e.kind, e.message),
            }),
        }
    }

    fn call(&mut self, req: &Request) -> Result<Outcome> {
        let reply = self.client.call(req);
        self.reply(req.verb(), reply)
    }

    fn status(&mut self) -> Result<HookStatus> {
        match self.call(&Request::Status)? {
            Outcome::Status(s) => Ok(s),
            other => Err(self.unexpected(Verb::Status, &other)),
        }
    }

    fn copy_out(&mut self, dir: &File, name: &Path) -> Result<(u64, usize)> {
        let reply = self.client.copy_out_fd(dir, name, None);
        match self.reply(Verb::CopyOut, reply)? {
            Outcome::CopiedOut(r) => Ok((r.bytes, r.allocations)),
            other => Err(self.unexpected(Verb::CopyOut, &other)),
        }
    }

    /// Prepare a CopyOut into `<dir>/<name>` while the process runs.
    fn prepare(&mut self, dir: &File, name: &Path) -> Result<PrepareReport> {
        let reply = self.client.prepare_fd(dir, name, None);
        match self.reply(Verb::Prepare, reply)? {
            Outcome::Prepared(r) => Ok(r),
            other => Err(self.unexpected(Verb::Prepare, &other)),
        }
    }

    /// A verb whose reply may come with memory fds: the outcome and the fds.
    fn call_for_fds(
        &mut self,
        verb: Verb,
        call: impl FnOnce(
            &mut ControlClient,
        ) -> std::result::Result<(Reply, Vec<OwnedFd>), ControlError>,
    ) -> Result<(Outcome, Vec<OwnedFd>)> {
        let (reply, fds) = match call(&mut self.client) {
            Ok((reply, fds)) => (Ok(reply), fds),
            Err(e) => (Err(e), Vec::new()),
        };
        Ok((self.reply(verb, reply)?, fds))
    }

    /// Release; with `keep`, the kept memory's addresses and fds (empty when the hook
    /// could not keep it).
    fn release(&mut self, keep: bool) -> Result<(Vec<u64>, Vec<OwnedFd>)> {
        match self.call_for_fds(Verb::Release, |c| c.release(keep))? {
            // Without every fd nothing is kept (the memory is freed as they close).
            (Outcome::Released(r), fds) if r.held.len() == fds.len() => Ok((r.held, fds)),
            (Outcome::Released(_), _) => Ok((Vec::new(), Vec::new())),
            (other, _) => Err(self.unexpected(Verb::Release, &other)),
        }
    }

    /// Snapshot: the report and the fds of its `held` addresses (the memory, then the
    /// snapshot). A reply without every fd is an error: that memory is gone.
    fn snapshot(&mut self) -> Result<(SnapshotReport, Vec<OwnedFd>)> {
        match self.call_for_fds(Verb::Snapshot, |c| c.snapshot())? {
            (Outcome::Snapshotted(r), fds) if r.release.held.len() == fds.len() => Ok((r, fds)),
            (Outcome::Snapshotted(r), fds) => Err(HookError::Stranded {
                pid: self.pid,
                cause: format!(
                    "{} of the {} kept memory fds arrived after its Snapshot",
                    fds.len(),
                    r.release.held.len()
                ),
            }),
            (other, _) => Err(self.unexpected(Verb::Snapshot, &other)),
        }
    }

    /// WriteSnapshot into `<dir>/<name>`: bytes and milliseconds.
    fn write_snapshot(&mut self, dir: &File, name: &Path) -> Result<u64> {
        let reply = self.client.write_snapshot_fd(dir, name, None);
        match self.reply(Verb::WriteSnapshot, reply)? {
            Outcome::SnapshotWritten(r) => Ok(r.bytes),
            other => Err(self.unexpected(Verb::WriteSnapshot, &other)),
        }
    }

    fn reattach(&mut self, held: &[u64], fds: &[OwnedFd]) -> Result<()> {
        let reply = self.client.reattach(held, fds);
        match self.reply(Verb::Reattach, reply)? {
            Outcome::Reattached(_) => Ok(()),
            other => Err(self.unexpected(Verb::Reattach, &other)),
        }
    }

    fn copy_in(&mut self, image: &Path) -> Result<CopyInReport> {
        let dir = File::open(image).map_err(|source| HookError::Io {
            pid: self.pid,
            what: format!("opening {}", image.display()),
            source,
        })?;
        let reply = self.client.copy_in_fd(&dir);
        match self.reply(Verb::CopyIn, reply)? {
            Outcome::CopiedIn(r) => Ok(r),
            other => Err(self.unexpected(Verb::CopyIn, &other)),
        }
    }

    /// Hands over the restore's helpers (see [`crate::restore_helpers`]).
    fn warm_helpers(&mut self, helpers: ProcessHelpers) -> Result<WarmReport> {
        let reply = self.client.warm_with_helpers(helpers.jobs, &helpers.socks);
        match self.reply(Verb::Warm, reply)? {
            Outcome::Warmed(report) => Ok(report),
            other => Err(self.unexpected(Verb::Warm, &other)),
        }
    }

    fn unexpected(&self, verb: Verb, outcome: &Outcome) -> HookError {
        HookError::Unexpected {
            pid: self.pid,
            verb,
            outcome: format!("{outcome:?}"),
        }
    }
}

/// Whether this shim can hold `n` more fds (kept memory) under its soft `RLIMIT_NOFILE`;
/// when not, the memory is not kept (the copy-in gives it back). The limit is not raised:
/// the containers this shim starts would inherit it.
fn fds_fit(pid: u32, n: usize) -> bool {
    match gpucr_hook::control::FdRoom::now() {
        Ok(room) if room.fits(n) => true,
        Ok(room) => {
            tracing::warn!(
                pid,
                allocations = n,
                open = room.open,
                soft_limit = room.soft,
                "device memory not kept on the GPU: the shim's fd limit is too low (raise \
                 containerd's LimitNOFILE); it is copied back in instead"
            );
            false
        }
        Err(e) => {
            tracing::warn!(pid, error = %e, "device memory not kept: cannot read the fd limit");
            false
        }
    }
}

fn ms_since(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

/// What the checkpoint did with one process's hook.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub host_pid: u32,
    pub ns_pid: u32,
    pub allocations: usize,
    pub freeze_ms: u64,
    pub copy_out_bytes: u64,
    pub copy_out_ms: u64,
    pub release_ms: u64,
    /// Allocations whose memory the shim held on the GPU across the dump (leave-running).
    #[serde(default)]
    pub kept: usize,
    /// The Snapshot verb (device-to-device copy and release), when the memory was
    /// snapshotted; `copy_out_ms` is then the image's write after the thaw.
    #[serde(default)]
    pub snapshot_ms: u64,
    /// From the Freeze to the Thaw: how long the process's GPU work was held (0 when
    /// not thawed by this checkpoint, e.g. it exited).
    #[serde(default)]
    pub gpu_paused_ms: u64,
    /// Whether the copy-out was prepared before the freeze, and how long that took.
    #[serde(default)]
    pub prepared: bool,
    #[serde(default)]
    pub prepare_ms: u64,
}

/// A process left to the driver path, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fallback {
    pub host_pid: u32,
    pub reason: String,
}

/// `gpucr-hook.json`: whether the container had the hook, and per process what moved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HookRecord {
    pub version: u32,
    pub injected: bool,
    pub processes: Vec<ProcessRecord>,
    pub fallbacks: Vec<Fallback>,
}

impl HookRecord {
    /// The record of a checkpoint whose container had the hook but whose GPU state the
    /// hook did not move (CRIU's plugin did): the restore needs the hook's mounts all the
    /// same, since CRIU restores the library mapped at them.
    pub fn injected_only() -> HookRecord {
        HookRecord {
            version: RECORD_VERSION,
            injected: true,
            processes: Vec::new(),
            fallbacks: Vec::new(),
        }
    }

    pub fn file_path(image: &Path) -> PathBuf {
        image.join(RECORD_FILE)
    }

    /// The device memory the hooks give back at a restore (every process's allocations).
    pub fn device_bytes(&self) -> u64 {
        self.processes.iter().map(|p| p.copy_out_bytes).sum()
    }

    /// The image directory of process `ns_pid` (never taken from the record's text).
    pub fn image_of(image: &Path, ns_pid: u32) -> PathBuf {
        image.join(IMAGE_DIR).join(ns_pid.to_string())
    }

    pub fn save(&self, image: &Path) -> Result<()> {
        let path = Self::file_path(image);
        let text = serde_json::to_vec_pretty(self).expect("hook record serializes");
        std::fs::write(&path, text).map_err(|e| HookError::Record {
            path,
            msg: format!("cannot write: {e}"),
        })
    }

    /// The record of `image`, if it has one.
    pub fn load(image: &Path) -> Result<Option<HookRecord>> {
        let path = Self::file_path(image);
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(HookError::Record {
                    path,
                    msg: format!("cannot read: {e}"),
                })
            }
        };
        let record: HookRecord = serde_json::from_slice(&text).map_err(|e| HookError::Record {
            path: path.clone(),
            msg: format!("damaged: {e}"),
        })?;
        if record.version > RECORD_VERSION {
            return Err(HookError::Record {
                path,
                msg: format!(
                    "version {} is newer than this gpucr understands ({RECORD_VERSION}); \
                     upgrade gpucr",
                    record.version
                ),
            });
        }
        Ok(Some(record))
    }

    /// Reads every process's image through (manifest, chunk checksums): a damaged or
    /// missing one is refused before a restore changes anything.
    pub fn validate(&self, image: &Path) -> Result<()> {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
        for p in &self.processes {
            let dir = Self::image_of(image, p.ns_pid);
            gpu_state::image::ImageReader::open(&dir)
                .and_then(|r| r.verify(threads))
                .map_err(|e| HookError::Record {
                    path: dir.clone(),
                    msg: format!("the GPU state image of pid {} is damaged: {e}", p.ns_pid),
                })?;
        }
        Ok(())
    }
}

/// How far a process got; what giving its memory back takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Frozen,
    CopiedOut,
    Released,
    /// The kept memory is mapped again: Thaw is all that is left.
    Reattached,
    /// Memory freed, its snapshot held by this shim: Reattach → Thaw → write.
    Snapshotted,
    /// Memory back from the snapshot: Thaw, then the snapshot's write.
    SnapshotReattached,
    /// Running; the snapshot is still to be written (or dropped).
    WritePending,
    /// Running; its snapshot was dropped or could not be written: not in the image.
    Unwritten,
    /// Running, with its image complete.
    Done,
}

/// A process whose hook moved (part of) the checkpoint.
#[derive(Debug)]
struct Moved {
    process: HookProcess,
    stage: Stage,
    record: ProcessRecord,
    /// Kept memory (Release with `keep`): addresses and the fds that hold it.
    held: Vec<u64>,
    fds: Vec<OwnedFd>,
    /// When the Freeze was asked for.
    frozen_at: Instant,
}

/// The hook's part of one checkpoint: processes frozen with their memory in the image
/// (and released), and those left to the driver path. Give the memory back with
/// [`HookCheckpoint::give_back`] unless CRIU killed the task.
#[derive(Debug)]
pub struct HookCheckpoint {
    id: String,
    image: PathBuf,
    /// Ask the hooks to keep the memory on the GPU (the task lives on).
    keep: bool,
    /// Ask the hooks for a snapshot (the task lives on, and runs once given back).
    snapshot: bool,
    /// Ask the hooks to prepare their copy-out before the freeze (the task may run).
    prepare: bool,
    moved: Vec<Moved>,
    fallbacks: Vec<Fallback>,
}

/// Checkpoint, before the driver's lock: Status → Freeze → CopyOut → Release for each of
/// `processes`, images under `<image>/gpu-hook/`; with `keep` (leave-running) the memory
/// stays on the GPU, held by this shim until [`HookCheckpoint::give_back`]. A `running`
/// task (not paused by the client) may run on while the hook prepares: with `keep`,
/// Snapshot replaces CopyOut + Release where the hook can, and the image is written by
/// [`HookCheckpoint::give_back_and_write`]; without, the CopyOut is prepared (Prepare)
/// before the Freeze. A paused task gets neither: it must not run before its dump (the
/// client took, or will take, its rootfs at the pause). A process that cannot is left
/// running for the driver path; an error means a process could not be brought back
/// (every other one was).
pub fn copy_out(
    id: &str,
    processes: &[HookProcess],
    image: &Path,
    keep: bool,
    running: bool,
) -> Result<HookCheckpoint> {
    let mut cp = HookCheckpoint {
        id: id.to_string(),
        image: image.to_path_buf(),
        keep,
        snapshot: keep && running,
        prepare: running && !keep,
        moved: Vec::new(),
        fallbacks: Vec::new(),
    };
    let root = image.join(IMAGE_DIR);
    let dir = std::fs::create_dir_all(&root)
        .and_then(|()| File::open(&root))
        .map_err(|source| HookError::Io {
            pid: 0,
            what: format!("creating {}", root.display()),
            source,
        })?;
    for p in processes {
        match cp.move_one(p, &dir) {
            Ok(moved) => {
                tracing::info!(
                    id,
                    pid = p.host_pid,
                    ns_pid = p.ns_pid,
                    bytes = moved.record.copy_out_bytes,
                    copy_out_ms = moved.record.copy_out_ms,
                    kept = moved.record.kept,
                    "device memory moved by the hook"
                );
                cp.moved.push(moved);
            }
            Err(Outcome1::Fallback(reason)) => {
                tracing::warn!(id, pid = p.host_pid, %reason, "hook fast path not used for \
                    this process; the driver checkpoints all of its memory");
                cp.fallbacks.push(Fallback {
                    host_pid: p.host_pid,
                    reason,
                });
            }
            Err(Outcome1::Fatal(e)) => {
                if let Err(again) = cp.give_back() {
                    tracing::error!(id, "after a hook failure: {again}");
                }
                return Err(e);
            }
        }
    }
    Ok(cp)
}

/// Why one process did not move.
enum Outcome1 {
    /// Running again with its memory: the driver path takes it.
    Fallback(String),
    /// Not running: the checkpoint must fail.
    Fatal(HookError),
}

impl HookCheckpoint {
    fn move_one(&self, p: &HookProcess, dir: &File) -> std::result::Result<Moved, Outcome1> {
        let fallback = |e: HookError| Outcome1::Fallback(e.to_string());
        let mut conn = Conn::open(p).map_err(fallback)?;
        let status = conn.status().map_err(fallback)?;
        if let Some(first) = status.unsupported.first() {
            return Err(Outcome1::Fallback(format!(
                "{} allocation(s) the hook cannot move (first: {first:?})",
                status.unsupported.len()
            )));
        }
        if status.state != CheckpointState::Running {
            return Err(Outcome1::Fallback(format!(
                "the hook is {:?}, not Running (an earlier checkpoint did not finish)",
                status.state
            )));
        }
        let name = PathBuf::from(p.ns_pid.to_string());
        let (mut prepared, mut prepare_ms) = (false, 0);
        if self.prepare {
            // The image's data file allocated and registered while the process runs: the
            // frozen copy-out then only moves bytes. Refused where it cannot help (an
            // image off tmpfs): the copy-out stages as before.
            let t = Instant::now();
            match conn.prepare(dir, &name) {
                Ok(r) => {
                    (prepared, prepare_ms) = (true, ms_since(t));
                    tracing::info!(id = %self.id, pid = p.host_pid, bytes = r.bytes,
                        windows = r.windows, prepare_ms, "copy-out prepared while the process runs");
                }
                Err(HookError::Verb { message, .. }) => tracing::info!(
                    id = %self.id,
                    pid = p.host_pid,
                    reason = %message,
                    "copy-out not prepared"
                ),
                Err(e) => return Err(fallback(e)),
            }
        }
        let mut moved = Moved {
            process: p.clone(),
            stage: Stage::Frozen,
            record: ProcessRecord {
                host_pid: p.host_pid,
                ns_pid: p.ns_pid,
                allocations: status.allocations,
                freeze_ms: 0,
                copy_out_bytes: 0,
                copy_out_ms: 0,
                release_ms: 0,
                kept: 0,
                snapshot_ms: 0,
                gpu_paused_ms: 0,
                prepared,
                prepare_ms,
            },
            held: Vec::new(),
            fds: Vec::new(),
            frozen_at: Instant::now(),
        };
        let t = moved.frozen_at;
        conn.call(&Request::Freeze).map_err(fallback)?;
        moved.record.freeze_ms = ms_since(t);
        if self.snapshot && fds_fit(p.host_pid, 1) {
            let t = Instant::now();
            match conn.snapshot() {
                Ok((report, fds)) => {
                    moved.record.snapshot_ms = ms_since(t);
                    moved.record.kept = report.release.allocations;
                    moved.held = report.release.held;
                    moved.fds = fds;
                    moved.stage = Stage::Snapshotted;
                    return Ok(moved);
                }
                // Refused: still Frozen, nothing released.
                Err(HookError::Verb { message, .. }) => tracing::info!(
                    id = %self.id,
                    pid = p.host_pid,
                    reason = %message,
                    "no device snapshot; copying the memory out while frozen"
                ),
                Err(e) => return Err(self.undo_one(&mut moved, &mut conn, e)),
            }
        }
        let t = Instant::now();
        let steps = conn.copy_out(dir, &name).and_then(|(bytes, allocations)| {
            moved.stage = Stage::CopiedOut;
            moved.record.copy_out_ms = ms_since(t);
            (moved.record.copy_out_bytes, moved.record.allocations) = (bytes, allocations);
            let t = Instant::now();
            let (held, fds) = conn.release(self.keep && fds_fit(p.host_pid, allocations))?;
            moved.record.release_ms = ms_since(t);
            moved.record.kept = held.len();
            (moved.held, moved.fds) = (held, fds);
            moved.stage = Stage::Released;
            Ok(())
        });
        match steps {
            Ok(()) => Ok(moved),
            // The hook undid a failed release itself; the process is CopiedOut or Frozen.
            Err(e) => Err(self.undo_one(&mut moved, &mut conn, e)),
        }
    }

    /// After `e` failed a process's checkpoint: it runs again with its memory (and goes
    /// to the driver path), or is stranded.
    fn undo_one(&self, moved: &mut Moved, conn: &mut Conn, e: HookError) -> Outcome1 {
        let p = &moved.process;
        let (host_pid, ns_pid) = (p.host_pid, p.ns_pid);
        match give_back_one(&self.id, &self.image, moved, conn) {
            Ok(()) => {
                let _ = std::fs::remove_dir_all(HookRecord::image_of(&self.image, ns_pid));
                Outcome1::Fallback(e.to_string())
            }
            Err(undo) => Outcome1::Fatal(HookError::Stranded {
                pid: host_pid,
                cause: format!("{e}; then {undo}"),
            }),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.moved.is_empty() && self.fallbacks.is_empty()
    }

    /// Host pids of the processes whose memory the hook moved.
    pub fn moved_pids(&self) -> Vec<u32> {
        self.moved.iter().map(|m| m.process.host_pid).collect()
    }

    /// The record of this checkpoint (`injected`: the container had the hook).
    pub fn record(&self) -> HookRecord {
        HookRecord {
            version: RECORD_VERSION,
            injected: true,
            processes: self.moved.iter().map(|m| m.record.clone()).collect(),
            fallbacks: self.fallbacks.clone(),
        }
    }

    /// Every moved process gets its memory back and runs (after the driver's unlock:
    /// the lock would block the hook's own CUDA calls); snapshots are dropped (the
    /// checkpoint failed, or CRIU's image will not be used). Tries all; returns the
    /// first failure.
    pub fn give_back(mut self) -> Result<()> {
        let given = self.give_back_all();
        given.and(self.settle_snapshots(false))
    }

    /// [`HookCheckpoint::give_back`], then each snapshot is written into the image while
    /// its process runs: the checkpoint's success path. Afterwards the record tells
    /// what moved.
    pub fn give_back_and_write(&mut self) -> Result<()> {
        let given = self.give_back_all();
        // A snapshot is written only when every process got its memory back.
        let write = given.is_ok();
        given.and(self.settle_snapshots(write))
    }

    /// Whether every moved process's memory is in the image (no snapshot unwritten).
    pub fn images_complete(&self) -> bool {
        self.moved.iter().all(|m| {
            !matches!(
                m.stage,
                Stage::Snapshotted
                    | Stage::SnapshotReattached
                    | Stage::WritePending
                    | Stage::Unwritten
            )
        })
    }

    fn give_back_all(&mut self) -> Result<()> {
        let mut first = None;
        for m in &mut self.moved {
            if matches!(
                m.stage,
                Stage::Done | Stage::WritePending | Stage::Unwritten
            ) {
                continue;
            }
            let res = Conn::open(&m.process)
                .and_then(|mut conn| give_back_one(&self.id, &self.image, m, &mut conn));
            if let Err(e) = res {
                tracing::error!(id = %self.id, pid = m.process.host_pid, "hook: {e}");
                let e = match (m.stage, e) {
                    (_, e @ HookError::Stranded { .. }) => e,
                    (Stage::Released | Stage::Snapshotted, e) => HookError::Stranded {
                        pid: m.process.host_pid,
                        cause: e.to_string(),
                    },
                    (_, e) => e,
                };
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Writes (or, without `write`, drops) every pending snapshot. Tries all; returns
    /// the first failure.
    fn settle_snapshots(&mut self, write: bool) -> Result<()> {
        let root = self.image.join(IMAGE_DIR);
        let mut first = None;
        for m in &mut self.moved {
            if m.stage != Stage::WritePending {
                continue;
            }
            let pid = m.process.host_pid;
            let res = Conn::open(&m.process).and_then(|mut conn| {
                if !write {
                    conn.call(&Request::DropSnapshot)?;
                    return Ok(());
                }
                let t = Instant::now();
                let dir = File::open(&root).map_err(|source| HookError::Io {
                    pid,
                    what: format!("opening {}", root.display()),
                    source,
                })?;
                let name = PathBuf::from(m.process.ns_pid.to_string());
                match conn.write_snapshot(&dir, &name) {
                    Ok(bytes) => {
                        m.record.copy_out_ms = ms_since(t);
                        m.record.copy_out_bytes = bytes;
                        tracing::info!(id = %self.id, pid, bytes, write_ms = m.record.copy_out_ms,
                            "device memory snapshot written while the process runs");
                        Ok(())
                    }
                    Err(e) => {
                        if let Err(d) = conn.call(&Request::DropSnapshot) {
                            tracing::warn!(id = %self.id, pid, "dropping the snapshot: {d}");
                        }
                        Err(e)
                    }
                }
            });
            m.stage = match (&res, write) {
                (Ok(()), true) => Stage::Done,
                _ => Stage::Unwritten,
            };
            if let Err(e) = res {
                tracing::error!(id = %self.id, pid, "hook: {e}");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Reattach → Thaw when the memory was kept, else Remap → CopyIn → Thaw (also after a
/// failed Reattach), or Thaw alone when nothing was released. A snapshot's Reattach must
/// work (its image is not written yet): it is that process's only way back.
fn give_back_one(id: &str, image: &Path, m: &mut Moved, conn: &mut Conn) -> Result<()> {
    if m.stage == Stage::Snapshotted {
        let t = Instant::now();
        let fds = std::mem::take(&mut m.fds);
        conn.reattach(&m.held, &fds)
            .map_err(|e| HookError::Stranded {
                pid: m.process.host_pid,
                cause: format!("its snapshot could not be mapped back: {e}"),
            })?;
        tracing::info!(
            id,
            pid = m.process.host_pid,
            allocations = m.record.kept,
            reattach_ms = ms_since(t),
            "device memory given back by the hook from its snapshot on the GPU (no copy-in)"
        );
        m.stage = Stage::SnapshotReattached;
    }
    if m.stage == Stage::Released && !m.fds.is_empty() {
        let t = Instant::now();
        let fds = std::mem::take(&mut m.fds);
        match conn.reattach(&m.held, &fds) {
            Ok(()) => {
                tracing::info!(
                    id,
                    pid = m.process.host_pid,
                    allocations = fds.len(),
                    reattach_ms = ms_since(t),
                    "device memory kept on the GPU given back by the hook (no copy-in)"
                );
                m.stage = Stage::Reattached;
            }
            Err(e) => tracing::warn!(
                id,
                pid = m.process.host_pid,
                error = %e,
                "kept device memory not reattached; copying it in from the image"
            ),
        }
        // Closing our fds frees what the hook did not take back.
    }
    if m.stage == Stage::Released {
        let t = Instant::now();
        conn.call(&Request::Remap)?;
        let remap_ms = ms_since(t);
        let t = Instant::now();
        let r = conn.copy_in(&HookRecord::image_of(image, m.process.ns_pid))?;
        // What the helpers (restore_helpers) copied, and how fast the hook's copy-in ran.
        let ok = || r.helpers.iter().filter(|h| h.error.is_none());
        let helper_bytes: u64 = ok().map(|h| h.bytes).sum();
        let helper_wait_ms = ok().map(|h| h.pin_wait_s).fold(0.0, f64::max) * 1e3;
        tracing::info!(
            id,
            pid = m.process.host_pid,
            remap_ms,
            copy_in_ms = ms_since(t),
            bytes = r.bytes,
            hook_copy_in_ms = (r.seconds * 1e3) as u64,
            copy_in_gb_s = format!("{:.1}", r.bytes as f64 / r.seconds.max(1e-9) / 1e9),
            helpers = r.helpers.len(),
            helper_bytes,
            helper_pin_wait_ms = helper_wait_ms as u64,
            helpers_failed = r.helpers.len() - ok().count(),
            "device memory given back by the hook"
        );
    }
    conn.call(&Request::Thaw)?;
    m.record.gpu_paused_ms = ms_since(m.frozen_at);
    tracing::info!(
        id,
        pid = m.process.host_pid,
        gpu_paused_ms = m.record.gpu_paused_ms,
        "GPU work resumed by the hook"
    );
    m.stage = match m.stage {
        Stage::SnapshotReattached => Stage::WritePending,
        _ => Stage::Done,
    };
    Ok(())
}

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
            stage: Stage::Released,
            record: p.clone(),
            held: Vec::new(),
            fds: Vec::new(),
            // Held since the dump; counted here from the give-back.
            frozen_at: Instant::now(),
        };
        give_back_one(id, image, &mut moved, &mut conn)?;
        tracing::info!(
            id,
            ns_pid = p.ns_pid,
            "restored process's device memory copied in"
        );
    }
    Ok(record.processes.len())
}

#[cfg(test)]
#[path = "gpu_hook_tests.rs"]
mod tests;
