//! A CopyOut readied while the workload runs (the `Prepare` verb): the image's writer
//! with its direct data file allocated on tmpfs and registered for DMA, window by window.
//! Allocating the file's pages (the kernel zeroes each) and registering them (pinning)
//! cost about as much as the copy itself; done before the freeze, the frozen CopyOut only
//! moves bytes, device to file, at the link's speed.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use gpu_state::image::{AllocId, DirectRegion, ImageWriter};

use crate::driver::{DevicePtr, VmmDriver, VmmError};

/// Most threads registering windows at once.
const REGISTER_THREADS: usize = 8;

const PAGE: usize = 4096;

/// Which image a CopyOut writes: its directory (device and inode, the same through
/// another fd of it), its name there and its parent image's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    dir: (u64, u64),
    name: OsString,
    parent: Option<(u64, u64)>,
}

impl Target {
    pub(crate) fn of(image_dir: &Path, parent: Option<&Path>) -> std::io::Result<Target> {
        let id = |p: &Path| std::fs::metadata(p).map(|m| (m.dev(), m.ino()));
        let name = image_dir
            .file_name()
            .ok_or_else(|| std::io::Error::other("an image directory without a name"))?;
        // `/proc/self/fd/<n>/name` has the parent `/proc/self/fd/<n>`: stat follows it.
        let dir = image_dir
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        Ok(Target {
            dir: id(dir)?,
            name: name.to_owned(),
            parent: parent.map(id).transpose()?,
        })
    }
}

/// A window (address, length) and how its registration went.
type Registration = ((usize, usize), Result<(), VmmError>);

/// Host memory registered for DMA, window by window; unregistered when dropped.
pub(crate) struct Registered<D: VmmDriver> {
    driver: Arc<D>,
    windows: Vec<(usize, usize)>,
}

impl<D: VmmDriver> Registered<D> {
    /// Registers `[base, base + len)` in windows of `window` bytes (page multiples), on
    /// up to [`REGISTER_THREADS`] threads. All or nothing.
    pub(crate) fn register(
        driver: &Arc<D>,
        base: *mut u8,
        len: usize,
        window: usize,
    ) -> Result<Self, VmmError> {
        let window = window.max(PAGE).next_multiple_of(PAGE);
        let spans: Vec<(usize, usize)> = (0..len.div_ceil(window))
            .map(|k| (base as usize + k * window, window.min(len - k * window)))
            .collect();
        let threads = spans.len().clamp(1, REGISTER_THREADS);
        let results: Vec<Vec<Registration>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (spans, driver) = (&spans, &**driver);
                    scope.spawn(move || {
                        spans
                            .iter()
                            .skip(t)
                            .step_by(threads)
                            .map(|&(at, n)| ((at, n), driver.register_host(at as *mut u8, n)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut done = Registered {
            driver: driver.clone(),
            windows: Vec::new(),
        };
        let mut first = None;
        for (span, result) in results.into_iter().flatten() {
            match result {
                Ok(()) => done.windows.push(span),
                Err(e) => first = first.or(Some(e)),
            }
        }
        match first {
            // `done` unregisters what was registered.
            Some(e) => Err(e),
            None if done.windows.len() == spans.len() => Ok(done),
            None => Err(VmmError {
                call: crate::driver::DriverCall::RegisterHost,
                code: crate::driver::CUDA_ERROR_INVALID_VALUE,
            }),
        }
    }

    pub(crate) fn windows(&self) -> usize {
        self.windows.len()
    }
}

impl<D: VmmDriver> Drop for Registered<D> {
    /// One window after the other: the driver's unregisters do not run in parallel
    /// (as long on many threads as on one), nor overlap the copies.
    fn drop(&mut self) {
        for &(at, _) in &self.windows {
            if let Err(e) = self.driver.unregister_host(at as *mut u8) {
                tracing::warn!(error = %e, "cannot unregister a prepared window");
            }
        }
    }
}

/// A readied CopyOut. Fields drop in order: the windows are unregistered before the
/// writer (and with it the data file's mapping) goes.
pub(crate) struct Prepared<D: VmmDriver> {
    pub(crate) registered: Registered<D>,
    pub(crate) writer: ImageWriter,
    pub(crate) target: Target,
    /// The allocations at the Prepare, in the order they were begun in the writer.
    pub(crate) layout: Vec<(DevicePtr, u64)>,
    pub(crate) ids: Vec<AllocId>,
    /// The data file's mapping (address, length), owned by the writer.
    pub(crate) region: (usize, usize),
    /// When the Prepare began.
    pub(crate) since: Instant,
}

impl<D: VmmDriver> Prepared<D> {
    /// The data file's mapping.
    pub(crate) fn region(&self) -> DirectRegion {
        DirectRegion {
            base: self.region.0 as *mut u8,
            len: self.region.1,
        }
    }
}
