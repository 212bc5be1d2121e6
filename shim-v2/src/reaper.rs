//! The shim's only reaper. The shim is a child subreaper, so container processes are
//! reparented to it; every exit is collected here with `waitpid(-1)` and either handed to
//! the task that spawned that child (a runc command) or forwarded once to the process-exit
//! stream. tokio's own child handling is never used: it would race with `waitpid(-1)`.

use std::{
    collections::HashMap,
    io::Read,
    os::unix::process::CommandExt,
    process::{Child, Command},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use nix::{
    errno::Errno,
    sys::wait::{waitpid, WaitPidFlag, WaitStatus},
    unistd::Pid,
};
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::{mpsc, oneshot},
};

/// One reaped child.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    pub pid: i32,
    /// The exit code, or 128 + signal number for a killed process (as containerd reports it).
    pub status: i32,
    pub at: SystemTime,
}

pub struct Reaper {
    /// Children whose exit a caller awaits. Spawning holds this lock until the pid is
    /// registered, so an exit reaped in between is never misrouted.
    waiters: Mutex<HashMap<i32, oneshot::Sender<Exit>>>,
    exits: mpsc::UnboundedSender<Exit>,
}

/// Captured output of a finished command.
#[derive(Debug)]
pub struct Output {
    pub status: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Reaper {
    /// Starts reaping on SIGCHLD. Exits of children nobody awaits (container processes)
    /// arrive on the returned receiver.
    pub fn start() -> std::io::Result<(Arc<Reaper>, mpsc::UnboundedReceiver<Exit>)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let reaper = Arc::new(Reaper {
            waiters: Mutex::new(HashMap::new()),
            exits: tx,
        });
        let mut sigchld = signal(SignalKind::child())?;
        let r = reaper.clone();
        tokio::spawn(async move {
            loop {
                r.reap_all();
                if sigchld.recv().await.is_none() {
                    break;
                }
            }
        });
        Ok((reaper, rx))
    }

    fn reap_all(&self) {
        loop {
            let (pid, status) = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (pid.as_raw(), code),
                Ok(WaitStatus::Signaled(pid, sig, _)) => (pid.as_raw(), 128 + sig as i32),
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
                Ok(_) => continue,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    tracing::warn!("waitpid: {e}");
                    return;
                }
            };
            let exit = Exit {
                pid,
                status,
                at: SystemTime::now(),
            };
            let waiter = self.waiters.lock().expect("reaper lock").remove(&pid);
            match waiter {
                Some(tx) => {
                    let _ = tx.send(exit);
                }
                None => {
                    let _ = self.exits.send(exit);
                }
            }
        }
    }

    /// Spawns `cmd` and returns a receiver for its exit.
    pub fn spawn(&self, cmd: &mut Command) -> std::io::Result<(Child, oneshot::Receiver<Exit>)> {
        let mut waiters = self.waiters.lock().expect("reaper lock");
        let child = cmd.spawn()?;
        let (tx, rx) = oneshot::channel();
        waiters.insert(child.id() as i32, tx);
        Ok((child, rx))
    }
}

/// Runs commands either under the shim's reaper (the serving shim) or plainly (the `delete`
/// action, where no reaper runs).
#[derive(Clone)]
pub enum Spawner {
    Reaped(Arc<Reaper>),
    Plain,
}

impl Spawner {
    pub async fn output(&self, cmd: Command) -> std::io::Result<Output> {
        self.output_within(cmd, None).await
    }

    /// Runs `cmd` to its end and captures its output; with `within`, a command still
    /// running then is killed with everything it started (see [`kill_tree`]) and the
    /// answer is an error of kind `TimedOut`.
    pub async fn output_within(
        &self,
        mut cmd: Command,
        within: Option<Duration>,
    ) -> std::io::Result<Output> {
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if within.is_some() {
            cmd.process_group(0);
        }
        let (mut child, mut exit) = self.spawn_waited(cmd)?;
        let pid = child.id() as i32;
        let stdout = child.stdout.take().map(read_all);
        let stderr = child.stderr.take().map(read_all);
        let finished = async {
            let exited = async {
                let status = (&mut exit).await?;
                // A runc that failed (or was killed) may leave CRIU behind in its group,
                // holding the container's processes and our pipes: it goes with runc.
                if within.is_some() && status != 0 {
                    kill_group(pid).await;
                }
                Ok::<_, std::io::Error>(status)
            };
            let (status, stdout, stderr) = tokio::join!(exited, join(stdout), join(stderr));
            Ok::<_, std::io::Error>(Output {
                status: status?,
                stdout,
                stderr,
            })
        };
        match within {
            None => finished.await,
            Some(d) => match tokio::time::timeout(d, finished).await {
                Ok(r) => r,
                Err(_) => Err(killed_after(pid, d, exit).await),
            },
        }
    }

    pub async fn status(&self, cmd: Command) -> std::io::Result<i32> {
        self.status_within(cmd, None).await
    }

    /// Runs `cmd` to its end; `within` as for [`Spawner::output_within`].
    pub async fn status_within(
        &self,
        mut cmd: Command,
        within: Option<Duration>,
    ) -> std::io::Result<i32> {
        if within.is_some() {
            cmd.process_group(0);
        }
        let (child, mut exit) = self.spawn_waited(cmd)?;
        let pid = child.id() as i32;
        drop(child);
        match within {
            None => exit.await,
            Some(d) => match tokio::time::timeout(d, &mut exit).await {
                Ok(Ok(status)) if status != 0 => {
                    // As in `output_within`: a failed runc's CRIU goes with it.
                    kill_group(pid).await;
                    Ok(status)
                }
                Ok(r) => r,
                Err(_) => Err(killed_after(pid, d, exit).await),
            },
        }
    }

    /// Spawns `cmd` and returns a future of its exit status.
    fn spawn_waited(&self, mut cmd: Command) -> std::io::Result<(Child, ExitFuture)> {
        match self {
            Spawner::Plain => {
                let child = cmd.spawn()?;
                // The caller keeps the pipes; waiting only needs the pid.
                let pid = Pid::from_raw(child.id() as i32);
                let waited = tokio::task::spawn_blocking(move || loop {
                    match waitpid(pid, None) {
                        Ok(WaitStatus::Exited(_, code)) => return Ok(code),
                        Ok(WaitStatus::Signaled(_, sig, _)) => return Ok(128 + sig as i32),
                        Ok(_) | Err(Errno::EINTR) => continue,
                        Err(e) => return Err(std::io::Error::from(e)),
                    }
                });
                let fut: ExitFuture =
                    Box::pin(async move { waited.await.map_err(std::io::Error::other)? });
                Ok((child, fut))
            }
            Spawner::Reaped(reaper) => {
                let (child, exit) = reaper.spawn(&mut cmd)?;
                let fut: ExitFuture = Box::pin(async move {
                    exit.await
                        .map(|e| e.status)
                        .map_err(|_| std::io::Error::other("reaper stopped"))
                });
                Ok((child, fut))
            }
        }
    }

    pub fn spawn_detached(&self, cmd: &mut Command) -> std::io::Result<u32> {
        match self {
            Spawner::Plain => Ok(cmd.spawn()?.id()),
            Spawner::Reaped(reaper) => {
                let (child, _exit) = reaper.spawn(cmd)?;
                Ok(child.id())
            }
        }
    }
}

type ExitFuture = std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<i32>> + Send>>;

/// How long a killed command's exit is waited for before the caller is answered anyway.
const KILLED_EXIT_WAIT: Duration = Duration::from_secs(10);

/// SIGKILLs the process group `pgid` (a failed runc's CRIU) and waits, bounded by
/// [`KILLED_EXIT_WAIT`], until none of it is left: a CRIU killed mid-restore holds its
/// cgroup yard in the work directory until it is gone, and the caller's cleanup (and
/// containerd's removal of the bundle) comes next. Orphans are reaped by the shim's
/// reaper, so the group empties.
async fn kill_group(pgid: i32) {
    use nix::sys::signal::{killpg, Signal};
    let group = Pid::from_raw(pgid);
    let started = std::time::Instant::now();
    while killpg(group, Signal::SIGKILL).is_ok() {
        if started.elapsed() > KILLED_EXIT_WAIT {
            tracing::warn!(pgid, "the failed runc's process group outlived its SIGKILL");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Kills the command `pid` that outlived `after` with what it started, waits (bounded)
/// for its exit, and says so as a `TimedOut` error.
async fn killed_after(pid: i32, after: Duration, exit: ExitFuture) -> std::io::Error {
    let killed = kill_tree(pid);
    let reaped = tokio::time::timeout(KILLED_EXIT_WAIT, exit).await.is_ok();
    tracing::warn!(pid, killed = ?killed, reaped, "command outlived its deadline of {after:?}: killed");
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("did not finish within {after:?} and was killed (pid {pid} and {} processes it started)", killed.len().saturating_sub(1)),
    )
}

/// SIGKILLs `root`, every descendant of it (CRIU under runc, and what CRIU forked), and
/// its process group. Descendants first collected, then killed: a killed parent's
/// children would be reparented (to the shim, a subreaper) and look unrelated.
pub fn kill_tree(root: i32) -> Vec<i32> {
    use nix::sys::signal::{kill, killpg, Signal};
    let tree = tree_of(root);
    for p in &tree {
        let _ = kill(Pid::from_raw(*p), Signal::SIGKILL);
    }
    let _ = killpg(Pid::from_raw(root), Signal::SIGKILL);
    tree
}

/// `root` and every descendant of it, from /proc's parent links (root first).
pub fn tree_of(root: i32) -> Vec<i32> {
    let mut tree = vec![root];
    let parents: Vec<(i32, i32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The command name may hold spaces and parentheses: fields follow the last ')'.
            let rest = &stat[stat.rfind(')')? + 1..];
            let ppid: i32 = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    tree
}

fn read_all<R: Read + Send + 'static>(mut r: R) -> tokio::task::JoinHandle<Vec<u8>> {
    tokio::task::spawn_blocking(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

async fn join(h: Option<tokio::task::JoinHandle<Vec<u8>>>) -> Vec<u8> {
    match h {
        Some(h) => h.await.unwrap_or_default(),
        None => Vec::new(),
    }
}

// Tests: shim-v2/tests/reaper.rs, a process of their own (a reaper's waitpid(-1) takes every
// child of its process, the other unit tests' too).
