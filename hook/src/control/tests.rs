use super::*;
use std::fs::File;
use std::io::{self};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::driver::DevicePtr;
use crate::gate::GateState;
use crate::helper::AheadJob;
use crate::protocol::{
    CheckpointState, CopyInReport, CopyOutReport, ErrorKind, HookStatus, MemoryReport, Outcome,
    PrepareReport, Reply, Request, SnapshotReport, Verb, WarmReport,
};
use std::fmt;

/// An engine that counts calls and fails the verbs it is told to.
#[derive(Default)]
struct StubEngine {
    calls: Mutex<Vec<Verb>>,
    fail: Mutex<Option<Verb>>,
    /// The image paths CopyOut and CopyIn were given.
    paths: Mutex<Vec<PathBuf>>,
    /// Release with keep hands out this many memory fds (memfds).
    keep: usize,
    /// Identities of the fds a Release handed out, and how many a Reattach gave back
    /// (matched in order).
    kept: Mutex<Vec<Option<(u64, u64)>>>,
    reattached: Mutex<usize>,
    /// A Prepare held (until CopyOut, Thaw or Snapshot).
    prepared: Mutex<bool>,
    /// Helper sockets handed over by Warm, with their jobs.
    adopted: Mutex<Vec<(AheadJob, OwnedFd)>>,
}

#[derive(Debug)]
struct StubError(Verb);

impl fmt::Display for StubError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stub {:?} failed", self.0)
    }
}
impl std::error::Error for StubError {}

impl StubEngine {
    /// `n` memory fds (memfds) and a report holding `n` addresses.
    fn hand_out(&self, n: usize) -> (MemoryReport, Vec<OwnedFd>) {
        let fds: Vec<OwnedFd> = (0..n).map(|_| memfd()).collect();
        *self.kept.lock().unwrap() = fds
            .iter()
            .map(|f| crate::driver::fd_identity(f.as_fd()))
            .collect();
        let report = MemoryReport {
            held: (1..=n as u64).map(|i| i << 21).collect(),
            ..mem()
        };
        (report, fds)
    }

    /// Records the image paths a verb was given.
    fn took(&self, dir: &Path, parent: Option<&Path>) {
        let mut paths = self.paths.lock().unwrap();
        paths.push(dir.to_path_buf());
        paths.extend(parent.map(Path::to_path_buf));
    }

    fn copy_out_as(
        &self,
        verb: Verb,
        dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, StubError> {
        self.took(dir, parent);
        self.step(verb).map(|()| CopyOutReport {
            allocations: 1,
            bytes: 10,
            peak_staging_bytes: 0,
            seconds: 0.0,
            profile: Default::default(),
            copied_bytes: 10,
            zero_chunks: 0,
            parent_chunks: 0,
        })
    }

    fn step(&self, verb: Verb) -> Result<(), StubError> {
        self.calls.lock().unwrap().push(verb);
        match *self.fail.lock().unwrap() {
            Some(v) if v == verb => Err(StubError(verb)),
            _ => Ok(()),
        }
    }
}

fn mem() -> MemoryReport {
    MemoryReport {
        allocations: 1,
        bytes: 4096,
        held: Vec::new(),
    }
}

fn memfd() -> OwnedFd {
    nix::sys::memfd::memfd_create(c"stub", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap()
}

impl Engine for StubEngine {
    type Error = StubError;
    fn freeze(&self) -> Result<(), StubError> {
        self.step(Verb::Freeze)
    }
    fn copy_out(&self, dir: &Path, parent: Option<&Path>) -> Result<CopyOutReport, StubError> {
        *self.prepared.lock().unwrap() = false;
        self.copy_out_as(Verb::CopyOut, dir, parent)
    }
    fn release(&self, keep: bool) -> Result<(MemoryReport, Vec<OwnedFd>), StubError> {
        self.step(Verb::Release)?;
        Ok(self.hand_out(if keep { self.keep } else { 0 }))
    }
    fn snapshot(&self) -> Result<(SnapshotReport, Vec<OwnedFd>), StubError> {
        *self.prepared.lock().unwrap() = false;
        self.step(Verb::Snapshot)?;
        // The allocations' memory, then the snapshot's.
        let (release, fds) = self.hand_out(self.keep + 1);
        let report = SnapshotReport {
            release,
            snapshot_bytes: 4096,
            copy_seconds: 0.0,
        };
        Ok((report, fds))
    }
    fn write_snapshot(
        &self,
        dir: &Path,
        parent: Option<&Path>,
    ) -> Result<CopyOutReport, StubError> {
        self.copy_out_as(Verb::WriteSnapshot, dir, parent)
    }
    fn drop_snapshot(&self) -> Result<(), StubError> {
        self.step(Verb::DropSnapshot)
    }
    fn reattach(&self, held: &[DevicePtr], fds: Vec<OwnedFd>) -> Result<MemoryReport, StubError> {
        self.step(Verb::Reattach)?;
        let kept = self.kept.lock().unwrap();
        *self.reattached.lock().unwrap() = fds
            .iter()
            .zip(kept.iter())
            .filter(|(f, id)| crate::driver::fd_identity(f.as_fd()) == **id)
            .count();
        assert_eq!(held.len(), fds.len());
        Ok(mem())
    }
    fn remap(&self) -> Result<MemoryReport, StubError> {
        self.step(Verb::Remap).map(|()| mem())
    }
    fn copy_in(&self, dir: &Path) -> Result<CopyInReport, StubError> {
        self.paths.lock().unwrap().push(dir.to_path_buf());
        self.step(Verb::CopyIn).map(|()| CopyInReport {
            allocations: 1,
            bytes: 10,
            staging_bytes: 0,
            seconds: 0.0,
            profile: Default::default(),
            mapped_reads: false,
            helpers: Vec::new(),
        })
    }
    fn thaw(&self) -> Result<(), StubError> {
        *self.prepared.lock().unwrap() = false;
        self.step(Verb::Thaw)
    }
    fn prepare(&self, dir: &Path, parent: Option<&Path>) -> Result<PrepareReport, StubError> {
        self.took(dir, parent);
        *self.prepared.lock().unwrap() = false;
        self.step(Verb::Prepare)?;
        *self.prepared.lock().unwrap() = true;
        Ok(PrepareReport::default())
    }
    fn prepared(&self) -> bool {
        *self.prepared.lock().unwrap()
    }
    fn warm(&self, dir: Option<&Path>) -> Result<WarmReport, StubError> {
        if let Some(dir) = dir {
            self.paths.lock().unwrap().push(dir.to_path_buf());
        }
        self.step(Verb::Warm).map(|()| WarmReport::default())
    }
    fn drop_prepared(&self) {
        *self.prepared.lock().unwrap() = false;
    }
    fn adopt_helpers(
        &self,
        jobs: Vec<AheadJob>,
        socks: Vec<OwnedFd>,
    ) -> Result<WarmReport, StubError> {
        self.step(Verb::Warm)?;
        let report = WarmReport {
            helpers: jobs.len(),
            ahead_bytes: jobs.iter().map(|j| j.bytes).sum(),
        };
        self.adopted
            .lock()
            .unwrap()
            .extend(jobs.into_iter().zip(socks));
        Ok(report)
    }
    fn status(&self, state: CheckpointState) -> HookStatus {
        HookStatus {
            pid: 1,
            state,
            gate: GateState::Running,
            allocations: 0,
            bytes: 0,
            released: 0,
            snapshot_bytes: 0,
            unsupported: Vec::new(),
        }
    }
}

fn request(verb: Verb) -> Request {
    match verb {
        Verb::Freeze => Request::Freeze,
        Verb::CopyOut => Request::CopyOut {
            image_dir: "/img".into(),
            parent: None,
        },
        Verb::Release => Request::Release { keep: false },
        Verb::Remap => Request::Remap,
        Verb::Reattach => Request::Reattach { held: Vec::new() },
        Verb::CopyIn => Request::CopyIn {
            image_dir: "/img".into(),
        },
        Verb::Thaw => Request::Thaw,
        Verb::Status => Request::Status,
        Verb::Snapshot => Request::Snapshot,
        Verb::WriteSnapshot => Request::WriteSnapshot {
            image_dir: "/img".into(),
            parent: None,
        },
        Verb::DropSnapshot => Request::DropSnapshot,
        Verb::Prepare => Request::Prepare {
            image_dir: "/img".into(),
            parent: None,
        },
        Verb::Warm => Request::Warm {
            image_dir: None,
            helpers: Vec::new(),
        },
    }
}

const STATES: [CheckpointState; 10] = [
    CheckpointState::Running,
    CheckpointState::Frozen,
    CheckpointState::CopiedOut,
    CheckpointState::Released,
    CheckpointState::Remapped,
    CheckpointState::CopiedIn,
    CheckpointState::Reattached,
    CheckpointState::Snapshotted,
    CheckpointState::SnapshotReattached,
    CheckpointState::WritePending,
];
const ALL_VERBS: [Verb; 13] = [
    Verb::Freeze,
    Verb::CopyOut,
    Verb::Release,
    Verb::Remap,
    Verb::Reattach,
    Verb::CopyIn,
    Verb::Thaw,
    Verb::Status,
    Verb::Snapshot,
    Verb::WriteSnapshot,
    Verb::DropSnapshot,
    Verb::Prepare,
    Verb::Warm,
];

#[test]
fn transition_table_over_every_state_and_verb() {
    use CheckpointState as S;
    let legal = [
        (S::Running, Verb::Freeze, S::Frozen),
        (S::Frozen, Verb::CopyOut, S::CopiedOut),
        (S::CopiedOut, Verb::Release, S::Released),
        (S::Released, Verb::Remap, S::Remapped),
        (S::Released, Verb::Reattach, S::Reattached),
        (S::Reattached, Verb::Thaw, S::Running),
        (S::Remapped, Verb::CopyIn, S::CopiedIn),
        (S::CopiedIn, Verb::Thaw, S::Running),
        (S::Frozen, Verb::Thaw, S::Running),
        (S::CopiedOut, Verb::Thaw, S::Running),
        (S::Frozen, Verb::Snapshot, S::Snapshotted),
        (S::Snapshotted, Verb::Reattach, S::SnapshotReattached),
        (S::Snapshotted, Verb::Remap, S::Remapped),
        (S::SnapshotReattached, Verb::Thaw, S::WritePending),
        (S::WritePending, Verb::WriteSnapshot, S::Running),
        (S::WritePending, Verb::DropSnapshot, S::Running),
        (S::Running, Verb::Prepare, S::Running),
        (S::Released, Verb::Warm, S::Released),
        (S::Snapshotted, Verb::Warm, S::Snapshotted),
        (S::Remapped, Verb::Warm, S::Remapped),
    ];
    for state in STATES {
        for verb in ALL_VERBS {
            let want = if verb == Verb::Status {
                Some(state)
            } else {
                legal
                    .iter()
                    .find(|(s, v, _)| *s == state && *v == verb)
                    .map(|(_, _, to)| *to)
            };
            let got = state.on(verb);
            match want {
                Some(to) => assert_eq!(got.unwrap(), to, "{state:?} {verb:?}"),
                None => assert!(
                    matches!(got, Err(ControlError::IllegalInState { .. })),
                    "{state:?} {verb:?} should be illegal"
                ),
            }
        }
    }
}

#[test]
fn controller_runs_the_full_sequence() {
    let mut c = Controller::new(StubEngine::default());
    for verb in [
        Verb::Freeze,
        Verb::CopyOut,
        Verb::Release,
        Verb::Remap,
        Verb::CopyIn,
        Verb::Thaw,
    ] {
        assert!(matches!(c.handle(&request(verb)), Reply::Ok(_)), "{verb:?}");
    }
    assert_eq!(c.state(), CheckpointState::Running);
    assert_eq!(c.engine().calls.lock().unwrap().len(), 6);
}

#[test]
fn illegal_verb_changes_nothing_and_does_not_reach_the_engine() {
    let mut c = Controller::new(StubEngine::default());
    let Reply::Error(e) = c.handle(&Request::Remap) else {
        panic!("Remap while running accepted");
    };
    assert_eq!(e.kind, ErrorKind::IllegalInState);
    assert!(e.message.contains("Remap"), "{}", e.message);
    assert_eq!(c.state(), CheckpointState::Running);
    assert!(c.engine().calls.lock().unwrap().is_empty());
}

#[test]
fn failed_verb_keeps_the_state_and_can_be_retried() {
    let mut c = Controller::new(StubEngine::default());
    c.handle(&Request::Freeze);
    c.handle(&request(Verb::CopyOut));
    *c.engine().fail.lock().unwrap() = Some(Verb::Release);
    let Reply::Error(e) = c.handle(&Request::Release { keep: false }) else {
        panic!("failure not reported");
    };
    assert_eq!(e.kind, ErrorKind::Failed);
    assert!(e.message.contains("stub Release failed"));
    assert_eq!(c.state(), CheckpointState::CopiedOut);
    *c.engine().fail.lock().unwrap() = None;
    assert!(matches!(
        c.handle(&Request::Release { keep: false }),
        Reply::Ok(_)
    ));
    assert_eq!(c.state(), CheckpointState::Released);
}

type Served = (
    tempfile::TempDir,
    PathBuf,
    Arc<Mutex<Controller<StubEngine>>>,
);

/// The paths the stub engine was given, in order.
fn engine_paths(controller: &Mutex<Controller<StubEngine>>) -> Vec<PathBuf> {
    controller
        .lock()
        .unwrap()
        .engine()
        .paths
        .lock()
        .unwrap()
        .clone()
}

fn serve_stub() -> Served {
    serve_stub_with(StubEngine::default())
}

fn serve_stub_with(engine: StubEngine) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_path(dir.path(), 42);
    let server = ControlServer::bind(&path).unwrap();
    let controller = Arc::new(Mutex::new(Controller::new(engine)));
    server.spawn(controller.clone()).unwrap();
    (dir, path, controller)
}

fn error_kind(reply: Reply) -> ErrorKind {
    match reply {
        Reply::Error(e) => e.kind,
        Reply::Ok(o) => panic!("expected an error, got {o:?}"),
    }
}

fn frame(bytes: &[u8]) -> Vec<u8> {
    let mut f = (bytes.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(bytes);
    f
}

#[test]
fn socket_bad_messages_get_error_replies_and_change_nothing() {
    let (_dir, path, controller) = serve_stub();
    let mut client = ControlClient::connect(&path).unwrap();
    let garbage = client.call_raw(&frame(b"\x00\xffnot json")).unwrap();
    assert_eq!(error_kind(garbage), ErrorKind::BadRequest);
    let unknown = client.call_raw(&frame(br#"{"verb":"Explode"}"#)).unwrap();
    assert_eq!(error_kind(unknown), ErrorKind::UnknownVerb);
    let order = client.call(&Request::Remap).unwrap();
    assert_eq!(error_kind(order), ErrorKind::IllegalInState);
    // The same connection still works, and nothing moved.
    let Reply::Ok(Outcome::Status(status)) = client.call(&Request::Status).unwrap() else {
        panic!("no status");
    };
    assert_eq!(status.state, CheckpointState::Running);

    let mut big = ControlClient::connect(&path).unwrap();
    let too_large = big.call_raw(&(1u32 << 30).to_be_bytes()).unwrap();
    assert_eq!(error_kind(too_large), ErrorKind::FrameTooLarge);
    assert!(
        big.call(&Request::Status).is_err(),
        "connection closed after it"
    );

    // A client that hangs up mid-frame does not hurt the server.
    drop(
        ControlClient::connect(&path)
            .unwrap()
            .stream
            .shutdown(std::net::Shutdown::Both),
    );
    let mut again = ControlClient::connect(&path).unwrap();
    assert!(matches!(
        again.call(&Request::Freeze).unwrap(),
        Reply::Ok(Outcome::Frozen)
    ));
    let c = controller.lock().unwrap();
    assert_eq!(c.state(), CheckpointState::Frozen);
    assert_eq!(*c.engine().calls.lock().unwrap(), vec![Verb::Freeze]);
}

#[test]
fn bind_replaces_a_stale_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_path(dir.path(), 7);
    drop(ControlServer::bind(&path).unwrap());
    assert!(path.exists());
    let server = ControlServer::bind(&path).unwrap();
    assert_eq!(server.path(), path);
}

// --- directories passed as fds ---

/// A pipe whose write end goes to the hook: the read end sees EOF once every copy of
/// the write end is closed, which tells whether the hook still holds the fd.
fn pipe() -> (File, OwnedFd) {
    let (r, w) = nix::unistd::pipe().unwrap();
    nix::fcntl::fcntl(
        &r,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .unwrap();
    (File::from(r), w)
}

/// Whether someone still holds the pipe's write end.
fn held(read_end: &mut File) -> bool {
    use std::io::Read;
    match read_end.read(&mut [0u8; 1]) {
        Ok(0) => false,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => true,
        other => panic!("unexpected pipe read {other:?}"),
    }
}

fn ok(reply: Reply) -> Outcome {
    match reply {
        Reply::Ok(o) => o,
        Reply::Error(e) => panic!("{e:?}"),
    }
}

#[test]
fn copy_out_by_fd_resolves_inside_the_directory_and_holds_it_while_copied_out() {
    let (_sock, path, controller) = serve_stub();
    let images = tempfile::tempdir().unwrap();
    let dir = File::open(images.path()).unwrap();
    let mut client = ControlClient::connect(&path).unwrap();
    ok(client.call(&Request::Freeze).unwrap());
    ok(client.copy_out_fd(&dir, Path::new("1234"), None).unwrap());
    drop(dir);
    let got = engine_paths(&controller)[0].clone();
    assert!(
        got.starts_with("/proc/self/fd/") && got.ends_with("1234"),
        "{got:?}"
    );
    // The hook's path reaches the client's directory (held: the client closed its own).
    std::fs::create_dir(&got).unwrap();
    assert!(images.path().join("1234").is_dir());
    assert_eq!(controller.lock().unwrap().held_fds(), 1);
    ok(client.call(&Request::Release { keep: false }).unwrap());
    // (That it is closed is shown with a pipe below: fd numbers are reused by other tests.)
    assert_eq!(controller.lock().unwrap().held_fds(), 0);
}

#[test]
fn copy_out_fds_are_closed_by_release_or_thaw_and_after_a_failure() {
    let (_sock, path, controller) = serve_stub();
    let mut client = ControlClient::connect(&path).unwrap();
    let copy_out = |client: &mut ControlClient, w: &OwnedFd| {
        client.call_with_fds(
            &Request::CopyOut {
                image_dir: "img".into(),
                parent: None,
            },
            &[w.as_fd()],
        )
    };
    // Thaw from CopiedOut closes them.
    ok(client.call(&Request::Freeze).unwrap());
    let (mut r, w) = pipe();
    ok(copy_out(&mut client, &w).unwrap());
    drop(w);
    assert!(held(&mut r));
    ok(client.call(&Request::Thaw).unwrap());
    assert!(!held(&mut r));
    // A failed CopyOut closes them at once.
    ok(client.call(&Request::Freeze).unwrap());
    *controller.lock().unwrap().engine().fail.lock().unwrap() = Some(Verb::CopyOut);
    let (mut r, w) = pipe();
    assert_eq!(
        error_kind(copy_out(&mut client, &w).unwrap()),
        ErrorKind::Failed
    );
    drop(w);
    assert!(!held(&mut r));
    assert_eq!(controller.lock().unwrap().state(), CheckpointState::Frozen);
}

/// A restore's Warm hands over helpers the shim started: their sockets follow the frame,
/// one per job, and the engine gets each with its job. A Warm naming both an image and
/// helpers, or with a socket missing, is refused.
#[test]
fn warm_hands_over_the_shims_helpers_with_their_jobs() {
    let (_sock, path, controller) = serve_stub();
    let mut client = ControlClient::connect(&path).unwrap();
    for req in [Verb::Freeze, Verb::CopyOut, Verb::Release] {
        ok(client.call(&request(req)).unwrap());
    }
    let job = |bytes| AheadJob {
        image_id: "ab".repeat(32),
        chunks: vec![(0, 1), (0, 2)],
        allocs: vec![(1 << 21, 4 << 20)],
        bytes,
    };
    let (mut r1, w1) = pipe();
    let (mut r2, w2) = pipe();
    let warmed = ok(client
        .warm_with_helpers(vec![job(5), job(7)], &[w1.as_fd(), w2.as_fd()])
        .unwrap());
    assert_eq!(
        warmed,
        Outcome::Warmed(WarmReport {
            helpers: 2,
            ahead_bytes: 12
        })
    );
    drop((w1, w2));
    // The engine holds the sockets (the helpers' ends stay open) with their jobs.
    assert!(held(&mut r1) && held(&mut r2));
    let adopted = controller
        .lock()
        .unwrap()
        .engine()
        .adopted
        .lock()
        .unwrap()
        .len();
    assert_eq!(adopted, 2);
    assert_eq!(
        controller.lock().unwrap().engine().adopted.lock().unwrap()[1].0,
        job(7)
    );
    // An image and helpers together, or a job without its socket: refused.
    let mut c = controller.lock().unwrap();
    let both = Request::Warm {
        image_dir: Some("img".into()),
        helpers: vec![job(1)],
    };
    let (reply, _) = c.exchange(&both, vec![memfd()]);
    assert_eq!(error_kind(reply), ErrorKind::BadRequest);
    let short = Request::Warm {
        image_dir: None,
        helpers: vec![job(1), job(2)],
    };
    let (reply, _) = c.exchange(&short, vec![memfd()]);
    assert_eq!(error_kind(reply), ErrorKind::BadRequest);
    assert_eq!(c.engine().adopted.lock().unwrap().len(), 2);
}

#[test]
fn copy_in_by_fd_closes_the_fd_after_the_verb() {
    let (_sock, path, controller) = serve_stub();
    let mut client = ControlClient::connect(&path).unwrap();
    for req in [Verb::Freeze, Verb::CopyOut, Verb::Release] {
        ok(client.call(&request(req)).unwrap());
    }
    // Warm with the image by fd too (the engine opens what it needs during the verb).
    let (mut r, w) = pipe();
    let warm = Request::Warm {
        image_dir: Some("img".into()),
        helpers: Vec::new(),
    };
    ok(client.call_with_fds(&warm, &[w.as_fd()]).unwrap());
    drop(w);
    assert!(!held(&mut r));
    let warmed = engine_paths(&controller).pop().unwrap();
    assert!(
        warmed.starts_with("/proc/self/fd/") && warmed.ends_with("img"),
        "{warmed:?}"
    );
    ok(client.call(&request(Verb::Remap)).unwrap());
    let (mut r, w) = pipe();
    ok(client
        .call_with_fds(
            &Request::CopyIn {
                image_dir: ".".into(),
            },
            &[w.as_fd()],
        )
        .unwrap());
    drop(w);
    assert!(!held(&mut r));
    let c = controller.lock().unwrap();
    let got = c.engine().paths.lock().unwrap().last().unwrap().clone();
    let fd: i32 = got
        .strip_prefix("/proc/self/fd")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(fd > 2, "{got:?}");
    assert_eq!(c.state(), CheckpointState::CopiedIn);
}

#[test]
fn misused_fds_are_refused_and_closed() {
    let (_sock, path, controller) = serve_stub();
    let mut client = ControlClient::connect(&path).unwrap();
    let (mut r, w) = pipe();
    let reply = client
        .call_with_fds(&Request::Freeze, &[w.as_fd()])
        .unwrap();
    assert_eq!(error_kind(reply), ErrorKind::BadRequest);
    ok(client.call(&Request::Freeze).unwrap());
    let bad_paths = ["/abs/img", "../escape", "a/../../b"];
    for p in bad_paths {
        let req = Request::CopyOut {
            image_dir: p.into(),
            parent: None,
        };
        let reply = client.call_with_fds(&req, &[w.as_fd()]).unwrap();
        assert_eq!(error_kind(reply), ErrorKind::BadRequest, "{p}");
    }
    let req = request(Verb::CopyOut);
    let three = [w.as_fd(), w.as_fd(), w.as_fd()];
    assert_eq!(
        error_kind(client.call_with_fds(&req, &three).unwrap()),
        ErrorKind::BadRequest
    );
    // A parent path without the parent's fd.
    let req = Request::CopyOut {
        image_dir: "img".into(),
        parent: Some("prev".into()),
    };
    assert_eq!(
        error_kind(client.call_with_fds(&req, &[w.as_fd()]).unwrap()),
        ErrorKind::BadRequest
    );
    drop(w);
    assert!(!held(&mut r));
    let c = controller.lock().unwrap();
    assert_eq!(c.state(), CheckpointState::Frozen);
    assert_eq!(*c.engine().calls.lock().unwrap(), vec![Verb::Freeze]);
}

/// A directory for images holding a parent image `prev`; the directory and `prev` opened.
fn images_with_parent() -> (tempfile::TempDir, File, File) {
    let images = tempfile::tempdir().unwrap();
    std::fs::create_dir(images.path().join("prev")).unwrap();
    let dir = File::open(images.path()).unwrap();
    let parent = File::open(images.path().join("prev")).unwrap();
    (images, dir, parent)
}

#[test]
fn a_parent_by_fd_is_resolved_against_the_second_fd() {
    let (_sock, path, controller) = serve_stub();
    let mut client = ControlClient::connect(&path).unwrap();
    let (images, dir, parent) = images_with_parent();
    ok(client.call(&Request::Freeze).unwrap());
    ok(client
        .copy_out_fd(&dir, Path::new("next"), Some(&parent))
        .unwrap());
    let c = controller.lock().unwrap();
    let paths = c.engine().paths.lock().unwrap().clone();
    assert_eq!(paths.len(), 2);
    assert!(paths[0].ends_with("next"));
    // The parent is the second fd itself.
    assert_eq!(
        std::fs::canonicalize(&paths[1]).unwrap(),
        std::fs::canonicalize(images.path().join("prev")).unwrap()
    );
    assert_eq!(c.held_fds(), 2);
}

#[test]
fn a_prepare_holds_its_fds_until_the_copy_out_or_a_thaw() {
    let (_sock, path, controller) = serve_stub();
    let mut client = ControlClient::connect(&path).unwrap();
    let (_images, dir, parent) = images_with_parent();
    let held = || controller.lock().unwrap().held_fds();
    ok(client
        .prepare_fd(&dir, Path::new("next"), Some(&parent))
        .unwrap());
    assert_eq!(held(), 2, "the prepared image lives under its fds");
    ok(client.call(&Request::Freeze).unwrap());
    assert_eq!(held(), 2);
    ok(client.copy_out_fd(&dir, Path::new("next"), None).unwrap());
    assert_eq!(held(), 1, "the CopyOut's own fd only");
    {
        let c = controller.lock().unwrap();
        let paths = c.engine().paths.lock().unwrap().clone();
        assert!(paths[0].ends_with("next") && paths[2].ends_with("next"));
    }
    ok(client.call(&Request::Thaw).unwrap());
    assert_eq!(held(), 0);

    // Dropped by a Thaw; a failed Prepare holds nothing; Prepare only while Running.
    ok(client.prepare_fd(&dir, Path::new("x"), None).unwrap());
    assert_eq!(held(), 1);
    ok(client.call(&Request::Freeze).unwrap());
    ok(client.call(&Request::Thaw).unwrap());
    assert_eq!(held(), 0);
    *controller.lock().unwrap().engine().fail.lock().unwrap() = Some(Verb::Prepare);
    assert!(matches!(
        client.prepare_fd(&dir, Path::new("y"), None).unwrap(),
        Reply::Error(_)
    ));
    assert_eq!(held(), 0);
    *controller.lock().unwrap().engine().fail.lock().unwrap() = None;
    ok(client.call(&Request::Freeze).unwrap());
    let Reply::Error(e) = client.prepare_fd(&dir, Path::new("z"), None).unwrap() else {
        panic!("Prepare while Frozen accepted");
    };
    assert_eq!(e.kind, ErrorKind::IllegalInState);
    assert_eq!(held(), 0);
}

#[test]
fn a_prepare_whose_connection_closes_is_dropped() {
    let (_sock, path, controller) = serve_stub();
    let (_images, dir, _) = images_with_parent();
    let mut first = ControlClient::connect(&path).unwrap();
    ok(first.prepare_fd(&dir, Path::new("a"), None).unwrap());
    // A later Prepare on another connection replaces it: closing the first keeps it.
    let mut second = ControlClient::connect(&path).unwrap();
    ok(second.prepare_fd(&dir, Path::new("b"), None).unwrap());
    drop(first);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(controller.lock().unwrap().held_fds(), 1);
    assert!(controller.lock().unwrap().engine().prepared());
    drop(second);
    let gone = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let c = controller.lock().unwrap();
        !c.engine().prepared() && c.held_fds() == 0
    });
    assert!(
        gone,
        "the prepared copy-out of a closed connection is dropped"
    );
}

/// The whole fast path over the socket with images passed as fds, as the shim does.
#[test]
fn fast_path_round_trip_with_images_by_fd() {
    use crate::driver::{DriverCall, VmmDriver};
    use crate::fake::FakeDriver;
    use crate::fastpath::FastPathOptions;
    use crate::hook::Hook;

    let driver = Arc::new(FakeDriver::default());
    let hook = Hook::new(driver.clone(), FastPathOptions::default()).unwrap();
    let data: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 70_000]).collect();
    let vas: Vec<_> = data
        .iter()
        .map(|d| {
            let va = hook.alloc(d.len() as u64).unwrap();
            driver.copy_from_host(va, d).unwrap();
            va
        })
        .collect();
    let sockets = tempfile::tempdir().unwrap();
    let mut client = ControlClient::connect(&hook.serve(sockets.path()).unwrap()).unwrap();
    let images = tempfile::tempdir().unwrap();
    let dir = File::open(images.path()).unwrap();
    ok(client.call(&Request::Freeze).unwrap());
    ok(client.copy_out_fd(&dir, Path::new("77"), None).unwrap());
    // A release failing half-way is undone from the image behind the held fd.
    driver.fail_nth(DriverCall::Release, 1);
    assert_eq!(
        error_kind(client.call(&Request::Release { keep: false }).unwrap()),
        ErrorKind::Failed
    );
    ok(client.call(&Request::Release { keep: false }).unwrap());
    // (The failed release's handle is leaked by the fake, so physical bytes stay > 0.)
    let Outcome::Status(status) = ok(client.call(&Request::Status).unwrap()) else {
        panic!("no status");
    };
    assert_eq!(
        (status.state, status.released),
        (CheckpointState::Released, 3)
    );
    ok(client.call(&Request::Remap).unwrap());
    let image = File::open(images.path().join("77")).unwrap();
    let Outcome::CopiedIn(report) = ok(client.copy_in_fd(&image).unwrap()) else {
        panic!("not a copy-in report");
    };
    assert_eq!(report.bytes, 3 * 70_000);
    ok(client.call(&Request::Thaw).unwrap());
    for (va, want) in vas.iter().zip(&data) {
        let mut got = vec![0u8; want.len()];
        driver.copy_to_host(*va, &mut got).unwrap();
        assert!(
            got == *want,
            "contents of {va:#x} differ after the round trip"
        );
    }
    assert!(gpu_state::image::ImageReader::open(&images.path().join("77")).is_ok());
}

#[test]
fn kept_memory_fds_travel_in_batches_and_come_back() {
    // More fds than one batch carries, and not a multiple of it.
    let n = 2 * crate::control::wire::FD_BATCH + 44;
    let (_sock, path, controller) = serve_stub_with(StubEngine {
        keep: n,
        ..StubEngine::default()
    });
    let mut client = ControlClient::connect(&path).unwrap();
    ok(client.call(&Request::Freeze).unwrap());
    ok(client.call(&request(Verb::CopyOut)).unwrap());
    let (reply, fds) = client.release(true).unwrap();
    let Reply::Ok(Outcome::Released(report)) = reply else {
        panic!("{reply:?}");
    };
    assert_eq!((report.held.len(), fds.len()), (n, n));
    // The stream is still at a frame boundary.
    assert!(matches!(
        client.call(&Request::Status).unwrap(),
        Reply::Ok(Outcome::Status(_))
    ));
    ok(client.reattach(&report.held, &fds).unwrap());
    assert_eq!(
        *controller
            .lock()
            .unwrap()
            .engine()
            .reattached
            .lock()
            .unwrap(),
        n
    );
    assert_eq!(
        controller.lock().unwrap().state(),
        CheckpointState::Reattached
    );
    ok(client.call(&Request::Thaw).unwrap());
}

#[test]
fn release_without_keep_sends_no_fds_and_call_drops_kept_ones() {
    let (_sock, path, _controller) = serve_stub_with(StubEngine {
        keep: 3,
        ..StubEngine::default()
    });
    let mut client = ControlClient::connect(&path).unwrap();
    ok(client.call(&Request::Freeze).unwrap());
    ok(client.call(&request(Verb::CopyOut)).unwrap());
    let (_, fds) = client.release(false).unwrap();
    assert!(fds.is_empty());
    ok(client.call(&Request::Remap).unwrap());
    ok(client.call(&request(Verb::CopyIn)).unwrap());
    ok(client.call(&Request::Thaw).unwrap());
    // A plain call of Release with keep reads (and closes) the fds: the next reply is
    // still in step.
    ok(client.call(&Request::Freeze).unwrap());
    ok(client.call(&request(Verb::CopyOut)).unwrap());
    ok(client.call(&Request::Release { keep: true }).unwrap());
    assert!(matches!(
        client.call(&Request::Status).unwrap(),
        Reply::Ok(Outcome::Status(_))
    ));
}

#[test]
fn reattach_with_the_wrong_number_of_fds_is_refused() {
    let mut c = Controller::new(StubEngine {
        keep: 2,
        ..StubEngine::default()
    });
    c.handle(&Request::Freeze);
    c.handle(&request(Verb::CopyOut));
    let (_, fds) = c.exchange(&Request::Release { keep: true }, Vec::new());
    assert_eq!(fds.len(), 2);
    let req = Request::Reattach {
        held: vec![1 << 21, 2 << 21, 3 << 21],
    };
    let (reply, _) = c.exchange(&req, fds);
    let Reply::Error(e) = reply else {
        panic!("accepted: {reply:?}");
    };
    assert_eq!(e.kind, ErrorKind::BadRequest);
    assert_eq!(c.state(), CheckpointState::Released);
    assert!(!c.engine().calls.lock().unwrap().contains(&Verb::Reattach));
}

#[test]
fn a_snapshot_sends_the_memory_and_the_snapshot_and_is_written_by_fd_after_the_thaw() {
    let (_sock, path, controller) = serve_stub_with(StubEngine {
        keep: 5,
        ..StubEngine::default()
    });
    let state = || controller.lock().unwrap().state();
    let mut client = ControlClient::connect(&path).unwrap();
    ok(client.call(&Request::Freeze).unwrap());
    let (reply, fds) = client.snapshot().unwrap();
    let Reply::Ok(Outcome::Snapshotted(report)) = reply else {
        panic!("{reply:?}");
    };
    assert_eq!((report.release.held.len(), fds.len()), (6, 6));
    assert_eq!(state(), CheckpointState::Snapshotted);
    // Not thawed without the memory, not written before it is back.
    for verb in [Verb::Thaw, Verb::WriteSnapshot, Verb::Freeze] {
        let reply = client.call(&request(verb)).unwrap();
        assert_eq!(error_kind(reply), ErrorKind::IllegalInState, "{verb:?}");
    }
    ok(client.reattach(&report.release.held, &fds).unwrap());
    assert_eq!(state(), CheckpointState::SnapshotReattached);
    ok(client.call(&Request::Thaw).unwrap());
    assert_eq!(state(), CheckpointState::WritePending);
    // No new checkpoint while the snapshot waits.
    let reply = client.call(&Request::Freeze).unwrap();
    assert_eq!(error_kind(reply), ErrorKind::IllegalInState);
    let images = tempfile::tempdir().unwrap();
    let dir = File::open(images.path()).unwrap();
    let parent = File::open(images.path()).unwrap();
    ok(client
        .write_snapshot_fd(&dir, Path::new("7"), Some(&parent))
        .unwrap());
    let paths = engine_paths(&controller);
    assert!(
        paths[0].starts_with("/proc/self/fd/") && paths[0].ends_with("7"),
        "{paths:?}"
    );
    assert_eq!(paths.len(), 2, "the parent too: {paths:?}");
    assert_eq!(state(), CheckpointState::Running);
    assert_eq!(controller.lock().unwrap().held_fds(), 0);
    // A failed write keeps the snapshot for DropSnapshot.
    ok(client.call(&Request::Freeze).unwrap());
    let (reply, fds) = client.snapshot().unwrap();
    let Reply::Ok(Outcome::Snapshotted(report)) = reply else {
        panic!("{reply:?}");
    };
    ok(client.reattach(&report.release.held, &fds).unwrap());
    ok(client.call(&Request::Thaw).unwrap());
    *controller.lock().unwrap().engine().fail.lock().unwrap() = Some(Verb::WriteSnapshot);
    let reply = client
        .write_snapshot_fd(&dir, Path::new("8"), None)
        .unwrap();
    assert_eq!(error_kind(reply), ErrorKind::Failed);
    assert_eq!(state(), CheckpointState::WritePending);
    ok(client.call(&Request::DropSnapshot).unwrap());
    assert_eq!(state(), CheckpointState::Running);
}
