//! Copy-in helpers: starting them, sending jobs ahead, handing out chunks and waiting for them.

use std::os::fd::OwnedFd;
use std::path::Path;

use gpu_state::image::{AllocId, ImageReader};

use super::dma::fd_room;
use super::options::{HELPER_SHARE_AHEAD, HELPER_SHARE_AT_COPY_IN};
use super::{lock, FastPath, FastPathError};
use crate::alloc::Allocation;
use crate::driver::VmmDriver;
use crate::helper::{data_file_fds, plan_image_jobs, AheadJob, Helper, HelperMsg, Helpers};
use crate::protocol::{HelperReport, WarmReport};

impl<D: VmmDriver + 'static> FastPath<D> {
    pub(super) fn spawn_helpers(&self) -> Option<Helpers> {
        let (n, Some(path)) = (self.opts.copy_in_helpers, self.opts.helper_path.as_ref()) else {
            return None;
        };
        if n == 0 {
            return None;
        }
        let Some(device) = self.driver().device_ordinal() else {
            tracing::info!("copy-in helpers not started: the driver has no device ordinal");
            return None;
        };
        match Helpers::spawn(path, n, device) {
            Ok(h) => {
                tracing::info!(helpers = h.len(), path = %path.display(), "copy-in helpers starting");
                Some(h)
            }
            Err(e) => {
                tracing::warn!(error = %e, "copy-in helpers not started; the copy-in stages everything");
                None
            }
        }
    }

    /// Sends every helper its job for a copy-in from `dir` now; the bytes sent. None
    /// when the copy-in will not use helpers for this image (no gh1 digests to check
    /// their chunks by, or not a raw image on tmpfs).
    pub(super) fn send_ahead(
        &self,
        helpers: &mut Helpers,
        dir: &Path,
    ) -> Result<u64, FastPathError> {
        let reader = ImageReader::open(dir)?;
        if !self.opts.device_hash || !reader.has_gpu_hashes() || reader.direct_refusal().is_some() {
            return Ok(0);
        }
        // Released memory: matched as the copy-in will, but not mapped yet.
        self.plan_in_image(&reader, &self.movable()?, true)?;
        let share = self.opts.helper_share.unwrap_or(HELPER_SHARE_AHEAD);
        let jobs = plan_image_jobs(&reader, self.opts.pid, share, helpers.len())?;
        let files = reader.data_files();
        let mut sent = 0;
        for (helper, (job, desc)) in helpers.list_mut().iter_mut().zip(jobs) {
            if !fd_room(files.len()) {
                tracing::info!(
                    fds = files.len(),
                    "copy-in job not sent ahead: too close to the fd limit"
                );
                break;
            }
            let fds = match data_file_fds(&reader) {
                Ok(fds) => fds,
                Err(e) => {
                    tracing::warn!(error = %e, "copy-in job not sent ahead: cannot duplicate a data file fd");
                    break;
                }
            };
            let bytes = desc.bytes;
            match helper.send_job_ahead(job, fds, desc) {
                Ok(()) => sent += bytes,
                Err(e) => {
                    tracing::warn!(pid = helper.pid(), error = %e, "copy-in job not sent ahead")
                }
            }
        }
        tracing::info!(
            bytes = sent,
            helpers = helpers.len(),
            "copy-in helpers pin their share ahead"
        );
        Ok(sent)
    }

    /// Takes over helpers the shim started and sent their jobs (a restore: see
    /// [`crate::helper`]); any helpers of this process's own are stopped. Makes no CUDA
    /// call.
    pub fn adopt_helpers(
        &self,
        jobs: Vec<AheadJob>,
        socks: Vec<OwnedFd>,
    ) -> Result<WarmReport, FastPathError> {
        let ahead_bytes = jobs.iter().map(|j| j.bytes).sum();
        let helpers = Helpers::adopt(jobs, socks);
        let report = WarmReport {
            helpers: helpers.len(),
            ahead_bytes,
        };
        if let Some(old) = lock(&self.helpers).replace(helpers) {
            lock(&self.reapers).extend(old.stop());
        }
        tracing::info!(
            helpers = report.helpers,
            bytes = ahead_bytes,
            "copy-in helpers of the shim's taken over"
        );
        Ok(report)
    }

    /// Lets any helpers go unused (reaped in the background, joined at the next freeze).
    pub(super) fn let_helpers_go(&self) {
        if let Some(h) = lock(&self.helpers).take() {
            lock(&self.reapers).extend(h.stop());
        }
    }

    /// The bytes of each work item's chunk.
    pub(super) fn chunk_lens(reader: &ImageReader, work: &[(AllocId, usize)]) -> Vec<u64> {
        work.iter()
            .map(|&(id, index)| reader.allocations()[id.0].chunks[index].len)
            .collect()
    }

    /// Gives the ready helpers their shares of `work` (see [`plan_image_jobs`]): raw,
    /// gh1-hashed chunks of a tmpfs image, the memory they land in exported. Jobs sent
    /// ahead (by Warm with this image, or by the shim) are used as they are; otherwise
    /// each helper gets its job now. Anything that does not work out leaves the chunks
    /// to the staged copy.
    pub(super) fn hand_out(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        work: &[(AllocId, usize)],
    ) -> Shared {
        let mut shared = Shared {
            taken: vec![false; work.len()],
            ..Shared::default()
        };
        let Some(helpers) = lock(&self.helpers).take() else {
            return shared;
        };
        let mut reapers = Vec::new();
        let mut ready = if reader.direct_refusal().is_none() {
            helpers.ready_now(&mut reapers)
        } else {
            reapers.extend(helpers.stop());
            Vec::new()
        };
        lock(&self.reapers).extend(reapers);
        if ready.is_empty() {
            return shared;
        }
        if !ready.iter().any(|h| h.ahead.is_some()) {
            ready = self.send_jobs_now(reader, ready);
        }
        let lens = Self::chunk_lens(reader, work);
        let image_id = reader.manifest_hash().to_hex();
        let index: std::collections::HashMap<(usize, usize), usize> = work
            .iter()
            .enumerate()
            .map(|(i, &(id, index))| ((id.0, index), i))
            .collect();
        for mut helper in ready {
            let job = helper.ahead.as_ref().map(|a| &a.job);
            let group: Option<Vec<usize>> = job
                .filter(|j| j.image_id == image_id)
                .and_then(|j| j.chunks.iter().map(|k| index.get(k).copied()).collect());
            let Some(group) = group else {
                tracing::info!(
                    pid = helper.pid(),
                    "copy-in helper not used: it has no job of this image"
                );
                lock(&self.reapers).push(helper.stop());
                continue;
            };
            let job_allocs = job.map(|j| j.allocs.clone()).unwrap_or_default();
            let gone = match self.export_for(allocs, &job_allocs) {
                Ok((fds, sizes)) => helper.go(&fds, &sizes).err(),
                Err(why) => Some(why),
            };
            if let Some(why) = gone {
                tracing::warn!(pid = helper.pid(), reason = %why, "copy-in helper not used");
                lock(&self.reapers).push(helper.stop());
                continue;
            }
            for &i in &group {
                shared.taken[i] = true;
            }
            let bytes = group.iter().map(|&i| lens[i]).sum();
            shared.running.push((helper, group, bytes));
        }
        shared
    }

    /// Sends the ready helpers their jobs now (no job went ahead); those that got one.
    pub(super) fn send_jobs_now(&self, reader: &ImageReader, ready: Vec<Helper>) -> Vec<Helper> {
        let share = self.opts.helper_share.unwrap_or(HELPER_SHARE_AT_COPY_IN);
        let jobs = match plan_image_jobs(reader, self.opts.pid, share, ready.len()) {
            Ok(jobs) => jobs,
            Err(e) => {
                tracing::warn!(error = %e, "copy-in helpers not used");
                lock(&self.reapers).extend(ready.into_iter().map(Helper::stop));
                return Vec::new();
            }
        };
        let files = reader.data_files();
        let mut with_jobs = Vec::new();
        let mut ready = ready.into_iter();
        for (job, desc) in jobs {
            let Some(mut helper) = ready.next() else {
                break;
            };
            if !fd_room(files.len()) {
                tracing::info!(
                    fds = files.len(),
                    "copy-in helper not used: too close to the fd limit"
                );
                lock(&self.reapers).push(helper.stop());
                continue;
            }
            match helper.send_job(&job, &files, desc) {
                Ok(()) => with_jobs.push(helper),
                Err(e) => {
                    tracing::warn!(pid = helper.pid(), error = %e, "copy-in helper not used");
                    lock(&self.reapers).push(helper.stop());
                }
            }
        }
        lock(&self.reapers).extend(ready.map(Helper::stop));
        with_jobs
    }

    /// The memory fds of a job's allocations (address and size, in job order), each
    /// exported and as the job knows it, and their mapped sizes.
    pub(super) fn export_for(
        &self,
        allocs: &[Allocation],
        job_allocs: &[(u64, u64)],
    ) -> Result<(Vec<OwnedFd>, Vec<u64>), String> {
        if !fd_room(job_allocs.len()) {
            return Err(format!(
                "{} fds would come too close to the fd limit",
                job_allocs.len()
            ));
        }
        let mut fds = Vec::with_capacity(job_allocs.len());
        let mut sizes = Vec::with_capacity(job_allocs.len());
        for &(va, size) in job_allocs {
            match allocs.iter().find(|a| a.va == va) {
                Some(a) if a.size == size => sizes.push(a.mapped_size),
                _ => return Err(format!("allocation {va:#x} is not as the job knows it")),
            }
            match self.allocator.export(va) {
                Ok(Some(fd)) => fds.push(fd),
                Ok(None) => return Err("its memory cannot be exported here".into()),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok((fds, sizes))
    }
}

/// The helpers a copy-in handed chunks to.
#[derive(Default)]
pub(super) struct Shared {
    /// Per work item: a helper has it.
    pub(super) taken: Vec<bool>,
    /// Each helper, its work items and their bytes.
    pub(super) running: Vec<(Helper, Vec<usize>, u64)>,
}

impl Shared {
    /// Waits for every helper's reply: their reports, the work items of those that
    /// failed (to be staged), and the helpers' reapers.
    pub(super) fn wait(
        self,
    ) -> (
        Vec<HelperReport>,
        Vec<usize>,
        Vec<std::thread::JoinHandle<()>>,
    ) {
        let mut reports = Vec::new();
        let mut failed = Vec::new();
        let mut reapers = Vec::new();
        for (mut helper, items, bytes) in self.running {
            let mut report = HelperReport {
                pid: helper.pid(),
                bytes,
                init_s: helper.init_s.unwrap_or_default(),
                ..HelperReport::default()
            };
            match helper.wait_done() {
                Ok(HelperMsg::Done {
                    seconds,
                    setup_s,
                    register_s,
                    ahead_s,
                    pin_wait_s,
                    ..
                }) => {
                    report.seconds = seconds;
                    report.setup_s = setup_s;
                    report.register_s = register_s;
                    report.ahead_s = ahead_s;
                    report.pin_wait_s = pin_wait_s;
                    reapers.push(helper.finish());
                }
                Ok(other) => unreachable!("wait_done returns Done only: {other:?}"),
                Err(e) => {
                    tracing::warn!(pid = report.pid, error = %e, "copy-in helper failed");
                    report.error = Some(e);
                    // Stopped before its chunks are staged again: it must not write
                    // into this memory any more.
                    drop(helper);
                    failed.extend(items);
                }
            }
            reports.push(report);
        }
        failed.sort_unstable();
        (reports, failed, reapers)
    }
}
