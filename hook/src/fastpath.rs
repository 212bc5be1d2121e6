//! The fast path: freeze → copy every tracked allocation out into a GPU state image →
//! release the physical memory (keeping the VA ranges); then remap (new physical
//! memory at the same VAs) → copy in from the image → thaw.
//!
//! Copies are pipelined (see "Copy path" in the README): copy-out DMAs device memory
//! straight into the [`ImageWriter`]'s staging buffers (pinned once per image through
//! [`VmmDriver::register_host`]) on `streams` copy streams, while the writer's workers
//! hash and store the chunks already copied; copy-in has reader threads fill a pinned
//! [`StagingPool`] (read, decompress, CRC) while the filled buffers go to the device on
//! the copy streams. Host memory stays bounded by the two pools; nothing holds a copy
//! of all device memory, and no DMA outlives its buffer ([`InFlight`]).

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_state::image::gpuhash::{self, ChunkDigest};
use gpu_state::image::{
    AllocId, AllocationTags, Compression, DirectChunk, DirectRegion, ImageError, ImageOptions,
    ImageReader, ImageWriter, Location, MappedImage, NoDirect, StagedChunk, StagingPin,
    StagingPool,
};
use thiserror::Error;

use crate::alloc::{AllocError, AllocState, Allocation, Allocator, Unsupported};
use crate::control::Engine;
use crate::driver::{fd_identity, DevicePtr, DriverError, VmmDriver};
use crate::gate::{Gate, GateError};
use crate::helper::{data_file_fds, plan_image_jobs, AheadJob, Helper, HelperMsg, Helpers};
use crate::prepared::{Prepared, Registered, Target};
use crate::protocol::{
    CheckpointState, CopyInReport, CopyOutReport, CopyProfile, HelperReport, HookStatus,
    MemoryReport, PrepareReport, SnapshotReport, WarmReport,
};
use crate::snapshot::{Snapshot, SnapshotError};

/// Fast path errors.
#[derive(Debug, Error)]
pub enum FastPathError {
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error("GPU state image: {0}")]
    Image(#[from] ImageError),
    #[error("{} allocation(s) the hook cannot move (first: {:?}); use the driver path", .0.len(), .0.first())]
    UnsupportedMemory(Vec<Unsupported>),
    #[error("allocation {va:#x} is not in the image")]
    NotInImage { va: DevicePtr },
    #[error("image allocation {va:#x} is not tracked by this process")]
    NotTracked { va: DevicePtr },
    #[error("allocation {va:#x} is {tracked} bytes here and {image} bytes in the image")]
    SizeMismatch {
        va: DevicePtr,
        tracked: u64,
        image: u64,
    },
    #[error("allocation {va:#x} is {state:?}; copies need it mapped")]
    NotMapped { va: DevicePtr, state: AllocState },
    #[error("release of {va:#x} failed ({source}); {undo}")]
    ReleaseFailed {
        va: DevicePtr,
        #[source]
        source: AllocError,
        /// What happened to the allocations released before it.
        undo: String,
    },
    #[error("no copy-out image to restore released memory from")]
    NoImage,
    #[error("{count} allocation(s) have no physical memory; Remap and CopyIn before Thaw")]
    ReleasedMemory { count: usize },
    #[error("after the copy-in, allocation {va:#x} at offset {offset:#x} does not match the gh1 digest in {}: the image or the copy is damaged; restore from another checkpoint", image.display())]
    DeviceCheck {
        va: DevicePtr,
        offset: u64,
        image: PathBuf,
    },
    #[error("Reattach: {0}; Remap and CopyIn instead")]
    NotKept(String),
    #[error("no snapshot: {0}")]
    NoSnapshot(&'static str),
    #[error("device memory cannot be kept on the GPU: {0}")]
    NotKeepable(String),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error("copy-out not prepared: {0}; the CopyOut copies through staging buffers")]
    NotPrepared(String),
    #[error("the GPU check of the copied-in memory could not run (the hash kernel failed after the copy-in had begun); treat the restored memory as unchecked")]
    DeviceCheckUnavailable,
}

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
    /// the H200's copy-in waits on the DMA, not on the readers, and mapping gained
    /// nothing there (33.5–35.3 vs 36.1 GB/s; populating the map costs ~10 ms).
    Off,
    /// Images on a tmpfs that keeps them in huge pages (`huge` or `1`): 6% faster than
    /// `read(2)` when the readers bound the copy-in (32 MiB chunks: 16 buffers for 12
    /// readers); on 4 KiB pages 1.6× slower, hence not there (docs/BENCHMARKS.md).
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

/// Hook defaults: 16 MiB chunks (few calls per GB, and 32 buffers in each 512 MiB
/// staging pool: with 16 of 32 MiB the 12 readers and 4 copies in flight held every
/// buffer and waited on each other — on the H200 16 GiB went in at 41 GB/s with 16 MiB
/// against 35 with 32 MiB in one run, and out 1.05–1.3× faster), no compression (model
/// weights barely compress, and zstd caps a worker near 1 GB/s), 512 MiB of staging
/// each way.
const DEFAULT_CHUNK_MIB: usize = 16;
const DEFAULT_STAGING_MIB: usize = 512;
const DEFAULT_STREAMS: usize = 4;
/// 2 GiB registered at a time: bounded pinning, few register calls per image.
const DEFAULT_DIRECT_WINDOW_MIB: usize = 2048;
/// Free device memory a snapshot leaves the workload (for the seconds of the write).
const DEFAULT_SNAPSHOT_HEADROOM_MIB: usize = 1024;
/// What the copy-in helpers take together when their jobs come with the copy-in: the
/// best of 25–50% with two helpers on the H200 (16 GiB; 40% and more left the helpers
/// the last to finish, pinning as they went).
const HELPER_SHARE_AT_COPY_IN: f64 = 0.3;
/// ... and when Warm sent the jobs ahead: the best of 30/50/70% (16 GiB, two helpers:
/// 38.4 / 44.2–45.0 / 48.0 GB/s against 35.5–37.9 staged alone, session 10).
const HELPER_SHARE_AHEAD: f64 = 0.7;

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

/// Pins staging pools through the driver (`cuMemHostRegister`), once per pool.
struct DriverPin<D>(Arc<D>);

impl<D: VmmDriver + 'static> StagingPin for DriverPin<D> {
    fn pin(&self, ptr: *mut u8, len: usize) -> Result<(), String> {
        self.0.register_host(ptr, len).map_err(|e| e.to_string())
    }
    fn unpin(&self, ptr: *mut u8, len: usize) {
        if let Err(e) = self.0.unregister_host(ptr) {
            tracing::warn!(error = %e, bytes = len, "cannot unregister staging memory");
        }
    }
}

/// Async copies in flight, oldest first, at most one per stream (`depth` streams used
/// round robin, the oldest completed before a stream is reused). Dropping it waits for
/// every copy still in flight, so on any error path no DMA outlives its buffer.
struct InFlight<'d, D: VmmDriver, T> {
    driver: &'d D,
    depth: usize,
    issued: usize,
    queue: VecDeque<(usize, T)>,
    /// Time spent waiting for copies to complete.
    waited: Duration,
}

impl<'d, D: VmmDriver, T> InFlight<'d, D, T> {
    fn new(driver: &'d D, depth: usize) -> Self {
        InFlight {
            driver,
            depth: depth.max(1),
            issued: 0,
            queue: VecDeque::new(),
            waited: Duration::ZERO,
        }
    }

    fn is_full(&self) -> bool {
        self.queue.len() >= self.depth
    }

    /// Issues a copy with `issue(stream)` and keeps `item` (its buffer) until it is
    /// waited for; completes the oldest copy first when all streams are busy.
    fn start(
        &mut self,
        item: T,
        issue: impl FnOnce(&mut T, usize) -> Result<(), DriverError>,
    ) -> Result<Option<T>, DriverError> {
        let done = if self.is_full() {
            self.complete_oldest()?
        } else {
            None
        };
        let stream = self.issued % self.depth;
        let mut item = item;
        // A copy that failed to issue was never queued: its buffer may go.
        issue(&mut item, stream)?;
        self.issued += 1;
        self.queue.push_back((stream, item));
        Ok(done)
    }

    /// Waits for the oldest copy and hands back its buffer.
    fn complete_oldest(&mut self) -> Result<Option<T>, DriverError> {
        let Some((stream, item)) = self.queue.pop_front() else {
            return Ok(None);
        };
        let t = Instant::now();
        let waited = self.driver.wait(stream);
        self.waited += t.elapsed();
        waited?;
        Ok(Some(item))
    }
}

impl<D: VmmDriver, T> Drop for InFlight<'_, D, T> {
    fn drop(&mut self) {
        for (stream, _) in &self.queue {
            if let Err(e) = self.driver.wait(*stream) {
                tracing::warn!(error = %e, "a copy stream failed while abandoning copies");
            }
        }
    }
}

const PAGE: usize = 4096;

/// A chunk whose copy-out is in flight: into a staging buffer or straight into the
/// direct data file.
enum Pending {
    Staged(StagedChunk),
    Direct(DirectChunk),
}

impl Pending {
    fn target(&mut self) -> (*mut u8, usize) {
        match self {
            Pending::Staged(c) => (c.as_mut_ptr(), c.len()),
            Pending::Direct(c) => (c.as_mut_ptr(), c.len()),
        }
    }

    fn commit(self, writer: &mut ImageWriter) -> Result<(), ImageError> {
        match self {
            Pending::Staged(c) => writer.commit(c),
            Pending::Direct(c) => writer.commit_direct(c),
        }
    }
}

/// Windows registered ahead of the one in use: registering pins (and on fresh tmpfs
/// pages faults in and zeroes) every page, so the next window is registered on a helper
/// thread while the copies run in the current one.
const WINDOWS_AHEAD: usize = 1;

/// A span's window and the bytes at its start (`head`) that lie before it.
type SpanWindow = (usize, usize);

/// Page-disjoint windows of about `size` bytes over `spans` (address, length, group:
/// one mapping), taken in order (`None`: a span that needs no window); returns the
/// windows `[start, end)` and for each span its window and `head`: bytes at its start
/// that lie in the page of the previous window (two registrations may not share a
/// page), to be copied apart. Spans whose start shares a page are unaligned chunks of a
/// staged image; a span within one shared page joins the previous window.
fn plan_windows(
    spans: impl IntoIterator<Item = Option<(usize, usize, usize)>>,
    size: usize,
) -> (Vec<(usize, usize)>, Vec<Option<SpanWindow>>) {
    let mut windows: Vec<(usize, usize, usize)> = Vec::new();
    let mut of = Vec::new();
    for span in spans {
        let Some((addr, len, group)) = span else {
            of.push(None);
            continue;
        };
        let end = addr + len;
        let mut head = 0;
        let mut start = addr & !(PAGE - 1);
        match windows.last_mut() {
            Some(w) if w.2 == group && end <= w.0.saturating_add(size) => {
                w.1 = w.1.max(end);
                // A duplicate of a chunk whose head went apart starts before the window.
                let head = w.0.saturating_sub(addr).min(len);
                of.push(Some((windows.len() - 1, head)));
                continue;
            }
            Some(w) if w.2 == group && start < w.1.next_multiple_of(PAGE) => {
                let next = w.1.next_multiple_of(PAGE);
                if next >= end {
                    w.1 = w.1.max(end);
                    of.push(Some((windows.len() - 1, 0)));
                    continue;
                }
                head = next - addr;
                start = next;
            }
            _ => {}
        }
        windows.push((start, end, group));
        of.push(Some((windows.len() - 1, head)));
    }
    (windows.into_iter().map(|(s, e, _)| (s, e)).collect(), of)
}

/// Registered windows of host memory, used in order: [`enter`](Self::enter)`(k)`
/// unregisters the window in use and returns once window `k` is registered, while a
/// helper thread registers up to [`WINDOWS_AHEAD`] more. Dropping it unregisters every
/// window (also those registered ahead). The caller waits for the copies of a window
/// before leaving it.
struct Windows<'d, D: VmmDriver> {
    driver: &'d D,
    windows: Vec<(usize, usize)>,
    requests: Option<mpsc::Sender<usize>>,
    results: mpsc::Receiver<(usize, Result<(), DriverError>)>,
    requested: usize,
    /// Registered and not unregistered yet.
    live: Vec<usize>,
    current: Option<usize>,
    /// Windows registered so far.
    registered: usize,
    /// Time spent in [`enter`](Self::enter).
    waited: Duration,
}

impl<'d, D: VmmDriver> Windows<'d, D> {
    fn start<'s>(
        scope: &'s std::thread::Scope<'s, 'd>,
        driver: &'d D,
        windows: Vec<(usize, usize)>,
        read_only: bool,
    ) -> Self {
        let (requests, todo) = mpsc::channel::<usize>();
        let (done, results) = mpsc::channel();
        let list = windows.clone();
        scope.spawn(move || {
            for k in todo {
                let (start, end) = list[k];
                let ptr = start as *mut u8;
                let result = if read_only {
                    driver.register_host_read_only(ptr, end - start)
                } else {
                    driver.register_host(ptr, end - start)
                };
                if done.send((k, result.clone())).is_err() {
                    if result.is_ok() {
                        let _ = driver.unregister_host(ptr);
                    }
                    return;
                }
            }
        });
        Windows {
            driver,
            windows,
            requests: Some(requests),
            results,
            requested: 0,
            live: Vec::new(),
            current: None,
            registered: 0,
            waited: Duration::ZERO,
        }
    }

    fn current(&self) -> Option<usize> {
        self.current
    }

    fn enter(&mut self, k: usize) -> Result<(), DriverError> {
        let t = Instant::now();
        let entered = self.enter_inner(k);
        self.waited += t.elapsed();
        entered
    }

    fn enter_inner(&mut self, k: usize) -> Result<(), DriverError> {
        if let Some(c) = self.current.take() {
            self.unregister(c);
        }
        let last = (k + WINDOWS_AHEAD).min(self.windows.len() - 1);
        while self.requested <= last {
            if let Some(tx) = &self.requests {
                let _ = tx.send(self.requested);
            }
            self.requested += 1;
        }
        loop {
            let gone = DriverError {
                call: crate::driver::DriverCall::RegisterHost,
                code: crate::driver::CUDA_ERROR_INVALID_VALUE,
            };
            let (i, result) = self.results.recv().map_err(|_| gone)?;
            match result {
                Ok(()) => {
                    self.live.push(i);
                    self.registered += 1;
                    if i == k {
                        self.current = Some(k);
                        return Ok(());
                    }
                }
                Err(e) if i == k => return Err(e),
                // A window before `k` that was skipped failed: nothing to undo.
                Err(_) => {}
            }
        }
    }

    fn unregister(&mut self, k: usize) {
        self.live.retain(|&i| i != k);
        if let Err(e) = self.driver.unregister_host(self.windows[k].0 as *mut u8) {
            tracing::warn!(error = %e, "cannot unregister a window");
        }
    }
}

impl<D: VmmDriver> Drop for Windows<'_, D> {
    fn drop(&mut self) {
        // The helper stops after the requests sent; undo what it registered.
        self.requests = None;
        self.current = None;
        while let Ok((i, result)) = self.results.recv() {
            if result.is_ok() {
                self.live.push(i);
            }
        }
        for k in std::mem::take(&mut self.live) {
            self.unregister(k);
        }
    }
}

/// One chunk a copy-out moves: allocation `id` at device address `va`, `len` bytes
/// from `offset`.
struct ChunkTodo {
    id: AllocId,
    va: DevicePtr,
    offset: u64,
    len: u64,
}

/// Why the direct copy-in stopped.
enum DirectInError {
    Driver(DriverError),
    /// A chunk failed its check.
    Corrupt(ImageError),
}

impl From<DriverError> for DirectInError {
    fn from(e: DriverError) -> Self {
        DirectInError::Driver(e)
    }
}

/// The fast path over one process's allocations and gate.
pub struct FastPath<D: VmmDriver> {
    allocator: Arc<Allocator<D>>,
    gate: Arc<Gate>,
    opts: FastPathOptions,
    /// The last image copied out, to undo a release that failed half-way.
    last_image: Mutex<Option<PathBuf>>,
    /// Memory exported by the last Release with `keep`: each address and its fd's
    /// identity, so Reattach maps back exactly that memory.
    kept: Mutex<BTreeMap<DevicePtr, Option<(u64, u64)>>>,
    /// The snapshot of a Snapshot verb, until written or dropped.
    snapshot: Mutex<Option<Snapshot>>,
    /// A CopyOut readied by Prepare, until that CopyOut or another verb.
    prepared: Mutex<Option<Prepared<D>>>,
    /// Copy-in helpers started by Warm, until the copy-in (or Thaw) lets them go.
    helpers: Mutex<Option<Helpers>>,
    /// Threads reaping helpers that were let go; joined at the next freeze, so no
    /// helper is left when anything dumps this process.
    reapers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl<D: VmmDriver + 'static> FastPath<D> {
    pub fn new(allocator: Arc<Allocator<D>>, gate: Arc<Gate>, opts: FastPathOptions) -> Self {
        FastPath {
            allocator,
            gate,
            opts,
            last_image: Mutex::new(None),
            kept: Mutex::new(BTreeMap::new()),
            snapshot: Mutex::new(None),
            prepared: Mutex::new(None),
            helpers: Mutex::new(None),
            reapers: Mutex::new(Vec::new()),
        }
    }

    fn driver(&self) -> &D {
        self.allocator.driver()
    }

    /// Tracked allocations, refusing if any memory cannot be moved.
    fn movable(&self) -> Result<Vec<Allocation>, FastPathError> {
        let table = self.allocator.table();
        if !table.unsupported().is_empty() {
            return Err(FastPathError::UnsupportedMemory(
                table.unsupported().to_vec(),
            ));
        }
        Ok(table.iter().cloned().collect())
    }

    /// What pins staging pools, unless pinning is off.
    fn pin(&self) -> Option<Arc<dyn StagingPin>> {
        let pin = DriverPin(self.allocator.driver().clone());
        self.opts.pin.then(|| Arc::new(pin) as Arc<dyn StagingPin>)
    }

    /// The copy-out's loop: every chunk DMA'd into a staging buffer or, with `region`,
    /// straight into its place in the direct data file (registered window by window on
    /// a helper thread of `scope`), committed to the writer when its copy is done.
    /// Returns the bytes copied, the windows registered and where the loop waited.
    fn copy_chunks_out<'s, 'd>(
        &'d self,
        scope: &'s std::thread::Scope<'s, 'd>,
        writer: &mut ImageWriter,
        todo: &[ChunkTodo],
        region: Option<DirectRegion>,
        registered: Option<&Registered<D>>,
    ) -> Result<(u64, usize, CopyProfile), FastPathError> {
        let mut plan = None;
        if let Some(region) = region.filter(|_| registered.is_none()) {
            let mut spans = Vec::new();
            for c in todo {
                let (at, len) = writer.direct_place(c.id, c.offset)?;
                spans.push(Some((region.base as usize + at as usize, len, 0)));
            }
            plan = Some(plan_windows(spans, self.opts.direct_window));
        }
        // Unregistered (after the copies are waited for) before the writer can go.
        let mut windows = plan
            .as_mut()
            .map(|(w, _)| Windows::start(scope, self.driver(), std::mem::take(w), false));
        let of = plan.map(|(_, of)| of).unwrap_or_default();
        let mut windows_used = 0;
        let mut profile = CopyProfile::default();
        // Declared after the windows: dropped first, so every copy is waited for before
        // a buffer or window can go.
        let mut flight: InFlight<D, Pending> = InFlight::new(
            self.driver(),
            self.opts.streams.min(writer.options().max_in_flight),
        );
        let mut bytes = 0;
        for (n, c) in todo.iter().enumerate() {
            let (id, offset) = (&c.id, c.offset);
            // Only stage when a buffer can be had without waiting on our own copies.
            if flight.is_full() {
                if let Some(done) = flight.complete_oldest()? {
                    done.commit(writer)?;
                }
            }
            let mut pending = None;
            if registered.is_some() {
                // Prepared: every place is registered already; a chunk left no place
                // (unchanged at the Prepare, changed since) is staged.
                if writer.has_direct_place(*id, offset) {
                    pending = Some(Pending::Direct(writer.stage_direct(*id, offset)?));
                }
            } else if let Some(win) = windows.as_mut() {
                // Direct places are page aligned: no head.
                let (k, _) = of[n].expect("every chunk has a window");
                if win.current() != Some(k) {
                    // No copy may still target the window that goes.
                    while let Some(done) = flight.complete_oldest()? {
                        done.commit(writer)?;
                    }
                    if let Err(e) = win.enter(k) {
                        tracing::warn!(error = %e, "cannot register the direct data file; the rest goes through staging");
                        windows_used = win.registered;
                        profile.register_wait = win.waited.as_secs_f64();
                        windows = None;
                        writer.trim_direct(writer.direct_place(*id, offset)?.0)?;
                    }
                }
                if windows.is_some() {
                    pending = Some(Pending::Direct(writer.stage_direct(*id, offset)?));
                }
            }
            let pending = match pending {
                Some(p) => p,
                None => {
                    let t = Instant::now();
                    let staged = writer.stage(*id, offset)?;
                    profile.buffer_wait += t.elapsed().as_secs_f64();
                    Pending::Staged(staged)
                }
            };
            let done = flight.start(pending, |pending, stream| {
                let (dst, len) = pending.target();
                // SAFETY: the staged buffer or direct range stays in `flight` (the
                // writer and the windows outlive it) until its stream is waited for.
                unsafe {
                    self.driver()
                        .copy_to_host_async(c.va + offset, dst, len, stream)
                }
            })?;
            if let Some(done) = done {
                done.commit(writer)?;
            }
            bytes += c.len;
        }
        while let Some(done) = flight.complete_oldest()? {
            done.commit(writer)?;
        }
        profile.dma_wait = flight.waited.as_secs_f64();
        drop(flight);
        if let Some(w) = &windows {
            windows_used = w.registered;
            profile.register_wait = w.waited.as_secs_f64();
        }
        if let Some(r) = registered {
            windows_used = r.windows();
        }
        Ok((bytes, windows_used, profile))
    }

    /// The chunks to copy, in order. With the device hash (option and driver), every
    /// chunk is hashed on the GPU first and [`ImageWriter::resolve`]d: zero chunks and
    /// chunks the parent image stores are recorded without a copy. Without it, or when
    /// hashing fails (logged), every chunk is copied and hashed on the CPU. The flag says
    /// whether the device hash was used.
    fn resolve_chunks(
        &self,
        writer: &mut ImageWriter,
        sources: &[(Allocation, DevicePtr)],
        ids: &[AllocId],
    ) -> Result<(Vec<ChunkTodo>, bool), FastPathError> {
        // The writer's: an incremental image's is its parent's.
        let chunk = writer.chunk_size() as u64;
        let all = |c: &mut Vec<ChunkTodo>, (a, src): &(Allocation, DevicePtr), id: AllocId| {
            for offset in (0..a.size).step_by(chunk as usize) {
                c.push(ChunkTodo {
                    id,
                    va: *src,
                    offset,
                    len: chunk.min(a.size - offset),
                });
            }
        };
        let mut todo = Vec::new();
        let regions: Vec<_> = sources.iter().map(|(a, src)| (*src, a.size)).collect();
        let Some(digests) = self.device_digests(&regions, chunk)? else {
            for (source, id) in sources.iter().zip(ids) {
                all(&mut todo, source, *id);
            }
            return Ok((todo, false));
        };
        for ((source, id), digests) in sources.iter().zip(ids).zip(digests) {
            let (a, src) = source;
            let Some(digests) = digests else {
                all(&mut todo, source, *id);
                continue;
            };
            for (i, d) in digests.into_iter().enumerate() {
                let offset = i as u64 * chunk;
                let len = chunk.min(a.size - offset);
                if writer.resolve(*id, offset, d)? {
                    todo.push(ChunkTodo {
                        id: *id,
                        va: *src,
                        offset,
                        len,
                    });
                }
            }
        }
        Ok((todo, true))
    }

    /// Every chunk's gh1 digest, hashed on the GPU, of each of `sources` (device address
    /// and size): per source its digests in order, or `None` for a source gh1 cannot hash
    /// (its size); `None` for all when the device hash is off or failed (logged).
    fn device_digests(
        &self,
        sources: &[(DevicePtr, u64)],
        chunk: u64,
    ) -> Result<Option<Vec<Option<Vec<ChunkDigest>>>>, FastPathError> {
        // gh1 hashes whole words: an allocation of another size (a plain cuMemAlloc can
        // ask for any) is hashed on the CPU.
        let hashable = |size: u64| gpuhash::hashable(size) && gpuhash::hashable(chunk);
        let regions: Vec<_> = sources
            .iter()
            .copied()
            .filter(|&(_, size)| hashable(size))
            .collect();
        if !self.opts.device_hash || regions.is_empty() {
            return Ok(None);
        }
        let sums = match self.driver().chunk_sums(&regions, chunk) {
            Ok(Some(sums)) => sums,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::warn!(error = %e, "hashing on the GPU failed; hashing on the CPU after the copy");
                return Ok(None);
            }
        };
        // The driver answers one list of sums per region, one sum per chunk.
        let malformed = || {
            FastPathError::Driver(DriverError {
                call: crate::driver::DriverCall::Hash,
                code: crate::driver::CUDA_ERROR_INVALID_VALUE,
            })
        };
        let mut sums = sums.into_iter();
        let mut out = Vec::with_capacity(sources.len());
        for &(_, size) in sources {
            if !hashable(size) {
                out.push(None);
                continue;
            }
            let sums = sums.next().ok_or_else(malformed)?;
            if sums.len() as u64 != size.div_ceil(chunk) {
                return Err(malformed());
            }
            let digests = sums
                .into_iter()
                .enumerate()
                .map(|(i, s)| s.digest(chunk.min(size - i as u64 * chunk)))
                .collect();
            out.push(Some(digests));
        }
        Ok(Some(out))
    }

    /// The mapped direct data file when direct copy-out is asked for and possible.
    fn direct_region(
        &self,
        writer: &mut ImageWriter,
    ) -> Result<Option<DirectRegion>, FastPathError> {
        if !self.opts.direct {
            return Ok(None);
        }
        if !self.opts.pin {
            tracing::info!("direct copy-out not used: pinning is off");
            return Ok(None);
        }
        if let Some(why) = writer.direct_refusal() {
            if why != NoDirect::Empty {
                tracing::info!(reason = %why, "direct copy-out not used");
            }
            return Ok(None);
        }
        Ok(Some(writer.start_direct()?))
    }

    fn tags(&self) -> AllocationTags {
        AllocationTags {
            pid: self.opts.pid,
            ..AllocationTags::default()
        }
    }

    /// Stops new GPU work, waits for the work in flight and synchronizes the device.
    pub fn freeze(&self) -> Result<(), FastPathError> {
        self.let_helpers_go();
        for reaper in std::mem::take(&mut *lock(&self.reapers)) {
            let _ = reaper.join();
        }
        self.gate.freeze(self.opts.freeze_timeout)?;
        if let Err(e) = self.driver().synchronize() {
            self.gate.thaw()?;
            return Err(e.into());
        }
        Ok(())
    }

    /// Writes every allocation into a new image at `image_dir`: device-to-host DMA of
    /// up to `streams` chunks at a time straight into the writer's pinned staging
    /// buffers, each handed to the writer's workers as soon as its copy is done.
    /// A CopyOut readied by [`FastPath::prepare`] is used when it names the same image
    /// and the allocations did not change since.
    pub fn copy_out(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, FastPathError> {
        let sources: Vec<_> = self
            .mapped()?
            .into_iter()
            .map(|a| {
                let va = a.va;
                (a, va)
            })
            .collect();
        let prepared = self.take_prepared(image_dir, parent, &sources);
        self.write_image(image_dir, parent, &sources, prepared)
    }

    /// Readies a CopyOut into `image_dir` while the workload runs: the image's writer
    /// with its direct data file (every chunk's place) allocated on tmpfs and registered
    /// for DMA. Replaces an earlier one. Refused, nothing held, where the image cannot
    /// take direct copies.
    pub fn prepare(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
    ) -> Result<PrepareReport, FastPathError> {
        self.drop_prepared();
        if !self.opts.prepare {
            return Err(FastPathError::NotPrepared(
                "turned off in this process (GPUCR_HOOK_PREPARE=0)".into(),
            ));
        }
        if !self.opts.pin {
            return Err(FastPathError::NotPrepared("pinning is off".into()));
        }
        let since = Instant::now();
        let target = Target::of(image_dir, parent).map_err(|e| {
            FastPathError::NotPrepared(format!("cannot identify the image's directory: {e}"))
        })?;
        let allocs = self.mapped()?;
        let (mut writer, ids) = self.new_writer(image_dir, parent, &allocs)?;
        if let Some(why) = writer.direct_refusal() {
            return Err(FastPathError::NotPrepared(why.to_string()));
        }
        let skip = match parent {
            Some(_) => self.unchanged_now(&writer, &allocs, &ids)?,
            None => HashSet::new(),
        };
        let region = writer.start_direct_without(|id, i| skip.contains(&(id, i)))?;
        let allocate_seconds = since.elapsed().as_secs_f64();
        let t = Instant::now();
        let registered = Registered::register(
            self.allocator.driver(),
            region.base,
            region.len,
            self.opts.direct_window,
        )?;
        let report = PrepareReport {
            bytes: region.len as u64,
            windows: registered.windows(),
            allocate_seconds,
            register_seconds: t.elapsed().as_secs_f64(),
        };
        tracing::info!(?report, dir = %image_dir.display(), "copy-out prepared");
        *self.prepared.lock().unwrap_or_else(|p| p.into_inner()) = Some(Prepared {
            registered,
            writer,
            target,
            layout: allocs.iter().map(|a| (a.va, a.size)).collect(),
            ids,
            region: (region.base as usize, region.len),
            since,
        });
        Ok(report)
    }

    /// A writer for a new image at `image_dir` with `allocs` begun, in order.
    fn new_writer<'a>(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
        allocs: impl IntoIterator<Item = &'a Allocation>,
    ) -> Result<(ImageWriter, Vec<AllocId>), FastPathError> {
        let mut writer =
            ImageWriter::create_with_pin(image_dir, parent, self.opts.image, self.pin())?;
        let ids = allocs
            .into_iter()
            .map(|a| writer.begin_allocation(a.va, a.size, self.tags()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((writer, ids))
    }

    /// Whether a prepared CopyOut is held.
    pub fn is_prepared(&self) -> bool {
        self.prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Drops a prepared CopyOut, if any: its windows unregistered, its unfinished image
    /// removed.
    pub fn drop_prepared(&self) {
        let prepared = self
            .prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(p) = prepared {
            tracing::info!(
                bytes = p.region.1,
                age_seconds = p.since.elapsed().as_secs_f64(),
                "prepared copy-out dropped"
            );
        }
    }

    /// For an incremental Prepare: the chunks (allocation, index) the GPU hash finds zero
    /// or in the parent chain now, left no place in the data file. Laying out all of them
    /// would allocate and pin the whole image for the few chunks that change (H200, 16 GiB
    /// with 1 changing: Prepare 1.2 s + CopyOut 0.39 s against 0.17 s staged). The CopyOut
    /// hashes again when frozen: a chunk that changed meanwhile is staged, one that went
    /// back has its place punched.
    fn unchanged_now(
        &self,
        writer: &ImageWriter,
        allocs: &[Allocation],
        ids: &[AllocId],
    ) -> Result<HashSet<(AllocId, usize)>, FastPathError> {
        let regions: Vec<_> = allocs.iter().map(|a| (a.va, a.size)).collect();
        let chunk = writer.chunk_size() as u64;
        let Some(digests) = self.device_digests(&regions, chunk)? else {
            return Err(FastPathError::NotPrepared(
                "an incremental copy-out needs the GPU hash to know what changed".into(),
            ));
        };
        let (mut skip, mut total) = (HashSet::new(), 0);
        for ((a, id), digests) in allocs.iter().zip(ids).zip(digests) {
            total += a.size.div_ceil(chunk) as usize;
            for (i, d) in digests.into_iter().flatten().enumerate() {
                if writer.would_resolve(d, chunk.min(a.size - i as u64 * chunk)) {
                    skip.insert((*id, i));
                }
            }
        }
        if skip.len() == total {
            return Err(FastPathError::NotPrepared(
                "nothing changed since the parent (GPU hash): the CopyOut only hashes".into(),
            ));
        }
        Ok(skip)
    }

    /// The prepared CopyOut if it is for this image and these allocations; any other is
    /// dropped (logged).
    fn take_prepared(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
        sources: &[(Allocation, DevicePtr)],
    ) -> Option<Prepared<D>> {
        let p = self
            .prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let why = match Target::of(image_dir, parent) {
            Err(e) => format!("cannot identify the image's directory: {e}"),
            Ok(t) if t != p.target => "prepared for another image".into(),
            Ok(_)
                if !sources
                    .iter()
                    .map(|(a, _)| (a.va, a.size))
                    .eq(p.layout.iter().copied()) =>
            {
                "the allocations changed since the Prepare".into()
            }
            Ok(_) => return Some(p),
        };
        tracing::info!(reason = %why, "prepared copy-out not used");
        None
    }

    /// Every tracked allocation, refusing if any is not mapped (or cannot be moved).
    fn mapped(&self) -> Result<Vec<Allocation>, FastPathError> {
        let allocs = self.movable()?;
        if let Some(alloc) = allocs.iter().find(|a| a.state != AllocState::Mapped) {
            return Err(FastPathError::NotMapped {
                va: alloc.va,
                state: alloc.state,
            });
        }
        Ok(allocs)
    }

    /// The copy-out proper: each allocation of `sources` recorded as it is, its bytes
    /// read at the address paired with it (its own, or its copy in a snapshot).
    fn write_image(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
        sources: &[(Allocation, DevicePtr)],
        prepared: Option<Prepared<D>>,
    ) -> Result<CopyOutReport, FastPathError> {
        let start = Instant::now();
        // Bindings drop in reverse order: `registered` (unpinning) before `writer`
        // (unmapping the data file) on every path.
        let (mut writer, ids, registered, prepared_region) = match prepared {
            Some(p) => {
                let region = p.region();
                (p.writer, p.ids, Some(p.registered), Some(region))
            }
            None => {
                let (writer, ids) =
                    self.new_writer(image_dir, parent, sources.iter().map(|(a, _)| a))?;
                (writer, ids, None, None)
            }
        };
        let staged_at = start.elapsed().as_secs_f64();
        let chunk_bytes = writer.chunk_size() as u64;
        let t = Instant::now();
        let (todo, hashed) = self.resolve_chunks(&mut writer, sources, &ids)?;
        let hash_seconds = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let region = match prepared_region {
            Some(r) => Some(r),
            None => self.direct_region(&mut writer)?,
        };
        let direct_seconds = t.elapsed().as_secs_f64();
        let (copied, windows, mut profile) = std::thread::scope(|scope| {
            self.copy_chunks_out(scope, &mut writer, &todo, region, registered.as_ref())
        })?;
        profile.device_hash = hash_seconds;
        profile.setup = staged_at + direct_seconds;
        let bytes = sources.iter().map(|(a, _)| a.size).sum();
        let stats = writer.stats();
        let t = Instant::now();
        let prepared = registered.is_some();
        drop(registered);
        profile.unregister = t.elapsed().as_secs_f64();
        let t = Instant::now();
        writer.finish()?;
        profile.finish = t.elapsed().as_secs_f64();
        *self.last_image.lock().unwrap_or_else(|p| p.into_inner()) = Some(image_dir.to_path_buf());
        let report = CopyOutReport {
            allocations: sources.len(),
            bytes,
            peak_staging_bytes: stats.peak_in_flight as u64 * chunk_bytes,
            seconds: start.elapsed().as_secs_f64(),
            profile,
            copied_bytes: copied,
            zero_chunks: stats.resolved_zero,
            parent_chunks: stats.resolved_parent,
        };
        tracing::info!(
            ?report,
            dir = %image_dir.display(),
            device_hash = hashed,
            pinned = stats.staging_pinned,
            direct = region.is_some(),
            prepared,
            direct_windows = windows,
            setup_seconds = staged_at,
            "device memory copied out"
        );
        Ok(report)
    }

    /// Releases the physical memory of every mapped allocation; the VA ranges stay.
    /// All or nothing: when one fails, the ones released before it get their memory
    /// back (the kept memory, else refilled from the last copy-out image).
    pub fn release(&self, keep: bool) -> Result<(MemoryReport, Vec<OwnedFd>), FastPathError> {
        let mapped: Vec<Allocation> = self
            .movable()?
            .into_iter()
            .filter(|a| a.state == AllocState::Mapped)
            .collect();
        let exported = if keep && self.opts.keep {
            self.export_all(&mapped).unwrap_or_else(|why| {
                tracing::info!(allocations = mapped.len(), "device memory not kept: {why}");
                Vec::new()
            })
        } else {
            Vec::new()
        };
        let mut report = self.release_each(&mapped, |r| self.undo_release(r, &exported))?;
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.clear();
        let mut fds = Vec::with_capacity(exported.len());
        for (va, fd) in exported {
            kept.insert(va, fd_identity(fd.as_fd()));
            report.held.push(va);
            fds.push(fd);
        }
        Ok((report, fds))
    }

    /// Releases `mapped`, all or nothing: when one fails, `undo` is given the ones
    /// released before it (and it, when unmapped) to give them their memory back.
    fn release_each(
        &self,
        mapped: &[Allocation],
        undo: impl FnOnce(&[Allocation]) -> Result<(), FastPathError>,
    ) -> Result<MemoryReport, FastPathError> {
        let mut report = MemoryReport::default();
        let mut released = Vec::new();
        for alloc in mapped {
            if let Err(source) = self.allocator.release(alloc.va) {
                // Unmapped but not released still counts: its memory is gone.
                if self.allocator.get(alloc.va).map(|a| a.state) == Some(AllocState::Released) {
                    released.push(alloc.clone());
                }
                let undo = match undo(&released) {
                    Ok(()) => format!("{} released allocation(s) restored", released.len()),
                    Err(e) => format!("restoring the released allocations failed: {e}"),
                };
                return Err(FastPathError::ReleaseFailed {
                    va: alloc.va,
                    source,
                    undo,
                });
            }
            report.allocations += 1;
            report.bytes += alloc.mapped_size;
            released.push(alloc.clone());
        }
        Ok(report)
    }

    /// Every allocation's memory exported as an fd, or why not: the fds must fit the
    /// process's fd limit and every export must work.
    fn export_all(&self, allocs: &[Allocation]) -> Result<Vec<(DevicePtr, OwnedFd)>, String> {
        make_fd_room(allocs.len())?;
        let mut out = Vec::with_capacity(allocs.len());
        for a in allocs {
            match self.allocator.export(a.va) {
                Ok(Some(fd)) => out.push((a.va, fd)),
                Ok(None) => return Err("the driver cannot export it".into()),
                Err(e) => return Err(format!("export of {:#x} failed: {e}", a.va)),
            }
        }
        Ok(out)
    }

    /// Copies every allocation into a snapshot on the device, releases the snapshot's
    /// memory kept (its fd returned) and every allocation's (freed: Reattach refills
    /// them from the snapshot, device to device). Nothing changes when it fails: no room
    /// for the snapshot, it cannot be exported, a driver error.
    pub fn snapshot(&self) -> Result<(SnapshotReport, Vec<OwnedFd>), FastPathError> {
        if !(self.opts.snapshot && self.opts.keep) {
            return Err(FastPathError::NoSnapshot(
                "snapshots are off in this process",
            ));
        }
        let mapped = self.mapped()?;
        make_fd_room(1).map_err(FastPathError::NotKeepable)?;
        let t = Instant::now();
        let mut snap = Snapshot::take(self.driver(), &mapped, self.opts.snapshot_headroom)?;
        let copy_seconds = t.elapsed().as_secs_f64();
        let driver = self.driver();
        let fd = match snap.export(driver) {
            Ok(Some(fd)) => fd,
            Ok(None) => {
                snap.free(driver);
                return Err(FastPathError::NotKeepable(
                    "the driver cannot export the snapshot".into(),
                ));
            }
            Err(e) => {
                snap.free(driver);
                return Err(e.into());
            }
        };
        let vas = |r: &[Allocation]| r.iter().map(|a| a.va).collect::<Vec<_>>();
        let mut release = match self.release_each(&mapped, |r| self.refill_from(&snap, &vas(r))) {
            Ok(report) => report,
            Err(e) => {
                snap.free(driver);
                return Err(e);
            }
        };
        if let Err(e) = snap.release(driver) {
            // The snapshot is the released allocations' only copy: mapped again (through
            // its fd if its own release got that far), it refills them.
            let undo = snap
                .reattach(driver, fd.as_fd())
                .map_err(FastPathError::from)
                .and_then(|()| self.refill_from(&snap, &vas(&mapped)));
            snap.free(driver);
            return Err(match undo {
                Ok(()) => e.into(),
                Err(u) => FastPathError::NotKeepable(format!(
                    "{e}; restoring the released allocations from the snapshot failed: {u}"
                )),
            });
        }
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.clear();
        kept.insert(snap.va(), fd_identity(fd.as_fd()));
        drop(kept);
        release.held.push(snap.va());
        let report = SnapshotReport {
            release,
            snapshot_bytes: snap.size(),
            copy_seconds,
        };
        tracing::info!(
            allocations = report.release.allocations,
            bytes = snap.size(),
            copy_seconds,
            "device memory snapshot taken on the device; memory released"
        );
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = Some(snap);
        Ok((report, vec![fd]))
    }

    /// Gives each released allocation of `vas` new memory, filled from its copy in
    /// `snap` (mapped), device to device.
    fn refill_from(&self, snap: &Snapshot, vas: &[DevicePtr]) -> Result<(), FastPathError> {
        for (alloc, src) in snap.sources() {
            if !vas.contains(&alloc.va) {
                continue;
            }
            if self.allocator.get(alloc.va).map(|a| a.state) == Some(AllocState::Released) {
                self.allocator.remap(alloc.va)?;
            }
            self.driver().copy_device(alloc.va, src, alloc.size)?;
        }
        Ok(())
    }

    /// Writes the snapshot (mapped again: after Reattach) into a new image at
    /// `image_dir`, as [`FastPath::copy_out`] would have written the memory when the
    /// snapshot was taken; then frees it. On failure the snapshot stays (DropSnapshot).
    pub fn write_snapshot(
        &self,
        image_dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, FastPathError> {
        let mut guard = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        let snap = guard
            .as_ref()
            .ok_or(FastPathError::NoSnapshot("none taken"))?;
        if !snap.is_mapped() {
            return Err(FastPathError::NoSnapshot(
                "its memory is not mapped (Reattach first)",
            ));
        }
        let report = self.write_image(image_dir, parent, &snap.sources(), None)?;
        if let Some(snap) = guard.take() {
            snap.free(self.driver());
        }
        Ok(report)
    }

    /// Frees the snapshot, if any, without writing it.
    pub fn drop_snapshot(&self) {
        if let Some(snap) = self
            .snapshot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            tracing::info!(bytes = snap.size(), "device memory snapshot dropped");
            snap.free(self.driver());
        }
    }

    /// Maps the memory kept since the last Release back at `held` (its addresses, in
    /// the order of `fds`). Only exactly that memory: every kept address, each with the
    /// fd that left with it.
    pub fn reattach(
        &self,
        held: &[DevicePtr],
        fds: Vec<OwnedFd>,
    ) -> Result<MemoryReport, FastPathError> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let mut sorted = held.to_vec();
        sorted.sort_unstable();
        if !sorted.iter().copied().eq(kept.keys().copied()) || fds.len() != held.len() {
            return Err(FastPathError::NotKept(format!(
                "{} address(es) and {} fd(s) given back, {} kept",
                held.len(),
                fds.len(),
                kept.len()
            )));
        }
        for (va, fd) in held.iter().zip(&fds) {
            if fd_identity(fd.as_fd()) != kept[va] || kept[va].is_none() {
                return Err(FastPathError::NotKept(format!(
                    "the fd given back for {va:#x} is not the memory released there"
                )));
            }
        }
        let mut report = MemoryReport::default();
        let mut snapshot = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        let mut allocations = Vec::with_capacity(held.len());
        for (va, fd) in held.iter().zip(fds) {
            // Mapped, the memory is held by this process's handle; the fd may close.
            match snapshot.as_mut().filter(|s| s.va() == *va) {
                Some(snap) => snap.reattach(self.driver(), fd.as_fd())?,
                None => {
                    self.allocator.reattach(*va, fd.as_fd())?;
                    allocations.push(*va);
                }
            }
            kept.remove(va);
        }
        drop(kept);
        // After a snapshot the allocations were freed: new memory, filled from it.
        if let Some(snap) = snapshot.as_ref() {
            let released: Vec<_> = self
                .allocator
                .table()
                .iter()
                .filter(|a| a.state == AllocState::Released)
                .map(|a| a.va)
                .collect();
            self.refill_from(snap, &released)?;
            allocations.extend(released);
        } else {
            self.make_exportable(&allocations);
        }
        drop(snapshot);
        for va in &allocations {
            report.allocations += 1;
            report.bytes += self.allocator.get(*va).map_or(0, |a| a.mapped_size);
        }
        Ok(report)
    }

    /// Imported memory cannot be exported again: each allocation at `vas` that cannot is
    /// moved onto new memory (a device-to-device copy, HBM-fast), so the next checkpoint
    /// keeps it too. One that cannot move (no room for the copy) stays as it is: the next
    /// keep falls back to the copy-in.
    fn make_exportable(&self, vas: &[DevicePtr]) {
        for &va in vas {
            if let Ok(Some(_fd)) = self.allocator.export(va) {
                continue;
            }
            if let Err(e) = self.allocator.renew(va) {
                tracing::info!(va, error = %e, "reattached memory stays unexportable; the next \
                    leave-running checkpoint copies it back in");
            }
        }
    }

    /// Gives `released` their memory back: the exported memory where it was kept, else
    /// new memory refilled from the last copy-out image.
    fn undo_release(
        &self,
        released: &[Allocation],
        exported: &[(DevicePtr, OwnedFd)],
    ) -> Result<(), FastPathError> {
        let mut refill = Vec::new();
        let mut reattached = Vec::new();
        for alloc in released {
            match exported.iter().find(|(va, _)| *va == alloc.va) {
                Some((va, fd)) => {
                    self.allocator.reattach(*va, fd.as_fd())?;
                    reattached.push(*va);
                }
                None => refill.push(alloc.clone()),
            }
        }
        self.make_exportable(&reattached);
        let released = refill;
        if released.is_empty() {
            return Ok(());
        }
        let dir = self
            .last_image
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(FastPathError::NoImage)?;
        let reader = ImageReader::open(&dir)?;
        for alloc in &released {
            self.allocator.remap(alloc.va)?;
        }
        let now: Vec<Allocation> = released
            .iter()
            .filter_map(|a| self.allocator.get(a.va))
            .collect();
        let plan = self.match_image(&reader, &now, false)?;
        let (work, targets) = Self::chunk_work(&reader, &now, &plan);
        let all: Vec<usize> = (0..work.len()).collect();
        self.fill(&reader, &work, &targets, &all, Instant::now())?;
        Ok(())
    }

    /// Creates physical memory again at the VA of every released allocation.
    pub fn remap(&self) -> Result<MemoryReport, FastPathError> {
        // Kept memory not reattached is given up: the copy-in refills from the image. So
        // is a snapshot (a process restored from a snapshot checkpoint has its address
        // range only; its image was written before the checkpoint completed).
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.drop_snapshot();
        self.for_each_in(AllocState::Released, |va| self.allocator.remap(va))
    }

    fn for_each_in(
        &self,
        state: AllocState,
        op: impl Fn(DevicePtr) -> Result<(), AllocError>,
    ) -> Result<MemoryReport, FastPathError> {
        let mut report = MemoryReport::default();
        for alloc in self.movable()?.iter().filter(|a| a.state == state) {
            op(alloc.va)?;
            report.allocations += 1;
            report.bytes += alloc.mapped_size;
        }
        Ok(report)
    }

    /// Fills every allocation from the image at `image_dir`, which must hold exactly
    /// the tracked allocations.
    pub fn copy_in(&self, image_dir: &Path) -> Result<CopyInReport, FastPathError> {
        let start = Instant::now();
        let allocs = self.movable()?;
        let mut reader = ImageReader::open(image_dir)?;
        let plan = self.match_image(&reader, &allocs, true)?;
        // Chunks hashed on the GPU at copy-out are checked there after the copy (one
        // kernel pass), not by the CPU reading every byte on the way in.
        let device_check = self.opts.device_hash
            && reader.has_gpu_hashes()
            && matches!(
                self.driver()
                    .chunk_sums(&[], reader.manifest().chunk_size.max(8)),
                Ok(Some(_))
            );
        if device_check {
            reader.defer_gpu_hashed_checks();
        }
        let direct = self.fill_direct(&reader, &allocs, &plan)?;
        // Only the staged readers read through the map.
        let mut mapped_reads = false;
        let mut helpers = Vec::new();
        let (bytes, staging_bytes, mut profile) = match direct {
            Some(done) => done,
            None => {
                mapped_reads = self.map_for_reads(&mut reader);
                let (work, targets) = Self::chunk_work(&reader, &allocs, &plan);
                // Helpers only take chunks the GPU check below covers.
                let shared = if device_check {
                    self.hand_out(&reader, &allocs, &work)
                } else {
                    self.let_helpers_go();
                    Shared::default()
                };
                let mine: Vec<usize> = (0..work.len())
                    .filter(|i| shared.taken.get(*i) != Some(&true))
                    .collect();
                let staged = self.fill(&reader, &work, &targets, &mine, start);
                // Waited for also when the staging failed: they DMA into our memory.
                let (reports, failed, reapers) = shared.wait();
                lock(&self.reapers).extend(reapers);
                helpers = reports;
                let (staging_bytes, profile) = staged?;
                if !failed.is_empty() {
                    tracing::warn!(
                        chunks = failed.len(),
                        "a copy-in helper failed; staging its share"
                    );
                    self.fill(&reader, &work, &targets, &failed, Instant::now())?;
                }
                let bytes = allocs.iter().map(|a| a.size).sum();
                (bytes, staging_bytes, profile)
            }
        };
        if device_check {
            let t = Instant::now();
            self.check_on_device(&reader, &allocs, &plan)?;
            profile.device_hash = t.elapsed().as_secs_f64();
        }
        let report = CopyInReport {
            allocations: allocs.len(),
            bytes,
            staging_bytes,
            seconds: start.elapsed().as_secs_f64(),
            profile,
            mapped_reads,
            helpers,
        };
        tracing::info!(?report, dir = %image_dir.display(), "device memory copied in");
        Ok(report)
    }

    /// Starts the copy-in helpers (Warm): they make their CUDA contexts while the
    /// driver restores this process. None without `copy_in_helpers` and a helper path,
    /// or when they cannot start (the copy-in then stages everything). With the image
    /// the copy-in will read, each helper also gets its job now and pins its share of
    /// the image ahead of the copy-in (see [`crate::helper`]). Makes no CUDA call: the
    /// driver may hold this process checkpointed.
    pub fn warm(&self, image_dir: Option<&Path>) -> Result<WarmReport, FastPathError> {
        let mut slot = lock(&self.helpers);
        if slot.is_none() {
            *slot = self.spawn_helpers();
        }
        let Some(helpers) = slot.as_mut() else {
            return Ok(WarmReport::default());
        };
        // A second Warm changes nothing: the same helpers, the same jobs.
        let sent: u64 = helpers
            .list_mut()
            .iter()
            .filter_map(|h| h.ahead.as_ref().map(|a| a.job.bytes))
            .sum();
        let ahead_bytes = match image_dir {
            Some(dir) if sent == 0 => self.send_ahead(helpers, dir).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "copy-in helpers get their jobs at the copy-in");
                0
            }),
            _ => sent,
        };
        Ok(WarmReport {
            helpers: helpers.len(),
            ahead_bytes,
        })
    }

    fn spawn_helpers(&self) -> Option<Helpers> {
        let (n, Some(path)) = (self.opts.copy_in_helpers, self.opts.helper_path.as_ref()) else {
            return None;
        };
        if n == 0 {
            return None;
        }
        let Some(device) = self.driver().device_ordinal() else {
            tracing::info!("copy-in helpers not started: the driver has no device ordinal");
            return None;
        };
        match Helpers::spawn(path, n, device) {
            Ok(h) => {
                tracing::info!(helpers = h.len(), path = %path.display(), "copy-in helpers starting");
                Some(h)
            }
            Err(e) => {
                tracing::warn!(error = %e, "copy-in helpers not started; the copy-in stages everything");
                None
            }
        }
    }

    /// Sends every helper its job for a copy-in from `dir` now; the bytes sent. None
    /// when the copy-in will not use helpers for this image (no gh1 digests to check
    /// their chunks by, or not a raw image on tmpfs).
    fn send_ahead(&self, helpers: &mut Helpers, dir: &Path) -> Result<u64, FastPathError> {
        let reader = ImageReader::open(dir)?;
        if !self.opts.device_hash || !reader.has_gpu_hashes() || reader.direct_refusal().is_some() {
            return Ok(0);
        }
        // Released memory: matched as the copy-in will, but not mapped yet.
        self.plan_in_image(&reader, &self.movable()?, true)?;
        let share = self.opts.helper_share.unwrap_or(HELPER_SHARE_AHEAD);
        let jobs = plan_image_jobs(&reader, self.opts.pid, share, helpers.len())?;
        let files = reader.data_files();
        let mut sent = 0;
        for (helper, (job, desc)) in helpers.list_mut().iter_mut().zip(jobs) {
            if !fd_room(files.len()) {
                tracing::info!(
                    fds = files.len(),
                    "copy-in job not sent ahead: too close to the fd limit"
                );
                break;
            }
            let fds = match data_file_fds(&reader) {
                Ok(fds) => fds,
                Err(e) => {
                    tracing::warn!(error = %e, "copy-in job not sent ahead: cannot duplicate a data file fd");
                    break;
                }
            };
            let bytes = desc.bytes;
            match helper.send_job_ahead(job, fds, desc) {
                Ok(()) => sent += bytes,
                Err(e) => {
                    tracing::warn!(pid = helper.pid(), error = %e, "copy-in job not sent ahead")
                }
            }
        }
        tracing::info!(
            bytes = sent,
            helpers = helpers.len(),
            "copy-in helpers pin their share ahead"
        );
        Ok(sent)
    }

    /// Takes over helpers the shim started and sent their jobs (a restore: see
    /// [`crate::helper`]); any helpers of this process's own are stopped. Makes no CUDA
    /// call.
    pub fn adopt_helpers(
        &self,
        jobs: Vec<AheadJob>,
        socks: Vec<OwnedFd>,
    ) -> Result<WarmReport, FastPathError> {
        let ahead_bytes = jobs.iter().map(|j| j.bytes).sum();
        let helpers = Helpers::adopt(jobs, socks);
        let report = WarmReport {
            helpers: helpers.len(),
            ahead_bytes,
        };
        if let Some(old) = lock(&self.helpers).replace(helpers) {
            lock(&self.reapers).extend(old.stop());
        }
        tracing::info!(
            helpers = report.helpers,
            bytes = ahead_bytes,
            "copy-in helpers of the shim's taken over"
        );
        Ok(report)
    }

    /// Lets any helpers go unused (reaped in the background, joined at the next freeze).
    fn let_helpers_go(&self) {
        if let Some(h) = lock(&self.helpers).take() {
            lock(&self.reapers).extend(h.stop());
        }
    }

    /// The bytes of each work item's chunk.
    fn chunk_lens(reader: &ImageReader, work: &[(AllocId, usize)]) -> Vec<u64> {
        work.iter()
            .map(|&(id, index)| reader.allocations()[id.0].chunks[index].len)
            .collect()
    }

    /// Gives the ready helpers their shares of `work` (see [`plan_image_jobs`]): raw,
    /// gh1-hashed chunks of a tmpfs image, the memory they land in exported. Jobs sent
    /// ahead (by Warm with this image, or by the shim) are used as they are; otherwise
    /// each helper gets its job now. Anything that does not work out leaves the chunks
    /// to the staged copy.
    fn hand_out(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        work: &[(AllocId, usize)],
    ) -> Shared {
        let mut shared = Shared {
            taken: vec![false; work.len()],
            ..Shared::default()
        };
        let Some(helpers) = lock(&self.helpers).take() else {
            return shared;
        };
        let mut reapers = Vec::new();
        let mut ready = if reader.direct_refusal().is_none() {
            helpers.ready_now(&mut reapers)
        } else {
            reapers.extend(helpers.stop());
            Vec::new()
        };
        lock(&self.reapers).extend(reapers);
        if ready.is_empty() {
            return shared;
        }
        if !ready.iter().any(|h| h.ahead.is_some()) {
            ready = self.send_jobs_now(reader, ready);
        }
        let lens = Self::chunk_lens(reader, work);
        let image_id = reader.manifest_hash().to_hex();
        let index: std::collections::HashMap<(usize, usize), usize> = work
            .iter()
            .enumerate()
            .map(|(i, &(id, index))| ((id.0, index), i))
            .collect();
        for mut helper in ready {
            let job = helper.ahead.as_ref().map(|a| &a.job);
            let group: Option<Vec<usize>> = job
                .filter(|j| j.image_id == image_id)
                .and_then(|j| j.chunks.iter().map(|k| index.get(k).copied()).collect());
            let Some(group) = group else {
                tracing::info!(
                    pid = helper.pid(),
                    "copy-in helper not used: it has no job of this image"
                );
                lock(&self.reapers).push(helper.stop());
                continue;
            };
            let job_allocs = job.map(|j| j.allocs.clone()).unwrap_or_default();
            let gone = match self.export_for(allocs, &job_allocs) {
                Ok((fds, sizes)) => helper.go(&fds, &sizes).err(),
                Err(why) => Some(why),
            };
            if let Some(why) = gone {
                tracing::warn!(pid = helper.pid(), reason = %why, "copy-in helper not used");
                lock(&self.reapers).push(helper.stop());
                continue;
            }
            for &i in &group {
                shared.taken[i] = true;
            }
            let bytes = group.iter().map(|&i| lens[i]).sum();
            shared.running.push((helper, group, bytes));
        }
        shared
    }

    /// Sends the ready helpers their jobs now (no job went ahead); those that got one.
    fn send_jobs_now(&self, reader: &ImageReader, ready: Vec<Helper>) -> Vec<Helper> {
        let share = self.opts.helper_share.unwrap_or(HELPER_SHARE_AT_COPY_IN);
        let jobs = match plan_image_jobs(reader, self.opts.pid, share, ready.len()) {
            Ok(jobs) => jobs,
            Err(e) => {
                tracing::warn!(error = %e, "copy-in helpers not used");
                lock(&self.reapers).extend(ready.into_iter().map(Helper::stop));
                return Vec::new();
            }
        };
        let files = reader.data_files();
        let mut with_jobs = Vec::new();
        let mut ready = ready.into_iter();
        for (job, desc) in jobs {
            let Some(mut helper) = ready.next() else {
                break;
            };
            if !fd_room(files.len()) {
                tracing::info!(
                    fds = files.len(),
                    "copy-in helper not used: too close to the fd limit"
                );
                lock(&self.reapers).push(helper.stop());
                continue;
            }
            match helper.send_job(&job, &files, desc) {
                Ok(()) => with_jobs.push(helper),
                Err(e) => {
                    tracing::warn!(pid = helper.pid(), error = %e, "copy-in helper not used");
                    lock(&self.reapers).push(helper.stop());
                }
            }
        }
        lock(&self.reapers).extend(ready.map(Helper::stop));
        with_jobs
    }

    /// The memory fds of a job's allocations (address and size, in job order), each
    /// exported and as the job knows it, and their mapped sizes.
    fn export_for(
        &self,
        allocs: &[Allocation],
        job_allocs: &[(u64, u64)],
    ) -> Result<(Vec<OwnedFd>, Vec<u64>), String> {
        if !fd_room(job_allocs.len()) {
            return Err(format!(
                "{} fds would come too close to the fd limit",
                job_allocs.len()
            ));
        }
        let mut fds = Vec::with_capacity(job_allocs.len());
        let mut sizes = Vec::with_capacity(job_allocs.len());
        for &(va, size) in job_allocs {
            match allocs.iter().find(|a| a.va == va) {
                Some(a) if a.size == size => sizes.push(a.mapped_size),
                _ => return Err(format!("allocation {va:#x} is not as the job knows it")),
            }
            match self.allocator.export(va) {
                Ok(Some(fd)) => fds.push(fd),
                Ok(None) => return Err("its memory cannot be exported here".into()),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok((fds, sizes))
    }

    /// Maps the image's data files for the staged readers as `map_reads` says; whether
    /// they are mapped (a failure is logged, and the readers use `read(2)`).
    fn map_for_reads(&self, reader: &mut ImageReader) -> bool {
        self.opts.map_reads != MapReads::Off
            && reader
                .map_data_files(self.opts.map_reads == MapReads::HugePages)
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "cannot map the image; copy-in reads it with read(2)");
                    false
                })
    }

    /// After a copy-in with deferred checks: hashes the allocations on the GPU and
    /// compares every chunk that has a gh1 digest (and every zero chunk) with the image.
    fn check_on_device(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        plan: &[AllocId],
    ) -> Result<(), FastPathError> {
        let chunk = reader.manifest().chunk_size;
        let pairs: Vec<_> = allocs
            .iter()
            .zip(plan)
            .filter(|(a, _)| gpuhash::hashable(a.size) && gpuhash::hashable(chunk))
            .collect();
        let regions: Vec<_> = pairs.iter().map(|(a, _)| (a.va, a.size)).collect();
        let sums = self
            .driver()
            .chunk_sums(&regions, chunk)?
            .ok_or(FastPathError::DeviceCheckUnavailable)?;
        for ((alloc, id), sums) in pairs.into_iter().zip(sums) {
            let chunks = &reader.allocations()[id.0].chunks;
            if sums.len() != chunks.len() {
                return Err(FastPathError::DeviceCheckUnavailable);
            }
            for (c, s) in chunks.iter().zip(sums) {
                let expected = match (c.at, c.gpu_hash) {
                    (Location::Zero, _) => ChunkDigest::Zero,
                    (_, Some(h)) => ChunkDigest::Hash(h),
                    // CRC-checked on the CPU on the way in.
                    (_, None) => continue,
                };
                if s.digest(c.len) != expected {
                    return Err(FastPathError::DeviceCheck {
                        va: alloc.va,
                        offset: c.offset,
                        image: reader.dir().to_path_buf(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Every chunk of `allocs` as (image allocation, chunk index), and its device address.
    fn chunk_work(
        reader: &ImageReader,
        allocs: &[Allocation],
        plan: &[AllocId],
    ) -> (Vec<(AllocId, usize)>, Vec<DevicePtr>) {
        let chunk = reader.manifest().chunk_size as usize;
        let mut work = Vec::new();
        let mut targets = Vec::new();
        for (alloc, id) in allocs.iter().zip(plan) {
            for index in 0..reader.allocations()[id.0].chunks.len() {
                work.push((*id, index));
                targets.push(alloc.va + (index * chunk) as u64);
            }
        }
        (work, targets)
    }

    /// The direct copy-in (`direct`, image on tmpfs, raw chunks): the image's data files
    /// mapped read-only, verifier threads check each chunk's CRC where it lies while the
    /// control thread DMAs the verified chunks straight from the mapping (registered
    /// read-only in windows, in file order) on the copy streams; zero chunks come from
    /// one zeroed pinned buffer. `None` when not used or a registration failed (then
    /// nothing is registered or in flight, and the staged path runs). Returns the bytes
    /// copied, the bytes of host buffers used and where the control thread waited.
    fn fill_direct(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        plan: &[AllocId],
    ) -> Result<Option<(u64, u64, CopyProfile)>, FastPathError> {
        if !self.opts.direct {
            return Ok(None);
        }
        if !self.opts.pin {
            tracing::info!("direct copy-in not used: pinning is off");
            return Ok(None);
        }
        if let Some(why) = reader.direct_refusal() {
            tracing::info!(reason = %why, "direct copy-in not used");
            return Ok(None);
        }
        let (work, targets) = Self::chunk_work(reader, allocs, plan);
        let bytes = allocs.iter().map(|a| a.size).sum();
        if work.is_empty() {
            return Ok(Some((bytes, 0, CopyProfile::default())));
        }
        let mapped = reader.map_chunks(&work)?;
        // Zero chunks first, then file by file in offset order, so windows only move on.
        let mut order: Vec<usize> = (0..work.len()).collect();
        order.sort_by_key(|&i| mapped.chunk(i).at.map_or((0, 0), |(m, o)| (m + 1, o)));
        let chunk = reader.manifest().chunk_size as usize;
        let zeros = mapped.chunk(order[0]).at.is_none();
        let zero_pool = if zeros {
            Some(StagingPool::new(1, chunk, self.pin())?)
        } else {
            None
        };
        // Never written: the pool is zeroed.
        let mut zero_buf = zero_pool.as_ref().map(|p| p.acquire());
        let zero_ptr = zero_buf
            .as_mut()
            .map_or(std::ptr::null(), |b| b.as_mut_ptr().cast_const());

        // Verdicts by position in `order`, filled by the verifiers ahead of the copies.
        let verdicts: Mutex<Vec<Option<Result<(), ImageError>>>> =
            Mutex::new((0..order.len()).map(|_| None).collect());
        let ready = std::sync::Condvar::new();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let copied = std::thread::scope(|scope| {
            for _ in 0..self.opts.read_threads.clamp(1, order.len()) {
                scope.spawn(|| loop {
                    let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if k >= order.len() || stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    let verdict = mapped.verify(order[k]);
                    verdicts.lock().unwrap_or_else(|p| p.into_inner())[k] = Some(verdict);
                    ready.notify_all();
                });
            }
            let result = self.copy_mapped(scope, &mapped, &order, &targets, zero_ptr, |k| {
                let mut v = verdicts.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(verdict) = v[k].take() {
                        return verdict;
                    }
                    v = ready.wait(v).unwrap_or_else(|p| p.into_inner());
                }
            });
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            result
        });
        let profile = match copied {
            Ok(Some(profile)) => profile,
            Ok(None) => return Ok(None),
            Err(DirectInError::Driver(e)) => return Err(e.into()),
            Err(DirectInError::Corrupt(e)) => return Err(e.into()),
        };
        self.driver().synchronize()?;
        drop(zero_buf);
        tracing::debug!(chunks = order.len(), "direct copy-in");
        Ok(Some((bytes, if zeros { chunk as u64 } else { 0 }, profile)))
    }

    /// The control thread's part of [`fill_direct`](Self::fill_direct): for each chunk
    /// in `order`, waits for its verdict (`verified(k)`), moves the registered window
    /// along and issues its copy. `Ok(None)`: a registration failed, nothing is left
    /// registered or in flight; else where it waited.
    fn copy_mapped<'s, 'd>(
        &'d self,
        scope: &'s std::thread::Scope<'s, 'd>,
        mapped: &MappedImage,
        order: &[usize],
        targets: &[DevicePtr],
        zero: *const u8,
        verified: impl Fn(usize) -> Result<(), ImageError>,
    ) -> Result<Option<CopyProfile>, DirectInError> {
        // Where each chunk lies (`None`: zero, or a file not mapped, which `verify`
        // refuses before any copy).
        let source = |i: usize| {
            let c = mapped.chunk(i);
            let (map, offset) = c.at?;
            let region = mapped.region(map)?;
            Some((region.base as usize + offset as usize, c.len, map))
        };
        let (list, of) = plan_windows(order.iter().map(|&i| source(i)), self.opts.direct_window);
        // Declared before `flight`: unregistered only after every copy is waited for.
        let mut windows = Windows::start(scope, self.driver(), list, true);
        let mut flight: InFlight<D, ()> = InFlight::new(self.driver(), self.opts.streams);
        let mut profile = CopyProfile::default();
        for (k, &i) in order.iter().enumerate() {
            let t = Instant::now();
            let verdict = verified(k);
            profile.verify_wait += t.elapsed().as_secs_f64();
            verdict.map_err(DirectInError::Corrupt)?;
            let c = mapped.chunk(i);
            let (mut target, mut len) = (targets[i], c.len);
            let src = match (c.at, source(i), of[k]) {
                (None, _, _) => zero,
                (Some(_), Some((addr, _, _)), Some((w, head))) => {
                    if windows.current() != Some(w) {
                        while flight.complete_oldest()?.is_some() {}
                        if let Err(e) = windows.enter(w) {
                            tracing::warn!(error = %e, "cannot register the mapped image; copy-in goes through staging");
                            return Ok(None);
                        }
                    }
                    if head > 0 {
                        // Less than a page, in the previous window's last page: a plain
                        // synchronous copy.
                        // SAFETY: inside the mapping, which nobody writes.
                        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, head) };
                        self.driver().copy_from_host(target, bytes)?;
                        target += head as u64;
                        len -= head;
                    }
                    (addr + head) as *const u8
                }
                _ => {
                    return Err(DirectInError::Corrupt(ImageError::Worker(format!(
                        "chunk {i} lies in no mapped file"
                    ))))
                }
            };
            if len == 0 {
                continue;
            }
            flight.start((), |_, stream| {
                // SAFETY: the mapping (or zero buffer) outlives `flight`, and nobody
                // writes it.
                unsafe { self.driver().copy_from_host_async(target, src, len, stream) }
            })?;
        }
        while flight.complete_oldest()?.is_some() {}
        profile.dma_wait = flight.waited.as_secs_f64();
        profile.register_wait = windows.waited.as_secs_f64();
        Ok(Some(profile))
    }

    /// Copies each allocation's image data in: reader threads fill a pinned staging
    /// pool (read, decompress, CRC) while filled buffers go to the device on up to
    /// `streams` copy streams. Returns the bytes copied, the pool's size and where the
    /// copying thread waited (`buffer_wait`: for the readers); `setup` is the time from
    /// `start` to the first read.
    fn fill(
        &self,
        reader: &ImageReader,
        all_work: &[(AllocId, usize)],
        all_targets: &[DevicePtr],
        items: &[usize],
        start: Instant,
    ) -> Result<(u64, CopyProfile), FastPathError> {
        let chunk = reader.manifest().chunk_size as usize;
        let work: Vec<_> = items.iter().map(|&i| all_work[i]).collect();
        let targets: Vec<_> = items.iter().map(|&i| all_targets[i]).collect();
        if work.is_empty() {
            return Ok((0, CopyProfile::default()));
        }
        let count = (self.opts.copy_in_staging / chunk).max(2);
        let pool = StagingPool::new(count, chunk, self.pin())?;
        // The sink keeps at most `count - 1` buffers, so the readers always have one.
        let mut flight = InFlight::new(self.driver(), self.opts.streams.min(count - 1));
        let t = Instant::now();
        let setup = start.elapsed().as_secs_f64();
        let read = reader.read_chunks_staged(
            &work,
            &pool,
            self.opts.read_threads,
            |i, buf, len| -> Result<(), FastPathError> {
                flight.start(buf, |buf, stream| {
                    // SAFETY: the buffer stays in `flight`, unchanged, until its stream
                    // is waited for.
                    unsafe {
                        self.driver()
                            .copy_from_host_async(targets[i], buf.as_ptr(), len, stream)
                    }
                })?;
                Ok(())
            },
        );
        let reading = t.elapsed().as_secs_f64();
        let dma_while_reading = flight.waited.as_secs_f64();
        let mut drained = Ok(());
        while drained.is_ok() {
            match flight.complete_oldest() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => drained = Err(e),
            }
        }
        let profile = CopyProfile {
            dma_wait: flight.waited.as_secs_f64(),
            buffer_wait: (reading - dma_while_reading).max(0.0),
            setup,
            ..CopyProfile::default()
        };
        drop(flight);
        read?;
        drained?;
        self.driver().synchronize()?;
        tracing::debug!(
            pinned = pool.is_pinned(),
            buffers = count,
            "copy-in staging"
        );
        Ok(((count * chunk) as u64, profile))
    }

    /// The image allocation of each of `allocs`, checked before anything is copied;
    /// with `exact`, the image must not hold allocations this process does not track.
    fn match_image(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        exact: bool,
    ) -> Result<Vec<AllocId>, FastPathError> {
        if let Some(alloc) = allocs.iter().find(|a| a.state != AllocState::Mapped) {
            return Err(FastPathError::NotMapped {
                va: alloc.va,
                state: alloc.state,
            });
        }
        self.plan_in_image(reader, allocs, exact)
    }

    /// The image allocation of each of `allocs` (by address, this process's, of the
    /// same size), whatever their state; with `exact`, as in [`Self::match_image`].
    fn plan_in_image(
        &self,
        reader: &ImageReader,
        allocs: &[Allocation],
        exact: bool,
    ) -> Result<Vec<AllocId>, FastPathError> {
        let mut plan = Vec::with_capacity(allocs.len());
        for alloc in allocs {
            let id = reader
                .find(alloc.va, self.opts.pid)
                .ok_or(FastPathError::NotInImage { va: alloc.va })?;
            let image = reader.allocations()[id.0].size;
            if image != alloc.size {
                return Err(FastPathError::SizeMismatch {
                    va: alloc.va,
                    tracked: alloc.size,
                    image,
                });
            }
            plan.push(id);
        }
        let extra = reader
            .allocations()
            .iter()
            .find(|a| a.tags.pid == self.opts.pid && !allocs.iter().any(|t| t.va == a.va));
        if let (true, Some(extra)) = (exact, extra) {
            return Err(FastPathError::NotTracked { va: extra.va });
        }
        Ok(plan)
    }

    /// Lets GPU work go on; refused while any allocation has no physical memory.
    pub fn thaw(&self) -> Result<(), FastPathError> {
        self.let_helpers_go();
        let count = self
            .allocator
            .table()
            .iter()
            .filter(|a| a.state == AllocState::Released)
            .count();
        if count > 0 {
            return Err(FastPathError::ReleasedMemory { count });
        }
        Ok(self.gate.thaw()?)
    }
}

/// The helpers a copy-in handed chunks to.
#[derive(Default)]
struct Shared {
    /// Per work item: a helper has it.
    taken: Vec<bool>,
    /// Each helper, its work items and their bytes.
    running: Vec<(Helper, Vec<usize>, u64)>,
}

impl Shared {
    /// Waits for every helper's reply: their reports, the work items of those that
    /// failed (to be staged), and the helpers' reapers.
    fn wait(
        self,
    ) -> (
        Vec<HelperReport>,
        Vec<usize>,
        Vec<std::thread::JoinHandle<()>>,
    ) {
        let mut reports = Vec::new();
        let mut failed = Vec::new();
        let mut reapers = Vec::new();
        for (mut helper, items, bytes) in self.running {
            let mut report = HelperReport {
                pid: helper.pid(),
                bytes,
                init_s: helper.init_s.unwrap_or_default(),
                ..HelperReport::default()
            };
            match helper.wait_done() {
                Ok(HelperMsg::Done {
                    seconds,
                    setup_s,
                    register_s,
                    ahead_s,
                    pin_wait_s,
                    ..
                }) => {
                    report.seconds = seconds;
                    report.setup_s = setup_s;
                    report.register_s = register_s;
                    report.ahead_s = ahead_s;
                    report.pin_wait_s = pin_wait_s;
                    reapers.push(helper.finish());
                }
                Ok(other) => unreachable!("wait_done returns Done only: {other:?}"),
                Err(e) => {
                    tracing::warn!(pid = report.pid, error = %e, "copy-in helper failed");
                    report.error = Some(e);
                    // Stopped before its chunks are staged again: it must not write
                    // into this memory any more.
                    drop(helper);
                    failed.extend(items);
                }
            }
            reports.push(report);
        }
        failed.sort_unstable();
        (reports, failed, reapers)
    }
}

/// Whether `n` more fds fit under this process's limit.
fn fd_room(n: usize) -> bool {
    crate::control::FdRoom::now().is_ok_and(|r| r.fits(n))
}

/// Locks, also after a panic elsewhere (the data stays usable).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<D: VmmDriver + 'static> Engine for FastPath<D> {
    type Error = FastPathError;

    fn freeze(&self) -> Result<(), FastPathError> {
        FastPath::freeze(self)
    }
    fn copy_out(&self, dir: &Path, parent: Option<&Path>) -> Result<CopyOutReport, FastPathError> {
        let result = FastPath::copy_out(self, dir, parent);
        self.driver().end_copies();
        result
    }
    fn release(&self, keep: bool) -> Result<(MemoryReport, Vec<OwnedFd>), FastPathError> {
        // A failed release refills memory from the image.
        let result = FastPath::release(self, keep);
        self.driver().end_copies();
        result
    }
    fn remap(&self) -> Result<MemoryReport, FastPathError> {
        FastPath::remap(self)
    }
    fn reattach(
        &self,
        held: &[DevicePtr],
        fds: Vec<OwnedFd>,
    ) -> Result<MemoryReport, FastPathError> {
        FastPath::reattach(self, held, fds)
    }
    fn copy_in(&self, dir: &Path) -> Result<CopyInReport, FastPathError> {
        let result = FastPath::copy_in(self, dir);
        self.driver().end_copies();
        result
    }
    // A prepared CopyOut is for the CopyOut that follows the Freeze; anything else
    // drops it (its mapping of a host file must not reach CRIU's dump).
    fn thaw(&self) -> Result<(), FastPathError> {
        self.drop_prepared();
        FastPath::thaw(self)
    }
    fn snapshot(&self) -> Result<(SnapshotReport, Vec<OwnedFd>), FastPathError> {
        self.drop_prepared();
        FastPath::snapshot(self)
    }
    fn write_snapshot(
        &self,
        dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, FastPathError> {
        let result = FastPath::write_snapshot(self, dir, parent);
        self.driver().end_copies();
        result
    }
    fn drop_snapshot(&self) -> Result<(), FastPathError> {
        FastPath::drop_snapshot(self);
        Ok(())
    }
    fn prepare(&self, dir: &Path, parent: Option<&Path>) -> Result<PrepareReport, FastPathError> {
        FastPath::prepare(self, dir, parent)
    }
    fn prepared(&self) -> bool {
        self.is_prepared()
    }
    fn warm(&self, image_dir: Option<&Path>) -> Result<WarmReport, FastPathError> {
        FastPath::warm(self, image_dir)
    }
    fn adopt_helpers(
        &self,
        jobs: Vec<AheadJob>,
        socks: Vec<OwnedFd>,
    ) -> Result<WarmReport, FastPathError> {
        FastPath::adopt_helpers(self, jobs, socks)
    }

    fn drop_prepared(&self) {
        FastPath::drop_prepared(self)
    }
    fn status(&self, state: CheckpointState) -> HookStatus {
        let table = self.allocator.table();
        HookStatus {
            pid: std::process::id(),
            state,
            gate: self.gate.state(),
            allocations: table.len(),
            bytes: table.total_bytes(),
            released: table
                .iter()
                .filter(|a| a.state == AllocState::Released)
                .count(),
            snapshot_bytes: self
                .snapshot
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map_or(0, Snapshot::size),
            unsupported: table.unsupported().to_vec(),
        }
    }
}

/// Makes room for `n` more open fds in this process (the exported memory's, until sent
/// to the shim): raises the soft `RLIMIT_NOFILE` towards the hard one when needed.
fn make_fd_room(n: usize) -> Result<(), String> {
    use crate::control::FdRoom;
    let room = FdRoom::now().map_err(|e| format!("cannot read the fd limit: {e}"))?;
    let need = room.open + n as u64 + FdRoom::SPARE;
    if need <= room.soft {
        return Ok(());
    }
    if need > room.hard {
        return Err(format!(
            "{n} allocations need {need} open fds, above the fd limit ({}); raise the \
             container's RLIMIT_NOFILE",
            room.hard
        ));
    }
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, need, room.hard)
        .map_err(|e| format!("setrlimit: {e}"))
}

#[cfg(test)]
#[path = "fastpath_tests.rs"]
mod tests;
