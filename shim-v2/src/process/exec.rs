//! Exec processes: added by Exec, run by Start, removed by Delete.

use containerd_shim_protos::protobuf::well_known_types::any::Any;
use tokio::sync::Mutex;

use super::{state::ExecState, ExitCell};
use crate::io::{ProcessIo, StdioSpec};

pub struct ExecProcess {
    pub exec_id: String,
    /// The OCI `Process` JSON containerd sent.
    pub spec: Any,
    pub stdio: StdioSpec,
    pub inner: Mutex<ExecInner>,
    pub exit: ExitCell,
}

pub struct ExecInner {
    pub state: ExecState,
    pub pid: u32,
    pub io: ProcessIo,
}

impl ExecProcess {
    pub fn new(exec_id: String, spec: Any, stdio: StdioSpec) -> Self {
        ExecProcess {
            exec_id,
            spec,
            stdio,
            inner: Mutex::new(ExecInner {
                state: ExecState::Created,
                pid: 0,
                io: ProcessIo::default(),
            }),
            exit: ExitCell::default(),
        }
    }
}
