//! The Task service: every RPC of containerd's task API v2, mapped onto `Container` verbs.
//! Errors become ttrpc codes at this one boundary (see error.rs).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant, SystemTime},
};

use async_trait::async_trait;
use containerd_shim::{ExitSignal, TtrpcContext, TtrpcResult};
use containerd_shim_protos::{
    api::{self, *},
    events::task::*,
    protobuf::{well_known_types::any::Any, Message, MessageField},
    shim::oci::ProcessDetails,
    shim_async::Task,
    types::task::ProcessInfo,
};
use gpucr_store::events::Kind;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::{
    container::{Container, CreateConfig},
    deadline::request_timeout,
    error::{Error, Result},
    events::{publish, timestamp, EventSender},
    io::StdioSpec,
    metrics,
    options::{CheckpointRequest, RuntimeOptions},
    reaper::{Exit, Spawner},
    stats,
};

/// Which process a pid belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Owner {
    Init(String),
    Exec(String, String),
}

/// Routes reaped pids to processes. Exits that arrive before their pid is known (the process
/// died while runc was still running) wait in `early` for the registration.
#[derive(Default)]
struct PidTable {
    owners: HashMap<i32, Owner>,
    early: HashMap<i32, Exit>,
}

const EARLY_EXIT_KEEP: Duration = Duration::from_secs(60);

impl PidTable {
    fn register(&mut self, pid: u32, owner: Owner) -> Option<Exit> {
        let pid = pid as i32;
        if let Some(exit) = self.early.remove(&pid) {
            return Some(exit);
        }
        self.owners.insert(pid, owner);
        None
    }

    fn route(&mut self, exit: Exit) -> Option<Owner> {
        if let Some(owner) = self.owners.remove(&exit.pid) {
            return Some(owner);
        }
        // Orphans reparented to the shim land here too: keep them only briefly.
        let now = SystemTime::now();
        self.early.retain(|_, e| {
            now.duration_since(e.at)
                .map(|d| d < EARLY_EXIT_KEEP)
                .unwrap_or(true)
        });
        self.early.insert(exit.pid, exit);
        None
    }

    fn forget(&mut self, owner: &Owner) {
        self.owners.retain(|_, o| o != owner);
    }
}

pub struct Inner {
    namespace: String,
    /// Containers by id. Never held across an await: clone the Arc out.
    containers: RwLock<HashMap<String, Arc<Container>>>,
    pids: Mutex<PidTable>,
    events: Arc<dyn EventSender>,
    spawner: Spawner,
    exit: Arc<ExitSignal>,
    /// OOM watchers send the container id here; one task turns them into TaskOOM events.
    oom: tokio::sync::mpsc::UnboundedSender<String>,
    /// Restores between their Create and their Start (a restore's metrics cover both verbs).
    restores: Mutex<HashMap<String, PendingRestore>>,
}

/// A restore whose Create is done, for its metrics at Start.
struct PendingRestore {
    began: Instant,
    image: PathBuf,
    mode: &'static str,
    /// The image's bytes and GPU bytes, taken at Create (Start may remove containerd's copy).
    bytes: u64,
    gpu_bytes: u64,
}

#[derive(Clone)]
pub struct TaskService {
    inner: Arc<Inner>,
}

impl TaskService {
    pub fn new(
        namespace: String,
        events: Arc<dyn EventSender>,
        spawner: Spawner,
        exit: Arc<ExitSignal>,
        exits: UnboundedReceiver<Exit>,
    ) -> Self {
        let (oom, mut ooms) = tokio::sync::mpsc::unbounded_channel::<String>();
        let inner = Arc::new(Inner {
            namespace,
            containers: RwLock::new(HashMap::new()),
            pids: Mutex::new(PidTable::default()),
            events,
            spawner,
            exit,
            oom,
            restores: Mutex::default(),
        });
        tokio::spawn(process_exits(inner.clone(), exits));
        let events = inner.events.clone();
        tokio::spawn(async move {
            while let Some(container_id) = ooms.recv().await {
                tracing::warn!(id = %container_id, "OOM kill in the container's cgroup");
                publish(
                    events.as_ref(),
                    TaskOOM {
                        container_id,
                        ..Default::default()
                    },
                )
                .await;
            }
        });
        TaskService { inner }
    }
}

/// The one consumer of container-process exits.
async fn process_exits(inner: Arc<Inner>, mut exits: UnboundedReceiver<Exit>) {
    while let Some(exit) = exits.recv().await {
        let owner = inner.pids.lock().expect("pids lock").route(exit);
        if let Some(owner) = owner {
            dispatch_exit(&inner, owner, exit);
        }
    }
}

/// Hands a routed exit to its handler. An init's exit is marked on its container first, in
/// reaping order: an exec Start that comes after it is refused (see `ExecsLive`).
fn dispatch_exit(inner: &Arc<Inner>, owner: Owner, exit: Exit) {
    if let Owner::Init(cid) = &owner {
        if let Ok(c) = inner.container(cid) {
            c.execs_live.init_reaped();
        }
    }
    tokio::spawn(handle_exit(inner.clone(), owner, exit));
}

async fn handle_exit(inner: Arc<Inner>, owner: Owner, exit: Exit) {
    let (cid, exec_id) = match &owner {
        Owner::Init(c) => (c.clone(), None),
        Owner::Exec(c, e) => (c.clone(), Some(e.clone())),
    };
    let Ok(c) = inner.container(&cid) else {
        return;
    };
    let info = match &exec_id {
        None => c.init_exited(exit.status, exit.at).await,
        Some(e) => match c.exec(e) {
            Ok(p) => c.exec_exited(&p, exit.status, exit.at).await,
            Err(_) => None,
        },
    };
    // A started exec counts until its exit is out (or known to be lost): the init's exit
    // waits for it.
    let is_exec = exec_id.is_some();
    let exec_done = || {
        if is_exec {
            c.execs_live.done();
        }
    };
    let Some(info) = info else {
        exec_done();
        return;
    };
    tracing::info!(id = %cid, exec_id = exec_id.as_deref().unwrap_or(""), pid = exit.pid,
        status = info.status, "process exited");
    publish(
        inner.events.as_ref(),
        TaskExit {
            container_id: cid.clone(),
            id: exec_id.unwrap_or(cid),
            pid: exit.pid as u32,
            exit_status: info.status,
            exited_at: MessageField::some(timestamp(info.at)),
            ..Default::default()
        },
    )
    .await;
    exec_done();
}

impl Inner {
    /// Metrics and the event log for one checkpoint or restore (never fails the RPC).
    /// `sizes`: the image's bytes and GPU bytes, counted for a success only.
    fn record(
        &self,
        kind: Kind,
        id: &str,
        (image, mode): (&Path, &'static str),
        began: Instant,
        sizes: (u64, u64),
        r: std::result::Result<(), &Error>,
    ) {
        let (bytes, gpu_bytes) = if r.is_ok() { sizes } else { (0, 0) };
        metrics::record(&metrics::Operation {
            kind,
            container: id,
            namespace: &self.namespace,
            image,
            mode,
            duration: began.elapsed(),
            bytes,
            gpu_bytes,
            error: r.err().map(|e| e.to_string()),
        });
    }

    fn container(&self, id: &str) -> Result<Arc<Container>> {
        self.containers
            .read()
            .expect("containers lock")
            .get(id)
            .cloned()
            .ok_or_else(|| Error::ContainerNotFound(id.to_string()))
    }

    /// Registers a new pid; an exit that beat the registration is handled now.
    fn register(self: &Arc<Self>, pid: u32, owner: Owner) {
        if pid == 0 {
            return;
        }
        let early = self
            .pids
            .lock()
            .expect("pids lock")
            .register(pid, owner.clone());
        if let Some(exit) = early {
            dispatch_exit(self, owner, exit);
        }
    }

    async fn send<E: containerd_shim::event::Event + 'static>(&self, e: E) {
        publish(self.events.as_ref(), e).await
    }
}

/// Moves this shim into `cgroup` (the `ShimCgroup` option, as the Go client's
/// `WithShimCgroup` sends it with the task's Create): a client that names the cgroup only
/// there (containerd 1.7's legacy `CreateOptions`) still finds the shim in it. Idempotent
/// when `start` moved the shim already.
fn move_into_shim_cgroup(id: &str, cgroup: &str) -> Result<()> {
    if cgroup.is_empty() {
        return Ok(());
    }
    let pid = std::process::id();
    containerd_shim::cgroup::add_task_to_cgroup(cgroup, pid).map_err(|e| Error::ShimCgroup {
        pid,
        cgroup: cgroup.to_string(),
        msg: e.to_string(),
    })?;
    tracing::info!(id, pid, cgroup, "shim moved into its cgroup (ShimCgroup)");
    Ok(())
}

impl TaskService {
    pub async fn task_create(&self, req: CreateTaskRequest) -> Result<CreateTaskResponse> {
        let inner = &self.inner;
        if inner.container(&req.id).is_ok() {
            return Err(Error::AlreadyExists(req.id));
        }
        let opts = RuntimeOptions::decode(req.options.as_ref())?;
        move_into_shim_cgroup(&req.id, &opts.shim_cgroup)?;
        let bundle = PathBuf::from(&req.bundle);
        opts.write_to_bundle(&bundle)?;
        let non_empty = |s: &str| Some(PathBuf::from(s)).filter(|p| !p.as_os_str().is_empty());
        let cfg = CreateConfig {
            id: req.id.clone(),
            bundle: bundle.clone(),
            namespace: inner.namespace.clone(),
            rootfs: req.rootfs.clone(),
            stdio: StdioSpec {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
            },
            checkpoint: non_empty(&req.checkpoint),
            parent_checkpoint: non_empty(&req.parent_checkpoint),
            opts,
        };
        let restore = cfg.checkpoint.clone().map(|image| {
            metrics::begin(&req.id);
            // Before Create puts a by-reference image's files back.
            let mode = metrics::image_mode(&image);
            (Instant::now(), image, mode)
        });
        let c = match Container::create(cfg, inner.spawner.clone()).await {
            Ok(c) => Arc::new(c),
            Err(e) => {
                if let Some((began, image, mode)) = &restore {
                    let at = (image.as_path(), *mode);
                    inner.record(Kind::Restore, &req.id, at, *began, (0, 0), Err(&e));
                }
                return Err(e);
            }
        };
        if let Some((began, image, mode)) = restore {
            let pending = PendingRestore {
                bytes: metrics::image_bytes(&image),
                gpu_bytes: metrics::gpu_bytes(&image),
                began,
                image,
                mode,
            };
            inner
                .restores
                .lock()
                .expect("restores lock")
                .insert(req.id.clone(), pending);
        }
        let pid = c.pid();
        inner
            .containers
            .write()
            .expect("containers lock")
            .insert(req.id.clone(), c);
        inner.register(pid, Owner::Init(req.id.clone()));
        if pid != 0 {
            crate::oom::watch(req.id.clone(), pid, inner.oom.clone());
        }
        tracing::info!(id = %req.id, pid, restore = !req.checkpoint.is_empty(), "created");
        inner
            .send(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                io: MessageField::some(TaskIO {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                    ..Default::default()
                }),
                checkpoint: req.checkpoint.clone(),
                pid,
                ..Default::default()
            })
            .await;
        Ok(CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    /// `request`: the client's deadline (a restore's bound), if it sent one.
    pub async fn task_start(
        &self,
        req: StartRequest,
        request: Option<Duration>,
    ) -> Result<StartResponse> {
        let inner = &self.inner;
        let c = inner.container(&req.id)?;
        let pid = if req.exec_id.is_empty() {
            let restoring = c.pid() == 0;
            let started = c
                .start(
                    |pid| inner.register(pid, Owner::Init(req.id.clone())),
                    request,
                )
                .await;
            let restore = restoring
                .then(|| {
                    inner
                        .restores
                        .lock()
                        .expect("restores lock")
                        .remove(&req.id)
                })
                .flatten();
            if let Some(p) = restore {
                inner.record(
                    Kind::Restore,
                    &req.id,
                    (&p.image, p.mode),
                    p.began,
                    (p.bytes, p.gpu_bytes),
                    started.as_ref().map(|_| ()),
                );
            }
            let pid = started?;
            if restoring {
                crate::oom::watch(req.id.clone(), pid, inner.oom.clone());
            }
            tracing::info!(id = %req.id, pid, "started");
            inner
                .send(TaskStart {
                    container_id: req.id.clone(),
                    pid,
                    ..Default::default()
                })
                .await;
            pid
        } else {
            let p = c.exec(&req.exec_id)?;
            let owner = Owner::Exec(req.id.clone(), req.exec_id.clone());
            let pid = c.start_exec(&p, |pid| inner.register(pid, owner)).await?;
            inner
                .send(TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid,
                    ..Default::default()
                })
                .await;
            pid
        };
        Ok(StartResponse {
            pid,
            ..Default::default()
        })
    }

    pub async fn task_delete(&self, req: DeleteRequest) -> Result<DeleteResponse> {
        let inner = &self.inner;
        let c = inner.container(&req.id)?;
        if !req.exec_id.is_empty() {
            let p = c.exec(&req.exec_id)?;
            let pid = p.inner.lock().await.pid;
            let exit = c.delete_exec(&p).await?;
            inner
                .pids
                .lock()
                .expect("pids lock")
                .forget(&Owner::Exec(req.id.clone(), req.exec_id.clone()));
            return Ok(DeleteResponse {
                pid,
                exit_status: exit.status,
                exited_at: MessageField::some(timestamp(exit.at)),
                ..Default::default()
            });
        }
        let pid = c.pid();
        let exit = c.delete().await?;
        inner
            .containers
            .write()
            .expect("containers lock")
            .remove(&req.id);
        inner
            .pids
            .lock()
            .expect("pids lock")
            .forget(&Owner::Init(req.id.clone()));
        tracing::info!(id = %req.id, "deleted");
        inner
            .send(TaskDelete {
                container_id: req.id.clone(),
                pid,
                exit_status: exit.status,
                exited_at: MessageField::some(timestamp(exit.at)),
                id: req.id.clone(),
                ..Default::default()
            })
            .await;
        Ok(DeleteResponse {
            pid,
            exit_status: exit.status,
            exited_at: MessageField::some(timestamp(exit.at)),
            ..Default::default()
        })
    }

    pub async fn task_state(&self, req: StateRequest) -> Result<StateResponse> {
        let c = self.inner.container(&req.id)?;
        if req.exec_id.is_empty() {
            let state = c.state();
            let exit = c.init_exit.get();
            return Ok(StateResponse {
                id: req.id.clone(),
                bundle: c.bundle.to_string_lossy().into_owned(),
                pid: c.pid(),
                status: state.status().into(),
                stdin: c.stdio.stdin.clone(),
                stdout: c.stdio.stdout.clone(),
                stderr: c.stdio.stderr.clone(),
                terminal: c.stdio.terminal,
                exit_status: exit.map(|e| e.status).unwrap_or(0),
                exited_at: MessageField::from_option(exit.map(|e| timestamp(e.at))),
                ..Default::default()
            });
        }
        let p = c.exec(&req.exec_id)?;
        let inner = p.inner.lock().await;
        let exit = p.exit.get();
        Ok(StateResponse {
            id: req.exec_id.clone(),
            bundle: c.bundle.to_string_lossy().into_owned(),
            pid: inner.pid,
            status: inner.state.status().into(),
            stdin: p.stdio.stdin.clone(),
            stdout: p.stdio.stdout.clone(),
            stderr: p.stdio.stderr.clone(),
            terminal: p.stdio.terminal,
            exit_status: exit.map(|e| e.status).unwrap_or(0),
            exited_at: MessageField::from_option(exit.map(|e| timestamp(e.at))),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    pub async fn task_kill(&self, req: KillRequest) -> Result<()> {
        let c = self.inner.container(&req.id)?;
        if req.exec_id.is_empty() {
            c.kill(req.signal, req.all).await
        } else {
            let p = c.exec(&req.exec_id)?;
            c.kill_exec(&p, req.signal).await
        }
    }

    pub async fn task_exec(&self, req: ExecProcessRequest) -> Result<()> {
        let c = self.inner.container(&req.id)?;
        let spec = req.spec.clone().into_option().unwrap_or_default();
        c.add_exec(
            &req.exec_id,
            spec,
            StdioSpec {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
            },
        )
        .await?;
        self.inner
            .send(TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            })
            .await;
        Ok(())
    }

    pub async fn task_resize_pty(&self, req: ResizePtyRequest) -> Result<()> {
        let c = self.inner.container(&req.id)?;
        if req.exec_id.is_empty() {
            c.init.lock().await.io.resize(req.width, req.height)
        } else {
            let p = c.exec(&req.exec_id)?;
            let inner = p.inner.lock().await;
            inner.io.resize(req.width, req.height)
        }
    }

    pub async fn task_close_io(&self, req: CloseIORequest) -> Result<()> {
        let c = self.inner.container(&req.id)?;
        if !req.stdin {
            return Ok(());
        }
        if req.exec_id.is_empty() {
            c.init.lock().await.io.close_stdin();
        } else {
            let p = c.exec(&req.exec_id)?;
            p.inner.lock().await.io.close_stdin();
        }
        Ok(())
    }

    pub async fn task_pause(&self, req: PauseRequest) -> Result<()> {
        let c = self.inner.container(&req.id)?;
        c.pause().await?;
        self.inner
            .send(TaskPaused {
                container_id: req.id.clone(),
                ..Default::default()
            })
            .await;
        Ok(())
    }

    pub async fn task_resume(&self, req: ResumeRequest) -> Result<()> {
        let c = self.inner.container(&req.id)?;
        c.resume().await?;
        self.inner
            .send(TaskResumed {
                container_id: req.id.clone(),
                ..Default::default()
            })
            .await;
        Ok(())
    }

    pub async fn task_update(&self, req: UpdateTaskRequest) -> Result<()> {
        let c = self.inner.container(&req.id)?;
        let resources = req
            .resources
            .as_ref()
            .ok_or_else(|| Error::invalid("update without resources"))?;
        c.update(resources).await
    }

    pub async fn task_wait(&self, req: WaitRequest) -> Result<WaitResponse> {
        let c = self.inner.container(&req.id)?;
        let info = if req.exec_id.is_empty() {
            c.init_exit.wait().await
        } else {
            let p = c.exec(&req.exec_id)?;
            drop(c);
            p.exit.wait().await
        };
        Ok(WaitResponse {
            exit_status: info.status,
            exited_at: MessageField::some(timestamp(info.at)),
            ..Default::default()
        })
    }

    pub async fn task_pids(&self, req: PidsRequest) -> Result<PidsResponse> {
        let c = self.inner.container(&req.id)?;
        // A restore armed at Create has no runc container until its Start: no processes
        // yet (an error here would make a restarted containerd clean the task up as leaked).
        let pids = if c.pid() == 0 {
            Vec::new()
        } else {
            c.runc.ps(&req.id).await?
        };
        let mut exec_pids = HashMap::new();
        let execs: Vec<_> = c
            .execs
            .lock()
            .expect("execs lock")
            .values()
            .cloned()
            .collect();
        for p in execs {
            let pid = p.inner.lock().await.pid;
            if pid != 0 {
                exec_pids.insert(pid, p.exec_id.clone());
            }
        }
        let processes = pids
            .into_iter()
            .map(|pid| {
                let info = exec_pids.get(&(pid as u32)).map(|exec_id| Any {
                    type_url: "containerd.runc.v1.ProcessDetails".into(),
                    value: ProcessDetails {
                        exec_id: exec_id.clone(),
                        ..Default::default()
                    }
                    .write_to_bytes()
                    .unwrap_or_default(),
                    ..Default::default()
                });
                ProcessInfo {
                    pid: pid as u32,
                    info: MessageField::from_option(info),
                    ..Default::default()
                }
            })
            .collect();
        Ok(PidsResponse {
            processes,
            ..Default::default()
        })
    }

    pub async fn task_stats(&self, req: StatsRequest) -> Result<StatsResponse> {
        let c = self.inner.container(&req.id)?;
        let sample = c.runc.stats(&req.id).await?;
        Ok(StatsResponse {
            stats: MessageField::some(stats::to_metrics_any(&sample, stats::cgroup_v2())?),
            ..Default::default()
        })
    }

    /// `request`: the client's deadline (the dump's bound), if it sent one.
    pub async fn task_checkpoint(
        &self,
        req: CheckpointTaskRequest,
        request: Option<Duration>,
    ) -> Result<()> {
        let c = self.inner.container(&req.id)?;
        let opts = CheckpointRequest::decode(req.options.as_ref())?;
        let image = if !opts.image_path.is_empty() {
            PathBuf::from(&opts.image_path)
        } else if !req.path.is_empty() {
            PathBuf::from(&req.path)
        } else {
            return Err(Error::invalid(
                "checkpoint needs a path (CheckpointTaskRequest.path or options.image_path)",
            ));
        };
        let began = Instant::now();
        metrics::begin(&req.id);
        let done = c.checkpoint(&image, &opts, request).await;
        let sizes = match &done {
            Ok(()) => (metrics::image_bytes(&image), metrics::gpu_bytes(&image)),
            Err(_) => (0, 0),
        };
        self.inner.record(
            Kind::Checkpoint,
            &req.id,
            (&image, metrics::mode_label(c.store.mode)),
            began,
            sizes,
            done.as_ref().map(|_| ()),
        );
        done?;
        self.inner
            .send(TaskCheckpointed {
                container_id: req.id.clone(),
                checkpoint: image.to_string_lossy().into_owned(),
                ..Default::default()
            })
            .await;
        Ok(())
    }

    pub async fn task_connect(&self, req: ConnectRequest) -> Result<ConnectResponse> {
        let task_pid = self.inner.container(&req.id).map(|c| c.pid()).unwrap_or(0);
        Ok(ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        })
    }

    pub async fn task_shutdown(&self, _req: ShutdownRequest) -> Result<()> {
        if !self
            .inner
            .containers
            .read()
            .expect("containers lock")
            .is_empty()
        {
            return Ok(());
        }
        tracing::info!("no containers left: shim exits");
        self.inner.exit.signal();
        Ok(())
    }
}

fn rpc<T>(r: Result<T>) -> TtrpcResult<T> {
    r.map_err(|e| {
        // A failed or refused restore is what an operator looks for in containerd's log
        // (containerd only hands it to the client; a failed checkpoint is logged where it
        // fails); the rest (NotFound for a process already gone, …) is routine.
        if e.is_restore() {
            tracing::warn!("{e}");
        } else {
            tracing::debug!("rpc error: {e}");
        }
        e.into()
    })
}

#[async_trait]
impl Task for TaskService {
    async fn state(&self, _: &TtrpcContext, r: StateRequest) -> TtrpcResult<StateResponse> {
        rpc(self.task_state(r).await)
    }
    async fn create(
        &self,
        _: &TtrpcContext,
        r: CreateTaskRequest,
    ) -> TtrpcResult<CreateTaskResponse> {
        rpc(self.task_create(r).await)
    }
    async fn start(&self, ctx: &TtrpcContext, r: StartRequest) -> TtrpcResult<StartResponse> {
        rpc(self.task_start(r, request_timeout(ctx.timeout_nano)).await)
    }
    async fn delete(&self, _: &TtrpcContext, r: DeleteRequest) -> TtrpcResult<DeleteResponse> {
        rpc(self.task_delete(r).await)
    }
    async fn pids(&self, _: &TtrpcContext, r: PidsRequest) -> TtrpcResult<PidsResponse> {
        rpc(self.task_pids(r).await)
    }
    async fn pause(&self, _: &TtrpcContext, r: PauseRequest) -> TtrpcResult<api::Empty> {
        rpc(self.task_pause(r).await).map(|_| api::Empty::new())
    }
    async fn resume(&self, _: &TtrpcContext, r: ResumeRequest) -> TtrpcResult<api::Empty> {
        rpc(self.task_resume(r).await).map(|_| api::Empty::new())
    }
    async fn checkpoint(
        &self,
        ctx: &TtrpcContext,
        r: CheckpointTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        // Runs to its end on its own: ttrpc drops a request's future when its connection
        // closes (containerd restarted), and a checkpoint dropped mid-way would leave the
        // GPU locked and checkpointed and the task frozen, with no rollback.
        let (this, request) = (self.clone(), request_timeout(ctx.timeout_nano));
        let waiting = Waiting::default();
        let gone = waiting.gone.clone();
        let (id, image) = (r.id.clone(), PathBuf::from(&r.path));
        let done = tokio::spawn(async move {
            let res = this.task_checkpoint(r, request).await;
            if gone.load(std::sync::atomic::Ordering::SeqCst) {
                remove_orphaned_image(&id, &image);
            }
            res
        })
        .await
        .unwrap_or_else(|e| {
            Err(Error::Runtime {
                op: "checkpoint",
                msg: format!("the checkpoint's task ended: {e}"),
            })
        });
        waiting.answered();
        rpc(done).map(|_| api::Empty::new())
    }
    async fn kill(&self, _: &TtrpcContext, r: KillRequest) -> TtrpcResult<api::Empty> {
        rpc(self.task_kill(r).await).map(|_| api::Empty::new())
    }
    async fn exec(&self, _: &TtrpcContext, r: ExecProcessRequest) -> TtrpcResult<api::Empty> {
        rpc(self.task_exec(r).await).map(|_| api::Empty::new())
    }
    async fn resize_pty(&self, _: &TtrpcContext, r: ResizePtyRequest) -> TtrpcResult<api::Empty> {
        rpc(self.task_resize_pty(r).await).map(|_| api::Empty::new())
    }
    async fn close_io(&self, _: &TtrpcContext, r: CloseIORequest) -> TtrpcResult<api::Empty> {
        rpc(self.task_close_io(r).await).map(|_| api::Empty::new())
    }
    async fn update(&self, _: &TtrpcContext, r: UpdateTaskRequest) -> TtrpcResult<api::Empty> {
        rpc(self.task_update(r).await).map(|_| api::Empty::new())
    }
    async fn wait(&self, _: &TtrpcContext, r: WaitRequest) -> TtrpcResult<WaitResponse> {
        rpc(self.task_wait(r).await)
    }
    async fn stats(&self, _: &TtrpcContext, r: StatsRequest) -> TtrpcResult<StatsResponse> {
        rpc(self.task_stats(r).await)
    }
    async fn connect(&self, _: &TtrpcContext, r: ConnectRequest) -> TtrpcResult<ConnectResponse> {
        rpc(self.task_connect(r).await)
    }
    async fn shutdown(&self, _: &TtrpcContext, r: ShutdownRequest) -> TtrpcResult<api::Empty> {
        rpc(self.task_shutdown(r).await).map(|_| api::Empty::new())
    }
}

/// Set when a Checkpoint request's future is dropped before it answered: its client
/// (containerd) is gone and nobody will read the image it asked for.
#[derive(Default)]
struct Waiting {
    gone: Arc<std::sync::atomic::AtomicBool>,
    answered: bool,
}

impl Waiting {
    fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.answered {
            self.gone.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// A checkpoint finished after containerd went away: the directory containerd made for it
/// (`ctrd-checkpoint*`, removed by containerd once it has stored the image) has no reader
/// left, so it goes. A directory the client named (`--image-path`) is the client's.
fn remove_orphaned_image(id: &str, image: &Path) {
    let ours = image
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("ctrd-checkpoint"));
    if !ours {
        tracing::warn!(%id, image = %image.display(),
            "the checkpoint finished after its client went away; the image is kept");
        return;
    }
    match std::fs::remove_dir_all(image) {
        Ok(()) => tracing::warn!(%id, image = %image.display(),
            "the checkpoint finished after containerd went away; its temporary image was removed"),
        Err(e) => tracing::warn!(%id, image = %image.display(), error = %e,
            "cannot remove the temporary image of a checkpoint whose containerd went away"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_before_registration_is_not_lost() {
        let mut t = PidTable::default();
        let exit = Exit {
            pid: 42,
            status: 1,
            at: SystemTime::now(),
        };
        assert_eq!(t.route(exit), None);
        let got = t.register(42, Owner::Init("c".into())).unwrap();
        assert_eq!(got.status, 1);
        // Registered normally: the exit is routed once, then forgotten.
        assert!(t
            .register(43, Owner::Exec("c".into(), "e".into()))
            .is_none());
        let e2 = Exit { pid: 43, ..exit };
        assert_eq!(t.route(e2), Some(Owner::Exec("c".into(), "e".into())));
        assert_eq!(t.route(e2), None);
    }
}
