//! The host-specific parts of a container (CDI devices, device nodes, bind mounts, GPU UUIDs)
//! through `gpucr-cdi`: injected at Create, recorded at checkpoint (`gpucr-host.json`), and
//! re-resolved on the restoring host, whose config.json is rewritten before `runc restore`.
//!
//! CDI devices are named by `cdi.k8s.io/*` annotations (what CRI, and `ctr run --annotation`,
//! leave in the spec). CRI has already applied their edits; applying them again changes
//! nothing, so the shim can do it for every client.

use std::path::{Path, PathBuf};

use gpu_state::GpuPair;
use gpucr_cdi::{
    apply_edits, cdi_devices_from_annotations, plan_restore_bundle, read_oci_spec, CdiRegistry,
    HostManifest, RecordOptions, RestoreTarget,
};

use crate::error::{Error, Result};

/// Annotation: `always` passes the old→new GPU pairs to the driver's restore even when every
/// GPU is the same one (the remap path, exercised on a one-GPU machine); default: only when a
/// GPU changes.
pub const GPU_PAIRS_ANNOTATION: &str = "io.gpucr.gpu-pairs";

/// Shim environment: CDI spec directories, `:`-separated (default `/etc/cdi:/var/run/cdi`).
pub const CDI_SPEC_DIRS_ENV: &str = "GPUCR_CDI_SPEC_DIRS";

fn registry() -> CdiRegistry {
    match std::env::var(CDI_SPEC_DIRS_ENV) {
        Ok(dirs) if !dirs.is_empty() => {
            let dirs: Vec<PathBuf> = dirs.split(':').map(PathBuf::from).collect();
            CdiRegistry::load(&dirs)
        }
        _ => CdiRegistry::load_default(),
    }
}

fn cdi_error(e: gpucr_cdi::Error) -> Error {
    Error::invalid(format!("CDI: {e}"))
}

/// Create: applies the edits of the spec's annotated CDI devices to the bundle's spec (the
/// caller writes it); returns the device names.
pub fn inject_cdi_devices(spec: &mut serde_json::Value) -> Result<Vec<String>> {
    let names = cdi_devices_from_annotations(spec);
    if names.is_empty() {
        return Ok(names);
    }
    let resolved = registry().resolve(&names).map_err(cdi_error)?;
    apply_edits(spec, &resolved.edits).map_err(cdi_error)?;
    Ok(names)
}

/// Checkpoint: records the host-specific parts of the running container into the image.
pub fn record(bundle: &Path, image: &Path) -> Result<PathBuf> {
    let spec = read_oci_spec(&bundle.join("config.json")).map_err(cdi_error)?;
    let manifest =
        HostManifest::record(&spec, &registry(), &RecordOptions::default()).map_err(cdi_error)?;
    manifest.save(image).map_err(cdi_error)
}

/// Restore, before anything is created: fits the bundle's config.json to this host (target CDI
/// devices, mount sources) and returns the old→new GPU pairs for the driver. Refuses, naming
/// every difference, when this host cannot take the checkpoint.
pub fn plan_restore(bundle: &Path, image: &Path) -> Result<Vec<GpuPair>> {
    if !HostManifest::file_path(image).exists() {
        return Ok(Vec::new());
    }
    let manifest = HostManifest::load(image).map_err(cdi_error)?;
    let config = bundle.join("config.json");
    let spec = read_oci_spec(&config).map_err(cdi_error)?;
    // Devices the restore request names (CRI: the new container's); else the recorded names.
    let requested = cdi_devices_from_annotations(&spec);
    let target = RestoreTarget {
        cdi_devices: (!requested.is_empty()).then_some(requested),
        bundle_dir: Some(bundle.to_path_buf()),
        ..Default::default()
    };
    let plan = plan_restore_bundle(&manifest, &config, &registry(), &target).map_err(cdi_error)?;
    plan.write_spec(&config).map_err(cdi_error)?;
    tracing::info!(devices = ?plan.cdi_devices,
        ext_mounts = ?plan.ext_mounts.iter().map(|m| m.to_criu_arg()).collect::<Vec<_>>(),
        "restore fitted to this host");
    let always = spec
        .pointer("/annotations")
        .and_then(|a| a.get(GPU_PAIRS_ANNOTATION))
        .and_then(|v| v.as_str())
        == Some("always");
    gpu_pairs(&plan.gpu_uuid_pairs, always)
}

/// After `runc restore`: CRIU brought the container's `/dev` (a tmpfs) back from the image,
/// with the checkpoint host's device numbers. Nodes that the (rewritten) spec gives other
/// numbers are made again, so the container sees this host's devices. Returns what changed.
pub fn refresh_device_nodes(bundle: &Path, pid: u32) -> Result<Vec<String>> {
    use nix::sys::stat::{lstat, makedev, mknod, Mode, SFlag};
    let spec = read_oci_spec(&bundle.join("config.json")).map_err(cdi_error)?;
    let devices = spec
        .pointer("/linux/devices")
        .and_then(|d| d.as_array())
        .cloned()
        .unwrap_or_default();
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let mut changed = Vec::new();
    for d in devices {
        let (Some(path), Some(kind)) = (d["path"].as_str(), d["type"].as_str()) else {
            continue;
        };
        let kind = match kind {
            "c" | "u" => SFlag::S_IFCHR,
            "b" => SFlag::S_IFBLK,
            _ => continue,
        };
        let (major, minor) = (
            d["major"].as_u64().unwrap_or(0),
            d["minor"].as_u64().unwrap_or(0),
        );
        let want = makedev(major, minor);
        let node = root.join(path.trim_start_matches('/'));
        if let Ok(st) = lstat(&node) {
            let same_kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == kind;
            if same_kind && st.st_rdev == want {
                continue;
            }
            std::fs::remove_file(&node)
                .map_err(|e| Error::io(format!("replacing device node {path}"), e))?;
        }
        let mode = d["fileMode"].as_u64().unwrap_or(0o666) as u32 & 0o7777;
        mknod(&node, kind, Mode::from_bits_truncate(mode), want)
            .map_err(|e| Error::io(format!("creating device node {path}"), e.into()))?;
        let (uid, gid) = (d["uid"].as_u64(), d["gid"].as_u64());
        if uid.is_some() || gid.is_some() {
            nix::unistd::chown(
                &node,
                uid.map(|u| nix::unistd::Uid::from_raw(u as u32)),
                gid.map(|g| nix::unistd::Gid::from_raw(g as u32)),
            )
            .map_err(|e| Error::io(format!("chown of device node {path}"), e.into()))?;
        }
        changed.push(format!("{path} -> {major}:{minor}"));
    }
    Ok(changed)
}

/// The planned pairs as the driver wants them (see [`GpuPair::for_restore`]).
fn gpu_pairs(pairs: &[gpucr_cdi::GpuUuidPair], always: bool) -> Result<Vec<GpuPair>> {
    GpuPair::for_restore(
        pairs.iter().map(|p| (p.old.as_str(), p.new.as_str())),
        always,
    )
    .map_err(Error::invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_only_when_a_gpu_moves() {
        let same = gpucr_cdi::GpuUuidPair {
            old: "GPU-11111111-2222-3333-4444-555555555555".into(),
            new: "GPU-11111111-2222-3333-4444-555555555555".into(),
        };
        assert!(gpu_pairs(std::slice::from_ref(&same), false)
            .unwrap()
            .is_empty());
        assert_eq!(
            gpu_pairs(std::slice::from_ref(&same), true).unwrap().len(),
            1,
            "always: the identical pair goes to the driver"
        );
        let moved = gpucr_cdi::GpuUuidPair {
            old: same.old.clone(),
            new: "GPU-aaaaaaaa-2222-3333-4444-555555555555".into(),
        };
        assert_eq!(gpu_pairs(&[same, moved], false).unwrap().len(), 2);
        let bad = gpucr_cdi::GpuUuidPair {
            old: "x".into(),
            new: "GPU-aaaaaaaa-2222-3333-4444-555555555555".into(),
        };
        assert!(gpu_pairs(&[bad], false).is_err());
    }
}
