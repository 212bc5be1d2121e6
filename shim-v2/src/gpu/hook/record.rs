//! `gpucr-hook.json`: what the hook moved at a checkpoint, read back by a restore.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{HookError, Result};

/// The record of the hook's part of a checkpoint, next to `gpucr-gpu.json`.
pub const RECORD_FILE: &str = crate::records::HOOK;
/// The directory of the per-process GPU state images inside a checkpoint image.
pub const IMAGE_DIR: &str = crate::records::HOOK_IMAGES;
pub(super) const RECORD_VERSION: u32 = 1;

/// What the checkpoint did with one process's hook.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub host_pid: u32,
    pub ns_pid: u32,
    pub allocations: usize,
    pub freeze_ms: u64,
    pub copy_out_bytes: u64,
    pub copy_out_ms: u64,
    pub release_ms: u64,
    /// Allocations whose memory the shim held on the GPU across the dump (leave-running).
    #[serde(default)]
    pub kept: usize,
    /// The Snapshot verb (device-to-device copy and release), when the memory was
    /// snapshotted; `copy_out_ms` is then the image's write after the thaw.
    #[serde(default)]
    pub snapshot_ms: u64,
    /// From the Freeze to the Thaw: how long the process's GPU work was held (0 when
    /// not thawed by this checkpoint, e.g. it exited).
    #[serde(default)]
    pub gpu_paused_ms: u64,
    /// Whether the copy-out was prepared before the freeze, and how long that took.
    #[serde(default)]
    pub prepared: bool,
    #[serde(default)]
    pub prepare_ms: u64,
}

/// A process left to the driver path, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fallback {
    pub host_pid: u32,
    pub reason: String,
}

/// `gpucr-hook.json`: whether the container had the hook, and per process what moved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HookRecord {
    pub version: u32,
    pub injected: bool,
    pub processes: Vec<ProcessRecord>,
    pub fallbacks: Vec<Fallback>,
}

impl HookRecord {
    /// The record of a checkpoint whose container had the hook but whose GPU state the
    /// hook did not move (CRIU's plugin did): the restore needs the hook's mounts all the
    /// same, since CRIU restores the library mapped at them.
    pub fn injected_only() -> HookRecord {
        HookRecord {
            version: RECORD_VERSION,
            injected: true,
            processes: Vec::new(),
            fallbacks: Vec::new(),
        }
    }

    pub fn file_path(image: &Path) -> PathBuf {
        image.join(RECORD_FILE)
    }

    /// The device memory the hooks give back at a restore (every process's allocations).
    pub fn device_bytes(&self) -> u64 {
        self.processes.iter().map(|p| p.copy_out_bytes).sum()
    }

    /// The image directory of process `ns_pid` (never taken from the record's text).
    pub fn image_of(image: &Path, ns_pid: u32) -> PathBuf {
        image.join(IMAGE_DIR).join(ns_pid.to_string())
    }

    pub fn save(&self, image: &Path) -> Result<()> {
        let path = Self::file_path(image);
        let text = serde_json::to_vec_pretty(self).expect("hook record serializes");
        std::fs::write(&path, text).map_err(|source| HookError::RecordIo {
            path,
            what: "write",
            source,
        })
    }

    /// The record of `image`, if it has one.
    pub fn load(image: &Path) -> Result<Option<HookRecord>> {
        let path = Self::file_path(image);
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(HookError::RecordIo {
                    path,
                    what: "read",
                    source,
                })
            }
        };
        let record: HookRecord =
            serde_json::from_slice(&text).map_err(|source| HookError::RecordDamaged {
                path: path.clone(),
                source,
            })?;
        if record.version > RECORD_VERSION {
            return Err(HookError::RecordVersion {
                path,
                version: record.version,
                understood: RECORD_VERSION,
            });
        }
        Ok(Some(record))
    }

    /// Reads every process's image through (manifest, chunk checksums): a damaged or
    /// missing one is refused before a restore changes anything.
    pub fn validate(&self, image: &Path) -> Result<()> {
        // The node's cores (up to 16): this check is all a restore does at that moment.
        let threads = crate::manifest::hash_threads();
        for p in &self.processes {
            let dir = Self::image_of(image, p.ns_pid);
            gpu_state::image::ImageReader::open(&dir)
                .and_then(|r| r.verify(threads))
                .map_err(|source| HookError::ImageDamaged {
                    path: dir.clone(),
                    ns_pid: p.ns_pid,
                    source: Box::new(source),
                })?;
        }
        Ok(())
    }
}
