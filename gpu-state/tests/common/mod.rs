#![allow(dead_code)] // each test binary uses a different part of the harness

//! Test harness around tests/fake-libcuda: builds it if needed, installs it as
//! `libcuda.so.1` in a temp dir and points gpu-state at it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use gpu_state::{CheckpointApi, CudaDriver, ProcessState};

/// The fake reads its environment on every call, so tests that use it run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// `<target>/debug/libcuda.so`, built on first use.
pub fn fake_lib() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        // The test binary lives in <target>/<profile>/deps/.
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let lib = profile_dir.join("libcuda.so");
        if !lib.exists() {
            let target = profile_dir.parent().unwrap();
            let status = std::process::Command::new(env!("CARGO"))
                .args(["build", "-p", "fake-libcuda"])
                .env("CARGO_TARGET_DIR", target)
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .unwrap();
            assert!(status.success(), "building fake-libcuda failed");
        }
        lib
    })
}

pub struct Fake {
    pub dir: tempfile::TempDir,
    _serial: MutexGuard<'static, ()>,
}

impl Fake {
    /// A fresh fake driver running `script`.
    pub fn new(script: &str) -> Fake {
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(fake_lib(), dir.path().join("libcuda.so.1")).unwrap();
        std::fs::write(dir.path().join("script"), script).unwrap();
        std::env::set_var("GPUCR_LIBCUDA", dir.path().join("libcuda.so.1"));
        std::env::set_var("GPUCR_FAKE_CUDA_SCRIPT", dir.path().join("script"));
        std::env::set_var("GPUCR_FAKE_CUDA_LOG", dir.path().join("log"));
        Fake {
            dir,
            _serial: serial,
        }
    }

    pub fn driver(&self) -> Arc<dyn CheckpointApi> {
        Arc::new(CudaDriver::load().expect("fake libcuda loads"))
    }

    /// Mutating calls in order, as "op pid -> rc" lines.
    pub fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.starts_with("get_"))
            .map(str::to_string)
            .collect()
    }

    /// The fake driver's state of `pid` (what a real driver would report).
    pub fn state(&self, pid: u32) -> ProcessState {
        self.driver().get_state(pid).unwrap()
    }
}
