//! The records a checkpoint image holds besides CRIU's own files: each file's name, who
//! writes it and who reads it, and the checks a restore makes of them at Create.
//!
//! | file | written by | read by |
//! | --- | --- | --- |
//! | [`HOOK_IMAGES`]`/<ns pid>/` | the hook, at CopyOut or WriteSnapshot (gpu-state's image format) | the hook, at a restore's copy-in; checked at Create ([`Records::read_checked`]) |
//! | [`GPU`] | `gpu::driver` (gpu-state's `GpuCheckpointRecord`), after the dump | Create ([`Records::read`]: the compatibility check, how many CUDA processes Start must find) |
//! | [`HOOK`] | `gpu::hook` ([`HookRecord`]), after the dump and the give-back | Create ([`Records::read`]: hook mounts, device memory, the copy-in and its helpers) |
//! | [`HOST`] | `gpu::host` through `gpucr-cdi`, after the give-back | Create (`gpu::host::plan_restore`) |
//! | [`CHECKPOINT`] | `manifest::write_manifest`, last of all | Create, before anything else ([`Records::read_checked`]) |
//! | [`PLUGIN_GPUS`] | gpucr's CRIU plugin at the dump (`criu-plugin/src/gpus.rs`) | that plugin at a restore; the shim only hashes it |
//!
//! A finished checkpoint is flat: the hook's images are folded into top-level files
//! (`layout`), and Create unfolds them before the checks.

use std::path::Path;

use gpu_state::GpuCheckpointRecord;

use crate::error::{Error, Result};
use crate::gpu::hook::HookRecord;

/// Every file of the image, sizes and per-chunk hashes: the image check.
pub const CHECKPOINT: &str = crate::manifest::MANIFEST;
/// What the hook moved, per process.
pub const HOOK: &str = "gpucr-hook.json";
/// The directory of the hook's per-process GPU state images.
pub const HOOK_IMAGES: &str = "gpu-hook";
/// The driver path's record: driver, GPUs, CUDA processes.
pub const GPU: &str = gpu_state::RECORD_FILE_NAME;
/// What the container needs from its host: CDI devices, device nodes, mounts, GPU UUIDs.
pub const HOST: &str = gpucr_cdi::MANIFEST_FILE;
/// The GPUs gpucr's CRIU plugin saw at the dump (the plugin's own record).
pub const PLUGIN_GPUS: &str = "gpucr-plugin-gpus.json";

/// The records a restore reads, each read once at Create after the image check.
#[derive(Debug, Clone, Default)]
pub struct Records {
    pub hook: Option<HookRecord>,
    pub gpu: Option<GpuCheckpointRecord>,
}

impl Records {
    /// Reads [`HOOK`] and [`GPU`] from `image` (either may be absent).
    pub fn read(image: &Path) -> Result<Records> {
        Ok(Records {
            hook: HookRecord::load(image)?,
            gpu: crate::gpu::driver::load_record(image)?,
        })
    }

    /// Create's one pass over an image: every file against gpucr's manifest
    /// (`manifest::validate_image`), then the records, read once, then the hook's images
    /// through their own hashes (named by the hook record). Blocks: it reads the whole image.
    pub fn read_checked(id: &str, image: &Path) -> Result<Records> {
        crate::manifest::validate_image(id, image)?;
        let records = Records::read(image).map_err(|e| Error::RestoreRefused {
            id: id.to_string(),
            image: image.to_path_buf(),
            source: Box::new(e),
        })?;
        if let Some(hook) = &records.hook {
            let started = std::time::Instant::now();
            hook.validate(image).map_err(|e| Error::Restore {
                id: id.to_string(),
                image: image.to_path_buf(),
                msg: e.to_string(),
            })?;
            tracing::info!(%id, bytes = hook.device_bytes(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "the hook's GPU state images verified (every chunk's CRC32C)");
        }
        Ok(records)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_names_are_those_the_writers_use() {
        assert_eq!(GPU, "gpucr-gpu.json");
        assert_eq!(HOST, "gpucr-host.json");
        assert_eq!(crate::manifest::MANIFEST, CHECKPOINT);
        assert_eq!(crate::gpu::hook::RECORD_FILE, HOOK);
        assert_eq!(crate::gpu::hook::IMAGE_DIR, HOOK_IMAGES);
    }
}
