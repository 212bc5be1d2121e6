//! libgpucr_hook.so preloaded into a real process (tests/cuda_app.c, compiled
//! with `cc` here) whose libcuda.so.1 is tests/fake-libcuda: the program reaches the
//! driver through cuGetProcAddress and through dlsym like the CUDA runtime and PyTorch
//! do, and the test drives the hook's control socket through a whole fast-path cycle.
//!
//! The two libraries are taken from this test binary's target directory (or
//! `GPUCR_SHIM_DIR`, where CI builds the workspace), else built with cargo.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gpucr_hook::control::{socket_path, ControlClient};
use gpucr_hook::gate::GateState;
use gpucr_hook::protocol::{CheckpointState, Outcome, Reply, Request};

const WAIT: Duration = Duration::from_secs(20);

/// `<target>/<profile>` of this test binary (`<target>/<profile>/deps/<test>`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// `file` from this profile's directory or `GPUCR_SHIM_DIR`, else built from `package`.
fn artifact(file: &str, package: &str) -> PathBuf {
    let profile = profile_dir();
    let mut dirs = vec![profile.clone()];
    dirs.extend(std::env::var_os("GPUCR_SHIM_DIR").map(PathBuf::from));
    if let Some(found) = dirs.iter().map(|d| d.join(file)).find(|p| p.is_file()) {
        return found;
    }
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-p", package])
        .env("CARGO_TARGET_DIR", profile.parent().unwrap())
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if profile.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("run cargo build");
    let built = profile.join(file);
    assert!(
        status.success() && built.is_file(),
        "building {package} gave no {}",
        built.display()
    );
    built
}

/// The fake driver installed as libcuda.so.1, the hook, and the compiled program.
struct Setup {
    _dir: tempfile::TempDir,
    lib_dir: PathBuf,
    hook: PathBuf,
    app: PathBuf,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let fake = artifact("libcuda.so", "fake-libcuda");
        let hook = artifact("libgpucr_hook.so", "gpucr-hook-preload");
        let dir = tempfile::Builder::new()
            .prefix("gpucr-interpose-")
            .tempdir()
            .unwrap();
        let lib_dir = dir.path().join("lib");
        std::fs::create_dir(&lib_dir).unwrap();
        std::fs::copy(&fake, lib_dir.join("libcuda.so.1")).unwrap();
        let app = dir.path().join("cuda_app");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_app.c");
        let out = Command::new("cc")
            .args(["-O1", "-Wall", "-o"])
            .arg(&app)
            .arg(&src)
            .arg("-ldl")
            .output()
            .expect("run cc (a C compiler is needed for this test)");
        assert!(
            out.status.success(),
            "cc failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Setup {
            _dir: dir,
            lib_dir,
            hook,
            app,
        }
    })
}

/// One running cuda_app, its stdout lines arriving on a channel.
struct App {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    /// Lines printed before "ready" (the `sym` lines).
    syms: Vec<String>,
    /// The two allocations: (address, size).
    allocs: [(u64, u64); 2],
    dir: tempfile::TempDir,
}

impl App {
    fn start(hooked: bool, mode: &str) -> App {
        let s = setup();
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(&s.app);
        cmd.arg(mode)
            .env("LD_LIBRARY_PATH", &s.lib_dir)
            .env("LD_PRELOAD", &s.hook)
            .env("GPUCR_FAKE_CUDA_MEM_LOG", dir.path().join("mem.log"))
            .env("GPUCR_HOOK_LOG", "1")
            .env_remove("GPUCR_HOOK_SOCKET_DIR")
            .env_remove("GPUCR_HOOK_DISABLE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if hooked {
            cmd.env("GPUCR_HOOK_SOCKET_DIR", dir.path());
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut app = App {
            child,
            stdin,
            lines,
            syms: Vec::new(),
            allocs: [(0, 0); 2],
            dir,
        };
        loop {
            let line = app.next_line(WAIT).expect("cuda_app never got ready");
            if let Some(rest) = line.strip_prefix("ready ") {
                let w: Vec<&str> = rest.split_whitespace().collect();
                let hex = |s: &str| u64::from_str_radix(s, 16).unwrap();
                app.allocs = [
                    (hex(w[0]), w[1].parse().unwrap()),
                    (hex(w[2]), w[3].parse().unwrap()),
                ];
                break;
            }
            app.syms.push(line);
        }
        app
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn next_line(&self, timeout: Duration) -> Option<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => Some(l),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// Sends `cmd` and returns its answer.
    fn ask(&mut self, cmd: &str) -> String {
        self.send(cmd);
        self.next_line(WAIT)
            .unwrap_or_else(|| panic!("no answer to {cmd}"))
    }

    fn sym(&self, what: &str) -> String {
        self.syms
            .iter()
            .find_map(|l| l.strip_prefix(&format!("sym {what} ")))
            .unwrap_or_else(|| panic!("no sym line for {what}: {:?}", self.syms))
            .to_string()
    }

    /// The fake driver's memory call log.
    fn mem_log(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("mem.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn count(&self, prefix: &str) -> usize {
        self.mem_log()
            .iter()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    fn socket(&self) -> PathBuf {
        socket_path(self.dir.path(), self.pid())
    }

    fn client(&self) -> ControlClient {
        let deadline = Instant::now() + WAIT;
        loop {
            match ControlClient::connect(&self.socket()) {
                Ok(c) => return c,
                Err(e) if Instant::now() > deadline => panic!("no control socket: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// The permissions column of the /proc/<pid>/maps line holding `addr`.
    fn protection(&self, addr: u64) -> String {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", self.pid())).unwrap();
        for line in maps.lines() {
            let mut w = line.split_whitespace();
            let (range, perms) = (w.next().unwrap(), w.next().unwrap());
            let (lo, hi) = range.split_once('-').unwrap();
            let (lo, hi) = (
                u64::from_str_radix(lo, 16).unwrap(),
                u64::from_str_radix(hi, 16).unwrap(),
            );
            if (lo..hi).contains(&addr) {
                return perms.to_string();
            }
        }
        panic!("{addr:#x} not mapped");
    }
}

impl Drop for App {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ok(client: &mut ControlClient, req: &Request) -> Outcome {
    match client.call(req).unwrap() {
        Reply::Ok(o) => o,
        Reply::Error(e) => panic!("{req:?} failed: {e:?}"),
    }
}

fn status(client: &mut ControlClient) -> gpucr_hook::protocol::HookStatus {
    match ok(client, &Request::Status) {
        Outcome::Status(s) => s,
        o => panic!("not a status: {o:?}"),
    }
}

#[test]
fn wrappers_are_handed_out_by_get_proc_address_and_dlsym() {
    let app = App::start(true, "plain");
    assert_eq!(
        app.sym("dlsym:cuGetProcAddress_v2"),
        "libgpucr_hook.so cuGetProcAddress_v2"
    );
    // Asked for itself, cuGetProcAddress hands out our wrapper again.
    assert_eq!(
        app.sym("cuGetProcAddress"),
        "libgpucr_hook.so cuGetProcAddress_v2"
    );
    assert_eq!(app.sym("cuMemAlloc"), "libgpucr_hook.so cuMemAlloc_v2");
    // The per-thread-default-stream flag selects the _ptsz/_ptds twins.
    assert_eq!(
        app.sym("cuLaunchKernel"),
        "libgpucr_hook.so cuLaunchKernel_ptsz"
    );
    assert_eq!(
        app.sym("cuMemcpyDtoH"),
        "libgpucr_hook.so cuMemcpyDtoH_v2_ptds"
    );
    assert_eq!(
        app.sym("dlsym:cuMemAlloc_v2"),
        "libgpucr_hook.so cuMemAlloc_v2"
    );
    // Functions we do not wrap stay the driver's.
    assert_eq!(app.sym("cuCtxSetCurrent"), "libcuda.so.1 cuCtxSetCurrent");
}

#[test]
fn checkpoint_cycle_keeps_memory_exact_and_gates_launches() {
    let mut app = App::start(true, "plain");
    let before = app.ask("check");
    assert!(before.starts_with("ok "), "{before}");
    // Both allocations (one per resolution path) went through VMM, none to cuMemAlloc.
    assert_eq!(app.count("cuMemCreate "), 2, "{:?}", app.mem_log());
    assert_eq!(app.count("cuMemAlloc_v2"), 0, "{:?}", app.mem_log());

    let mut client = app.client();
    let st = status(&mut client);
    assert_eq!((st.allocations, st.state), (2, CheckpointState::Running));
    assert_eq!(st.bytes, app.allocs[0].1 + app.allocs[1].1);
    assert!(st.unsupported.is_empty());

    ok(&mut client, &Request::Freeze);
    // A launch during the freeze waits at the gate.
    app.send("launch");
    assert_eq!(app.next_line(Duration::from_millis(300)), None);
    assert_eq!(status(&mut client).gate, GateState::Frozen);

    let image = app.dir.path().join("image");
    let out = ok(
        &mut client,
        &Request::CopyOut {
            image_dir: image.clone(),
            parent: None,
        },
    );
    assert!(
        matches!(out, Outcome::CopiedOut(ref r) if r.allocations == 2),
        "{out:?}"
    );
    // The staging memory was pinned for the copy and is unpinned after it.
    let pinned = app.count("cuMemHostRegister_v2");
    assert!(pinned > 0, "{:#?}", app.mem_log());
    assert_eq!(
        app.count("cuMemHostUnregister"),
        pinned,
        "{:#?}",
        app.mem_log()
    );

    ok(&mut client, &Request::Release { keep: false });
    for (va, _) in app.allocs {
        assert_eq!(app.protection(va), "---p", "{va:#x} still accessible");
    }
    assert_eq!(app.count("cuMemRelease"), 2);
    ok(&mut client, &Request::Remap);
    for (va, _) in app.allocs {
        assert_eq!(app.protection(va), "rw-s", "{va:#x} not remapped");
    }
    assert_eq!(app.count("cuMemCreate "), 4);
    ok(&mut client, &Request::CopyIn { image_dir: image });
    assert_eq!(app.next_line(Duration::from_millis(100)), None);
    ok(&mut client, &Request::Thaw);

    assert_eq!(app.next_line(WAIT).as_deref(), Some("launched 0"));
    let after = app.ask("check");
    assert!(after.starts_with("ok "), "{after}");
    assert_ne!(after, before, "the launch after thaw changed the memory");
    assert_eq!(status(&mut client).state, CheckpointState::Running);

    // Frees of VMM memory go to the hook, not to the driver's cuMemFree.
    assert_eq!(app.ask("free"), "freed 0 0");
    assert_eq!(app.count("cuMemFree_v2"), 0);
    assert_eq!(app.count("cuMemAddressFree"), 2);
    assert_eq!(status(&mut client).allocations, 0);
}

#[test]
fn managed_memory_is_reported_and_copy_out_refused() {
    let mut app = App::start(true, "managed");
    let mut client = app.client();
    let st = status(&mut client);
    assert_eq!(st.unsupported.len(), 1, "{st:?}");
    ok(&mut client, &Request::Freeze);
    let reply = client
        .call(&Request::CopyOut {
            image_dir: app.dir.path().join("image"),
            parent: None,
        })
        .unwrap();
    assert!(matches!(reply, Reply::Error(_)), "{reply:?}");
    ok(&mut client, &Request::Thaw);
    assert!(app.ask("check").starts_with("ok "));
}

#[test]
fn without_a_socket_dir_the_hook_passes_everything_through() {
    let mut app = App::start(false, "plain");
    assert!(app.ask("check").starts_with("ok "));
    assert_eq!(app.count("cuMemAlloc_v2"), 2, "{:?}", app.mem_log());
    assert_eq!(app.count("cuMemCreate"), 0);
    assert!(!app.socket().exists());
    assert_eq!(app.ask("free"), "freed 0 0");
    assert_eq!(app.count("cuMemFree_v2"), 2);
}

#[test]
fn garbage_on_the_socket_does_not_hurt_the_program() {
    let mut app = App::start(true, "plain");
    let mut client = app.client();
    let mut frame = 9u32.to_be_bytes().to_vec();
    frame.extend_from_slice(b"\xffgarbage!");
    let reply = client.call_raw(&frame).unwrap();
    assert!(matches!(reply, Reply::Error(_)), "{reply:?}");
    // A frame claiming 4 GiB, then a hang-up mid-frame.
    {
        let mut other = app.client();
        let _ = other.call_raw(&u32::MAX.to_be_bytes());
    }
    {
        use std::io::Write as _;
        let mut raw = std::os::unix::net::UnixStream::connect(app.socket()).unwrap();
        raw.write_all(&100u32.to_be_bytes()).unwrap();
        raw.write_all(b"{\"verb\"").unwrap();
    }
    assert_eq!(status(&mut client).allocations, 2);
    assert!(app.ask("check").starts_with("ok "));
    assert_eq!(app.ask("launch"), "launched 0");
}
