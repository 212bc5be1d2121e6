//! Device memory: release (optionally kept exported), reattach, remap and snapshot.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::Instant;

use gpu_state::image::ImageReader;

use super::dma::{make_fd_room, FdRoomError};
use super::{FastPath, FastPathError};
use thiserror::Error;

use crate::alloc::{AllocError, AllocState, Allocation};
use crate::driver::{fd_identity, DevicePtr, VmmDriver, VmmError};
use crate::protocol::{CopyOutReport, MemoryReport, SnapshotReport};
use crate::snapshot::Snapshot;

impl<D: VmmDriver + 'static> FastPath<D> {
    /// Releases the physical memory of every mapped allocation; the VA ranges stay.
    /// All or nothing: when one fails, the ones released before it get their memory
    /// back (the kept memory, else refilled from the last copy-out image).
    pub fn release(&self, keep: bool) -> Result<(MemoryReport, Vec<OwnedFd>), FastPathError> {
        let mapped: Vec<Allocation> = self
            .movable()?
            .into_iter()
            .filter(|a| a.state == AllocState::Mapped)
            .collect();
        let exported = if keep && self.opts.keep {
            self.export_all(&mapped).unwrap_or_else(|why| {
                let why = crate::control::error_chain(&why);
                tracing::info!(allocations = mapped.len(), "device memory not kept: {why}");
                Vec::new()
            })
        } else {
            Vec::new()
        };
        let mut report = self.release_each(&mapped, |r| self.undo_release(r, &exported))?;
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.clear();
        let mut fds = Vec::with_capacity(exported.len());
        for (va, fd) in exported {
            kept.insert(va, fd_identity(fd.as_fd()));
            report.held.push(va);
            fds.push(fd);
        }
        Ok((report, fds))
    }

    /// Releases `mapped`, all or nothing: when one fails, `undo` is given the ones
    /// released before it (and it, when unmapped) to give them their memory back.
    pub(super) fn release_each(
        &self,
        mapped: &[Allocation],
        undo: impl FnOnce(&[Allocation]) -> Result<(), FastPathError>,
    ) -> Result<MemoryReport, FastPathError> {
        let mut report = MemoryReport::default();
        let mut released = Vec::new();
        for alloc in mapped {
            if let Err(source) = self.allocator.release(alloc.va) {
                // Unmapped but not released still counts: its memory is gone.
                if self.allocator.get(alloc.va).map(|a| a.state) == Some(AllocState::Released) {
                    released.push(alloc.clone());
                }
                let undo = match undo(&released) {
                    Ok(()) => format!("{} released allocation(s) restored", released.len()),
                    Err(e) => format!("restoring the released allocations failed: {e}"),
                };
                return Err(FastPathError::ReleaseFailed {
                    va: alloc.va,
                    source,
                    undo,
                });
            }
            report.allocations += 1;
            report.bytes += alloc.mapped_size;
            released.push(alloc.clone());
        }
        Ok(report)
    }

    /// Every allocation's memory exported as an fd, or why not: the fds must fit the
    /// process's fd limit and every export must work.
    pub(super) fn export_all(
        &self,
        allocs: &[Allocation],
    ) -> Result<Vec<(DevicePtr, OwnedFd)>, KeepError> {
        make_fd_room(allocs.len())?;
        let mut out = Vec::with_capacity(allocs.len());
        for a in allocs {
            match self.allocator.export(a.va) {
                Ok(Some(fd)) => out.push((a.va, fd)),
                Ok(None) => return Err(KeepError::NotExportable),
                Err(source) => return Err(KeepError::Export { va: a.va, source }),
            }
        }
        Ok(out)
    }

    /// Copies every allocation into a snapshot on the device, releases the snapshot's
    /// memory kept (its fd returned) and every allocation's (freed: Reattach refills
    /// them from the snapshot, device to device). Nothing changes when it fails: no room
    /// for the snapshot, it cannot be exported, a driver error.
    pub fn snapshot(&self) -> Result<(SnapshotReport, Vec<OwnedFd>), FastPathError> {
        if !(self.opts.snapshot && self.opts.keep) {
            return Err(FastPathError::NoSnapshot(
                "snapshots are off in this process",
            ));
        }
        let mapped = self.mapped()?;
        make_fd_room(1).map_err(|e| FastPathError::NotKeepable(e.into()))?;
        let t = Instant::now();
        let mut snap = Snapshot::take(self.driver(), &mapped, self.opts.snapshot_headroom)?;
        let copy_seconds = t.elapsed().as_secs_f64();
        let driver = self.driver();
        let fd = match snap.export(driver) {
            Ok(Some(fd)) => fd,
            Ok(None) => {
                snap.free(driver);
                return Err(FastPathError::NotKeepable(KeepError::SnapshotNotExportable));
            }
            Err(e) => {
                snap.free(driver);
                return Err(e.into());
            }
        };
        let vas = |r: &[Allocation]| r.iter().map(|a| a.va).collect::<Vec<_>>();
        let mut release = match self.release_each(&mapped, |r| self.refill_from(&snap, &vas(r))) {
            Ok(report) => report,
            Err(e) => {
                snap.free(driver);
                return Err(e);
            }
        };
        if let Err(e) = snap.release(driver) {
            // The snapshot is the released allocations' only copy: mapped again (through
            // its fd if its own release got that far), it refills them.
            let undo = snap
                .reattach(driver, fd.as_fd())
                .map_err(FastPathError::from)
                .and_then(|()| self.refill_from(&snap, &vas(&mapped)));
            snap.free(driver);
            return Err(match undo {
                Ok(()) => e.into(),
                Err(u) => FastPathError::NotKeepable(KeepError::SnapshotUndo {
                    release: e,
                    undo: Box::new(u),
                }),
            });
        }
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.clear();
        kept.insert(snap.va(), fd_identity(fd.as_fd()));
        drop(kept);
        release.held.push(snap.va());
        let report = SnapshotReport {
            release,
            snapshot_bytes: snap.size(),
            copy_seconds,
        };
        tracing::info!(
            allocations = report.release.allocations,
            bytes = snap.size(),
            copy_seconds,
            "device memory snapshot taken on the device; memory released"
        );
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = Some(snap);
        Ok((report, vec![fd]))
    }

    /// Gives each released allocation of `vas` new memory, filled from its copy in
    /// `snap` (mapped), device to device.
    pub(super) fn refill_from(
        &self,
        snap: &Snapshot,
        vas: &[DevicePtr],
    ) -> Result<(), FastPathError> {
        for (alloc, src) in snap.sources() {
            if !vas.contains(&alloc.va) {
                continue;
            }
            if self.allocator.get(alloc.va).map(|a| a.state) == Some(AllocState::Released) {
                self.allocator.remap(alloc.va)?;
            }
            self.driver().copy_device(alloc.va, src, alloc.size)?;
        }
        Ok(())
    }

    /// Writes the snapshot (mapped again: after Reattach) into a new image at
    /// `image_dir`, as [`FastPath::copy_out`] would have written the memory when the
    /// snapshot was taken; then frees it. On failure the snapshot stays (DropSnapshot).
    pub fn write_snapshot(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, FastPathError> {
        let mut guard = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        let snap = guard
            .as_ref()
            .ok_or(FastPathError::NoSnapshot("none taken"))?;
        if !snap.is_mapped() {
            return Err(FastPathError::NoSnapshot(
                "its memory is not mapped (Reattach first)",
            ));
        }
        let report = self.write_image(image_dir, parent, &snap.sources(), None)?;
        if let Some(snap) = guard.take() {
            snap.free(self.driver());
        }
        Ok(report)
    }

    /// Frees the snapshot, if any, without writing it.
    pub fn drop_snapshot(&self) {
        if let Some(snap) = self
            .snapshot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            tracing::info!(bytes = snap.size(), "device memory snapshot dropped");
            snap.free(self.driver());
        }
    }

    /// Maps the memory kept since the last Release back at `held` (its addresses, in
    /// the order of `fds`). Only exactly that memory: every kept address, each with the
    /// fd that left with it.
    pub fn reattach(
        &self,
        held: &[DevicePtr],
        fds: Vec<OwnedFd>,
    ) -> Result<MemoryReport, FastPathError> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let mut sorted = held.to_vec();
        sorted.sort_unstable();
        if !sorted.iter().copied().eq(kept.keys().copied()) || fds.len() != held.len() {
            return Err(FastPathError::NotKept(format!(
                "{} address(es) and {} fd(s) given back, {} kept",
                held.len(),
                fds.len(),
                kept.len()
            )));
        }
        for (va, fd) in held.iter().zip(&fds) {
            if fd_identity(fd.as_fd()) != kept[va] || kept[va].is_none() {
                return Err(FastPathError::NotKept(format!(
                    "the fd given back for {va:#x} is not the memory released there"
                )));
            }
        }
        let mut report = MemoryReport::default();
        let mut snapshot = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        let mut allocations = Vec::with_capacity(held.len());
        for (va, fd) in held.iter().zip(fds) {
            // Mapped, the memory is held by this process's handle; the fd may close.
            match snapshot.as_mut().filter(|s| s.va() == *va) {
                Some(snap) => snap.reattach(self.driver(), fd.as_fd())?,
                None => {
                    self.allocator.reattach(*va, fd.as_fd())?;
                    allocations.push(*va);
                }
            }
            kept.remove(va);
        }
        drop(kept);
        // After a snapshot the allocations were freed: new memory, filled from it.
        if let Some(snap) = snapshot.as_ref() {
            let released: Vec<_> = self
                .allocator
                .table()
                .iter()
                .filter(|a| a.state == AllocState::Released)
                .map(|a| a.va)
                .collect();
            self.refill_from(snap, &released)?;
            allocations.extend(released);
        } else {
            self.make_exportable(&allocations);
        }
        drop(snapshot);
        for va in &allocations {
            report.allocations += 1;
            report.bytes += self.allocator.get(*va).map_or(0, |a| a.mapped_size);
        }
        Ok(report)
    }

    /// Imported memory cannot be exported again: each allocation at `vas` that cannot is
    /// moved onto new memory (a device-to-device copy, HBM-fast), so the next checkpoint
    /// keeps it too. One that cannot move (no room for the copy) stays as it is: the next
    /// keep falls back to the copy-in.
    pub(super) fn make_exportable(&self, vas: &[DevicePtr]) {
        for &va in vas {
            if let Ok(Some(_fd)) = self.allocator.export(va) {
                continue;
            }
            if let Err(e) = self.allocator.renew(va) {
                tracing::info!(va, error = %e, "reattached memory stays unexportable; the next \
                    leave-running checkpoint copies it back in");
            }
        }
    }

    /// Gives `released` their memory back: the exported memory where it was kept, else
    /// new memory refilled from the last copy-out image.
    pub(super) fn undo_release(
        &self,
        released: &[Allocation],
        exported: &[(DevicePtr, OwnedFd)],
    ) -> Result<(), FastPathError> {
        let mut refill = Vec::new();
        let mut reattached = Vec::new();
        for alloc in released {
            match exported.iter().find(|(va, _)| *va == alloc.va) {
                Some((va, fd)) => {
                    self.allocator.reattach(*va, fd.as_fd())?;
                    reattached.push(*va);
                }
                None => refill.push(alloc.clone()),
            }
        }
        self.make_exportable(&reattached);
        let released = refill;
        if released.is_empty() {
            return Ok(());
        }
        let dir = self
            .last_image
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(FastPathError::NoImage)?;
        let reader = ImageReader::open(&dir)?;
        for alloc in &released {
            self.allocator.remap(alloc.va)?;
        }
        let now: Vec<Allocation> = released
            .iter()
            .filter_map(|a| self.allocator.get(a.va))
            .collect();
        let plan = self.match_image(&reader, &now, false)?;
        let (work, targets) = Self::chunk_work(&reader, &now, &plan);
        let all: Vec<usize> = (0..work.len()).collect();
        self.fill(&reader, &work, &targets, &all, Instant::now())?;
        Ok(())
    }

    /// Creates physical memory again at the VA of every released allocation.
    pub fn remap(&self) -> Result<MemoryReport, FastPathError> {
        // Kept memory not reattached is given up: the copy-in refills from the image. So
        // is a snapshot (a process restored from a snapshot checkpoint has its address
        // range only; its image was written before the checkpoint completed).
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.drop_snapshot();
        self.for_each_in(AllocState::Released, |va| self.allocator.remap(va))
    }

    pub(super) fn for_each_in(
        &self,
        state: AllocState,
        op: impl Fn(DevicePtr) -> Result<(), AllocError>,
    ) -> Result<MemoryReport, FastPathError> {
        let mut report = MemoryReport::default();
        for alloc in self.movable()?.iter().filter(|a| a.state == state) {
            op(alloc.va)?;
            report.allocations += 1;
            report.bytes += alloc.mapped_size;
        }
        Ok(report)
    }
}

/// Why device memory cannot be kept on the GPU (a Release with `keep`, a Snapshot).
#[derive(Debug, Error)]
pub enum KeepError {
    #[error(transparent)]
    FdRoom(#[from] FdRoomError),
    #[error("the driver cannot export it")]
    NotExportable,
    #[error("the driver cannot export the snapshot")]
    SnapshotNotExportable,
    #[error("export of {va:#x} failed")]
    Export {
        va: DevicePtr,
        #[source]
        source: AllocError,
    },
    #[error("{release}; restoring the released allocations from the snapshot failed")]
    SnapshotUndo {
        release: VmmError,
        #[source]
        undo: Box<FastPathError>,
    },
}
