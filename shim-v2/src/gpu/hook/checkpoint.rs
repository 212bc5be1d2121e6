//! The hook's part of a checkpoint: each process frozen and its memory moved into the
//! image (or snapshotted, or left to the driver), and given back after the dump.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpucr_hook::protocol::{CheckpointState, Request, Verb};

use super::conn::{fds_fit, Conn};
use super::give_back::Moved;
use super::record::RECORD_VERSION;
use super::{
    ms_since, Fallback, HookError, HookProcess, HookRecord, ProcessRecord, Result, IMAGE_DIR,
};

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
            Err(NotMoved::Fallback(reason)) => {
                tracing::warn!(id, pid = p.host_pid, %reason, "hook fast path not used for \
                    this process; the driver checkpoints all of its memory");
                cp.fallbacks.push(Fallback {
                    host_pid: p.host_pid,
                    reason,
                });
            }
            Err(NotMoved::Fatal(e)) => {
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
enum NotMoved {
    /// Running again with its memory: the driver path takes it.
    Fallback(String),
    /// Not running: the checkpoint must fail.
    Fatal(HookError),
}

impl HookCheckpoint {
    fn move_one(&self, p: &HookProcess, dir: &File) -> std::result::Result<Moved, NotMoved> {
        let fallback = |e: HookError| NotMoved::Fallback(e.to_string());
        let mut conn = Conn::open(p).map_err(fallback)?;
        let status = conn.status().map_err(fallback)?;
        if let Some(first) = status.unsupported.first() {
            return Err(NotMoved::Fallback(format!(
                "{} allocation(s) the hook cannot move (first: {first:?})",
                status.unsupported.len()
            )));
        }
        if status.state != CheckpointState::Running {
            return Err(NotMoved::Fallback(format!(
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
                Err(HookError::Verb { kind, message, .. }) => tracing::info!(
                    id = %self.id,
                    pid = p.host_pid,
                    reason = %format!("{kind:?}: {message}"),
                    "copy-out not prepared"
                ),
                Err(e) => return Err(fallback(e)),
            }
        }
        let mut moved = Moved {
            process: p.clone(),
            state: CheckpointState::Running,
            unwritten: false,
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
        moved.call(&mut conn, &Request::Freeze).map_err(fallback)?;
        moved.record.freeze_ms = ms_since(t);
        if self.snapshot && fds_fit(p.host_pid, 1) {
            let t = Instant::now();
            match moved.step(Verb::Snapshot, |_| conn.snapshot()) {
                Ok((report, fds)) => {
                    moved.record.snapshot_ms = ms_since(t);
                    moved.record.kept = report.release.allocations;
                    moved.held = report.release.held;
                    moved.fds = fds;
                    return Ok(moved);
                }
                // Refused: still Frozen, nothing released.
                Err(HookError::Verb { kind, message, .. }) => tracing::info!(
                    id = %self.id,
                    pid = p.host_pid,
                    reason = %format!("{kind:?}: {message}"),
                    "no device snapshot; copying the memory out while frozen"
                ),
                Err(e) => return Err(self.undo_one(&mut moved, &mut conn, e)),
            }
        }
        let t = Instant::now();
        let steps = moved
            .step(Verb::CopyOut, |_| conn.copy_out(dir, &name))
            .and_then(|(bytes, allocations)| {
                moved.record.copy_out_ms = ms_since(t);
                (moved.record.copy_out_bytes, moved.record.allocations) = (bytes, allocations);
                let t = Instant::now();
                let keep = self.keep && fds_fit(p.host_pid, allocations);
                let (held, fds) = moved.step(Verb::Release, |_| conn.release(keep))?;
                moved.record.release_ms = ms_since(t);
                moved.record.kept = held.len();
                (moved.held, moved.fds) = (held, fds);
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
    fn undo_one(&self, moved: &mut Moved, conn: &mut Conn, e: HookError) -> NotMoved {
        let p = &moved.process;
        let (host_pid, ns_pid) = (p.host_pid, p.ns_pid);
        match moved.give_back(&self.id, &self.image, conn) {
            Ok(()) => {
                let _ = std::fs::remove_dir_all(HookRecord::image_of(&self.image, ns_pid));
                NotMoved::Fallback(e.to_string())
            }
            Err(undo) => NotMoved::Fatal(HookError::Stranded {
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
        self.settle(false)
    }

    /// [`HookCheckpoint::give_back`], then each snapshot is written into the image while
    /// its process runs: the checkpoint's success path. Afterwards the record tells
    /// what moved.
    pub fn give_back_and_write(&mut self) -> Result<()> {
        self.settle(true)
    }

    /// Whether every moved process's memory is in the image (no snapshot unwritten).
    pub fn images_complete(&self) -> bool {
        self.moved.iter().all(Moved::in_image)
    }

    /// Every process not running yet gets its memory back; then the snapshots are
    /// written (`write`, and only when every process got its memory back) or dropped.
    fn settle(&mut self, write: bool) -> Result<()> {
        let mut first = None;
        for m in &mut self.moved {
            if m.given_back() {
                continue;
            }
            let res = Conn::open(&m.process)
                .and_then(|mut conn| m.give_back(&self.id, &self.image, &mut conn));
            if let Err(e) = res {
                tracing::error!(id = %self.id, pid = m.process.host_pid, "hook: {e}");
                let e = match (m.memory_away(), e) {
                    (_, e @ HookError::Stranded { .. }) => e,
                    (true, e) => HookError::Stranded {
                        pid: m.process.host_pid,
                        cause: e.to_string(),
                    },
                    (_, e) => e,
                };
                first.get_or_insert(e);
            }
        }
        let given = first.map_or(Ok(()), Err);
        let write = write && given.is_ok();
        given.and(self.settle_snapshots(write))
    }

    /// Writes (or, without `write`, drops) every pending snapshot. Tries all; returns
    /// the first failure.
    fn settle_snapshots(&mut self, write: bool) -> Result<()> {
        let root = self.image.join(IMAGE_DIR);
        let mut first = None;
        for m in &mut self.moved {
            if m.state != CheckpointState::WritePending {
                continue;
            }
            let pid = m.process.host_pid;
            let res = Conn::open(&m.process).and_then(|mut conn| {
                if !write {
                    return m.call(&mut conn, &Request::DropSnapshot);
                }
                let t = Instant::now();
                let dir = File::open(&root).map_err(|source| HookError::Io {
                    pid,
                    what: format!("opening {}", root.display()),
                    source,
                })?;
                let name = PathBuf::from(m.process.ns_pid.to_string());
                match m.step(Verb::WriteSnapshot, |_| conn.write_snapshot(&dir, &name)) {
                    Ok(bytes) => {
                        m.record.copy_out_ms = ms_since(t);
                        m.record.copy_out_bytes = bytes;
                        tracing::info!(id = %self.id, pid, bytes, write_ms = m.record.copy_out_ms,
                            "device memory snapshot written while the process runs");
                        Ok(())
                    }
                    Err(e) => {
                        if let Err(d) = m.call(&mut conn, &Request::DropSnapshot) {
                            tracing::warn!(id = %self.id, pid, "dropping the snapshot: {d}");
                        }
                        Err(e)
                    }
                }
            });
            m.unwritten = !(res.is_ok() && write);
            if let Err(e) = res {
                tracing::error!(id = %self.id, pid, "hook: {e}");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}
