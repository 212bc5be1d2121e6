//! The [`ControlClient`] the shim links.

use std::fs::File;
use std::io::{self};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use super::wire::{
    read_frame, send_frame_with_fds, write_frame, FrameError, MAX_FRAME, MAX_REPLY_FRAME,
};
use crate::helper::AheadJob;
use crate::protocol::{Outcome, Reply, Request};

use super::wire::{recv_fd_batches, send_fd_batches};
use super::ControlError;

/// A client of the control socket (the shim's side; also used by tests).
pub struct ControlClient {
    pub(super) stream: UnixStream,
}

impl ControlClient {
    pub fn connect(path: &Path) -> Result<ControlClient, ControlError> {
        let stream = UnixStream::connect(path).map_err(|source| ControlError::Socket {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(ControlClient { stream })
    }

    /// Bounds how long one reply may take (`None`: forever), so a hung process cannot
    /// hang its caller.
    pub fn set_timeout(&self, timeout: Option<std::time::Duration>) -> io::Result<()> {
        self.stream.set_read_timeout(timeout)?;
        self.stream.set_write_timeout(timeout)
    }

    /// Sends `req` and waits for the reply. Memory fds that come with it (a Release
    /// with `keep`) are closed: use [`ControlClient::release`] to hold them.
    pub fn call(&mut self, req: &Request) -> Result<Reply, ControlError> {
        write_frame(&mut self.stream, req, MAX_FRAME)?;
        Ok(self.read_reply()?.0)
    }

    /// Release; with `keep`, also the memory fds of the reply's `held` addresses (they
    /// keep the memory on the GPU until closed or given back with Reattach).
    pub fn release(&mut self, keep: bool) -> Result<(Reply, Vec<OwnedFd>), ControlError> {
        write_frame(&mut self.stream, &Request::Release { keep }, MAX_FRAME)?;
        self.read_reply()
    }

    /// Snapshot; the fds of the reply's `held` addresses (the kept memory, then the
    /// snapshot) follow it, as after [`ControlClient::release`].
    pub fn snapshot(&mut self) -> Result<(Reply, Vec<OwnedFd>), ControlError> {
        write_frame(&mut self.stream, &Request::Snapshot, MAX_FRAME)?;
        self.read_reply()
    }

    /// Reattach: gives the memory fds of `held` back, in the order Release listed them.
    pub fn reattach(&mut self, held: &[u64], fds: &[impl AsFd]) -> Result<Reply, ControlError> {
        let req = Request::Reattach {
            held: held.to_vec(),
        };
        write_frame(&mut self.stream, &req, MAX_FRAME)?;
        send_fd_batches(&self.stream, fds)?;
        Ok(self.read_reply()?.0)
    }

    /// Warm handing over helpers the caller started and sent `jobs`: their sockets
    /// `socks`, in the same order, follow the frame (the hook gets its own copies).
    pub fn warm_with_helpers(
        &mut self,
        jobs: Vec<AheadJob>,
        socks: &[impl AsFd],
    ) -> Result<Reply, ControlError> {
        let req = Request::Warm {
            image_dir: None,
            helpers: jobs,
        };
        write_frame(&mut self.stream, &req, MAX_FRAME)?;
        send_fd_batches(&self.stream, socks)?;
        Ok(self.read_reply()?.0)
    }

    /// Sends `req` with `fds` (SCM_RIGHTS on the frame's first bytes) and waits for the
    /// reply. The hook gets its own copies; the caller's stay open.
    pub fn call_with_fds(
        &mut self,
        req: &Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Reply, ControlError> {
        send_frame_with_fds(&self.stream, req, MAX_FRAME, fds)?;
        Ok(self.read_reply()?.0)
    }

    /// CopyOut into a new image `name` inside the directory `dir` (an open directory of
    /// the caller's, passed as an fd), as a delta of the image `parent` when given.
    pub fn copy_out_fd(
        &mut self,
        dir: &File,
        name: &Path,
        parent: Option<&File>,
    ) -> Result<Reply, ControlError> {
        let req = Request::CopyOut {
            image_dir: name.to_path_buf(),
            parent: parent.map(|_| PathBuf::from(".")),
        };
        self.call_with_dirs(&req, dir, parent)
    }

    /// Prepare a CopyOut into a new image `name` inside the open directory `dir`, as
    /// [`ControlClient::copy_out_fd`] names it.
    pub fn prepare_fd(
        &mut self,
        dir: &File,
        name: &Path,
        parent: Option<&File>,
    ) -> Result<Reply, ControlError> {
        let req = Request::Prepare {
            image_dir: name.to_path_buf(),
            parent: parent.map(|_| PathBuf::from(".")),
        };
        self.call_with_dirs(&req, dir, parent)
    }

    /// WriteSnapshot into a new image `name` inside the open directory `dir`, as
    /// [`ControlClient::copy_out_fd`] does.
    pub fn write_snapshot_fd(
        &mut self,
        dir: &File,
        name: &Path,
        parent: Option<&File>,
    ) -> Result<Reply, ControlError> {
        let req = Request::WriteSnapshot {
            image_dir: name.to_path_buf(),
            parent: parent.map(|_| PathBuf::from(".")),
        };
        self.call_with_dirs(&req, dir, parent)
    }

    /// `req` with the image's directory `dir` and its parent image's as fds.
    fn call_with_dirs(
        &mut self,
        req: &Request,
        dir: &File,
        parent: Option<&File>,
    ) -> Result<Reply, ControlError> {
        let mut fds = vec![dir.as_fd()];
        fds.extend(parent.map(|p| p.as_fd()));
        self.call_with_fds(req, &fds)
    }

    /// CopyIn from the image that the open directory `image` is.
    pub fn copy_in_fd(&mut self, image: &File) -> Result<Reply, ControlError> {
        let req = Request::CopyIn {
            image_dir: PathBuf::from("."),
        };
        self.call_with_fds(&req, &[image.as_fd()])
    }

    /// Sends raw frame bytes (for tests of bad input) and reads the reply.
    pub fn call_raw(&mut self, frame: &[u8]) -> Result<Reply, ControlError> {
        use std::io::Write;
        self.stream
            .write_all(frame)
            .map_err(|e| ControlError::Frame(e.into()))?;
        Ok(self.read_reply()?.0)
    }

    /// The reply, and the memory fds that follow a Release's (always read, so the stream
    /// stays at a frame boundary).
    fn read_reply(&mut self) -> Result<(Reply, Vec<OwnedFd>), ControlError> {
        let bytes = read_frame(&mut self.stream, MAX_REPLY_FRAME)?;
        let reply: Reply = serde_json::from_slice(&bytes).map_err(FrameError::from)?;
        let held = match &reply {
            Reply::Ok(Outcome::Released(r)) => r.held.len(),
            Reply::Ok(Outcome::Snapshotted(r)) => r.release.held.len(),
            _ => 0,
        };
        let fds = match held {
            0 => Vec::new(),
            n => {
                // The memory is released either way: without its fds it is freed, and the
                // caller copies it back in from the image (Remap, CopyIn).
                recv_fd_batches(&self.stream, n).unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "the kept memory's fds did not arrive");
                    Vec::new()
                })
            }
        };
        Ok((reply, fds))
    }
}
