//! A Kubernetes node for the CRI tests, without kubelet: a private containerd 2.x with its
//! CRI plugin (the handlers the test names), a loopback registry holding busybox and the
//! pause image, and a [`CriClient`] making kubelet's calls; pods on the host's network with
//! cgroupfs parents, removed on drop. Also what the tests read back: a counter through
//! ExecSync, a container's pid, an archive's names, and checkpointctl.
//!
//! Needs containerd 2.x and checkpointctl where tests/containerd2.sh puts them
//! (`GPUCR_TEST_CONTAINERD2`, `GPUCR_CHECKPOINTCTL` to override).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cri::{self, CriClient, Handler};
use crate::registry::Registry;
use crate::{Cmd, Containerd, Daemon, StartOptions, COUNTER_FILE};

/// The checkpointctl that tests/containerd2.sh sets up.
const CHECKPOINTCTL_DEFAULT: &str = "/opt/gpucr-test/bin/checkpointctl";

/// A containerd 2.x with CRI, a registry with busybox and the pause image, a CRI client.
/// Fields drop in order after the pods are removed: the daemon goes before the registry and
/// the scratch directory (its CNI and hosts.toml directories) it watches.
pub struct CriNode {
    pub client: CriClient,
    pub ctd: Containerd,
    pub registry: Registry,
    /// busybox's reference in the registry.
    pub busybox: String,
    pods: Vec<String>,
    scratch: tempfile::TempDir,
}

impl CriNode {
    /// A node whose CRI has `handlers` (the first is the default).
    pub fn start(handlers: &[Handler]) -> Self {
        Self::start_with_env(handlers, Vec::new())
    }

    /// [`CriNode::start`] with more environment for containerd, which its shims (and their
    /// runc and CRIU) inherit.
    pub fn start_with_env(handlers: &[Handler], env: Vec<(OsString, OsString)>) -> Self {
        let daemon = Daemon::containerd2().unwrap_or_else(|e| panic!("{e}"));
        let registry = Registry::start().expect("registry");
        let (busybox, pause) = cri::push_test_images(&registry).expect("test images");
        let scratch = tempfile::Builder::new()
            .prefix("gpucr-cri-")
            .tempdir()
            .expect("scratch dir");
        let certs_d = scratch.path().join("certs.d");
        registry.write_hosts_toml(&certs_d).expect("hosts.toml");
        let config = cri::cri_config(scratch.path(), handlers, &pause, &certs_d);
        let ctd = Containerd::start_opts(StartOptions {
            daemon: Some(daemon),
            cri: Some(config),
            env,
            ..StartOptions::default()
        })
        .expect("containerd 2.x with CRI");
        let client =
            CriClient::connect_ready(ctd.address(), Duration::from_secs(30)).expect("CRI service");
        Self {
            client,
            ctd,
            registry,
            busybox,
            pods: Vec::new(),
            scratch,
        }
    }

    /// `name` under the node's scratch directory, created.
    pub fn dir(&self, name: &str) -> PathBuf {
        let dir = self.scratch.path().join(name);
        std::fs::create_dir_all(&dir).expect("create dir");
        dir
    }

    /// The cgroupfs parent of pod `name`'s pods (what [`CriNode::run_pod`] gives it).
    pub fn cgroup_parent(&self, name: &str) -> String {
        format!("/{}/pod{name}-{}", self.ctd.namespace(), std::process::id())
    }

    /// A pod of the `handler` runtime class; its config, sandbox id, and how long
    /// RunPodSandbox took.
    pub fn run_pod(
        &mut self,
        name: &str,
        handler: &str,
    ) -> (cri::api::PodSandboxConfig, String, Duration) {
        let uid = format!("{name}-{}", std::process::id());
        let logs = self.dir(&format!("pods/default_{name}_{uid}"));
        let pod = cri::pod_config(name, &uid, &logs, &self.cgroup_parent(name));
        let started = Instant::now();
        let sandbox = self
            .client
            .run_pod_sandbox(&pod, handler)
            .unwrap_or_else(|e| panic!("RunPodSandbox {name} ({handler}): {e}"));
        let took = started.elapsed();
        self.pods.push(sandbox.clone());
        (pod, sandbox, took)
    }

    /// CreateContainer + StartContainer of `config` in `sandbox`; the container id.
    pub fn create_and_start(
        &mut self,
        sandbox: &str,
        config: &cri::api::ContainerConfig,
        pod: &cri::api::PodSandboxConfig,
    ) -> String {
        let image = config.image.as_ref().map_or("", |i| i.image.as_str());
        let id = self
            .client
            .create_container(sandbox, config, pod)
            .unwrap_or_else(|e| panic!("CreateContainer from {image}: {e}"));
        self.client
            .start_container(&id)
            .unwrap_or_else(|e| panic!("StartContainer of {id} (from {image}): {e}"));
        id
    }

    /// What kubelet's checkpoint API does: CheckpointContainer of `id` to kubelet's archive
    /// path for container `container` of pod `pod_name` (under the node's
    /// `var/lib/kubelet/checkpoints`). Returns the archive, which must exist, and how long
    /// the call took.
    pub fn checkpoint_to_kubelet_archive(
        &mut self,
        id: &str,
        pod_name: &str,
        container: &str,
    ) -> (PathBuf, Duration) {
        let checkpoints = self.dir("var/lib/kubelet/checkpoints");
        let archive = cri::kubelet_checkpoint_path(&checkpoints, pod_name, "default", container);
        let started = Instant::now();
        self.client
            .checkpoint_container(id, &archive, 0)
            .unwrap_or_else(|e| panic!("CheckpointContainer of {id}: {e}"));
        let took = started.elapsed();
        assert!(archive.is_file(), "no archive at {}", archive.display());
        (archive, took)
    }

    /// The checkpoint OCI image of `archive` (see [`cri::push_checkpoint_image`]) pushed as
    /// `<repository>:<tag>` to the node's registry; its reference.
    pub fn push_checkpoint_image(
        &self,
        archive: &Path,
        container: &str,
        repository: &str,
        tag: &str,
    ) -> String {
        let bytes = std::fs::read(archive).expect("read the archive");
        cri::push_checkpoint_image(&self.registry, bytes, container, repository, tag)
            .expect("checkpoint image")
    }

    /// What kubelet does to restore: a new pod `pod_name` of `handler` whose container
    /// `container` has the image `from` — a checkpoint archive's path, or a checkpoint OCI
    /// image, which is pulled first. Returns the container id and how long the pull, the
    /// CreateContainer and the StartContainer took.
    pub fn restore_in_new_pod(
        &mut self,
        pod_name: &str,
        handler: &str,
        container: &str,
        from: &str,
    ) -> (String, Duration) {
        let (pod, sandbox, _) = self.run_pod(pod_name, handler);
        let started = Instant::now();
        if !Path::new(from).is_file() {
            self.client
                .pull_image(from, &pod)
                .unwrap_or_else(|e| panic!("PullImage {from} ({handler}): {e}"));
        }
        let config = cri::container_config(container, from, &[], &pod);
        let id = self.create_and_start(&sandbox, &config, &pod);
        (id, started.elapsed())
    }

    /// The counter ([`COUNTER_FILE`]) of container `id`, read through ExecSync.
    pub fn read_counter(&mut self, id: &str) -> u64 {
        let out = self
            .client
            .exec_sync(id, &["cat", COUNTER_FILE])
            .unwrap_or_else(|e| panic!("reading the counter of {id}: {e}"));
        out.trim()
            .parse()
            .unwrap_or_else(|_| panic!("counter of {id}: {out:?}"))
    }

    /// Waits (30 s at most) until the counter of `id` is above `value`; returns it.
    pub fn wait_counter_above(&mut self, id: &str, value: u64) -> u64 {
        let started = Instant::now();
        loop {
            let got = self.read_counter(id);
            if got > value {
                return got;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "counter of {id} stays at {got}, not above {value}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A restored counter starts where the dump caught it (between the values read just
    /// before and just after the checkpoint: a restarted one would start from 1) and keeps
    /// counting. `what` says which restore it is.
    pub fn assert_counter_continues(&mut self, id: &str, before: u64, after: u64, what: &str) {
        let first = self.read_counter(id);
        assert!(
            first >= before && first <= after + 25,
            "{what}: the counter reads {first}; it was {before}..{after} at the checkpoint"
        );
        self.wait_counter_above(id, first);
    }

    /// The container's init pid (ContainerStatus's verbose info).
    pub fn pid(&mut self, id: &str) -> u32 {
        self.client.container_pid(id).expect("the container's pid")
    }
}

impl Drop for CriNode {
    fn drop(&mut self) {
        for pod in std::mem::take(&mut self.pods) {
            if let Err(e) = self.client.remove_pod(&pod) {
                eprintln!("removing pod {pod}: {e}");
            }
        }
    }
}

/// The names in an archive (a plain tar, as CRI writes it), without a leading `./`.
pub fn archive_names(path: &Path) -> Vec<String> {
    cri::archive_names(path).unwrap_or_else(|e| panic!("{e}"))
}

/// checkpointctl: `GPUCR_CHECKPOINTCTL`, else where tests/containerd2.sh puts it.
pub fn checkpointctl() -> PathBuf {
    std::env::var_os("GPUCR_CHECKPOINTCTL")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(CHECKPOINTCTL_DEFAULT))
}

/// `checkpointctl inspect --all` reads `archive`, CRIU's dump statistics included.
///
/// checkpointctl before 1.4 (Debian's 1.3) fails `--all` on a checkpoint holding a zombie,
/// looking for its memory images, which CRIU does not write (checkpoint-restore/checkpointctl
/// #184): the counter's `sleep` that exited just before the freeze. Then everything that
/// reads no process memory is inspected instead.
/// checkpointctl's flags for an archive: everything (`--all`), or for one by reference (its
/// CRIU pages are in the gpucr store, not in the archive) everything but what it reads from
/// process memory (`--ps-tree-cmd`, `--ps-tree-env`).
pub fn checkpointctl_flags(archive: &Path) -> &'static [&'static str] {
    let by_reference = archive_names(archive)
        .iter()
        .any(|n| n.ends_with("gpucr-store.json"));
    if by_reference {
        &[
            "--stats",
            "--ps-tree",
            "--files",
            "--sockets",
            "--mounts",
            "--metadata",
        ]
    } else {
        &["--all"]
    }
}

pub fn assert_checkpointctl_inspects(archive: &Path) {
    let run = |args: &[&str]| {
        Cmd::new(checkpointctl())
            .arg("inspect")
            .args(args)
            .arg(archive)
            .output()
            .unwrap_or_else(|e| panic!("checkpointctl inspect {args:?}: {e}"))
    };
    let mut out = run(checkpointctl_flags(archive));
    if !out.success() && out.stderr.contains("pagemap-") && out.stderr.contains("no such file") {
        eprintln!(
            "checkpointctl inspect --all: {} (a zombie in the checkpoint, checkpointctl#184); \
             inspecting without process memory",
            out.stderr.trim()
        );
        out = run(&["--stats", "--ps-tree", "--mounts", "--metadata"]);
    }
    assert!(
        out.success() && out.stdout.contains("CRIU dump statistics"),
        "checkpointctl inspect {} shows no dump statistics:\n{}{}",
        archive.display(),
        out.stdout,
        out.stderr
    );
}
