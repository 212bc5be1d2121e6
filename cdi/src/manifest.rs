//! The host manifest: the host-specific parts of a container, recorded at checkpoint.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::info;

use crate::error::{Error, Result};
use crate::model::ContainerEdits;
use crate::oci::{bind_mounts, str_field, write_json_atomic};
use crate::registry::{CdiRegistry, Resolved};

/// File name of the manifest inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "gpucr-host.json";
/// Version written by this crate; `load` refuses newer ones.
pub const MANIFEST_VERSION: u32 = 1;
/// Annotation prefix under which CRI/device plugins list CDI devices (`a/b=c,d/e=f`).
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// What the checkpointed container had that belongs to its host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostManifest {
    pub version: u32,
    /// The CDI devices in request order (explicit list first, then annotations).
    pub cdi_devices: Vec<RecordedCdiDevice>,
    /// The merged edits these devices injected on the checkpoint host; restore takes them out.
    pub cdi_edits: ContainerEdits,
    /// Every `linux.devices` entry of the spec.
    pub device_nodes: Vec<DeviceNodeRecord>,
    /// Every bind mount of the spec (CRIU dumped each as an external mount).
    pub bind_mounts: Vec<BindMountRecord>,
    /// GPU UUIDs in the container's device order, as given by the caller.
    pub gpu_uuids: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedCdiDevice {
    /// Fully qualified `vendor/class=name`.
    pub name: String,
    pub spec_path: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_uuid: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNodeRecord {
    /// Path inside the container.
    pub path: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// Host path, known when a CDI device added the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// The CDI device that added it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi_device: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BindMountRecord {
    pub destination: String,
    pub source: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    /// True when a CDI device injected it: restore replaces it with the target's CDI mount.
    #[serde(default)]
    pub from_cdi: bool,
}

/// What the caller knows beyond the spec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordOptions {
    /// CDI devices the container was created with, when the spec's annotations do not list
    /// them (e.g. `ctr run --device`).
    pub cdi_devices: Vec<String>,
    /// GPU UUIDs in the container's device order. Empty: taken from the CDI devices that
    /// carry one.
    pub gpu_uuids: Vec<String>,
}

impl HostManifest {
    /// Records the host-specific parts of `spec` (the running container's config.json),
    /// resolving its CDI devices against the checkpoint host's `registry`.
    pub fn record(spec: &Value, registry: &CdiRegistry, opts: &RecordOptions) -> Result<Self> {
        let mut names = opts.cdi_devices.clone();
        for n in cdi_devices_from_annotations(spec) {
            if !names.contains(&n) {
                names.push(n);
            }
        }
        let resolved = registry.resolve(&names)?;
        let cdi_devices: Vec<RecordedCdiDevice> = resolved
            .devices
            .iter()
            .map(|d| RecordedCdiDevice {
                name: d.name.clone(),
                spec_path: d.spec_path.clone(),
                gpu_uuid: d.gpu_uuid.clone(),
            })
            .collect();
        let device_nodes = record_device_nodes(spec, &resolved);
        let bind_mounts = bind_mounts(spec)
            .into_iter()
            .map(|m| BindMountRecord {
                from_cdi: resolved
                    .edits
                    .mounts
                    .iter()
                    .any(|cm| cm.container_path == m.destination),
                destination: m.destination,
                source: m.source,
                options: m.options,
            })
            .collect();
        let gpu_uuids = if opts.gpu_uuids.is_empty() {
            cdi_devices
                .iter()
                .filter_map(|d| d.gpu_uuid.clone())
                .collect()
        } else {
            opts.gpu_uuids.clone()
        };
        Ok(HostManifest {
            version: MANIFEST_VERSION,
            cdi_devices,
            cdi_edits: resolved.edits,
            device_nodes,
            bind_mounts,
            gpu_uuids,
        })
    }

    /// Path of the manifest inside `checkpoint_dir`.
    pub fn file_path(checkpoint_dir: &Path) -> PathBuf {
        checkpoint_dir.join(MANIFEST_FILE)
    }

    /// Writes `gpucr-host.json` into `checkpoint_dir` (atomically) and returns its path.
    pub fn save(&self, checkpoint_dir: &Path) -> Result<PathBuf> {
        let path = Self::file_path(checkpoint_dir);
        let value = serde_json::to_value(self).map_err(|source| Error::Json {
            path: path.clone(),
            source,
        })?;
        write_json_atomic(&path, &value)?;
        info!(path = %path.display(), devices = self.cdi_devices.len(), "saved host manifest");
        Ok(path)
    }

    /// Reads `gpucr-host.json` from `checkpoint_dir`.
    pub fn load(checkpoint_dir: &Path) -> Result<Self> {
        let path = Self::file_path(checkpoint_dir);
        let data = std::fs::read(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        // Check the version first so a newer layout gets a version error, not a field error.
        let raw: Value = serde_json::from_slice(&data).map_err(|source| Error::Json {
            path: path.clone(),
            source,
        })?;
        let found = raw.get("version").and_then(Value::as_u64).unwrap_or(0);
        if found > u64::from(MANIFEST_VERSION) {
            return Err(Error::UnsupportedManifestVersion {
                path,
                found: u32::try_from(found).unwrap_or(u32::MAX),
                supported: MANIFEST_VERSION,
            });
        }
        serde_json::from_value(raw).map_err(|source| Error::Json { path, source })
    }

    /// The recorded CDI device names, in order.
    pub fn cdi_device_names(&self) -> Vec<String> {
        self.cdi_devices.iter().map(|d| d.name.clone()).collect()
    }
}

/// CDI device names listed in the spec's `cdi.k8s.io/*` annotations, in key order.
pub fn cdi_devices_from_annotations(spec: &Value) -> Vec<String> {
    let Some(annotations) = spec.get("annotations").and_then(Value::as_object) else {
        return Vec::new();
    };
    // Sorted by key: serde_json's map order depends on its `preserve_order` feature.
    let mut entries: Vec<(&String, &Value)> = annotations
        .iter()
        .filter(|(k, _)| k.starts_with(CDI_ANNOTATION_PREFIX))
        .collect();
    entries.sort_by(|a, b| a.0.cmp(b.0));
    let mut names = Vec::new();
    for (_, value) in entries {
        for name in value.as_str().unwrap_or_default().split(',') {
            let name = name.trim();
            if !name.is_empty() && !names.iter().any(|n| n == name) {
                names.push(name.to_string());
            }
        }
    }
    names
}

fn record_device_nodes(spec: &Value, cdi: &Resolved) -> Vec<DeviceNodeRecord> {
    let Some(devices) = spec.pointer("/linux/devices").and_then(Value::as_array) else {
        return Vec::new();
    };
    devices
        .iter()
        .map(|d| {
            let path = str_field(d, "path").to_string();
            let cdi_device = cdi
                .devices
                .iter()
                .find(|dev| dev.edits.device_nodes.iter().any(|n| n.path == path))
                .map(|dev| dev.name.clone());
            // Spec-level nodes (nvidiactl, nvidia-uvm) have a host path but no single device.
            let host_path = cdi
                .edits
                .device_nodes
                .iter()
                .find(|n| n.path == path)
                .map(|n| n.host_path().to_string());
            DeviceNodeRecord {
                kind: str_field(d, "type").to_string(),
                major: d.get("major").and_then(Value::as_i64),
                minor: d.get("minor").and_then(Value::as_i64),
                host_path,
                cdi_device,
                path,
            }
        })
        .collect()
}
