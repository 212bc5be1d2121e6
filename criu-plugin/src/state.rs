//! What the plugin remembers between hooks of one CRIU run.

use std::sync::{Mutex, MutexGuard};

use gpu_state::{GpuPair, ProcessState};

use crate::isolated::IsolatedDriver;

/// A CUDA process we paused during this dump.
#[derive(Debug, Clone, Copy)]
pub struct Tracked {
    pub pid: i32,
    pub restore_tid: i32,
    /// The driver state before CRIU touched it; `exit(DUMP)` returns it there.
    pub initial: ProcessState,
    pub checkpointed: bool,
}

pub struct Plugin {
    /// `None`: no CUDA driver here, or the plugin is off for this stage.
    pub driver: Option<IsolatedDriver>,
    pub inventory_added: bool,
    pub tracked: Vec<Tracked>,
    /// Restore: which recorded GPU becomes which here (empty: the same GPUs).
    pub gpu_pairs: Vec<GpuPair>,
    /// The processes the gpucr shim quiesced (see `shim`), read once at init.
    pub shim: crate::shim::Quiesced,
}

impl Default for Plugin {
    fn default() -> Self {
        Plugin {
            driver: None,
            inventory_added: false,
            tracked: Vec::new(),
            gpu_pairs: Vec::new(),
            shim: crate::shim::Quiesced::from_env(),
        }
    }
}

static PLUGIN: Mutex<Option<Plugin>> = Mutex::new(None);

/// The plugin state; CRIU calls hooks from one thread, the lock only keeps Rust honest.
pub fn get() -> MutexGuard<'static, Option<Plugin>> {
    PLUGIN.lock().unwrap_or_else(|e| e.into_inner())
}
