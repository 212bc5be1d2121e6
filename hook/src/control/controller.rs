//! The [`Controller`]: runs each verb on an [`Engine`] only in its state, and holds
//! the fds a request brought as long as the protocol says.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::wire::MAX_FDS;
use crate::driver::DevicePtr;
use crate::helper::AheadJob;
use crate::protocol::{
    CheckpointState, CopyInReport, CopyOutReport, ErrorKind, HookStatus, MemoryReport, Outcome,
    PrepareReport, Reply, Request, SnapshotReport, Verb, WarmReport,
};

use super::ControlError;

/// What the controller drives: the fast path, or a stub in tests.
pub trait Engine: Send {
    type Error: std::error::Error;
    fn freeze(&self) -> Result<(), Self::Error>;
    fn copy_out(&self, dir: &Path, parent: Option<&Path>) -> Result<CopyOutReport, Self::Error>;
    /// Releases every allocation's memory. With `keep`, exports it first when it can:
    /// the report's `held` lists the addresses of the returned fds, in order.
    fn release(&self, keep: bool) -> Result<(MemoryReport, Vec<OwnedFd>), Self::Error>;
    fn remap(&self) -> Result<MemoryReport, Self::Error>;
    /// Maps the memory of `fds` (kept since the release, one per address of `held`)
    /// back at `held`.
    fn reattach(&self, held: &[DevicePtr], fds: Vec<OwnedFd>) -> Result<MemoryReport, Self::Error>;
    fn copy_in(&self, dir: &Path) -> Result<CopyInReport, Self::Error>;
    fn thaw(&self) -> Result<(), Self::Error>;
    fn status(&self, state: CheckpointState) -> HookStatus;
    /// Copies every allocation into a snapshot on the device, then releases the
    /// snapshot (kept: its fd returned) and every allocation. An error changes nothing.
    fn snapshot(&self) -> Result<(SnapshotReport, Vec<OwnedFd>), Self::Error>;
    /// Writes the snapshot into a new image, then frees it.
    fn write_snapshot(
        &self,
        dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, Self::Error>;
    /// Frees the snapshot without writing it.
    fn drop_snapshot(&self) -> Result<(), Self::Error>;
    /// Readies a CopyOut into `dir` while the workload runs (see [`crate::protocol`]).
    fn prepare(&self, dir: &Path, parent: Option<&Path>) -> Result<PrepareReport, Self::Error>;
    /// Whether a prepared CopyOut is held (its directory fds must stay open).
    fn prepared(&self) -> bool;
    /// Drops a prepared CopyOut, if any.
    fn drop_prepared(&self);
    /// Starts what the next copy-in (from `image_dir` when given) can use: its helpers,
    /// and with an image their shares pinned ahead; none by default.
    fn warm(&self, _image_dir: Option<&Path>) -> Result<WarmReport, Self::Error> {
        Ok(WarmReport::default())
    }
    /// Takes over helpers the shim started and sent `jobs` (one socket each, in
    /// order); by default they are let go (their sockets closed).
    fn adopt_helpers(
        &self,
        _jobs: Vec<AheadJob>,
        _socks: Vec<OwnedFd>,
    ) -> Result<WarmReport, Self::Error> {
        Ok(WarmReport::default())
    }
}

/// Runs verbs on an engine in checkpoint order.
pub struct Controller<E> {
    state: CheckpointState,
    engine: E,
    /// The fds of the last CopyOut, held while CopiedOut: a Release that fails half-way
    /// refills the released allocations from that image, through these fds' paths.
    held: Vec<OwnedFd>,
    /// The fds of the last Prepare, held while the engine holds what it prepared (its
    /// unfinished image lives under these fds' paths).
    prepared: Vec<OwnedFd>,
    /// Counts successful Prepares: which one the engine holds.
    prepare_token: u64,
}

impl<E: Engine> Controller<E> {
    pub fn new(engine: E) -> Self {
        Controller {
            state: CheckpointState::Running,
            engine,
            held: Vec::new(),
            prepared: Vec::new(),
            prepare_token: 0,
        }
    }

    pub fn state(&self) -> CheckpointState {
        self.state
    }

    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// Runs one request; the state moves only when the verb succeeded.
    pub fn handle(&mut self, req: &Request) -> Reply {
        self.handle_with_fds(req, Vec::new())
    }

    /// Runs one request that came with `fds` (see [`crate::protocol`]): its relative
    /// paths are resolved against them. The fds are closed after the verb, except those
    /// of a successful CopyOut, which are held while CopiedOut. Memory fds a Release
    /// returns are closed (see [`Controller::exchange`]).
    pub fn handle_with_fds(&mut self, req: &Request, fds: Vec<OwnedFd>) -> Reply {
        self.exchange(req, fds).0
    }

    /// Runs one request with the fds that came with it and returns the reply with the
    /// fds that go with it: a Reattach's fds are the kept memory, a Release with `keep`
    /// returns them.
    pub fn exchange(&mut self, req: &Request, fds: Vec<OwnedFd>) -> (Reply, Vec<OwnedFd>) {
        let next = match self.state.on(req.verb()) {
            Ok(next) => next,
            Err(e) => {
                return (
                    Reply::error(ErrorKind::IllegalInState, e.to_string()),
                    Vec::new(),
                )
            }
        };
        let (req, path_fds, memory_fds) = match req {
            Request::Reattach { held } if held.len() != fds.len() => {
                let msg = format!(
                    "Reattach of {} address(es) came with {} fd(s)",
                    held.len(),
                    fds.len()
                );
                return (Reply::error(ErrorKind::BadRequest, msg), Vec::new());
            }
            Request::Reattach { .. } => (req.clone(), Vec::new(), fds),
            Request::Warm { image_dir, helpers } if !helpers.is_empty() => {
                if image_dir.is_some() || helpers.len() != fds.len() {
                    let msg = format!(
                        "Warm with {} helper job(s) came with {} socket fd(s){}: send one \
                         socket per job and no image",
                        helpers.len(),
                        fds.len(),
                        if image_dir.is_some() {
                            " and an image"
                        } else {
                            ""
                        }
                    );
                    return (Reply::error(ErrorKind::BadRequest, msg), Vec::new());
                }
                (req.clone(), Vec::new(), fds)
            }
            _ => match resolve_fd_paths(req, &fds) {
                Ok(req) => (req, fds, Vec::new()),
                Err(e) => {
                    return (
                        Reply::error(ErrorKind::BadRequest, e.to_string()),
                        Vec::new(),
                    )
                }
            },
        };
        let outcome = self.run(&req, memory_fds);
        let mut out = Vec::new();
        let reply = match outcome {
            Ok((outcome, fds)) => {
                tracing::debug!(verb = ?req.verb(), from = ?self.state, to = ?next, "control verb done");
                self.state = next;
                match req.verb() {
                    Verb::CopyOut => self.held = path_fds,
                    Verb::Prepare => {
                        self.prepared = path_fds;
                        self.prepare_token += 1;
                    }
                    _ => {}
                }
                out = fds;
                Reply::Ok(outcome)
            }
            Err(e) => {
                tracing::warn!(verb = ?req.verb(), state = ?self.state, error = %e, "control verb failed");
                Reply::error(ErrorKind::Failed, error_chain(&e))
            }
        };
        if self.state != CheckpointState::CopiedOut {
            // Closed before the dump: CRIU cannot dump fds of host directories.
            self.held.clear();
        }
        if !self.engine.prepared() {
            self.prepared.clear();
        }
        (reply, out)
    }

    /// Which successful Prepare was the last (see [`Controller::abandon_prepare`]).
    pub fn prepare_token(&self) -> u64 {
        self.prepare_token
    }

    /// Drops what Prepare `token` readied if it is still held: its connection closed
    /// before the CopyOut (a shim that went away must not leave a mapping of a host file
    /// and pinned memory for the next dump to meet).
    pub fn abandon_prepare(&mut self, token: u64) {
        if token == self.prepare_token && self.engine.prepared() {
            tracing::info!("the connection that prepared a copy-out closed; dropping it");
            self.engine.drop_prepared();
            self.prepared.clear();
        }
    }

    /// How many fds the controller holds (those of the last CopyOut, while CopiedOut,
    /// and of a Prepare while the engine holds it).
    pub fn held_fds(&self) -> usize {
        self.held.len() + self.prepared.len()
    }

    fn run(&self, req: &Request, fds: Vec<OwnedFd>) -> Result<(Outcome, Vec<OwnedFd>), E::Error> {
        let e = &self.engine;
        let outcome = match req {
            Request::Release { keep } => {
                let (report, fds) = e.release(*keep)?;
                return Ok((Outcome::Released(report), fds));
            }
            Request::Snapshot => {
                let (report, fds) = e.snapshot()?;
                return Ok((Outcome::Snapshotted(report), fds));
            }
            Request::Reattach { held } => Outcome::Reattached(e.reattach(held, fds)?),
            Request::WriteSnapshot { image_dir, parent } => {
                Outcome::SnapshotWritten(e.write_snapshot(image_dir, parent.as_deref())?)
            }
            Request::DropSnapshot => e.drop_snapshot().map(|()| Outcome::SnapshotDropped)?,
            Request::Prepare { image_dir, parent } => {
                Outcome::Prepared(e.prepare(image_dir, parent.as_deref())?)
            }
            Request::Freeze => e.freeze().map(|()| Outcome::Frozen)?,
            Request::CopyOut { image_dir, parent } => {
                Outcome::CopiedOut(e.copy_out(image_dir, parent.as_deref())?)
            }
            Request::Warm { image_dir, helpers } if helpers.is_empty() => {
                Outcome::Warmed(e.warm(image_dir.as_deref())?)
            }
            Request::Warm { helpers, .. } => {
                Outcome::Warmed(e.adopt_helpers(helpers.clone(), fds)?)
            }
            Request::Remap => Outcome::Remapped(e.remap()?),
            Request::CopyIn { image_dir } => Outcome::CopiedIn(e.copy_in(image_dir)?),
            Request::Thaw => e.thaw().map(|()| Outcome::Thawed)?,
            Request::Status => Outcome::Status(e.status(self.state)),
        };
        Ok((outcome, Vec::new()))
    }
}

/// `/proc/self/fd/<fd>/<rel>`, `rel` being relative and staying inside the directory
/// (`.` is the directory itself).
fn fd_path(fd: &OwnedFd, rel: &Path, what: &str) -> Result<PathBuf, ControlError> {
    use std::path::Component;
    let inside = rel
        .components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !inside {
        return Err(ControlError::BadFds(format!(
            "{what} {} must be a path inside the directory passed as an fd \
             (relative, no ..)",
            rel.display()
        )));
    }
    let base = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    Ok(rel
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .fold(base, |p, c| p.join(c)))
}

/// The request with its relative paths resolved against `fds`; unchanged without fds.
fn resolve_fd_paths(req: &Request, fds: &[OwnedFd]) -> Result<Request, ControlError> {
    if fds.is_empty() {
        return Ok(req.clone());
    }
    let bad = |msg: String| ControlError::BadFds(msg);
    if fds.len() > MAX_FDS {
        return Err(bad(format!("{} fds sent, at most {MAX_FDS}", fds.len())));
    }
    match (req, fds) {
        (
            Request::CopyOut { image_dir, parent }
            | Request::WriteSnapshot { image_dir, parent }
            | Request::Prepare { image_dir, parent },
            [dir, rest @ ..],
        ) => {
            let parent = match (parent, rest) {
                (None, []) => None,
                (Some(p), [pfd]) => Some(fd_path(pfd, p, "parent")?),
                (Some(p), []) if p.is_absolute() => Some(p.clone()),
                _ => {
                    return Err(bad(format!(
                        "{:?} with fds: send the parent's fd as the second fd, \
                         with a relative parent path",
                        req.verb()
                    )))
                }
            };
            let image_dir = fd_path(dir, image_dir, "image_dir")?;
            Ok(match req {
                Request::CopyOut { .. } => Request::CopyOut { image_dir, parent },
                Request::Prepare { .. } => Request::Prepare { image_dir, parent },
                _ => Request::WriteSnapshot { image_dir, parent },
            })
        }
        (Request::CopyIn { image_dir }, [dir]) => Ok(Request::CopyIn {
            image_dir: fd_path(dir, image_dir, "image_dir")?,
        }),
        (
            Request::Warm {
                image_dir: Some(image_dir),
                helpers,
            },
            [dir],
        ) if helpers.is_empty() => Ok(Request::Warm {
            image_dir: Some(fd_path(dir, image_dir, "image_dir")?),
            helpers: Vec::new(),
        }),
        (req, fds) => Err(bad(format!(
            "{:?} does not take {} fd(s) (CopyOut, WriteSnapshot and Prepare take 1 or 2, CopyIn and Warm with an image 1)",
            req.verb(),
            fds.len()
        ))),
    }
}

/// `err` and its sources, joined with ": ".
pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut msg = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}
