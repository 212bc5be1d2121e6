//! Copy-in helpers: processes of their own (`gpucr-copyin`, `hook/src/bin`) that DMA part
//! of a copy-in straight from the image's pages, registered for DMA in their own context,
//! while this process stages the rest through its pinned buffers.
//!
//! Why processes: inside one process the driver does not pin host memory while copies
//! run (register + DMA take their sum, `tests/gpu/register_probe.cu`), and a staged
//! copy-in costs three passes over host memory (read the page cache, write the pinned
//! buffer, DMA reads it), which bounds it by the host's memory bandwidth. Across
//! processes pinning and copies overlap (`tests/gpu/xproc_probe.cu`: one process staging
//! while two others register and DMA went faster than staging alone), and a registered
//! chunk costs one pass. Figures: docs/BENCHMARKS.md.
//!
//! The helpers are spawned by Warm, before the copy-in is due (their CUDA context takes a while),
//! or — in a restore, where the hook first answers only after CRIU's restore — by the shim on the
//! host before `runc restore`, which sends them their jobs itself ([`plan_image_jobs`]) and hands
//! their sockets to the hook with Warm ([`AheadJob`]). A helper's work comes in two parts: a
//! [`Job`] — the pieces it copies (chunk → allocation offset) with the image's data files as fds —
//! which it starts pinning at once, and a [`Go`] with the memory fds of the allocations the pieces
//! land in (exported by the hook once its memory exists again, imported there and mapped), after
//! which it copies. Warm with an image sends the jobs at once, so the pinning (a fraction of a
//! second per few GB) runs while the driver restores the process and the copy-in itself is DMA from
//! pinned pages; without one, the copy-in sends Job and Go together. A helper replies Done or
//! Failed; what a failed helper had is staged afterwards. Nothing a helper copies is trusted: only
//! chunks with a gh1 digest go to helpers, and the copy-in checks them on the GPU after. Helpers
//! never outlive the copy-in (or a Thaw): no checkpoint meets one.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use gpu_state::image::{AllocId, ImageError, ImageReader, RawPlace};
use serde::{Deserialize, Serialize};

use crate::control::wire::{read_frame, recv_fd_batches, send_fd_batches, write_frame, FrameError};

/// The helper's end of its socket (an fd number), in its environment.
pub const ENV_SOCKET_FD: &str = "GPUCR_COPYIN_SOCKET_FD";
/// The CUDA device ordinal the helper copies to (the hook's context's device).
pub const ENV_DEVICE: &str = "GPUCR_COPYIN_DEVICE";
/// Instead, the UUID of that device (`GPU-…`): a helper the shim starts on the host,
/// where ordinals are not the container's.
pub const ENV_DEVICE_UUID: &str = "GPUCR_COPYIN_DEVICE_UUID";
/// Largest frame on a helper socket.
pub const MAX_FRAME: u32 = 64 << 20;
/// How long a copy-in waits for a helper's reply to its job.
const JOB_DEADLINE: Duration = Duration::from_secs(120);

/// One helper's share of a copy-in. The job frame is followed by `files` data file fds
/// (fd batches, [`send_fd_batches`]); the allocations' memory fds follow its [`Go`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Job {
    /// The size of each allocation (as the image records it) whose memory fd follows
    /// the [`Go`]: no piece may reach past it.
    pub allocs: Vec<u64>,
    /// How many data file fds follow the memory fds.
    pub files: usize,
    /// What to copy, in file order.
    pub pieces: Vec<Piece>,
}

/// The second part of a job: the job's `allocs.len()` memory fds follow this frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Go {
    pub memory: usize,
    /// The mapped size of each memory fd (the allocation's size rounded up to the
    /// driver's granularity): only the hook knows it, and the job may come from the shim.
    pub sizes: Vec<u64>,
}

/// What the copy-in must know of a job sent ahead (by the hook's Warm, or by the shim,
/// which hands the helper's socket over with Warm): which chunks the helper copies and
/// into which allocations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AheadJob {
    /// The image's manifest id: a copy-in from another image cannot use the job.
    pub image_id: String,
    /// The chunks of the job, as (image allocation index, chunk index), in job order.
    pub chunks: Vec<(usize, usize)>,
    /// The device address and size of each of the job's allocations, in job order.
    pub allocs: Vec<(u64, u64)>,
    /// The job's bytes.
    pub bytes: u64,
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
        /// From its Go to this reply.
        seconds: f64,
        /// From its Go until the memory was imported and mapped.
        #[serde(default)]
        setup_s: f64,
        /// From its job until its last stretch was pinned.
        register_s: f64,
        /// From its job to its Go (the time it had to pin ahead).
        #[serde(default)]
        ahead_s: f64,
        /// After its Go, waiting for stretches still being pinned.
        #[serde(default)]
        pin_wait_s: f64,
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

/// Largest stretch a helper registers in one call (as the probes measured).
pub const WINDOW: u64 = 512 << 20;
const PAGE: u64 = 4096;

/// A stretch of one data file: `[start, end)`, page aligned, and the pieces in it.
#[derive(Debug, PartialEq, Eq)]
pub struct Stretch {
    pub file: usize,
    pub start: u64,
    pub end: u64,
    /// Indices into the job's pieces.
    pub pieces: Vec<usize>,
}

/// The job's pieces (in data files of `sizes` bytes) grouped into page-aligned stretches of at most [`WINDOW`] bytes
/// that never share a page (a page registered twice would fail).
pub fn stretches(job: &Job, sizes: &[u64]) -> Result<Vec<Stretch>, String> {
    let mut order: Vec<usize> = (0..job.pieces.len()).collect();
    order.sort_by_key(|&i| (job.pieces[i].file, job.pieces[i].file_offset));
    let mut out: Vec<Stretch> = Vec::new();
    for i in order {
        let p = &job.pieces[i];
        let size = *sizes
            .get(p.file)
            .ok_or("a piece names a file the job lacks")?;
        if p.file_offset.checked_add(p.len).is_none_or(|e| e > size) {
            return Err(format!("a piece lies past the end of data file {}", p.file));
        }
        let start = p.file_offset / PAGE * PAGE;
        let end = (p.file_offset + p.len).div_ceil(PAGE) * PAGE;
        match out.last_mut() {
            Some(s) if s.file == p.file && start < s.end => {
                s.end = s.end.max(end);
                s.pieces.push(i);
            }
            Some(s) if s.file == p.file && start == s.end && end - s.start <= WINDOW => {
                s.end = end;
                s.pieces.push(i);
            }
            _ => out.push(Stretch {
                file: p.file,
                start,
                end,
                pieces: vec![i],
            }),
        }
    }
    Ok(out)
}

/// The device a helper copies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelperDevice {
    /// The hook's context's ordinal (a helper of the hook's, in the container).
    Ordinal(i32),
    /// The GPU's UUID (a helper of the shim's, on the host).
    Uuid(String),
}

/// The command that starts helper `path` for `device`, our end of its socket, and its
/// end: inherited by the helper (no close-on-exec), to be dropped once it is spawned.
pub fn helper_command(
    path: &Path,
    device: &HelperDevice,
) -> Result<(Command, UnixStream, OwnedFd), String> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| format!("socketpair for a helper: {e}"))?;
    let theirs = OwnedFd::from(theirs);
    // The helper's end is inherited by clearing its close-on-exec here rather than in a
    // pre_exec hook: without one, std spawns with posix_spawn (no fork of a process that
    // may map hundreds of GiB) and no atfork handler runs.
    let flags = nix::fcntl::fcntl(&theirs, nix::fcntl::FcntlArg::F_GETFD)
        .map_err(|e| format!("fcntl on a helper socket: {e}"))?;
    let flags = nix::fcntl::FdFlag::from_bits_truncate(flags) - nix::fcntl::FdFlag::FD_CLOEXEC;
    nix::fcntl::fcntl(&theirs, nix::fcntl::FcntlArg::F_SETFD(flags))
        .map_err(|e| format!("fcntl on a helper socket: {e}"))?;
    let mut cmd = Command::new(path);
    cmd.env(ENV_SOCKET_FD, theirs.as_raw_fd().to_string())
        .stdin(std::process::Stdio::null());
    match device {
        HelperDevice::Ordinal(n) => cmd.env(ENV_DEVICE, n.to_string()),
        HelperDevice::Uuid(u) => cmd.env(ENV_DEVICE_UUID, u),
    };
    Ok((cmd, ours, theirs))
}

/// Helpers spawned for one copy-in.
pub struct Helpers {
    list: Vec<Helper>,
}

/// One helper process and its socket.
pub struct Helper {
    /// `None` once let go, or when the shim started it (the shim reaps it).
    child: Option<Child>,
    sock: UnixStream,
    /// Its context's start-up time, once it said Ready.
    pub init_s: Option<f64>,
    /// The job sent ahead of the copy-in (by Warm with an image), waiting for its Go.
    pub ahead: Option<Ahead>,
}

/// A job sent: what it holds, and the thread still writing it.
pub struct Ahead {
    pub job: AheadJob,
    /// Writes the job (the helper reads it only once its context is up, and the frame
    /// and fds may not fit the socket's buffer): joined before the Go.
    sender: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Ahead {
    /// A job already written in full.
    pub fn sent(job: AheadJob) -> Ahead {
        Ahead { job, sender: None }
    }
}

/// Copies of the image's data file fds, to go with a job written from another thread.
pub fn data_file_fds(reader: &ImageReader) -> std::io::Result<Vec<OwnedFd>> {
    reader
        .data_files()
        .iter()
        .map(|f| f.try_clone().map(OwnedFd::from))
        .collect()
}

/// The helpers' jobs for a copy-in of every allocation of `pid` in `reader` (a copy-in
/// matches the image exactly): [`split`] of their raw chunks with a gh1 digest, `share`
/// of all their bytes over `n` helpers, each job with what the copy-in needs to know of
/// it. The shim plans a restore's jobs with this before the hook answers, and the hook
/// its own: the same split either way.
pub fn plan_image_jobs(
    reader: &ImageReader,
    pid: Option<u32>,
    share: f64,
    n: usize,
) -> Result<Vec<(Job, AheadJob)>, ImageError> {
    let allocations = reader.allocations();
    let work: Vec<(AllocId, usize)> = allocations
        .iter()
        .enumerate()
        .filter(|(_, a)| a.tags.pid == pid)
        .flat_map(|(i, a)| (0..a.chunks.len()).map(move |k| (AllocId(i), k)))
        .collect();
    let places = reader.raw_places(&work)?;
    let lens: Vec<u64> = work
        .iter()
        .map(|&(id, k)| allocations[id.0].chunks[k].len)
        .collect();
    let image_id = reader.manifest_hash().to_hex();
    let files = reader.data_files().len();
    let mut jobs = Vec::new();
    for group in split(&places, &lens, share, n) {
        let mut job = Job {
            allocs: Vec::new(),
            files,
            pieces: Vec::with_capacity(group.len()),
        };
        let mut ahead = AheadJob {
            image_id: image_id.clone(),
            chunks: Vec::with_capacity(group.len()),
            allocs: Vec::new(),
            bytes: 0,
        };
        let mut index_of = std::collections::HashMap::new();
        for i in group {
            let (id, k) = work[i];
            let alloc = &allocations[id.0];
            let a = *index_of.entry(id.0).or_insert_with(|| {
                job.allocs.push(alloc.size);
                ahead.allocs.push((alloc.va, alloc.size));
                job.allocs.len() - 1
            });
            let place = places[i].expect("split hands out raw chunks only");
            job.pieces.push(Piece {
                alloc: a,
                alloc_offset: alloc.chunks[k].offset,
                file: place.file,
                file_offset: place.offset,
                len: place.len,
            });
            ahead.chunks.push((id.0, k));
            ahead.bytes += lens[i];
        }
        jobs.push((job, ahead));
    }
    Ok(jobs)
}

impl Helpers {
    /// Starts `n` helpers from `path` for CUDA device `device`, without waiting for them.
    /// The hook's preload is not inherited (a helper's CUDA calls are its own).
    pub fn spawn(path: &Path, n: usize, device: i32) -> Result<Helpers, String> {
        let mut list = Vec::with_capacity(n);
        for _ in 0..n {
            let (mut cmd, ours, theirs) = helper_command(path, &HelperDevice::Ordinal(device))?;
            // The hook's preload is not inherited (a helper's CUDA calls are its own).
            let child = cmd
                .env_remove("LD_PRELOAD")
                .spawn()
                .map_err(|e| format!("cannot start the copy-in helper {}: {e}", path.display()))?;
            drop(theirs);
            list.push(Helper {
                child: Some(child),
                sock: ours,
                init_s: None,
                ahead: None,
            });
        }
        Ok(Helpers { list })
    }

    /// Helpers the shim started and sent their jobs (`jobs[i]` is what socket `socks[i]`'s
    /// helper holds); they are the shim's children and say Ready to this process.
    pub fn adopt(jobs: Vec<AheadJob>, socks: Vec<OwnedFd>) -> Helpers {
        let list = jobs
            .into_iter()
            .zip(socks)
            .map(|(job, sock)| Helper {
                child: None,
                sock: UnixStream::from(sock),
                init_s: None,
                ahead: Some(Ahead::sent(job)),
            })
            .collect();
        Helpers { list }
    }

    /// The helpers, e.g. to send them jobs ahead.
    pub fn list_mut(&mut self) -> &mut [Helper] {
        &mut self.list
    }

    /// How many were spawned.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
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
                Ok(false) => {
                    tracing::info!(pid = h.pid(), "copy-in helper not ready in time; not used")
                }
                Err(e) => {
                    tracing::warn!(pid = h.pid(), error = %e, "copy-in helper failed to start")
                }
            }
            reapers.push(h.stop());
        }
        ready
    }

    /// Stops every helper (see [`Helper::stop`]).
    pub fn stop(self) -> Vec<std::thread::JoinHandle<()>> {
        self.list.into_iter().map(Helper::stop).collect()
    }
}

impl Helper {
    /// Whether the Ready message is there (non-blocking).
    fn poll_ready(&mut self) -> Result<bool, String> {
        let mut pfd = [nix::poll::PollFd::new(
            self.sock.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
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

    /// Its pid; 0 for a helper of the shim's.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Sends `job` with its data file fds now (the copy-in's own job: the helper is
    /// Ready and reading).
    pub fn send_job(
        &mut self,
        job: &Job,
        files: &[impl AsFd],
        desc: AheadJob,
    ) -> Result<(), String> {
        write_job(&mut self.sock, job, files)?;
        self.ahead = Some(Ahead::sent(desc));
        Ok(())
    }

    /// Sends `job` ahead of the copy-in, from a thread (the helper may still be making
    /// its context); `ahead` says what it holds.
    pub fn send_job_ahead(
        &mut self,
        job: Job,
        files: Vec<OwnedFd>,
        desc: AheadJob,
    ) -> Result<(), String> {
        let mut sock = self
            .sock
            .try_clone()
            .map_err(|e| format!("cannot clone a helper socket: {e}"))?;
        let mut ahead = Ahead::sent(desc);
        ahead.sender = Some(
            std::thread::Builder::new()
                .name("gpucr-helper-job".into())
                .spawn(move || write_job(&mut sock, &job, &files))
                .map_err(|e| format!("cannot start a thread: {e}"))?,
        );
        self.ahead = Some(ahead);
        Ok(())
    }

    /// Sends the Go of the job sent (its memory fds and their mapped sizes, in the
    /// job's allocation order), after the job itself has gone out.
    pub fn go(&mut self, memory: &[OwnedFd], sizes: &[u64]) -> Result<(), String> {
        if let Some(sender) = self.ahead.as_mut().and_then(|a| a.sender.take()) {
            sender
                .join()
                .map_err(|_| "the thread sending a job panicked".to_string())??;
        }
        let go = Go {
            memory: memory.len(),
            sizes: sizes.to_vec(),
        };
        write_frame(&mut self.sock, &go, MAX_FRAME).map_err(|e| format!("sending Go: {e}"))?;
        self.sock.flush().map_err(|e| e.to_string())?;
        send_fd_batches(&self.sock, memory).map_err(|e| format!("sending memory fds: {e}"))
    }

    /// Waits for the job's outcome.
    pub fn wait_done(&mut self) -> Result<HelperMsg, String> {
        self.sock
            .set_read_timeout(Some(JOB_DEADLINE))
            .map_err(|e| e.to_string())?;
        match self.recv()? {
            done @ HelperMsg::Done { .. } => Ok(done),
            HelperMsg::Failed { message } => Err(message),
            other => Err(format!("unexpected {other:?}")),
        }
    }
}

impl Helper {
    /// Lets the helper go: its socket closes (it unpins, unmaps and exits) and a
    /// thread reaps it, killing it if it has not exited within a few seconds. Join
    /// the handle before anything could dump the process tree (the next freeze).
    pub fn finish(self) -> std::thread::JoinHandle<()> {
        self.let_go(Duration::from_secs(5))
    }

    /// Stops an unused helper now (it may still be making its context) and reaps it
    /// in a thread.
    pub fn stop(self) -> std::thread::JoinHandle<()> {
        self.let_go(Duration::ZERO)
    }

    fn let_go(mut self, grace: Duration) -> std::thread::JoinHandle<()> {
        let child = self.child.take();
        let sender = self.ahead.as_mut().and_then(|a| a.sender.take());
        drop(self);
        std::thread::spawn(move || {
            let Some(mut child) = child else { return };
            let deadline = Instant::now() + grace;
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
            // With the helper gone its socket takes no more: the sender returns.
            if let Some(sender) = sender {
                let _ = sender.join();
            }
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
        if let Some(sender) = self.ahead.as_mut().and_then(|a| a.sender.take()) {
            let _ = sender.join();
        }
    }
}

/// Writes a job frame and its data file fds.
pub fn write_job(sock: &mut UnixStream, job: &Job, files: &[impl AsFd]) -> Result<(), String> {
    write_frame(sock, job, MAX_FRAME).map_err(|e| format!("sending the job: {e}"))?;
    sock.flush().map_err(|e| e.to_string())?;
    send_fd_batches(sock, files).map_err(|e| format!("sending file fds: {e}"))
}

/// The helper's side of its socket: the fd in [`ENV_SOCKET_FD`].
pub fn helper_socket() -> Result<UnixStream, String> {
    let fd: i32 = std::env::var(ENV_SOCKET_FD)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            format!("{ENV_SOCKET_FD} is not set: gpucr-copyin is started by the hook or the shim")
        })?;
    // SAFETY: the hook passed this fd to us for this purpose; nothing else owns it.
    let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    Ok(UnixStream::from(owned))
}

/// Sends one message (the helper's side).
pub fn say(sock: &mut UnixStream, msg: &HelperMsg) -> Result<(), String> {
    write_frame(sock, msg, MAX_FRAME).map_err(|e| e.to_string())?;
    sock.flush().map_err(|e| e.to_string())
}

/// Receives one job with its data file fds (the helper's side); `None` when the hook
/// closed.
pub fn next_job(sock: &mut UnixStream) -> Result<Option<(Job, Vec<OwnedFd>)>, String> {
    let buf = match read_frame(sock, MAX_FRAME) {
        Ok(buf) => buf,
        // Closed before a frame: no more jobs.
        Err(FrameError::Closed) => return Ok(None),
        Err(e) => return Err(format!("reading a job: {e}")),
    };
    let job: Job = serde_json::from_slice(&buf).map_err(|e| format!("bad job: {e}"))?;
    let files = recv_fd_batches(sock, job.files).map_err(|e| e.to_string())?;
    Ok(Some((job, files)))
}

/// A Go as received: the memory fds and their mapped sizes.
pub type GoFds = (Vec<OwnedFd>, Vec<u64>);

/// Receives the Go of `job` with its memory fds and their mapped sizes (the helper's
/// side); `None` when the hook closed instead (the copy-in will not use this helper).
pub fn next_go(sock: &mut UnixStream, job: &Job) -> Result<Option<GoFds>, String> {
    let buf = match read_frame(sock, MAX_FRAME) {
        Ok(buf) => buf,
        Err(FrameError::Closed) => return Ok(None),
        Err(e) => return Err(format!("reading Go: {e}")),
    };
    let go: Go = serde_json::from_slice(&buf).map_err(|e| format!("bad Go: {e}"))?;
    let memory = recv_fd_batches(sock, go.memory).map_err(|e| e.to_string())?;
    if go.memory != job.allocs.len() || go.sizes.len() != go.memory {
        return Err(format!(
            "Go names {} memory fds and {} sizes for a job of {} allocations",
            go.memory,
            go.sizes.len(),
            job.allocs.len()
        ));
    }
    if let Some(i) = (0..go.memory).find(|&i| go.sizes[i] < job.allocs[i]) {
        return Err(format!(
            "memory fd {i} maps {} bytes, less than its allocation's {}",
            go.sizes[i], job.allocs[i]
        ));
    }
    Ok(Some((memory, go.sizes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(file: usize, offset: u64, len: u64) -> Option<RawPlace> {
        Some(RawPlace {
            file,
            offset,
            len,
            gpu_hashed: true,
        })
    }

    #[test]
    fn split_takes_the_last_hashed_raw_chunks_in_file_order() {
        // Work items out of file order; one zero chunk, one compressed (None) and one
        // raw chunk without a gh1 digest never go to a helper.
        let mut places = vec![
            raw(0, 300, 100),
            None,
            raw(0, 0, 100),
            raw(1, 0, 100),
            raw(0, 100, 100),
            raw(0, 200, 100),
        ];
        places.push(Some(RawPlace {
            gpu_hashed: false,
            ..raw(1, 100, 100).unwrap()
        }));
        let lens = vec![100; places.len()];
        // 700 bytes in all; 40% = 280: the last three hashed chunks in file order.
        assert_eq!(split(&places, &lens, 0.4, 1), vec![vec![5, 0, 3]]);
        // Two helpers: runs of about equal bytes, each in file order.
        assert_eq!(split(&places, &lens, 0.4, 2), vec![vec![5, 0], vec![3]]);
        // More helpers than chunks: empty lists are dropped.
        assert_eq!(split(&places, &lens, 0.2, 4), vec![vec![0], vec![3]]);
        assert!(split(&places, &lens, 0.0, 2).is_empty());
        assert!(split(&places, &lens, 0.4, 0).is_empty());
        // Everything hashed and raw at 100%.
        let all = split(&places, &lens, 1.0, 1);
        assert_eq!(all, vec![vec![2, 4, 5, 0, 3]]);
    }

    fn piece(file: usize, file_offset: u64, len: u64) -> Piece {
        Piece {
            alloc: 0,
            alloc_offset: 0,
            file,
            file_offset,
            len,
        }
    }

    #[test]
    fn stretches_are_page_aligned_capped_and_never_share_a_page() {
        let mib = 1 << 20;
        let job = Job {
            allocs: vec![1 << 40],
            files: 2,
            pieces: vec![
                piece(0, 16 * mib, 16 * mib),
                piece(0, 0, 16 * mib),
                // Touches the page the previous piece ends in: the same stretch.
                piece(0, 32 * mib + 100, 50),
                // A gap of whole pages: a new stretch.
                piece(0, 64 * mib, 4096),
                piece(1, 10, 20),
            ],
        };
        let sizes = [1 << 30, 4096];
        let s = stretches(&job, &sizes).unwrap();
        let got: Vec<_> = s
            .iter()
            .map(|s| (s.file, s.start, s.end, s.pieces.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, 32 * mib + 4096, vec![1, 0, 2]),
                (0, 64 * mib, 64 * mib + 4096, vec![3]),
                (1, 0, 4096, vec![4]),
            ]
        );
        // Adjacent pieces beyond WINDOW start a new stretch.
        let many = Job {
            pieces: (0..40).map(|i| piece(0, i * 16 * mib, 16 * mib)).collect(),
            ..job.clone()
        };
        let s = stretches(&many, &sizes).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].end - s[0].start, WINDOW);
        assert!(s.iter().all(|s| s.start % 4096 == 0 && s.end % 4096 == 0));
        // A piece past its file's end, or naming a missing file, is refused.
        let past = Job {
            pieces: vec![piece(1, 4000, 200)],
            ..job.clone()
        };
        assert!(stretches(&past, &sizes)
            .unwrap_err()
            .contains("past the end"));
        let missing = Job {
            pieces: vec![piece(2, 0, 1)],
            ..job
        };
        assert!(stretches(&missing, &sizes).is_err());
    }

    #[test]
    fn jobs_and_replies_round_trip() {
        let job = Job {
            allocs: vec![2 << 20],
            files: 1,
            pieces: vec![piece(0, 0, 10)],
        };
        let back: Job = serde_json::from_str(&serde_json::to_string(&job).unwrap()).unwrap();
        assert_eq!(back, job);
        let go: Go = serde_json::from_str(r#"{"memory":1,"sizes":[2097152]}"#).unwrap();
        assert_eq!(
            go,
            Go {
                memory: 1,
                sizes: vec![2 << 20]
            }
        );
        let ready: HelperMsg = serde_json::from_str(r#"{"reply":"Ready","init_s":0.5}"#).unwrap();
        assert_eq!(ready, HelperMsg::Ready { init_s: 0.5 });
        assert!(serde_json::from_str::<HelperMsg>(r#"{"reply":"Done"}"#).is_err());
    }
}
