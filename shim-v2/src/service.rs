//! The shim binary's lifecycle (containerd's `start` and `delete` actions and the serving
//! process), on the `containerd-shim` crate's `Shim` trait.

use std::{path::Path, sync::Arc};

use async_trait::async_trait;
use containerd_shim::{
    protos::protobuf::well_known_types::timestamp::Timestamp, publisher::RemotePublisher,
    util::write_str_to_file, Config, DeleteResponse, ExitSignal, Flags, StartOpts,
};

use crate::{
    error::{IoContext, Result},
    events::{timestamp, Publisher},
    options::RuntimeOptions,
    reaper::{Reaper, Spawner},
    runc::Runc,
    task::TaskService,
};

/// Annotations that put containers of one pod into one shim.
const GROUP_ANNOTATIONS: [&str; 2] = [
    "io.containerd.gpucr.v2.group",
    "io.kubernetes.cri.sandbox-id",
];
/// Written at Create so that `delete` (run when the shim is gone) uses the same runc.
const OPTIONS_FILE: &str = "gpucr-options.json";

pub struct Service {
    id: String,
    namespace: String,
    debug: bool,
    exit: Arc<ExitSignal>,
}

pub fn write_bundle_options(bundle: &Path, opts: &RuntimeOptions) -> Result<()> {
    let path = bundle.join(OPTIONS_FILE);
    let text = serde_json::to_vec(opts).expect("options serialize");
    std::fs::write(&path, text).ctx(|| format!("writing {}", path.display()))
}

fn read_bundle_options(bundle: &Path) -> RuntimeOptions {
    std::fs::read(bundle.join(OPTIONS_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
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
        let cwd =
            std::env::current_dir().map_err(|e| containerd_shim::Error::Other(e.to_string()))?;
        let group = grouping(&cwd, &opts.id);
        let address = containerd_shim::spawn(opts, &group, Vec::new()).await?;
        write_str_to_file("address", &address).await?;
        Ok(address)
    }

    /// containerd could not reach the shim (it crashed or was killed): clean up after it.
    async fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        let bundle =
            std::env::current_dir().map_err(|e| containerd_shim::Error::Other(e.to_string()))?;
        let opts = read_bundle_options(&bundle);
        let runc = Runc {
            binary: opts.binary().to_string(),
            root: opts.runc_root(&self.namespace),
            systemd_cgroup: opts.systemd_cgroup,
            log: bundle.join("log.json"),
            spawner: Spawner::Plain,
        };
        if let Err(e) = runc.delete(&self.id, true).await {
            // Already gone from runc is fine; anything else is worth a line in the log.
            eprintln!("gpucr: runc delete --force {}: {e}", self.id);
        }
        crate::container::unmount_rootfs(&bundle);
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

    #[test]
    fn options_survive_for_delete() {
        let dir = tempfile::tempdir().unwrap();
        let o = RuntimeOptions {
            binary_name: "crun".into(),
            ..Default::default()
        };
        write_bundle_options(dir.path(), &o).unwrap();
        assert_eq!(read_bundle_options(dir.path()), o);
    }
}
