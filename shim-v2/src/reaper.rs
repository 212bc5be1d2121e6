//! The shim's only reaper. The shim is a child subreaper, so container processes are
//! reparented to it; every exit is collected here with `waitpid(-1)` and either handed to
//! the task that spawned that child (a runc command) or forwarded once to the process-exit
//! stream. tokio's own child handling is never used: it would race with `waitpid(-1)`.

use std::{
    collections::HashMap,
    io::Read,
    process::{Child, Command, ExitStatus as StdExitStatus},
    sync::{Arc, Mutex},
    time::SystemTime,
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
    /// Runs `cmd` to completion, capturing stdout and stderr.
    pub async fn output(&self, mut cmd: Command) -> std::io::Result<Output> {
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        match self {
            Spawner::Plain => {
                let out = tokio::task::spawn_blocking(move || cmd.output())
                    .await
                    .map_err(std::io::Error::other)??;
                Ok(Output {
                    status: status_code(out.status),
                    stdout: out.stdout,
                    stderr: out.stderr,
                })
            }
            Spawner::Reaped(reaper) => {
                let (mut child, exit) = reaper.spawn(&mut cmd)?;
                let stdout = child.stdout.take().map(read_all);
                let stderr = child.stderr.take().map(read_all);
                let stdout = join(stdout).await;
                let stderr = join(stderr).await;
                let exit = exit
                    .await
                    .map_err(|_| std::io::Error::other("reaper stopped"))?;
                Ok(Output {
                    status: exit.status,
                    stdout,
                    stderr,
                })
            }
        }
    }

    /// Runs `cmd` (whose stdio the caller set) to completion and returns its exit status.
    pub async fn status(&self, mut cmd: Command) -> std::io::Result<i32> {
        match self {
            Spawner::Plain => {
                let st = tokio::task::spawn_blocking(move || cmd.status())
                    .await
                    .map_err(std::io::Error::other)??;
                Ok(status_code(st))
            }
            Spawner::Reaped(reaper) => {
                let (child, exit) = reaper.spawn(&mut cmd)?;
                // Close our copies of the child's stdio now, so pipes see EOF when it is done.
                drop(cmd);
                drop(child);
                let exit = exit
                    .await
                    .map_err(|_| std::io::Error::other("reaper stopped"))?;
                Ok(exit.status)
            }
        }
    }

    /// Spawns a long-lived helper (a logging binary) whose exit is reaped but not awaited.
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

fn status_code(st: StdExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn commands_and_orphans_are_reaped_once() {
        let (reaper, mut exits) = Reaper::start().unwrap();
        let sp = Spawner::Reaped(reaper.clone());
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        let out = sp.output(cmd).await.unwrap();
        assert_eq!(out.status, 3);
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");

        // A child nobody awaits goes to the exit stream, with 128+signal when killed.
        // Reaped by the reaper under test, not by std: hence no wait().
        #[allow(clippy::zombie_processes)]
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        nix::sys::signal::kill(Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
        let exit = tokio::time::timeout(std::time::Duration::from_secs(5), exits.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(exit.pid, pid);
        assert_eq!(exit.status, 137);
    }
}
