//! The hook's copy settings: the `GPUCR_HOOK_*` environment variables, parsed once into
//! [`FastPathOptions`].

use std::path::PathBuf;
use std::time::Duration;

use gpu_state::image::{Compression, ImageOptions};
use thiserror::Error;

/// How the fast path runs.
#[derive(Debug, Clone)]
pub struct FastPathOptions {
    /// How images are written (chunk size, compression, worker threads, and the
    /// copy-out staging pool: `max_in_flight` buffers of `chunk_size`).
    pub image: ImageOptions,
    /// How long a freeze waits for GPU work in flight.
    pub freeze_timeout: Duration,
    /// The `pid` tag of the image's allocations (this process's PID, which CRIU keeps).
    pub pid: Option<u32>,
    /// Copy streams, i.e. DMA copies in flight at once (capped by the staging buffers).
    pub streams: usize,
    /// Bytes of the copy-in staging pool (at least two buffers of the image's chunk
    /// size).
    pub copy_in_staging: usize,
    /// Threads reading (decompressing, checking) chunks during copy-in.
    pub read_threads: usize,
    /// When the staged copy-in reads an image through a read-only mapping of its data
    /// files (`memcpy` out of the page cache) instead of `read(2)`.
    pub map_reads: MapReads,
    /// Pin the staging pools for DMA (`cuMemHostRegister`); off, copies go through
    /// pageable memory (for comparison).
    pub pin: bool,
    /// Copy-out DMAs chunks straight into the image's data file when the image is on
    /// tmpfs (mapped shared, registered in windows); see "Copy path" in the README.
    pub direct: bool,
    /// Bytes of the direct data file registered at one time.
    pub direct_window: usize,
    /// Prepare answers: a CopyOut readied before the freeze (data file allocated and
    /// registered while the workload runs; tmpfs images only), then moved device to
    /// file directly whatever `direct` says.
    pub prepare: bool,
    /// Hash chunks on the GPU before copying (when the driver can): zero chunks and
    /// chunks the parent image stores are not copied, the rest only CRC'd on the CPU.
    pub device_hash: bool,
    /// A Release with `keep` exports the memory (fds to the shim) instead of freeing it,
    /// and Reattach maps it back: a leave-running checkpoint without a copy-in. Needs
    /// memory made exportable (the preloaded hook asks the driver for it when on).
    pub keep: bool,
    /// Snapshot answers (needs `keep`): a leave-running checkpoint copies the memory
    /// device to device and is written after the thaw, while the workload runs.
    pub snapshot: bool,
    /// Bytes of device memory a snapshot must leave free (the workload may allocate
    /// while it is written); with less room, Snapshot is refused.
    pub snapshot_headroom: u64,
    /// Copy-in helpers Warm starts (`gpucr-copyin` at `helper_path`; 0: none). See
    /// [`crate::helper`].
    pub copy_in_helpers: usize,
    /// The helper binary (`GPUCR_HOOK_HELPER`; unset: no helpers).
    pub helper_path: Option<PathBuf>,
    /// Fraction of a copy-in's bytes the helpers take together; `None`: 30% when
    /// their jobs come with the copy-in, 70% when Warm sent them ahead (pinned ahead,
    /// a helper's share is DMA only).
    pub helper_share: Option<f64>,
}

/// When the staged copy-in maps an image's data files instead of reading them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapReads {
    /// Always `read(2)` (`GPUCR_HOOK_MAP_READS=0`, the default): with 16 MiB chunks
    /// the copy-in waits on the DMA, not on the readers, so mapping gains nothing
    /// measurable and populating the map costs time (docs/BENCHMARKS.md).
    Off,
    /// Images on a tmpfs that keeps them in huge pages (`huge` or `1`): a little faster
    /// than `read(2)` when the readers bound the copy-in (32 MiB chunks: 16 buffers for 12
    /// readers); slower on 4 KiB pages, hence not there (docs/BENCHMARKS.md).
    HugePages,
    /// Any image on tmpfs (`tmpfs`).
    Tmpfs,
}

/// Hook copy settings from the environment (see [`FastPathOptions::from_env_with`]).
pub const ENV_COMPRESSION: &str = "GPUCR_HOOK_COMPRESSION";
pub const ENV_CHUNK_MIB: &str = "GPUCR_HOOK_CHUNK_MIB";
pub const ENV_STAGING_MIB: &str = "GPUCR_HOOK_STAGING_MIB";
pub const ENV_THREADS: &str = "GPUCR_HOOK_THREADS";
pub const ENV_STREAMS: &str = "GPUCR_HOOK_STREAMS";
pub const ENV_PIN: &str = "GPUCR_HOOK_PIN";
pub const ENV_DIRECT: &str = "GPUCR_HOOK_DIRECT";
pub const ENV_DIRECT_WINDOW_MIB: &str = "GPUCR_HOOK_DIRECT_WINDOW_MIB";
pub const ENV_PREPARE: &str = "GPUCR_HOOK_PREPARE";
pub const ENV_MAP_READS: &str = "GPUCR_HOOK_MAP_READS";
pub const ENV_DEVICE_HASH: &str = "GPUCR_HOOK_DEVICE_HASH";
pub const ENV_KEEP: &str = "GPUCR_HOOK_KEEP";
pub const ENV_SNAPSHOT: &str = "GPUCR_HOOK_SNAPSHOT";
pub const ENV_SNAPSHOT_HEADROOM_MIB: &str = "GPUCR_HOOK_SNAPSHOT_HEADROOM_MIB";
pub const ENV_COPYIN_HELPERS: &str = "GPUCR_HOOK_COPYIN_HELPERS";
pub const ENV_HELPER: &str = "GPUCR_HOOK_HELPER";
pub const ENV_HELPER_SHARE: &str = "GPUCR_HOOK_HELPER_SHARE";
/// Stored chunks start at multiples of this many MiB (the store's slice: the shim sets it for
/// checkpoints by reference, see [`ImageOptions::align`]); unset or 0: end to end.
pub const ENV_ALIGN_MIB: &str = "GPUCR_HOOK_ALIGN_MIB";

/// Hook defaults: 16 MiB chunks (few calls per GB, and 32 buffers in each 512 MiB
/// staging pool: with 16 of 32 MiB the 12 readers and 4 copies in flight held every
/// buffer and waited on each other, so both directions were slower), no compression
/// (model weights barely compress, and zstd costs a worker far more than it saves),
/// 512 MiB of staging each way. Figures: docs/BENCHMARKS.md.
const DEFAULT_CHUNK_MIB: usize = 16;
const DEFAULT_STAGING_MIB: usize = 512;
const DEFAULT_STREAMS: usize = 4;
/// 2 GiB registered at a time: bounded pinning, few register calls per image.
const DEFAULT_DIRECT_WINDOW_MIB: usize = 2048;
/// Free device memory a snapshot leaves the workload (for the seconds of the write).
const DEFAULT_SNAPSHOT_HEADROOM_MIB: usize = 1024;
/// What the copy-in helpers take together when their jobs come with the copy-in: the
/// best measured share with two helpers (a larger one left the helpers the last to
/// finish, pinning as they went).
pub(super) const HELPER_SHARE_AT_COPY_IN: f64 = 0.3;
/// ... and when Warm sent the jobs ahead (their pinning is done by the copy-in): the
/// best of the shares measured (docs/BENCHMARKS.md).
pub(super) const HELPER_SHARE_AHEAD: f64 = 0.7;

/// A bad hook copy setting in the environment.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{var}={value:?}: {reason}")]
pub struct OptionsError {
    pub var: &'static str,
    pub value: String,
    pub reason: &'static str,
}

impl FastPathOptions {
    /// The hook's options from environment variables (`get` looks one up):
    /// `GPUCR_HOOK_COMPRESSION` = `none` (default) | `zstd` | `zstd:<level>`,
    /// `GPUCR_HOOK_CHUNK_MIB` (32), `GPUCR_HOOK_STAGING_MIB` (512, per direction),
    /// `GPUCR_HOOK_THREADS` (CPUs, at most 16), `GPUCR_HOOK_STREAMS` (4),
    /// `GPUCR_HOOK_PIN` (`1`; `0` copies through pageable memory),
    /// `GPUCR_HOOK_DIRECT` (`0`; `1`: direct copy-out into tmpfs images),
    /// `GPUCR_HOOK_DIRECT_WINDOW_MIB` (2048), `GPUCR_HOOK_PREPARE` (`1`; `0` refuses
    /// Prepare), `GPUCR_HOOK_DEVICE_HASH` (`1`; `0` hashes
    /// every chunk on the CPU after copying it), `GPUCR_HOOK_KEEP` (`1`; `0`: device
    /// memory is plain, never exported, and a leave-running checkpoint copies it back),
    /// `GPUCR_HOOK_SNAPSHOT` (`1`; `0`: the memory is written while frozen),
    /// `GPUCR_HOOK_ALIGN_MIB` (`0`; chunks start at multiples of it),
    /// `GPUCR_HOOK_SNAPSHOT_HEADROOM_MIB` (1024), `GPUCR_HOOK_MAP_READS` (`0`; `huge`, `tmpfs`:
    /// see [`MapReads`]).
    pub fn from_env_with(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<FastPathOptions, OptionsError> {
        let number = |var: &'static str, default: usize| -> Result<usize, OptionsError> {
            match get(var) {
                None => Ok(default),
                Some(v) => match v.trim().parse::<usize>() {
                    Ok(n) if n > 0 => Ok(n),
                    _ => Err(OptionsError {
                        var,
                        value: v,
                        reason: "expected a positive integer",
                    }),
                },
            }
        };
        let compression = match get(ENV_COMPRESSION) {
            None => Compression::None,
            Some(v) => parse_compression(&v).ok_or(OptionsError {
                var: ENV_COMPRESSION,
                value: v,
                reason: "expected none, zstd or zstd:<level 1..=19>",
            })?,
        };
        let cpus = std::thread::available_parallelism().map_or(4, |n| n.get());
        let chunk_mib = number(ENV_CHUNK_MIB, DEFAULT_CHUNK_MIB)?;
        if chunk_mib > 1024 {
            return Err(OptionsError {
                var: ENV_CHUNK_MIB,
                value: chunk_mib.to_string(),
                reason: "chunks are at most 1024 MiB",
            });
        }
        let chunk_size = chunk_mib << 20;
        let align = match get(ENV_ALIGN_MIB) {
            None => 0,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) if n <= 1024 => n << 20,
                _ => {
                    return Err(OptionsError {
                        var: ENV_ALIGN_MIB,
                        value: v,
                        reason: "expected 0 to 1024 MiB",
                    })
                }
            },
        };
        let staging = number(ENV_STAGING_MIB, DEFAULT_STAGING_MIB)? << 20;
        let threads = number(ENV_THREADS, cpus.clamp(1, 16))?.min(256);
        let streams = number(ENV_STREAMS, DEFAULT_STREAMS)?.min(64);
        let flag = |var: &'static str, default: bool| match get(var).as_deref().map(str::trim) {
            None => Ok(default),
            Some("1") => Ok(true),
            Some("0") => Ok(false),
            Some(v) => Err(OptionsError {
                var,
                value: v.to_string(),
                reason: "expected 0 or 1",
            }),
        };
        let pin = flag(ENV_PIN, true)?;
        let direct = flag(ENV_DIRECT, false)?;
        let direct_window = number(ENV_DIRECT_WINDOW_MIB, DEFAULT_DIRECT_WINDOW_MIB)? << 20;
        let prepare = flag(ENV_PREPARE, true)?;
        let map_reads = match get(ENV_MAP_READS).as_deref().map(str::trim) {
            Some("huge" | "1") => MapReads::HugePages,
            None | Some("0") => MapReads::Off,
            Some("tmpfs") => MapReads::Tmpfs,
            Some(v) => {
                return Err(OptionsError {
                    var: ENV_MAP_READS,
                    value: v.to_string(),
                    reason: "expected 0, huge (or 1) or tmpfs",
                })
            }
        };
        let device_hash = flag(ENV_DEVICE_HASH, true)?;
        let keep = flag(ENV_KEEP, true)?;
        let snapshot = flag(ENV_SNAPSHOT, true)?;
        let headroom = match get(ENV_SNAPSHOT_HEADROOM_MIB) {
            None => DEFAULT_SNAPSHOT_HEADROOM_MIB as u64,
            Some(v) => v.trim().parse::<u64>().map_err(|_| OptionsError {
                var: ENV_SNAPSHOT_HEADROOM_MIB,
                value: v.clone(),
                reason: "expected a number of MiB",
            })?,
        };
        let copy_in_helpers = match get(ENV_COPYIN_HELPERS) {
            None => 0,
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n <= 8 => n,
                _ => {
                    return Err(OptionsError {
                        var: ENV_COPYIN_HELPERS,
                        value: v,
                        reason: "expected 0 to 8 helpers",
                    })
                }
            },
        };
        let helper_share = match get(ENV_HELPER_SHARE) {
            None => None,
            Some(v) => match v.trim().parse::<u32>() {
                Ok(n) if n <= 100 => Some(n as f64 / 100.0),
                _ => {
                    return Err(OptionsError {
                        var: ENV_HELPER_SHARE,
                        value: v,
                        reason: "expected a percentage, 0 to 100",
                    })
                }
            },
        };
        Ok(FastPathOptions {
            image: ImageOptions {
                chunk_size,
                compression,
                threads,
                // At least one buffer per stream plus one to hand to the workers.
                max_in_flight: (staging / chunk_size).max(streams + 1),
                align,
            },
            freeze_timeout: Duration::from_secs(30),
            pid: Some(std::process::id()),
            streams,
            copy_in_staging: staging,
            read_threads: threads,
            map_reads,
            pin,
            direct,
            direct_window,
            prepare,
            device_hash,
            keep,
            snapshot,
            snapshot_headroom: headroom << 20,
            copy_in_helpers,
            helper_path: get(ENV_HELPER)
                .filter(|v| !v.trim().is_empty())
                .map(PathBuf::from),
            helper_share,
        })
    }

    /// The hook's options from the process environment; a bad setting is logged and
    /// the built-in defaults are used.
    pub fn from_env() -> FastPathOptions {
        Self::from_env_with(|var| std::env::var(var).ok()).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "ignoring the hook's copy settings");
            Self::from_env_with(|_| None).expect("defaults are valid")
        })
    }
}

fn parse_compression(value: &str) -> Option<Compression> {
    match value.trim() {
        "none" => Some(Compression::None),
        "zstd" => Some(Compression::Zstd { level: 1 }),
        v => {
            let level: i32 = v.strip_prefix("zstd:")?.parse().ok()?;
            (1..=19)
                .contains(&level)
                .then_some(Compression::Zstd { level })
        }
    }
}

impl Default for FastPathOptions {
    /// [`FastPathOptions::from_env`]: the preloaded hook makes its options this way.
    fn default() -> Self {
        Self::from_env()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_state::image::Compression;

    #[test]
    fn options_come_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let d = FastPathOptions::from_env_with(env(&[])).unwrap();
        assert_eq!(d.image.compression, Compression::None);
        assert_eq!(d.image.chunk_size, 16 << 20);
        assert_eq!(d.image.max_in_flight, 32);
        assert_eq!((d.streams, d.copy_in_staging, d.pin), (4, 512 << 20, true));
        let o = FastPathOptions::from_env_with(env(&[
            (ENV_COMPRESSION, "zstd:3"),
            (ENV_CHUNK_MIB, "64"),
            (ENV_STAGING_MIB, "256"),
            (ENV_THREADS, "12"),
            (ENV_STREAMS, "8"),
            (ENV_PIN, "0"),
        ]))
        .unwrap();
        assert_eq!(o.image.compression, Compression::Zstd { level: 3 });
        assert_eq!((o.image.chunk_size, o.image.max_in_flight), (64 << 20, 9));
        assert_eq!((o.image.threads, o.read_threads, o.streams), (12, 12, 8));
        assert!(!o.pin);
        assert!(!d.direct && d.direct_window == 2048 << 20);
        // The helpers' share: by mode unless set.
        assert_eq!((d.copy_in_helpers, d.helper_share), (0, None));
        let h = FastPathOptions::from_env_with(env(&[(ENV_HELPER_SHARE, "50")])).unwrap();
        assert_eq!(h.helper_share, Some(0.5));
        assert_eq!(d.image.align, 0);
        let a = FastPathOptions::from_env_with(env(&[(ENV_ALIGN_MIB, "8")])).unwrap();
        assert_eq!(a.image.align, 8 << 20);
        assert!(FastPathOptions::from_env_with(env(&[(ENV_ALIGN_MIB, "x")])).is_err());
        assert!(FastPathOptions::from_env_with(env(&[(ENV_HELPER_SHARE, "150")])).is_err());
        assert_eq!(d.map_reads, MapReads::Off);
        for (v, want) in [
            ("0", MapReads::Off),
            ("huge", MapReads::HugePages),
            ("1", MapReads::HugePages),
            ("tmpfs", MapReads::Tmpfs),
        ] {
            let pairs: &'static [(&'static str, &'static str)] =
                Box::leak(Box::new([(ENV_MAP_READS, v)]));
            let o = FastPathOptions::from_env_with(env(pairs)).unwrap();
            assert_eq!(o.map_reads, want, "{v}");
        }
        let on = FastPathOptions::from_env_with(env(&[
            (ENV_DIRECT, "1"),
            (ENV_DIRECT_WINDOW_MIB, "512"),
        ]))
        .unwrap();
        assert!(on.direct && on.direct_window == 512 << 20);
        let z = FastPathOptions::from_env_with(env(&[(ENV_COMPRESSION, "zstd")])).unwrap();
        assert_eq!(z.image.compression, Compression::Zstd { level: 1 });
        for (var, bad) in [
            (ENV_COMPRESSION, "lz4"),
            (ENV_COMPRESSION, "zstd:99"),
            (ENV_CHUNK_MIB, "0"),
            (ENV_CHUNK_MIB, "2048"),
            (ENV_STREAMS, "x"),
            (ENV_PIN, "yes"),
            (ENV_DIRECT, "on"),
            (ENV_DIRECT_WINDOW_MIB, "0"),
            (ENV_MAP_READS, "yes"),
        ] {
            let pairs: &'static [(&'static str, &'static str)] = Box::leak(Box::new([(var, bad)]));
            let err = FastPathOptions::from_env_with(env(pairs)).unwrap_err();
            assert_eq!(err.var, var);
        }
    }
}
