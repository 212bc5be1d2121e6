//! The harness's typed error.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while setting up or driving containerd from a test.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("{what} at {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot spawn `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` ran past {timeout:?}\nstdout: {stdout}\nstderr: {stderr}")]
    Timeout {
        command: String,
        timeout: Duration,
        stdout: String,
        stderr: String,
    },
    #[error("`{command}` failed ({status})\nstdout: {stdout}\nstderr: {stderr}")]
    CommandFailed {
        command: String,
        status: String,
        stdout: String,
        stderr: String,
    },
    #[error("containerd did not answer on {address} within {timeout:?}; log tail:\n{log_tail}")]
    ContainerdNotReady {
        address: PathBuf,
        timeout: Duration,
        log_tail: String,
    },
    #[error("no containerd-shim-gpucr-v2 binary: {0}")]
    ShimNotFound(String),
    #[error("timed out after {timeout:?} waiting for {what}; last observation: {last}")]
    PollTimeout {
        what: String,
        timeout: Duration,
        last: String,
    },
    #[error("unexpected output: {0}")]
    Unexpected(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("ttrpc: {0}")]
    Ttrpc(#[from] containerd_shim_protos::ttrpc::Error),
}

impl HarnessError {
    /// Wraps an I/O error with what was attempted and on which path.
    pub fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { what, path, source }
    }
}

/// Result type of the harness.
pub type Result<T> = std::result::Result<T, HarnessError>;
