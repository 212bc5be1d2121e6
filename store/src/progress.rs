//! Progress of long transfers (a pull from or push to the shared store, an ingest, an export),
//! reported through [`Progress`]: the shim logs it ([`LogProgress`]), the `gpucr` CLI draws a
//! bar on a terminal, and callers that want neither pass [`NoProgress`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Told how much a transfer moves, then how it goes. Called from several threads at once.
pub trait Progress: Send + Sync {
    /// The transfer will move `total` bytes; called once, before any [`Progress::advance`].
    fn start(&self, total: u64);
    /// `bytes` more have been moved.
    fn advance(&self, bytes: u64);
    /// The transfer ended, successfully or not.
    fn finish(&self) {}
}

/// Reports nothing.
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _total: u64) {}
    fn advance(&self, _bytes: u64) {}
}

/// Logs a line (tracing, at info) every [`LogProgress::EVERY`] or each tenth of the total,
/// whichever comes first, with the container it is for: bytes done and total, the rate.
pub struct LogProgress {
    id: String,
    what: String,
    total: AtomicU64,
    done: AtomicU64,
    started: Instant,
    /// When the last line was logged and the tenth it reported.
    last: Mutex<(Instant, u64)>,
}

impl LogProgress {
    pub const EVERY: Duration = Duration::from_secs(2);

    /// `id`: the container; `what`: the transfer, e.g. "pulling from the shared store X".
    pub fn new(id: impl Into<String>, what: impl Into<String>) -> Self {
        let now = Instant::now();
        LogProgress {
            id: id.into(),
            what: what.into(),
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
            started: now,
            last: Mutex::new((now, 0)),
        }
    }

    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    fn log(&self, done: u64, total: u64) {
        let secs = self.started.elapsed().as_secs_f64();
        let mib_s = if secs > 0.0 {
            done as f64 / secs / (1 << 20) as f64
        } else {
            0.0
        };
        let percent = (done * 100).checked_div(total).unwrap_or(100);
        tracing::info!(id = %self.id, done, total, percent, mib_s = format!("{mib_s:.1}"),
            "{}", self.what);
    }
}

impl Progress for LogProgress {
    fn start(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        self.log(0, total);
    }

    fn advance(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let total = self.total.load(Ordering::Relaxed);
        let tenth = (done * 10).checked_div(total).unwrap_or(10);
        let mut last = self.last.lock().expect("progress lock");
        // The last bytes are logged by `finish`.
        if done < total && (tenth > last.1 || last.0.elapsed() >= Self::EVERY) {
            *last = (Instant::now(), tenth);
            drop(last);
            self.log(done, total);
        }
    }

    fn finish(&self) {
        self.log(self.done(), self.total.load(Ordering::Relaxed));
    }
}

/// Records what it was told, for tests.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct Counting {
    pub total: AtomicU64,
    pub done: AtomicU64,
    pub finished: std::sync::atomic::AtomicBool,
}

#[cfg(test)]
impl Progress for Counting {
    fn start(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
    }
    fn advance(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }
    fn finish(&self) {
        self.finished.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_progress_counts_from_many_threads() {
        let p = LogProgress::new("c1", "pulling");
        p.start(1000);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..25 {
                        p.advance(10)
                    }
                });
            }
        });
        p.finish();
        assert_eq!(p.done(), 1000);
        // Every tenth was crossed, so the last one logged is the ninth (the tenth is finish's).
        assert_eq!(p.last.lock().unwrap().1, 9);
    }
}
