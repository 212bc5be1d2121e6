//! Kubernetes for real (issue #21): kubelet's CRI calls to containerd 2.x with its CRI plugin,
//! for the `runc` and `gpucr` runtime handlers side by side — RunPodSandbox, PullImage (from a
//! loopback registry), CreateContainer, StartContainer, CheckpointContainer to a kubelet-style
//! archive, then a restore into a new pod from the archive path and from a checkpoint OCI
//! image built from it; the counter continues. gpucr's archives carry CRIU's `dump.log` and
//! `stats-dump`, and checkpointctl reads them. The handler's options (BinaryName,
//! SystemdCgroup) reach the shim.
//!
//! Needs containerd 2.x and checkpointctl where tests/containerd2.sh puts them
//! (`GPUCR_TEST_CONTAINERD2`, `GPUCR_CHECKPOINTCTL` to override). `GPUCR_CRI_ROUNDS` (default
//! 1) repeats the flow per runtime, interleaved, and prints the medians (docs/BENCHMARKS.md).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpucr_tests::cri::{self, CriClient, Handler};
use gpucr_tests::registry::Registry;
use gpucr_tests::{counter_args, poll_until, Cmd, Containerd, Daemon, StartOptions, COUNTER_FILE};

/// The checkpointctl that tests/containerd2.sh sets up.
const CHECKPOINTCTL_DEFAULT: &str = "/opt/gpucr-test/bin/checkpointctl";

/// A containerd 2.x with CRI, a registry with busybox and the pause image, a CRI client.
/// Fields drop in order after the pods are removed: the daemon goes before the registry and
/// the scratch directory (its CNI and hosts.toml directories) it watches.
struct CriNode {
    client: CriClient,
    ctd: Containerd,
    registry: Registry,
    busybox: String,
    pods: Vec<String>,
    scratch: tempfile::TempDir,
}

impl CriNode {
    fn start(handlers: &[Handler]) -> Self {
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
            ..StartOptions::default()
        })
        .expect("containerd 2.x with CRI");
        let mut client = None;
        poll_until("CRI answers Version", Duration::from_secs(30), || {
            Ok(
                match CriClient::connect(ctd.address()).and_then(|mut c| {
                    c.version()?;
                    Ok(c)
                }) {
                    Ok(c) => {
                        client = Some(c);
                        Ok(())
                    }
                    Err(e) => Err(e.to_string()),
                },
            )
        })
        .expect("CRI service");
        Self {
            client: client.unwrap(),
            ctd,
            registry,
            busybox,
            pods: Vec::new(),
            scratch,
        }
    }

    fn dir(&self, name: &str) -> PathBuf {
        let dir = self.scratch.path().join(name);
        std::fs::create_dir_all(&dir).expect("create dir");
        dir
    }

    /// A pod of the `handler` runtime class; its config and sandbox id.
    fn run_pod(
        &mut self,
        name: &str,
        handler: &str,
    ) -> (cri::api::PodSandboxConfig, String, Duration) {
        let uid = format!("{name}-{}", std::process::id());
        let logs = self.dir(&format!("pods/default_{name}_{uid}"));
        let cgroup_parent = format!("/{}/pod{uid}", self.ctd.namespace());
        let pod = cri::pod_config(name, &uid, &logs, &cgroup_parent);
        let started = Instant::now();
        let sandbox = self
            .client
            .run_pod_sandbox(&pod, handler)
            .unwrap_or_else(|e| panic!("RunPodSandbox {name} ({handler}): {e}"));
        let took = started.elapsed();
        self.pods.push(sandbox.clone());
        (pod, sandbox, took)
    }

    fn read_counter(&mut self, id: &str) -> u64 {
        let out = self
            .client
            .exec_sync(id, &["cat", COUNTER_FILE])
            .unwrap_or_else(|e| panic!("reading the counter of {id}: {e}"));
        out.trim()
            .parse()
            .unwrap_or_else(|_| panic!("counter of {id}: {out:?}"))
    }

    fn wait_counter_above(&mut self, id: &str, value: u64) -> u64 {
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

    /// The container's init pid (ContainerStatus's verbose info).
    fn pid(&mut self, id: &str) -> u32 {
        let status = self.client.container_status(id).expect("ContainerStatus");
        let info: serde_json::Value =
            serde_json::from_str(status.info.get("info").expect("verbose info"))
                .expect("info JSON");
        info["pid"].as_u64().expect("pid in info") as u32
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

/// Times of one round of the flow, for one handler.
#[derive(Debug, Default, Clone)]
struct Times {
    run_pod: Duration,
    create_start: Duration,
    checkpoint: Duration,
    restore_archive: Duration,
    restore_image: Duration,
}

/// The whole kubelet flow for `handler`; returns the times and the archive.
fn kubelet_flow(node: &mut CriNode, handler: &str, round: usize) -> (Times, PathBuf) {
    let mut times = Times::default();
    let pod_name = format!("counter-{handler}-{round}");
    let (pod, sandbox, took) = node.run_pod(&pod_name, handler);
    times.run_pod = took;
    let busybox = node.busybox.clone();
    node.client
        .pull_image(&busybox, &pod)
        .unwrap_or_else(|e| panic!("PullImage ({handler}): {e}"));
    let config = cri::container_config("counter", &busybox, &counter_args(), &pod);
    let started = Instant::now();
    let id = node
        .client
        .create_container(&sandbox, &config, &pod)
        .unwrap_or_else(|e| panic!("CreateContainer ({handler}): {e}"));
    node.client
        .start_container(&id)
        .unwrap_or_else(|e| panic!("StartContainer ({handler}): {e}"));
    times.create_start = started.elapsed();
    node.wait_counter_above(&id, 5);

    let checkpoints = node.dir("var/lib/kubelet/checkpoints");
    let archive = cri::kubelet_checkpoint_path(&checkpoints, &pod_name, "default", "counter");
    let before = node.read_counter(&id);
    let started = Instant::now();
    node.client
        .checkpoint_container(&id, &archive, 0)
        .unwrap_or_else(|e| panic!("CheckpointContainer ({handler}): {e}"));
    times.checkpoint = started.elapsed();
    let after = node.read_counter(&id);
    assert!(archive.is_file(), "no archive at {}", archive.display());

    // (a) From the archive path, into a new pod of the same runtime class.
    let (pod_a, sandbox_a, _) = node.run_pod(&format!("{pod_name}-from-archive"), handler);
    let config_a = cri::container_config("counter", &archive.to_string_lossy(), &[], &pod_a);
    let started = Instant::now();
    let restored = node
        .client
        .create_container(&sandbox_a, &config_a, &pod_a)
        .unwrap_or_else(|e| {
            panic!(
                "CreateContainer from {} ({handler}): {e}",
                archive.display()
            )
        });
    node.client
        .start_container(&restored)
        .unwrap_or_else(|e| panic!("StartContainer (restore from the archive, {handler}): {e}"));
    times.restore_archive = started.elapsed();
    assert_continues(node, &restored, before, after, handler, "the archive");

    // (b) From a checkpoint OCI image built from the archive, pulled like any image.
    let bytes = std::fs::read(&archive).expect("read the archive");
    let image = cri::push_checkpoint_image(
        &node.registry,
        &bytes,
        "counter",
        &format!("gpucr/checkpoint-{handler}"),
        &round.to_string(),
    )
    .expect("checkpoint image");
    let (pod_b, sandbox_b, _) = node.run_pod(&format!("{pod_name}-from-image"), handler);
    let started = Instant::now();
    node.client
        .pull_image(&image, &pod_b)
        .unwrap_or_else(|e| panic!("PullImage {image} ({handler}): {e}"));
    let config_b = cri::container_config("counter", &image, &[], &pod_b);
    let restored = node
        .client
        .create_container(&sandbox_b, &config_b, &pod_b)
        .unwrap_or_else(|e| panic!("CreateContainer from {image} ({handler}): {e}"));
    node.client
        .start_container(&restored)
        .unwrap_or_else(|e| panic!("StartContainer (restore from {image}, {handler}): {e}"));
    times.restore_image = started.elapsed();
    assert_continues(node, &restored, before, after, handler, &image);
    (times, archive)
}

/// A restored counter starts where the dump caught it (between the values read just before
/// and just after the checkpoint: a restarted one would start from 1) and keeps counting.
fn assert_continues(
    node: &mut CriNode,
    id: &str,
    before: u64,
    after: u64,
    handler: &str,
    from: &str,
) {
    let first = node.read_counter(id);
    assert!(
        first >= before && first <= after + 25,
        "{handler}: restored from {from}, the counter reads {first}; it was {before}..{after} \
         at the checkpoint"
    );
    node.wait_counter_above(id, first);
}

/// The names in an archive (a plain tar, as CRI writes it).
fn archive_names(path: &Path) -> Vec<String> {
    let mut names = Vec::new();
    let file = std::fs::File::open(path).expect("open archive");
    let mut tar = tar::Archive::new(file);
    for entry in tar.entries().expect("archive entries") {
        let mut entry = entry.expect("archive entry");
        let name = entry
            .path()
            .expect("entry path")
            .to_string_lossy()
            .into_owned();
        let mut sink = Vec::new();
        let _ = entry.read_to_end(&mut sink);
        names.push(name.trim_start_matches("./").to_owned());
    }
    names
}

fn checkpointctl() -> PathBuf {
    std::env::var_os("GPUCR_CHECKPOINTCTL")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(CHECKPOINTCTL_DEFAULT))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn kubelet_checkpoint_and_restore_runc_and_gpucr_side_by_side() {
    let handlers = [Handler::runc(), Handler::gpucr()];
    let mut node = CriNode::start(&handlers);
    let rounds: usize = std::env::var("GPUCR_CRI_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1);
    let mut all: Vec<(String, Times)> = Vec::new();
    let mut gpucr_archive = None;
    for round in 0..rounds {
        for h in &handlers {
            let (times, archive) = kubelet_flow(&mut node, &h.name, round);
            let names = archive_names(&archive);
            for want in [
                "stats-dump",
                "dump.log",
                "config.dump",
                "spec.dump",
                "status.dump",
            ] {
                assert!(
                    names.iter().any(|n| n == want),
                    "{}: the archive {} has no {want}: {names:?}",
                    h.name,
                    archive.display()
                );
            }
            if h.name == "gpucr" {
                gpucr_archive = Some(archive);
            }
            all.push((h.name.clone(), times));
        }
    }

    // checkpointctl reads gpucr's archive, CRIU's statistics and log included.
    let archive = gpucr_archive.expect("a gpucr archive");
    let show = Cmd::new(checkpointctl())
        .arg("show")
        .arg(&archive)
        .run_ok()
        .unwrap_or_else(|e| panic!("checkpointctl show: {e}"));
    assert!(
        show.stdout.contains("counter"),
        "checkpointctl show: {}",
        show.stdout
    );
    let inspect = Cmd::new(checkpointctl())
        .args(["inspect", "--all"])
        .arg(&archive)
        .run_ok()
        .unwrap_or_else(|e| panic!("checkpointctl inspect --all: {e}"));
    assert!(
        inspect.stdout.contains("CRIU dump statistics"),
        "checkpointctl inspect --all shows no dump statistics:\n{}",
        inspect.stdout
    );
    println!("checkpointctl show:\n{}", show.stdout);

    // The table for docs/BENCHMARKS.md.
    println!(
        "CRI on containerd {} ({rounds} rounds, medians):",
        node.ctd.daemon().version
    );
    println!("| step | runc | gpucr | gpucr/runc |");
    println!("|---|---|---|---|");
    type Field = fn(&Times) -> Duration;
    let fields: [(&str, Field); 5] = [
        ("RunPodSandbox", |t| t.run_pod),
        ("CreateContainer + StartContainer", |t| t.create_start),
        ("CheckpointContainer", |t| t.checkpoint),
        ("restore from the archive (Create + Start)", |t| {
            t.restore_archive
        }),
        ("restore from the image (Pull + Create + Start)", |t| {
            t.restore_image
        }),
    ];
    for (label, f) in fields {
        let of = |name: &str| {
            median(
                all.iter()
                    .filter(|(n, _)| n == name)
                    .map(|(_, t)| f(t))
                    .collect(),
            )
        };
        let (r, g) = (of("runc"), of("gpucr"));
        println!(
            "| {label} | {:.3} s | {:.3} s | {:.2} |",
            r.as_secs_f64(),
            g.as_secs_f64(),
            g.as_secs_f64() / r.as_secs_f64()
        );
    }
}

/// The RuntimeClass's options reach the shim: BinaryName names a runc wrapper that logs its
/// calls, and SystemdCgroup = false puts the container in the pod's cgroupfs parent.
#[test]
fn runtime_class_options_reach_the_shim() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let log = scratch.path().join("runc-calls.log");
    let wrapper = scratch.path().join("runc-logged");
    let runc = Cmd::new("sh")
        .args(["-c", "command -v runc"])
        .run_ok()
        .expect("runc in PATH")
        .stdout
        .trim()
        .to_owned();
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"$*\" >> {}\nexec {runc} \"$@\"\n",
            log.display()
        ),
    )
    .expect("write the wrapper");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let handler = Handler::gpucr_with_binary("gpucr-logged", &wrapper.to_string_lossy());
    let mut node = CriNode::start(&[Handler::runc(), handler]);
    let (pod, sandbox, _) = node.run_pod("logged", "gpucr-logged");
    let busybox = node.busybox.clone();
    node.client.pull_image(&busybox, &pod).expect("PullImage");
    let config = cri::container_config("counter", &busybox, &counter_args(), &pod);
    let id = node
        .client
        .create_container(&sandbox, &config, &pod)
        .expect("CreateContainer");
    node.client.start_container(&id).expect("StartContainer");
    node.wait_counter_above(&id, 2);
    let archive = node.dir("ckpt").join("logged.tar");
    node.client
        .checkpoint_container(&id, &archive, 0)
        .expect("CheckpointContainer");

    let calls = std::fs::read_to_string(&log).unwrap_or_default();
    for verb in ["create", "start", "checkpoint"] {
        assert!(
            calls
                .lines()
                .any(|l| l.split_whitespace().any(|w| w == verb) && l.contains(&id)),
            "BinaryName's wrapper saw no `{verb}` of {id}:\n{calls}"
        );
    }
    let pid = node.pid(&id);
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let parent = format!("/{}/podlogged-{}", node.ctd.namespace(), std::process::id());
    assert!(
        cgroups
            .lines()
            .any(|l| l.ends_with(&format!("{parent}/{id}"))),
        "SystemdCgroup = false: the container's cgroup is not {parent}/{id}:\n{cgroups}"
    );
}

/// A node upgraded from containerd 1.7 keeps its config (version 2) naming gpucr: containerd
/// 2.x migrates it (issue #23) with the runtime class, its type and its options intact — the
/// table install.sh writes on 1.x, as `containerd config migrate` shows it.
#[test]
fn a_17_config_naming_gpucr_migrates_to_2x() {
    let daemon = Daemon::containerd2().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpucr]
  runtime_type = "io.containerd.gpucr.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpucr.options]
    BinaryName = "runc"
    SystemdCgroup = false
"#,
    )
    .expect("write config");
    let out = Cmd::new(&daemon.containerd)
        .arg("--config")
        .arg(&config)
        .args(["config", "migrate"])
        .timeout(Duration::from_secs(30))
        .run_ok()
        .expect("containerd config migrate");
    let text = out.stdout;
    let table = "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpucr]";
    let at = text
        .find(table)
        .unwrap_or_else(|| panic!("no gpucr runtime after the migration:\n{text}"));
    let gpucr = &text[at..];
    assert!(
        gpucr.contains("runtime_type = 'io.containerd.gpucr.v2'")
            && gpucr.contains("BinaryName = 'runc'")
            && gpucr.contains("SystemdCgroup = false"),
        "the gpucr runtime keeps its type and options:\n{gpucr}"
    );
}
