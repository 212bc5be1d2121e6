//! The Task API calls only containerd's Go client can make, sent to a task's shim over
//! ttrpc as that client's daemon forwards them (exec with a terminal and no stdin, CloseIO,
//! legacy option types), with gpucr and the stock runc shim side by side in one test.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use containerd_shim_protos::api::{
    CloseIORequest, DeleteRequest, ExecProcessRequest, StartRequest, StateRequest, Status,
    WaitRequest,
};
use containerd_shim_protos::ttrpc::context;
use protobuf::well_known_types::any::Any;
use serde_json::Value;

use crate::containerd::{runtime_under_test, Containerd, GPUCR_RUNTIME, RUNC_RUNTIME};
use crate::error::{HarnessError, Result};

/// containerd's type URL for an OCI `Process` in JSON (typeurl's registration).
const PROCESS_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Process";
const RPC_TIMEOUT_NS: i64 = 30_000_000_000;

/// The runtimes a side-by-side test runs its scenario with: gpucr then the runc shim (the
/// reference), or only the runc shim when `GPUCR_TEST_RUNTIME` names it.
pub fn side_by_side() -> Vec<&'static str> {
    if runtime_under_test() == RUNC_RUNTIME {
        vec![RUNC_RUNTIME]
    } else {
        vec![GPUCR_RUNTIME, RUNC_RUNTIME]
    }
}

impl Containerd {
    /// `ctr run -d --runtime <runtime>` with extra `flags`; output to a log file as
    /// [`Containerd::run_detached`].
    pub fn run_detached_on(
        &self,
        runtime: &str,
        id: &str,
        image: &str,
        flags: &[&str],
        args: &[&str],
    ) -> Result<()> {
        let log = self.dir().join(format!("{id}.log"));
        self.ctr_cmd()
            .args(["run", "-d", "--runtime", runtime])
            .arg(format!("--log-uri=file://{}", log.display()))
            .args(flags)
            .arg(image)
            .arg(id)
            .args(args)
            .run_ok()?;
        self.wait_status(id, "RUNNING")
    }

    /// A ttrpc connection to task `id`'s shim.
    pub fn task_rpc(&self, id: &str) -> Result<TaskRpc> {
        let address = self.shim_address(id)?;
        let client = crate::shim_client::TaskApi::connect(&address)?;
        Ok(TaskRpc {
            client,
            address,
            namespace: self.namespace().to_owned(),
            id: id.to_owned(),
            bundle: self.bundle(id),
        })
    }

    /// [`Containerd::run_detached_on`] of the counter workload; waits until it counts.
    pub fn run_counter_on(&self, runtime: &str, id: &str, image: &str) -> Result<()> {
        let args = crate::task::counter_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run_detached_on(runtime, id, image, &[], &args)?;
        self.wait_counter_above(id, 0).map(drop)
    }
}

/// Task RPCs of one task, straight to its shim.
pub struct TaskRpc {
    /// Task v2 or v3, whichever the shim serves (containerd 2.x's runc shim: v3 only).
    pub client: crate::shim_client::TaskApi,
    address: String,
    namespace: String,
    pub id: String,
    bundle: PathBuf,
}

/// Stdio of an exec as containerd's `cio` gives it: fifo paths, empty for none.
#[derive(Debug, Default, Clone)]
pub struct ExecIo {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

impl TaskRpc {
    /// A second connection to the same shim (for a call made from another thread).
    pub fn reconnect(&self) -> Result<TaskRpc> {
        let client = crate::shim_client::TaskApi::connect(&self.address)?;
        Ok(TaskRpc {
            client,
            address: self.address.clone(),
            namespace: self.namespace.clone(),
            id: self.id.clone(),
            bundle: self.bundle.clone(),
        })
    }

    pub fn ctx(&self) -> context::Context {
        let mut ctx = context::with_timeout(RPC_TIMEOUT_NS);
        ctx.add(
            "containerd-namespace-ttrpc".to_owned(),
            self.namespace.clone(),
        );
        ctx
    }

    /// The container's own process spec with `args` and `terminal`: what a Go client's
    /// `task.Exec` sends (it starts from the container's spec).
    pub fn process_spec(&self, args: &[&str], terminal: bool) -> Result<Vec<u8>> {
        let path = self.bundle.join("config.json");
        let spec: Value = serde_json::from_slice(
            &std::fs::read(&path).map_err(HarnessError::io("read bundle spec", &path))?,
        )?;
        let mut process = spec["process"].clone();
        process["args"] = serde_json::json!(args);
        process["terminal"] = Value::Bool(terminal);
        Ok(serde_json::to_vec(&process)?)
    }

    /// The Exec RPC (adds the process; Start runs it).
    pub fn exec(&self, exec_id: &str, spec: Vec<u8>, io: &ExecIo) -> Result<()> {
        let req = ExecProcessRequest {
            id: self.id.clone(),
            exec_id: exec_id.to_owned(),
            terminal: io.terminal,
            stdin: io.stdin.clone(),
            stdout: io.stdout.clone(),
            stderr: io.stderr.clone(),
            spec: protobuf::MessageField::some(Any {
                type_url: PROCESS_TYPE_URL.to_owned(),
                value: spec,
                ..Default::default()
            }),
            ..Default::default()
        };
        self.client.exec(self.ctx(), &req)?;
        Ok(())
    }

    /// Start of the init (`exec_id` empty) or of an exec; the pid.
    pub fn start(&self, exec_id: &str) -> Result<u32> {
        let req = StartRequest {
            id: self.id.clone(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        Ok(self.client.start(self.ctx(), &req)?.pid)
    }

    /// Wait for the init or an exec; its exit status.
    pub fn wait(&self, exec_id: &str) -> Result<u32> {
        let req = WaitRequest {
            id: self.id.clone(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        Ok(self.client.wait(self.ctx(), &req)?.exit_status)
    }

    pub fn status(&self, exec_id: &str) -> Result<Status> {
        let req = StateRequest {
            id: self.id.clone(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        Ok(self
            .client
            .state(self.ctx(), &req)?
            .status
            .enum_value_or_default())
    }

    /// `task.CloseIO(ctx, WithStdinCloser)` of an exec.
    pub fn close_stdin(&self, exec_id: &str) -> Result<()> {
        let req = CloseIORequest {
            id: self.id.clone(),
            exec_id: exec_id.to_owned(),
            stdin: true,
            ..Default::default()
        };
        self.client.close_io(self.ctx(), &req)?;
        Ok(())
    }

    /// Delete of an exec; its exit status.
    pub fn delete_exec(&self, exec_id: &str) -> Result<u32> {
        let req = DeleteRequest {
            id: self.id.clone(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        Ok(self.client.delete(self.ctx(), &req)?.exit_status)
    }
}

/// A fifo made the way containerd's `cio` makes them.
pub fn mkfifo(path: &Path) -> Result<()> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| HarnessError::Unexpected(format!("fifo path: {e}")))?;
    // SAFETY: mkfifo(3) on a NUL-terminated path we own.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(HarnessError::io("mkfifo", path)(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The client's read end of an output fifo, opened before the process starts (never
/// blocks, sees no EOF while the shim holds its writer).
pub fn open_output(path: &Path) -> Result<File> {
    File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(HarnessError::io("open output fifo", path))
}

/// The client's write end of a stdin fifo (read-write: opening never waits for the shim).
pub fn open_input(path: &Path) -> Result<File> {
    File::options()
        .read(true)
        .write(true)
        .open(path)
        .map_err(HarnessError::io("open stdin fifo", path))
}

/// Reads `fifo` until `done` holds for what was read or `timeout` passes; what was read.
pub fn read_until(fifo: &mut File, timeout: Duration, done: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !done(&got) && Instant::now() < deadline {
        match fifo.read(&mut buf) {
            Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
            // Nothing yet (no writer yet, or nothing written).
            _ => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    got
}
