use super::*;
use crate::gate::GateState;
use std::fmt;

/// An engine that counts calls and fails the verbs it is told to.
#[derive(Default)]
struct StubEngine {
    calls: Mutex<Vec<Verb>>,
    fail: Mutex<Option<Verb>>,
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
    }
}

impl Engine for StubEngine {
    type Error = StubError;
    fn freeze(&self) -> Result<(), StubError> {
        self.step(Verb::Freeze)
    }
    fn copy_out(&self, _: &Path, _: Option<&Path>) -> Result<CopyOutReport, StubError> {
        self.step(Verb::CopyOut).map(|()| CopyOutReport {
            allocations: 1,
            bytes: 10,
            peak_staging_bytes: 0,
            seconds: 0.0,
        })
    }
    fn release(&self) -> Result<MemoryReport, StubError> {
        self.step(Verb::Release).map(|()| mem())
    }
    fn remap(&self) -> Result<MemoryReport, StubError> {
        self.step(Verb::Remap).map(|()| mem())
    }
    fn copy_in(&self, _: &Path) -> Result<CopyInReport, StubError> {
        self.step(Verb::CopyIn).map(|()| CopyInReport {
            allocations: 1,
            bytes: 10,
            staging_bytes: 0,
            seconds: 0.0,
        })
    }
    fn thaw(&self) -> Result<(), StubError> {
        self.step(Verb::Thaw)
    }
    fn status(&self, state: CheckpointState) -> HookStatus {
        HookStatus {
            pid: 1,
            state,
            gate: GateState::Running,
            allocations: 0,
            bytes: 0,
            released: 0,
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
        Verb::Release => Request::Release,
        Verb::Remap => Request::Remap,
        Verb::CopyIn => Request::CopyIn {
            image_dir: "/img".into(),
        },
        Verb::Thaw => Request::Thaw,
        Verb::Status => Request::Status,
    }
}

const STATES: [CheckpointState; 6] = [
    CheckpointState::Running,
    CheckpointState::Frozen,
    CheckpointState::CopiedOut,
    CheckpointState::Released,
    CheckpointState::Remapped,
    CheckpointState::CopiedIn,
];
const ALL_VERBS: [Verb; 7] = [
    Verb::Freeze,
    Verb::CopyOut,
    Verb::Release,
    Verb::Remap,
    Verb::CopyIn,
    Verb::Thaw,
    Verb::Status,
];

#[test]
fn transition_table_over_every_state_and_verb() {
    use CheckpointState as S;
    let legal = [
        (S::Running, Verb::Freeze, S::Frozen),
        (S::Frozen, Verb::CopyOut, S::CopiedOut),
        (S::CopiedOut, Verb::Release, S::Released),
        (S::Released, Verb::Remap, S::Remapped),
        (S::Remapped, Verb::CopyIn, S::CopiedIn),
        (S::CopiedIn, Verb::Thaw, S::Running),
        (S::Frozen, Verb::Thaw, S::Running),
        (S::CopiedOut, Verb::Thaw, S::Running),
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
    let Reply::Error(e) = c.handle(&Request::Release) else {
        panic!("failure not reported");
    };
    assert_eq!(e.kind, ErrorKind::Failed);
    assert!(e.message.contains("stub Release failed"));
    assert_eq!(c.state(), CheckpointState::CopiedOut);
    *c.engine().fail.lock().unwrap() = None;
    assert!(matches!(c.handle(&Request::Release), Reply::Ok(_)));
    assert_eq!(c.state(), CheckpointState::Released);
}

fn serve_stub() -> (
    tempfile::TempDir,
    PathBuf,
    Arc<Mutex<Controller<StubEngine>>>,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_path(dir.path(), 42);
    let server = ControlServer::bind(&path).unwrap();
    let controller = Arc::new(Mutex::new(Controller::new(StubEngine::default())));
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
