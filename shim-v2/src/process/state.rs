//! Explicit state machines for the init process and exec processes.
//!
//! Each state answers each verb: either the state it moves to, or a typed error that the
//! service returns as FailedPrecondition. The per-state rules follow containerd's Go runc shim
//! (`process/init_state.go`), without its string-keyed transitions.

use std::fmt;

use containerd_shim_protos::api::Status;

/// What a client asks of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskVerb {
    Start,
    Pause,
    Resume,
    Checkpoint,
    Exec,
    Kill,
    Update,
    Delete,
    /// Not a client verb: the reaper saw the process exit.
    Exit,
}

/// State of a container's init process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitState {
    /// `runc create` done; waiting for Start.
    Created,
    /// Create armed a restore from a checkpoint image; Start runs `runc restore`.
    CreatedCheckpoint,
    Running,
    Paused,
    Stopped,
    Deleted,
}

/// State of an exec process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecState {
    Created,
    Running,
    Stopped,
    Deleted,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot {verb:?} a task in state {from:?}")]
pub struct StateError {
    pub from: InitState,
    pub verb: TaskVerb,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot {verb:?} an exec process in state {from:?}")]
pub struct ExecStateError {
    pub from: ExecState,
    pub verb: TaskVerb,
}

impl InitState {
    /// The state after `verb`, or why `verb` is not allowed now. Checkpoint keeps the state:
    /// with `exit` the process goes to Stopped through the reaper, like any exit.
    pub fn next(self, verb: TaskVerb) -> Result<InitState, StateError> {
        use InitState::*;
        use TaskVerb as V;
        let to = match (self, verb) {
            (Created | CreatedCheckpoint, V::Start) => Running,
            (Running, V::Pause) => Paused,
            (Paused, V::Resume) => Running,
            (Running | Paused, V::Checkpoint) => self,
            (Created | Running, V::Exec) => self,
            (Created | CreatedCheckpoint | Running | Paused, V::Kill) => self,
            (Created | Running | Paused, V::Update) => self,
            (Created | CreatedCheckpoint | Stopped, V::Delete) => Deleted,
            (Created | CreatedCheckpoint | Running | Paused | Stopped, V::Exit) => Stopped,
            _ => return Err(StateError { from: self, verb }),
        };
        Ok(to)
    }

    pub fn status(self) -> Status {
        match self {
            InitState::Created | InitState::CreatedCheckpoint => Status::CREATED,
            InitState::Running => Status::RUNNING,
            InitState::Paused => Status::PAUSED,
            InitState::Stopped | InitState::Deleted => Status::STOPPED,
        }
    }
}

impl ExecState {
    pub fn next(self, verb: TaskVerb) -> Result<ExecState, ExecStateError> {
        use ExecState::*;
        let to = match (self, verb) {
            (Created, TaskVerb::Start) => Running,
            (Created | Running, TaskVerb::Kill) => self,
            (Created | Stopped, TaskVerb::Delete) => Deleted,
            (Created | Running | Stopped, TaskVerb::Exit) => Stopped,
            _ => return Err(ExecStateError { from: self, verb }),
        };
        Ok(to)
    }

    pub fn status(self) -> Status {
        match self {
            ExecState::Created => Status::CREATED,
            ExecState::Running => Status::RUNNING,
            ExecState::Stopped | ExecState::Deleted => Status::STOPPED,
        }
    }
}

impl fmt::Display for InitState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VERBS: [TaskVerb; 9] = [
        TaskVerb::Start,
        TaskVerb::Pause,
        TaskVerb::Resume,
        TaskVerb::Checkpoint,
        TaskVerb::Exec,
        TaskVerb::Kill,
        TaskVerb::Update,
        TaskVerb::Delete,
        TaskVerb::Exit,
    ];

    #[test]
    fn every_init_state_and_verb() {
        use InitState::*;
        // One row per state, one column per verb, in VERBS order; None = refused.
        let table: [(InitState, [Option<InitState>; 9]); 6] = [
            (
                Created,
                [
                    Some(Running),
                    None,
                    None,
                    None,
                    Some(Created),
                    Some(Created),
                    Some(Created),
                    Some(Deleted),
                    Some(Stopped),
                ],
            ),
            (
                CreatedCheckpoint,
                [
                    Some(Running),
                    None,
                    None,
                    None,
                    None,
                    Some(CreatedCheckpoint),
                    None,
                    Some(Deleted),
                    Some(Stopped),
                ],
            ),
            (
                Running,
                [
                    None,
                    Some(Paused),
                    None,
                    Some(Running),
                    Some(Running),
                    Some(Running),
                    Some(Running),
                    None,
                    Some(Stopped),
                ],
            ),
            (
                Paused,
                [
                    None,
                    None,
                    Some(Running),
                    Some(Paused),
                    None,
                    Some(Paused),
                    Some(Paused),
                    None,
                    Some(Stopped),
                ],
            ),
            (
                Stopped,
                [
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    Some(Deleted),
                    Some(Stopped),
                ],
            ),
            (Deleted, [None; 9]),
        ];
        for (from, row) in table {
            for (verb, want) in VERBS.iter().zip(row) {
                let got = from.next(*verb).ok();
                assert_eq!(got, want, "{from:?} --{verb:?}-->");
                if want.is_none() {
                    let err = from.next(*verb).unwrap_err();
                    assert_eq!(err, StateError { from, verb: *verb });
                }
            }
        }
    }

    #[test]
    fn every_exec_state_and_verb() {
        use ExecState::*;
        for from in [Created, Running, Stopped, Deleted] {
            for verb in VERBS {
                let want = match (from, verb) {
                    (Created, TaskVerb::Start) => Some(Running),
                    (Created | Running, TaskVerb::Kill) => Some(from),
                    (Created | Stopped, TaskVerb::Delete) => Some(Deleted),
                    (Deleted, _) => None,
                    (_, TaskVerb::Exit) => Some(Stopped),
                    _ => None,
                };
                assert_eq!(from.next(verb).ok(), want, "{from:?} --{verb:?}-->");
            }
        }
    }

    #[test]
    fn status_reported_to_containerd() {
        assert_eq!(InitState::CreatedCheckpoint.status(), Status::CREATED);
        assert_eq!(InitState::Paused.status(), Status::PAUSED);
        assert_eq!(InitState::Deleted.status(), Status::STOPPED);
        assert_eq!(ExecState::Running.status(), Status::RUNNING);
    }
}
