//! Running external commands with a timeout and captured output.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{HarnessError, Result};

/// What a finished command left behind.
#[derive(Debug, Clone)]
pub struct Output {
    /// The command line, for messages.
    pub command: String,
    /// Exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    /// stdout as (lossy) UTF-8.
    pub stdout: String,
    /// stdout as bytes.
    pub stdout_bytes: Vec<u8>,
    pub stderr: String,
}

impl Output {
    /// True when the command exited with status 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// Turns a non-zero exit into [`HarnessError::CommandFailed`].
    pub fn check(self) -> Result<Self> {
        if self.success() {
            Ok(self)
        } else {
            Err(HarnessError::CommandFailed {
                status: match self.code {
                    Some(code) => format!("exit status {code}"),
                    None => "killed by a signal".to_owned(),
                },
                command: self.command,
                stdout: self.stdout,
                stderr: self.stderr,
            })
        }
    }
}

/// A command to run: program, arguments, environment, optional stdin and a timeout.
#[derive(Debug, Clone)]
pub struct Cmd {
    program: OsString,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    stdin: Stdin,
    timeout: Duration,
}

/// What the command's stdin is.
#[derive(Debug, Clone)]
enum Stdin {
    Null,
    /// These bytes, then EOF.
    Bytes(Vec<u8>),
    /// A pipe nobody writes to, closed when the command ends (for programs that stop at EOF).
    KeepOpen,
}

impl Cmd {
    /// Default time a command may run.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    pub fn new(program: impl Into<OsString>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            envs: Vec::new(),
            stdin: Stdin::Null,
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// Bytes written to the command's stdin, which is then closed. Without it stdin is /dev/null.
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = Stdin::Bytes(bytes.into());
        self
    }

    /// Gives the command a stdin pipe that stays open, without data, until it exits.
    pub fn stdin_open(mut self) -> Self {
        self.stdin = Stdin::KeepOpen;
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The command line as one string (for messages; not shell-quoted).
    pub fn display(&self) -> String {
        std::iter::once(&self.program)
            .chain(&self.args)
            .map(|s| s.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The command line quoted for a POSIX shell (e.g. for `script -c`).
    pub fn shell_line(&self) -> String {
        std::iter::once(&self.program)
            .chain(&self.args)
            .map(|s| format!("'{}'", s.to_string_lossy().replace('\'', r"'\''")))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Runs the command to its end or to the timeout (then kills it and returns an error).
    pub fn output(&self) -> Result<Output> {
        let command = self.display();
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(match self.stdin {
                Stdin::Null => Stdio::null(),
                Stdin::Bytes(_) | Stdin::KeepOpen => Stdio::piped(),
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| HarnessError::Spawn {
                command: command.clone(),
                source,
            })?;
        let mut open_stdin = None;
        match (&self.stdin, child.stdin.take()) {
            (Stdin::Bytes(bytes), Some(mut pipe)) => {
                let bytes = bytes.clone();
                // A writer thread, so a command that does not read cannot block us.
                thread::spawn(move || {
                    let _ = pipe.write_all(&bytes);
                });
            }
            (Stdin::KeepOpen, pipe) => open_stdin = pipe,
            _ => {}
        }
        let stdout = drain(child.stdout.take());
        let stderr = drain(child.stderr.take());
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() >= deadline => break None,
                Ok(None) => thread::sleep(Duration::from_millis(10)),
                Err(source) => {
                    return Err(HarnessError::Spawn { command, source });
                }
            }
        };
        drop(open_stdin);
        let Some(status) = status else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(HarnessError::Timeout {
                command,
                timeout: self.timeout,
                stdout: text(join(stdout)),
                stderr: text(join(stderr)),
            });
        };
        let stdout_bytes = join(stdout);
        Ok(Output {
            command,
            code: status.code(),
            stdout: String::from_utf8_lossy(&stdout_bytes).into_owned(),
            stdout_bytes,
            stderr: text(join(stderr)),
        })
    }

    /// Runs the command and fails unless it exits with status 0.
    pub fn run_ok(&self) -> Result<Output> {
        self.output()?.check()
    }
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> Option<thread::JoinHandle<Vec<u8>>> {
    pipe.map(|mut pipe| {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    })
}

/// Collects a drain thread's text. A grandchild that keeps the pipe open past a timeout would
/// block this forever, so a thread that is not done yet yields an empty string.
fn join(handle: Option<thread::JoinHandle<Vec<u8>>>) -> Vec<u8> {
    let Some(handle) = handle else {
        return Vec::new();
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    while !handle.is_finished() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
    if handle.is_finished() {
        handle.join().unwrap_or_default()
    } else {
        b"<output still open>".to_vec()
    }
}

fn text(bytes: Vec<u8>) -> String {
    String::from_utf8_lossy(&bytes).into_owned()
}
