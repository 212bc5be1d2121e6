//! kubelet's CRI calls with GPU containers (issues #21, #28), for `tests/gpu/h200-cri.sh`: a
//! containerd 2.x with CRI (the `gpucr` runtime class from the drop-in install/install.sh
//! wrote, imported), a loopback registry, and for each scenario of a plan the flow kubelet
//! drives — RunPodSandbox, PullImage, CreateContainer (devices or CDI devices, mounts, env,
//! annotations as kubelet fills them), StartContainer, CheckpointContainer to a kubelet-style
//! archive — then a new pod restored from the archive path and one from a checkpoint OCI
//! image (`org.criu.checkpoint.container.name`) pulled from the registry, and optionally the
//! same container through `ctr c checkpoint --task --rw` / `ctr c restore --live --rw`, side
//! by side. Every "step S hash H" line the workload writes (to a file in its rootfs) must be
//! the reference run's line for S, and the steps must go on without a gap or a restart.
//!
//! ```text
//! cri-gpu PLAN.json
//! ```
//!
//! The plan (JSON):
//! `{"out": DIR, "imports": [GLOB], "cdi_spec_dirs": [DIR], "env": {K: V},
//!   "checkpointctl": PATH, "images": [{"name": REPO, "tag": TAG, "layer": TAR, "env": [..]}],
//!   "scenarios": [{"name", "handler", "image": "REPO:TAG", "command": [..], "env": {..},
//!   "mounts": [[HOST, CONTAINER]], "devices": [PATH], "cdi_devices": [NAME],
//!   "annotations": {..}, "reference": FILE, "steps_file": "/tmp/steps",
//!   "start_timeout_s": N, "restores": ["archive", "image"], "ctr": [EXTRA CTR RUN ARGS]}]}`.
//! Results: `OUT/cri-results.txt` (one line per leg: name, PASS/FAIL, seconds, figures),
//! `OUT/containerd.log`, `OUT/<scenario>-checkpointctl.txt`.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpucr_tests::cri::{self, api, CriClient, Handler, MEDIA_LAYER_TAR};
use gpucr_tests::image::{image_manifest, Blob, BusyboxImage, MEDIA_CONFIG};
use gpucr_tests::registry::Registry;
use gpucr_tests::{Cmd, Containerd, Daemon, StartOptions};
use serde_json::{json, Value};

type Error = Box<dyn std::error::Error>;
type Result<T> = std::result::Result<T, Error>;

fn main() -> ExitCode {
    let Some(plan) = std::env::args().nth(1) else {
        eprintln!("usage: cri-gpu PLAN.json");
        return ExitCode::from(2);
    };
    match run(Path::new(&plan)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cri-gpu: {e}");
            ExitCode::FAILURE
        }
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|o| {
            o.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

fn log(msg: &str) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    println!("[cri-gpu {}.{:03}] {msg}", t.as_secs(), t.subsec_millis());
}

/// One leg's outcome, a line of `cri-results.txt`.
struct Results {
    file: std::fs::File,
    all_passed: bool,
}

impl Results {
    fn record(&mut self, name: &str, outcome: &Result<(f64, String)>) {
        let line = match outcome {
            Ok((secs, figs)) => format!("{name:<24} PASS {secs:8.2}s  {figs}"),
            Err(e) => {
                self.all_passed = false;
                format!(
                    "{name:<24} FAIL {:8.2}s  {}",
                    0.0,
                    e.to_string().replace('\n', " | ")
                )
            }
        };
        println!("{line}");
        let _ = writeln!(self.file, "{line}");
    }
}

/// The node: containerd 2.x with CRI, the registry, the client.
struct Node {
    client: CriClient,
    ctd: Containerd,
    registry: Registry,
    scratch: PathBuf,
    images: HashMap<String, String>,
    checkpointctl: Option<PathBuf>,
}

fn run(plan_path: &Path) -> Result<bool> {
    let plan: Value = serde_json::from_slice(&std::fs::read(plan_path)?)?;
    let out = PathBuf::from(plan["out"].as_str().ok_or("plan: no out")?);
    std::fs::create_dir_all(&out)?;
    let mut results = Results {
        file: std::fs::File::create(out.join("cri-results.txt"))?,
        all_passed: true,
    };
    let mut node = start_node(&plan, &out)?;
    for scenario in plan["scenarios"].as_array().cloned().unwrap_or_default() {
        let name = scenario["name"].as_str().unwrap_or("?").to_owned();
        log(&format!("scenario {name}"));
        let s = Scenario::from(&scenario, &node)?;
        s.kubelet_flow(&mut node, &mut results);
        if !s.ctr_args.is_empty() || scenario["ctr"].is_array() {
            let outcome = s.ctr_flow(&node);
            results.record(&format!("{name}-ctr"), &outcome);
        }
    }
    let _ = std::fs::copy(
        node.ctd.dir().join("containerd.log"),
        out.join("containerd.log"),
    );
    Ok(results.all_passed)
}

fn start_node(plan: &Value, out: &Path) -> Result<Node> {
    let daemon = Daemon::containerd2()?;
    let registry = Registry::start()?;
    let (_, pause) = cri::push_test_images(&registry)?;
    let scratch = out.join("cri-node");
    std::fs::create_dir_all(&scratch)?;
    let certs_d = scratch.join("certs.d");
    registry.write_hosts_toml(&certs_d)?;
    let mut images = HashMap::new();
    for image in plan["images"].as_array().cloned().unwrap_or_default() {
        let (repo, tag) = (
            image["name"].as_str().ok_or("image: no name")?,
            image["tag"].as_str().unwrap_or("1"),
        );
        let layer = std::fs::read(image["layer"].as_str().ok_or("image: no layer")?)?;
        push_rootfs_image(&registry, repo, tag, layer, &strings(&image["env"]))?;
        images.insert(format!("{repo}:{tag}"), registry.reference(repo, tag));
    }
    let cdi_dirs: Vec<PathBuf> = strings(&plan["cdi_spec_dirs"])
        .into_iter()
        .map(PathBuf::from)
        .collect();
    // Only runc here: the gpucr runtime class is the imported drop-in, as install.sh wrote it.
    let config = cri::cri_config_cdi(&scratch, &[Handler::runc()], &pause, &certs_d, &cdi_dirs);
    let ctd = Containerd::start_opts(StartOptions {
        daemon: Some(daemon),
        cri: Some(config),
        imports: strings(&plan["imports"]),
        env: string_map(&plan["env"])
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect(),
        ..StartOptions::default()
    })?;
    log(&format!(
        "containerd {} with CRI at {}",
        ctd.daemon().version,
        ctd.address().display()
    ));
    let client = CriClient::connect_ready(ctd.address(), Duration::from_secs(30))?;
    Ok(Node {
        client,
        ctd,
        registry,
        scratch,
        images,
        checkpointctl: plan["checkpointctl"].as_str().map(PathBuf::from),
    })
}

/// An image of one uncompressed layer (a tar of a rootfs the script made) with `env`.
fn push_rootfs_image(
    registry: &Registry,
    repo: &str,
    tag: &str,
    layer: Vec<u8>,
    env: &[String],
) -> Result<()> {
    let base: Value = serde_json::from_slice(&BusyboxImage::get()?.config.bytes)?;
    // An uncompressed layer's diff_id is its digest: hashed once.
    let layer = Blob::new(MEDIA_LAYER_TAR, layer);
    let diff_id = layer.digest.clone();
    let config = json!({
        "architecture": base["architecture"],
        "os": "linux",
        "config": { "Env": env, "Cmd": ["sh"], "WorkingDir": "/" },
        "rootfs": { "type": "layers", "diff_ids": [diff_id] },
    });
    let config = Blob::new(MEDIA_CONFIG, serde_json::to_vec(&config)?);
    let manifest = image_manifest(&config, &[&layer], None)?;
    registry.push(repo, tag, &manifest, &[&config, &layer]);
    Ok(())
}

/// One workload and how it runs in a pod.
struct Scenario {
    name: String,
    handler: String,
    image: String,
    command: Vec<String>,
    env: BTreeMap<String, String>,
    mounts: Vec<(String, String)>,
    devices: Vec<String>,
    cdi_devices: Vec<String>,
    annotations: BTreeMap<String, String>,
    reference: BTreeMap<u64, String>,
    steps_file: String,
    start_timeout: Duration,
    restores: Vec<String>,
    ctr_args: Vec<String>,
    /// Whether the shim must have injected the hook (`None`: not checked, e.g. no GPU).
    expect_hook: Option<bool>,
}

impl Scenario {
    fn from(v: &Value, node: &Node) -> Result<Self> {
        let image = v["image"].as_str().ok_or("scenario: no image")?;
        let reference = v["reference"].as_str().ok_or("scenario: no reference")?;
        let restores = strings(&v["restores"]);
        Ok(Self {
            name: v["name"].as_str().unwrap_or("?").to_owned(),
            handler: v["handler"].as_str().unwrap_or("gpucr").to_owned(),
            image: node
                .images
                .get(image)
                .cloned()
                .ok_or_else(|| format!("no image {image} in the plan"))?,
            command: strings(&v["command"]),
            env: string_map(&v["env"]),
            mounts: v["mounts"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|m| Some((m[0].as_str()?.into(), m[1].as_str()?.into())))
                        .collect()
                })
                .unwrap_or_default(),
            devices: strings(&v["devices"]),
            cdi_devices: strings(&v["cdi_devices"]),
            annotations: string_map(&v["annotations"]),
            reference: read_reference(Path::new(reference))?,
            steps_file: v["steps_file"].as_str().unwrap_or("/tmp/steps").to_owned(),
            start_timeout: Duration::from_secs(v["start_timeout_s"].as_u64().unwrap_or(180)),
            restores: if restores.is_empty() {
                vec!["archive".into(), "image".into()]
            } else {
                restores
            },
            ctr_args: strings(&v["ctr"]),
            expect_hook: v["expect_hook"].as_bool(),
        })
    }

    /// The container as kubelet describes it for a pod spec with this workload.
    fn container_config(&self, image: &str, pod: &api::PodSandboxConfig) -> api::ContainerConfig {
        let mut config = cri::container_config("workload", image, &self.command, pod);
        config.envs = self
            .env
            .iter()
            .map(|(k, v)| api::KeyValue {
                key: k.clone(),
                value: v.clone(),
            })
            .collect();
        config.mounts = self
            .mounts
            .iter()
            .map(|(host, ctr)| api::Mount {
                container_path: ctr.clone(),
                host_path: host.clone(),
                readonly: true,
                ..Default::default()
            })
            .collect();
        config.devices = self
            .devices
            .iter()
            .map(|d| api::Device {
                container_path: d.clone(),
                host_path: d.clone(),
                permissions: "rw".into(),
            })
            .collect();
        config.cdi_devices = self
            .cdi_devices
            .iter()
            .map(|name| api::CdiDevice { name: name.clone() })
            .collect();
        config
            .annotations
            .extend(self.annotations.iter().map(|(k, v)| (k.clone(), v.clone())));
        config
    }

    fn kubelet_flow(&self, node: &mut Node, results: &mut Results) {
        let pod_name = format!("{}-{}", self.name, std::process::id());
        let started = Instant::now();
        let original = self.start_pod(node, &pod_name, &self.image.clone(), true);
        let (_pod, sandbox, id, pid) = match original {
            Ok(v) => v,
            Err(e) => {
                results.record(&format!("{}-start", self.name), &Err(e));
                return;
            }
        };
        let start_s = started.elapsed().as_secs_f64();
        // Checkpoint to a kubelet-style archive; the container keeps running.
        let checkpoints = node.scratch.join("var/lib/kubelet/checkpoints");
        let _ = std::fs::create_dir_all(&checkpoints);
        let archive = cri::kubelet_checkpoint_path(&checkpoints, &pod_name, "default", "workload");
        let mut at = -1;
        let checkpoint = (|| -> Result<(f64, String)> {
            let before = last_step(&self.steps(pid));
            let t = Instant::now();
            node.client.checkpoint_container(&id, &archive, 0)?;
            let secs = t.elapsed().as_secs_f64();
            at = last_step(&self.steps(pid));
            // Leave-running: the original goes on, exact.
            let last = self.wait_steps(pid, at + 3, Duration::from_secs(120))?;
            let bytes = std::fs::metadata(&archive)?.len();
            let names = cri::archive_names(&archive)?;
            for want in ["dump.log", "stats-dump", "config.dump", "spec.dump"] {
                if !names.iter().any(|n| n == want) {
                    return Err(format!("the archive has no {want}").into());
                }
            }
            let nested = names
                .iter()
                .filter(|n| n.starts_with("checkpoint/") && n.matches('/').count() > 1)
                .count();
            Ok((
                secs,
                format!(
                    "start_s={start_s:.2} steps_before={before} steps_at={at} original_ran_to={last} \
                     archive_mib={} entries={} nested={nested}",
                    bytes >> 20,
                    names.len()
                ),
            ))
        })();
        let ok = checkpoint.is_ok();
        results.record(&format!("{}-checkpoint", self.name), &checkpoint);
        if let Err(e) = node.client.remove_pod(&sandbox) {
            log(&format!("removing pod {sandbox}: {e}"));
        }
        if !ok {
            return;
        }
        if let Some(ctl) = node.checkpointctl.clone() {
            let outcome = checkpointctl(&ctl, &archive, &node.scratch, &self.name);
            results.record(&format!("{}-checkpointctl", self.name), &outcome);
        }
        for from in self.restores.clone() {
            let outcome = self.restore(node, &pod_name, &from, &archive, at);
            results.record(&format!("{}-restore-{from}", self.name), &outcome);
        }
        let _ = std::fs::remove_file(&archive);
    }

    /// A pod with the workload: RunPodSandbox, PullImage, CreateContainer, StartContainer,
    /// then (when `wait`) until it wrote step 3.
    fn start_pod(
        &self,
        node: &mut Node,
        pod_name: &str,
        image: &str,
        wait: bool,
    ) -> Result<(api::PodSandboxConfig, String, String, u32)> {
        let uid = format!("{pod_name}-uid");
        let logs = node.scratch.join(format!("pods/default_{pod_name}_{uid}"));
        std::fs::create_dir_all(&logs)?;
        // A kubepods-style cgroup parent (cgroupfs driver), as kubelet makes for a pod.
        let cgroup_parent = format!("/kubepods/besteffort/pod{uid}");
        let pod = cri::pod_config(pod_name, &uid, &logs, &cgroup_parent);
        let sandbox = node
            .client
            .run_pod_sandbox(&pod, &self.handler)
            .map_err(|e| format!("RunPodSandbox {pod_name}: {e}"))?;
        // kubelet pulls an image; a checkpoint archive's path is CRI's to read (no pull).
        if !image.starts_with('/') {
            node.client
                .pull_image(image, &pod)
                .map_err(|e| format!("PullImage {image}: {e}"))?;
        }
        let config = self.container_config(image, &pod);
        let id = node
            .client
            .create_container(&sandbox, &config, &pod)
            .map_err(|e| format!("CreateContainer ({image}): {e}"))?;
        node.client
            .start_container(&id)
            .map_err(|e| format!("StartContainer: {e}"))?;
        let pid = node.client.container_pid(&id)?;
        self.check_hook(node, &id)?;
        if wait {
            self.wait_steps(pid, 3, self.start_timeout)?;
        }
        Ok((pod, sandbox, id, pid))
    }

    fn restore(
        &self,
        node: &mut Node,
        pod_name: &str,
        from: &str,
        archive: &Path,
        at_checkpoint: i64,
    ) -> Result<(f64, String)> {
        let name = format!("{pod_name}-from-{from}");
        let t = Instant::now();
        let (image, push_s) = match from {
            "archive" => (archive.to_string_lossy().into_owned(), 0.0),
            "image" => {
                let tp = Instant::now();
                let bytes = std::fs::read(archive)?;
                let image = cri::push_checkpoint_image(
                    &node.registry,
                    bytes,
                    "workload",
                    &format!("gpucr/checkpoint-{}", self.name),
                    "1",
                )?;
                (image, tp.elapsed().as_secs_f64())
            }
            other => return Err(format!("unknown restore source {other}").into()),
        };
        let t_restore = Instant::now();
        let (_, sandbox, _id, pid) = self.start_pod(node, &name, &image, false)?;
        let restore_s = t_restore.elapsed().as_secs_f64();
        let check = (|| -> Result<String> {
            let first = self.steps(pid);
            let first_last = last_step(&first);
            let last = self.wait_steps(
                pid,
                at_checkpoint.max(first_last) + 4,
                Duration::from_secs(120),
            )?;
            let steps = self.steps(pid);
            let restarted = steps.first().map(|(s, _)| *s).unwrap_or(0);
            Ok(format!(
                "restore_s={restore_s:.2} push_s={push_s:.2} first_step={first_last} \
                 at_checkpoint={at_checkpoint} ran_to={last} lines={} from_step={restarted}",
                steps.len()
            ))
        })();
        let _ = node.client.remove_pod(&sandbox);
        let figs = check?;
        Ok((t.elapsed().as_secs_f64(), figs))
    }

    /// The same workload through ctr on the same containerd (namespace k8s.io, the image CRI
    /// pulled): `ctr c checkpoint --task --rw`, kill, rm, `ctr c restore --live --rw`.
    fn ctr_flow(&self, node: &Node) -> Result<(f64, String)> {
        let ctr = |args: &[&str], secs: u64| {
            Cmd::new(&node.ctd.daemon().ctr)
                .arg("-a")
                .arg(node.ctd.address())
                .args(["-n", cri::CRI_NAMESPACE])
                .args(args)
                .timeout(Duration::from_secs(secs))
                .run_ok()
        };
        let id = format!("ctr-{}", self.name);
        let reference = format!("gpucr.test/ckpt-{}:1", self.name);
        let mut run: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            "--runtime".into(),
            gpucr_tests::GPUCR_RUNTIME.into(),
            "--net-host".into(),
        ];
        for (k, v) in &self.env {
            run.extend(["--env".into(), format!("{k}={v}")]);
        }
        for (k, v) in &self.annotations {
            run.extend(["--annotation".into(), format!("{k}={v}")]);
        }
        for (host, ctr_path) in &self.mounts {
            run.extend([
                "--mount".into(),
                format!("type=bind,src={host},dst={ctr_path},options=rbind:ro"),
            ]);
        }
        run.extend(self.ctr_args.iter().cloned());
        run.push(self.image.clone());
        run.push(id.clone());
        run.extend(self.command.iter().cloned());
        let run: Vec<&str> = run.iter().map(String::as_str).collect();
        ctr(&run, 120)?;
        let cleanup = |id: &str| {
            let _ = ctr(&["task", "kill", "-s", "SIGKILL", id], 30);
            std::thread::sleep(Duration::from_millis(500));
            let _ = ctr(&["task", "rm", "-f", id], 60);
            let _ = ctr(&["container", "rm", id], 60);
        };
        let outcome = (|| -> Result<(f64, String)> {
            let pid = ctr_pid(&ctr, &id)?;
            self.wait_steps(pid, 3, self.start_timeout)?;
            let t = Instant::now();
            ctr(
                &["container", "checkpoint", "--task", "--rw", &id, &reference],
                600,
            )?;
            let ckpt_s = t.elapsed().as_secs_f64();
            let at = last_step(&self.steps(pid));
            cleanup(&id);
            let t = Instant::now();
            ctr(
                &["container", "restore", "--live", "--rw", &id, &reference],
                600,
            )?;
            let restore_s = t.elapsed().as_secs_f64();
            let pid = ctr_pid(&ctr, &id)?;
            let last = self.wait_steps(pid, at + 4, Duration::from_secs(120))?;
            Ok((
                ckpt_s + restore_s,
                format!("ctr_checkpoint_s={ckpt_s:.2} ctr_restore_s={restore_s:.2} at_checkpoint={at} ran_to={last}"),
            ))
        })();
        cleanup(&id);
        let _ = ctr(&["image", "rm", "--sync", &reference], 120);
        outcome
    }

    /// The path the test means: the hook injected into the container's spec (fast path) or
    /// not (`io.gpucr.hook=off` from the pod's annotations reached the shim: driver path).
    fn check_hook(&self, node: &Node, id: &str) -> Result<()> {
        let Some(expect) = self.expect_hook else {
            return Ok(());
        };
        let config = node
            .ctd
            .state_dir()
            .join("io.containerd.runtime.v2.task")
            .join(cri::CRI_NAMESPACE)
            .join(id)
            .join("config.json");
        let spec: Value = serde_json::from_slice(&std::fs::read(&config)?)?;
        let injected = spec["process"]["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .any(|e| e.starts_with("LD_PRELOAD=") && e.contains("libgpucr_hook"));
        if injected != expect {
            return Err(format!(
                "the hook is {}injected into {id} ({}), the scenario wants the {} path",
                if injected { "" } else { "not " },
                config.display(),
                if expect { "hook" } else { "driver" }
            )
            .into());
        }
        Ok(())
    }

    fn steps(&self, pid: u32) -> Vec<(u64, String)> {
        let path = format!("/proc/{pid}/root{}", self.steps_file);
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                match w.as_slice() {
                    ["step", s, "hash", h] => Some((s.parse().ok()?, h.to_string())),
                    _ => None,
                }
            })
            .collect()
    }

    /// Until the workload wrote step `min`; every line must be the reference's, the steps
    /// consecutive (a restarted workload writes step 0 again). The last step.
    fn wait_steps(&self, pid: u32, min: i64, timeout: Duration) -> Result<i64> {
        let started = Instant::now();
        loop {
            let steps = self.steps(pid);
            self.check(&steps)?;
            let last = last_step(&steps);
            if last >= min {
                return Ok(last);
            }
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return Err(format!("the workload (pid {pid}) is gone at step {last}").into());
            }
            if started.elapsed() > timeout {
                return Err(format!(
                    "the workload (pid {pid}) is at step {last} after {:?}, wanted {min}",
                    timeout
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn check(&self, steps: &[(u64, String)]) -> Result<()> {
        for (i, (step, hash)) in steps.iter().enumerate() {
            if i > 0 && *step != steps[i - 1].0 + 1 {
                return Err(format!(
                    "step {} follows step {}: the workload did not go on from where it was",
                    step,
                    steps[i - 1].0
                )
                .into());
            }
            match self.reference.get(step) {
                Some(want) if want == hash => {}
                Some(want) => {
                    return Err(format!(
                        "step {step}: hash {hash}, the uninterrupted run's is {want}"
                    )
                    .into())
                }
                None => {
                    return Err(format!("step {step} is past the reference run's").into());
                }
            }
        }
        Ok(())
    }
}

fn last_step(steps: &[(u64, String)]) -> i64 {
    steps.last().map(|(s, _)| *s as i64).unwrap_or(-1)
}

fn read_reference(path: &Path) -> Result<BTreeMap<u64, String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("reading the reference {}: {e}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w.as_slice() {
                ["step", s, "hash", h] => Some((s.parse().ok()?, h.to_string())),
                _ => None,
            }
        })
        .collect())
}

fn ctr_pid(
    ctr: &dyn Fn(&[&str], u64) -> gpucr_tests::Result<gpucr_tests::Output>,
    id: &str,
) -> Result<u32> {
    let out = ctr(&["task", "ls"], 30)?;
    out.stdout
        .lines()
        .find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.first() == Some(&id)).then(|| w.get(1)?.parse().ok())?
        })
        .ok_or_else(|| format!("no task {id} in ctr task ls:\n{}", out.stdout).into())
}

fn checkpointctl(ctl: &Path, archive: &Path, dir: &Path, name: &str) -> Result<(f64, String)> {
    let t = Instant::now();
    let flags = gpucr_tests::cri_node::checkpointctl_flags(archive);
    let out = Cmd::new(ctl)
        .arg("inspect")
        .args(flags)
        .arg(archive)
        .timeout(Duration::from_secs(300))
        .run_ok()?;
    let secs = t.elapsed().as_secs_f64();
    let path = dir.join(format!("{name}-checkpointctl.txt"));
    std::fs::write(&path, &out.stdout)?;
    if !out.stdout.contains("CRIU dump statistics") {
        return Err(format!(
            "checkpointctl inspect {} shows no dump statistics ({})",
            flags.join(" "),
            path.display()
        )
        .into());
    }
    Ok((
        secs,
        format!("output={} flags={}", path.display(), flags.join(",")),
    ))
}
