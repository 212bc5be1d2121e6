//! The driver's checkpoint API called from a child process, never from CRIU itself.
//!
//! Loading libcuda (and NVML) into CRIU can start threads there, and a multi-threaded CRIU
//! cannot `setns` into the dumped container's mount namespace (the dump fails with
//! `Can't setns 20/mnt: Invalid argument` once the driver was called in-process).
//! So each call forks CRIU (single-threaded, so fork is safe), the child loads libcuda, makes
//! the one call and writes the outcome to a pipe; the parent keeps only the answer. CRIU stays
//! the tracer of the dumped tasks: the ptrace dance around the restore thread stays in the
//! parent. SIGCHLD is blocked around the child's life and its signal consumed, so CRIU's own
//! SIGCHLD handler (restore) never sees a child it did not start.

use std::io::{Read as _, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use gpu_state::driver::CuError;
use gpu_state::{CheckpointApi, CudaDriver, DriverError, GpuPair, ProcessState, Step};
use serde::{Deserialize, Serialize};

/// The answer of one call, as it crosses the pipe.
#[derive(Debug, Serialize, Deserialize)]
enum Wire {
    Probe { path: String, version: i32 },
    NoDriverHere,
    Done,
    State(ProcessState),
    Tid(u32),
    Cuda { step: Step, pid: u32, code: i32 },
    PairsUnsupported(i32),
    UnknownState { pid: u32, raw: i32 },
    NoDriver(String),
    Other { path: String, reason: String },
    NoAnswer(String),
}

impl Wire {
    fn from_error(e: DriverError) -> Wire {
        match e {
            DriverError::Cuda { step, pid, code } => Wire::Cuda {
                step,
                pid,
                code: code.0,
            },
            DriverError::GpuPairsUnsupported { driver_version } => {
                Wire::PairsUnsupported(driver_version)
            }
            DriverError::UnknownState { pid, raw } => Wire::UnknownState { pid, raw },
            DriverError::NoDriver { reason } => Wire::NoDriver(reason),
            DriverError::Load { path, reason } => Wire::Other { path, reason },
            DriverError::NoAnswer { reason } => Wire::NoAnswer(reason),
            e @ DriverError::MissingSymbol { .. } => Wire::Other {
                path: "libcuda".into(),
                reason: e.to_string(),
            },
        }
    }

    fn into_error(self) -> DriverError {
        match self {
            Wire::Cuda { step, pid, code } => DriverError::Cuda {
                step,
                pid,
                code: CuError(code),
            },
            Wire::PairsUnsupported(v) => DriverError::GpuPairsUnsupported { driver_version: v },
            Wire::UnknownState { pid, raw } => DriverError::UnknownState { pid, raw },
            Wire::NoDriver(reason) => DriverError::NoDriver { reason },
            Wire::Other { path, reason } => DriverError::Load { path, reason },
            Wire::NoAnswer(reason) => DriverError::NoAnswer { reason },
            other => unexpected(&format!("unexpected answer {other:?}")),
        }
    }
}

/// What a child call did, or why no answer came.
fn unexpected(what: &str) -> DriverError {
    DriverError::NoAnswer {
        reason: format!("the child process making the call: {what}"),
    }
}

/// Environment variable: the most seconds one driver call may take before its child is
/// killed (default [`DEFAULT_CALL_TIMEOUT`]: room for a checkpoint of a large GPU's memory
/// at the driver's speed, docs/BENCHMARKS.md).
pub const CALL_TIMEOUT_ENV: &str = "GPUCR_PLUGIN_CALL_TIMEOUT_S";
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);
/// Probing loads libcuda and asks its version: seconds, never minutes.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);
/// What a lock may take beyond the timeout the driver itself was given.
const LOCK_GRACE: Duration = Duration::from_secs(15);

fn call_timeout() -> Duration {
    std::env::var(CALL_TIMEOUT_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&s| s > 0)
        .map_or(DEFAULT_CALL_TIMEOUT, Duration::from_secs)
}

/// The checkpoint API through short-lived children (see the module docs).
#[derive(Debug, Clone)]
pub struct IsolatedDriver {
    path: String,
    version: i32,
    /// Deadline of each call but the lock (which has the driver's own timeout).
    timeout: Duration,
}

impl IsolatedDriver {
    /// Like [`CudaDriver::probe`], in a child: `Ok(None)` on a machine without the driver.
    pub fn probe() -> Result<Option<IsolatedDriver>, DriverError> {
        match in_child(PROBE_TIMEOUT, || match CudaDriver::probe() {
            Ok(Some(d)) => Wire::Probe {
                path: d.path().to_string(),
                version: d.driver_version().unwrap_or(0),
            },
            Ok(None) => Wire::NoDriverHere,
            Err(e) => Wire::from_error(e),
        })? {
            Wire::Probe { path, version } => Ok(Some(IsolatedDriver {
                path,
                version,
                timeout: call_timeout(),
            })),
            Wire::NoDriverHere => Ok(None),
            other => Err(other.into_error()),
        }
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    fn call(
        &self,
        f: impl FnOnce(&CudaDriver) -> Result<Wire, DriverError>,
    ) -> Result<Wire, DriverError> {
        self.call_within(self.timeout, f)
    }

    fn call_within(
        &self,
        deadline: Duration,
        f: impl FnOnce(&CudaDriver) -> Result<Wire, DriverError>,
    ) -> Result<Wire, DriverError> {
        let wire = in_child(deadline, || match CudaDriver::load() {
            Ok(d) => f(&d).unwrap_or_else(Wire::from_error),
            Err(e) => Wire::from_error(e),
        })?;
        match wire {
            w @ (Wire::Done | Wire::State(_) | Wire::Tid(_)) => Ok(w),
            other => Err(other.into_error()),
        }
    }
}

impl CheckpointApi for IsolatedDriver {
    fn driver_version(&self) -> Result<i32, DriverError> {
        Ok(self.version)
    }

    fn get_state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        match self.call(|d| d.get_state(pid).map(Wire::State))? {
            Wire::State(s) => Ok(s),
            w => Err(w.into_error()),
        }
    }

    fn get_restore_thread_id(&self, pid: u32) -> Result<u32, DriverError> {
        match self.call(|d| d.get_restore_thread_id(pid).map(Wire::Tid))? {
            Wire::Tid(t) => Ok(t),
            w => Err(w.into_error()),
        }
    }

    fn lock(&self, pid: u32, timeout: Option<Duration>) -> Result<(), DriverError> {
        let deadline = timeout.map_or(self.timeout, |t| t + LOCK_GRACE);
        self.call_within(deadline, |d| d.lock(pid, timeout).map(|()| Wire::Done))
            .map(drop)
    }

    fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        self.call(|d| d.checkpoint(pid).map(|()| Wire::Done))
            .map(drop)
    }

    fn restore(&self, pid: u32, gpu_pairs: &[GpuPair]) -> Result<(), DriverError> {
        self.call(|d| d.restore(pid, gpu_pairs).map(|()| Wire::Done))
            .map(drop)
    }

    fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        self.call(|d| d.unlock(pid).map(|()| Wire::Done)).map(drop)
    }
}

/// What reading the child's pipe came to.
enum Read {
    Done(Vec<u8>),
    TimedOut,
    Failed(std::io::Error),
}

/// Reads `rd` to its end, giving up at `deadline` from now. CRIU's SIGALRM (its own
/// `--timeout`) interrupts poll; that only shortens nothing here, the loop goes on.
fn read_until(rd: OwnedFd, deadline: Duration) -> Read {
    let end = Instant::now() + deadline;
    let mut file = std::fs::File::from(rd);
    let mut text = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Read::TimedOut;
        }
        let mut pfd = libc::pollfd {
            fd: file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Read::Failed(e);
        }
        if n == 0 {
            continue;
        }
        match file.read(&mut buf) {
            Ok(0) => return Read::Done(text),
            Ok(k) => text.extend_from_slice(&buf[..k]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Read::Failed(e),
        }
    }
}

/// Runs `f` in a forked child and returns what it wrote; a child that has not answered
/// within `deadline` is killed and the call is an error (a driver call that never returns
/// must not hang CRIU, and with it the checkpointed container, forever).
fn in_child(deadline: Duration, f: impl FnOnce() -> Wire) -> Result<Wire, DriverError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fds.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(unexpected(&format!(
            "pipe: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: fresh fds owned from here on.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let mut chld = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    let mut old = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: plain signal-mask calls on local sets.
    unsafe {
        libc::sigemptyset(chld.as_mut_ptr());
        libc::sigaddset(chld.as_mut_ptr(), libc::SIGCHLD);
        libc::sigprocmask(libc::SIG_BLOCK, chld.as_ptr(), old.as_mut_ptr());
    }
    // SAFETY: CRIU is single-threaded (that is the point of this module), so the child may
    // run ordinary code; it leaves through _exit without running CRIU's atexit handlers.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        drop(rd);
        let wire = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .unwrap_or_else(|_| Wire::NoDriver("the driver call panicked".into()));
        let mut w = std::fs::File::from(wr);
        let ok = serde_json::to_writer(&mut w, &wire).is_ok() && w.flush().is_ok();
        // SAFETY: leave without unwinding into CRIU's code.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    drop(wr);
    let result = if pid < 0 {
        Err(unexpected(&format!(
            "fork: {}",
            std::io::Error::last_os_error()
        )))
    } else {
        let read = read_until(rd, deadline);
        if matches!(read, Read::TimedOut) {
            // SAFETY: our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let mut status = 0;
        // SAFETY: reaping our own child.
        while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
            && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {}
        match read {
            Read::Failed(e) => Err(unexpected(&format!("reading the child's answer: {e}"))),
            Read::TimedOut => Err(unexpected(&format!(
                "the driver call did not return within {} s; its process was killed (raise \
                 {CALL_TIMEOUT_ENV} if the GPU holds much memory)",
                deadline.as_secs()
            ))),
            Read::Done(text) if text.is_empty() => Err(unexpected(&format!(
                "the child calling the driver died without an answer (wait status {status:#x})"
            ))),
            Read::Done(text) => serde_json::from_slice(&text)
                .map_err(|e| unexpected(&format!("the child's answer is garbled: {e}"))),
        }
    };
    // SAFETY: consume our child's SIGCHLD (if pending) and put the mask back.
    unsafe {
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut pending = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigpending(pending.as_mut_ptr());
        if libc::sigismember(pending.as_ptr(), libc::SIGCHLD) == 1 {
            libc::sigtimedwait(chld.as_ptr(), std::ptr::null_mut(), &zero);
        }
        libc::sigprocmask(libc::SIG_SETMASK, old.as_ptr(), std::ptr::null_mut());
    }
    result
}

/// How many threads this process has (CRIU must stay at 1).
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_secs(10);

    #[test]
    fn child_answers_cross_the_pipe() {
        let w = in_child(SHORT, || Wire::Tid(42)).unwrap();
        assert!(matches!(w, Wire::Tid(42)));
        let e = in_child(SHORT, || Wire::Cuda {
            step: Step::Lock,
            pid: 7,
            code: 2,
        })
        .unwrap()
        .into_error();
        assert_eq!(e.cuda_code(), Some(CuError(2)));
    }

    #[test]
    fn a_dying_child_is_an_error_not_a_hang() {
        let e = in_child(SHORT, || unsafe { libc::_exit(3) }).unwrap_err();
        assert!(e.to_string().contains("died without an answer"), "{e}");
    }

    #[test]
    fn a_child_that_never_answers_is_killed_at_the_deadline() {
        let t0 = Instant::now();
        let e = in_child(Duration::from_millis(300), || loop {
            std::thread::sleep(Duration::from_secs(1));
        })
        .unwrap_err();
        assert!(e.to_string().contains("did not return within"), "{e}");
        assert!(e.to_string().contains(CALL_TIMEOUT_ENV), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn without_a_driver_probe_says_none() {
        std::env::set_var("GPUCR_LIBCUDA", "/nonexistent/libcuda.so.1");
        assert!(IsolatedDriver::probe().unwrap().is_none());
    }
}
