//! What GPUs a host has, and whether a checkpoint taken on one host can be restored
//! on another.
//!
//! [`Inventory::gather`] prefers NVML (it knows memory) and falls back to
//! `/proc/driver/nvidia`; on a machine without NVIDIA's driver it is empty.

mod nvml;
pub mod procfs;

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use nvml::LIBNVML_ENV;

/// Where the NVIDIA kernel module publishes its GPUs.
pub const PROCFS_ROOT: &str = "/proc/driver/nvidia";
/// Environment: another directory laid out like [`PROCFS_ROOT`] (tests stand in a GPU
/// inventory with it on machines without NVIDIA's driver).
pub const PROCFS_ROOT_ENV: &str = "GPUCR_NVIDIA_PROCFS";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InventorySource {
    Nvml,
    Procfs,
    /// No NVIDIA driver on this host.
    #[default]
    None,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    /// e.g. "NVIDIA H200".
    pub model: String,
    /// e.g. "GPU-5b1d3e7a-...".
    pub uuid: String,
    pub bus_id: Option<String>,
    pub memory_total_bytes: Option<u64>,
    pub memory_free_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Inventory {
    /// Kernel driver version, e.g. "580.159.04".
    pub driver_version: Option<String>,
    pub source: InventorySource,
    pub gpus: Vec<GpuInfo>,
}

impl Inventory {
    /// NVML if it answers, else procfs, else an empty inventory.
    /// `/proc/driver/nvidia` only (or [`PROCFS_ROOT_ENV`]): no library is loaded and no
    /// thread started, which a process that must stay single-threaded (CRIU, which
    /// `setns`es into mount namespaces) needs. No memory figures.
    pub fn gather_procfs() -> Inventory {
        let root = std::env::var_os(PROCFS_ROOT_ENV)
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| PROCFS_ROOT.into());
        procfs::read(Path::new(&root)).unwrap_or_default()
    }

    /// With [`PROCFS_ROOT_ENV`] set, only that directory is read.
    pub fn gather() -> Inventory {
        if std::env::var_os(PROCFS_ROOT_ENV).is_some_and(|r| !r.is_empty()) {
            return Self::gather_procfs();
        }
        nvml::read().unwrap_or_else(Self::gather_procfs)
    }

    /// The driver branch (the major number, e.g. 580), which checkpoint images are
    /// assumed to need on both sides.
    pub fn driver_branch(&self) -> Option<u32> {
        self.driver_version
            .as_deref()?
            .split('.')
            .next()?
            .parse()
            .ok()
    }
}

/// One way the restore host differs from the checkpoint host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    NoGpus,
    GpuCount {
        recorded: usize,
        current: usize,
    },
    DriverBranch {
        recorded: u32,
        current: u32,
    },
    GpuModel {
        index: u32,
        recorded: String,
        current: String,
    },
    FreeMemory {
        index: u32,
        uuid: String,
        needed: u64,
        free: u64,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::NoGpus => f.write_str("this host has no NVIDIA GPU (or its driver is not loaded)"),
            Mismatch::GpuCount { recorded, current } => {
                write!(f, "the checkpoint used {recorded} GPUs but this host has {current}")
            }
            Mismatch::DriverBranch { recorded, current } => write!(
                f,
                "driver branch {current} differs from the checkpoint's {recorded}; install a {recorded}.x driver"
            ),
            Mismatch::GpuModel { index, recorded, current } => write!(
                f,
                "GPU {index} is a {current} but the checkpoint ran on a {recorded}; the driver restores only onto the same chip"
            ),
            Mismatch::FreeMemory { index, uuid, needed, free } => write!(
                f,
                "GPU {index} ({uuid}) has {} MiB free but the checkpoint needs {} MiB; free GPU memory first",
                free / (1 << 20),
                needed / (1 << 20)
            ),
        }
    }
}

/// The restore host cannot take this checkpoint.
#[derive(Debug, Clone, thiserror::Error)]
#[error("this host cannot restore the GPU checkpoint: {}", list(.mismatches))]
pub struct CompatibilityError {
    pub mismatches: Vec<Mismatch>,
}

fn list(m: &[Mismatch]) -> String {
    m.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Compares the inventory recorded at checkpoint with this host's.
///
/// GPUs are compared by position (GPU i of the checkpoint against GPU i here), which
/// is what a restore without GPU pairs does. `min_free_bytes_per_gpu` (e.g. the
/// record's device memory estimate) is checked against each GPU whose free memory is
/// known. Unknown fields (procfs has no memory; an old record has no driver
/// version) are not held against the host.
pub fn check_compatibility(
    recorded: &Inventory,
    current: &Inventory,
    min_free_bytes_per_gpu: Option<u64>,
) -> Result<(), CompatibilityError> {
    let mut mismatches = Vec::new();
    if recorded.gpus.is_empty() {
        return Ok(());
    }
    if current.gpus.is_empty() {
        return Err(CompatibilityError {
            mismatches: vec![Mismatch::NoGpus],
        });
    }
    if current.gpus.len() < recorded.gpus.len() {
        mismatches.push(Mismatch::GpuCount {
            recorded: recorded.gpus.len(),
            current: current.gpus.len(),
        });
    }
    if let (Some(r), Some(c)) = (recorded.driver_branch(), current.driver_branch()) {
        if r != c {
            mismatches.push(Mismatch::DriverBranch {
                recorded: r,
                current: c,
            });
        }
    }
    for (old, new) in recorded.gpus.iter().zip(&current.gpus) {
        if !old.model.is_empty() && !new.model.is_empty() && old.model != new.model {
            mismatches.push(Mismatch::GpuModel {
                index: new.index,
                recorded: old.model.clone(),
                current: new.model.clone(),
            });
        }
        if let (Some(needed), Some(free)) = (min_free_bytes_per_gpu, new.memory_free_bytes) {
            if free < needed {
                mismatches.push(Mismatch::FreeMemory {
                    index: new.index,
                    uuid: new.uuid.clone(),
                    needed,
                    free,
                });
            }
        }
    }
    if mismatches.is_empty() {
        Ok(())
    } else {
        Err(CompatibilityError { mismatches })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv(driver: &str, gpus: &[(&str, Option<u64>)]) -> Inventory {
        Inventory {
            driver_version: Some(driver.into()),
            source: InventorySource::Nvml,
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, (m, free))| GpuInfo {
                    index: i as u32,
                    model: m.to_string(),
                    uuid: format!("GPU-{i}"),
                    bus_id: None,
                    memory_total_bytes: None,
                    memory_free_bytes: *free,
                })
                .collect(),
        }
    }

    #[test]
    fn same_host_is_compatible() {
        let a = inv("580.159.04", &[("NVIDIA H200", Some(100 << 30))]);
        let b = inv("580.65.06", &[("NVIDIA H200", Some(100 << 30))]);
        check_compatibility(&a, &b, Some(10 << 30)).unwrap();
    }

    #[test]
    fn names_every_difference() {
        let a = inv(
            "580.159.04",
            &[("NVIDIA H200", None), ("NVIDIA H200", None)],
        );
        let b = inv("570.86.15", &[("NVIDIA H100 80GB HBM3", Some(1 << 30))]);
        let err = check_compatibility(&a, &b, Some(2 << 30)).unwrap_err();
        let msg = err.to_string();
        assert_eq!(err.mismatches.len(), 4, "{msg}");
        assert!(msg.contains("2 GPUs but this host has 1"), "{msg}");
        assert!(msg.contains("driver branch 570"), "{msg}");
        assert!(msg.contains("H100"), "{msg}");
        assert!(
            msg.contains("1024 MiB free but the checkpoint needs 2048 MiB"),
            "{msg}"
        );
    }

    #[test]
    fn cpu_host_cannot_restore_gpu_checkpoint() {
        let a = inv("580.159.04", &[("NVIDIA H200", None)]);
        let err = check_compatibility(&a, &Inventory::default(), None).unwrap_err();
        assert_eq!(err.mismatches, vec![Mismatch::NoGpus]);
        check_compatibility(&Inventory::default(), &Inventory::default(), None).unwrap();
    }
}
