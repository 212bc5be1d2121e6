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
//!
//! Cut by role: `state` (the state table), `controller` (the [`Controller`] and the
//! [`Engine`] it drives), `server` (the socket), `client` (the [`ControlClient`] the shim
//! links) and `wire` (framing and fd batches, shared by server and client).

use std::io;
use std::path::PathBuf;

use thiserror::Error;

use crate::protocol::{CheckpointState, Verb};
use wire::FrameError;

mod client;
mod controller;
mod server;
mod state;
pub mod wire;

pub use client::ControlClient;
pub(crate) use controller::error_chain;
pub use controller::{Controller, Engine};
pub use server::{socket_path, ControlServer};
pub use wire::{recv_fd_batches, send_fd_batches, FdRoom};

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

#[cfg(test)]
mod tests;
