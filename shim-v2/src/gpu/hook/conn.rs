//! One process's control connection: the socket reached through its directory, and each
//! verb's call with the reply checked against what the verb answers.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::Path;

use gpucr_hook::control::{ControlClient, ControlError};
use gpucr_hook::protocol::{
    CopyInReport, HookStatus, Outcome, PrepareReport, Reply, Request, SnapshotReport, Verb,
    WarmReport,
};

use super::{HookError, HookProcess, Result, CALL_TIMEOUT};
use crate::gpu::restore_helpers::ProcessHelpers;

/// Connects to `socket` through an `O_PATH` descriptor of its directory
/// (`/proc/self/fd/<n>/<name>`): the bundle's path under containerd's state directory
/// (a 64-character CRI id in it) easily makes the socket's own path longer than a unix
/// socket address may be (108 bytes).
fn connect(socket: &Path) -> std::result::Result<ControlClient, ControlError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let (Some(dir), Some(name)) = (socket.parent(), socket.file_name()) else {
        return ControlClient::connect(socket);
    };
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|source| ControlError::Socket {
            path: socket.to_path_buf(),
            source,
        })?;
    let short = Path::new("/proc/self/fd")
        .join(dir.as_raw_fd().to_string())
        .join(name);
    ControlClient::connect(&short).map_err(|e| match e {
        ControlError::Socket { source, .. } => ControlError::Socket {
            path: socket.to_path_buf(),
            source,
        },
        other => other,
    })
}

/// One process's connection.
pub(super) struct Conn {
    pid: u32,
    client: ControlClient,
}

impl Conn {
    pub(super) fn open(p: &HookProcess) -> Result<Conn> {
        let control = |source| HookError::Control {
            pid: p.host_pid,
            source,
        };
        let client = connect(&p.socket).map_err(control)?;
        client
            .set_timeout(Some(CALL_TIMEOUT))
            .map_err(|e| control(ControlError::Frame(e.into())))?;
        Ok(Conn {
            pid: p.host_pid,
            client,
        })
    }

    pub(super) fn reply(
        &self,
        verb: Verb,
        reply: std::result::Result<Reply, ControlError>,
    ) -> Result<Outcome> {
        match reply.map_err(|source| HookError::Control {
            pid: self.pid,
            source,
        })? {
            Reply::Ok(outcome) => Ok(outcome),
            Reply::Error(e) => Err(HookError::Verb {
                pid: self.pid,
                verb,
                kind: e.kind,
                message: e.message,
            }),
        }
    }

    pub(super) fn call(&mut self, req: &Request) -> Result<Outcome> {
        let reply = self.client.call(req);
        self.reply(req.verb(), reply)
    }

    pub(super) fn status(&mut self) -> Result<HookStatus> {
        match self.call(&Request::Status)? {
            Outcome::Status(s) => Ok(s),
            other => Err(self.unexpected(Verb::Status, &other)),
        }
    }

    pub(super) fn copy_out(&mut self, dir: &File, name: &Path) -> Result<(u64, usize)> {
        let reply = self.client.copy_out_fd(dir, name, None);
        match self.reply(Verb::CopyOut, reply)? {
            Outcome::CopiedOut(r) => Ok((r.bytes, r.allocations)),
            other => Err(self.unexpected(Verb::CopyOut, &other)),
        }
    }

    /// Prepare a CopyOut into `<dir>/<name>` while the process runs.
    pub(super) fn prepare(&mut self, dir: &File, name: &Path) -> Result<PrepareReport> {
        let reply = self.client.prepare_fd(dir, name, None);
        match self.reply(Verb::Prepare, reply)? {
            Outcome::Prepared(r) => Ok(r),
            other => Err(self.unexpected(Verb::Prepare, &other)),
        }
    }

    /// A verb whose reply may come with memory fds: the outcome and the fds.
    pub(super) fn call_for_fds(
        &mut self,
        verb: Verb,
        call: impl FnOnce(
            &mut ControlClient,
        ) -> std::result::Result<(Reply, Vec<OwnedFd>), ControlError>,
    ) -> Result<(Outcome, Vec<OwnedFd>)> {
        let (reply, fds) = match call(&mut self.client) {
            Ok((reply, fds)) => (Ok(reply), fds),
            Err(e) => (Err(e), Vec::new()),
        };
        Ok((self.reply(verb, reply)?, fds))
    }

    /// Release; with `keep`, the kept memory's addresses and fds (empty when the hook
    /// could not keep it).
    pub(super) fn release(&mut self, keep: bool) -> Result<(Vec<u64>, Vec<OwnedFd>)> {
        match self.call_for_fds(Verb::Release, |c| c.release(keep))? {
            // Without every fd nothing is kept (the memory is freed as they close).
            (Outcome::Released(r), fds) if r.held.len() == fds.len() => Ok((r.held, fds)),
            (Outcome::Released(_), _) => Ok((Vec::new(), Vec::new())),
            (other, _) => Err(self.unexpected(Verb::Release, &other)),
        }
    }

    /// Snapshot: the report and the fds of its `held` addresses (the memory, then the
    /// snapshot). A reply without every fd is an error: that memory is gone.
    pub(super) fn snapshot(&mut self) -> Result<(SnapshotReport, Vec<OwnedFd>)> {
        match self.call_for_fds(Verb::Snapshot, |c| c.snapshot())? {
            (Outcome::Snapshotted(r), fds) if r.release.held.len() == fds.len() => Ok((r, fds)),
            (Outcome::Snapshotted(r), fds) => Err(HookError::Stranded {
                pid: self.pid,
                cause: format!(
                    "{} of the {} kept memory fds arrived after its Snapshot",
                    fds.len(),
                    r.release.held.len()
                ),
            }),
            (other, _) => Err(self.unexpected(Verb::Snapshot, &other)),
        }
    }

    /// WriteSnapshot into `<dir>/<name>`: bytes and milliseconds.
    pub(super) fn write_snapshot(&mut self, dir: &File, name: &Path) -> Result<u64> {
        let reply = self.client.write_snapshot_fd(dir, name, None);
        match self.reply(Verb::WriteSnapshot, reply)? {
            Outcome::SnapshotWritten(r) => Ok(r.bytes),
            other => Err(self.unexpected(Verb::WriteSnapshot, &other)),
        }
    }

    pub(super) fn reattach(&mut self, held: &[u64], fds: &[OwnedFd]) -> Result<()> {
        let reply = self.client.reattach(held, fds);
        match self.reply(Verb::Reattach, reply)? {
            Outcome::Reattached(_) => Ok(()),
            other => Err(self.unexpected(Verb::Reattach, &other)),
        }
    }

    pub(super) fn copy_in(&mut self, image: &Path) -> Result<CopyInReport> {
        let dir = File::open(image).map_err(|source| HookError::Io {
            pid: self.pid,
            what: format!("opening {}", image.display()),
            source,
        })?;
        let reply = self.client.copy_in_fd(&dir);
        match self.reply(Verb::CopyIn, reply)? {
            Outcome::CopiedIn(r) => Ok(r),
            other => Err(self.unexpected(Verb::CopyIn, &other)),
        }
    }

    /// Hands over the restore's helpers (see [`crate::gpu::restore_helpers`]).
    pub(super) fn warm_helpers(&mut self, helpers: ProcessHelpers) -> Result<WarmReport> {
        let reply = self.client.warm_with_helpers(helpers.jobs, &helpers.socks);
        match self.reply(Verb::Warm, reply)? {
            Outcome::Warmed(report) => Ok(report),
            other => Err(self.unexpected(Verb::Warm, &other)),
        }
    }

    pub(super) fn unexpected(&self, verb: Verb, outcome: &Outcome) -> HookError {
        HookError::Unexpected {
            pid: self.pid,
            verb,
            outcome: format!("{outcome:?}"),
        }
    }
}

/// Whether this shim can hold `n` more fds (kept memory) under its soft `RLIMIT_NOFILE`;
/// when not, the memory is not kept (the copy-in gives it back). The limit is not raised:
/// the containers this shim starts would inherit it.
pub(super) fn fds_fit(pid: u32, n: usize) -> bool {
    match gpucr_hook::control::FdRoom::now() {
        Ok(room) if room.fits(n) => true,
        Ok(room) => {
            tracing::warn!(
                pid,
                allocations = n,
                open = room.open,
                soft_limit = room.soft,
                "device memory not kept on the GPU: the shim's fd limit is too low (raise \
                 containerd's LimitNOFILE); it is copied back in instead"
            );
            false
        }
        Err(e) => {
            tracing::warn!(pid, error = %e, "device memory not kept: cannot read the fd limit");
            false
        }
    }
}
