//! The shim's error type, mapped to ttrpc status codes at exactly one boundary
//! (`From<Error> for ttrpc::Error`), so containerd's errdefs see NotFound, AlreadyExists,
//! FailedPrecondition and InvalidArgument where an operator expects them.

use std::path::PathBuf;

use containerd_shim_protos::ttrpc::{self, Code};

use crate::process::state::{ExecStateError, StateError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("container {0} not found in this shim")]
    ContainerNotFound(String),
    #[error("process {exec_id} of container {id} not found")]
    ProcessNotFound { id: String, exec_id: String },
    #[error("container {0} already exists in this shim")]
    AlreadyExists(String),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    ExecState(#[from] ExecStateError),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("{op} failed: {msg}")]
    Runtime { op: &'static str, msg: String },
    /// runc died of a signal before it could log an error: killed by someone else (an
    /// operator, the OOM killer, a test); the shim killed what it had started with it.
    #[error(
        "{op} failed: runc was killed by signal {signal} before it finished (not by the shim: \
         an OOM kill or another process); CRIU under it was killed with its process group"
    )]
    RuntimeKilled { op: &'static str, signal: i32 },
    #[error("checkpoint of {id} failed: {msg}; {left}{}", criu_log_hint(.log))]
    Checkpoint {
        id: String,
        msg: String,
        /// The task's state after the failure, as runc reports it.
        left: TaskLeft,
        /// CRIU's dump log, when CRIU ran.
        log: Option<PathBuf>,
    },
    /// A step before the dump failed (the hook's copy-out, the driver's lock): the task is
    /// as the client had it.
    #[error("checkpoint of {id} failed: {source}; {left}")]
    CheckpointStep {
        id: String,
        #[source]
        source: Cause,
        left: TaskLeft,
    },
    #[error("restore of {id} from {image} failed: {msg}")]
    Restore {
        id: String,
        image: PathBuf,
        msg: String,
    },
    /// Create refused a checkpoint this host cannot take (GPU, hook, devices).
    #[error("restore of {id} from {image} failed: {source}")]
    RestoreRefused {
        id: String,
        image: PathBuf,
        #[source]
        source: Cause,
    },
    /// A step that ran out of time; what it started was killed.
    #[error("{op} {msg}")]
    TimedOut {
        op: &'static str,
        after: std::time::Duration,
        msg: String,
    },
    #[error("GPU: {0}")]
    Gpu(#[source] Box<crate::gpu::error::GpuError>),
    #[error("GPU hook: {0}")]
    Hook(#[from] crate::gpu::hook::HookError),
    #[error(transparent)]
    Cgroup(#[from] crate::restore_cgroup::CgroupError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("decoding {what}: {msg}")]
    Decode { what: &'static str, msg: String },
    #[error("operation not supported: {0}")]
    Unsupported(String),
    #[error(
        "moving the shim (pid {pid}) into cgroup {cgroup}, the ShimCgroup option of the task's \
         Create: {msg}; create that cgroup (in every hierarchy) or leave ShimCgroup out"
    )]
    ShimCgroup {
        pid: u32,
        cgroup: String,
        msg: String,
    },
    /// An exec started after the shim saw the init process exit (containerd's runc shim
    /// answers the same, FailedPrecondition).
    #[error(
        "container {id}: its init process is not running (it exited); no process can be \
         executed in it, start a new task"
    )]
    InitExited { id: String },
    /// A test's failpoint fired (see `failpoint`): never outside the fault-injection suite.
    #[error(
        "failpoint {point} fired (GPUCR_FAILPOINTS is set in containerd's environment: unset \
         it outside tests)"
    )]
    Failpoint { point: &'static str },
}

/// The typed error a checkpoint or restore failed with, kept as its source.
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

/// What a failed checkpoint left of the task: runc's own state, asked after the failure
/// (a CRIU killed mid-dump can leave the cgroup frozen or thawed behind the shim's back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskLeft {
    Running,
    Paused,
    Gone,
}

impl std::fmt::Display for TaskLeft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TaskLeft::Running => "the container was left running",
            TaskLeft::Paused => {
                "the container was left paused, as its client paused it (resume it)"
            }
            TaskLeft::Gone => "the container's init is gone (delete the task)",
        })
    }
}

impl From<crate::process::state::InitState> for TaskLeft {
    /// For failures before CRIU ran: the task is as the client had it.
    fn from(s: crate::process::state::InitState) -> Self {
        match s {
            crate::process::state::InitState::Paused => TaskLeft::Paused,
            _ => TaskLeft::Running,
        }
    }
}

fn criu_log_hint(log: &Option<PathBuf>) -> String {
    match log {
        Some(p) => format!(", CRIU's log is at {}", p.display()),
        None => String::new(),
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// Whether a restore failed or was refused: what an operator looks for in the log.
    pub fn is_restore(&self) -> bool {
        matches!(self, Error::Restore { .. } | Error::RestoreRefused { .. })
    }

    fn code(&self) -> Code {
        match self {
            Error::ContainerNotFound(_) | Error::ProcessNotFound { .. } => Code::NOT_FOUND,
            Error::AlreadyExists(_) => Code::ALREADY_EXISTS,
            Error::State(_)
            | Error::ExecState(_)
            | Error::InitExited { .. }
            | Error::ShimCgroup { .. } => Code::FAILED_PRECONDITION,
            Error::InvalidArgument(_) | Error::Decode { .. } => Code::INVALID_ARGUMENT,
            Error::Unsupported(_) => Code::UNIMPLEMENTED,
            Error::TimedOut { .. } => Code::DEADLINE_EXCEEDED,
            Error::Runtime { .. }
            | Error::RuntimeKilled { .. }
            | Error::Checkpoint { .. }
            | Error::CheckpointStep { .. }
            | Error::Restore { .. }
            | Error::RestoreRefused { .. }
            | Error::Gpu(_)
            | Error::Hook(_)
            | Error::Cgroup(_)
            | Error::Failpoint { .. }
            | Error::Io { .. } => Code::UNKNOWN,
        }
    }
}

/// Adds context to an io::Result.
pub trait IoContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::io(context(), e))
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> Self {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}

impl From<crate::gpu::error::GpuError> for Error {
    fn from(e: crate::gpu::error::GpuError) -> Self {
        Error::Gpu(Box::new(e))
    }
}

impl From<protobuf::Error> for Error {
    fn from(e: protobuf::Error) -> Self {
        Error::Decode {
            what: "protobuf message",
            msg: e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::state::{ExecState, InitState, TaskVerb};

    fn code_of(e: Error) -> Code {
        match ttrpc::Error::from(e) {
            ttrpc::Error::RpcStatus(s) => s.code(),
            other => panic!("not a status: {other:?}"),
        }
    }

    #[test]
    fn errors_map_to_the_codes_containerd_expects() {
        assert_eq!(
            code_of(Error::ContainerNotFound("a".into())),
            Code::NOT_FOUND
        );
        assert_eq!(
            code_of(Error::ProcessNotFound {
                id: "a".into(),
                exec_id: "b".into()
            }),
            Code::NOT_FOUND
        );
        assert_eq!(
            code_of(Error::AlreadyExists("a".into())),
            Code::ALREADY_EXISTS
        );
        assert_eq!(
            code_of(Error::State(StateError {
                from: InitState::Stopped,
                verb: TaskVerb::Pause
            })),
            Code::FAILED_PRECONDITION
        );
        assert_eq!(
            code_of(Error::ExecState(ExecStateError {
                from: ExecState::Running,
                verb: TaskVerb::Start
            })),
            Code::FAILED_PRECONDITION
        );
        assert_eq!(code_of(Error::invalid("x")), Code::INVALID_ARGUMENT);
        assert_eq!(code_of(Error::Unsupported("x".into())), Code::UNIMPLEMENTED);
        assert_eq!(
            code_of(Error::Runtime {
                op: "runc start",
                msg: "boom".into()
            }),
            Code::UNKNOWN
        );
    }
}
