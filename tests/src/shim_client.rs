//! Talking to a task's shim directly over ttrpc, for calls `ctr` 1.7 lacks (`Update`).

use containerd_shim_protos::api::{self, UpdateTaskRequest};
use containerd_shim_protos::shim_sync::{Client, TaskClient};
use containerd_shim_protos::ttrpc::context;
use protobuf::well_known_types::any::Any;
use serde_json::json;

use serde_json::Value;

use crate::containerd::Containerd;
use crate::error::{HarnessError, Result};

/// containerd's ttrpc metadata key for the namespace.
const NAMESPACE_HEADER: &str = "containerd-namespace-ttrpc";
/// Type URL containerd uses for JSON `LinuxResources`.
const LINUX_RESOURCES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";
const RPC_TIMEOUT_NS: i64 = 10_000_000_000;

impl Containerd {
    /// The shim's ttrpc address, from the `address` file in the task's bundle, or (the runc
    /// shim of containerd 2.x, which writes none) from its `bootstrap.json`.
    pub fn shim_address(&self, id: &str) -> Result<String> {
        let bundle = self.bundle(id);
        let path = bundle.join("address");
        match std::fs::read_to_string(&path) {
            Ok(address) => Ok(address.trim().to_owned()),
            Err(e) => {
                let bootstrap = bundle.join("bootstrap.json");
                let Ok(text) = std::fs::read(&bootstrap) else {
                    return Err(HarnessError::io("read shim address file", &path)(e));
                };
                let v: Value = serde_json::from_slice(&text)?;
                v["address"].as_str().map(str::to_owned).ok_or_else(|| {
                    HarnessError::Unexpected(format!("no address in {}", bootstrap.display()))
                })
            }
        }
    }

    /// A ttrpc Task client connected to the shim of task `id`, and a call context carrying
    /// this daemon's namespace.
    pub fn shim_client(&self, id: &str) -> Result<(TaskClient, context::Context)> {
        connect(&self.shim_address(id)?, self.namespace(), RPC_TIMEOUT_NS)
    }

    /// Sets the task's memory limit through the shim's `Update` RPC, the way containerd's
    /// `Task.Update` forwards `LinuxResources` (JSON in an `Any`).
    pub fn update_memory_limit(&self, id: &str, limit: u64) -> Result<()> {
        let (client, ctx) = self.shim_client(id)?;
        let resources = json!({ "memory": { "limit": limit } });
        let request = UpdateTaskRequest {
            id: id.to_owned(),
            resources: protobuf::MessageField::some(Any {
                type_url: LINUX_RESOURCES_TYPE_URL.to_owned(),
                value: serde_json::to_vec(&resources)?,
                ..Default::default()
            }),
            ..Default::default()
        };
        client.update(ctx, &request)?;
        Ok(())
    }
}

/// A ttrpc Task client connected to the shim at `address` and a call context for
/// `namespace` that times out after `timeout_ns`.
pub fn connect(
    address: &str,
    namespace: &str,
    timeout_ns: i64,
) -> Result<(TaskClient, context::Context)> {
    let client = Client::connect(address)?;
    let mut ctx = context::with_timeout(timeout_ns);
    ctx.add(NAMESPACE_HEADER.to_owned(), namespace.to_owned());
    Ok((TaskClient::new(client), ctx))
}

/// The Task API of one shim, whichever version it serves: gpucr and containerd 1.7's runc
/// shim serve `containerd.task.v2.Task`, containerd 2.x's runc shim only
/// `containerd.task.v3.Task` (the same messages). The first call finds out.
pub struct TaskApi {
    client: Client,
    v3: std::sync::atomic::AtomicBool,
}

const TASK_V2: &str = "containerd.task.v2.Task";
const TASK_V3: &str = "containerd.task.v3.Task";

macro_rules! task_calls {
    ($($name:ident($method:literal, $req:ty) -> $resp:ty;)*) => {
        $(
            pub fn $name(
                &self,
                ctx: context::Context,
                req: &$req,
            ) -> containerd_shim_protos::ttrpc::Result<$resp> {
                self.call(ctx, $method, req)
            }
        )*
    };
}

impl TaskApi {
    pub fn connect(address: &str) -> Result<TaskApi> {
        Ok(TaskApi {
            client: Client::connect(address)?,
            v3: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn request<Q: protobuf::Message, R: protobuf::Message>(
        &self,
        ctx: &context::Context,
        service: &str,
        method: &str,
        req: &Q,
    ) -> containerd_shim_protos::ttrpc::Result<R> {
        use containerd_shim_protos::ttrpc::{context::to_pb, Error, Request};
        let mut creq = Request::new();
        creq.set_service(service.to_owned());
        creq.set_method(method.to_owned());
        creq.set_timeout_nano(ctx.timeout_nano);
        creq.set_metadata(to_pb(ctx.metadata.clone()));
        creq.payload = req
            .write_to_bytes()
            .map_err(|e| Error::Others(format!("encoding {method}: {e}")))?;
        let res = self.client.request(creq)?;
        R::parse_from_bytes(&res.payload)
            .map_err(|e| Error::Others(format!("decoding {method}'s reply: {e}")))
    }

    fn call<Q: protobuf::Message, R: protobuf::Message>(
        &self,
        ctx: context::Context,
        method: &str,
        req: &Q,
    ) -> containerd_shim_protos::ttrpc::Result<R> {
        use std::sync::atomic::Ordering;
        if self.v3.load(Ordering::Relaxed) {
            return self.request(&ctx, TASK_V3, method, req);
        }
        match self.request(&ctx, TASK_V2, method, req) {
            Err(containerd_shim_protos::ttrpc::Error::RpcStatus(st))
                if st.code() == containerd_shim_protos::ttrpc::Code::UNIMPLEMENTED
                    && st.message().contains(TASK_V2) =>
            {
                self.v3.store(true, Ordering::Relaxed);
                self.request(&ctx, TASK_V3, method, req)
            }
            other => other,
        }
    }

    task_calls! {
        state("State", api::StateRequest) -> api::StateResponse;
        start("Start", api::StartRequest) -> api::StartResponse;
        delete("Delete", api::DeleteRequest) -> api::DeleteResponse;
        exec("Exec", api::ExecProcessRequest) -> api::Empty;
        close_io("CloseIO", api::CloseIORequest) -> api::Empty;
        wait("Wait", api::WaitRequest) -> api::WaitResponse;
        kill("Kill", api::KillRequest) -> api::Empty;
        checkpoint("Checkpoint", api::CheckpointTaskRequest) -> api::Empty;
        update("Update", api::UpdateTaskRequest) -> api::Empty;
        connect_task("Connect", api::ConnectRequest) -> api::ConnectResponse;
    }
}

/// The shim's Checkpoint RPC for task `id` into directory `dir` with `flags`, as containerd
/// 2.x's daemon forwards it (path = the image path, `CheckpointOptions`), and nothing else:
/// no Pause before it, no Resume after it.
pub fn checkpoint_over_ttrpc(
    client: &TaskClient,
    ctx: context::Context,
    id: &str,
    dir: &std::path::Path,
    flags: &CheckpointFlags<'_>,
) -> Result<()> {
    let options = containerd_shim_protos::shim::oci::CheckpointOptions {
        exit: flags.exit,
        image_path: dir.to_string_lossy().into_owned(),
        work_path: flags
            .work_path
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default(),
        ..Default::default()
    };
    let request = containerd_shim_protos::api::CheckpointTaskRequest {
        id: id.to_owned(),
        path: dir.to_string_lossy().into_owned(),
        options: protobuf::MessageField::some(Any {
            type_url: "containerd.runc.v1.CheckpointOptions".to_owned(),
            value: protobuf::Message::write_to_bytes(&options)
                .map_err(|e| HarnessError::Unexpected(format!("encoding options: {e}")))?,
            ..Default::default()
        }),
        ..Default::default()
    };
    client.checkpoint(ctx, &request)?;
    Ok(())
}

/// Flags of `ctr task checkpoint` that travel as `containerd.runc.v1.CheckpointOptions`.
#[derive(Debug, Default, Clone)]
pub struct CheckpointFlags<'a> {
    pub exit: bool,
    pub image_path: Option<&'a std::path::Path>,
    pub work_path: Option<&'a std::path::Path>,
}

/// Where a checkpoint went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointOutcome {
    /// An image in the content store (`ctr task checkpoint` without `--image-path`).
    Stored(String),
    /// A CRIU image directory.
    Dir(std::path::PathBuf),
}

impl Containerd {
    /// True when this `ctr` sends `--exit`/`--image-path`/`--work-path` to the runtime under
    /// test: containerd 1.7's ctr does so only for runtimes named `io.containerd.runc.*`
    /// (2.x for every runtime).
    pub fn ctr_forwards_checkpoint_flags(&self) -> bool {
        if self.runtime().starts_with("io.containerd.runc.") {
            return true;
        }
        let version = self
            .ctr(&["--version"])
            .map(|o| o.stdout)
            .unwrap_or_default();
        let major = version.split_whitespace().nth(2).and_then(|v| {
            v.trim_start_matches('v')
                .split('.')
                .next()?
                .parse::<u32>()
                .ok()
        });
        major.is_some_and(|m| m >= 2)
    }

    /// `ctr task checkpoint` with `flags`. Where this ctr would drop the flags (1.7 with a
    /// non-runc runtime), sends the request containerd 2.x's daemon forwards for them — path =
    /// the image path (a fresh directory when none is given) and `CheckpointOptions` — to the
    /// shim over ttrpc instead, so the shim's handling of the options is what is tested.
    pub fn checkpoint_with_flags(
        &self,
        id: &str,
        flags: &CheckpointFlags<'_>,
    ) -> Result<CheckpointOutcome> {
        if self.ctr_forwards_checkpoint_flags() {
            let image = flags.image_path.map(|p| p.to_string_lossy().into_owned());
            let work = flags.work_path.map(|p| p.to_string_lossy().into_owned());
            let mut extra: Vec<&str> = Vec::new();
            if flags.exit {
                extra.push("--exit");
            }
            if let Some(i) = &image {
                extra.extend(["--image-path", i.as_str()]);
            }
            if let Some(w) = &work {
                extra.extend(["--work-path", w.as_str()]);
            }
            let stored = self.task_checkpoint(id, &extra)?;
            return Ok(match (stored, flags.image_path) {
                (Some(name), _) => CheckpointOutcome::Stored(name),
                (None, Some(dir)) => CheckpointOutcome::Dir(dir.to_path_buf()),
                (None, None) => {
                    return Err(HarnessError::Unexpected(format!(
                        "ctr task checkpoint {id} stored no image"
                    )))
                }
            });
        }
        let dir = match flags.image_path {
            Some(p) => p.to_path_buf(),
            None => self.dir().join(format!("ckpt-{id}-{}", std::process::id())),
        };
        self.shim_checkpoint(id, &dir, flags)?;
        Ok(CheckpointOutcome::Dir(dir))
    }

    /// [`Containerd::checkpoint_with_flags`] into the image directory `dir`, leaving the task
    /// running (containerd 2.x's ctr also keeps the image in its content store).
    pub fn checkpoint_into(&self, id: &str, dir: &std::path::Path) -> Result<CheckpointOutcome> {
        let flags = CheckpointFlags {
            image_path: Some(dir),
            ..Default::default()
        };
        self.checkpoint_with_flags(id, &flags)
    }

    /// The shim's Checkpoint RPC into directory `dir` with `flags`, straight over ttrpc:
    /// unlike containerd's client (ctr, CRI), nothing pauses the task first.
    pub fn shim_checkpoint(
        &self,
        id: &str,
        dir: &std::path::Path,
        flags: &CheckpointFlags<'_>,
    ) -> Result<()> {
        let (client, ctx) = self.shim_client(id)?;
        checkpoint_over_ttrpc(&client, ctx, id, dir, flags)
    }

    /// Restores container `id` (which must not exist) from a checkpoint `outcome`; `image` and
    /// `spec_json` describe the container for a directory checkpoint.
    pub fn restore_outcome(
        &self,
        id: &str,
        outcome: &CheckpointOutcome,
        image: &str,
        spec_json: &[u8],
    ) -> Result<()> {
        match outcome {
            CheckpointOutcome::Stored(name) => self.restore_task_checkpoint(id, name, true),
            CheckpointOutcome::Dir(dir) => self.restore_from_image_path(id, dir, image, spec_json),
        }
    }
}
