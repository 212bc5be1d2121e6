//! The control side: the checkpoint state machine ([`CheckpointState::on`]), a
//! [`Controller`] that runs each verb on an [`Engine`] only in its state, and a
//! [`ControlServer`] that serves the protocol on a unix socket in the per-container
//! socket directory.
//!
//! A bad message (garbage, oversized frame, unknown verb, a verb out of order) gets an
//! error reply and changes nothing; a verb whose engine call fails leaves the state as
//! it was, so it can be retried (or the shim thaws and falls back to the driver path).

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use thiserror::Error;

use crate::protocol::{
    parse_request, read_frame, write_frame, CheckpointState, CopyInReport, CopyOutReport,
    ErrorKind, FrameError, HookStatus, MemoryReport, Outcome, Reply, Request, Verb, MAX_FRAME,
    MAX_REPLY_FRAME,
};

/// What the controller drives: the fast path, or a stub in tests.
pub trait Engine: Send {
    type Error: std::error::Error;
    fn freeze(&self) -> Result<(), Self::Error>;
    fn copy_out(&self, dir: &Path, parent: Option<&Path>) -> Result<CopyOutReport, Self::Error>;
    fn release(&self) -> Result<MemoryReport, Self::Error>;
    fn remap(&self) -> Result<MemoryReport, Self::Error>;
    fn copy_in(&self, dir: &Path) -> Result<CopyInReport, Self::Error>;
    fn thaw(&self) -> Result<(), Self::Error>;
    fn status(&self, state: CheckpointState) -> HookStatus;
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
}

impl CheckpointState {
    /// The state after `verb`. `Thaw` is legal after Freeze and CopyOut too (a checkpoint
    /// given up before anything was released) but not after Release or Remap, where the
    /// device memory is not back yet.
    pub fn on(self, verb: Verb) -> Result<CheckpointState, ControlError> {
        use CheckpointState as S;
        match (self, verb) {
            (state, Verb::Status) => Ok(state),
            (S::Running, Verb::Freeze) => Ok(S::Frozen),
            (S::Frozen, Verb::CopyOut) => Ok(S::CopiedOut),
            (S::CopiedOut, Verb::Release) => Ok(S::Released),
            (S::Released, Verb::Remap) => Ok(S::Remapped),
            (S::Remapped, Verb::CopyIn) => Ok(S::CopiedIn),
            (S::Frozen | S::CopiedOut | S::CopiedIn, Verb::Thaw) => Ok(S::Running),
            (state, verb) => Err(ControlError::IllegalInState { verb, state }),
        }
    }
}

/// Runs verbs on an engine in checkpoint order.
pub struct Controller<E> {
    state: CheckpointState,
    engine: E,
}

impl<E: Engine> Controller<E> {
    pub fn new(engine: E) -> Self {
        Controller {
            state: CheckpointState::Running,
            engine,
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
        let next = match self.state.on(req.verb()) {
            Ok(next) => next,
            Err(e) => return Reply::error(ErrorKind::IllegalInState, e.to_string()),
        };
        let outcome = self.run(req);
        match outcome {
            Ok(outcome) => {
                tracing::debug!(verb = ?req.verb(), from = ?self.state, to = ?next, "control verb done");
                self.state = next;
                Reply::Ok(outcome)
            }
            Err(e) => {
                tracing::warn!(verb = ?req.verb(), state = ?self.state, error = %e, "control verb failed");
                Reply::error(ErrorKind::Failed, error_chain(&e))
            }
        }
    }

    fn run(&self, req: &Request) -> Result<Outcome, E::Error> {
        let e = &self.engine;
        Ok(match req {
            Request::Freeze => e.freeze().map(|()| Outcome::Frozen)?,
            Request::CopyOut { image_dir, parent } => {
                Outcome::CopiedOut(e.copy_out(image_dir, parent.as_deref())?)
            }
            Request::Release => Outcome::Released(e.release()?),
            Request::Remap => Outcome::Remapped(e.remap()?),
            Request::CopyIn { image_dir } => Outcome::CopiedIn(e.copy_in(image_dir)?),
            Request::Thaw => e.thaw().map(|()| Outcome::Thawed)?,
            Request::Status => Outcome::Status(e.status(self.state)),
        })
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

/// Handles one connection's requests until it closes or sends an unreadable frame.
fn serve_connection<E: Engine>(mut stream: UnixStream, controller: &Mutex<Controller<E>>) {
    loop {
        let reply = match read_frame(&mut stream, MAX_FRAME) {
            Ok(bytes) => match parse_request(&bytes) {
                Ok(req) => controller
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .handle(&req),
                Err(e) => Reply::Error(e),
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
    }
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

    /// Sends `req` and waits for the reply.
    pub fn call(&mut self, req: &Request) -> Result<Reply, ControlError> {
        write_frame(&mut self.stream, req, MAX_FRAME)?;
        self.read_reply()
    }

    /// Sends raw frame bytes (for tests of bad input) and reads the reply.
    pub fn call_raw(&mut self, frame: &[u8]) -> Result<Reply, ControlError> {
        use std::io::Write;
        self.stream
            .write_all(frame)
            .map_err(|e| ControlError::Frame(e.into()))?;
        self.read_reply()
    }

    fn read_reply(&mut self) -> Result<Reply, ControlError> {
        let bytes = read_frame(&mut self.stream, MAX_REPLY_FRAME)?;
        Ok(serde_json::from_slice(&bytes).map_err(FrameError::from)?)
    }
}

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
