//! Restore planning: fit a recorded container onto this host's devices and paths.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tracing::info;

use crate::error::{Error, RestoreProblem, Result};
use crate::manifest::{HostManifest, CDI_ANNOTATION_PREFIX};
use crate::oci::{self, apply_edits, bind_mounts, remove_edits, set_mount_source};
use crate::registry::{CdiRegistry, Resolved};

/// Annotation key under which a plan lists the target CDI devices when they differ from the
/// recorded ones (the recorded `cdi.k8s.io/*` keys are dropped then).
pub const RESTORE_ANNOTATION: &str = "cdi.k8s.io/gpucr_restore";

/// What the restore request says about the target; everything defaults to "same as recorded".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreTarget {
    /// CDI devices for the restored container, in the order to pair with the recorded ones.
    /// `None`: the recorded names, resolved against this host's specs.
    pub cdi_devices: Option<Vec<String>>,
    /// This host's GPU UUIDs in device order. `None`: taken from the target CDI devices that
    /// carry one (named `GPU-…`, or a UUID in annotations/env).
    pub gpu_uuids: Option<Vec<String>>,
    /// Container destination → host source, for volumes whose host path changed.
    pub mount_sources: BTreeMap<String, String>,
    /// Where relative mount sources start (runc joins them with the bundle directory).
    pub bundle_dir: Option<PathBuf>,
}

/// One `--ext-mount-map` entry: the mount's container path (CRIU's key) and its host source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtMount {
    pub destination: String,
    pub source: String,
}

impl ExtMount {
    /// `dest:source`, the form `criu --ext-mount-map` takes.
    pub fn to_criu_arg(&self) -> String {
        format!("{}:{}", self.destination, self.source)
    }
}

/// A checkpointed GPU and the GPU of this host that takes its place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUuidPair {
    pub old: String,
    pub new: String,
}

/// The result of planning: nothing has been written or created yet.
#[derive(Debug, Clone, PartialEq)]
pub struct RestorePlan {
    /// The rewritten OCI runtime spec for `runc restore`.
    pub spec: Value,
    /// The target CDI devices (fully qualified), in pairing order.
    pub cdi_devices: Vec<String>,
    /// Every bind mount of the rewritten spec, for CRIU's external mount map.
    pub ext_mounts: Vec<ExtMount>,
    /// Recorded GPU i ↔ target GPU i.
    pub gpu_uuid_pairs: Vec<GpuUuidPair>,
}

impl RestorePlan {
    /// Writes the rewritten spec to `config_path` (atomically).
    pub fn write_spec(&self, config_path: &Path) -> Result<()> {
        oci::write_json_atomic(config_path, &self.spec)
    }
}

/// Plans a restore of `manifest` onto this host from the bundle's `config.json`; relative
/// mount sources are taken from the bundle directory unless `target.bundle_dir` says otherwise.
pub fn plan_restore_bundle(
    manifest: &HostManifest,
    config_path: &Path,
    registry: &CdiRegistry,
    target: &RestoreTarget,
) -> Result<RestorePlan> {
    let spec = oci::read_oci_spec(config_path)?;
    let mut target = target.clone();
    if target.bundle_dir.is_none() {
        target.bundle_dir = config_path.parent().map(Path::to_path_buf);
    }
    plan_restore(manifest, &spec, registry, &target)
}

/// Rewrites `restore_spec` for this host: takes out the recorded CDI edits, injects the
/// target devices' edits, maps volumes, and pairs GPU UUIDs. Refuses with every difference
/// found ([`Error::RestoreRefused`]) when the host cannot take the checkpoint.
pub fn plan_restore(
    manifest: &HostManifest,
    restore_spec: &Value,
    registry: &CdiRegistry,
    target: &RestoreTarget,
) -> Result<RestorePlan> {
    let mut problems = Vec::new();
    let recorded = manifest.cdi_device_names();
    let names = target
        .cdi_devices
        .clone()
        .unwrap_or_else(|| recorded.clone());
    if names.len() != recorded.len() {
        problems.push(RestoreProblem::DeviceCountMismatch {
            recorded: recorded.clone(),
            target: names.clone(),
        });
    }
    let resolved = resolve_each(registry, &names, &mut problems);
    let gpu_uuid_pairs = pair_gpus(manifest, &resolved, target, &mut problems);

    let mut spec = restore_spec.clone();
    remove_edits(&mut spec, &manifest.cdi_edits);
    // Also take out the target's own edits first: a spec that already has them (CRI built it
    // on this host with CDI on) must not get its hooks twice.
    remove_edits(&mut spec, &resolved.edits);
    if let Err(e) = apply_edits(&mut spec, &resolved.edits) {
        problems.push(RestoreProblem::UnresolvableDevice {
            name: names.join(","),
            reason: e.to_string(),
        });
    }
    if names != recorded {
        rewrite_cdi_annotations(&mut spec, &resolved);
    }
    map_mounts(manifest, &mut spec, target, &mut problems);

    if !problems.is_empty() {
        return Err(Error::RestoreRefused(problems));
    }
    let ext_mounts = bind_mounts(&spec)
        .into_iter()
        .map(|m| ExtMount {
            destination: m.destination,
            source: m.source,
        })
        .collect();
    let plan = RestorePlan {
        spec,
        cdi_devices: resolved.devices.iter().map(|d| d.name.clone()).collect(),
        ext_mounts,
        gpu_uuid_pairs,
    };
    info!(devices = ?plan.cdi_devices, gpus = plan.gpu_uuid_pairs.len(), "planned restore");
    Ok(plan)
}

/// Resolves names one at a time so that each unknown one is reported, then all together.
fn resolve_each(
    registry: &CdiRegistry,
    names: &[String],
    problems: &mut Vec<RestoreProblem>,
) -> Resolved {
    let mut ok = Vec::new();
    for name in names {
        match registry.resolve(std::slice::from_ref(name)) {
            Ok(_) => ok.push(name.clone()),
            Err(e) => problems.push(RestoreProblem::UnresolvableDevice {
                name: name.clone(),
                reason: e.to_string(),
            }),
        }
    }
    // Every name in `ok` resolved alone, so together they resolve too.
    registry.resolve(&ok).unwrap_or_default()
}

/// Pairing rule: the i-th recorded UUID goes with the i-th target UUID, the target's order
/// being its CDI device order (or the caller's list).
fn pair_gpus(
    manifest: &HostManifest,
    resolved: &Resolved,
    target: &RestoreTarget,
    problems: &mut Vec<RestoreProblem>,
) -> Vec<GpuUuidPair> {
    let new: Vec<String> = match &target.gpu_uuids {
        Some(uuids) => uuids.clone(),
        None => resolved
            .devices
            .iter()
            .filter_map(|d| d.gpu_uuid.clone())
            .collect(),
    };
    if new.len() != manifest.gpu_uuids.len() {
        problems.push(RestoreProblem::GpuCountMismatch {
            recorded: manifest.gpu_uuids.len(),
            target: new.len(),
        });
        if target.gpu_uuids.is_none() {
            for d in resolved.devices.iter().filter(|d| d.gpu_uuid.is_none()) {
                problems.push(RestoreProblem::TargetGpuUuidUnknown {
                    device: d.name.clone(),
                });
            }
        }
        return Vec::new();
    }
    manifest
        .gpu_uuids
        .iter()
        .zip(new)
        .map(|(old, new)| GpuUuidPair {
            old: old.clone(),
            new,
        })
        .collect()
}

/// Checks that every recorded bind mount is in the new spec, applies source overrides, and
/// that every bind source exists on this host.
fn map_mounts(
    manifest: &HostManifest,
    spec: &mut Value,
    target: &RestoreTarget,
    problems: &mut Vec<RestoreProblem>,
) {
    for (dest, source) in &target.mount_sources {
        if !set_mount_source(spec, dest, source) {
            problems.push(RestoreProblem::MountMissingInTarget {
                destination: dest.clone(),
            });
        }
    }
    let binds = bind_mounts(spec);
    for rec in &manifest.bind_mounts {
        // CRIU dumped each of these as an external mount; without one at the same
        // destination it has nothing to map the key to.
        if !binds.iter().any(|b| b.destination == rec.destination) {
            problems.push(RestoreProblem::MountMissingInTarget {
                destination: rec.destination.clone(),
            });
        }
    }
    for b in &binds {
        let source = match &target.bundle_dir {
            Some(dir) if Path::new(&b.source).is_relative() => dir.join(&b.source),
            _ => PathBuf::from(&b.source),
        };
        if std::fs::symlink_metadata(&source).is_err() {
            problems.push(RestoreProblem::MissingMountSource {
                destination: b.destination.clone(),
                source: b.source.clone(),
            });
        }
    }
}

fn rewrite_cdi_annotations(spec: &mut Value, resolved: &Resolved) {
    let Some(annotations) = spec.get_mut("annotations").and_then(Value::as_object_mut) else {
        return;
    };
    annotations.retain(|k, _| !k.starts_with(CDI_ANNOTATION_PREFIX));
    let names: Vec<&str> = resolved.devices.iter().map(|d| d.name.as_str()).collect();
    annotations.insert(RESTORE_ANNOTATION.into(), Value::String(names.join(",")));
}
