//! The shim binary's lifecycle (containerd's `start` and `delete` actions, `-info`, `-v`
//! and the serving process), on the `containerd-shim` crate's `Shim` trait.
//!
//! `start` is ours rather than the crate's `spawn`: the crate reads the options on stdin as
//! `containerd.runc.v1.Options` whatever their type (so CRI's TOML text became a cgroup
//! path) and leaves the serving shim behind when start fails after spawning it.

use std::{
    os::unix::fs::FileTypeExt,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use containerd_shim::{
    protos::{
        protobuf::{
            well_known_types::{any::Any, timestamp::Timestamp},
            MessageField,
        },
        types::introspection::{RuntimeInfo, RuntimeVersion},
    },
    publisher::RemotePublisher,
    util::write_str_to_file,
    Config, DeleteResponse, ExitSignal, Flags, StartOpts,
};
use tokio::{
    io::AsyncReadExt,
    process::{Child, Command},
    signal::unix::{signal, SignalKind},
};

use crate::{
    error::{Error, Result},
    events::{timestamp, Publisher},
    options::{self, RuntimeOptions},
    reaper::{Reaper, Spawner},
    runc::Runc,
    task::TaskService,
    RUNTIME_ID,
};

/// Annotations that put containers of one pod into one shim.
const GROUP_ANNOTATIONS: [&str; 2] = [
    "io.containerd.gpucr.v2.group",
    "io.kubernetes.cri.sandbox-id",
];
/// The serving shim's socket address, in the bundle; the crate removes the socket it names
/// when the shim exits.
const ADDRESS_FILE: &str = "address";
/// How long `start` waits for the serving shim to listen. It takes milliseconds; this only
/// bounds a shim stuck before serving, which would otherwise outlive a start that failed.
const SERVE_TIMEOUT: Duration = Duration::from_secs(30);
/// `runc delete --force` in `shim delete`: containerd kills the whole command at 5 s.
const DELETE_SHIM_RUNC_DEADLINE: Duration = Duration::from_secs(3);
/// The type URL containerd registers for the OCI runtime features (JSON-encoded).
const FEATURES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/features/Features";

/// Why containerd's `start` action failed. containerd prints it in the failing RPC's error
/// (RunPodSandbox, `ctr run`), so each says what to check.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("reading the runtime options from stdin: {0}")]
    Stdin(#[source] std::io::Error),
    #[error("finding the bundle (the start action's working directory): {0}")]
    Bundle(#[source] std::io::Error),
    #[error("runtime options of container {id}: {source}")]
    Options {
        id: String,
        #[source]
        source: Error,
    },
    #[error("spawning the serving shim {exe}: {source}")]
    Spawn {
        exe: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "moving the shim (pid {pid}) into cgroup {cgroup}, the ShimCgroup runtime option: {msg}; \
         create that cgroup or remove ShimCgroup from the runtime's options"
    )]
    Cgroup {
        pid: u32,
        cgroup: String,
        msg: String,
    },
    #[error("adjusting the OOM score of the shim (pid {pid}): {msg}")]
    OomScore { pid: u32, msg: String },
    #[error(
        "the serving shim (pid {pid}) did not listen on {address} within {timeout:?}; \
         it was killed, see containerd's log for the shim's own log"
    )]
    ServeTimeout {
        pid: u32,
        address: String,
        timeout: Duration,
    },
    #[error(
        "the serving shim (pid {pid}) {status} before listening on {address}; \
         see containerd's log for the shim's own log"
    )]
    ServerDied {
        pid: u32,
        address: String,
        status: String,
    },
    #[error("writing the shim address to {ADDRESS_FILE} in the bundle: {0}")]
    AddressFile(String),
}

impl From<StartError> for containerd_shim::Error {
    fn from(e: StartError) -> Self {
        match e {
            StartError::Options { .. } => containerd_shim::Error::InvalidArgument(e.to_string()),
            _ => containerd_shim::Error::Other(e.to_string()),
        }
    }
}

pub struct Service {
    id: String,
    namespace: String,
    debug: bool,
    exit: Arc<ExitSignal>,
}

/// The shim group of the container whose bundle is `bundle`: its pod, or itself.
fn grouping(bundle: &Path, id: &str) -> String {
    let spec: Option<serde_json::Value> = std::fs::read(bundle.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let annotations = spec.as_ref().and_then(|s| s.get("annotations"));
    GROUP_ANNOTATIONS
        .iter()
        .find_map(|k| annotations?.get(*k)?.as_str().map(str::to_string))
        .filter(|g| !g.is_empty())
        .unwrap_or_else(|| id.to_string())
}

/// containerd's `start` action: decode the options containerd sent, then either find the
/// pod's serving shim or spawn one, and return the socket address that containerd dials.
/// Writes nothing to stdout or stderr: containerd 1.7 reads both as the address.
async fn start(opts: &StartOpts, stdin: &[u8], bundle: &Path) -> Result<String, StartError> {
    // Every check that needs no process runs first: a start refused here leaves nothing.
    let options = options::start_options(stdin, &opts.id, &opts.namespace)
        .and_then(|any| RuntimeOptions::decode(any.as_ref()))
        .map_err(|source| StartError::Options {
            id: opts.id.clone(),
            source,
        })?;
    let group = grouping(bundle, &opts.id);
    let address = containerd_shim::socket_address(&opts.address, &opts.namespace, &group);
    if socket_answers(&address).await {
        // The pod's shim serves this container too; it keeps its own cgroup.
        write_address(bundle, &address).await?;
        return Ok(address);
    }
    let child = spawn_server(opts, bundle, &address)?;
    match serve(child, &options, bundle, &address).await {
        Ok(()) => Ok(address),
        Err((child, e)) => {
            abandon(child, bundle, &address).await;
            Err(e)
        }
    }
}

/// Re-executes this binary as the serving shim, in its own process group so that a signal
/// to containerd's group (Ctrl-C on a foreground containerd) does not stop every shim.
fn spawn_server(opts: &StartOpts, bundle: &Path, address: &str) -> Result<Child, StartError> {
    let exe = std::env::current_exe().map_err(|source| StartError::Spawn {
        exe: PathBuf::from("/proc/self/exe"),
        source,
    })?;
    let mut cmd = Command::new(&exe);
    cmd.current_dir(bundle)
        .stdin(Stdio::null())
        // The server closes this pipe once it listens (the crate dup2s stderr onto stdout).
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .args(["-namespace", &opts.namespace, "-id", &opts.id])
        .args(["-address", &opts.address, "-socket", address]);
    if opts.debug {
        cmd.arg("-debug");
    }
    cmd.spawn()
        .map_err(|source| StartError::Spawn { exe, source })
}

/// Puts the spawned shim where its options say, then waits until it listens. On failure the
/// child comes back for `abandon`.
async fn serve(
    mut child: Child,
    options: &RuntimeOptions,
    bundle: &Path,
    address: &str,
) -> std::result::Result<(), (Child, StartError)> {
    let pid = child.id().unwrap_or(0);
    if !options.shim_cgroup.is_empty() {
        if let Err(e) = containerd_shim::cgroup::add_task_to_cgroup(&options.shim_cgroup, pid) {
            let e = StartError::Cgroup {
                pid,
                cgroup: options.shim_cgroup.clone(),
                msg: e.to_string(),
            };
            return Err((child, e));
        }
    }
    if let Err(e) = containerd_shim::cgroup::adjust_oom_score(pid) {
        let msg = e.to_string();
        return Err((child, StartError::OomScore { pid, msg }));
    }
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let mut sink = Vec::new();
    // EOF comes when the server listens, and also when it dies first: the socket tells which.
    if tokio::time::timeout(SERVE_TIMEOUT, stdout.read_to_end(&mut sink))
        .await
        .is_err()
    {
        let e = StartError::ServeTimeout {
            pid,
            address: address.to_string(),
            timeout: SERVE_TIMEOUT,
        };
        return Err((child, e));
    }
    if !socket_answers(address).await {
        let status = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
        let status = match status {
            Ok(Ok(s)) => describe_exit(s),
            _ => "stopped answering".to_string(),
        };
        let e = StartError::ServerDied {
            pid,
            address: address.to_string(),
            status,
        };
        return Err((child, e));
    }
    if let Err(e) = write_address(bundle, address).await {
        return Err((child, e));
    }
    Ok(())
}

/// Undoes a failed start: the server is killed (it may already be gone) and reaped, then
/// its socket and the address file are removed, so kubelet's retries do not pile shims up.
async fn abandon(mut child: Child, bundle: &Path, address: &str) {
    let _ = child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    remove_stale_socket(address).await;
    let _ = tokio::fs::remove_file(bundle.join(ADDRESS_FILE)).await;
}

fn describe_exit(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => format!("exited ({s})"),
    }
}

async fn write_address(bundle: &Path, address: &str) -> Result<(), StartError> {
    write_str_to_file(bundle.join(ADDRESS_FILE), address)
        .await
        .map_err(|e| StartError::AddressFile(e.to_string()))
}

fn socket_path(address: &str) -> &str {
    address.strip_prefix("unix://").unwrap_or(address)
}

/// Whether a shim listens on `address` (the pod's shim, or the one just spawned).
async fn socket_answers(address: &str) -> bool {
    tokio::net::UnixStream::connect(socket_path(address))
        .await
        .is_ok()
}

/// Removes the socket file at `address` unless a process still listens on it: after a
/// failed start that is another start's shim, found by the spawned one, not ours.
async fn remove_stale_socket(address: &str) {
    let path = socket_path(address);
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    if is_socket && !socket_answers(address).await {
        let _ = std::fs::remove_file(path);
    }
}

/// `-info`: the `containerd.types.RuntimeInfo` that containerd 2.x's introspection service
/// reports for this runtime (CRI reads the OCI runtime's features from it, e.g. for
/// idmapped and recursive read-only mounts). `stdin` holds the runtime options, or nothing.
pub fn runtime_info(stdin: &[u8]) -> Result<RuntimeInfo> {
    let any = options::options_any(stdin)?;
    let opts = RuntimeOptions::decode(any.as_ref())?;
    Ok(RuntimeInfo {
        name: RUNTIME_ID.to_string(),
        version: MessageField::some(RuntimeVersion {
            version: env!("CARGO_PKG_VERSION").to_string(),
            revision: REVISION.unwrap_or_default().to_string(),
            ..Default::default()
        }),
        options: MessageField::from_option(any),
        features: MessageField::from_option(runc_features(opts.binary())?),
        ..Default::default()
    })
}

/// The git revision, when the build sets `GPUCR_GIT_REVISION`.
const REVISION: Option<&str> = option_env!("GPUCR_GIT_REVISION");

/// `<runc> features` as containerd's runc shim reports it: the JSON, under the type URL that
/// containerd decodes it by. An OCI runtime without `features` only costs the detection.
fn runc_features(binary: &str) -> Result<Option<Any>> {
    let out = std::process::Command::new(binary)
        .arg("features")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::invalid(format!(
                "runtime binary {binary:?} not found; install it or set BinaryName in the \
                 runtime's options"
            )))
        }
        Err(e) => return Err(Error::io(format!("running {binary} features"), e)),
    };
    let json = serde_json::from_slice::<serde_json::Value>(&out.stdout).is_ok();
    Ok((out.status.success() && json).then(|| Any {
        type_url: FEATURES_TYPE_URL.to_string(),
        value: out.stdout,
        ..Default::default()
    }))
}

/// `-v`, in the layout of containerd's own shims.
pub fn version_text(argv0: &str) -> String {
    let name = Path::new(argv0)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| argv0.to_string());
    let mut text = format!("{name}:\n  Version:  {}\n", env!("CARGO_PKG_VERSION"));
    if let Some(rev) = REVISION {
        text.push_str(&format!("  Revision: {rev}\n"));
    }
    text.push('\n');
    text
}

/// SIGTERM and SIGINT end the serving shim as they end containerd's runc shim: through the
/// same exit as Shutdown, whatever containers it still has. containerd sees the connection
/// close and runs this binary's `delete`, which force-deletes them (`delete_shim`). The
/// crate's own handler only logs these signals, which left `kill -TERM` without effect.
fn exit_on_signals(exit: Arc<ExitSignal>, id: String) -> std::io::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(id = %id, signal = name,
            "exit signal: the shim exits; containerd's delete removes any container left");
        exit.signal();
    });
    Ok(())
}

#[async_trait]
impl containerd_shim::Shim for Service {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Service {
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            debug: args.debug,
            exit: Arc::new(ExitSignal::default()),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        let mut stdin = Vec::new();
        tokio::io::stdin()
            .read_to_end(&mut stdin)
            .await
            .map_err(StartError::Stdin)?;
        let bundle = std::env::current_dir().map_err(StartError::Bundle)?;
        Ok(start(&opts, &stdin, &bundle).await?)
    }

    /// containerd could not reach the shim (it crashed or was killed): clean up after it.
    async fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        let bundle =
            std::env::current_dir().map_err(|e| containerd_shim::Error::Other(e.to_string()))?;
        let opts = RuntimeOptions::read_from_bundle(&bundle);
        let runc = Runc {
            binary: opts.binary().to_string(),
            root: opts.runc_root(&self.namespace),
            systemd_cgroup: opts.systemd_cgroup,
            log: bundle.join("log.json"),
            spawner: Spawner::Plain,
        };
        // containerd kills this command after 5 s: the rootfs first (a lazy unmount never
        // blocks), then what the dead shim left running (a checkpoint's or restore's runc
        // and CRIU, which hold the container's processes seized), then runc's state.
        crate::container::unmount_rootfs(&bundle);
        crate::container::unmount_under(&bundle.join(crate::container::BUNDLE_CRIU_WORK));
        for pid in runc.orphans() {
            let killed = crate::reaper::kill_tree(pid);
            eprintln!(
                "gpucr: {}: killed the dead shim's runc and CRIU {killed:?}",
                self.id
            );
        }
        if let Err(e) = runc
            .delete_within(&self.id, true, Some(DELETE_SHIM_RUNC_DEADLINE))
            .await
        {
            // Already gone from runc is fine; anything else is worth a line in the log.
            eprintln!("gpucr: runc delete --force {}: {e}", self.id);
        }
        // A restore the dead shim was running: runc killed with it left CRIU's rootfs mount.
        if let Err(e) = runc.remove_restore_leftovers(&self.id) {
            eprintln!("gpucr: {}: {e}", self.id);
        }
        crate::unpacked::discard_recorded(&bundle).await;
        // A killed shim leaves its socket (the crate removes it only on a clean exit): gone
        // unless another shim of the pod listens there.
        if let Ok(address) = std::fs::read_to_string(bundle.join(ADDRESS_FILE)) {
            remove_stale_socket(address.trim()).await;
        }
        let pid = std::fs::read_to_string(bundle.join("init.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let exited_at: Timestamp = timestamp(std::time::SystemTime::now());
        Ok(DeleteResponse {
            pid,
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: Some(exited_at).into(),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> TaskService {
        crate::logger::init(self.debug);
        let (reaper, exits) = Reaper::start().expect("SIGCHLD handler");
        tracing::info!(id = %self.id, namespace = %self.namespace, pid = std::process::id(),
            "gpucr shim serving");
        if let Err(e) = exit_on_signals(self.exit.clone(), self.id.clone()) {
            tracing::warn!(id = %self.id, error = %e,
                "SIGTERM/SIGINT handler: the shim will only exit on Shutdown");
        }
        TaskService::new(
            self.namespace.clone(),
            Arc::new(Publisher {
                remote: publisher,
                namespace: self.namespace.clone(),
            }),
            Spawner::Reaped(reaper),
            self.exit.clone(),
            exits,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_share_a_shim() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(grouping(dir.path(), "c1"), "c1");
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"annotations":{"io.kubernetes.cri.sandbox-id":"pod-1"}}"#,
        )
        .unwrap();
        assert_eq!(grouping(dir.path(), "c1"), "pod-1");
    }

    fn start_opts(id: &str) -> StartOpts {
        StartOpts {
            id: id.into(),
            publish_binary: String::new(),
            address: "/run/containerd/containerd.sock".into(),
            ttrpc_address: String::new(),
            namespace: "k8s.io".into(),
            debug: false,
        }
    }

    fn sh(script: &str) -> Child {
        Command::new("sh")
            .args(["-c", script])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    }

    fn gone(pid: u32) -> bool {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_err()
    }

    #[tokio::test]
    async fn a_refused_option_spawns_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut buf = Vec::new();
        {
            let mut os = protobuf::CodedOutputStream::vec(&mut buf);
            os.write_bytes(3, b"BinaryName = 'runc'\nShimCgroups = '/x'\n")
                .unwrap();
            os.flush().unwrap();
        }
        let any = Any {
            type_url: "runtimeoptions.v1.Options".into(),
            value: buf,
            ..Default::default()
        };
        let stdin = protobuf::Message::write_to_bytes(&any).unwrap();
        let e = start(&start_opts("c1"), &stdin, dir.path())
            .await
            .unwrap_err();
        assert!(matches!(e, StartError::Options { .. }), "{e}");
        assert!(e.to_string().contains("\"ShimCgroups\""), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let e = containerd_shim::Error::from(e);
        assert!(matches!(e, containerd_shim::Error::InvalidArgument(_)));
    }

    #[tokio::test]
    async fn a_server_that_dies_is_reaped_and_its_socket_removed() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s");
        // A socket file nobody listens on, as a killed server leaves it.
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        let address = format!("unix://{}", sock.display());
        std::fs::write(dir.path().join(ADDRESS_FILE), &address).unwrap();
        let child = sh("exit 3");
        let pid = child.id().unwrap();
        let (child, e) = serve(child, &RuntimeOptions::default(), dir.path(), &address)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("exited with status 3"), "{e}");
        abandon(child, dir.path(), &address).await;
        assert!(gone(pid));
        assert!(!sock.exists());
        assert!(!dir.path().join(ADDRESS_FILE).exists());
    }

    #[tokio::test]
    async fn a_failed_cgroup_move_kills_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let address = format!("unix://{}/s", dir.path().display());
        let child = sh("sleep 100");
        let pid = child.id().unwrap();
        let options = RuntimeOptions {
            shim_cgroup: "/gpucr-test-no-such-cgroup".into(),
            ..Default::default()
        };
        let (child, e) = serve(child, &options, dir.path(), &address)
            .await
            .unwrap_err();
        assert!(matches!(e, StartError::Cgroup { .. }), "{e}");
        assert!(e.to_string().contains("/gpucr-test-no-such-cgroup"), "{e}");
        abandon(child, dir.path(), &address).await;
        assert!(gone(pid));
    }

    #[tokio::test]
    async fn a_listening_server_is_kept_and_its_socket_too() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s");
        let _listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let address = format!("unix://{}", sock.display());
        // Closing stdout is how the server says it listens.
        serve(
            sh("exec >&-; sleep 0.1"),
            &RuntimeOptions::default(),
            dir.path(),
            &address,
        )
        .await
        .map_err(|(_, e)| e)
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join(ADDRESS_FILE)).unwrap(),
            address
        );
        // A socket someone listens on survives a failed start that found it.
        remove_stale_socket(&address).await;
        assert!(sock.exists());
    }

    #[test]
    fn info_is_a_runtime_info_with_the_runtime_s_features() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("fake-runc");
        std::fs::write(&fake, "#!/bin/sh\necho '{\"ociVersionMin\": \"1.0.0\"}'\n").unwrap();
        let mut perm = std::fs::metadata(&fake).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&fake, perm).unwrap();
        let opts = containerd_shim::protos::shim::oci::Options {
            binary_name: fake.display().to_string(),
            ..Default::default()
        };
        let any = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: protobuf::Message::write_to_bytes(&opts).unwrap(),
            ..Default::default()
        };
        let stdin = protobuf::Message::write_to_bytes(&any).unwrap();
        // A fork elsewhere in the tests may still hold the script open for writing (ETXTBSY).
        let info = (0..50)
            .find_map(|_| {
                let r = runtime_info(&stdin);
                if r.is_err() {
                    std::thread::sleep(Duration::from_millis(20));
                }
                r.ok()
            })
            .expect("runtime_info");
        let bytes = protobuf::Message::write_to_bytes(&info).unwrap();
        let info: RuntimeInfo = protobuf::Message::parse_from_bytes(&bytes).unwrap();
        assert_eq!(info.name, RUNTIME_ID);
        assert_eq!(info.version.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(info.options.type_url, "containerd.runc.v1.Options");
        assert_eq!(info.features.type_url, FEATURES_TYPE_URL);
        let features: serde_json::Value = serde_json::from_slice(&info.features.value).unwrap();
        assert_eq!(features["ociVersionMin"], "1.0.0");

        let missing = containerd_shim::protos::shim::oci::Options {
            binary_name: dir.path().join("none").display().to_string(),
            ..Default::default()
        };
        let any = Any {
            value: protobuf::Message::write_to_bytes(&missing).unwrap(),
            ..any
        };
        let e = runtime_info(&protobuf::Message::write_to_bytes(&any).unwrap()).unwrap_err();
        assert!(e.to_string().contains("set BinaryName"), "{e}");
    }

    #[test]
    fn version_names_the_binary() {
        let v = version_text("/usr/local/bin/containerd-shim-gpucr-v2");
        assert!(
            v.starts_with("containerd-shim-gpucr-v2:\n  Version:  "),
            "{v}"
        );
    }

    #[tokio::test]
    async fn sigterm_ends_the_shim() {
        let exit = Arc::new(ExitSignal::default());
        exit_on_signals(exit.clone(), "c1".into()).unwrap();
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).unwrap();
        tokio::time::timeout(Duration::from_secs(5), exit.wait())
            .await
            .expect("SIGTERM signals the exit");
    }
}
