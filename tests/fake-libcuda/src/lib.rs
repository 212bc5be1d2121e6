//! A scripted stand-in for libcuda.so.1's checkpoint API, so gpucr's GPU paths
//! (including every failure) run on CPU machines.
//!
//! The script (`$GPUCR_FAKE_CUDA_SCRIPT`, format in README.md) says which pids are
//! CUDA processes and how each call behaves. Per-pid state and call counters live in
//! `<log>.state`, guarded by `flock` on `<log>.lock`, because the shim and the CRIU
//! plugin load this library in different processes. Every call is appended to the
//! log (`$GPUCR_FAKE_CUDA_LOG`) as `<op> <pid>[ pairs=N] -> <rc>`.

mod mem;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::raw::{c_int, c_uint, c_void};
use std::time::Duration;

const SUCCESS: c_int = 0;
const INVALID_VALUE: c_int = 1;
const ILLEGAL_STATE: c_int = 401;
const NOT_READY: c_int = 600;

const RUNNING: u8 = 0;
const LOCKED: u8 = 1;
const CHECKPOINTED: u8 = 2;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    GetState,
    GetRestoreTid,
    Lock,
    Checkpoint,
    Restore,
    Unlock,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::GetState => "get_state",
            Op::GetRestoreTid => "get_restore_tid",
            Op::Lock => "lock",
            Op::Checkpoint => "checkpoint",
            Op::Restore => "restore",
            Op::Unlock => "unlock",
        }
    }

    fn parse(s: &str) -> Option<Op> {
        [
            Op::GetState,
            Op::GetRestoreTid,
            Op::Lock,
            Op::Checkpoint,
            Op::Restore,
            Op::Unlock,
        ]
        .into_iter()
        .find(|op| op.name() == s)
    }

    /// (required state, state after success) for the mutating calls.
    fn edge(self) -> Option<(u8, u8)> {
        match self {
            Op::Lock => Some((RUNNING, LOCKED)),
            Op::Checkpoint => Some((LOCKED, CHECKPOINTED)),
            Op::Restore => Some((CHECKPOINTED, LOCKED)),
            Op::Unlock => Some((LOCKED, RUNNING)),
            _ => None,
        }
    }
}

/// What a rule makes a call do.
#[derive(Default, Clone, Copy, Debug)]
struct Action {
    hang_ms: u64,
    fail: Option<c_int>,
}

#[derive(Debug)]
struct Rule {
    op: Op,
    pid: Option<i32>,
    call: Option<u64>,
    action: Action,
}

#[derive(Debug)]
struct CudaPid {
    tid: i32,
    state: u8,
}

#[derive(Debug)]
struct Script {
    driver_version: c_int,
    pids: BTreeMap<i32, CudaPid>,
    /// `cuda * [state=..]`: every pid not listed is a CUDA process starting in this state.
    any_pid: Option<u8>,
    rules: Vec<Rule>,
}

fn parse_state(s: &str) -> u8 {
    match s {
        "locked" => LOCKED,
        "checkpointed" => CHECKPOINTED,
        _ => RUNNING,
    }
}

fn load_script() -> Script {
    let mut script = Script {
        driver_version: 13000,
        pids: BTreeMap::new(),
        any_pid: None,
        rules: Vec::new(),
    };
    let Some(path) = std::env::var_os("GPUCR_FAKE_CUDA_SCRIPT") else {
        return script;
    };
    let text = fs::read_to_string(path).unwrap_or_default();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [] => {}
            ["driver_version", v] => script.driver_version = v.parse().unwrap_or(13000),
            ["cuda", "*", rest @ ..] => {
                let state = rest.iter().find_map(|kv| kv.strip_prefix("state="));
                script.any_pid = Some(state.map_or(RUNNING, parse_state));
            }
            ["cuda", pid, rest @ ..] => {
                let Ok(pid) = pid.parse() else { continue };
                let mut p = CudaPid {
                    tid: pid,
                    state: RUNNING,
                };
                for kv in rest {
                    match kv.split_once('=') {
                        Some(("tid", v)) => p.tid = v.parse().unwrap_or(pid),
                        Some(("state", v)) => p.state = parse_state(v),
                        _ => {}
                    }
                }
                script.pids.insert(pid, p);
            }
            [op, pid, rest @ ..] => {
                let Some(op) = Op::parse(op) else { continue };
                let mut rule = Rule {
                    op,
                    pid: pid.parse().ok(),
                    call: None,
                    action: Action::default(),
                };
                let mut it = rest.iter();
                while let Some(w) = it.next() {
                    match *w {
                        "fail" => rule.action.fail = it.next().and_then(|c| c.parse().ok()),
                        "hang" => {
                            rule.action.hang_ms =
                                it.next().and_then(|c| c.parse().ok()).unwrap_or(0)
                        }
                        w => {
                            if let Some(k) = w.strip_prefix("call=") {
                                rule.call = k.parse().ok();
                            }
                        }
                    }
                }
                script.rules.push(rule);
            }
            _ => {}
        }
    }
    script
}

fn log_path() -> String {
    std::env::var("GPUCR_FAKE_CUDA_LOG").unwrap_or_else(|_| "/tmp/gpucr-fake-cuda.log".into())
}

/// Per-pid state and per-(op, pid) call counts, shared across processes.
#[derive(Default)]
struct Shared {
    state: BTreeMap<i32, u8>,
    count: BTreeMap<(String, i32), u64>,
}

impl Shared {
    fn load(path: &str) -> Shared {
        let mut s = Shared::default();
        for line in fs::read_to_string(path).unwrap_or_default().lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["state", pid, st] => {
                    if let (Ok(p), Ok(v)) = (pid.parse(), st.parse()) {
                        s.state.insert(p, v);
                    }
                }
                ["count", op, pid, n] => {
                    if let (Ok(p), Ok(n)) = (pid.parse(), n.parse()) {
                        s.count.insert((op.to_string(), p), n);
                    }
                }
                _ => {}
            }
        }
        s
    }

    fn save(&self, path: &str) {
        let mut out = String::new();
        for (pid, st) in &self.state {
            out.push_str(&format!("state {pid} {st}\n"));
        }
        for ((op, pid), n) in &self.count {
            out.push_str(&format!("count {op} {pid} {n}\n"));
        }
        let tmp = format!("{path}.tmp");
        if fs::write(&tmp, out).is_ok() {
            let _ = fs::rename(tmp, path);
        }
    }
}

/// Holds `flock` on `<log>.lock` while alive.
struct FileLock(File);

impl FileLock {
    fn take(log: &str) -> Option<FileLock> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(format!("{log}.lock"))
            .ok()?;
        // SAFETY: valid fd owned by `f`.
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        Some(FileLock(f))
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // SAFETY: valid fd owned by self.0.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn append_log(log: &str, line: &str) {
    if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(log) {
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

/// Runs one call: picks the rule, hangs outside the lock, applies the transition.
fn call(
    op: Op,
    pid: c_int,
    extra: &str,
    args_ok: bool,
    timeout_ms: u32,
) -> (c_int, Option<CudaPid>) {
    let script = load_script();
    let log = log_path();
    let state_path = format!("{log}.state");
    let key = (op.name().to_string(), pid);

    let started_ms = unix_ms();
    let action = {
        let _guard = FileLock::take(&log);
        let mut shared = Shared::load(&state_path);
        let n = shared.count.get(&key).copied().unwrap_or(0) + 1;
        shared.count.insert(key, n);
        shared.save(&state_path);
        script
            .rules
            .iter()
            .find(|r| r.op == op && r.pid.is_none_or(|p| p == pid) && r.call.is_none_or(|k| k == n))
            .map(|r| r.action)
            .unwrap_or_default()
    };

    // A lock that would take longer than its timeout gives up like the driver does.
    let lock_times_out = op == Op::Lock && timeout_ms > 0 && action.hang_ms > u64::from(timeout_ms);
    let sleep = if lock_times_out {
        u64::from(timeout_ms)
    } else {
        action.hang_ms
    };
    if sleep > 0 {
        std::thread::sleep(Duration::from_millis(sleep));
    }

    let _guard = FileLock::take(&log);
    let mut shared = Shared::load(&state_path);
    let scripted = match script.pids.get(&pid) {
        Some(p) => Some((p.tid, p.state)),
        None => script.any_pid.map(|state| (pid, state)),
    };
    let found = scripted.map(|(tid, state)| CudaPid {
        tid,
        state: shared.state.get(&pid).copied().unwrap_or(state),
    });
    let rc = match &found {
        None => INVALID_VALUE,
        Some(_) if !args_ok => INVALID_VALUE,
        Some(_) if lock_times_out => NOT_READY,
        Some(_) if action.fail.is_some() => action.fail.unwrap_or(INVALID_VALUE),
        Some(p) => match op.edge() {
            Some((from, _)) if p.state != from => ILLEGAL_STATE,
            Some((_, to)) => {
                shared.state.insert(pid, to);
                shared.save(&state_path);
                SUCCESS
            }
            None => SUCCESS,
        },
    };
    let line = format!("{} {pid}{extra} -> {rc}", op.name());
    append_log(
        &format!("{log}.times"),
        &format!("{started_ms} {} {line}", unix_ms()),
    );
    append_log(&log, &line);
    (rc, found)
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn all_zero(p: *const c_void, from: usize) -> bool {
    if p.is_null() {
        return true;
    }
    // SAFETY: every args struct is 64 bytes.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), 64) };
    bytes[from..].iter().all(|b| *b == 0)
}

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> c_int {
    SUCCESS
}

/// # Safety
/// `version` must be a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> c_int {
    if version.is_null() {
        return INVALID_VALUE;
    }
    *version = load_script().driver_version;
    SUCCESS
}

/// # Safety
/// `state` must be a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_int) -> c_int {
    let (rc, p) = call(Op::GetState, pid, "", !state.is_null(), 0);
    if let (SUCCESS, Some(p)) = (rc, p) {
        *state = c_int::from(p.state);
    }
    rc
}

/// # Safety
/// `tid` must be a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessGetRestoreThreadId(
    pid: c_int,
    tid: *mut c_int,
) -> c_int {
    let (rc, p) = call(Op::GetRestoreTid, pid, "", !tid.is_null(), 0);
    if let (SUCCESS, Some(p)) = (rc, p) {
        *tid = p.tid;
    }
    rc
}

/// # Safety
/// `args` is NULL or points to a 64-byte CUcheckpointLockArgs.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessLock(pid: c_int, args: *mut c_void) -> c_int {
    let timeout_ms = if args.is_null() {
        0
    } else {
        *(args as *const u32)
    };
    call(Op::Lock, pid, "", all_zero(args, 4), timeout_ms).0
}

/// # Safety
/// `args` is NULL or points to 64 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessCheckpoint(pid: c_int, args: *mut c_void) -> c_int {
    call(Op::Checkpoint, pid, "", all_zero(args, 0), 0).0
}

/// # Safety
/// `args` is NULL or points to a 64-byte CUcheckpointRestoreArgs of the layout that
/// matches the scripted driver version.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessRestore(pid: c_int, args: *mut c_void) -> c_int {
    let v13 = load_script().driver_version >= 13000;
    let (ok, extra) = if args.is_null() {
        (true, String::new())
    } else if v13 {
        let pairs = *(args as *const *const u8);
        let count = *(args.cast::<u8>().add(8) as *const u32);
        let ok = all_zero(args, 12) && (count == 0 || !pairs.is_null());
        (
            ok,
            if count > 0 {
                format!(" pairs={count}")
            } else {
                String::new()
            },
        )
    } else {
        (all_zero(args, 0), String::new())
    };
    call(Op::Restore, pid, &extra, ok, 0).0
}

/// # Safety
/// `args` is NULL or points to 64 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessUnlock(pid: c_int, args: *mut c_void) -> c_int {
    call(Op::Unlock, pid, "", all_zero(args, 0), 0).0
}
