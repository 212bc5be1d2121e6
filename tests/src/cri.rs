//! kubelet's side of CRI, for the tests: a client of containerd 2.x's CRI service (the
//! `runtime.v1` API of the `k8s-cri` crate, over the daemon's unix socket) making the calls
//! kubelet makes, with the fields kubelet fills in; the test config that enables CRI with
//! `runc` and `gpucr` runtime handlers and a loopback registry; and the images CRI pulls
//! from it (busybox, a pause image, checkpoint images built from an archive).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The CRI API's types (`runtime.v1`).
pub use k8s_cri::v1 as api;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{self as cri, NamespaceMode};
use serde_json::json;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::error::{HarnessError, Result};
use crate::image::{image_manifest, Blob, BusyboxImage, MEDIA_CONFIG};
use crate::registry::Registry;

/// The annotation containerd (2.1+) looks for on a checkpoint OCI image.
pub const CHECKPOINT_ANNOTATION: &str = "org.criu.checkpoint.container.name";
/// An uncompressed OCI layer (what `buildah add` of an archive gives).
pub const MEDIA_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
/// CRI's namespace in containerd.
pub const CRI_NAMESPACE: &str = "k8s.io";

/// A blocking CRI client (its own tokio runtime).
pub struct CriClient {
    rt: tokio::runtime::Runtime,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
}

fn grpc(call: &str) -> impl FnOnce(tonic::Status) -> HarnessError + '_ {
    move |s| HarnessError::Unexpected(format!("CRI {call}: {:?}: {}", s.code(), s.message()))
}

impl CriClient {
    /// Connects to the CRI service on containerd's socket.
    pub fn connect(socket: &Path) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(HarnessError::io("tokio runtime", "<cri client>"))?;
        let socket = socket.to_path_buf();
        let channel = rt
            .block_on(async move {
                Endpoint::from_static("http://[::]:50051")
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let socket = socket.clone();
                        async move {
                            let stream = tokio::net::UnixStream::connect(socket).await?;
                            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                        }
                    }))
                    .await
            })
            .map_err(|e| HarnessError::Unexpected(format!("connecting to CRI: {e}")))?;
        Ok(Self {
            rt,
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
        })
    }

    /// Connects once containerd's CRI service answers `Version` (it starts after the daemon's
    /// socket), trying for up to `timeout`.
    pub fn connect_ready(socket: &Path, timeout: std::time::Duration) -> Result<Self> {
        let mut client = None;
        crate::poll_until("CRI answers Version", timeout, || {
            Ok(
                match Self::connect(socket).and_then(|mut c| {
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
        })?;
        client.ok_or_else(|| HarnessError::Unexpected("no CRI client".into()))
    }

    /// The container's init pid (ContainerStatus's verbose info).
    pub fn container_pid(&mut self, id: &str) -> Result<u32> {
        let status = self.container_status(id)?;
        let info = status
            .info
            .get("info")
            .ok_or_else(|| HarnessError::Unexpected(format!("{id}: no verbose info")))?;
        let info: serde_json::Value = serde_json::from_str(info)?;
        info["pid"]
            .as_u64()
            .map(|p| p as u32)
            .ok_or_else(|| HarnessError::Unexpected(format!("{id}: no pid in the verbose info")))
    }

    /// `Version`: the runtime's name and version.
    pub fn version(&mut self) -> Result<cri::VersionResponse> {
        let req = cri::VersionRequest {
            version: "v1".into(),
        };
        let resp = self.rt.block_on(self.runtime.version(req));
        Ok(resp.map_err(grpc("Version"))?.into_inner())
    }

    /// `RunPodSandbox` with the pod's runtime handler (its RuntimeClass); the sandbox id.
    pub fn run_pod_sandbox(
        &mut self,
        config: &cri::PodSandboxConfig,
        handler: &str,
    ) -> Result<String> {
        let req = cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.into(),
        };
        let resp = self.rt.block_on(self.runtime.run_pod_sandbox(req));
        Ok(resp
            .map_err(grpc("RunPodSandbox"))?
            .into_inner()
            .pod_sandbox_id)
    }

    /// `PullImage` as kubelet sends it (with the pod's config); the image ref.
    pub fn pull_image(&mut self, image: &str, pod: &cri::PodSandboxConfig) -> Result<String> {
        let req = cri::PullImageRequest {
            image: Some(cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            auth: None,
            sandbox_config: Some(pod.clone()),
        };
        let resp = self.rt.block_on(self.images.pull_image(req));
        Ok(resp.map_err(grpc("PullImage"))?.into_inner().image_ref)
    }

    /// `CreateContainer`; the container id.
    pub fn create_container(
        &mut self,
        sandbox: &str,
        config: &cri::ContainerConfig,
        pod: &cri::PodSandboxConfig,
    ) -> Result<String> {
        let req = cri::CreateContainerRequest {
            pod_sandbox_id: sandbox.into(),
            config: Some(config.clone()),
            sandbox_config: Some(pod.clone()),
        };
        let resp = self.rt.block_on(self.runtime.create_container(req));
        Ok(resp
            .map_err(grpc("CreateContainer"))?
            .into_inner()
            .container_id)
    }

    /// `StartContainer`.
    pub fn start_container(&mut self, id: &str) -> Result<()> {
        let req = cri::StartContainerRequest {
            container_id: id.into(),
        };
        let resp = self.rt.block_on(self.runtime.start_container(req));
        resp.map_err(grpc("StartContainer")).map(drop)
    }

    /// `CheckpointContainer` to `location` (kubelet: `timeout` 0, CRI's default, unless the
    /// API call gave one).
    pub fn checkpoint_container(&mut self, id: &str, location: &Path, timeout: i64) -> Result<()> {
        let req = cri::CheckpointContainerRequest {
            container_id: id.into(),
            location: location.to_string_lossy().into_owned(),
            timeout,
        };
        let resp = self.rt.block_on(self.runtime.checkpoint_container(req));
        resp.map_err(grpc("CheckpointContainer")).map(drop)
    }

    /// `ContainerStatus` (verbose: containerd's info too).
    pub fn container_status(&mut self, id: &str) -> Result<cri::ContainerStatusResponse> {
        let req = cri::ContainerStatusRequest {
            container_id: id.into(),
            verbose: true,
        };
        let resp = self.rt.block_on(self.runtime.container_status(req));
        Ok(resp.map_err(grpc("ContainerStatus"))?.into_inner())
    }

    /// `ExecSync`: stdout of `cmd` in the container, which must exit 0.
    pub fn exec_sync(&mut self, id: &str, cmd: &[&str]) -> Result<String> {
        let req = cri::ExecSyncRequest {
            container_id: id.into(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: 10,
        };
        let resp = self.rt.block_on(self.runtime.exec_sync(req));
        let resp = resp.map_err(grpc("ExecSync"))?.into_inner();
        if resp.exit_code != 0 {
            return Err(HarnessError::Unexpected(format!(
                "ExecSync {cmd:?} in {id}: exit {}: {}",
                resp.exit_code,
                String::from_utf8_lossy(&resp.stderr)
            )));
        }
        Ok(String::from_utf8_lossy(&resp.stdout).into_owned())
    }

    /// `StopPodSandbox` + `RemovePodSandbox` (its containers go with it), as kubelet does
    /// when a pod is deleted.
    pub fn remove_pod(&mut self, sandbox: &str) -> Result<()> {
        let stop = cri::StopPodSandboxRequest {
            pod_sandbox_id: sandbox.into(),
        };
        let resp = self.rt.block_on(self.runtime.stop_pod_sandbox(stop));
        resp.map_err(grpc("StopPodSandbox"))?;
        let remove = cri::RemovePodSandboxRequest {
            pod_sandbox_id: sandbox.into(),
        };
        let resp = self.rt.block_on(self.runtime.remove_pod_sandbox(remove));
        resp.map_err(grpc("RemovePodSandbox")).map(drop)
    }
}

/// A pod as kubelet describes it: metadata, the kubelet labels, a log directory, the host's
/// network (`hostNetwork: true`: no CNI here), the container's own pid namespace, a cgroupfs parent.
pub fn pod_config(
    name: &str,
    uid: &str,
    log_dir: &Path,
    cgroup_parent: &str,
) -> cri::PodSandboxConfig {
    let namespace = "default";
    let labels = HashMap::from([
        ("io.kubernetes.pod.name".to_owned(), name.to_owned()),
        (
            "io.kubernetes.pod.namespace".to_owned(),
            namespace.to_owned(),
        ),
        ("io.kubernetes.pod.uid".to_owned(), uid.to_owned()),
    ]);
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            uid: uid.into(),
            namespace: namespace.into(),
            attempt: 0,
        }),
        // kubelet leaves the hostname empty for a pod on the host's network (the host's UTS).
        hostname: String::new(),
        log_directory: log_dir.to_string_lossy().into_owned(),
        labels,
        annotations: HashMap::from([("kubernetes.io/config.source".to_owned(), "api".to_owned())]),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: cgroup_parent.into(),
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(namespaces()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn namespaces() -> cri::NamespaceOption {
    cri::NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

/// A container as kubelet describes it: metadata, the image, argv, kubelet's labels and
/// annotations, a log path under the pod's log directory.
pub fn container_config(
    name: &str,
    image: &str,
    args: &[String],
    pod: &cri::PodSandboxConfig,
) -> cri::ContainerConfig {
    let meta = pod.metadata.clone().unwrap_or_default();
    let labels = HashMap::from([
        ("io.kubernetes.container.name".to_owned(), name.to_owned()),
        ("io.kubernetes.pod.name".to_owned(), meta.name.clone()),
        (
            "io.kubernetes.pod.namespace".to_owned(),
            meta.namespace.clone(),
        ),
        ("io.kubernetes.pod.uid".to_owned(), meta.uid.clone()),
    ]);
    let annotations = HashMap::from([
        (
            "io.kubernetes.container.hash".to_owned(),
            "5f1a2b3c".to_owned(),
        ),
        (
            "io.kubernetes.container.restartCount".to_owned(),
            "0".to_owned(),
        ),
        (
            "io.kubernetes.container.terminationMessagePath".to_owned(),
            "/dev/termination-log".to_owned(),
        ),
    ]);
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: image.into(),
            user_specified_image: image.into(),
            ..Default::default()
        }),
        args: args.to_vec(),
        log_path: format!("{name}/0.log"),
        labels,
        annotations,
        linux: Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: Some(namespaces()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// kubelet's archive name: `checkpoint-<pod>_<namespace>-<container>-<RFC 3339 time>.tar`
/// (under /var/lib/kubelet/checkpoints on a node; `dir` here).
pub fn kubelet_checkpoint_path(dir: &Path, pod: &str, namespace: &str, container: &str) -> PathBuf {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    dir.join(format!(
        "checkpoint-{pod}_{namespace}-{container}-{}.tar",
        rfc3339(now.as_secs())
    ))
}

/// `YYYY-MM-DDTHH:MM:SSZ` of a Unix time (civil-from-days, UTC).
fn rfc3339(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// An image of one layer over busybox's: `config` is the image config's `config` object.
fn busybox_variant(config: serde_json::Value) -> Result<(Blob, Blob)> {
    let base = BusyboxImage::get()?;
    let mut image: serde_json::Value = serde_json::from_slice(&base.config.bytes)?;
    image["config"] = config;
    let config = Blob::new(MEDIA_CONFIG, serde_json::to_vec(&image)?);
    Ok((image_manifest(&config, &[&base.layer], None)?, config))
}

/// Puts busybox (`gpucr/busybox:test`) and a pause image (`gpucr/pause:test`: busybox's
/// `sleep`, the sandbox's process) into `registry`; returns their references.
pub fn push_test_images(registry: &Registry) -> Result<(String, String)> {
    let base = BusyboxImage::get()?;
    registry.push(
        "gpucr/busybox",
        "test",
        &base.manifest,
        &[&base.config, &base.layer],
    );
    let (manifest, config) = busybox_variant(json!({
        "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
        "Entrypoint": ["/bin/sleep", "2000000000"],
        "WorkingDir": "/",
    }))?;
    registry.push("gpucr/pause", "test", &manifest, &[&config, &base.layer]);
    Ok((
        registry.reference("gpucr/busybox", "test"),
        registry.reference("gpucr/pause", "test"),
    ))
}

/// The checkpoint OCI image kubelet's users build from an archive (`buildah from scratch`,
/// `buildah add <ctr> <archive> /`, `buildah config --annotation
/// org.criu.checkpoint.container.name=<name>`, `buildah commit`): one uncompressed layer that
/// is the archive, the annotation on the manifest. Pushed as `<repository>:<tag>`.
pub fn push_checkpoint_image(
    registry: &Registry,
    archive: Vec<u8>,
    container_name: &str,
    repository: &str,
    tag: &str,
) -> Result<String> {
    // An uncompressed layer's diff_id is its digest: hashed once.
    let layer = Blob::new(MEDIA_LAYER_TAR, archive);
    // The platform of the images the harness builds (busybox's).
    let base: serde_json::Value = serde_json::from_slice(&BusyboxImage::get()?.config.bytes)?;
    let config = json!({
        "architecture": base["architecture"],
        "os": "linux",
        "config": {},
        "rootfs": { "type": "layers", "diff_ids": [layer.digest] },
    });
    let config = Blob::new(MEDIA_CONFIG, serde_json::to_vec(&config)?);
    let annotations = json!({ CHECKPOINT_ANNOTATION: container_name });
    let manifest = image_manifest(&config, &[&layer], Some(annotations))?;
    registry.push(repository, tag, &manifest, &[&config, &layer]);
    Ok(registry.reference(repository, tag))
}

/// A CRI runtime handler of the test config.
#[derive(Debug, Clone)]
pub struct Handler {
    /// The handler's name (the RuntimeClass's `handler`).
    pub name: String,
    pub runtime_type: String,
    /// The `options` table, as TOML inline-table content.
    pub options: String,
    /// Annotation patterns CRI passes from a container's config to its OCI spec
    /// (`container_annotations`; none when empty).
    pub container_annotations: Vec<String>,
}

impl Handler {
    /// `runc`: the stock shim, as Debian's config has it.
    pub fn runc() -> Self {
        Self {
            name: "runc".into(),
            runtime_type: crate::RUNC_RUNTIME.into(),
            options: "SystemdCgroup = false".into(),
            container_annotations: Vec::new(),
        }
    }

    /// `gpucr`, with the options of install/containerd/gpucr-v3.toml.
    pub fn gpucr() -> Self {
        Self::gpucr_with_binary("gpucr", "runc")
    }

    /// A gpucr handler whose `BinaryName` is `binary`.
    pub fn gpucr_with_binary(name: &str, binary: &str) -> Self {
        Self {
            name: name.into(),
            runtime_type: crate::GPUCR_RUNTIME.into(),
            options: format!("BinaryName = {binary:?}, SystemdCgroup = false"),
            container_annotations: Vec::new(),
        }
    }

    /// A gpucr handler whose options give it a checkpoint store of its own (a RuntimeClass
    /// with `StoreMode` and `Store`), with a size threshold low enough for the counter's
    /// CRIU pages.
    pub fn gpucr_with_store(name: &str, mode: &str, store: &Path) -> Self {
        let mut h = Self::gpucr_with_binary(name, "runc");
        h.options.push_str(&format!(
            ", StoreMode = {mode:?}, Store = {:?}, StoreMinBytes = 16384",
            store.display().to_string()
        ));
        h
    }

    /// The handler passing gpucr's annotations (`io.gpucr.*`) to the shim, as README's
    /// Kubernetes section says to set it up.
    pub fn with_gpucr_annotations(mut self) -> Self {
        self.container_annotations.push("io.gpucr.*".into());
        self
    }
}

/// The CRI part of a containerd 2.x test config (version 3 plugin ids): the handlers (the
/// first is the default), the pause image, the registry's hosts.toml directory, no CNI
/// configured (the pods use the host's network).
pub fn cri_config(dir: &Path, handlers: &[Handler], pause: &str, certs_d: &Path) -> String {
    cri_config_cdi(dir, handlers, pause, certs_d, &[])
}

/// [`cri_config`] with CDI on when `cdi_spec_dirs` names any: CRI then resolves a container's
/// `cdi_devices` (what kubelet passes from a device plugin) from the specs there.
pub fn cri_config_cdi(
    dir: &Path,
    handlers: &[Handler],
    pause: &str,
    certs_d: &Path,
    cdi_spec_dirs: &[PathBuf],
) -> String {
    let rt = r#"[plugins."io.containerd.cri.v1.runtime".containerd.runtimes"#;
    let cdi = if cdi_spec_dirs.is_empty() {
        "enable_cdi = false".to_owned()
    } else {
        let dirs: Vec<String> = cdi_spec_dirs
            .iter()
            .map(|d| format!("{:?}", d.display().to_string()))
            .collect();
        format!("enable_cdi = true\n  cdi_spec_dirs = [{}]", dirs.join(", "))
    };
    let mut text = format!(
        r#"[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{certs_d}"

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"

[plugins."io.containerd.cri.v1.runtime"]
  {cdi}
  # The pause container's -998 (kubelet's) needs CAP_SYS_RESOURCE, which a test machine that
  # is itself a container may lack: no lower than containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni}/bin"]
    conf_dir = "{cni}/net.d"
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "{default}"
"#,
        certs_d = certs_d.display(),
        cni = dir.join("cni").display(),
        default = handlers.first().map(|h| h.name.as_str()).unwrap_or("runc"),
    );
    for h in handlers {
        text.push_str(&format!(
            "{rt}.{name}]\n  runtime_type = \"{ty}\"\n  options = {{ {opts} }}\n",
            name = h.name,
            ty = h.runtime_type,
            opts = h.options
        ));
        if !h.container_annotations.is_empty() {
            text.push_str(&format!(
                "  container_annotations = {:?}\n",
                h.container_annotations
            ));
        }
    }
    text
}

/// The names in an archive (a plain tar, as CRI writes it), without a leading `./`.
pub fn archive_names(path: &Path) -> Result<Vec<String>> {
    let io = |what| HarnessError::io(what, path);
    let mut names = Vec::new();
    let mut tar = tar::Archive::new(std::fs::File::open(path).map_err(io("open archive"))?);
    for entry in tar.entries().map_err(io("read archive"))? {
        let entry = entry.map_err(io("read archive entry"))?;
        let name = entry.path().map_err(io("archive entry path"))?;
        names.push(name.to_string_lossy().trim_start_matches("./").to_owned());
    }
    Ok(names)
}
