//! The checkpoint state table: which verb is legal in which state, and where it leads.

use crate::protocol::{CheckpointState, Verb};

use super::ControlError;

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
