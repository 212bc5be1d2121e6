//! Giving one process its memory back: after a checkpoint (or a failed one) and at a
//! restore. The shim tracks each process in the hook's own [`CheckpointState`] and moves
//! it only through the hook's table ([`CheckpointState::on`]), so one table governs both
//! ends of the socket.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Instant;

use gpucr_hook::protocol::{CheckpointState, Request, Verb};

use super::conn::Conn;
use super::{ms_since, HookError, HookProcess, HookRecord, ProcessRecord, Result};

/// A process whose hook moved (part of) the checkpoint.
#[derive(Debug)]
pub(super) struct Moved {
    pub process: HookProcess,
    /// Where the hook is, as far as the verbs this shim sent took it.
    pub state: CheckpointState,
    /// Running again, but its snapshot was dropped or could not be written: its memory
    /// is not in the image.
    pub unwritten: bool,
    pub record: ProcessRecord,
    /// Kept memory (Release with `keep`): addresses and the fds that hold it.
    pub held: Vec<u64>,
    pub fds: Vec<OwnedFd>,
    /// When the Freeze was asked for.
    pub frozen_at: Instant,
}

impl Moved {
    /// Sends `verb` (through `call`) when the hook's table allows it in this state, and
    /// moves on with it once it succeeded; a failed verb leaves the hook where it was.
    pub fn step<T>(&mut self, verb: Verb, call: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let next = self.state.on(verb).map_err(|source| HookError::Control {
            pid: self.process.host_pid,
            source,
        })?;
        let out = call(self)?;
        self.state = next;
        Ok(out)
    }

    /// A plain verb (no reply to read) through [`Moved::step`].
    pub fn call(&mut self, conn: &mut Conn, req: &Request) -> Result<()> {
        self.step(req.verb(), |_| conn.call(req).map(drop))
    }

    /// Whether its device memory is away from the GPU (released, or held only as a
    /// snapshot) and not yet running on it again: a failure now strands the process.
    pub fn memory_away(&self) -> bool {
        use CheckpointState as S;
        matches!(
            self.state,
            S::Released | S::Remapped | S::CopiedIn | S::Snapshotted
        )
    }

    /// Whether it runs again with its memory (a snapshot maybe still to write).
    pub fn given_back(&self) -> bool {
        matches!(
            self.state,
            CheckpointState::Running | CheckpointState::WritePending
        )
    }

    /// Whether its memory is in the image (no snapshot held, pending or unwritten).
    pub fn in_image(&self) -> bool {
        use CheckpointState as S;
        !self.unwritten
            && !matches!(
                self.state,
                S::Snapshotted | S::SnapshotReattached | S::WritePending
            )
    }

    /// Reattach → Thaw when the memory was kept, else Remap → CopyIn → Thaw (also after a
    /// failed Reattach), or Thaw alone when nothing was released. A snapshot's Reattach must
    /// work (its image is not written yet): it is that process's only way back. A process
    /// restored from a snapshot checkpoint (Snapshotted, no fds held) is copied in.
    pub fn give_back(&mut self, id: &str, image: &Path, conn: &mut Conn) -> Result<()> {
        let m = self;
        let pid = m.process.host_pid;
        if m.state == CheckpointState::Snapshotted && !m.fds.is_empty() {
            let t = Instant::now();
            let fds = std::mem::take(&mut m.fds);
            m.step(Verb::Reattach, |m| conn.reattach(&m.held, &fds))
                .map_err(|e| HookError::Stranded {
                    pid,
                    cause: format!("its snapshot could not be mapped back: {e}"),
                })?;
            tracing::info!(
                id,
                pid,
                allocations = m.record.kept,
                reattach_ms = ms_since(t),
                "device memory given back by the hook from its snapshot on the GPU (no copy-in)"
            );
        }
        if m.state == CheckpointState::Released && !m.fds.is_empty() {
            let t = Instant::now();
            let fds = std::mem::take(&mut m.fds);
            match m.step(Verb::Reattach, |m| conn.reattach(&m.held, &fds)) {
                Ok(()) => tracing::info!(
                    id,
                    pid,
                    allocations = fds.len(),
                    reattach_ms = ms_since(t),
                    "device memory kept on the GPU given back by the hook (no copy-in)"
                ),
                Err(e) => tracing::warn!(
                    id,
                    pid,
                    error = %e,
                    "kept device memory not reattached; copying it in from the image"
                ),
            }
            // Closing our fds frees what the hook did not take back.
        }
        if matches!(
            m.state,
            CheckpointState::Released | CheckpointState::Snapshotted
        ) {
            let t = Instant::now();
            m.call(conn, &Request::Remap)?;
            let remap_ms = ms_since(t);
            let t = Instant::now();
            let dir = HookRecord::image_of(image, m.process.ns_pid);
            let r = m.step(Verb::CopyIn, |_| conn.copy_in(&dir))?;
            // What the helpers (restore_helpers) copied, and how fast the hook's copy-in ran.
            let ok = || r.helpers.iter().filter(|h| h.error.is_none());
            let helper_bytes: u64 = ok().map(|h| h.bytes).sum();
            let helper_wait_ms = ok().map(|h| h.pin_wait_s).fold(0.0, f64::max) * 1e3;
            tracing::info!(
                id,
                pid,
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
        // Running, or WritePending after a snapshot's reattach.
        m.call(conn, &Request::Thaw)?;
        m.record.gpu_paused_ms = ms_since(m.frozen_at);
        tracing::info!(
            id,
            pid,
            gpu_paused_ms = m.record.gpu_paused_ms,
            "GPU work resumed by the hook"
        );
        Ok(())
    }
}
