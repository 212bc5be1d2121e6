//! The `Container` aggregate: one task's init process, its exec processes, and the runc
//! handle they share. Verbs here do the work; the service (task.rs) maps RPCs onto them.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::{Duration, SystemTime},
};

use containerd_shim_protos::{api::Mount, protobuf::well_known_types::any::Any};
use tokio::sync::{watch, Mutex};

use crate::{
    deadline::Deadlines,
    error::{Error, IoContext, Result},
    failpoint,
    gpu::{
        driver::{self as gpu, GpuConfig},
        hook::{self as gpu_hook, spec as hook_spec, HookRecord},
        host,
        restore_helpers::{HelperChoice, RestoreHelpers},
    },
    io::{IoOwner, PendingIo, StdioSpec},
    options::RuntimeOptions,
    process::{
        exec::ExecProcess,
        init::{InitProcess, RestorePlan},
        state::{ExecState, InitState, TaskVerb},
        ExitCell, ExitInfo,
    },
    reaper::Spawner,
    records::Records,
    runc::{CheckpointOpts, CreateOpts, ExecOpts, RestoreOpts, Runc},
    store_config::StoreConfig,
    unpacked::UnpackedCheckpoint,
};

/// How long an exit waits for the process's output to drain before it is reported.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

pub struct Container {
    pub id: String,
    pub bundle: PathBuf,
    pub namespace: String,
    pub runc: Runc,
    pub opts: RuntimeOptions,
    pub stdio: StdioSpec,
    pub rootfs: Vec<Mount>,
    /// How GPU processes of this container are quiesced (from its annotations).
    pub gpu: GpuConfig,
    /// How long CRIU may take (from its annotations, else by memory).
    pub deadlines: Deadlines,
    /// Where a checkpoint's large files go and where a restore finds them (`by_reference`;
    /// from its annotations, runtime options and the shim's environment).
    pub store: StoreConfig,
    /// Whether the container's processes have the hook library preloaded.
    pub hook: bool,
    /// The init process; held across one verb (see InitProcess).
    pub init: Mutex<InitProcess>,
    /// The init's state as last set: State and Kill answer from it while a verb holds
    /// `init` (a checkpoint or a restore can take minutes), as containerd's runc shim
    /// answers from its recorded state.
    observed: std::sync::Mutex<InitState>,
    /// A signal Kill sent while a restore ran: delivered once the restored task exists.
    pending_kill: std::sync::Mutex<Option<(u32, bool)>>,
    pub init_exit: ExitCell,
    /// Copy of the init pid readable without the lock (Connect, exit routing).
    pub init_pid: AtomicU32,
    /// Exec processes by exec id. A std mutex: never held across an await.
    pub execs: std::sync::Mutex<HashMap<String, Arc<ExecProcess>>>,
    /// Exec starts in progress and running execs, which the init's exit waits for.
    pub execs_live: ExecsLive,
    /// The spec has no PID namespace of its own (host PID namespace, or one joined by
    /// path): the init's exit leaves its processes running, so the shim kills them.
    pub kill_all_on_exit: bool,
    /// containerd's unpacked copy of the checkpoint being restored: removed in the
    /// background after the restore, and gone (or its removal waited for) by Delete's end:
    /// removing 17 GB just written to a disk took seconds on the H200 (writeback), and the
    /// shim exits next.
    pub unpacked: std::sync::Mutex<Option<UnpackedCheckpoint>>,
}

/// What the init's exit waits for, as containerd's runc shim (`runningExecs`,
/// `containerInitExit`, issue 10589): every exec whose start began before the shim saw the
/// init exit has either failed to start or had its exit reported before the init's exit is
/// reported, and no exec starts after it.
#[derive(Debug, Default)]
pub struct ExecsLive(watch::Sender<Live>);

#[derive(Debug, Default, Clone, Copy)]
struct Live {
    init_reaped: bool,
    /// Execs starting or running (exit not reported yet).
    execs: usize,
}

impl ExecsLive {
    /// The reaper saw the init exit: from now on no exec starts.
    pub fn init_reaped(&self) {
        self.0.send_modify(|l| l.init_reaped = true);
    }

    /// An exec's start begins; refused once the init exited.
    fn starting(&self, id: &str) -> Result<()> {
        let mut refused = false;
        self.0.send_if_modified(|l| {
            refused = l.init_reaped;
            if !refused {
                l.execs += 1;
            }
            !refused
        });
        if refused {
            return Err(Error::InitExited { id: id.to_string() });
        }
        Ok(())
    }

    /// An exec failed to start, or its exit was reported.
    pub fn done(&self) {
        self.0.send_modify(|l| l.execs = l.execs.saturating_sub(1));
    }

    /// Waits until no exec is starting or running.
    pub async fn none(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in the container, which the caller holds.
        let _ = rx.wait_for(|l| l.execs == 0).await;
    }
}

/// Whether the init's exit leaves processes of the container running: its spec has no PID
/// namespace of its own (`oci.WithHostNamespace(PIDNamespace)`, or one joined by path), as
/// containerd's runc shim decides it (`ShouldKillAllOnExit`; unreadable spec: kill).
fn shares_pid_namespace(bundle: &Path) -> bool {
    let spec = std::fs::read(bundle.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    let Some(spec) = spec else { return true };
    let namespaces = spec
        .pointer("/linux/namespaces")
        .and_then(|n| n.as_array())
        .cloned()
        .unwrap_or_default();
    !namespaces.iter().any(|ns| {
        ns.get("type").and_then(|t| t.as_str()) == Some("pid")
            && ns
                .get("path")
                .and_then(|p| p.as_str())
                .unwrap_or("")
                .is_empty()
    })
}

/// Everything Create needs.
pub struct CreateConfig {
    pub id: String,
    pub bundle: PathBuf,
    pub namespace: String,
    pub rootfs: Vec<Mount>,
    pub stdio: StdioSpec,
    pub checkpoint: Option<PathBuf>,
    pub parent_checkpoint: Option<PathBuf>,
    pub opts: RuntimeOptions,
}

fn read_pid(path: &Path) -> Result<u32> {
    let s = std::fs::read_to_string(path).ctx(|| format!("reading pid file {}", path.display()))?;
    s.trim().parse().map_err(|_| Error::Runtime {
        op: "read pid file",
        msg: format!("{} holds {:?}, not a pid", path.display(), s.trim()),
    })
}

/// Drains a process's output (bounded), then records its exit once: the exit event follows
/// the output. `None` when the exit was already recorded.
async fn record_exit(
    mut io: crate::io::ProcessIo,
    cell: &ExitCell,
    status: i32,
    at: SystemTime,
) -> Option<ExitInfo> {
    io.wait_outputs(OUTPUT_DRAIN).await;
    let info = ExitInfo {
        status: status as u32,
        at,
    };
    cell.set(info).then_some(info)
}

/// The exec's OCI `Process` JSON with `terminal` as the request asked: runc takes the tty
/// from the process file (`--tty` does not override it), and the shim wires the console
/// socket or pipes by the request; a spec that disagrees (a client that sets the terminal
/// only on its IO) made `runc exec` refuse the console socket.
fn exec_process_json(spec: &[u8], terminal: bool) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(spec) else {
        return spec.to_vec(); // not JSON: runc says what is wrong with it
    };
    let Some(process) = v.as_object_mut() else {
        return spec.to_vec();
    };
    if process
        .get("terminal")
        .and_then(|t| t.as_bool())
        .unwrap_or(false)
        == terminal
    {
        return spec.to_vec();
    }
    process.insert("terminal".into(), serde_json::Value::Bool(terminal));
    serde_json::to_vec(&v).unwrap_or_else(|_| spec.to_vec())
}

/// The annotations of the bundle's OCI spec (empty when it cannot be read).
pub fn spec_annotations(bundle: &Path) -> HashMap<String, String> {
    std::fs::read(bundle.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| {
            let a = v.get("annotations")?.as_object()?.clone();
            Some(
                a.into_iter()
                    .filter_map(|(k, v)| Some((k, v.as_str()?.to_string())))
                    .collect(),
            )
        })
        .unwrap_or_default()
}

pub fn mount_rootfs(rootfs: &[Mount], bundle: &Path) -> Result<()> {
    if rootfs.is_empty() {
        return Ok(());
    }
    let target = bundle.join("rootfs");
    std::fs::create_dir_all(&target).ctx(|| format!("creating {}", target.display()))?;
    for m in rootfs {
        containerd_shim::mount::mount_rootfs(
            Some(m.type_.as_str()).filter(|t| !t.is_empty()),
            Some(m.source.as_str()).filter(|s| !s.is_empty()),
            &m.options,
            &target,
        )
        .map_err(|e| Error::Runtime {
            op: "mount rootfs",
            msg: format!("{} on {}: {e}", m.source, target.display()),
        })?;
    }
    Ok(())
}

pub fn unmount_rootfs(bundle: &Path) {
    unmount_under(&bundle.join("rootfs"));
}

/// The directory where CRIU works in a bundle, unless the client named another.
pub const BUNDLE_CRIU_WORK: &str = "criu-work";

/// Unmounts (lazily) `dir` and everything mounted under it. A CRIU killed mid-restore
/// leaves its cgroup yard (`.criu.cgyard.*`, cgroup hierarchies) mounted in its work
/// directory, which would keep containerd from removing the bundle.
pub fn unmount_under(dir: &Path) {
    if let Err(e) = containerd_shim::mount::umount_recursive(dir.to_str(), libc::MNT_DETACH) {
        tracing::warn!(dir = %dir.display(), "unmount: {e}");
    }
}

impl Container {
    /// Create: mount the rootfs (always by the end of Create: CRI unpacks a checkpoint's rootfs
    /// diff between Create and Start), then `runc create`, or arm a restore.
    pub async fn create(cfg: CreateConfig, spawner: Spawner) -> Result<Container> {
        // Owned from here: a refused restore removes it before its error goes back (the
        // shim exits soon after).
        let unpacked = cfg
            .checkpoint
            .as_deref()
            .and_then(|image| UnpackedCheckpoint::recognize(&cfg.id, image));
        if let Some(u) = &unpacked {
            crate::unpacked::record(&cfg.bundle, u);
        }
        match Self::create_inner(cfg, spawner).await {
            Ok(c) => {
                *c.unpacked.lock().expect("unpacked lock") = unpacked;
                Ok(c)
            }
            Err(e) => {
                if let Some(u) = unpacked {
                    u.discard().await;
                }
                Err(e)
            }
        }
    }

    async fn create_inner(cfg: CreateConfig, spawner: Spawner) -> Result<Container> {
        let runc = Runc {
            binary: cfg.opts.binary().to_string(),
            root: cfg.opts.runc_root(&cfg.namespace),
            systemd_cgroup: cfg.opts.systemd_cgroup,
            log: cfg.bundle.join("log.json"),
            spawner: spawner.clone(),
        };
        let annotations = spec_annotations(&cfg.bundle);
        let gpu = GpuConfig::from_annotations(&annotations)?;
        let deadlines = Deadlines::from_annotations(&annotations)?;
        let store = StoreConfig::resolve(&annotations, &cfg.opts.store)?;
        if store.mode != crate::by_reference::Mode::Inline || cfg.checkpoint.is_some() {
            tracing::info!(id = %cfg.id, mode = ?store.mode, mode_from = %store.mode_from,
                store = %store.dir_label(), shared = ?store.shared(), "the checkpoint store");
        }
        if store.mode == crate::by_reference::Mode::Shared && store.shared().is_none() {
            // Said now, not only when the first checkpoint fails on it.
            tracing::warn!(id = %cfg.id, mode_from = %store.mode_from,
                "store mode shared, and no shared store: this container's checkpoints will \
                 fail until StoreShared (runtime options) or GPUCR_STORE_SHARED (containerd's \
                 environment) names one");
        }
        let mut gpu_pairs = Vec::new();
        let mut records = Records::default();
        let mut helpers = HelperChoice::NotWanted;
        let mut store_stage = None;
        let hook;
        if let Some(image) = &cfg.checkpoint {
            // A by-reference image's files back from the store, before anything reads it.
            if image.is_dir() {
                store_stage = crate::by_reference::resolve(&cfg.id, image, &store).await?;
            }
            // The hook's images back in their directories (a checkpoint leaves them flat);
            // a missing image is validate_image's to refuse.
            let unfolded = if image.is_dir() {
                crate::layout::unfold(image)
            } else {
                Ok(0)
            };
            unfolded.map_err(|e| Error::Restore {
                id: cfg.id.clone(),
                image: image.clone(),
                msg: format!("cannot lay out the hook's GPU state images: {e}"),
            })?;
            // Reads the whole image (chunk hashes): off the async workers.
            let (id, at) = (cfg.id.clone(), image.clone());
            records = tokio::task::spawn_blocking(move || Records::read_checked(&id, &at))
                .await
                .map_err(|e| Error::Restore {
                    id: cfg.id.clone(),
                    image: image.clone(),
                    msg: format!("the image check panicked: {e}"),
                })??;
            // Refuse what this host cannot take before anything is created.
            let refuse = |e: Error| Error::RestoreRefused {
                id: cfg.id.clone(),
                image: image.clone(),
                source: Box::new(e),
            };
            if let Some(record) = &records.gpu {
                // The device needs room for what the driver restores and what the hooks
                // copy back in.
                let hook_bytes = records.hook.as_ref().map_or(0, HookRecord::device_bytes);
                gpu::check_restore(record, hook_bytes).map_err(refuse)?;
            }
            // CRIU restores the hook's bind mounts by destination: they must be in the spec
            // (with this host's sources) before the host plan checks every recorded mount.
            hook = hook_spec::was_injected(image, records.hook.as_ref());
            if hook {
                hook_spec::inject_at_restore(&cfg.bundle).map_err(refuse)?;
            }
            gpu_pairs = host::plan_restore(&cfg.bundle, image).map_err(refuse)?;
            // Its own cgroup, not the checkpointed container's (see restore_cgroup).
            if let Some(old) = crate::manifest::checkpointed_id(image) {
                let renamed = crate::restore_cgroup::rename_spec_cgroup(&cfg.bundle, &old, &cfg.id)
                    .map_err(|e| refuse(Error::io("renaming the spec's cgroup", e)))?;
                if let Some(cgroup) = renamed {
                    tracing::info!(id = %cfg.id, %cgroup, checkpointed = %old,
                        "the restore gets its own cgroup");
                }
            }
            // On the spec as the restore will run it (this host's GPU, the hook's mounts).
            helpers = HelperChoice::choose(&cfg.bundle, records.hook.as_ref());
        } else {
            // One read and (when something changed) one write of config.json for both.
            let config = cfg.bundle.join("config.json");
            let mut spec = gpucr_cdi::read_oci_spec(&config).map_err(hook_spec::spec_error)?;
            let cdi = host::inject_cdi_devices(&mut spec)?;
            // By reference, the hook's chunks start on the store's slices (they dedup).
            let align = match store.mode {
                crate::by_reference::Mode::Inline => 0,
                _ => gpucr_store::dir::CHUNK_SIZE,
            };
            hook = hook_spec::inject_at_create(&cfg.id, &cfg.bundle, &mut spec, align)?;
            if !cdi.is_empty() || hook {
                gpucr_cdi::write_json_atomic(&config, &spec).map_err(hook_spec::spec_error)?;
            }
        }
        mount_rootfs(&cfg.rootfs, &cfg.bundle)?;
        let init = match &cfg.checkpoint {
            Some(image) => {
                let work = if cfg.opts.criu_work_path.is_empty() {
                    cfg.bundle.join(BUNDLE_CRIU_WORK)
                } else {
                    PathBuf::from(&cfg.opts.criu_work_path)
                };
                InitProcess::armed_restore(RestorePlan {
                    opts: RestoreOpts {
                        checkpoint: CheckpointOpts {
                            image_path: image.clone(),
                            work_path: Some(work),
                            parent_path: cfg.parent_checkpoint.clone(),
                            shell_job: cfg.stdio.terminal,
                            ..Default::default()
                        },
                        bundle: cfg.bundle.clone(),
                        pid_file: cfg.bundle.join("init.pid"),
                        console_socket: None,
                        no_pivot: cfg.opts.no_pivot_root,
                        env: Vec::new(),
                    },
                    records: std::mem::take(&mut records),
                    gpu_pairs: std::mem::take(&mut gpu_pairs),
                    helpers: std::mem::replace(&mut helpers, HelperChoice::NotWanted),
                    store_stage: store_stage.take(),
                })
            }
            None => {
                let pid_file = cfg.bundle.join("init.pid");
                let created = async {
                    let (child, pending) = PendingIo::prepare(
                        &cfg.stdio,
                        IoOwner {
                            id: &cfg.id,
                            namespace: &cfg.namespace,
                            uid: cfg.opts.io_uid,
                            gid: cfg.opts.io_gid,
                        },
                        &spawner,
                    )?;
                    let opts = CreateOpts {
                        bundle: &cfg.bundle,
                        pid_file: &pid_file,
                        console_socket: pending.console_socket(),
                        no_pivot: cfg.opts.no_pivot_root,
                    };
                    runc.create(&cfg.id, opts, child).await?;
                    let io = pending.finish().await?;
                    let pid = read_pid(&pid_file)?;
                    Ok::<_, Error>(InitProcess::created(pid, io))
                }
                .await;
                match created {
                    Ok(init) => init,
                    Err(e) => {
                        let _ = runc.delete(&cfg.id, true).await;
                        unmount_rootfs(&cfg.bundle);
                        return Err(e);
                    }
                }
            }
        };
        let pid = init.pid;
        let observed = std::sync::Mutex::new(init.state());
        let kill_all_on_exit = shares_pid_namespace(&cfg.bundle);
        Ok(Container {
            id: cfg.id,
            bundle: cfg.bundle,
            namespace: cfg.namespace,
            runc,
            opts: cfg.opts,
            stdio: cfg.stdio,
            rootfs: cfg.rootfs,
            gpu,
            deadlines,
            store,
            hook,
            init: Mutex::new(init),
            observed,
            pending_kill: std::sync::Mutex::new(None),
            init_exit: ExitCell::default(),
            init_pid: AtomicU32::new(pid),
            execs: std::sync::Mutex::new(HashMap::new()),
            execs_live: ExecsLive::default(),
            kill_all_on_exit,
            unpacked: std::sync::Mutex::new(None),
        })
    }

    pub fn pid(&self) -> u32 {
        self.init_pid.load(Ordering::SeqCst)
    }

    /// The init's state, without waiting for a verb in progress.
    pub fn state(&self) -> InitState {
        *self.observed.lock().expect("observed lock")
    }

    /// Every change of the init's state goes through here (the lock-free copy follows).
    pub(crate) fn set_state(&self, init: &mut InitProcess, next: InitState) {
        init.phase.set(next);
        *self.observed.lock().expect("observed lock") = next;
    }

    /// Start the init process: `runc start`, or `runc restore` when Create armed one.
    /// `on_pid` registers the new pid with the reaper routing before the lock is released.
    /// `request`: the client's deadline, if it sent one (a restore's deadline).
    pub async fn start(&self, on_pid: impl FnOnce(u32), request: Option<Duration>) -> Result<u32> {
        let mut init = self.init.lock().await;
        let next = init.state().next(TaskVerb::Start)?;
        let restored = match init.phase.restore_plan() {
            Some(plan) => Some(self.restore(plan, request).await),
            None => None,
        };
        if let Some(restored) = restored {
            let (pid, io) = match restored {
                Ok(v) => v,
                Err(e) => {
                    // Nothing to deliver it to.
                    self.pending_kill.lock().expect("pending_kill lock").take();
                    return Err(e);
                }
            };
            init.pid = pid;
            init.io = io;
            // Done with the image (a failed restore keeps it until Delete); removed in the
            // background, Start does not wait for it.
            if let Some(u) = self.unpacked.lock().expect("unpacked lock").as_mut() {
                u.remove_in_background();
            }
        } else {
            self.runc.start(&self.id).await?;
        }
        // Under the pending lock: a Kill either saw the old state and left its signal, or
        // sees Running and signals itself.
        let pending = {
            let mut pending = self.pending_kill.lock().expect("pending_kill lock");
            self.set_state(&mut init, next);
            pending.take()
        };
        self.init_pid.store(init.pid, Ordering::SeqCst);
        on_pid(init.pid);
        if let Some((signal, all)) = pending {
            tracing::info!(id = %self.id, signal, "delivering the kill sent during the restore");
            if let Err(e) = self.runc.kill(&self.id, signal, all).await {
                tracing::warn!(id = %self.id, "kill sent during the restore: {e}");
            }
        }
        Ok(init.pid)
    }

    async fn restore(
        &self,
        plan: &RestorePlan,
        request: Option<Duration>,
    ) -> Result<(u32, crate::io::ProcessIo)> {
        let r = &plan.opts;
        let started = std::time::Instant::now();
        let since = crate::restore_cgroup::boot_ticks();
        let (child, pending) =
            PendingIo::prepare(&self.stdio, self.io_owner(), &self.runc.spawner)?;
        let mut r = r.clone();
        r.console_socket = pending.console_socket().map(Path::to_path_buf);
        match self.gpu.quiescer {
            // The shim gives every restored CUDA process its GPU state back after CRIU;
            // gpucr's CUDA plugin, if installed, stays out of it.
            gpu::Quiescer::Shim => r.env.push((gpu::SHIM_QUIESCED_ENV.into(), "all".into())),
            // A CUDA CRIU plugin restores the GPU state inside `runc restore`: it gets the
            // pairs this host's plan made (gpucr's plugin reads GPUCR_GPU_MAP).
            gpu::Quiescer::CriuPlugin => r.env.extend(gpu::plugin_pair_env(&plan.gpu_pairs)),
        }
        let deadline = self.deadlines.restore(
            crate::manifest::image_bytes(&r.checkpoint.image_path),
            request,
        );
        tracing::info!(id = %self.id, deadline = ?deadline.after,
            deadline_from = %deadline.source, quiescer = ?self.gpu.quiescer, "restore");
        if let Some(w) = &r.checkpoint.work_path {
            std::fs::create_dir_all(w).ctx(|| format!("creating {}", w.display()))?;
        }
        // Started alongside `runc restore` (opening the image and planning take ~35 ms on
        // the H200): they pin their shares of the image while CRIU restores.
        let starting = match (&plan.helpers, plan.hook_copy_in()) {
            (HelperChoice::NotWanted, _) | (_, None) => None,
            (HelperChoice::Unavailable(why), Some(_)) => {
                tracing::info!(id = %self.id, reason = %why, "no copy-in helpers");
                None
            }
            (choice @ HelperChoice::On { .. }, Some(record)) => {
                let (id, image) = (self.id.clone(), r.checkpoint.image_path.clone());
                let (choice, record) = (choice.clone(), record.clone());
                let spawner = self.runc.spawner.clone();
                let driver_bytes = plan.driver_bytes();
                Some(tokio::task::spawn_blocking(move || {
                    RestoreHelpers::start(&id, &image, &choice, &record, driver_bytes, &spawner)
                }))
            }
        };
        let mut helpers = None;
        let res = async {
            let restored = match failpoint::hit(&self.id, failpoint::RESTORE_BEFORE_CRIU).await {
                Ok(()) => {
                    self.runc
                        .restore(&self.id, &r, child, Some(deadline.after))
                        .await
                }
                Err(e) => Err(e),
            };
            if let Some(starting) = starting {
                helpers = starting.await.ok();
            }
            restored?;
            let io = pending.finish().await?;
            let pid = read_pid(&r.pid_file)?;
            let fitted = async {
                failpoint::hit(&self.id, failpoint::RESTORE_AFTER_CRIU).await?;
                self.fit_restored(pid, plan, &mut helpers).await
            };
            let fitted = fitted.await;
            if let Err(e) = fitted {
                // Kill the half-restored tree before it is deleted below.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                return Err(e);
            }
            Ok::<_, Error>((pid, io))
        }
        .await;
        if let Some(helpers) = helpers {
            // Reaped in the background: a helper unpins its share of the image before it
            // exits (0.1–0.2 s on the H200), which the restored task need not wait for.
            tokio::spawn(helpers.finish());
        }
        match res {
            Ok(v) => {
                tracing::info!(id = %self.id, image = %r.checkpoint.image_path.display(),
                    elapsed_ms = started.elapsed().as_millis() as u64, "restored");
                Ok(v)
            }
            Err(e) => {
                // Leave nothing half-created: runc may have registered the container, or,
                // killed mid-way, left its CRIU mount of the rootfs without registering it.
                let _ = self.runc.delete(&self.id, true).await;
                // The tree CRIU forked, wherever it is (on cgroup v2, in the checkpoint's
                // cgroup), then anything else in this restore's own cgroup.
                if let Some(work) = &r.checkpoint.work_path {
                    let log = work.join("restore.log");
                    let tree = crate::restore_cgroup::kill_restored_tree(&log, since);
                    if !tree.is_empty() {
                        tracing::info!(id = %self.id, ?tree,
                            "killed the tree the failed restore forked (CRIU's log names its root)");
                    }
                }
                let orphans = crate::restore_cgroup::kill_spec_cgroup(&self.bundle);
                if !orphans.is_empty() {
                    tracing::info!(id = %self.id, ?orphans,
                        "killed what the failed restore left in the container's cgroup");
                }
                if let Some(work) = &r.checkpoint.work_path {
                    unmount_under(work);
                }
                match self.runc.remove_restore_leftovers(&self.id) {
                    Ok(true) => tracing::info!(id = %self.id,
                        "removed what the failed runc restore left in runc's root"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!(id = %self.id, "{e}"),
                }
                let criu = r
                    .checkpoint
                    .work_path
                    .as_deref()
                    .map(|w| w.join("restore.log"))
                    .and_then(|log| crate::criu_log::first_error(&log).map(|l| (log, l)));
                let msg = match (&e, criu) {
                    (Error::TimedOut { .. }, _) => format!(
                        "{e} (deadline: {}); nothing of the restore was left running; CRIU's \
                         log: {}",
                        deadline.source,
                        r.checkpoint
                            .work_path
                            .as_deref()
                            .map(|w| w.join("restore.log").display().to_string())
                            .unwrap_or_default()
                    ),
                    (_, Some((log, line))) => {
                        format!("{e}; CRIU: {line} (see {})", log.display())
                    }
                    (_, None) => e.to_string(),
                };
                Err(Error::Restore {
                    id: self.id.clone(),
                    image: r.checkpoint.image_path.clone(),
                    msg,
                })
            }
        }
    }

    /// After `runc restore`: this host's device nodes, then the GPU state of the restored CUDA
    /// processes (they wait CHECKPOINTED, their CUDA calls blocked, until the driver gives their
    /// device memory back), then the memory their hooks moved (after the driver's unlock: the
    /// hook's own CUDA calls need it).
    async fn fit_restored(
        &self,
        pid: u32,
        plan: &RestorePlan,
        helpers: &mut Option<RestoreHelpers>,
    ) -> Result<()> {
        crate::restore_cgroup::adopt(&self.runc.root, &self.id, pid)?;
        let refreshed = host::refresh_device_nodes(&self.bundle, pid)?;
        if !refreshed.is_empty() {
            tracing::info!(id = %self.id, nodes = ?refreshed, "device nodes of this host");
        }
        if self.gpu.quiescer != gpu::Quiescer::Shim {
            // CRIU's CUDA plugin restored and unlocked the driver's part already.
            return self.hook_restore(plan, helpers).await;
        }
        // The cgroup's members and the init's descendants: a tree CRIU left outside the
        // container's cgroup (or a pod's layout runc ps misreads) still finds its CUDA processes.
        let mut pids = self.runc.ps(&self.id).await?;
        pids.extend(crate::reaper::tree_of(pid as i32));
        pids.sort_unstable();
        pids.dedup();
        let n = gpu::resume_restored(pids, plan.gpu_pairs.clone()).await?;
        let gpu_expected = plan.gpu_processes();
        if n < gpu_expected {
            return Err(gpu::GpuError::Missing {
                expected: gpu_expected,
                found: n,
            }
            .into());
        }
        if n > 0 {
            tracing::info!(id = %self.id, processes = n, "GPU state restored");
        }
        self.hook_restore(plan, helpers).await
    }

    /// Remap → CopyIn → Thaw for every process whose memory the checkpoint's hooks moved,
    /// with the copy-in helpers started for them (given back in `helpers` to be let go).
    async fn hook_restore(
        &self,
        plan: &RestorePlan,
        helpers: &mut Option<RestoreHelpers>,
    ) -> Result<()> {
        let Some(record) = plan.hook_copy_in().cloned() else {
            return Ok(());
        };
        failpoint::hit(&self.id, failpoint::RESTORE_BEFORE_HOOK_COPY_IN).await?;
        let (id, image) = (self.id.clone(), plan.opts.checkpoint.image_path.clone());
        let sockets = hook_spec::socket_dir(&self.bundle);
        let started = std::time::Instant::now();
        let mut h = helpers.take().unwrap_or_default();
        let (n, h) = tokio::task::spawn_blocking(move || {
            let n = gpu_hook::copy_in_restored(&id, &sockets, &image, &record, &mut h);
            (n, h)
        })
        .await
        .map_err(gpu::GpuError::panicked("hook"))?;
        *helpers = Some(h);
        let n = n?;
        tracing::info!(id = %self.id, processes = n,
            elapsed_ms = started.elapsed().as_millis() as u64, "hook memory restored");
        Ok(())
    }

    fn io_owner(&self) -> IoOwner<'_> {
        IoOwner {
            id: &self.id,
            namespace: &self.namespace,
            uid: self.opts.io_uid,
            gid: self.opts.io_gid,
        }
    }

    pub async fn pause(&self) -> Result<()> {
        let mut init = self.init.lock().await;
        let next = init.state().next(TaskVerb::Pause)?;
        self.runc.pause(&self.id).await?;
        self.set_state(&mut init, next);
        Ok(())
    }

    pub async fn resume(&self) -> Result<()> {
        let mut init = self.init.lock().await;
        let next = init.state().next(TaskVerb::Resume)?;
        self.runc.resume(&self.id).await?;
        let later = init.phase.for_resume().map(std::mem::take);
        self.set_state(&mut init, next);
        let later = later.unwrap_or_default();
        if let Some(q) = later.locked {
            q.unlock().await?;
            tracing::info!(id = %self.id, "GPU unlocked on resume");
        }
        if let Some(h) = later.hook {
            crate::gpu::blocking("hook", move || h.give_back()).await??;
            tracing::info!(id = %self.id, "hook memory given back on resume");
        }
        Ok(())
    }

    /// Kill answers from the recorded state, not under the init lock: a checkpoint or
    /// restore may hold it for minutes, and the signal must still reach the task (a
    /// checkpoint it interrupts fails and says so).
    pub async fn kill(&self, signal: u32, all: bool) -> Result<()> {
        let state = {
            let mut pending = self.pending_kill.lock().expect("pending_kill lock");
            let state = self.state();
            if state == InitState::Stopped {
                return Err(Error::ProcessNotFound {
                    id: self.id.clone(),
                    exec_id: String::new(),
                });
            }
            state.next(TaskVerb::Kill)?;
            if state == InitState::CreatedCheckpoint {
                if self.init.try_lock().is_err() {
                    tracing::info!(id = %self.id, signal, "kill during the restore: delivered \
                        once the task is restored");
                    *pending = Some((signal, all));
                }
                return Ok(()); // nothing runs yet
            }
            state
        };
        let killed = self.runc.kill(&self.id, signal, all).await;
        if signal == libc::SIGKILL as u32 && state == InitState::Paused {
            self.thaw_for_kill().await;
        }
        killed
    }

    /// After a SIGKILL to a paused task: in a frozen cgroup (cgroup v1) the signal takes
    /// effect only at the thaw, and the init of a PID namespace is reaped only once its
    /// frozen processes died — without a thaw no exit ever comes (#27.1: a CRIU that died
    /// mid-dump leaves the init dying in a frozen cgroup). Whether the runtime's own kill
    /// thaws depends on its version, `--all` and what it makes of the dying init, so the
    /// shim thaws itself (containerd's runc shim thaws a paused task whose init exited); the
    /// exit then moves the task to `Stopped`.
    async fn thaw_for_kill(&self) {
        match self.runc.resume(&self.id).await {
            Ok(()) => tracing::info!(id = %self.id, "thawed the paused task it killed"),
            Err(e) => tracing::debug!(id = %self.id, "thaw after SIGKILL: {e}"),
        }
    }

    pub async fn update(&self, resources: &Any) -> Result<()> {
        let init = self.init.lock().await;
        init.state().next(TaskVerb::Update)?;
        let path = self.bundle.join("update-resources.json");
        std::fs::write(&path, &resources.value).ctx(|| format!("writing {}", path.display()))?;
        let res = self.runc.update(&self.id, &path).await;
        let _ = std::fs::remove_file(&path);
        res
    }

    /// Delete the init process: runc delete, unmount, stop stdio. Returns its exit.
    pub async fn delete(&self) -> Result<ExitInfo> {
        let mut init = self.init.lock().await;
        let from = init.state();
        let next = from.next(TaskVerb::Delete)?;
        match from {
            InitState::CreatedCheckpoint => {}
            _ => {
                if let Err(e) = self.runc.delete(&self.id, from == InitState::Created).await {
                    // A container runc no longer knows is already gone: that is a delete.
                    // One runc still holds as paused or running though its init is gone
                    // (a thaw that failed, a CRIU that refroze it) is forced: nothing of it
                    // may outlive the task.
                    match self.runc.state(&self.id).await {
                        Err(_) => {}
                        Ok(st) if st.status != "stopped" && from == InitState::Stopped => {
                            tracing::warn!(id = %self.id, runc_status = %st.status,
                                "deleting with --force: {e}");
                            self.runc.delete(&self.id, true).await?;
                        }
                        Ok(_) => return Err(e),
                    }
                }
            }
        }
        init.io.shutdown();
        self.set_state(&mut init, next);
        drop(init);
        unmount_rootfs(&self.bundle);
        // A restore's image goes before the shim may exit: removed now when the restore
        // never started (or failed), else its removal since Start is waited for.
        let unpacked = self.unpacked.lock().expect("unpacked lock").take();
        if let Some(u) = unpacked {
            u.discard().await;
        }
        let exit = self.init_exit.get().unwrap_or(ExitInfo {
            // Deleted before it ever ran (or killed by runc delete just now).
            status: if from == InitState::Created { 137 } else { 0 },
            at: SystemTime::now(),
        });
        self.init_exit.set(exit);
        Ok(exit)
    }

    /// The reaper saw the init process exit (`execs_live.init_reaped()` was called as it
    /// was routed). Its exit is recorded once nothing of the container can outlive it: the
    /// rest of a shared PID namespace is killed (its orphans would hold the output pipes
    /// open for OUTPUT_DRAIN), and execs starting or running report first.
    pub async fn init_exited(&self, status: i32, at: SystemTime) -> Option<ExitInfo> {
        if self.kill_all_on_exit {
            match self.runc.kill(&self.id, libc::SIGKILL as u32, true).await {
                Ok(()) => tracing::info!(id = %self.id,
                    "init exited in a shared PID namespace: killed the container's other processes"),
                Err(e) => tracing::warn!(id = %self.id,
                    "init exited in a shared PID namespace; killing the rest failed: {e}"),
            }
        }
        self.execs_live.none().await;
        self.record_init_exit(status, at).await
    }

    async fn record_init_exit(&self, status: i32, at: SystemTime) -> Option<ExitInfo> {
        let mut init = self.init.lock().await;
        let was = init.state();
        match was.next(TaskVerb::Exit) {
            Ok(next) => self.set_state(&mut init, next),
            Err(_) => return None, // deleted already: reported by Delete
        }
        // As containerd's runc shim: a frozen cgroup whose init died is thawed, so what is
        // left in it can exit and runc can delete it.
        if was == InitState::Paused {
            if let Err(e) = self.runc.resume(&self.id).await {
                tracing::warn!(id = %self.id, "thawing the paused task whose init exited: {e}");
            }
        }
        let io = std::mem::take(&mut init.io);
        drop(init);
        record_exit(io, &self.init_exit, status, at).await
    }

    // --- exec processes ---

    pub fn exec(&self, exec_id: &str) -> Result<Arc<ExecProcess>> {
        self.execs
            .lock()
            .expect("execs lock")
            .get(exec_id)
            .cloned()
            .ok_or_else(|| Error::ProcessNotFound {
                id: self.id.clone(),
                exec_id: exec_id.to_string(),
            })
    }

    pub async fn add_exec(&self, exec_id: &str, spec: Any, stdio: StdioSpec) -> Result<()> {
        self.init.lock().await.state().next(TaskVerb::Exec)?;
        let mut execs = self.execs.lock().expect("execs lock");
        if execs.contains_key(exec_id) {
            return Err(Error::AlreadyExists(format!("{}/{exec_id}", self.id)));
        }
        execs.insert(
            exec_id.to_string(),
            Arc::new(ExecProcess::new(exec_id.to_string(), spec, stdio)),
        );
        Ok(())
    }

    /// Starts an exec, unless the init exited already; the init's exit waits until this
    /// start failed or the exec's exit was reported (`ExecsLive`).
    pub async fn start_exec(&self, p: &ExecProcess, on_pid: impl FnOnce(u32)) -> Result<u32> {
        self.execs_live.starting(&self.id)?;
        let started = self.run_exec(p, on_pid).await;
        if started.is_err() {
            self.execs_live.done();
        }
        started
    }

    async fn run_exec(&self, p: &ExecProcess, on_pid: impl FnOnce(u32)) -> Result<u32> {
        let mut inner = p.inner.lock().await;
        let next = inner.state.next(TaskVerb::Start)?;
        let process_json = self.bundle.join(format!("exec-{}.json", p.exec_id));
        let pid_file = self.bundle.join(format!("exec-{}.pid", p.exec_id));
        std::fs::write(
            &process_json,
            exec_process_json(&p.spec.value, p.stdio.terminal),
        )
        .ctx(|| format!("writing {}", process_json.display()))?;
        let res = async {
            let (child, pending) =
                PendingIo::prepare(&p.stdio, self.io_owner(), &self.runc.spawner)?;
            let opts = ExecOpts {
                process_json: &process_json,
                pid_file: &pid_file,
                console_socket: pending.console_socket(),
                tty: p.stdio.terminal,
            };
            self.runc.exec(&self.id, opts, child).await?;
            let io = pending.finish().await?;
            let pid = read_pid(&pid_file)?;
            Ok::<_, Error>((pid, io))
        }
        .await;
        let _ = std::fs::remove_file(&process_json);
        let _ = std::fs::remove_file(&pid_file);
        let (pid, io) = res?;
        inner.pid = pid;
        inner.io = io;
        inner.state = next;
        on_pid(pid);
        Ok(pid)
    }

    pub async fn kill_exec(&self, p: &ExecProcess, signal: u32) -> Result<()> {
        let inner = p.inner.lock().await;
        if inner.state == ExecState::Stopped || inner.pid == 0 {
            return Err(Error::ProcessNotFound {
                id: self.id.clone(),
                exec_id: p.exec_id.clone(),
            });
        }
        let sig = nix::sys::signal::Signal::try_from(signal as i32)
            .map_err(|_| Error::invalid(format!("signal {signal} is not a valid signal")))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(inner.pid as i32), sig).map_err(|e| {
            if e == nix::errno::Errno::ESRCH {
                Error::ProcessNotFound {
                    id: self.id.clone(),
                    exec_id: p.exec_id.clone(),
                }
            } else {
                Error::io("kill exec process", e.into())
            }
        })
    }

    pub async fn delete_exec(&self, p: &ExecProcess) -> Result<ExitInfo> {
        let mut inner = p.inner.lock().await;
        let next = inner.state.next(TaskVerb::Delete)?;
        inner.io.shutdown();
        inner.state = next;
        drop(inner);
        self.execs.lock().expect("execs lock").remove(&p.exec_id);
        let exit = p.exit.get().unwrap_or(ExitInfo {
            status: 0,
            at: SystemTime::now(),
        });
        p.exit.set(exit);
        Ok(exit)
    }

    pub async fn exec_exited(
        &self,
        p: &ExecProcess,
        status: i32,
        at: SystemTime,
    ) -> Option<ExitInfo> {
        let mut inner = p.inner.lock().await;
        inner.state = inner.state.next(TaskVerb::Exit).ok()?;
        let io = std::mem::take(&mut inner.io);
        drop(inner);
        record_exit(io, &p.exit, status, at).await
    }
}
