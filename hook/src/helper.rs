//! Copy-in helpers: processes of their own (`gpucr-copyin`, `hook/src/bin`) that DMA part
//! of a copy-in straight from the image's pages, registered for DMA in their own context,
//! while this process stages the rest through its pinned buffers.
//!
//! Why processes: inside one process the driver does not pin host memory while copies
//! run (register + DMA take their sum, `tests/gpu/register_probe.cu`), and a staged
//! copy-in costs three passes over host memory (read the page cache, write the pinned
//! buffer, DMA reads it), which bounds it at 31–36 GB/s on the H200's host. Across
//! processes pinning and copies overlap (`tests/gpu/xproc_probe.cu`: 10 GiB staged by one
//! process and 2 × 3 GiB registered and DMA'd by two others, 44–47 GB/s), and a
//! registered chunk costs one pass.
//!
//! The helpers are spawned by Warm, before the copy-in is due (their CUDA context takes
//! a while), and wait; at the copy-in the ones that are ready get a [`Job`]: the memory
//! fds of the allocations it touches (exported, imported there and mapped), the image's
//! data files as fds, and pieces (chunk → allocation offset). A helper replies Done or
//! Failed; what a failed helper had is staged afterwards. Nothing a helper copies is
//! trusted: only chunks with a gh1 digest go to helpers, and the copy-in checks them on
//! the GPU after. Helpers never outlive the copy-in (or a Thaw): no checkpoint meets one.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use gpu_state::image::RawPlace;
use serde::{Deserialize, Serialize};

use crate::control::{recv_fd_batches, send_fd_batches};
use crate::protocol::{read_frame, write_frame, FrameError};

/// The helper's end of its socket (an fd number), in its environment.
pub const ENV_SOCKET_FD: &str = "GPUCR_COPYIN_SOCKET_FD";
/// The CUDA device ordinal the helper copies to (the hook's context's device).
pub const ENV_DEVICE: &str = "GPUCR_COPYIN_DEVICE";
/// Largest frame on a helper socket.
pub const MAX_FRAME: u32 = 64 << 20;
/// How long a copy-in waits for a helper's reply to its job.
const JOB_DEADLINE: Duration = Duration::from_secs(120);

/// One helper's share of a copy-in. The job frame is followed by `allocs.len()` memory
/// fds, then `files` data file fds (fd batches, [`send_fd_batches`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Job {
    /// The mapped size of each allocation whose memory fd follows.
    pub allocs: Vec<u64>,
    /// How many data file fds follow the memory fds.
    pub files: usize,
    /// What to copy, in file order.
    pub pieces: Vec<Piece>,
}

/// `len` bytes at `file_offset` of data file `file` into allocation `alloc` at
/// `alloc_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Piece {
    pub alloc: usize,
    pub alloc_offset: u64,
    pub file: usize,
    pub file_offset: u64,
    pub len: u64,
}

/// What a helper says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", deny_unknown_fields)]
pub enum HelperMsg {
    /// Its context is up; it waits for a job.
    Ready { init_s: f64 },
    /// Every piece is on the GPU.
    Done {
        bytes: u64,
        seconds: f64,
        register_s: f64,
    },
    /// Nothing can be assumed about its pieces.
    Failed { message: String },
}

/// Chooses the work items helpers copy: of the raw chunks with a gh1 digest, the last
/// in file order up to `share` of all `lens`' bytes, cut into `n` runs of about equal
/// bytes (each helper registers one stretch of the files). Returns one list of work
/// indices per helper (in file order; empty lists dropped).
pub fn split(places: &[Option<RawPlace>], lens: &[u64], share: f64, n: usize) -> Vec<Vec<usize>> {
    let total: u64 = lens.iter().sum();
    let want = (total as f64 * share.clamp(0.0, 1.0)) as u64;
    if n == 0 || want == 0 {
        return Vec::new();
    }
    let mut raw: Vec<usize> = (0..places.len())
        .filter(|&i| places[i].is_some_and(|p| p.gpu_hashed))
        .collect();
    raw.sort_by_key(|&i| places[i].map(|p| (p.file, p.offset)));
    let mut taken = Vec::new();
    let mut bytes = 0;
    for &i in raw.iter().rev() {
        if bytes >= want {
            break;
        }
        bytes += lens[i];
        taken.push(i);
    }
    taken.reverse();
    let per = bytes.div_ceil(n as u64).max(1);
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut acc = 0;
    for i in taken {
        let h = ((acc / per) as usize).min(n - 1);
        out[h].push(i);
        acc += lens[i];
    }
    out.retain(|v| !v.is_empty());
    out
}

/// Helpers spawned for one copy-in.
pub struct Helpers {
    list: Vec<Helper>,
    spawned_at: Instant,
}

/// One helper process and its socket.
pub struct Helper {
    /// `None` once let go.
    child: Option<Child>,
    sock: UnixStream,
    /// Its context's start-up time, once it said Ready.
    pub init_s: Option<f64>,
}

impl Helpers {
    /// Starts `n` helpers from `path` for CUDA device `device`, without waiting for them.
    /// The hook's preload is not inherited (a helper's CUDA calls are its own).
    pub fn spawn(path: &Path, n: usize, device: i32) -> Result<Helpers, String> {
        let mut list = Vec::with_capacity(n);
        for _ in 0..n {
            let (ours, theirs) =
                UnixStream::pair().map_err(|e| format!("socketpair for a helper: {e}"))?;
            let fd = theirs.as_raw_fd();
            let mut cmd = Command::new(path);
            cmd.env_remove("LD_PRELOAD")
                .env(ENV_SOCKET_FD, fd.to_string())
                .env(ENV_DEVICE, device.to_string())
                .stdin(std::process::Stdio::null());
            // SAFETY: only async-signal-safe calls between fork and exec: the helper's end
            // of the socket loses close-on-exec.
            unsafe {
                cmd.pre_exec(move || {
                    let flags = nix::libc::fcntl(fd, nix::libc::F_GETFD);
                    if flags < 0 || nix::libc::fcntl(fd, nix::libc::F_SETFD, flags & !nix::libc::FD_CLOEXEC) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = cmd
                .spawn()
                .map_err(|e| format!("cannot start the copy-in helper {}: {e}", path.display()))?;
            drop(theirs);
            list.push(Helper {
                child: Some(child),
                sock: ours,
                init_s: None,
            });
        }
        Ok(Helpers {
            list,
            spawned_at: Instant::now(),
        })
    }

    /// How many were spawned.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Seconds since they were spawned.
    pub fn age(&self) -> f64 {
        self.spawned_at.elapsed().as_secs_f64()
    }

    /// The helpers that have said Ready by now (waiting for none); the others are let
    /// go (their reapers in `reapers`).
    pub fn ready_now(self, reapers: &mut Vec<std::thread::JoinHandle<()>>) -> Vec<Helper> {
        let mut ready = Vec::new();
        for mut h in self.list {
            match h.poll_ready() {
                Ok(true) => {
                    ready.push(h);
                    continue;
                }
                Ok(false) => tracing::info!(
                    pid = h.pid(),
                    "copy-in helper not ready in time; not used"
                ),
                Err(e) => {
                    tracing::warn!(pid = h.pid(), error = %e, "copy-in helper failed to start")
                }
            }
            reapers.push(h.finish());
        }
        ready
    }

    /// Lets every helper go (see [`Helper::finish`]).
    pub fn finish(self) -> Vec<std::thread::JoinHandle<()>> {
        self.list.into_iter().map(Helper::finish).collect()
    }
}

impl Helper {
    /// Whether the Ready message is there (non-blocking).
    fn poll_ready(&mut self) -> Result<bool, String> {
        let mut pfd = [nix::poll::PollFd::new(self.sock.as_fd(), nix::poll::PollFlags::POLLIN)];
        let n = nix::poll::poll(&mut pfd, nix::poll::PollTimeout::ZERO)
            .map_err(|e| format!("poll: {e}"))?;
        if n == 0 {
            return Ok(false);
        }
        match self.recv()? {
            HelperMsg::Ready { init_s } => {
                self.init_s = Some(init_s);
                Ok(true)
            }
            HelperMsg::Failed { message } => Err(message),
            other => Err(format!("unexpected {other:?} before a job")),
        }
    }

    fn recv(&mut self) -> Result<HelperMsg, String> {
        let buf = read_frame(&mut self.sock, MAX_FRAME).map_err(|e| format!("reading: {e}"))?;
        serde_json::from_slice(&buf).map_err(|e| format!("bad message: {e}"))
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Sends `job` with its memory fds and data file fds.
    pub fn send(&mut self, job: &Job, memory: &[OwnedFd], files: &[impl AsFd]) -> Result<(), String> {
        write_frame(&mut self.sock, job, MAX_FRAME).map_err(|e| format!("sending the job: {e}"))?;
        self.sock.flush().map_err(|e| e.to_string())?;
        send_fd_batches(&self.sock, memory).map_err(|e| format!("sending memory fds: {e}"))?;
        send_fd_batches(&self.sock, files).map_err(|e| format!("sending file fds: {e}"))?;
        Ok(())
    }

    /// Waits for the job's outcome: `(bytes, seconds, register_s)`.
    pub fn wait_done(&mut self) -> Result<(u64, f64, f64), String> {
        self.sock
            .set_read_timeout(Some(JOB_DEADLINE))
            .map_err(|e| e.to_string())?;
        match self.recv()? {
            HelperMsg::Done {
                bytes,
                seconds,
                register_s,
            } => Ok((bytes, seconds, register_s)),
            HelperMsg::Failed { message } => Err(message),
            other => Err(format!("unexpected {other:?}")),
        }
    }
}

impl Helper {
    /// Lets the helper go: its socket closes (it unpins, unmaps and exits) and a
    /// thread reaps it, killing it if it has not exited within a few seconds. Join
    /// the handle before anything could dump the process tree (the next freeze).
    pub fn finish(mut self) -> std::thread::JoinHandle<()> {
        let child = self.child.take();
        drop(self);
        std::thread::spawn(move || {
            let Some(mut child) = child else { return };
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => return,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    _ => break,
                }
            }
            let _ = child.kill();
            let _ = child.wait();
        })
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        // Not let go by `finish` (an error path): stopped at once, never left for a
        // later dump.
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The helper's side of its socket: the fd in [`ENV_SOCKET_FD`].
pub fn helper_socket() -> Result<UnixStream, String> {
    let fd: i32 = std::env::var(ENV_SOCKET_FD)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{ENV_SOCKET_FD} is not set: gpucr-copyin is started by the hook"))?;
    // SAFETY: the hook passed this fd to us for this purpose; nothing else owns it.
    let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    Ok(UnixStream::from(owned))
}

/// Sends one message (the helper's side).
pub fn say(sock: &mut UnixStream, msg: &HelperMsg) -> Result<(), String> {
    write_frame(sock, msg, MAX_FRAME).map_err(|e| e.to_string())?;
    sock.flush().map_err(|e| e.to_string())
}

/// Receives one job with its fds (the helper's side); `None` when the hook closed.
pub fn next_job(sock: &mut UnixStream) -> Result<Option<(Job, Vec<OwnedFd>, Vec<OwnedFd>)>, String> {
    let buf = match read_frame(sock, MAX_FRAME) {
        Ok(buf) => buf,
        // Closed before a frame: no more jobs.
        Err(FrameError::Closed) => return Ok(None),
        Err(e) => return Err(format!("reading a job: {e}")),
    };
    let job: Job = serde_json::from_slice(&buf).map_err(|e| format!("bad job: {e}"))?;
    let memory = recv_fd_batches(sock, job.allocs.len()).map_err(|e| e.to_string())?;
    let files = recv_fd_batches(sock, job.files).map_err(|e| e.to_string())?;
    Ok(Some((job, memory, files)))
}
