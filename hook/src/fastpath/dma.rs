//! DMA plumbing the copies share: pinning staging pools, copies in flight, direct-I/O windows and
//! fd room.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_state::image::StagingPin;

use thiserror::Error;

use crate::driver::{VmmDriver, VmmError};

/// Pins staging pools through the driver (`cuMemHostRegister`), once per pool.
pub(super) struct DriverPin<D>(pub(super) Arc<D>);

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
pub(super) struct InFlight<'d, D: VmmDriver, T> {
    pub(super) driver: &'d D,
    pub(super) depth: usize,
    pub(super) issued: usize,
    pub(super) queue: VecDeque<(usize, T)>,
    /// Time spent waiting for copies to complete.
    pub(super) waited: Duration,
}

impl<'d, D: VmmDriver, T> InFlight<'d, D, T> {
    pub(super) fn new(driver: &'d D, depth: usize) -> Self {
        InFlight {
            driver,
            depth: depth.max(1),
            issued: 0,
            queue: VecDeque::new(),
            waited: Duration::ZERO,
        }
    }

    pub(super) fn is_full(&self) -> bool {
        self.queue.len() >= self.depth
    }

    /// Issues a copy with `issue(stream)` and keeps `item` (its buffer) until it is
    /// waited for; completes the oldest copy first when all streams are busy.
    pub(super) fn start(
        &mut self,
        item: T,
        issue: impl FnOnce(&mut T, usize) -> Result<(), VmmError>,
    ) -> Result<Option<T>, VmmError> {
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
    pub(super) fn complete_oldest(&mut self) -> Result<Option<T>, VmmError> {
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

pub(super) const PAGE: usize = 4096;

/// Windows registered ahead of the one in use: registering pins (and on fresh tmpfs
/// pages faults in and zeroes) every page, so the next window is registered on a helper
/// thread while the copies run in the current one.
pub(super) const WINDOWS_AHEAD: usize = 1;

/// A span's window and the bytes at its start (`head`) that lie before it.
pub(super) type SpanWindow = (usize, usize);

/// Page-disjoint windows of about `size` bytes over `spans` (address, length, group:
/// one mapping), taken in order (`None`: a span that needs no window); returns the
/// windows `[start, end)` and for each span its window and `head`: bytes at its start
/// that lie in the page of the previous window (two registrations may not share a
/// page), to be copied apart. Spans whose start shares a page are unaligned chunks of a
/// staged image; a span within one shared page joins the previous window.
pub(super) fn plan_windows(
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
pub(super) struct Windows<'d, D: VmmDriver> {
    pub(super) driver: &'d D,
    pub(super) windows: Vec<(usize, usize)>,
    pub(super) requests: Option<mpsc::Sender<usize>>,
    pub(super) results: mpsc::Receiver<(usize, Result<(), VmmError>)>,
    pub(super) requested: usize,
    /// Registered and not unregistered yet.
    pub(super) live: Vec<usize>,
    pub(super) current: Option<usize>,
    /// Windows registered so far.
    pub(super) registered: usize,
    /// Time spent in [`enter`](Self::enter).
    pub(super) waited: Duration,
}

impl<'d, D: VmmDriver> Windows<'d, D> {
    pub(super) fn start<'s>(
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

    pub(super) fn current(&self) -> Option<usize> {
        self.current
    }

    pub(super) fn enter(&mut self, k: usize) -> Result<(), VmmError> {
        let t = Instant::now();
        let entered = self.enter_inner(k);
        self.waited += t.elapsed();
        entered
    }

    pub(super) fn enter_inner(&mut self, k: usize) -> Result<(), VmmError> {
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
            let gone = VmmError {
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

    pub(super) fn unregister(&mut self, k: usize) {
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

/// Whether `n` more fds fit under this process's limit.
pub(super) fn fd_room(n: usize) -> bool {
    crate::control::wire::FdRoom::now().is_ok_and(|r| r.fits(n))
}

/// Makes room for `n` more open fds in this process (the exported memory's, until sent
/// to the shim): raises the soft `RLIMIT_NOFILE` towards the hard one when needed.
pub(super) fn make_fd_room(n: usize) -> Result<(), FdRoomError> {
    use crate::control::wire::FdRoom;
    let room = FdRoom::now().map_err(FdRoomError::Read)?;
    let need = room.open + n as u64 + FdRoom::SPARE;
    if need <= room.soft {
        return Ok(());
    }
    if need > room.hard {
        return Err(FdRoomError::AboveLimit {
            n,
            need,
            hard: room.hard,
        });
    }
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, need, room.hard)
        .map_err(FdRoomError::Raise)
}

/// Why [`make_fd_room`] found no room.
#[derive(Debug, Error)]
pub enum FdRoomError {
    #[error("cannot read the fd limit")]
    Read(#[source] std::io::Error),
    #[error(
        "{n} allocations need {need} open fds, above the fd limit ({hard}); raise the \
         container's RLIMIT_NOFILE"
    )]
    AboveLimit { n: usize, need: u64, hard: u64 },
    #[error("setrlimit")]
    Raise(#[source] nix::Error),
}
