//! GPU quiescing around CRIU, through the CUDA driver's checkpoint API (gpu-state).
//!
//! Checkpoint: find the container's CUDA processes, lock them, move device memory to host
//! memory (driver checkpoint), let runc/CRIU dump, then (leave-running) restore and unlock.
//! Restore: after `runc restore`, restore and unlock each CUDA process of the new tree.
//! Every failure brings the processes back to RUNNING (gpu-state rolls back) before the
//! error is returned, so a failed checkpoint never leaves a GPU locked.
//!
//! Under gpucr the shim is the quiescer (hook fast path, then the driver path) unless the
//! container asks for CRIU's CUDA plugin (`io.gpucr.gpu-quiesce=plugin`). A CUDA plugin in
//! CRIU's directory (gpucr's, installed by install.sh, or NVIDIA's) is loaded by the same
//! CRIU either way: the shim tells it which processes it already quiesced
//! ([`SHIM_QUIESCED_ENV`] in runc's environment, which runc hands to CRIU), and gpucr's
//! plugin leaves those alone. NVIDIA's plugin does not read it: without `cuda-checkpoint`
//! it disables itself; with it, it leaves CHECKPOINTED processes so and restores them
//! inside CRIU's restore, after which the shim finds them RUNNING and skips them.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use gpu_state::{
    check_compatibility, CheckpointApi, CudaDriver, GpuCheckpointRecord, GpuPair, GpuProcessSet,
    Inventory, StepTimeouts,
};

use crate::error::{Error, Result};
pub use crate::gpu::error::GpuError;

/// Annotation: `auto` (default, = `shim`), `shim` or `plugin` — who quiesces CUDA processes.
pub const QUIESCE_ANNOTATION: &str = "io.gpucr.gpu-quiesce";
/// runc's (and so CRIU's) environment: what the shim quiesced itself, for CRIU's CUDA
/// plugin. A dump: the host pids, comma-separated; a restore: `all` (the shim gives every
/// restored CUDA process its GPU state back after CRIU).
pub const SHIM_QUIESCED_ENV: &str = "GPUCR_SHIM_QUIESCED";
/// Annotation: the driver lock timeout in milliseconds (default 10000).
pub const LOCK_TIMEOUT_ANNOTATION: &str = "io.gpucr.gpu-lock-timeout-ms";
/// Environment (of the shim): `1` makes every process of a container a GPU candidate.
pub use gpu_state::process::discovery::ALL_PROCESSES_ENV;
const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// Who quiesces the GPU for this container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quiescer {
    Shim,
    CriuPlugin,
}

#[derive(Debug, Clone)]
pub struct GpuConfig {
    pub quiescer: Quiescer,
    pub lock_timeout: Duration,
}

impl GpuConfig {
    pub fn from_annotations(annotations: &HashMap<String, String>) -> Result<GpuConfig> {
        let quiescer = match annotations.get(QUIESCE_ANNOTATION).map(String::as_str) {
            None | Some("auto") | Some("") | Some("shim") => Quiescer::Shim,
            Some("plugin") => Quiescer::CriuPlugin,
            Some(other) => {
                return Err(Error::invalid(format!(
                    "{QUIESCE_ANNOTATION}={other:?}: use auto, shim or plugin"
                )))
            }
        };
        let lock_timeout = match annotations.get(LOCK_TIMEOUT_ANNOTATION) {
            None => DEFAULT_LOCK_TIMEOUT,
            Some(ms) => Duration::from_millis(ms.parse().map_err(|_| {
                Error::invalid(format!("{LOCK_TIMEOUT_ANNOTATION}={ms:?} is not a number"))
            })?),
        };
        Ok(GpuConfig {
            quiescer,
            lock_timeout,
        })
    }
}

/// CRIU's plugin directory: `$CRIU_LIBS_DIR`, else the build default.
fn criu_plugin_dir() -> PathBuf {
    std::env::var_os("CRIU_LIBS_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/criu"))
}

/// The CUDA plugins CRIU will load (files of its plugin directory naming `cuda_plugin`):
/// logged at a checkpoint, so an operator sees who else touches the GPU.
pub fn criu_cuda_plugins() -> Vec<PathBuf> {
    let Ok(dir) = std::fs::read_dir(criu_plugin_dir()) else {
        return Vec::new();
    };
    dir.flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "so"))
        .filter(|p| {
            std::fs::read(p)
                .map(|b| b.windows(11).any(|w| w == b"cuda_plugin"))
                .unwrap_or(false)
        })
        .collect()
}

/// The [`SHIM_QUIESCED_ENV`] value of a dump: the host pids the shim quiesced.
pub fn shim_quiesced_value(pids: &[u32]) -> String {
    let mut pids = pids.to_vec();
    pids.sort_unstable();
    pids.dedup();
    pids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Pids (of `pids`) that map an NVIDIA device or libcuda: the only ones worth asking the
/// driver about, so a CPU-only container never loads libcuda into the shim. A process the
/// driver checkpointed holds no `/dev/nvidia*` mapping any more, only libcuda's file mappings:
/// that is what a restored CUDA process looks like until its device memory is back.
pub fn nvidia_pids(pids: &[i32]) -> Vec<u32> {
    pids.iter()
        .map(|p| *p as u32)
        .filter(|pid| gpu_state::process::discovery::is_cuda_candidate(*pid))
        .collect()
}

fn driver() -> Result<Arc<dyn CheckpointApi>> {
    match CudaDriver::probe() {
        Ok(Some(d)) => Ok(Arc::new(d)),
        Ok(None) => Err(GpuError::NoLibcuda.into()),
        Err(e) => Err(GpuError::Driver(e).into()),
    }
}

/// Runs `f` on a blocking thread; a panic is the GPU worker's error.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    crate::gpu::blocking("GPU", f).await?
}

/// CUDA processes locked and checkpointed for one container checkpoint.
pub struct Quiesced {
    set: GpuProcessSet,
}

/// Locks and checkpoints the CUDA processes among `candidates`. `Ok(None)`: none are CUDA.
pub async fn quiesce(candidates: Vec<u32>, lock_timeout: Duration) -> Result<Option<Quiesced>> {
    blocking(move || {
        let api = driver()?;
        let mut set = GpuProcessSet::discover(api, &candidates, StepTimeouts::default())
            .map_err(GpuError::Discover)?;
        if set.is_empty() {
            return Ok(None);
        }
        set.lock_all(lock_timeout).map_err(GpuError::step("lock"))?;
        set.checkpoint_all().map_err(GpuError::step("checkpoint"))?;
        Ok(Some(Quiesced { set }))
    })
    .await
}

impl Quiesced {
    pub fn pids(&self) -> Vec<u32> {
        self.set.pids()
    }

    /// Writes `gpucr-gpu.json` (driver, GPUs, per-process timings) into the image. The set
    /// comes back either way, so the caller can still resume the processes.
    pub async fn record(self, image: PathBuf) -> (Self, Result<()>) {
        let joined = tokio::task::spawn_blocking(move || {
            let record = self.set.record(Some(Inventory::gather()));
            let res = record
                .save(&image)
                .map(drop)
                .map_err(|e| GpuError::WriteRecord(e).into());
            (self, res)
        })
        .await;
        match joined {
            Ok(v) => v,
            Err(e) => panic!("GPU record worker panicked: {e}"),
        }
    }

    /// Restores device memory and unlocks: the processes run again.
    pub async fn resume(mut self) -> Result<()> {
        blocking(move || {
            self.set
                .resume_all(&[])
                .map_err(|e| GpuError::step("resume after checkpoint")(e).into())
        })
        .await
    }

    /// Gives device memory back but keeps the processes LOCKED (their CUDA calls wait): for a
    /// task the client paused, so nothing runs between the dump and the client's snapshot of
    /// the rootfs. `unlock` follows when the task is resumed.
    pub async fn restore_memory(mut self) -> Result<Self> {
        blocking(move || {
            self.set
                .restore_all(&[])
                .map_err(GpuError::step("restore after checkpoint"))?;
            Ok(self)
        })
        .await
    }

    pub async fn unlock(mut self) -> Result<()> {
        blocking(move || {
            self.set
                .unlock_all()
                .map_err(|e| GpuError::step("unlock after checkpoint")(e).into())
        })
        .await
    }
}

/// The GPU record of a checkpoint image, if it has one.
pub fn load_record(image: &Path) -> Result<Option<GpuCheckpointRecord>> {
    if !GpuCheckpointRecord::file_path(image).exists() {
        return Ok(None);
    }
    GpuCheckpointRecord::load(image)
        .map(Some)
        .map_err(|e| GpuError::DamagedRecord(e).into())
}

/// Refuses a restore this host cannot take (driver branch, GPU model, free memory for
/// what the driver restores and the `hook_bytes` the hooks copy back in).
pub fn check_restore(record: &GpuCheckpointRecord, hook_bytes: u64) -> Result<()> {
    let Some(recorded) = &record.inventory else {
        return Ok(());
    };
    let current = Inventory::gather();
    let need = Some(record.device_memory_estimate_bytes() + hook_bytes).filter(|b| *b > 0);
    check_compatibility(recorded, &current, need).map_err(|e| GpuError::Incompatible(e).into())
}

/// The environment that hands GPU pairs to gpucr's CRIU plugin (`GPUCR_GPU_MAP`, and
/// `GPUCR_GPU_PAIRS=always` so identical pairs reach the driver as the plan asked).
pub fn plugin_pair_env(pairs: &[GpuPair]) -> Vec<(String, String)> {
    let map = pairs
        .iter()
        .map(|p| format!("{}={}", p.old, p.new))
        .collect::<Vec<_>>()
        .join(",");
    vec![
        ("GPUCR_GPU_MAP".into(), map),
        ("GPUCR_GPU_PAIRS".into(), "always".into()),
    ]
}

/// After `runc restore`: restore and unlock every CUDA process among `pids`, onto the GPUs
/// `pairs` name when the container moved (empty: the same GPUs).
pub async fn resume_restored(pids: Vec<i32>, pairs: Vec<GpuPair>) -> Result<usize> {
    let candidates = nvidia_pids(&pids);
    if candidates.is_empty() {
        return Ok(0);
    }
    blocking(move || {
        let api = driver()?;
        let mut set = GpuProcessSet::discover(api, &candidates, StepTimeouts::default())
            .map_err(GpuError::Discover)?;
        let n = set.processes().len();
        tracing::info!(
            processes = n,
            gpu_pairs = pairs.len(),
            "restoring device memory"
        );
        set.resume_all(&pairs)
            .map_err(GpuError::step("restore of device memory"))?;
        Ok(n)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotations_pick_the_quiescer_and_timeout() {
        let mut a = HashMap::new();
        a.insert(QUIESCE_ANNOTATION.to_string(), "plugin".to_string());
        a.insert(LOCK_TIMEOUT_ANNOTATION.to_string(), "2500".to_string());
        let c = GpuConfig::from_annotations(&a).unwrap();
        assert_eq!(c.quiescer, Quiescer::CriuPlugin);
        assert_eq!(c.lock_timeout, Duration::from_millis(2500));
        a.insert(QUIESCE_ANNOTATION.to_string(), "both".to_string());
        assert!(GpuConfig::from_annotations(&a).is_err());
        // Whatever CRIU's directory holds, the shim quiesces by default.
        a.remove(QUIESCE_ANNOTATION);
        assert_eq!(
            GpuConfig::from_annotations(&a).unwrap().quiescer,
            Quiescer::Shim
        );
    }

    #[test]
    fn quiesced_pids_reach_the_plugin_sorted_once() {
        assert_eq!(shim_quiesced_value(&[42, 7, 42]), "7,42");
        assert_eq!(shim_quiesced_value(&[]), "");
    }

    #[test]
    fn pairs_reach_the_plugin_as_a_map() {
        use gpu_state::GpuUuid;
        let a = GpuUuid::parse("GPU-aaaaaaaa-1111-2222-3333-444444444444").unwrap();
        let b = GpuUuid::parse("GPU-bbbbbbbb-1111-2222-3333-444444444444").unwrap();
        let env = plugin_pair_env(&[GpuPair { old: a, new: b }]);
        assert_eq!(env[0].0, "GPUCR_GPU_MAP");
        assert_eq!(
            env[0].1,
            "GPU-aaaaaaaa-1111-2222-3333-444444444444=GPU-bbbbbbbb-1111-2222-3333-444444444444"
        );
    }

    #[test]
    fn cpu_processes_are_not_gpu_candidates() {
        assert!(nvidia_pids(&[std::process::id() as i32]).is_empty());
    }
}
