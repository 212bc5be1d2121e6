//! The wire: length-prefixed JSON frames, with directory fds (SCM_RIGHTS) on a
//! request and memory fds in batches after a frame.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use crate::protocol::{FrameError, FD_BATCH, MAX_FDS, MAX_HELD};

/// This process's open fds and its `RLIMIT_NOFILE`: whether kept memory's fds fit.
#[derive(Debug, Clone, Copy)]
pub struct FdRoom {
    pub open: u64,
    pub soft: u64,
    pub hard: u64,
}

impl FdRoom {
    /// Headroom left for the process's own fds while memory fds are held.
    pub const SPARE: u64 = 64;

    pub fn now() -> io::Result<FdRoom> {
        let open = std::fs::read_dir("/proc/self/fd")?.count() as u64;
        let (soft, hard) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .map_err(io::Error::from)?;
        Ok(FdRoom { open, soft, hard })
    }

    /// Whether `n` more fds fit under the soft limit, with [`FdRoom::SPARE`] to spare.
    pub fn fits(&self, n: usize) -> bool {
        self.open + n as u64 + Self::SPARE <= self.soft
    }
}

/// Sends `fds` in batches of at most [`FD_BATCH`], each with one byte `F`.
pub fn send_fd_batches(stream: &UnixStream, fds: &[impl AsFd]) -> Result<(), FrameError> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    for batch in fds.chunks(FD_BATCH) {
        let raw: Vec<RawFd> = batch.iter().map(|fd| fd.as_fd().as_raw_fd()).collect();
        loop {
            match sendmsg::<()>(
                stream.as_raw_fd(),
                &[IoSlice::new(b"F")],
                &[ControlMessage::ScmRights(&raw)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Err(nix::errno::Errno::EINTR) => continue,
                Ok(1) => break,
                Ok(_) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                Err(e) => return Err(io::Error::from(e).into()),
            }
        }
    }
    Ok(())
}

/// Receives `n` fds sent by [`send_fd_batches`]. Reads every batch even when one came
/// short (the fd limit), so the stream stays at a frame boundary; then fails.
pub fn recv_fd_batches(stream: &UnixStream, n: usize) -> Result<Vec<OwnedFd>, FrameError> {
    if n > MAX_HELD {
        return Err(
            io::Error::other(format!("{n} memory fds announced, at most {MAX_HELD}")).into(),
        );
    }
    let mut fds = Vec::with_capacity(n);
    let mut short = false;
    for _ in 0..n.div_ceil(FD_BATCH) {
        let mut byte = [0u8; 1];
        let (bytes, cut) = recv_some(stream, &mut byte, FD_BATCH, &mut fds)?;
        if bytes == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        short |= cut;
    }
    if short || fds.len() != n {
        return Err(io::Error::other(format!(
            "{} of {n} memory fds arrived (the process's fd limit?)",
            fds.len()
        ))
        .into());
    }
    Ok(fds)
}

/// Reads one frame and the fds that came with it (SCM_RIGHTS, close-on-exec).
pub(super) fn recv_frame(
    stream: &UnixStream,
    max: u32,
) -> Result<(Vec<u8>, Vec<OwnedFd>), FrameError> {
    let mut fds = Vec::new();
    let mut len = [0u8; 4];
    if !recv_exact(stream, &mut len, &mut fds)? {
        return Err(FrameError::Closed);
    }
    let len = u32::from_be_bytes(len);
    if len > max {
        return Err(FrameError::TooLarge {
            len: len.into(),
            max,
        });
    }
    let mut buf = vec![0u8; len as usize];
    if !recv_exact(stream, &mut buf, &mut fds)? {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    Ok((buf, fds))
}

/// Fills `buf` with recvmsg, collecting fds; `false` at end of stream before any byte.
fn recv_exact(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> Result<bool, FrameError> {
    let mut filled = 0;
    while filled < buf.len() {
        let (bytes, truncated) = recv_some(stream, &mut buf[filled..], MAX_FDS + 1, fds)?;
        if truncated {
            return Err(io::Error::other(format!(
                "more fds than the {MAX_FDS} a request may carry"
            ))
            .into());
        }
        if bytes == 0 {
            if filled == 0 {
                return Ok(false);
            }
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        filled += bytes;
    }
    Ok(true)
}

/// One `recvmsg` into `buf` (retried on EINTR); the fds that came with it (room for
/// `max_fds`, close-on-exec) are appended to `fds`. Returns the bytes read and whether
/// fds were cut off (more came than there was room for: the kernel closed the rest).
fn recv_some(
    stream: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
    fds: &mut Vec<OwnedFd>,
) -> Result<(usize, bool), FrameError> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let room = (max_fds * std::mem::size_of::<RawFd>()) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let mut space = vec![0u8; unsafe { nix::libc::CMSG_SPACE(room) } as usize];
    let mut iov = [IoSliceMut::new(buf)];
    let msg = loop {
        match recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other.map_err(io::Error::from)?,
        }
    };
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            // SAFETY: the kernel just installed these fds in this process; we own them.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    Ok((msg.bytes, msg.flags.contains(MsgFlags::MSG_CTRUNC)))
}
