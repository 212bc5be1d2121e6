//! A private containerd daemon per test, torn down (with every shim and container it started)
//! on drop.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::command::{Cmd, Output};
use crate::error::{HarnessError, Result};
use crate::image::BusyboxImage;
use crate::poll::poll_until;
use crate::procfs;

/// The runtime the stock containerd package ships; tests are validated against it.
pub const RUNC_RUNTIME: &str = "io.containerd.runc.v2";
/// gpucr's runtime name.
pub const GPUCR_RUNTIME: &str = "io.containerd.gpucr.v2";
/// The shim binary containerd looks for (in PATH) for [`GPUCR_RUNTIME`].
pub const GPUCR_SHIM_BINARY: &str = "containerd-shim-gpucr-v2";

/// Plugins a test daemon does not need; CRI in particular would want CNI and take seconds.
const DISABLED_PLUGINS: &[&str] = &[
    "io.containerd.grpc.v1.cri",
    "io.containerd.internal.v1.tracing",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.nri.v1.nri",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.blockfile",
];

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(15);

/// The runtime under test: `GPUCR_TEST_RUNTIME`, default `io.containerd.gpucr.v2`.
pub fn runtime_under_test() -> String {
    std::env::var("GPUCR_TEST_RUNTIME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| GPUCR_RUNTIME.to_owned())
}

/// The directory holding `containerd-shim-gpucr-v2`: `GPUCR_SHIM_DIR`, else where
/// install.sh installs it (`/usr/local/bin`).
pub fn shim_dir() -> Result<PathBuf> {
    let dir = std::env::var_os("GPUCR_SHIM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(crate::installed::SHIM_DIR));
    if !dir.join(GPUCR_SHIM_BINARY).is_file() {
        return Err(HarnessError::ShimNotFound(format!(
            "{} has no {GPUCR_SHIM_BINARY}: the tests run the installed layout, run \
             install/install.sh first (or set GPUCR_SHIM_DIR)",
            dir.display()
        )));
    }
    Ok(dir)
}

/// A running containerd with its own root, state, sockets, log and namespace.
pub struct Containerd {
    dir: Option<tempfile::TempDir>,
    root: PathBuf,
    child: Option<Child>,
    address: PathBuf,
    namespace: String,
    log_path: PathBuf,
    runtime: String,
}

impl Containerd {
    /// Starts a daemon and waits until it answers. The shim directory goes first in its PATH.
    pub fn start() -> Result<Self> {
        Self::start_with_env::<&str, &str>(&[])
    }

    /// [`Containerd::start`] with extra environment for the daemon, which its shims (and the
    /// runc and CRIU they run) inherit.
    pub fn start_with_env<K: AsRef<OsStr>, V: AsRef<OsStr>>(env: &[(K, V)]) -> Result<Self> {
        static SEQUENCE: AtomicU32 = AtomicU32::new(0);
        let runtime = runtime_under_test();
        let shim_dir = match shim_dir() {
            Ok(dir) => Some(dir),
            Err(e) if runtime == GPUCR_RUNTIME => return Err(e),
            Err(_) => None,
        };
        let dir = tempfile::Builder::new()
            .prefix("gpucr-ctd-")
            .tempdir()
            .map_err(HarnessError::io("create temp dir", std::env::temp_dir()))?;
        let root = dir.path().to_path_buf();
        let address = root.join("containerd.sock");
        let log_path = root.join("containerd.log");
        let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let namespace = format!("gpucr-{}-{sequence}", std::process::id());

        let config_path = root.join("config.toml");
        fs::write(&config_path, config_toml(&root, &address))
            .map_err(HarnessError::io("write containerd config", &config_path))?;
        let log = fs::File::create(&log_path)
            .map_err(HarnessError::io("create containerd log", &log_path))?;
        let log_err = log
            .try_clone()
            .map_err(HarnessError::io("dup containerd log", &log_path))?;

        let path = std::env::var_os("PATH").unwrap_or_default();
        let path = match &shim_dir {
            Some(shim_dir) => {
                let mut dirs = vec![shim_dir.clone()];
                dirs.extend(std::env::split_paths(&path));
                std::env::join_paths(dirs).expect("PATH entries have no ':'")
            }
            None => path,
        };
        // containerd unpacks checkpoints it restores into its temp dir (ctrd-checkpoint*):
        // one of the daemon's own, so a test can see what is left there.
        let tmp = root.join("tmp");
        fs::create_dir(&tmp).map_err(HarnessError::io("create containerd's TMPDIR", &tmp))?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config_path)
            .env("PATH", path)
            .env("TMPDIR", &tmp)
            .env_remove("XDG_RUNTIME_DIR")
            .envs(env.iter().map(|(k, v)| (k.as_ref(), v.as_ref())))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|source| HarnessError::Spawn {
                command: "containerd".into(),
                source,
            })?;
        let containerd = Self {
            dir: Some(dir),
            root,
            child: Some(child),
            address,
            namespace,
            log_path,
            runtime,
        };
        containerd.wait_ready()?;
        Ok(containerd)
    }

    fn wait_ready(&self) -> Result<()> {
        let started = Instant::now();
        while started.elapsed() < READY_TIMEOUT {
            if self.address.exists() {
                let out = self
                    .ctr_cmd()
                    .arg("version")
                    .timeout(Duration::from_secs(5))
                    .output();
                if matches!(out, Ok(ref o) if o.success()) {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(HarnessError::ContainerdNotReady {
            address: self.address.clone(),
            timeout: READY_TIMEOUT,
            log_tail: self.log_tail(40),
        })
    }

    /// The daemon's gRPC socket.
    pub fn address(&self) -> &Path {
        &self.address
    }

    /// The containerd namespace this daemon's tests use (unique per daemon).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The runtime the tests pass to `ctr --runtime`.
    pub fn runtime(&self) -> &str {
        &self.runtime
    }

    /// The daemon's private directory (config, log, root, state); a place for test files too.
    pub fn dir(&self) -> &Path {
        &self.root
    }

    /// containerd's TMPDIR, where it unpacks a checkpoint it restores from the content store.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// What containerd unpacked for restores and is still there (`ctrd-checkpoint*`).
    pub fn unpacked_checkpoints(&self) -> Vec<PathBuf> {
        let Ok(entries) = fs::read_dir(self.tmp_dir()) else {
            return Vec::new();
        };
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("ctrd-checkpoint")
            })
            .map(|e| e.path())
            .collect();
        found.sort();
        found
    }

    /// Waits until nothing containerd unpacked for a restore is left in its TMPDIR: gpucr
    /// removes it once the restore is done with it, refused or not (containerd leaves it,
    /// and so does the stock runc shim: a no-op for other runtimes).
    pub fn wait_unpacked_removed(&self) -> Result<()> {
        if self.runtime != GPUCR_RUNTIME {
            return Ok(());
        }
        poll_until(
            "containerd's unpacked checkpoints removed",
            Duration::from_secs(10),
            || {
                let left = self.unpacked_checkpoints();
                Ok(if left.is_empty() { Ok(()) } else { Err(left) })
            },
        )
    }

    /// containerd's state directory.
    pub fn state_dir(&self) -> PathBuf {
        self.root.join("state")
    }

    /// The bundle directory containerd creates for a task (the shim's working directory).
    pub fn bundle(&self, id: &str) -> PathBuf {
        self.state_dir()
            .join("io.containerd.runtime.v2.task")
            .join(&self.namespace)
            .join(id)
    }

    /// The last `lines` lines of containerd's log (shim logs go there too).
    pub fn log_tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(&self.log_path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// `ctr -a <address> -n <namespace>`, ready for arguments.
    pub fn ctr_cmd(&self) -> Cmd {
        Cmd::new("ctr")
            .arg("-a")
            .arg(&self.address)
            .arg("-n")
            .arg(&self.namespace)
    }

    /// Runs `ctr <args>` and returns what it printed, whatever its status.
    pub fn ctr(&self, args: &[&str]) -> Result<Output> {
        self.ctr_cmd().args(args).output()
    }

    /// Runs `ctr <args>` and fails unless it exits with 0.
    pub fn ctr_ok(&self, args: &[&str]) -> Result<Output> {
        self.ctr_cmd().args(args).run_ok()
    }

    /// Imports the busybox image and returns its name.
    pub fn import_busybox(&self) -> Result<String> {
        let image = BusyboxImage::get()?;
        self.import_layout(&image.layout_tar()?, &[])?;
        Ok(image.reference.clone())
    }

    /// Writes an OCI layout tarball to the daemon's directory and runs `ctr image import`.
    pub fn import_layout(&self, tar: &[u8], extra_args: &[&str]) -> Result<Output> {
        static SEQUENCE: AtomicU32 = AtomicU32::new(0);
        let path = self.root.join(format!(
            "import-{}.tar",
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        ));
        fs::write(&path, tar).map_err(HarnessError::io("write image tarball", &path))?;
        let path_arg = path.to_string_lossy().into_owned();
        let mut args = vec!["image", "import"];
        args.extend_from_slice(extra_args);
        args.push(&path_arg);
        let out = self.ctr_ok(&args);
        let _ = fs::remove_file(&path);
        out
    }

    /// Best-effort removal of every task and container of this daemon's namespace.
    fn remove_all(&self) {
        let quick = |args: &[&str]| {
            self.ctr_cmd()
                .args(args)
                .timeout(CLEANUP_TIMEOUT)
                .output()
                .ok()
        };
        if let Some(out) = quick(&["task", "ls", "-q"]) {
            for id in out.stdout.split_whitespace() {
                quick(&["task", "kill", "-a", "-s", "SIGKILL", id]);
            }
            for id in out.stdout.split_whitespace() {
                let _ = poll_until("task stop", Duration::from_secs(5), || {
                    let out = self.ctr(&["task", "rm", "-f", id])?;
                    Ok(if out.success() || out.stderr.contains("not found") {
                        Ok(())
                    } else {
                        Err(out.stderr)
                    })
                });
            }
        }
        if let Some(out) = quick(&["container", "ls", "-q"]) {
            for id in out.stdout.split_whitespace() {
                quick(&["container", "rm", id]);
            }
        }
    }

    fn stop_daemon(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "==== containerd log tail ({}), namespace {} ====\n{}\n==== end of containerd log ====",
                self.log_path.display(),
                self.namespace,
                self.log_tail(150)
            );
        }
        self.remove_all();
        self.stop_daemon();
        let address = self.address.to_string_lossy().into_owned();
        procfs::kill_shims_of(&address);
        procfs::kill_cgroup_members(&self.namespace);
        procfs::unmount_under(&self.root);
        let _ = fs::remove_dir_all(Path::new("/run/containerd/runc").join(&self.namespace));
        if std::env::var_os("GPUCR_TEST_KEEP").is_some() {
            if let Some(dir) = self.dir.take() {
                eprintln!("keeping {}", dir.keep().display());
            }
        }
    }
}

fn config_toml(root: &Path, address: &Path) -> String {
    let disabled = DISABLED_PLUGINS
        .iter()
        .map(|p| format!("{p:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = [{disabled}]

[grpc]
  address = "{address}"

[ttrpc]
  address = "{address}.ttrpc"

[debug]
  level = "debug"

[metrics]
  address = ""
"#,
        root = root.join("root").display(),
        state = root.join("state").display(),
        address = address.display(),
    )
}
