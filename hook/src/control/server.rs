//! The [`ControlServer`]: the control socket, one thread per connection.

use std::io::{self};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::wire::{write_frame, FrameError, MAX_FRAME, MAX_REPLY_FRAME};
use crate::protocol::{parse_request, ErrorKind, Reply, Request};

use super::controller::{Controller, Engine};
use super::wire::{recv_fd_batches, recv_frame, send_fd_batches};
use super::ControlError;

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
