//! The control side: the checkpoint state machine ([`CheckpointState::on`]), a
//! [`Controller`] that runs each verb on an [`Engine`] only in its state, and a
//! [`ControlServer`] that serves the protocol on a unix socket in the per-container
//! socket directory.
//!
//! A bad message (garbage, oversized frame, unknown verb, a verb out of order) gets an
//! error reply and changes nothing; a verb whose engine call fails leaves the state as
//! it was, so it can be retried (or the shim thaws and falls back to the driver path).
//!
//! Image directories may come as fds with the request (see [`crate::protocol`]): the
//! controller turns the request's relative paths into `/proc/self/fd/<n>/...` paths and
//! holds the fds only as long as the protocol says.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use thiserror::Error;

use crate::driver::DevicePtr;
use crate::helper::AheadJob;
use crate::protocol::{
    parse_request, read_frame, write_frame, CheckpointState, CopyInReport, CopyOutReport,
    ErrorKind, FrameError, HookStatus, MemoryReport, Outcome, PrepareReport, Reply, Request,
    SnapshotReport, Verb, WarmReport, FD_BATCH, MAX_FDS, MAX_FRAME, MAX_HELD, MAX_REPLY_FRAME,
};

/// What the controller drives: the fast path, or a stub in tests.
pub trait Engine: Send {
    type Error: std::error::Error;
    fn freeze(&self) -> Result<(), Self::Error>;
    fn copy_out(&self, dir: &Path, parent: Option<&Path>) -> Result<CopyOutReport, Self::Error>;
    /// Releases every allocation's memory. With `keep`, exports it first when it can:
    /// the report's `held` lists the addresses of the returned fds, in order.
    fn release(&self, keep: bool) -> Result<(MemoryReport, Vec<OwnedFd>), Self::Error>;
    fn remap(&self) -> Result<MemoryReport, Self::Error>;
    /// Maps the memory of `fds` (kept since the release, one per address of `held`)
    /// back at `held`.
    fn reattach(&self, held: &[DevicePtr], fds: Vec<OwnedFd>) -> Result<MemoryReport, Self::Error>;
    fn copy_in(&self, dir: &Path) -> Result<CopyInReport, Self::Error>;
    fn thaw(&self) -> Result<(), Self::Error>;
    fn status(&self, state: CheckpointState) -> HookStatus;
    /// Copies every allocation into a snapshot on the device, then releases the
    /// snapshot (kept: its fd returned) and every allocation. An error changes nothing.
    fn snapshot(&self) -> Result<(SnapshotReport, Vec<OwnedFd>), Self::Error>;
    /// Writes the snapshot into a new image, then frees it.
    fn write_snapshot(
        &self,
        dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, Self::Error>;
    /// Frees the snapshot without writing it.
    fn drop_snapshot(&self) -> Result<(), Self::Error>;
    /// Readies a CopyOut into `dir` while the workload runs (see [`crate::protocol`]).
    fn prepare(&self, dir: &Path, parent: Option<&Path>) -> Result<PrepareReport, Self::Error>;
    /// Whether a prepared CopyOut is held (its directory fds must stay open).
    fn prepared(&self) -> bool;
    /// Drops a prepared CopyOut, if any.
    fn drop_prepared(&self);
    /// Starts what the next copy-in (from `image_dir` when given) can use: its helpers,
    /// and with an image their shares pinned ahead; none by default.
    fn warm(&self, _image_dir: Option<&Path>) -> Result<WarmReport, Self::Error> {
        Ok(WarmReport::default())
    }
    /// Takes over helpers the shim started and sent `jobs` (one socket each, in
    /// order); by default they are let go (their sockets closed).
    fn adopt_helpers(
        &self,
        _jobs: Vec<AheadJob>,
        _socks: Vec<OwnedFd>,
    ) -> Result<WarmReport, Self::Error> {
        Ok(WarmReport::default())
    }
}

/// Control errors.
#[derive(Debug, Error)]
pub enum ControlError {
    #[error("{verb:?} is not legal while {state:?}")]
    IllegalInState { verb: Verb, state: CheckpointState },
    #[error("control socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("{0}")]
    BadFds(String),
}

impl CheckpointState {
    /// The state after `verb`. `Thaw` is legal after Freeze and CopyOut too (a checkpoint
    /// given up before anything was released) but not after Release or Remap, where the
    /// device memory is not back yet. A snapshot is written or dropped before the next
    /// checkpoint can begin.
    pub fn on(self, verb: Verb) -> Result<CheckpointState, ControlError> {
        use CheckpointState as S;
        match (self, verb) {
            (state, Verb::Status) => Ok(state),
            (S::Running, Verb::Prepare) => Ok(S::Running),
            // Before a copy-in: a process waiting for its memory (restored, or released).
            (S::Released | S::Snapshotted | S::Remapped, Verb::Warm) => Ok(self),
            (S::Running, Verb::Freeze) => Ok(S::Frozen),
            (S::Frozen, Verb::CopyOut) => Ok(S::CopiedOut),
            (S::CopiedOut, Verb::Release) => Ok(S::Released),
            (S::Released, Verb::Remap) => Ok(S::Remapped),
            (S::Released, Verb::Reattach) => Ok(S::Reattached),
            (S::Remapped, Verb::CopyIn) => Ok(S::CopiedIn),
            (S::Frozen | S::CopiedOut | S::CopiedIn | S::Reattached, Verb::Thaw) => Ok(S::Running),
            (S::Frozen, Verb::Snapshot) => Ok(S::Snapshotted),
            (S::Snapshotted, Verb::Reattach) => Ok(S::SnapshotReattached),
            // A process restored from a snapshot checkpoint: its image is complete.
            (S::Snapshotted, Verb::Remap) => Ok(S::Remapped),
            (S::SnapshotReattached, Verb::Thaw) => Ok(S::WritePending),
            (S::WritePending, Verb::WriteSnapshot | Verb::DropSnapshot) => Ok(S::Running),
            (state, verb) => Err(ControlError::IllegalInState { verb, state }),
        }
    }
}

/// Runs verbs on an engine in checkpoint order.
pub struct Controller<E> {
    state: CheckpointState,
    engine: E,
    /// The fds of the last CopyOut, held while CopiedOut: a Release that fails half-way
    /// refills the released allocations from that image, through these fds' paths.
    held: Vec<OwnedFd>,
    /// The fds of the last Prepare, held while the engine holds what it prepared (its
    /// unfinished image lives under these fds' paths).
    prepared: Vec<OwnedFd>,
    /// Counts successful Prepares: which one the engine holds.
    prepare_token: u64,
}

impl<E: Engine> Controller<E> {
    pub fn new(engine: E) -> Self {
        Controller {
            state: CheckpointState::Running,
            engine,
            held: Vec::new(),
            prepared: Vec::new(),
            prepare_token: 0,
        }
    }

    pub fn state(&self) -> CheckpointState {
        self.state
    }

    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// Runs one request; the state moves only when the verb succeeded.
    pub fn handle(&mut self, req: &Request) -> Reply {
        self.handle_with_fds(req, Vec::new())
    }

    /// Runs one request that came with `fds` (see [`crate::protocol`]): its relative
    /// paths are resolved against them. The fds are closed after the verb, except those
    /// of a successful CopyOut, which are held while CopiedOut. Memory fds a Release
    /// returns are closed (see [`Controller::exchange`]).
    pub fn handle_with_fds(&mut self, req: &Request, fds: Vec<OwnedFd>) -> Reply {
        self.exchange(req, fds).0
    }

    /// Runs one request with the fds that came with it and returns the reply with the
    /// fds that go with it: a Reattach's fds are the kept memory, a Release with `keep`
    /// returns them.
    pub fn exchange(&mut self, req: &Request, fds: Vec<OwnedFd>) -> (Reply, Vec<OwnedFd>) {
        let next = match self.state.on(req.verb()) {
            Ok(next) => next,
            Err(e) => {
                return (
                    Reply::error(ErrorKind::IllegalInState, e.to_string()),
                    Vec::new(),
                )
            }
        };
        let (req, path_fds, memory_fds) = match req {
            Request::Reattach { held } if held.len() != fds.len() => {
                let msg = format!(
                    "Reattach of {} address(es) came with {} fd(s)",
                    held.len(),
                    fds.len()
                );
                return (Reply::error(ErrorKind::BadRequest, msg), Vec::new());
            }
            Request::Reattach { .. } => (req.clone(), Vec::new(), fds),
            Request::Warm { image_dir, helpers } if !helpers.is_empty() => {
                if image_dir.is_some() || helpers.len() != fds.len() {
                    let msg = format!(
                        "Warm with {} helper job(s) came with {} socket fd(s){}: send one \
                         socket per job and no image",
                        helpers.len(),
                        fds.len(),
                        if image_dir.is_some() {
                            " and an image"
                        } else {
                            ""
                        }
                    );
                    return (Reply::error(ErrorKind::BadRequest, msg), Vec::new());
                }
                (req.clone(), Vec::new(), fds)
            }
            _ => match resolve_fd_paths(req, &fds) {
                Ok(req) => (req, fds, Vec::new()),
                Err(e) => {
                    return (
                        Reply::error(ErrorKind::BadRequest, e.to_string()),
                        Vec::new(),
                    )
                }
            },
        };
        let outcome = self.run(&req, memory_fds);
        let mut out = Vec::new();
        let reply = match outcome {
            Ok((outcome, fds)) => {
                tracing::debug!(verb = ?req.verb(), from = ?self.state, to = ?next, "control verb done");
                self.state = next;
                match req.verb() {
                    Verb::CopyOut => self.held = path_fds,
                    Verb::Prepare => {
                        self.prepared = path_fds;
                        self.prepare_token += 1;
                    }
                    _ => {}
                }
                out = fds;
                Reply::Ok(outcome)
            }
            Err(e) => {
                tracing::warn!(verb = ?req.verb(), state = ?self.state, error = %e, "control verb failed");
                Reply::error(ErrorKind::Failed, error_chain(&e))
            }
        };
        if self.state != CheckpointState::CopiedOut {
            // Closed before the dump: CRIU cannot dump fds of host directories.
            self.held.clear();
        }
        if !self.engine.prepared() {
            self.prepared.clear();
        }
        (reply, out)
    }

    /// Which successful Prepare was the last (see [`Controller::abandon_prepare`]).
    pub fn prepare_token(&self) -> u64 {
        self.prepare_token
    }

    /// Drops what Prepare `token` readied if it is still held: its connection closed
    /// before the CopyOut (a shim that went away must not leave a mapping of a host file
    /// and pinned memory for the next dump to meet).
    pub fn abandon_prepare(&mut self, token: u64) {
        if token == self.prepare_token && self.engine.prepared() {
            tracing::info!("the connection that prepared a copy-out closed; dropping it");
            self.engine.drop_prepared();
            self.prepared.clear();
        }
    }

    /// How many fds the controller holds (those of the last CopyOut, while CopiedOut,
    /// and of a Prepare while the engine holds it).
    pub fn held_fds(&self) -> usize {
        self.held.len() + self.prepared.len()
    }

    fn run(&self, req: &Request, fds: Vec<OwnedFd>) -> Result<(Outcome, Vec<OwnedFd>), E::Error> {
        let e = &self.engine;
        let outcome = match req {
            Request::Release { keep } => {
                let (report, fds) = e.release(*keep)?;
                return Ok((Outcome::Released(report), fds));
            }
            Request::Snapshot => {
                let (report, fds) = e.snapshot()?;
                return Ok((Outcome::Snapshotted(report), fds));
            }
            Request::Reattach { held } => Outcome::Reattached(e.reattach(held, fds)?),
            Request::WriteSnapshot { image_dir, parent } => {
                Outcome::SnapshotWritten(e.write_snapshot(image_dir, parent.as_deref())?)
            }
            Request::DropSnapshot => e.drop_snapshot().map(|()| Outcome::SnapshotDropped)?,
            Request::Prepare { image_dir, parent } => {
                Outcome::Prepared(e.prepare(image_dir, parent.as_deref())?)
            }
            Request::Freeze => e.freeze().map(|()| Outcome::Frozen)?,
            Request::CopyOut { image_dir, parent } => {
                Outcome::CopiedOut(e.copy_out(image_dir, parent.as_deref())?)
            }
            Request::Warm { image_dir, helpers } if helpers.is_empty() => {
                Outcome::Warmed(e.warm(image_dir.as_deref())?)
            }
            Request::Warm { helpers, .. } => {
                Outcome::Warmed(e.adopt_helpers(helpers.clone(), fds)?)
            }
            Request::Remap => Outcome::Remapped(e.remap()?),
            Request::CopyIn { image_dir } => Outcome::CopiedIn(e.copy_in(image_dir)?),
            Request::Thaw => e.thaw().map(|()| Outcome::Thawed)?,
            Request::Status => Outcome::Status(e.status(self.state)),
        };
        Ok((outcome, Vec::new()))
    }
}

/// `/proc/self/fd/<fd>/<rel>`, `rel` being relative and staying inside the directory
/// (`.` is the directory itself).
fn fd_path(fd: &OwnedFd, rel: &Path, what: &str) -> Result<PathBuf, ControlError> {
    use std::path::Component;
    let inside = rel
        .components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !inside {
        return Err(ControlError::BadFds(format!(
            "{what} {} must be a path inside the directory passed as an fd \
             (relative, no ..)",
            rel.display()
        )));
    }
    let base = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    Ok(rel
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .fold(base, |p, c| p.join(c)))
}

/// The request with its relative paths resolved against `fds`; unchanged without fds.
fn resolve_fd_paths(req: &Request, fds: &[OwnedFd]) -> Result<Request, ControlError> {
    if fds.is_empty() {
        return Ok(req.clone());
    }
    let bad = |msg: String| ControlError::BadFds(msg);
    if fds.len() > MAX_FDS {
        return Err(bad(format!("{} fds sent, at most {MAX_FDS}", fds.len())));
    }
    match (req, fds) {
        (
            Request::CopyOut { image_dir, parent }
            | Request::WriteSnapshot { image_dir, parent }
            | Request::Prepare { image_dir, parent },
            [dir, rest @ ..],
        ) => {
            let parent = match (parent, rest) {
                (None, []) => None,
                (Some(p), [pfd]) => Some(fd_path(pfd, p, "parent")?),
                (Some(p), []) if p.is_absolute() => Some(p.clone()),
                _ => {
                    return Err(bad(format!(
                        "{:?} with fds: send the parent's fd as the second fd, \
                         with a relative parent path",
                        req.verb()
                    )))
                }
            };
            let image_dir = fd_path(dir, image_dir, "image_dir")?;
            Ok(match req {
                Request::CopyOut { .. } => Request::CopyOut { image_dir, parent },
                Request::Prepare { .. } => Request::Prepare { image_dir, parent },
                _ => Request::WriteSnapshot { image_dir, parent },
            })
        }
        (Request::CopyIn { image_dir }, [dir]) => Ok(Request::CopyIn {
            image_dir: fd_path(dir, image_dir, "image_dir")?,
        }),
        (
            Request::Warm {
                image_dir: Some(image_dir),
                helpers,
            },
            [dir],
        ) if helpers.is_empty() => Ok(Request::Warm {
            image_dir: Some(fd_path(dir, image_dir, "image_dir")?),
            helpers: Vec::new(),
        }),
        (req, fds) => Err(bad(format!(
            "{:?} does not take {} fd(s) (CopyOut, WriteSnapshot and Prepare take 1 or 2, CopyIn and Warm with an image 1)",
            req.verb(),
            fds.len()
        ))),
    }
}

/// `err` and its sources, joined with ": ".
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut msg = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// The socket's name in the socket directory: one per process.
pub fn socket_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("hook-{pid}.sock"))
}

/// Serves the control protocol. One thread accepts; each connection gets a thread
/// and handles its requests in order. The controller's mutex is held for one verb at
/// a time (a long copy-out makes a concurrent Status wait).
pub struct ControlServer {
    path: PathBuf,
    listener: UnixListener,
}

impl ControlServer {
    /// Binds `path`, replacing a stale socket left by an earlier process.
    pub fn bind(path: &Path) -> Result<ControlServer, ControlError> {
        let socket_err = |source| ControlError::Socket {
            path: path.to_path_buf(),
            source,
        };
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(socket_err(e)),
        }
        let listener = UnixListener::bind(path).map_err(socket_err)?;
        Ok(ControlServer {
            path: path.to_path_buf(),
            listener,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves on a background thread until the process exits.
    pub fn spawn<E: Engine + 'static>(
        self,
        controller: Arc<Mutex<Controller<E>>>,
    ) -> io::Result<JoinHandle<()>> {
        std::thread::Builder::new()
            .name("gpucr-hook-ctl".into())
            .spawn(move || self.serve(controller))
    }

    fn serve<E: Engine + 'static>(self, controller: Arc<Mutex<Controller<E>>>) {
        for stream in self.listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "control socket accept failed");
                    continue;
                }
            };
            let controller = controller.clone();
            let spawned = std::thread::Builder::new()
                .name("gpucr-hook-conn".into())
                .spawn(move || serve_connection(stream, &controller));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no thread for a control connection");
            }
        }
    }
}

/// Handles one connection's requests until it closes or sends an unreadable frame; then
/// drops a Prepare it made that no CopyOut used.
fn serve_connection<E: Engine>(stream: UnixStream, controller: &Mutex<Controller<E>>) {
    let mut prepared = None;
    serve_requests(stream, controller, &mut prepared);
    if let Some(token) = prepared {
        controller
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .abandon_prepare(token);
    }
}

fn serve_requests<E: Engine>(
    mut stream: UnixStream,
    controller: &Mutex<Controller<E>>,
    prepared: &mut Option<u64>,
) {
    loop {
        let (reply, out) = match recv_frame(&stream, MAX_FRAME) {
            Ok((bytes, mut fds)) => match parse_request(&bytes) {
                Ok(req) => {
                    let following = match &req {
                        Request::Reattach { held } => held.len(),
                        Request::Warm { helpers, .. } => helpers.len(),
                        _ => 0,
                    };
                    if following > 0 {
                        // The memory (or helper socket) fds follow the frame; read them
                        // all, also when too many, so the stream stays at a frame
                        // boundary.
                        match recv_fd_batches(&stream, following) {
                            Ok(more) => fds.extend(more),
                            Err(e) => {
                                tracing::debug!(error = %e, "control connection dropped");
                                return;
                            }
                        }
                    }
                    let mut c = controller.lock().unwrap_or_else(|p| p.into_inner());
                    let before = c.prepare_token();
                    let exchanged = c.exchange(&req, fds);
                    if c.prepare_token() != before {
                        *prepared = Some(c.prepare_token());
                    }
                    exchanged
                }
                Err(e) => (Reply::Error(e), Vec::new()),
            },
            Err(FrameError::Closed) => return,
            Err(e @ FrameError::TooLarge { .. }) => {
                // The rest of the stream cannot be trusted to be at a frame boundary.
                let _ = write_frame(
                    &mut stream,
                    &Reply::error(ErrorKind::FrameTooLarge, e.to_string()),
                    MAX_REPLY_FRAME,
                );
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, "control connection dropped");
                return;
            }
        };
        if let Err(e) = write_frame(&mut stream, &reply, MAX_REPLY_FRAME) {
            tracing::debug!(error = %e, "control reply not delivered");
            return;
        }
        if let Err(e) = send_fd_batches(&stream, &out) {
            // The memory stays with the hook's last fds (closed now): the shim falls
            // back to Remap and CopyIn.
            tracing::warn!(error = %e, fds = out.len(), "kept memory's fds not delivered");
            return;
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
fn recv_frame(stream: &UnixStream, max: u32) -> Result<(Vec<u8>, Vec<OwnedFd>), FrameError> {
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

/// A client of the control socket (the shim's side; also used by tests).
pub struct ControlClient {
    stream: UnixStream,
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
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let body = serde_json::to_vec(req).map_err(FrameError::from)?;
        let len = u32::try_from(body.len())
            .ok()
            .filter(|l| *l <= MAX_FRAME)
            .ok_or(FrameError::TooLarge {
                len: body.len() as u64,
                max: MAX_FRAME,
            })?;
        let mut frame = len.to_be_bytes().to_vec();
        frame.extend_from_slice(&body);
        let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
        let cmsgs = [ControlMessage::ScmRights(&raw)];
        let cmsgs = if raw.is_empty() { &[][..] } else { &cmsgs[..] };
        let sent = loop {
            match sendmsg::<()>(
                self.stream.as_raw_fd(),
                &[IoSlice::new(&frame)],
                cmsgs,
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => break other.map_err(|e| FrameError::from(io::Error::from(e)))?,
            }
        };
        // The fds went with the first byte; the rest of a short write follows plainly.
        use std::io::Write;
        self.stream
            .write_all(&frame[sent..])
            .map_err(FrameError::from)?;
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

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
