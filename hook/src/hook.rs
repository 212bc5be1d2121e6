//! [`Hook`]: one process's hook, wired together: the allocator, the freeze gate, the
//! fast path behind a [`Controller`], and the control socket. These are the entry
//! points the interposition layer (hook/preload) calls from its `cu*` wrappers.
//!
//! An address the hook does not track (memory from before the hook loaded, or from a
//! path it does not back) gives [`AllocError::NotFound`] from [`Hook::free`]; the
//! wrapper then forwards the call to the real driver.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use thiserror::Error;

use crate::alloc::{AllocError, Allocator, UnsupportedKind};
use crate::control::{socket_path, ControlError, ControlServer, Controller};
use crate::driver::{DevicePtr, VmmDriver};
use crate::fastpath::{FastPath, FastPathOptions};
use crate::gate::{Gate, GateGuard};
use crate::protocol::CheckpointState;

/// The environment variable naming the per-container control socket directory.
pub const ENV_SOCKET_DIR: &str = "GPUCR_HOOK_SOCKET_DIR";
/// The environment variable that turns the hook off (`1`, `true` or `yes`).
pub const ENV_DISABLE: &str = "GPUCR_HOOK_DISABLE";

/// Hook errors.
#[derive(Debug, Error)]
pub enum HookSetupError {
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("control server thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// What the environment asks of the hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookConfig {
    /// Pass every call through untouched.
    Disabled,
    /// Back allocations with VMM and serve the control socket in this directory.
    Enabled { socket_dir: PathBuf },
}

impl HookConfig {
    /// Reads the configuration through `var` (e.g. `std::env::var_os`). Without a
    /// socket directory there is nobody to answer, so the hook stays off.
    pub fn from_env(var: impl Fn(&str) -> Option<OsString>) -> HookConfig {
        let disabled = var(ENV_DISABLE)
            .and_then(|v| v.into_string().ok())
            .is_some_and(|v| matches!(v.trim(), "1" | "true" | "yes"));
        match var(ENV_SOCKET_DIR) {
            Some(dir) if !disabled && !dir.is_empty() => HookConfig::Enabled {
                socket_dir: PathBuf::from(dir),
            },
            _ => HookConfig::Disabled,
        }
    }
}

/// One process's hook. See the module docs.
pub struct Hook<D: VmmDriver> {
    allocator: Arc<Allocator<D>>,
    gate: Arc<Gate>,
    controller: Arc<Mutex<Controller<FastPath<D>>>>,
}

impl<D: VmmDriver + 'static> Hook<D> {
    pub fn new(driver: Arc<D>, opts: FastPathOptions) -> Result<Hook<D>, HookSetupError> {
        let allocator = Arc::new(Allocator::new(driver)?);
        let gate = Arc::new(Gate::new());
        let fast = FastPath::new(allocator.clone(), gate.clone(), opts);
        Ok(Hook {
            allocator,
            gate,
            controller: Arc::new(Mutex::new(Controller::new(fast))),
        })
    }

    /// Binds `<socket_dir>/hook-<pid>.sock` and serves it on a background thread;
    /// returns the socket's path.
    pub fn serve(&self, socket_dir: &Path) -> Result<PathBuf, HookSetupError> {
        let path = socket_path(socket_dir, std::process::id());
        let server = ControlServer::bind(&path)?;
        server
            .spawn(self.controller.clone())
            .map_err(HookSetupError::Thread)?;
        tracing::info!(socket = %path.display(), "gpucr hook serving");
        Ok(path)
    }

    /// Holds the gate for a launch, copy or other GPU work.
    pub fn enter(&self) -> GateGuard<'_> {
        self.gate.enter()
    }

    /// `cuMemAlloc`, gated.
    pub fn alloc(&self, size: u64) -> Result<DevicePtr, AllocError> {
        let _work = self.gate.enter();
        self.allocator.alloc(size)
    }

    /// `cuMemAllocPitch`, gated; returns the address and the pitch.
    pub fn alloc_pitch(
        &self,
        width: u64,
        height: u64,
        element: u32,
    ) -> Result<(DevicePtr, u64), AllocError> {
        let _work = self.gate.enter();
        self.allocator.alloc_pitch(width, height, element)
    }

    /// `cuMemFree`, gated; [`AllocError::NotFound`] for an address the hook does not own.
    pub fn free(&self, va: DevicePtr) -> Result<(), AllocError> {
        let _work = self.gate.enter();
        self.allocator.free(va)
    }

    /// Records memory the hook cannot move (the call itself goes to the real driver).
    pub fn record_unsupported(&self, kind: UnsupportedKind, va: DevicePtr, size: u64) {
        self.allocator.record_unsupported(kind, va, size);
    }

    /// Forgets unsupported memory at `va` once the application freed it.
    pub fn forget_unsupported(&self, va: DevicePtr) {
        self.allocator.table().forget_unsupported(va);
    }

    /// Whether `addr` (interior pointers too) is memory the hook owns.
    pub fn owns(&self, addr: DevicePtr) -> bool {
        self.allocator.find(addr).is_some()
    }

    /// Where the checkpoint sequence is.
    pub fn state(&self) -> CheckpointState {
        self.controller
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .state()
    }

    pub fn allocator(&self) -> &Arc<Allocator<D>> {
        &self.allocator
    }

    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ControlClient;
    use crate::fake::FakeDriver;
    use crate::gate::GateState;
    use crate::protocol::{ErrorKind, Outcome, Reply, Request};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn config_from_env() {
        assert_eq!(HookConfig::from_env(env(&[])), HookConfig::Disabled);
        assert_eq!(
            HookConfig::from_env(env(&[(ENV_SOCKET_DIR, "/run/gpucr")])),
            HookConfig::Enabled {
                socket_dir: "/run/gpucr".into()
            }
        );
        for off in ["1", "true", "yes"] {
            let cfg =
                HookConfig::from_env(env(&[(ENV_SOCKET_DIR, "/run/gpucr"), (ENV_DISABLE, off)]));
            assert_eq!(cfg, HookConfig::Disabled, "{off}");
        }
        let cfg = HookConfig::from_env(env(&[(ENV_SOCKET_DIR, "/d"), (ENV_DISABLE, "0")]));
        assert!(matches!(cfg, HookConfig::Enabled { .. }));
        assert_eq!(
            HookConfig::from_env(env(&[(ENV_SOCKET_DIR, "")])),
            HookConfig::Disabled
        );
    }

    fn hook() -> Hook<FakeDriver> {
        let opts = FastPathOptions {
            freeze_timeout: Duration::from_secs(10),
            ..FastPathOptions::default()
        };
        Hook::new(Arc::new(FakeDriver::default()), opts).unwrap()
    }

    #[test]
    fn allocations_are_gated_and_tracked() {
        let hook = hook();
        let va = hook.alloc(1000).unwrap();
        assert!(hook.owns(va + 999));
        assert!(!hook.owns(va + 1000));
        assert!(matches!(
            hook.free(0x1234),
            Err(AllocError::NotFound { .. })
        ));
        hook.gate().freeze(Duration::from_secs(10)).unwrap();
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                hook.free(va).unwrap();
                done.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!done.load(Ordering::SeqCst), "free passed a frozen gate");
            hook.gate().thaw().unwrap();
        });
        assert!(!hook.owns(va));
    }

    #[test]
    fn a_status_larger_than_a_request_frame_is_delivered() {
        let hook = hook();
        for i in 0..5000u64 {
            hook.record_unsupported(UnsupportedKind::Managed, 0x1000 * (i + 1), 4096);
        }
        let dir = tempfile::tempdir().unwrap();
        let mut client = ControlClient::connect(&hook.serve(dir.path()).unwrap()).unwrap();
        let Reply::Ok(Outcome::Status(status)) = client.call(&Request::Status).unwrap() else {
            panic!("no status");
        };
        assert_eq!(status.unsupported.len(), 5000);
    }

    #[test]
    fn serves_its_socket_in_the_directory() {
        let hook = hook();
        hook.alloc(4096).unwrap();
        hook.record_unsupported(UnsupportedKind::IpcHandle, 0x5000, 4096);
        let dir = tempfile::tempdir().unwrap();
        let path = hook.serve(dir.path()).unwrap();
        assert_eq!(path, socket_path(dir.path(), std::process::id()));
        let mut client = ControlClient::connect(&path).unwrap();
        let Reply::Ok(Outcome::Status(status)) = client.call(&Request::Status).unwrap() else {
            panic!("no status");
        };
        assert_eq!((status.allocations, status.bytes), (1, 4096));
        assert_eq!(status.unsupported.len(), 1);
        assert_eq!(status.gate, GateState::Running);
        // With unsupported memory the fast path refuses; freeze and thaw still work.
        assert!(matches!(
            client.call(&Request::Freeze).unwrap(),
            Reply::Ok(_)
        ));
        let img = dir.path().join("img");
        let reply = client
            .call(&Request::CopyOut {
                image_dir: img,
                parent: None,
            })
            .unwrap();
        assert!(
            matches!(reply, Reply::Error(ref e) if e.kind == ErrorKind::Failed),
            "{reply:?}"
        );
        assert_eq!(hook.state(), CheckpointState::Frozen);
        assert!(matches!(client.call(&Request::Thaw).unwrap(), Reply::Ok(_)));
        assert_eq!(hook.gate().state(), GateState::Running);
    }
}
