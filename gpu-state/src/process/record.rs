//! The JSON record of a GPU checkpoint, written into the checkpoint directory.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::error::RecordError;
use crate::inventory::Inventory;

use super::{unix_ms, GpuProcess};

/// File name of the record inside the checkpoint directory.
pub const RECORD_FILE_NAME: &str = "gpucr-gpu.json";
/// Bumped when a field changes meaning.
pub const RECORD_FORMAT_VERSION: u32 = 1;

/// What gpucr did to the GPU side of a container at checkpoint, and what the
/// restore host must offer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuCheckpointRecord {
    pub format_version: u32,
    pub created_unix_ms: u64,
    /// `cuDriverGetVersion` of the checkpointing host (e.g. 13000).
    pub cuda_driver_version: Option<i32>,
    /// GPUs of the checkpointing host, for the compatibility check on restore.
    pub inventory: Option<Inventory>,
    /// Per process: states, per-step timings and the device memory estimate.
    pub processes: Vec<GpuProcess>,
}

impl GpuCheckpointRecord {
    pub fn new(
        cuda_driver_version: Option<i32>,
        inventory: Option<Inventory>,
        processes: Vec<GpuProcess>,
    ) -> Self {
        Self {
            format_version: RECORD_FORMAT_VERSION,
            created_unix_ms: unix_ms(SystemTime::now()),
            cuda_driver_version,
            inventory,
            processes,
        }
    }

    /// Where the record lives inside `checkpoint_dir`.
    pub fn file_path(checkpoint_dir: &Path) -> PathBuf {
        checkpoint_dir.join(RECORD_FILE_NAME)
    }

    /// Sum of the per-process device memory estimates, in bytes.
    pub fn device_memory_estimate_bytes(&self) -> u64 {
        self.processes
            .iter()
            .filter_map(GpuProcess::device_memory_estimate_bytes)
            .sum()
    }

    /// Writes the record atomically (temp file + rename) and returns its path.
    pub fn save(&self, checkpoint_dir: &Path) -> Result<PathBuf, RecordError> {
        let path = Self::file_path(checkpoint_dir);
        let tmp = checkpoint_dir.join(format!(".{RECORD_FILE_NAME}.tmp"));
        let text = serde_json::to_vec_pretty(self).map_err(|e| RecordError::Parse {
            path: path.clone(),
            source: e,
        })?;
        std::fs::write(&tmp, text).map_err(|source| RecordError::Write {
            path: tmp.clone(),
            source,
        })?;
        std::fs::rename(&tmp, &path).map_err(|source| RecordError::Write {
            path: path.clone(),
            source,
        })?;
        Ok(path)
    }

    /// Reads the record from `checkpoint_dir`.
    pub fn load(checkpoint_dir: &Path) -> Result<Self, RecordError> {
        let path = Self::file_path(checkpoint_dir);
        let text = std::fs::read(&path).map_err(|source| RecordError::Read {
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|source| RecordError::Parse { path, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::ProcessState;

    #[test]
    fn save_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = GpuProcess::new(42, 43, ProcessState::Running);
        p.rss_before_checkpoint_kib = Some(1000);
        p.rss_after_checkpoint_kib = Some(3000);
        let rec = GpuCheckpointRecord::new(Some(13000), None, vec![p]);
        let path = rec.save(dir.path()).unwrap();
        assert!(path.ends_with(RECORD_FILE_NAME));
        let back = GpuCheckpointRecord::load(dir.path()).unwrap();
        assert_eq!(back, rec);
        assert_eq!(back.device_memory_estimate_bytes(), 2000 * 1024);
    }
}
