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

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpucr_tests::cri::{self, Handler};
use gpucr_tests::cri_node::{self, archive_names, checkpointctl, CriNode};
use gpucr_tests::{counter_args, files_under, Cmd, Daemon};

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
    let id = node.create_and_start(&sandbox, &config, &pod);
    times.create_start = started.elapsed();
    node.wait_counter_above(&id, 5);

    let before = node.read_counter(&id);
    let (archive, took) = node.checkpoint_to_kubelet_archive(&id, &pod_name, "counter");
    times.checkpoint = took;
    let after = node.read_counter(&id);

    // (a) From the archive path, into a new pod of the same runtime class.
    let from = archive.to_string_lossy().into_owned();
    let (restored, took) = node.restore_in_new_pod(
        &format!("{pod_name}-from-archive"),
        handler,
        "counter",
        &from,
    );
    times.restore_archive = took;
    let what = format!("{handler}: restored from the archive");
    node.assert_counter_continues(&restored, before, after, &what);

    // (b) From a checkpoint OCI image built from the archive, pulled like any image.
    let image = node.push_checkpoint_image(
        &archive,
        "counter",
        &format!("gpucr/checkpoint-{handler}"),
        &round.to_string(),
    );
    let (restored, took) = node.restore_in_new_pod(
        &format!("{pod_name}-from-image"),
        handler,
        "counter",
        &image,
    );
    times.restore_image = took;
    let what = format!("{handler}: restored from {image}");
    node.assert_counter_continues(&restored, before, after, &what);
    (times, archive)
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
    cri_node::assert_checkpointctl_inspects(&archive);
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
    let parent = node.cgroup_parent("logged");
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

/// By reference through kubelet's calls (issue 22): with the node's store mode `local`, the
/// archive CheckpointContainer writes holds `gpucr-store.json` instead of CRIU's pages, and
/// both restores (from the archive, from a checkpoint image built from it) put them back from
/// the store.
#[test]
fn a_checkpoint_by_reference_goes_through_kubelets_archive() {
    let store = tempfile::Builder::new()
        .prefix("gpucr-cri-store-")
        .tempdir()
        .expect("tempdir");
    let env = vec![
        ("GPUCR_STORE".into(), store.path().as_os_str().to_owned()),
        ("GPUCR_STORE_MODE".into(), "local".into()),
        ("GPUCR_STORE_MIN_BYTES".into(), "16384".into()),
    ];
    let mut node = CriNode::start_with_env(&[Handler::gpucr()], env);
    let (_, archive) = kubelet_flow(&mut node, "gpucr", 0);
    assert_by_reference(&archive, store.path());
    // checkpointctl reads it, but for the process memory (in the store, not the archive).
    cri_node::assert_checkpointctl_inspects(&archive);
}

/// A RuntimeClass's own store (issue 22): the `gpucr-local` handler's options say
/// `StoreMode = "local"` and name its store. A pod of that class, with no annotation,
/// checkpoints by reference into that directory, not into the node's (containerd's
/// environment names another store, mode inline), and both restores into pods of the class
/// take the files back from it.
#[test]
fn a_runtime_class_checkpoints_by_reference_into_its_own_store() {
    let tempdir = |prefix: &str| {
        tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("tempdir")
    };
    let (class_store, node_store) = (tempdir("gpucr-cri-class-"), tempdir("gpucr-cri-node-"));
    let env = vec![
        (
            "GPUCR_STORE".into(),
            node_store.path().as_os_str().to_owned(),
        ),
        ("GPUCR_STORE_MODE".into(), "inline".into()),
    ];
    let local = Handler::gpucr_with_store("gpucr-local", "local", class_store.path());
    let mut node = CriNode::start_with_env(&[Handler::gpucr(), local], env);
    let (_, archive) = kubelet_flow(&mut node, "gpucr-local", 0);
    assert_by_reference(&archive, class_store.path());
    let chunks = files_under(&class_store.path().join("chunks"));
    assert!(
        !chunks.is_empty(),
        "no chunks in the class's store {}",
        class_store.path().display()
    );
    let elsewhere = files_under(node_store.path());
    assert!(
        elsewhere.is_empty(),
        "the node's store got files: {elsewhere:?}"
    );
}

/// `archive` holds the reference (`gpucr-store.json`) instead of CRIU's pages, and `store`
/// one container's checkpoints.
fn assert_by_reference(archive: &Path, store: &Path) {
    let names = archive_names(archive);
    assert!(
        names.iter().any(|n| n.ends_with("gpucr-store.json")),
        "no reference in the archive: {names:?}"
    );
    assert!(
        !names.iter().any(|n| n
            .rsplit('/')
            .next()
            .is_some_and(|b| b.starts_with("pages-"))),
        "CRIU's pages are in the archive: {names:?}"
    );
    let manifests = store.join("manifests");
    assert_eq!(
        std::fs::read_dir(&manifests)
            .map(|d| d.count())
            .unwrap_or(0),
        1,
        "one container's checkpoints in {}",
        manifests.display()
    );
}
