//! Copy-in helpers for a restore. The hook of a restored process first answers after
//! CRIU's restore, and only the driver's restore (~0.2 s) lies between that and its
//! copy-in: too short for a helper's CUDA context (0.24–0.43 s on the H200) and its
//! pinning. So the shim starts the helpers itself (`gpucr-copyin`, on the host) before
//! `runc restore`, plans each one's job from the image alone
//! ([`gpucr_hook::helper::plan_image_jobs`], the hook's own split) and sends it at once:
//! the helpers pin their shares of the image while CRIU restores. After CRIU, each
//! process's hook gets its helpers' sockets with Warm ([`ProcessHelpers`]) and sends them
//! only the memory (Go) at its copy-in, which it checks on the GPU as with its own
//! helpers. Nothing a helper does is trusted, and a helper that is late, fails or is never
//! handed over costs nothing but its share being staged by the hook.
//!
//! Only for images the hook's helpers could take (raw chunks with gh1 digests on tmpfs),
//! a container with one GPU that this host names by UUID, and a GPU with room for the
//! helpers' contexts next to everything the restore gives back.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gpu_state::image::ImageReader;
use gpu_state::Inventory;
use gpucr_hook::helper::{
    data_file_fds, helper_command, plan_image_jobs, write_job, AheadJob, HelperDevice,
};
use tokio::sync::oneshot;

use crate::gpu::hook::HookRecord;
use crate::reaper::{Exit, Spawner};

/// Annotation: how many copy-in helpers a restore of this container starts per process
/// (`0`: none). Default [`HELPERS_ENV`], else [`DEFAULT_HELPERS`].
pub const HELPERS_ANNOTATION: &str = "io.gpucr.restore-helpers";
/// Shim environment: the default number of helpers.
pub const HELPERS_ENV: &str = "GPUCR_RESTORE_HELPERS";
/// Shim environment: the share of the image the helpers copy, in percent (default 70: the
/// H200's best with jobs sent ahead, docs/BENCHMARKS.md).
pub const SHARE_ENV: &str = "GPUCR_RESTORE_HELPER_SHARE";
/// Shim environment: the helper binary (default: `gpucr-copyin` next to the shim's).
pub const COPYIN_ENV: &str = "GPUCR_COPYIN";
pub const DEFAULT_HELPERS: usize = 2;
const DEFAULT_SHARE: f64 = 0.7;
/// How long the hand-over waits for a job still being written (the helper reads it once
/// its context is up; CRIU's restore has usually taken longer than that).
const JOB_WAIT: Duration = Duration::from_secs(5);
/// How long a helper may take to exit once nobody holds its socket.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// Whether a restore starts copy-in helpers, decided once at Create from the spec as the
/// restore runs it and the image's hook record, and carried to Start in the restore's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelperChoice {
    /// Nothing for helpers to do (no memory moved through the hook), or turned off
    /// ([`HELPERS_ANNOTATION`] or [`HELPERS_ENV`] 0).
    NotWanted,
    /// Wanted, but this host cannot run them; why (logged at Start).
    Unavailable(String),
    /// `per_process` helpers for each process, the program at `path`, on GPU `uuid`.
    On {
        per_process: usize,
        path: PathBuf,
        uuid: String,
    },
}

impl HelperChoice {
    pub fn choose(bundle: &Path, record: Option<&HookRecord>) -> HelperChoice {
        if record.is_none_or(|r| r.processes.is_empty()) {
            return HelperChoice::NotWanted;
        }
        let spec = match gpucr_cdi::read_oci_spec(&bundle.join("config.json")) {
            Ok(spec) => spec,
            Err(e) => return HelperChoice::Unavailable(format!("the spec cannot be read: {e}")),
        };
        let per_process = helper_count(&spec);
        if per_process == 0 {
            return HelperChoice::NotWanted;
        }
        let path = copyin_path();
        if !path.is_file() {
            return HelperChoice::Unavailable(format!(
                "the helper is not installed at {}",
                path.display()
            ));
        }
        match helper_gpu(&spec, Path::new(NVIDIA_GPUS)) {
            Ok(uuid) => HelperChoice::On {
                per_process,
                path,
                uuid,
            },
            Err(why) => HelperChoice::Unavailable(why),
        }
    }
}

/// One helper: its process, our end of its socket, and its job.
struct Started {
    pid: u32,
    exit: Watch,
    sock: Option<UnixStream>,
    job: AheadJob,
    /// The job's writer says here when the job is out.
    sent: mpsc::Receiver<Result<(), String>>,
}

/// How a helper's exit is seen: through the shim's reaper (which reaps every child of
/// the serving shim), or by waiting for it (no reaper runs).
enum Watch {
    Reaped(oneshot::Receiver<Exit>),
    Own(std::process::Child),
}

impl Watch {
    /// Whether the process has not been seen to exit (its pid is still its own).
    fn alive(&mut self) -> bool {
        match self {
            Watch::Reaped(rx) => matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            Watch::Own(child) => matches!(child.try_wait(), Ok(None)),
        }
    }

    /// Waits up to `grace` for the exit; whether it came.
    async fn exited(&mut self, grace: Duration) -> bool {
        match self {
            Watch::Reaped(rx) => tokio::time::timeout(grace, rx).await.is_ok(),
            Watch::Own(child) => {
                let deadline = Instant::now() + grace;
                loop {
                    match child.try_wait() {
                        Ok(None) if Instant::now() < deadline => {
                            tokio::time::sleep(Duration::from_millis(10)).await
                        }
                        Ok(None) => return false,
                        _ => return true,
                    }
                }
            }
        }
    }
}

/// The helpers a restore started, by the namespace pid of the process they are for.
#[derive(Default)]
pub struct RestoreHelpers {
    id: String,
    by_process: HashMap<u32, Vec<Started>>,
}

/// What one process's hook gets with Warm: the jobs and, in the same order, the sockets.
pub struct ProcessHelpers {
    pub jobs: Vec<AheadJob>,
    pub socks: Vec<OwnedFd>,
}

impl RestoreHelpers {
    /// Before `runc restore`: starts the helpers for every process of `record` whose
    /// image they can take, each sent its job. `driver_bytes`: what the driver restores
    /// next to them. Never fails: what cannot be done is logged and the copy-in stages it.
    /// Starts the helpers `choice` names for every process of `record`, unless the GPU has
    /// no room for their contexts next to what the restore gives back (the moment's free
    /// memory, so checked here rather than at Create).
    pub fn start(
        id: &str,
        image: &Path,
        choice: &HelperChoice,
        record: &HookRecord,
        driver_bytes: u64,
        spawner: &Spawner,
    ) -> RestoreHelpers {
        let mut out = RestoreHelpers {
            id: id.to_string(),
            ..RestoreHelpers::default()
        };
        let HelperChoice::On {
            per_process: n,
            path,
            uuid,
        } = choice
        else {
            return out;
        };
        let contexts = n * record.processes.len();
        let free = Inventory::gather()
            .gpus
            .into_iter()
            .find(|g| &g.uuid == uuid)
            .and_then(|g| g.memory_free_bytes);
        if let Err(why) = room_for_contexts(free, driver_bytes, record, contexts) {
            tracing::info!(id, reason = %why, "no copy-in helpers");
            return out;
        }
        out.start_processes(image, record, *n, path, uuid, spawner);
        out
    }

    /// [`RestoreHelpers::start`] once the count, the helper and the GPU are known.
    pub(crate) fn start_processes(
        &mut self,
        image: &Path,
        record: &HookRecord,
        n: usize,
        path: &Path,
        uuid: &str,
        spawner: &Spawner,
    ) {
        let (id, share) = (self.id.clone(), share());
        for p in &record.processes {
            let dir = HookRecord::image_of(image, p.ns_pid);
            match start_for(&dir, p.ns_pid, n, share, path, uuid, spawner) {
                Ok(started) if !started.is_empty() => {
                    let bytes: u64 = started.iter().map(|s| s.job.bytes).sum();
                    tracing::info!(id, ns_pid = p.ns_pid, helpers = started.len(), bytes,
                        gpu = %uuid, "copy-in helpers started; they pin their shares during CRIU's restore");
                    self.by_process.insert(p.ns_pid, started);
                }
                Ok(_) => {}
                Err(why) => {
                    tracing::info!(id, ns_pid = p.ns_pid, reason = %why, "no copy-in helpers")
                }
            }
        }
    }

    /// The helpers of process `ns_pid` whose jobs are out, for its hook's Warm; the
    /// others are let go. Blocks up to [`JOB_WAIT`] for jobs still being written.
    pub fn take(&mut self, ns_pid: u32) -> Option<ProcessHelpers> {
        let started = self.by_process.get_mut(&ns_pid)?;
        let mut out = ProcessHelpers {
            jobs: Vec::new(),
            socks: Vec::new(),
        };
        let deadline = Instant::now() + JOB_WAIT;
        for s in started.iter_mut() {
            let wait = deadline.saturating_duration_since(Instant::now());
            let sock = s.sock.take();
            match (s.sent.recv_timeout(wait), sock) {
                (Ok(Ok(())), Some(sock)) => {
                    out.jobs.push(s.job.clone());
                    out.socks.push(OwnedFd::from(sock));
                }
                (Ok(Err(e)), _) => {
                    tracing::warn!(id = %self.id, pid = s.pid, error = %e, "copy-in helper not used")
                }
                _ => {
                    tracing::warn!(id = %self.id, pid = s.pid, "copy-in helper not used: its job is not out in time");
                    if s.exit.alive() {
                        kill(s.pid);
                    }
                }
            }
        }
        (!out.jobs.is_empty()).then_some(out)
    }

    /// After the copy-ins (or a failed restore): every helper is let go (our sockets
    /// closed), given [`EXIT_GRACE`] to exit, then killed; all are reaped.
    pub async fn finish(self) {
        let mut all: Vec<Started> = self.by_process.into_values().flatten().collect();
        for s in &mut all {
            drop(s.sock.take());
        }
        for mut s in all {
            if !s.exit.exited(EXIT_GRACE).await {
                tracing::warn!(id = %self.id, pid = s.pid, "copy-in helper did not exit; killed");
                kill(s.pid);
                s.exit.exited(EXIT_GRACE).await;
            }
        }
    }

    /// How many helpers were started.
    pub fn len(&self) -> usize {
        self.by_process.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Device memory a helper's CUDA context may take (a primary context without modules
/// takes a few hundred MiB; generous).
const CONTEXT_BYTES: u64 = 1 << 30;

/// Whether `free` bytes of the GPU (unknown: assumed enough) leave room for `contexts`
/// helper contexts next to what the restore gives back: the helpers' contexts exist
/// while the process's memory is created again, and must not make that fail.
fn room_for_contexts(
    free: Option<u64>,
    driver_bytes: u64,
    record: &HookRecord,
    contexts: usize,
) -> Result<(), String> {
    let Some(free) = free else {
        return Ok(());
    };
    let need = record.device_bytes() + driver_bytes + contexts as u64 * CONTEXT_BYTES;
    if free < need {
        return Err(format!(
            "the GPU has {} MiB free, and the restore plus {contexts} helper contexts need \
             about {} MiB",
            free >> 20,
            need >> 20
        ));
    }
    Ok(())
}

fn kill(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Starts up to `n` helpers for the image at `dir` (process `ns_pid`), each sent its job
/// from a thread (it reads it once its context is up).
fn start_for(
    dir: &Path,
    ns_pid: u32,
    n: usize,
    share: f64,
    path: &Path,
    uuid: &str,
    spawner: &Spawner,
) -> Result<Vec<Started>, String> {
    let reader = ImageReader::open(dir).map_err(|e| format!("image {}: {e}", dir.display()))?;
    if !reader.has_gpu_hashes() {
        return Err("the image has no gh1 digests to check the helpers' chunks by".into());
    }
    if let Some(why) = reader.direct_refusal() {
        return Err(format!("the image cannot be registered for DMA: {why:?}"));
    }
    let jobs = plan_image_jobs(&reader, Some(ns_pid), share, n).map_err(|e| e.to_string())?;
    let mut started = Vec::with_capacity(jobs.len());
    for (job, desc) in jobs {
        let files =
            data_file_fds(&reader).map_err(|e| format!("cannot duplicate a data file fd: {e}"))?;
        let device = HelperDevice::Uuid(uuid.to_string());
        let (mut cmd, sock, theirs) = helper_command(path, &device)?;
        // The helper's CUDA calls are its own; its errors go to the shim's log.
        cmd.env_remove("LD_PRELOAD");
        let spawned = match spawner {
            // Reaped by the shim's reaper, never waited for here.
            Spawner::Reaped(reaper) => reaper
                .spawn(&mut cmd)
                .map(|(child, exit)| (child.id(), Watch::Reaped(exit))),
            Spawner::Plain => cmd.spawn().map(|child| (child.id(), Watch::Own(child))),
        };
        let (pid, exit) = spawned.map_err(|e| format!("cannot start {}: {e}", path.display()))?;
        drop(theirs);
        let (tx, sent) = mpsc::channel();
        let mut writer = sock
            .try_clone()
            .map_err(|e| format!("cannot clone a helper socket: {e}"))?;
        std::thread::Builder::new()
            .name("gpucr-restore-job".into())
            .spawn(move || {
                let _ = tx.send(write_job(&mut writer, &job, &files));
            })
            .map_err(|e| format!("cannot start a thread: {e}"))?;
        started.push(Started {
            pid,
            exit,
            sock: Some(sock),
            job: desc,
            sent,
        });
    }
    Ok(started)
}

/// How many helpers per process the container's `spec` asks for.
fn helper_count(spec: &serde_json::Value) -> usize {
    let annotation = spec
        .pointer("/annotations")
        .and_then(|a| a.get(HELPERS_ANNOTATION))
        .and_then(|v| v.as_str())
        .map(str::to_string);
    annotation
        .or_else(|| std::env::var(HELPERS_ENV).ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_HELPERS)
        .min(16)
}

fn share() -> f64 {
    std::env::var(SHARE_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|p| (0.0..=100.0).contains(p))
        .map_or(DEFAULT_SHARE, |p| p / 100.0)
}

fn copyin_path() -> PathBuf {
    std::env::var_os(COPYIN_ENV)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::current_exe()
                .ok()
                .map(|exe| exe.with_file_name("gpucr-copyin"))
        })
        .unwrap_or_else(|| PathBuf::from("/usr/local/bin/gpucr-copyin"))
}

/// Where the NVIDIA driver lists this host's GPUs (`<pci>/information`).
pub const NVIDIA_GPUS: &str = "/proc/driver/nvidia/gpus";

/// The UUID of the container's GPU: the one `/dev/nvidiaN` device of its spec (by minor
/// number), or — with none in the spec — the host's only GPU. Helpers copy on one GPU,
/// so a container with several gets none.
fn helper_gpu(spec: &serde_json::Value, gpus: &Path) -> Result<String, String> {
    let minors: Vec<u64> = spec
        .pointer("/linux/devices")
        .and_then(|d| d.as_array())
        .into_iter()
        .flatten()
        .filter_map(|d| {
            let path = d["path"].as_str()?;
            let n = path.strip_prefix("/dev/nvidia")?;
            n.parse::<u64>().ok()?;
            d["minor"].as_u64().or_else(|| n.parse().ok())
        })
        .collect();
    let host = host_gpus(gpus);
    match minors.as_slice() {
        [minor] => host
            .iter()
            .find(|(m, _)| m == minor)
            .map(|(_, uuid)| uuid.clone())
            .ok_or_else(|| format!("no GPU of this host has device minor {minor}")),
        [] if host.len() == 1 => Ok(host[0].1.clone()),
        [] => Err(format!(
            "the spec names no /dev/nvidiaN device and this host has {} GPUs",
            host.len()
        )),
        more => Err(format!(
            "the container has {} GPUs: helpers copy on one",
            more.len()
        )),
    }
}

/// (device minor, UUID) of each GPU the driver lists under `dir`.
fn host_gpus(dir: &Path) -> Vec<(u64, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(e.path().join("information")) else {
            continue;
        };
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim_start_matches(':').trim().to_string())
        };
        if let (Some(minor), Some(uuid)) = (
            field("Device Minor").and_then(|m| m.parse().ok()),
            field("GPU UUID"),
        ) {
            out.push((minor, uuid));
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_dir(root: &Path, pci: &str, minor: u64, uuid: &str) {
        let d = root.join(pci);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("information"),
            format!(
                "Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\n\
                 Video BIOS: \t ??\nBus Type: \t PCIe\nDevice Minor: \t {minor}\n"
            ),
        )
        .unwrap();
    }

    fn spec(devices: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"linux": {"devices": devices}})
    }

    #[test]
    fn the_containers_gpu_is_found_by_its_device_minor() {
        let gpus = tempfile::tempdir().unwrap();
        let (a, b) = (
            "GPU-aaaaaaaa-1111-2222-3333-444444444444",
            "GPU-bbbbbbbb-1111-2222-3333-444444444444",
        );
        gpu_dir(gpus.path(), "0000:18:00.0", 0, a);
        gpu_dir(gpus.path(), "0000:2a:00.0", 1, b);
        let nvidia = |n: u64| serde_json::json!({"path": format!("/dev/nvidia{n}"), "type": "c", "major": 195, "minor": n});
        let ctl =
            serde_json::json!({"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255});
        let one = spec(serde_json::json!([ctl, nvidia(1)]));
        assert_eq!(helper_gpu(&one, gpus.path()).unwrap(), b);
        // Two GPUs in the container, none in a spec on a two-GPU host, or a minor this
        // host lacks: no helpers, and why.
        let two = spec(serde_json::json!([nvidia(0), nvidia(1)]));
        assert!(helper_gpu(&two, gpus.path())
            .unwrap_err()
            .contains("2 GPUs"));
        let none = spec(serde_json::json!([ctl]));
        assert!(helper_gpu(&none, gpus.path())
            .unwrap_err()
            .contains("has 2 GPUs"));
        let absent = spec(serde_json::json!([nvidia(7)]));
        assert!(helper_gpu(&absent, gpus.path())
            .unwrap_err()
            .contains("minor 7"));
        // A host with one GPU: a spec without device nodes (e.g. the NVIDIA runtime
        // adds them) gets that one.
        std::fs::remove_dir_all(gpus.path().join("0000:2a:00.0")).unwrap();
        assert_eq!(helper_gpu(&none, gpus.path()).unwrap(), a);
    }

    fn process(bytes: u64) -> crate::gpu::hook::ProcessRecord {
        crate::gpu::hook::ProcessRecord {
            host_pid: 1,
            ns_pid: 1,
            allocations: 1,
            freeze_ms: 0,
            copy_out_bytes: bytes,
            copy_out_ms: 0,
            release_ms: 0,
            kept: 0,
            snapshot_ms: 0,
            gpu_paused_ms: 0,
            prepared: false,
            prepare_ms: 0,
        }
    }

    #[test]
    fn helpers_need_room_for_their_contexts_next_to_the_restored_memory() {
        let record = HookRecord {
            version: 1,
            injected: true,
            processes: vec![process(16 << 30), process(8 << 30)],
            fallbacks: Vec::new(),
        };
        let gib = |n: u64| Some(n << 30);
        assert!(room_for_contexts(gib(30), 0, &record, 4).is_ok());
        let err = room_for_contexts(gib(26), 0, &record, 4).unwrap_err();
        assert!(err.contains("26624 MiB free"), "{err}");
        // Free memory unknown (no NVML): started.
        assert!(room_for_contexts(None, 0, &record, 4).is_ok());
    }

    #[test]
    fn the_choice_is_made_from_the_record_and_the_spec() {
        let bundle = tempfile::tempdir().unwrap();
        let with = |annotations: serde_json::Value| {
            let spec = serde_json::json!({"ociVersion": "1.0.2", "annotations": annotations});
            std::fs::write(bundle.path().join("config.json"), spec.to_string()).unwrap();
        };
        let moved = HookRecord {
            version: 1,
            injected: true,
            processes: vec![process(1 << 30)],
            fallbacks: Vec::new(),
        };
        let none = HookRecord {
            processes: Vec::new(),
            ..moved.clone()
        };
        with(serde_json::json!({HELPERS_ANNOTATION: "2"}));
        assert_eq!(
            HelperChoice::choose(bundle.path(), None),
            HelperChoice::NotWanted
        );
        assert_eq!(
            HelperChoice::choose(bundle.path(), Some(&none)),
            HelperChoice::NotWanted
        );
        // Wanted, and the helper is not beside the test binary.
        match HelperChoice::choose(bundle.path(), Some(&moved)) {
            HelperChoice::Unavailable(why) => assert!(why.contains("not installed"), "{why}"),
            other => panic!("{other:?}"),
        }
        with(serde_json::json!({HELPERS_ANNOTATION: "0"}));
        assert_eq!(
            HelperChoice::choose(bundle.path(), Some(&moved)),
            HelperChoice::NotWanted
        );
    }

    #[test]
    fn the_helper_count_comes_from_the_annotation_first() {
        let spec = serde_json::json!({"annotations": {HELPERS_ANNOTATION: "0"}});
        assert_eq!(helper_count(&spec), 0);
        let spec = serde_json::json!({"annotations": {HELPERS_ANNOTATION: "3"}});
        assert_eq!(helper_count(&spec), 3);
    }
}
