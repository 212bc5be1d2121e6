//! The wire: length-prefixed JSON frames and their size limits, with directory fds
//! (SCM_RIGHTS) on a request and memory fds in batches after a frame, and [`FdRoom`]:
//! whether a process has room for the memory fds it is about to hold.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use serde::Serialize;
use thiserror::Error;

/// Largest request frame the hook accepts (a Warm handing over helpers lists their
/// chunks: a few bytes per 16 MiB chunk).
pub const MAX_FRAME: u32 = 4 << 20;
/// Most fds one request may carry (CopyOut, Prepare: the image's directory and its parent).
pub const MAX_FDS: usize = 2;
/// Largest reply frame (a Status lists every unsupported allocation).
pub const MAX_REPLY_FRAME: u32 = 16 << 20;
/// Most memory fds in one batch (the kernel takes at most 253 per message).
pub const FD_BATCH: usize = 128;
/// Most memory fds one Release or Reattach moves.
pub const MAX_HELD: usize = 1 << 16;

/// Framing errors.
#[derive(Debug, Error)]
pub enum FrameError {
    #[error("frame of {len} bytes is larger than {max}")]
    TooLarge { len: u64, max: u32 },
    #[error("connection closed")]
    Closed,
    #[error("frame I/O: {0}")]
    Io(#[from] io::Error),
    #[error("frame is not valid JSON for this message: {0}")]
    Json(#[from] serde_json::Error),
}

/// Reads one frame of at most `max` bytes; [`FrameError::Closed`] at a clean end of
/// stream.
pub fn read_frame(r: &mut impl Read, max: u32) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let mut buf = vec![0u8; body_len(len, max)?];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Writes `msg` as one frame of at most `max` bytes.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T, max: u32) -> Result<(), FrameError> {
    w.write_all(&encode_frame(msg, max)?)?;
    w.flush()?;
    Ok(())
}

/// Writes `msg` as one frame of at most `max` bytes with `fds` (SCM_RIGHTS) on its
/// first byte.
pub(super) fn send_frame_with_fds<T: Serialize>(
    stream: &UnixStream,
    msg: &T,
    max: u32,
    fds: &[BorrowedFd<'_>],
) -> Result<(), FrameError> {
    let frame = encode_frame(msg, max)?;
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let sent = send_some(stream, &frame, &raw)?;
    // The fds went with the first byte; the rest of a short write follows plainly.
    (&*stream).write_all(&frame[sent..])?;
    Ok(())
}

/// `msg` as one frame: its length (4 bytes, big-endian), then its JSON; at most `max`
/// bytes of JSON.
fn encode_frame<T: Serialize>(msg: &T, max: u32) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(msg)?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|l| *l <= max)
        .ok_or(FrameError::TooLarge {
            len: body.len() as u64,
            max,
        })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// A frame's body length from its 4-byte prefix, refused above `max`.
fn body_len(len: [u8; 4], max: u32) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(len);
    if len > max {
        return Err(FrameError::TooLarge {
            len: len.into(),
            max,
        });
    }
    Ok(len as usize)
}

/// One `sendmsg` of `bytes` with `fds` (none: no control message), retried on EINTR,
/// without SIGPIPE. Returns the bytes sent.
fn send_some(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> Result<usize, FrameError> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let cmsgs = [ControlMessage::ScmRights(fds)];
    let cmsgs = if fds.is_empty() { &[][..] } else { &cmsgs[..] };
    loop {
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(bytes)],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => return Ok(other.map_err(io::Error::from)?),
        }
    }
}

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
    for batch in fds.chunks(FD_BATCH) {
        let raw: Vec<RawFd> = batch.iter().map(|fd| fd.as_fd().as_raw_fd()).collect();
        if send_some(stream, b"F", &raw)? != 1 {
            return Err(io::Error::from(io::ErrorKind::WriteZero).into());
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
    let mut buf = vec![0u8; body_len(len, max)?];
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{parse_request, Request};

    /// A frame written to a peer that went away (a shim or helper gone) fails with EPIPE
    /// and raises no SIGPIPE, whose default action would kill the workload the hook lives
    /// in (C and Python programs keep it): std's `UnixStream` writes with MSG_NOSIGNAL.
    /// Run in a child with SIGPIPE's default action.
    #[test]
    fn writes_to_a_closed_peer_fail_without_sigpipe() {
        use nix::sys::signal::{signal, SigHandler, Signal};
        use nix::sys::wait::{waitpid, WaitStatus};
        use nix::unistd::{fork, ForkResult};
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(theirs);
        let frame = [0u8, 0, 0, 2, b'{', b'}'];
        // SAFETY: the child makes only async-signal-safe calls (no allocation) and exits.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                let code = unsafe {
                    let _ = signal(Signal::SIGPIPE, SigHandler::SigDfl);
                    match (&ours).write_all(&frame) {
                        Err(e) if e.raw_os_error() == Some(nix::libc::EPIPE) => 0,
                        _ => 1,
                    }
                };
                unsafe { nix::libc::_exit(code) }
            }
            ForkResult::Parent { child } => {
                assert_eq!(waitpid(child, None).unwrap(), WaitStatus::Exited(child, 0));
            }
        }
    }

    #[test]
    fn frames_round_trip_and_refuse_oversize() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &Request::Freeze, MAX_FRAME).unwrap();
        let mut r = &buf[..];
        assert_eq!(
            parse_request(&read_frame(&mut r, MAX_FRAME).unwrap()).unwrap(),
            Request::Freeze
        );
        assert!(matches!(
            read_frame(&mut r, MAX_FRAME),
            Err(FrameError::Closed)
        ));

        let huge = (MAX_FRAME + 1).to_be_bytes();
        assert!(matches!(
            read_frame(&mut &huge[..], MAX_FRAME),
            Err(FrameError::TooLarge { .. })
        ));
        let short = [0, 0, 0, 10, b'{'];
        assert!(matches!(
            read_frame(&mut &short[..], MAX_FRAME),
            Err(FrameError::Io(_))
        ));
    }
}
