//! A private containerd daemon per test, torn down (with every shim and container it started)
//! on drop.
//!
//! The daemon binary is the node's `containerd` (1.7 on the test machines), or the one named by
//! `GPUCR_TEST_CONTAINERD` (tests/containerd2.sh unpacks containerd 2.x beside it), or a test's
//! own choice ([`StartOptions::daemon`]); the `ctr` next to it drives it, and the config matches
//! its major version (version 2 for 1.x, version 3 for 2.x). CRI is disabled unless a test asks
//! for it ([`StartOptions::cri`], 2.x only).

use std::ffi::{OsStr, OsString};
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

/// Plugins a test daemon does not need, in containerd 1.7 and 2.x alike.
const DISABLED_PLUGINS: &[&str] = &[
    "io.containerd.internal.v1.tracing",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.nri.v1.nri",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.blockfile",
];
/// containerd 1.7's CRI plugin: always disabled (it would want CNI and take seconds).
const CRI_PLUGINS_1: &[&str] = &["io.containerd.grpc.v1.cri"];
/// Only in containerd 2.x.
const DISABLED_PLUGINS_2: &[&str] = &["io.containerd.snapshotter.v1.erofs"];
/// containerd 2.x's CRI plugins, disabled unless a test asks for CRI.
const CRI_PLUGINS_2: &[&str] = &[
    "io.containerd.grpc.v1.cri",
    "io.containerd.cri.v1.images",
    "io.containerd.cri.v1.runtime",
];

/// Where tests/containerd2.sh unpacks containerd 2.x.
pub const CONTAINERD2_DEFAULT: &str = "/opt/gpucr-test/containerd2/usr/bin/containerd";

/// A containerd binary, the `ctr` that goes with it, and its version.
#[derive(Debug, Clone)]
pub struct Daemon {
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    /// What `containerd --version` says, e.g. `2.1.9+unknown`.
    pub version: String,
    pub major: u32,
}

impl Daemon {
    /// The daemon the tests run by default: `GPUCR_TEST_CONTAINERD`, else `containerd` in PATH.
    pub fn under_test() -> Result<Self> {
        match std::env::var_os("GPUCR_TEST_CONTAINERD").filter(|s| !s.is_empty()) {
            Some(path) => Self::at(Path::new(&path)),
            None => Self::at(Path::new("containerd")),
        }
    }

    /// containerd 2.x for the CRI tests: `GPUCR_TEST_CONTAINERD2`, else where
    /// tests/containerd2.sh puts it; an error saying how to get it when it is not there.
    pub fn containerd2() -> Result<Self> {
        let path = std::env::var_os("GPUCR_TEST_CONTAINERD2")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(CONTAINERD2_DEFAULT));
        if !path.is_file() {
            return Err(HarnessError::Unexpected(format!(
                "no containerd 2.x at {}: run tests/containerd2.sh (or set GPUCR_TEST_CONTAINERD2)",
                path.display()
            )));
        }
        let daemon = Self::at(&path)?;
        if daemon.major < 2 {
            return Err(HarnessError::Unexpected(format!(
                "{} is containerd {}, not 2.x",
                path.display(),
                daemon.version
            )));
        }
        Ok(daemon)
    }

    /// The daemon at `containerd` (a path, or a name looked up in PATH); its `ctr` is the one
    /// in the same directory when there is one.
    pub fn at(containerd: &Path) -> Result<Self> {
        let out = Cmd::new(containerd).arg("--version").run_ok()?;
        // "containerd github.com/containerd/containerd/v2 2.1.9+unknown" (1.7: "... v1.7.24 <rev>")
        let version = out
            .stdout
            .split_whitespace()
            .nth(2)
            .map(|v| v.trim_start_matches('v').to_owned())
            .ok_or_else(|| {
                HarnessError::Unexpected(format!("containerd --version: {}", out.stdout))
            })?;
        let major = version
            .split('.')
            .next()
            .and_then(|m| m.parse().ok())
            .ok_or_else(|| HarnessError::Unexpected(format!("containerd version {version}")))?;
        let sibling = containerd.parent().map(|d| d.join("ctr"));
        let ctr = match sibling {
            Some(ctr) if containerd.components().count() > 1 && ctr.is_file() => ctr,
            _ => PathBuf::from("ctr"),
        };
        Ok(Self {
            containerd: containerd.to_path_buf(),
            ctr,
            version,
            major,
        })
    }

    /// The directory of the daemon's own binaries (its runc shim), when it is not in PATH.
    fn bin_dir(&self) -> Option<PathBuf> {
        (self.containerd.components().count() > 1)
            .then(|| self.containerd.parent().map(Path::to_path_buf))
            .flatten()
    }
}

/// How [`Containerd::start_opts`] starts a daemon.
#[derive(Debug, Default)]
pub struct StartOptions {
    /// The daemon binary; [`Daemon::under_test`] when `None`.
    pub daemon: Option<Daemon>,
    /// Extra environment for the daemon, which its shims (and their runc, CRIU) inherit.
    pub env: Vec<(OsString, OsString)>,
    /// Enables CRI (containerd 2.x): TOML appended to the config, e.g. the CRI plugins'
    /// runtime and registry tables.
    pub cri: Option<String>,
    /// Files the config imports (containerd 2.x), e.g. the drop-in install/install.sh writes:
    /// `/etc/containerd/conf.d/*.toml`.
    pub imports: Vec<String>,
    /// A network namespace (`/run/netns/NAME`) the daemon, and so its shims and their
    /// containers' host network, run in: another node's network ([`crate::netns::NetNs`]).
    pub netns: Option<PathBuf>,
}

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
    daemon: Daemon,
    launch: Launch,
}

/// How the daemon was started, to start it again the same way (`Containerd::restart`).
struct Launch {
    config: PathBuf,
    path: std::ffi::OsString,
    tmp: PathBuf,
    env: Vec<(std::ffi::OsString, std::ffi::OsString)>,
    netns: Option<PathBuf>,
}

impl Containerd {
    /// Starts a daemon and waits until it answers. The shim directory goes first in its PATH.
    pub fn start() -> Result<Self> {
        Self::start_with_env::<&str, &str>(&[])
    }

    /// [`Containerd::start`] with extra environment for the daemon, which its shims (and the
    /// runc and CRIU they run) inherit.
    pub fn start_with_env<K: AsRef<OsStr>, V: AsRef<OsStr>>(env: &[(K, V)]) -> Result<Self> {
        Self::start_opts(StartOptions {
            env: env
                .iter()
                .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
                .collect(),
            ..StartOptions::default()
        })
    }

    /// Starts a daemon as `opts` say and waits until it answers.
    pub fn start_opts(opts: StartOptions) -> Result<Self> {
        static SEQUENCE: AtomicU32 = AtomicU32::new(0);
        let daemon = match opts.daemon {
            Some(d) => d,
            None => Daemon::under_test()?,
        };
        if opts.cri.is_some() && daemon.major < 2 {
            return Err(HarnessError::Unexpected(format!(
                "CRI tests need containerd 2.x, not {}",
                daemon.version
            )));
        }
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
        let config = match daemon.major {
            0 | 1 => config_toml_v2(&root, &address),
            _ => config_toml_v3(&root, &address, opts.cri.as_deref(), &opts.imports),
        };
        fs::write(&config_path, config)
            .map_err(HarnessError::io("write containerd config", &config_path))?;
        let path = std::env::var_os("PATH").unwrap_or_default();
        // gpucr's shim first, then the daemon's own binaries (2.x's runc shim), then PATH.
        let mut dirs: Vec<PathBuf> = shim_dir.iter().cloned().collect();
        dirs.extend(daemon.bin_dir());
        dirs.extend(std::env::split_paths(&path));
        let path = std::env::join_paths(dirs).expect("PATH entries have no ':'");
        // containerd unpacks checkpoints it restores into its temp dir (ctrd-checkpoint*):
        // one of the daemon's own, so a test can see what is left there.
        let tmp = root.join("tmp");
        fs::create_dir(&tmp).map_err(HarnessError::io("create containerd's TMPDIR", &tmp))?;
        let mut containerd = Self {
            dir: Some(dir),
            root,
            child: None,
            address,
            namespace,
            log_path,
            runtime,
            daemon,
            launch: Launch {
                config: config_path,
                path,
                tmp,
                env: opts.env,
                netns: opts.netns,
            },
        };
        containerd.child = Some(containerd.spawn_daemon()?);
        containerd.wait_ready()?;
        Ok(containerd)
    }

    fn spawn_daemon(&self) -> Result<Child> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(HarnessError::io("open containerd log", &self.log_path))?;
        let log_err = log
            .try_clone()
            .map_err(HarnessError::io("dup containerd log", &self.log_path))?;
        let l = &self.launch;
        let mut cmd = Command::new(&self.daemon.containerd);
        // Joined in the child before exec; the file stays open here until the spawn is done.
        let netns = match &l.netns {
            Some(ns) => Some(fs::File::open(ns).map_err(HarnessError::io("open netns", ns))?),
            None => None,
        };
        if let Some(f) = &netns {
            let fd = std::os::fd::AsRawFd::as_raw_fd(f);
            // SAFETY: the closure only calls setns, which is async-signal-safe.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        cmd.arg("--config")
            .arg(&l.config)
            .env("PATH", &l.path)
            .env("TMPDIR", &l.tmp)
            .env_remove("XDG_RUNTIME_DIR")
            // The shims' metrics and event log stay in the daemon's directory (a test's own
            // environment overrides them).
            .env("GPUCR_METRICS_TEXTFILE", self.metrics_textfile())
            .env("GPUCR_EVENT_LOG", self.event_log())
            .envs(l.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|source| HarnessError::Spawn {
                command: self.daemon.containerd.display().to_string(),
                source,
            })
    }

    /// The node-exporter textfile this daemon's shims write (`GPUCR_METRICS_TEXTFILE`).
    pub fn metrics_textfile(&self) -> PathBuf {
        self.root.join("metrics/gpucr.prom")
    }

    /// The event log this daemon's shims append to (`GPUCR_EVENT_LOG`).
    pub fn event_log(&self) -> PathBuf {
        self.root.join("events.jsonl")
    }

    /// Stops the daemon (SIGTERM: its shims and their containers live on) and starts it
    /// again with the same root, config and environment; it reconnects to the shims.
    pub fn restart(&mut self) -> Result<()> {
        self.stop_daemon();
        self.child = Some(self.spawn_daemon()?);
        self.wait_ready()
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

    /// The daemon binary this test runs, its version and its `ctr`.
    pub fn daemon(&self) -> &Daemon {
        &self.daemon
    }

    /// containerd's major version (1 or 2).
    pub fn major(&self) -> u32 {
        self.daemon.major
    }

    /// The runtime the tests pass to `ctr --runtime`.
    pub fn runtime(&self) -> &str {
        &self.runtime
    }

    /// The daemon's pid, while it runs.
    pub fn daemon_pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
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
        self.bundle_in(&self.namespace, id)
    }

    /// The bundle of container `id` of another namespace (CRI's `k8s.io`).
    pub fn bundle_in(&self, namespace: &str, id: &str) -> PathBuf {
        self.state_dir()
            .join("io.containerd.runtime.v2.task")
            .join(namespace)
            .join(id)
    }

    /// The socket of the shim serving container `id` (not in a pod): where containerd's
    /// shims listen, `/run/containerd/s/<sha256 of address/namespace/id>`.
    pub fn shim_socket(&self, id: &str) -> PathBuf {
        use sha2::{Digest, Sha256};
        let key = self.address.join(&self.namespace).join(id);
        let hash = Sha256::digest(key.to_string_lossy().as_bytes());
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        Path::new("/run/containerd/s").join(hex)
    }

    /// The last `lines` lines of containerd's log (shim logs go there too).
    pub fn log_tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(&self.log_path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// `ctr -a <address> -n <namespace>`, ready for arguments.
    pub fn ctr_cmd(&self) -> Cmd {
        Cmd::new(&self.daemon.ctr)
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

fn toml_list(items: &[&str]) -> String {
    items
        .iter()
        .map(|p| format!("{p:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn config_toml_v2(root: &Path, address: &Path) -> String {
    let disabled = toml_list(&[DISABLED_PLUGINS, CRI_PLUGINS_1].concat());
    format!("version = 2\n{}", config_common(root, address, &disabled))
}

/// containerd 2.x: config version 3; CRI's plugins disabled unless `cri` has their tables.
fn config_toml_v3(root: &Path, address: &Path, cri: Option<&str>, imports: &[String]) -> String {
    let mut disabled = [DISABLED_PLUGINS, DISABLED_PLUGINS_2].concat();
    if cri.is_none() {
        disabled.extend_from_slice(CRI_PLUGINS_2);
    }
    let common = config_common(root, address, &toml_list(&disabled));
    // Top-level keys come before the first table.
    let imports: Vec<&str> = imports.iter().map(String::as_str).collect();
    let imports = if imports.is_empty() {
        String::new()
    } else {
        format!("imports = [{}]\n", toml_list(&imports))
    };
    format!(
        "version = 3\n{imports}{common}\n{}\n",
        cri.unwrap_or_default()
    )
}

fn config_common(root: &Path, address: &Path, disabled: &str) -> String {
    format!(
        r#"root = "{root}"
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
