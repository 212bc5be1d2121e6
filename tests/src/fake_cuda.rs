//! tests/fake-libcuda as the shim's (and CRIU plugin's) libcuda: located or built like the
//! shim, installed as `libcuda.so.1` in a temp dir, scripted and read back.
//!
//! The fake rereads its script on every call, so a test can declare a container's pids as
//! CUDA processes after the container started. Start containerd with [`FakeCuda::env`]:
//! shims, runc, CRIU and its plugins inherit it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::containerd::shim_dir;
use crate::error::{HarnessError, Result};

/// The fake's file name as cargo builds it.
pub const FAKE_LIBCUDA: &str = "libcuda.so";
/// gpucr's CRIU plugin as cargo builds it.
pub const CRIU_PLUGIN: &str = "libgpucr_criu_plugin.so";

/// Driver states as the fake stores them.
pub const RUNNING: u8 = 0;
pub const LOCKED: u8 = 1;
pub const CHECKPOINTED: u8 = 2;

/// The driver calls on one CUDA process around a leave-running checkpoint, as
/// [`FakeCuda::calls_of`] lists them.
pub const FULL_CYCLE: [&str; 4] = [
    "lock -> 0",
    "checkpoint -> 0",
    "restore -> 0",
    "unlock -> 0",
];

/// `<target>/<profile>` of this test binary (`<target>/<profile>/deps/<test>`).
fn test_profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.to_path_buf())
}

/// Finds `file` next to the shim (GPUCR_SHIM_DIR or the workspace target dir), else next to
/// this test binary, else builds `package` into this test binary's target dir.
pub fn built_artifact(file: &str, package: &str) -> Result<PathBuf> {
    let mut dirs: Vec<PathBuf> = shim_dir().into_iter().collect();
    dirs.extend(test_profile_dir());
    if let Some(found) = dirs.iter().map(|d| d.join(file)).find(|p| p.is_file()) {
        return Ok(found);
    }
    let profile = test_profile_dir()
        .ok_or_else(|| HarnessError::Unexpected("no test binary directory".into()))?;
    let target = profile
        .parent()
        .ok_or_else(|| HarnessError::Unexpected("no target directory".into()))?;
    let mut cmd = std::process::Command::new(env!("CARGO"));
    cmd.args(["build", "-p", package])
        .env("CARGO_TARGET_DIR", target)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if profile.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let status = cmd.status().map_err(|source| HarnessError::Spawn {
        command: format!("cargo build -p {package}"),
        source,
    })?;
    let built = profile.join(file);
    if !status.success() || !built.is_file() {
        return Err(HarnessError::Unexpected(format!(
            "building {package} did not produce {}",
            built.display()
        )));
    }
    Ok(built)
}

/// The hook's preload library as cargo builds it (package `gpucr-hook-preload`).
pub const HOOK_LIB: &str = "libgpucr_hook.so";

/// The hook's preload library where install.sh installs it (the shim's default).
pub fn hook_lib() -> Result<PathBuf> {
    crate::installed::file(crate::installed::HOOK_LIB)
}

/// gpucr's CRIU plugin where install.sh installs it (CRIU's plugin directory).
pub fn criu_plugin() -> Result<PathBuf> {
    crate::installed::file(crate::installed::CRIU_PLUGIN)
}

/// One scripted fake driver: `libcuda.so.1`, its script and its logs in a temp dir.
pub struct FakeCuda {
    dir: tempfile::TempDir,
}

impl FakeCuda {
    /// A fake with an empty script (no CUDA processes).
    pub fn new() -> Result<FakeCuda> {
        let lib = built_artifact(FAKE_LIBCUDA, "fake-libcuda")?;
        let dir = tempfile::Builder::new()
            .prefix("gpucr-fakecuda-")
            .tempdir()
            .map_err(HarnessError::io("create temp dir", std::env::temp_dir()))?;
        let installed = dir.path().join("libcuda.so.1");
        std::fs::copy(&lib, &installed).map_err(HarnessError::io("copy fake libcuda", &lib))?;
        let fake = FakeCuda { dir };
        fake.set_script("")?;
        Ok(fake)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn lib(&self) -> PathBuf {
        self.dir().join("libcuda.so.1")
    }

    fn script_path(&self) -> PathBuf {
        self.dir().join("script")
    }

    fn log_path(&self) -> PathBuf {
        self.dir().join("log")
    }

    /// Environment that makes the shim (and CRIU's plugin) use this fake for every process
    /// of a container.
    pub fn env(&self) -> Vec<(String, String)> {
        let s = |p: PathBuf| p.to_string_lossy().into_owned();
        vec![
            ("GPUCR_LIBCUDA".into(), s(self.lib())),
            ("GPUCR_FAKE_CUDA_SCRIPT".into(), s(self.script_path())),
            ("GPUCR_FAKE_CUDA_LOG".into(), s(self.log_path())),
            ("GPUCR_GPU_ALL_PROCESSES".into(), "1".into()),
        ]
    }

    /// Replaces the script (read by the fake on every call).
    pub fn set_script(&self, script: &str) -> Result<()> {
        let path = self.script_path();
        let tmp = self.dir().join("script.tmp");
        std::fs::write(&tmp, script).map_err(HarnessError::io("write fake script", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(HarnessError::io("install fake script", &path))
    }

    /// Every call so far, as `<op> <pid> -> <rc>` lines.
    pub fn log(&self) -> Vec<String> {
        std::fs::read_to_string(self.log_path())
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The state-changing calls (lock, checkpoint, restore, unlock) so far.
    pub fn calls(&self) -> Vec<String> {
        self.log()
            .into_iter()
            .filter(|l| !l.starts_with("get_"))
            .collect()
    }

    /// The state-changing calls on `pid`, as `<op> -> <rc>`.
    pub fn calls_of(&self, pid: u32) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                let op = w.next()?;
                (w.next()? == pid.to_string())
                    .then(|| format!("{op} {}", w.collect::<Vec<_>>().join(" ")))
            })
            .collect()
    }

    /// Pids that got at least one state-changing call.
    pub fn called_pids(&self) -> Vec<u32> {
        self.called_pids_after(0)
    }

    /// Pids that got a state-changing call after the first `skip` calls.
    pub fn called_pids_after(&self, skip: usize) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .calls()
            .iter()
            .skip(skip)
            .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Calls with their start and end (Unix ms): `(start, end, "<op> <pid> -> <rc>")`.
    pub fn timed_calls(&self) -> Vec<(u64, u64, String)> {
        std::fs::read_to_string(self.dir().join("log.times"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut w = l.splitn(3, ' ');
                let start = w.next()?.parse().ok()?;
                let end = w.next()?.parse().ok()?;
                Some((start, end, w.next()?.to_owned()))
            })
            .filter(|(_, _, l)| !l.starts_with("get_"))
            .collect()
    }

    /// The fake driver's state of every pid that changed state (see [`RUNNING`] etc.).
    pub fn states(&self) -> BTreeMap<u32, u8> {
        std::fs::read_to_string(self.dir().join("log.state"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                match w.as_slice() {
                    ["state", pid, st] => Some((pid.parse().ok()?, st.parse().ok()?)),
                    _ => None,
                }
            })
            .collect()
    }
}
