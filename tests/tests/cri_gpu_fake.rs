//! Kubernetes with a (fake) GPU (issue #28): kubelet's CRI calls to containerd 2.x, as in
//! cri.rs, for a GPU container of runtime class `gpucr` on a CPU machine — RunPodSandbox,
//! PullImage from the loopback registry, CreateContainer, StartContainer,
//! CheckpointContainer to a kubelet-style archive, then the container restored into a new
//! pod from the archive's path and into another from a checkpoint OCI image (annotation
//! `org.criu.checkpoint.container.name`), on both of gpucr's paths:
//!
//! - the driver path (`io.gpucr.hook=off`): tests/fake-libcuda is the shim's libcuda and
//!   every process of a container is a GPU candidate (`GPUCR_GPU_ALL_PROCESSES=1` in
//!   containerd's environment, as in gpu_fake.rs); the fake's script makes the counter a CUDA
//!   process. The driver's lock, checkpoint, restore and unlock happen on the original's pid,
//!   then restore and unlock on the restored pids in each new pod (the H200's "the checkpoint
//!   holds GPU state of 1 CUDA processes, but only 0 were found after CRIU's restore" was a
//!   restore in a new pod), which sit in that pod's cgroup, and the counter continues;
//! - the hook path (`io.gpucr.hook=on`, as in hook_fastpath.rs): the shim preloads the hook
//!   into hook/preload/tests/cuda_app.c, whose `libcuda.so.1` is the fake; the hook's images
//!   go through CRI's copy of the checkpoint into the archive, and each restored program finds
//!   its device memory exact (same hash) and runs on.
//!
//! There are no `/dev/nvidia*` devices here: the annotations say what devices would (CRI
//! passes them on because the handler lists `io.gpucr.*`, as README's Kubernetes section
//! says to set up). Needs what cri.rs needs (containerd 2.x, checkpointctl: see
//! tests/containerd2.sh) and the installed hook library; only meaningful for gpucr.

use std::ffi::OsString;
use std::time::Duration;

use gpucr_tests::cri::{self, api, Handler, CRI_NAMESPACE};
use gpucr_tests::cri_node::{self, archive_names, CriNode};
use gpucr_tests::cuda_app::{self, Step, HASH_FILE};
use gpucr_tests::fake_cuda::{self, FakeCuda, FULL_CYCLE, RUNNING};
use gpucr_tests::{counter_args, poll_until, runtime_under_test, GPUCR_RUNTIME};

const HANDLER: &str = "gpucr";
/// What a restored CUDA process gets from the shim.
const RESTORED: [&str; 2] = ["restore -> 0", "unlock -> 0"];
/// What the shim says when a restored process got its device memory back from the hook's
/// image.
const COPIED_IN: &str = "restored process's device memory copied in";
const WAIT: Duration = Duration::from_secs(30);

/// A CRI node whose shims use a fake libcuda. Fields drop in order: the node (its pods, the
/// daemon and its shims) before the fake's files.
struct FakeGpuNode {
    node: CriNode,
    fake: FakeCuda,
}

fn start() -> Option<FakeGpuNode> {
    let runtime = runtime_under_test();
    if runtime != GPUCR_RUNTIME {
        eprintln!("skipped: GPU paths are gpucr's, the runtime under test is {runtime}");
        return None;
    }
    let fake = FakeCuda::new().expect("fake libcuda");
    let env = fake
        .env()
        .into_iter()
        .map(|(k, v)| (OsString::from(k), OsString::from(v)))
        .collect();
    let node = CriNode::start_with_env(&[Handler::gpucr().with_gpucr_annotations()], env);
    Some(FakeGpuNode { node, fake })
}

/// kubelet's config of container `name` in `pod`, with `io.gpucr.hook=<hook>` and `env`.
fn gpu_container(
    name: &str,
    image: &str,
    args: &[String],
    hook: &str,
    env: &[String],
    pod: &api::PodSandboxConfig,
) -> api::ContainerConfig {
    let mut config = cri::container_config(name, image, args, pod);
    config
        .annotations
        .insert("io.gpucr.hook".into(), hook.into());
    config.envs = env
        .iter()
        .filter_map(|e| e.split_once('='))
        .map(|(key, value)| api::KeyValue {
            key: key.into(),
            value: value.into(),
        })
        .collect();
    config
}

impl FakeGpuNode {
    /// The annotations of `id`'s OCI spec (ContainerStatus's verbose info).
    fn spec_annotation(&mut self, id: &str, key: &str) -> Option<String> {
        let status = self
            .node
            .client
            .container_status(id)
            .expect("ContainerStatus");
        let info: serde_json::Value =
            serde_json::from_str(status.info.get("info").expect("verbose info"))
                .expect("info JSON");
        info["runtimeSpec"]["annotations"][key]
            .as_str()
            .map(str::to_owned)
    }

    fn shim_log(&self) -> String {
        self.node.ctd.log_tail(400)
    }

    fn read_step(&mut self, id: &str) -> Option<Step> {
        Step::parse(&self.node.client.exec_sync(id, &["cat", HASH_FILE]).ok()?)
    }

    /// Waits until the program in `id` checked its memory after step `n`.
    fn wait_step_above(&mut self, id: &str, n: u64) -> Step {
        let mut last = None;
        poll_until(&format!("{id} past step {n}"), WAIT, || {
            last = self.read_step(id);
            Ok(match &last {
                Some(s) if s.n > n => Ok(s.clone()),
                other => Err(other.clone()),
            })
        })
        .unwrap_or_else(|e| panic!("{e}; shim log: {}", self.shim_log()))
    }

    /// The program in `id` runs on with its memory as it was (`hash`).
    fn assert_memory_kept(&mut self, id: &str, hash: &str, what: &str) {
        let now = self.read_step(id).map_or(0, |s| s.n);
        let next = self.wait_step_above(id, now);
        assert_eq!(
            next.verdict, hash,
            "{what}: the memory of {id} after step {now}"
        );
    }
}

/// A line of `/proc/<pid>/cgroup` ends with `<parent>/<id>`: the process is in container
/// `id`'s cgroup under the pod's parent.
fn in_cgroup_of(pid: u32, parent: &str, id: &str) -> Result<(), String> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_err(|e| format!("/proc/{pid}/cgroup: {e}"))?;
    let own = format!("{parent}/{id}");
    if cgroups.lines().any(|l| l.ends_with(&own)) {
        Ok(())
    } else {
        Err(format!("pid {pid} is not in {own}:\n{cgroups}"))
    }
}

#[test]
fn a_fake_gpu_pod_is_checkpointed_and_restored_into_new_pods_through_the_driver() {
    let Some(mut g) = start() else {
        return;
    };
    let pod_name = "gpu-driver";
    let (pod, sandbox, _) = g.node.run_pod(pod_name, HANDLER);
    let busybox = g.node.busybox.clone();
    g.node
        .client
        .pull_image(&busybox, &pod)
        .expect("PullImage busybox");
    let config = gpu_container("counter", &busybox, &counter_args(), "off", &[], &pod);
    let id = g.node.create_and_start(&sandbox, &config, &pod);
    assert_eq!(
        g.spec_annotation(&id, "io.gpucr.hook").as_deref(),
        Some("off"),
        "CRI passes gpucr's annotation to the shim (the handler lists io.gpucr.*)"
    );
    g.node.wait_counter_above(&id, 5);
    let pid = g.node.pid(&id);
    g.fake.set_script(&format!("cuda {pid}\n")).unwrap();

    // CheckpointContainer (containerd pauses the task around it): the shim quiesces the
    // CUDA process and gives it back; the GPU record goes into the archive.
    let before = g.node.read_counter(&id);
    let (archive, took) = g
        .node
        .checkpoint_to_kubelet_archive(&id, pod_name, "counter");
    let after = g.node.read_counter(&id);
    eprintln!("CheckpointContainer of the fake-GPU counter: {took:?}");
    assert_eq!(
        g.fake.calls_of(pid),
        FULL_CYCLE,
        "driver calls on the original: {:#?}",
        g.fake.log()
    );
    assert_eq!(g.fake.states().get(&pid), Some(&RUNNING));
    g.node.wait_counter_above(&id, after);
    let names = archive_names(&archive);
    for want in ["checkpoint/gpucr-gpu.json", "stats-dump", "spec.dump"] {
        assert!(
            names.iter().any(|n| n == want),
            "the archive {} has no {want}: {names:?}",
            archive.display()
        );
    }
    cri_node::assert_checkpointctl_inspects(&archive);

    // The restored processes have new pids, which the driver knows CHECKPOINTED.
    g.fake
        .set_script(&format!("cuda {pid}\ncuda * state=checkpointed\n"))
        .unwrap();
    let image =
        g.node
            .push_checkpoint_image(&archive, "counter", "gpucr/checkpoint-gpu-driver", "1");
    let archive_path = archive.to_string_lossy().into_owned();
    for (suffix, from) in [
        ("from-archive", archive_path.as_str()),
        ("from-image", &image),
    ] {
        let new_pod = format!("{pod_name}-{suffix}");
        let skip = g.fake.calls().len();
        let (restored, took) = g
            .node
            .restore_in_new_pod(&new_pod, HANDLER, "counter", from);
        eprintln!("restore {suffix} (fake GPU, driver path): {took:?}");
        let new_pid = g.node.pid(&restored);
        let resumed = g.fake.called_pids_after(skip);
        assert!(
            resumed.contains(&new_pid),
            "{suffix}: the restored init {new_pid} in pod {new_pod} got no driver call: {:#?}\n\
             shim log: {}",
            g.fake.log(),
            g.shim_log()
        );
        assert!(
            !resumed.contains(&pid),
            "{suffix}: the original was touched"
        );
        for p in &resumed {
            assert_eq!(g.fake.calls_of(*p), RESTORED, "{suffix}: pid {p}");
            assert_eq!(g.fake.states().get(p), Some(&RUNNING), "{suffix}: pid {p}");
        }
        in_cgroup_of(new_pid, &g.node.cgroup_parent(&new_pod), &restored)
            .unwrap_or_else(|e| panic!("{suffix}: {e}"));
        g.node
            .assert_counter_continues(&restored, before, after, &format!("restored {suffix}"));
    }
    // The original ran on untouched by the restores.
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE);
    let now = g.node.read_counter(&id);
    g.node.wait_counter_above(&id, now);
}

#[test]
fn a_hooked_fake_gpu_pod_gets_its_device_memory_back_in_new_pods() {
    let Some(mut g) = start() else {
        return;
    };
    let hook_lib = fake_cuda::hook_lib().expect("libgpucr_hook.so");
    let app = cuda_app::image(&g.fake.lib(), &hook_lib).expect("the app image");
    g.node
        .registry
        .push("gpucr/cuda-app", "test", &app.manifest, &app.blobs());
    let app_ref = g.node.registry.reference("gpucr/cuda-app", "test");

    let pod_name = "gpu-hook";
    let (pod, sandbox, _) = g.node.run_pod(pod_name, HANDLER);
    g.node
        .client
        .pull_image(&app_ref, &pod)
        .expect("PullImage the app");
    let config = gpu_container(
        "app",
        &app_ref,
        &cuda_app::args(),
        "on",
        &cuda_app::env(),
        &pod,
    );
    let id = g.node.create_and_start(&sandbox, &config, &pod);
    let first = g.wait_step_above(&id, 1);
    assert!(first.verdict.starts_with("ok "), "{first:?}");
    let hash = first.verdict;
    let sockets = g.node.ctd.bundle_in(CRI_NAMESPACE, &id).join("gpucr-hook");
    assert!(
        sockets.join("hook-1.sock").exists(),
        "the shim preloaded no hook (no hook-1.sock in {}); shim log: {}",
        sockets.display(),
        g.shim_log()
    );

    // CRI copies the CRIU tar entry by entry into one directory: the hook's images, folded
    // flat, come through whole.
    let (archive, took) = g.node.checkpoint_to_kubelet_archive(&id, pod_name, "app");
    eprintln!("CheckpointContainer of the hooked app: {took:?}");
    g.assert_memory_kept(&id, &hash, "the original after the checkpoint");
    let names = archive_names(&archive);
    assert!(
        names.iter().any(|n| n == "checkpoint/gpucr-hook.json"),
        "no gpucr-hook.json in the archive: {names:?}"
    );
    assert!(
        names
            .iter()
            .any(|n| n.starts_with("checkpoint/gpu-hook.1.")),
        "no gpu-hook.1.* (the hook's image of ns pid 1) in the archive: {names:?}"
    );

    let image = g
        .node
        .push_checkpoint_image(&archive, "app", "gpucr/checkpoint-gpu-hook", "1");
    let archive_path = archive.to_string_lossy().into_owned();
    for (n, (suffix, from)) in [
        ("from-archive", archive_path.as_str()),
        ("from-image", &image),
    ]
    .into_iter()
    .enumerate()
    {
        let new_pod = format!("{pod_name}-{suffix}");
        let (restored, took) = g.node.restore_in_new_pod(&new_pod, HANDLER, "app", from);
        eprintln!("restore {suffix} (fake GPU, hook path): {took:?}");
        g.assert_memory_kept(&restored, &hash, &format!("restored {suffix}"));
        let copied_in = g.node.ctd.log_tail(usize::MAX).matches(COPIED_IN).count();
        assert_eq!(
            copied_in,
            n + 1,
            "{suffix}: the restored program got its memory from the hook's image: {}",
            g.shim_log()
        );
        let pid = g.node.pid(&restored);
        in_cgroup_of(pid, &g.node.cgroup_parent(&new_pod), &restored)
            .unwrap_or_else(|e| panic!("{suffix}: {e}"));
    }
    g.assert_memory_kept(&id, &hash, "the original after the restores");
}
