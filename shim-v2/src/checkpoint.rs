//! Checkpoint of a task (`runc checkpoint` through CRIU).
//!
//! Every checkpoint ends by writing `gpucr-checkpoint.json` (see `manifest`): every file of
//! the image with its size and chunk hashes, which a restore checks before anything changes.
//!
//! With the hook (see `gpu::hook`), its processes move their device memory first:
//! hook copy-out → driver lock + checkpoint → dump → driver restore + unlock → hook give-back.
//! A leave-running checkpoint of a running task snapshots the memory on the device instead
//! of copying it out: the image is written after the give-back, while the task runs, and
//! the records and the manifest after that.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{
    by_reference,
    container::Container,
    error::{Error, IoContext, Result, TaskLeft},
    failpoint,
    gpu::{
        driver as gpu,
        hook::{self as gpu_hook, spec as hook_spec, HookCheckpoint, HookRecord},
        host,
    },
    layout, manifest,
    options::CheckpointRequest,
    process::{
        init::{ForResume, InitProcess},
        state::{InitState, TaskVerb},
    },
    runc::CheckpointOpts,
};

/// What a checkpoint holds of the task between the hook's copy-out and the records: the
/// processes whose memory the hook moved, the CUDA processes the driver locked, and a
/// paused task thawed for CRIU's CUDA plugin. Every failure gives it all back
/// ([`Held::undo`]); a finished dump releases it to the task ([`Held::release`]).
#[derive(Default)]
struct Held {
    hooked: Option<HookCheckpoint>,
    quiesced: Option<gpu::Quiesced>,
    /// Paused by the client, thawed for CRIU's plugin: paused again after the dump.
    thawed: bool,
    /// What the client's Resume finishes (a paused task's GPU kept LOCKED, the hook's
    /// memory behind it); `locked_before`: an earlier checkpoint left the GPU LOCKED.
    later: ForResume,
    locked_before: bool,
}

impl Held {
    /// The host pids the shim quiesced itself (driver path and hook), for CRIU's plugin.
    fn quiesced_pids(&self) -> Vec<u32> {
        let mut pids = self
            .quiesced
            .as_ref()
            .map(gpu::Quiesced::pids)
            .unwrap_or_default();
        pids.extend(
            self.hooked
                .as_ref()
                .map(HookCheckpoint::moved_pids)
                .unwrap_or_default(),
        );
        pids
    }

    /// After the dump: a task thawed for the plugin is paused again when it lives on
    /// (`lives`: the dump failed or left it running).
    async fn repause(&mut self, c: &Container, lives: bool) {
        if std::mem::take(&mut self.thawed) && lives {
            if let Err(e) = c.runc.pause(&c.id).await {
                tracing::error!(id = %c.id, "re-pausing after the plugin's checkpoint: {e}");
            }
        }
    }

    /// Writes `gpucr-gpu.json` after the dump (the locked processes stay held).
    async fn record_gpu(&mut self, image: &Path) -> Result<()> {
        let Some(q) = self.quiesced.take() else {
            return Ok(());
        };
        let (q, recorded) = q.record(image.to_path_buf()).await;
        self.quiesced = Some(q);
        recorded
    }

    /// A failed checkpoint: the GPU back to the task (driver restore and unlock; a paused
    /// task's unlock waits for Resume), then the hook's memory, snapshots dropped. Returns
    /// what could not be given back.
    async fn undo(mut self, c: &Container, state: InitState) -> (Vec<Error>, ForResume) {
        self.repause(c, true).await;
        let mut failed = Vec::new();
        if let Some(q) = self.quiesced.take() {
            failed.extend(c.resume_gpu(q, state, &mut self.later).await.err());
        }
        if let Some(h) = self.hooked.take() {
            let locked = self.locked_before || self.later.locked.is_some();
            let (_, given) = c
                .hook_give_back(h, state, false, locked, &mut self.later)
                .await;
            failed.extend(given.err());
        }
        (failed, self.later)
    }

    /// A finished dump: what the task lives on with (unless CRIU killed it, `exit`) is
    /// given back before the records, a snapshot's image written while the task runs.
    /// Returns the hook's record for the image (`Some(None)`: a process's memory is not
    /// in it; `None`: no hook) and whether everything came back.
    async fn release(
        mut self,
        c: &Container,
        state: InitState,
        exit: bool,
    ) -> (Option<Option<HookRecord>>, Result<()>, ForResume) {
        let mut resumed = match self.quiesced.take() {
            Some(q) if !exit => c.resume_gpu(q, state, &mut self.later).await,
            _ => Ok(()),
        };
        let locked = self.locked_before || self.later.locked.is_some();
        let record = match self.hooked.take() {
            Some(h) if !exit => {
                let (record, given) = c
                    .hook_give_back(h, state, true, locked, &mut self.later)
                    .await;
                resumed = resumed.and(given);
                Some(record)
            }
            // CRIU killed the task: nothing to give back to.
            Some(h) => Some(Some(h.record())),
            // The hook is in the container but CRIU's plugin moved the GPU: the record
            // still says so, for the restore's mounts.
            None if c.hook => Some(Some(HookRecord::injected_only())),
            None => None,
        };
        (record, resumed, self.later)
    }
}

impl Container {
    /// CRIU's work directory (its `dump.log` and `stats-dump`): the client's, else the
    /// runtime options', else where containerd's CRI archives them from, so that
    /// `checkpointctl show/inspect` reads a kubelet checkpoint archive. CRI passes a work path
    /// only to io.containerd.runc.v2 and, for other runtimes, archives what is where that
    /// path would have pointed (internal/cri/server/container_checkpoint_linux.go):
    /// - 2.1.9, 2.2.5 and later, 2.3.2 and later: `<cri root>/containers/<id>/ctrd-checkpoint`,
    ///   which CRI creates before the checkpoint and tars afterwards: CRIU writes there.
    /// - 2.1.0–2.1.8, 2.2.0–2.2.4, 2.3.0–2.3.1: CRI copies `stats-dump` (its checkpoint fails
    ///   without it) and `dump.log` from `<cri root>/containers/<id>/` after the checkpoint;
    ///   that directory is CRI's own, so CRIU writes into `<bundle>/criu-work` and links to
    ///   the two files go there (the copy follows them).
    ///
    /// The container's CRI directory is found from the spec CRI wrote: its `/etc/hostname`
    /// (or hosts, resolv.conf) mount comes from `<cri root>/sandboxes/<sandbox id>/`, and the
    /// directory holds CRI's `status` file. Outside CRI (ctr, nerdctl): `<bundle>/criu-work`,
    /// kept after the checkpoint.
    fn work_dir(&self, req: &CheckpointRequest) -> PathBuf {
        /// `<cri root>/containers/<id>` when the bundle's spec was written by CRI.
        fn cri_container_dir(bundle: &Path, id: &str) -> Option<PathBuf> {
            let spec = std::fs::read(bundle.join("config.json")).ok()?;
            let spec: serde_json::Value = serde_json::from_slice(&spec).ok()?;
            let sandbox = spec["annotations"]["io.kubernetes.cri.sandbox-id"].as_str()?;
            let from_sandbox = spec["mounts"].as_array()?.iter().find_map(|m| {
                let dest = m["destination"].as_str()?;
                if !["/etc/hostname", "/etc/hosts", "/etc/resolv.conf"].contains(&dest) {
                    return None;
                }
                let dir = Path::new(m["source"].as_str()?).parent()?;
                let sandboxes = dir.parent()?;
                (dir.file_name()? == sandbox && sandboxes.file_name()? == "sandboxes")
                    .then(|| sandboxes.parent().map(Path::to_path_buf))
                    .flatten()
            })?;
            let dir = from_sandbox.join("containers").join(id);
            dir.join("status").is_file().then_some(dir)
        }

        if !req.work_path.is_empty() {
            return PathBuf::from(&req.work_path);
        }
        if !self.opts.criu_work_path.is_empty() {
            return PathBuf::from(&self.opts.criu_work_path);
        }
        let own = self.bundle.join(crate::container::BUNDLE_CRIU_WORK);
        let Some(cri) = cri_container_dir(&self.bundle, &self.id) else {
            return own;
        };
        let archived = cri.join("ctrd-checkpoint");
        if archived.is_dir() {
            return archived;
        }
        for name in ["stats-dump", "dump.log"] {
            let link = cri.join(name);
            let _ = std::fs::remove_file(&link);
            if let Err(e) = std::os::unix::fs::symlink(own.join(name), &link) {
                tracing::warn!(id = %self.id, "linking {} for CRI: {e}", link.display());
            }
        }
        own
    }

    /// Checkpoints the task into `image`. On failure the task is left running (resumed if
    /// the failed dump left it frozen) and CRIU's log is kept in the bundle. `request` is
    /// the client's own deadline, if it sent one (see `deadline`).
    pub async fn checkpoint(
        &self,
        image: &Path,
        req: &CheckpointRequest,
        request: Option<Duration>,
    ) -> Result<()> {
        let mut init = self.init.lock().await;
        init.state().next(TaskVerb::Checkpoint)?;
        failpoint::hit(&self.id, failpoint::CHECKPOINT_BEFORE_FREEZE).await?;
        let work = self.work_dir(req);
        if req.work_path.is_empty() && self.opts.criu_work_path.is_empty() {
            let _ = std::fs::remove_dir_all(&work);
        }
        for d in [image, work.as_path()] {
            std::fs::create_dir_all(d).ctx(|| format!("creating {}", d.display()))?;
        }
        // By reference, the hook writes onto the store's filesystem: its bytes are written once.
        let stage = (self.hook && self.gpu.quiescer == gpu::Quiescer::Shim)
            .then(|| by_reference::stage_for_hook(&self.id, image, &self.store))
            .flatten();
        let opts = CheckpointOpts {
            image_path: image.to_path_buf(),
            work_path: Some(work.clone()),
            parent_path: None,
            leave_running: !req.exit,
            tcp_established: req.open_tcp,
            ext_unix_sk: req.external_unix_sockets,
            shell_job: req.terminal || self.stdio.terminal,
            file_locks: req.file_locks,
            empty_ns: req.empty_namespaces.clone(),
            manage_cgroups_mode: Some(req.cgroups_mode.clone()).filter(|m| !m.is_empty()),
        };
        let locked_before = init.phase.for_resume().is_some_and(|l| l.locked.is_some());
        let mut held = match self.hold(init.state(), image, !req.exit).await {
            Ok(held) => held,
            Err((mut held, e)) => {
                held.locked_before = locked_before;
                let (failed, later) = held.undo(self, init.state()).await;
                init.phase.leave_for_resume(later);
                for undone in failed {
                    tracing::error!(id = %self.id, "after a failed GPU quiesce: {undone}");
                }
                return Err(e);
            }
        };
        held.locked_before = locked_before;
        // The hook's images are final (not a snapshot's, written after the thaw): the store
        // takes them in while CRIU dumps.
        let ahead = stage
            .as_ref()
            .filter(|_| {
                held.hooked
                    .as_ref()
                    .is_some_and(HookCheckpoint::images_complete)
            })
            .map(|stage| by_reference::take_ahead(&self.id, stage, &self.store));
        // CRIU's CUDA plugin (loaded whenever it is installed) leaves alone what the shim
        // quiesced: the driver path's processes and the hook's.
        let marker = gpu::shim_quiesced_value(&held.quiesced_pids());
        let env: Vec<(&str, &str)> = match self.gpu.quiescer {
            gpu::Quiescer::Shim => vec![(gpu::SHIM_QUIESCED_ENV, marker.as_str())],
            gpu::Quiescer::CriuPlugin => Vec::new(),
        };
        let pids = self.runc.ps(&self.id).await.unwrap_or_default();
        let deadline = self
            .deadlines
            .checkpoint(crate::deadline::resident_bytes(&pids), request);
        let started = Instant::now();
        tracing::info!(id = %self.id, image = %image.display(), exit = req.exit,
            quiescer = ?self.gpu.quiescer, shim_quiesced = %marker,
            cuda_plugins = ?gpu::criu_cuda_plugins(), deadline = ?deadline.after,
            deadline_from = %deadline.source, "checkpoint");
        // A failure here is undone as a failed dump.
        let dumped = match failpoint::hit(&self.id, failpoint::CHECKPOINT_BEFORE_DUMP).await {
            Ok(()) => {
                self.runc
                    .checkpoint(&self.id, &opts, &env, Some(deadline.after))
                    .await
            }
            Err(e) => Err(e),
        };
        held.repause(self, dumped.is_err() || !req.exit).await;
        if let Err(e) = dumped {
            let log = work.join("dump.log");
            let kept = self.bundle.join("criu-dump.log");
            let _ = std::fs::copy(&log, &kept);
            let tail = crate::criu_log::tail(&log, crate::criu_log::TAIL_BYTES);
            let cause = tail.as_deref().and_then(crate::criu_log::Cause::find);
            let mut msg = match (&e, cause, crate::criu_log::first_error(&log)) {
                (Error::TimedOut { .. }, _, _) => format!(
                    "{e} (deadline: {}); CRIU's dump was cut short",
                    deadline.source
                ),
                (_, Some((cause, line)), _) => format!(
                    "{} (CRIU: {line})",
                    cause.describe(&[image, work.as_path()])
                ),
                (_, None, Some(line)) => format!("{e}; CRIU: {line}"),
                (_, None, None) => e.to_string(),
            };
            // Thaw first: the driver's restore runs a thread inside the process.
            let left = self.settle_after_failed_dump(&mut init).await;
            let (failed, later) = held.undo(self, init.state()).await;
            init.phase.leave_for_resume(later);
            for undone in failed {
                msg = format!("{msg}; and then {undone}");
            }
            tracing::error!(id = %self.id, "checkpoint failed: {msg}");
            return Err(Error::Checkpoint {
                id: self.id.clone(),
                msg,
                left,
                log: Some(kept),
            });
        }
        let dump_ms = started.elapsed().as_millis() as u64;
        if let Err(e) = held.record_gpu(image).await {
            if !req.exit {
                let (failed, later) = held.undo(self, init.state()).await;
                init.phase.leave_for_resume(later);
                for undone in failed {
                    tracing::error!(id = %self.id, "after a failed GPU record: {undone}");
                }
            }
            return Err(e);
        }
        // The task lives on (leave-running): its GPU must too, before the records and
        // the manifest are written (and a snapshot's image: while the task runs).
        let (hook_record, resumed, later) = held.release(self, init.state(), req.exit).await;
        init.phase.leave_for_resume(later);
        // Whether the hook was there, and what it moved (timings, bytes, fallbacks).
        if let Some(record) = hook_record {
            let Some(record) = record else {
                let msg = format!(
                    "the GPU state of the hook's processes was not written into the image{}",
                    resumed
                        .as_ref()
                        .err()
                        .map(|e| format!(": {e}"))
                        .unwrap_or_default()
                );
                tracing::error!(id = %self.id, "checkpoint failed: {msg}");
                return Err(Error::Checkpoint {
                    id: self.id.clone(),
                    msg,
                    left: TaskLeft::from(init.state()),
                    log: None,
                });
            };
            if let Err(e) = record.save(image) {
                tracing::error!(id = %self.id, "no hook record in the image (a restore cannot \
                    give the moved memory back): {e}");
            }
        }
        // What another host needs to fit this container: CDI devices, mounts, GPU UUIDs.
        if let Err(e) = host::record(&self.bundle, image) {
            tracing::warn!(id = %self.id, "no host manifest in the image (restores elsewhere \
                cannot re-resolve devices): {e}");
        }
        // Flat, so that CRI's copy of the image into kubelet's archive keeps every file.
        let written = async {
            failpoint::hit(&self.id, failpoint::CHECKPOINT_BEFORE_MANIFEST).await?;
            layout::fold(image)?;
            manifest::write_manifest(&self.id, image, !req.exit, dump_ms)
        };
        let mut written = written.await;
        if written.is_ok() {
            // Its large files into the store (mode local or shared), the image sealed first.
            if let Err(msg) = by_reference::give_to_store(&self.id, image, &self.store, ahead).await
            {
                tracing::error!(id = %self.id, "checkpoint failed: {msg}");
                written = Err(Error::Checkpoint {
                    id: self.id.clone(),
                    msg,
                    left: TaskLeft::from(init.state()),
                    log: None,
                });
            }
        }
        if written.is_ok() {
            tracing::info!(id = %self.id, dump_ms, "checkpointed");
        }
        if let (Err(_), Err(g)) = (&written, &resumed) {
            tracing::error!(id = %self.id, "after a failed manifest: {g}");
        }
        written.and(resumed)
    }

    /// Quiesces the GPU before the dump: the hook's copy-out first (the driver's lock would
    /// block the hook's own CUDA calls), then the driver's lock and checkpoint, or a paused
    /// task thawed for CRIU's CUDA plugin. A paused task must not run before its dump, and
    /// its give-back may wait for Resume: no Prepare, no snapshot then. On failure, what is
    /// held so far comes back with the error, to be undone.
    async fn hold(
        &self,
        state: InitState,
        image: &Path,
        keep: bool,
    ) -> std::result::Result<Held, (Held, Error)> {
        let mut held = Held::default();
        let running = state != InitState::Paused;
        held.hooked = match self.hook_copy_out(state, image, keep, running).await {
            Ok(h) => h,
            Err(e) => return Err((held, e)),
        };
        let quiesced = async {
            failpoint::hit(&self.id, failpoint::CHECKPOINT_AFTER_COPY_OUT).await?;
            self.quiesce_gpu(state).await
        };
        held.quiesced = match quiesced.await {
            Ok(q) => q,
            Err(e) => return Err((held, e)),
        };
        held.thawed = match self.thaw_for_plugin(state).await {
            Ok(thawed) => thawed,
            Err(e) => return Err((held, e)),
        };
        Ok(held)
    }

    /// Runs `work` with a task the client paused thawed for it (the driver's lock and the
    /// hook's control thread run inside the process), and pauses it again after. A thaw
    /// that fails fails the work, unless `anyway` (giving memory back must not wait on it).
    async fn with_thawed<T>(
        &self,
        state: InitState,
        what: &str,
        anyway: bool,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        if state != InitState::Paused {
            return work.await;
        }
        match self.runc.resume(&self.id).await {
            Ok(()) => {}
            Err(e) if anyway => tracing::error!(id = %self.id, "thawing for {what}: {e}"),
            Err(e) => return Err(e),
        }
        let res = work.await;
        if let Err(e) = self.runc.pause(&self.id).await {
            tracing::error!(id = %self.id, "re-pausing after {what}: {e}");
        }
        res
    }

    /// Restores and unlocks the CUDA processes `q` of a task that lives on. A paused task is
    /// thawed for it and paused again, as for the lock: the driver works on a thread inside
    /// the process.
    ///
    /// A paused task gets its device memory back now but stays LOCKED until the client
    /// resumes it (`Container::resume` unlocks): unlocked while thawed, it would run on
    /// between the dump and the client's snapshot of the rootfs (ctr takes it after the
    /// Checkpoint RPC), and a restore would repeat that work.
    async fn resume_gpu(
        &self,
        q: gpu::Quiesced,
        state: InitState,
        later: &mut ForResume,
    ) -> Result<()> {
        if state != InitState::Paused {
            return q.resume().await;
        }
        let locked = self
            .with_thawed(state, "the GPU restore", true, q.restore_memory())
            .await?;
        later.locked = Some(locked);
        Ok(())
    }

    /// The hook's copy-out (freeze → copy-out → release) of each CUDA process whose hook
    /// answers, when the container has the hook and the shim quiesces. A paused task is
    /// thawed for it (the hook's control thread must run) and paused again.
    async fn hook_copy_out(
        &self,
        state: InitState,
        image: &Path,
        keep: bool,
        running: bool,
    ) -> Result<Option<HookCheckpoint>> {
        if !self.hook || self.gpu.quiescer != gpu::Quiescer::Shim {
            return Ok(None);
        }
        let pids = gpu::nvidia_pids(&self.runc.ps(&self.id).await?);
        let sockets = hook_spec::socket_dir(&self.bundle);
        let (id, image) = (self.id.clone(), image.to_path_buf());
        let copied = crate::gpu::blocking("hook", move || {
            let processes = gpu_hook::find(&sockets, &pids);
            gpu_hook::copy_out(&id, &processes, &image, keep, running)
        });
        let copied = self
            .with_thawed(state, "the hook's copy-out", false, copied)
            .await?;
        copied.map(Some).map_err(|e| Error::CheckpointStep {
            id: self.id.clone(),
            source: Box::new(e),
            left: TaskLeft::from(state),
        })
    }

    /// Gives the hook's processes their memory back (after the driver's unlock), with the
    /// snapshots written into the image (`write`, a task that is not paused) or dropped. A
    /// task the client paused is thawed for it, unless the driver keeps it LOCKED until
    /// Resume: then Resume gives the memory back, after the unlock. Returns the hook's
    /// record for the image, `None` when a process's memory is not in it (a snapshot
    /// unwritten).
    async fn hook_give_back(
        &self,
        mut h: HookCheckpoint,
        state: InitState,
        write: bool,
        gpu_locked: bool,
        later: &mut ForResume,
    ) -> (Option<HookRecord>, Result<()>) {
        if h.moved_pids().is_empty() {
            return (Some(h.record()), Ok(()));
        }
        if write && state != InitState::Paused {
            let given = crate::gpu::blocking("hook", move || {
                let given = h.give_back_and_write();
                (h.images_complete().then(|| h.record()), given)
            });
            return match given.await {
                Ok((record, given)) => (record, given.map_err(Error::from)),
                Err(e) => (None, Err(e)),
            };
        }
        // No snapshot (see `hold`): the images are complete already.
        let record = h.record();
        if state == InitState::Paused && gpu_locked {
            later.hook = Some(h);
            return (Some(record), Ok(()));
        }
        let given = crate::gpu::blocking("hook", move || h.give_back());
        let given = self
            .with_thawed(state, "the hook's give-back", false, given)
            .await;
        (Some(record), given.and_then(|g| g.map_err(Error::from)))
    }

    /// Locks and checkpoints the container's CUDA processes when the shim is the quiescer.
    /// A paused task is thawed for it: the driver's lock runs a thread inside the process.
    /// Records `gpucr-gpu.json` only after the dump (see `Held::record_gpu`).
    async fn quiesce_gpu(&self, state: InitState) -> Result<Option<gpu::Quiesced>> {
        if self.gpu.quiescer != gpu::Quiescer::Shim {
            return Ok(None);
        }
        let candidates = gpu::nvidia_pids(&self.runc.ps(&self.id).await?);
        if candidates.is_empty() {
            return Ok(None);
        }
        let started = Instant::now();
        let quiesced = gpu::quiesce(candidates, self.gpu.lock_timeout);
        let res = self
            .with_thawed(state, "GPU quiesce", false, async { Ok(quiesced.await) })
            .await?;
        let q = res.map_err(|e| Error::CheckpointStep {
            id: self.id.clone(),
            source: Box::new(e),
            left: TaskLeft::from(state),
        })?;
        if let Some(q) = &q {
            tracing::info!(id = %self.id, pids = ?q.pids(),
                elapsed_ms = started.elapsed().as_millis() as u64, "GPU locked and checkpointed");
        }
        Ok(q)
    }

    /// A CUDA CRIU plugin locks the GPU from inside CRIU, through a thread of the process:
    /// a task the client paused (cgroup-frozen, as ctr does before every checkpoint) must run
    /// for it. Returns whether the task was thawed (it is paused again after the dump).
    async fn thaw_for_plugin(&self, state: InitState) -> Result<bool> {
        if self.gpu.quiescer != gpu::Quiescer::CriuPlugin || state != InitState::Paused {
            return Ok(false);
        }
        if gpu::nvidia_pids(&self.runc.ps(&self.id).await?).is_empty() {
            return Ok(false);
        }
        self.runc.resume(&self.id).await?;
        Ok(true)
    }

    /// After a failed dump the task is put back as the client had it, from runc's real
    /// state: CRIU killed mid-dump leaves the cgroup frozen (or thawed, for a task the
    /// client paused). Returns what is left, for the error; the recorded state follows it.
    async fn settle_after_failed_dump(&self, init: &mut InitProcess) -> TaskLeft {
        let ours = init.state();
        let status = match self.runc.state(&self.id).await {
            Ok(st) => st.status,
            Err(e) => {
                tracing::warn!(id = %self.id, "runc state after a failed checkpoint: {e}");
                return TaskLeft::Gone;
            }
        };
        let fixed = match (ours, status.as_str()) {
            (InitState::Running, "paused") => self.runc.resume(&self.id).await,
            (InitState::Paused, "running") => self.runc.pause(&self.id).await,
            (_, "running" | "paused") => Ok(()),
            _ => return TaskLeft::Gone, // stopped: the init's exit is on its way
        };
        let now = match fixed {
            Ok(()) => ours,
            Err(e) => {
                tracing::error!(id = %self.id, runc_status = %status,
                    "putting the task back after a failed checkpoint: {e}");
                if status == "paused" {
                    InitState::Paused
                } else {
                    InitState::Running
                }
            }
        };
        if now != ours {
            tracing::warn!(id = %self.id, from = ?ours, to = ?now,
                "the failed checkpoint changed the task's state");
            self.set_state(init, now);
        }
        if now == InitState::Paused {
            TaskLeft::Paused
        } else {
            TaskLeft::Running
        }
    }
}
