//! A process's stdio: the URIs containerd sends are parsed once into [`IoTarget`], then
//! connected to the container process through pipes (or a pty from runc's console socket)
//! and copied by tasks that end on EOF.

use std::{
    fs::File,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::{fs::OpenOptionsExt, net::UnixListener, process::CommandExt},
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use nix::{
    fcntl::OFlag,
    sys::socket::{recvmsg, ControlMessageOwned, MsgFlags},
    unistd::pipe2,
};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::unix::pipe,
    task::JoinHandle,
};

use crate::{
    error::{Error, IoContext, Result},
    reaper::Spawner,
    runc::ChildStdio,
};

/// Where one stdio stream goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoTarget {
    Null,
    /// A FIFO that containerd (or a client) created and holds open.
    Fifo(PathBuf),
    /// A logging binary: it gets stdout on fd 3, stderr on fd 4 and closes fd 5 when ready.
    Binary {
        path: PathBuf,
        args: Vec<String>,
    },
    /// A file that stdout and stderr are appended to (through pipes the shim copies).
    File(PathBuf),
}

impl IoTarget {
    pub fn parse(uri: &str) -> Result<IoTarget> {
        if uri.is_empty() {
            return Ok(IoTarget::Null);
        }
        if uri.starts_with('/') {
            return Ok(IoTarget::Fifo(uri.into()));
        }
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| Error::invalid(format!("stdio {uri:?} is neither a path nor a URI")))?;
        let (path, query) = match rest.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (rest, None),
        };
        let path = PathBuf::from(percent_decode(path));
        match scheme {
            "fifo" => Ok(IoTarget::Fifo(path)),
            "file" => Ok(IoTarget::File(path)),
            "binary" => {
                let mut args = Vec::new();
                for kv in query.unwrap_or("").split('&').filter(|s| !s.is_empty()) {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    args.push(percent_decode(k));
                    if !v.is_empty() {
                        args.push(percent_decode(v));
                    }
                }
                Ok(IoTarget::Binary { path, args })
            }
            other => Err(Error::invalid(format!(
                "stdio scheme {other:?} of {uri:?} is not supported (use fifo, file or binary)"
            ))),
        }
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The stdio request of a process, as containerd sent it.
#[derive(Debug, Clone, Default)]
pub struct StdioSpec {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

/// Who the process belongs to: logging binaries get the ids; the pipes belong to
/// `IoUid`/`IoGid` (runtime options) so a process in a user namespace can use them.
pub struct IoOwner<'a> {
    pub id: &'a str,
    pub namespace: &'a str,
    pub uid: u32,
    pub gid: u32,
}

/// Copiers of a running process's stdio.
#[derive(Default)]
pub struct ProcessIo {
    stdin: Option<JoinHandle<()>>,
    /// The shim's own writer on the stdin fifo: while it is open the stdin copy never sees
    /// EOF (a client may close and reopen the fifo); CloseIO drops it, so the copy forwards
    /// everything clients wrote and ends at their last close, as containerd's runc shim.
    stdin_writer: Option<File>,
    outputs: Vec<JoinHandle<()>>,
    /// The pty master, kept for resizes.
    console: Option<File>,
}

/// Stdio prepared before runc runs; finished once runc has created the process.
pub struct PendingIo {
    io: ProcessIo,
    console_socket: Option<ConsoleSocket>,
    spec: StdioSpec,
}

fn pipe(owner: &IoOwner<'_>) -> Result<(OwnedFd, OwnedFd)> {
    let (r, w) = pipe2(OFlag::O_CLOEXEC).map_err(|e| Error::io("creating a pipe", e.into()))?;
    if owner.uid != 0 || owner.gid != 0 {
        for fd in [&r, &w] {
            nix::unistd::fchown(
                fd,
                Some(nix::unistd::Uid::from_raw(owner.uid)),
                Some(nix::unistd::Gid::from_raw(owner.gid)),
            )
            .map_err(|e| Error::io("chown of a stdio pipe to IoUid/IoGid", e.into()))?;
        }
    }
    Ok((r, w))
}

fn fifo_writer(path: &Path) -> Result<pipe::Sender> {
    // Read-write: opening never blocks on a reader, and our end never sees EPIPE.
    pipe::OpenOptions::new()
        .read_write(true)
        .open_sender(path)
        .ctx(|| format!("opening stdio fifo {}", path.display()))
}

/// The stdin fifo opened for the copy, and the shim's own writer on it (see
/// `ProcessIo::stdin_writer`): stdin ends by CloseIO, not by a client's reopen.
fn fifo_reader(path: &Path) -> Result<(pipe::Receiver, File)> {
    let what = || format!("opening stdin fifo {}", path.display());
    let reader = pipe::OpenOptions::new().open_receiver(path).ctx(what)?;
    // Non-blocking: the reader above is open, so this cannot wait for one.
    let writer = File::options()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .ctx(what)?;
    Ok((reader, writer))
}

fn copy_task<R, W>(mut r: R, mut w: W, what: &'static str) -> JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        // Not tokio::io::copy: while a write waits, it reads ahead, and a read error then
        // drops the bytes it holds. A pty master reports the last slave's close with EIO,
        // which a short-lived terminal process (`ctr task exec -t … tty`) hits at once:
        // its output was lost when the fifo's first write waited. Each read here is
        // written out in full before the next.
        let mut buf = vec![0u8; 32 << 10];
        loop {
            let n = match r.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // EIO is how a pty master reports that the last slave closed.
                Err(e) if e.raw_os_error() == Some(libc::EIO) => break,
                Err(e) => {
                    tracing::debug!("copying {what}: {e}");
                    break;
                }
            };
            if let Err(e) = w.write_all(&buf[..n]).await {
                tracing::debug!("copying {what}: {e}");
                break;
            }
        }
        let _ = w.shutdown().await;
    })
}

impl PendingIo {
    /// Creates the pipes (or the console socket) for a process about to be created by runc.
    pub fn prepare(
        spec: &StdioSpec,
        owner: IoOwner<'_>,
        spawner: &Spawner,
    ) -> Result<(ChildStdio, PendingIo)> {
        let mut io = ProcessIo::default();
        if spec.terminal {
            let socket = ConsoleSocket::new()?;
            let pending = PendingIo {
                io,
                console_socket: Some(socket),
                spec: spec.clone(),
            };
            return Ok((ChildStdio::null(), pending));
        }
        let stdin = match IoTarget::parse(&spec.stdin)? {
            IoTarget::Null => Stdio::null(),
            IoTarget::Fifo(path) => {
                let (r, w) = pipe(&owner)?;
                let (src, hold) = fifo_reader(&path)?;
                let dst = pipe::Sender::from_owned_fd(w).ctx(|| "stdin pipe".into())?;
                io.stdin = Some(copy_task(src, dst, "stdin"));
                io.stdin_writer = Some(hold);
                Stdio::from(r)
            }
            other => return Err(Error::invalid(format!("stdin cannot be {other:?}"))),
        };
        let (stdout, stderr) = match IoTarget::parse(&spec.stdout)? {
            IoTarget::File(path) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
                }
                // Through pipes, never the file itself: CRIU cannot dump a descriptor of a
                // host file outside the container's mounts, but it can dump a pipe.
                let open = || {
                    File::options()
                        .create(true)
                        .append(true)
                        .open(&path)
                        .ctx(|| format!("opening log file {}", path.display()))
                };
                let mut out = || -> Result<Stdio> {
                    let (r, w) = pipe(&owner)?;
                    let src = pipe::Receiver::from_owned_fd(r).ctx(|| "log pipe".into())?;
                    let dst = tokio::fs::File::from_std(open()?);
                    io.outputs.push(copy_task(src, dst, "log file"));
                    Ok(Stdio::from(w))
                };
                (out()?, out()?)
            }
            IoTarget::Binary { path, args } => start_logging_binary(&path, &args, &owner, spawner)?,
            out => {
                let stdout = output_pipe(out, &owner, &mut io, "stdout")?;
                let stderr =
                    output_pipe(IoTarget::parse(&spec.stderr)?, &owner, &mut io, "stderr")?;
                (stdout, stderr)
            }
        };
        Ok((
            ChildStdio {
                stdin,
                stdout,
                stderr,
            },
            PendingIo {
                io,
                console_socket: None,
                spec: spec.clone(),
            },
        ))
    }

    pub fn console_socket(&self) -> Option<&Path> {
        self.console_socket.as_ref().map(|s| s.path.as_path())
    }

    /// After runc succeeded: receive the pty master (if any) and start copying.
    pub async fn finish(mut self) -> Result<ProcessIo> {
        let Some(socket) = self.console_socket.take() else {
            return Ok(self.io);
        };
        let master = tokio::task::spawn_blocking(move || socket.receive())
            .await
            .map_err(|e| Error::io("console socket", std::io::Error::other(e)))??;
        let spec = &self.spec;
        if let IoTarget::Fifo(path) = IoTarget::parse(&spec.stdin)? {
            let (src, hold) = fifo_reader(&path)?;
            let dst = tokio::fs::File::from_std(master.try_clone().ctx(|| "dup pty".into())?);
            self.io.stdin = Some(copy_task(src, dst, "console stdin"));
            self.io.stdin_writer = Some(hold);
        }
        match IoTarget::parse(&spec.stdout)? {
            IoTarget::Fifo(path) => {
                let src = tokio::fs::File::from_std(master.try_clone().ctx(|| "dup pty".into())?);
                let dst = fifo_writer(&path)?;
                self.io.outputs.push(copy_task(src, dst, "console stdout"));
            }
            IoTarget::Null => {}
            other => {
                return Err(Error::invalid(format!(
                    "a terminal's output can only go to a fifo, not {other:?}"
                )))
            }
        }
        self.io.console = Some(master);
        Ok(self.io)
    }
}

fn output_pipe(
    target: IoTarget,
    owner: &IoOwner<'_>,
    io: &mut ProcessIo,
    what: &'static str,
) -> Result<Stdio> {
    match target {
        IoTarget::Null => Ok(Stdio::null()),
        IoTarget::Fifo(path) => {
            let (r, w) = pipe(owner)?;
            let src = pipe::Receiver::from_owned_fd(r).ctx(|| format!("{what} pipe"))?;
            let dst = fifo_writer(&path)?;
            io.outputs.push(copy_task(src, dst, what));
            Ok(Stdio::from(w))
        }
        other => Err(Error::invalid(format!(
            "{what} cannot be {other:?} unless stdout is the same"
        ))),
    }
}

/// Starts a logging binary (containerd's `binary://` scheme) and waits until it is ready.
fn start_logging_binary(
    path: &Path,
    args: &[String],
    owner: &IoOwner<'_>,
    spawner: &Spawner,
) -> Result<(Stdio, Stdio)> {
    let (out_r, out_w) = pipe(owner)?;
    let (err_r, err_w) = pipe(owner)?;
    let (ready_r, ready_w) = pipe(owner)?;
    let fds: [RawFd; 3] = [out_r.as_raw_fd(), err_r.as_raw_fd(), ready_w.as_raw_fd()];
    let mut cmd = Command::new(path);
    cmd.args(args)
        .env("CONTAINER_ID", owner.id)
        .env("CONTAINER_NAMESPACE", owner.namespace)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: only async-signal-safe dup/dup2 between fork and exec. Duplicating above fd 5
    // first keeps an fd numbered 3..5 from being overwritten before it is moved.
    unsafe {
        cmd.pre_exec(move || {
            let mut high = [0; 3];
            for (i, fd) in fds.iter().enumerate() {
                high[i] = libc::fcntl(*fd, libc::F_DUPFD, 10);
                if high[i] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (i, fd) in high.iter().enumerate() {
                if libc::dup2(*fd, 3 + i as i32) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    spawner
        .spawn_detached(&mut cmd)
        .ctx(|| format!("starting logging binary {}", path.display()))?;
    drop(cmd);
    drop((out_r, err_r, ready_w));
    // The binary closes fd 5 (or writes to it) when it is ready to read.
    let mut ready = File::from(ready_r);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        let _ = std::io::Read::read(&mut ready, &mut b);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10)).map_err(|_| {
        Error::io(
            format!(
                "logging binary {} did not signal readiness within 10 s",
                path.display()
            ),
            std::io::ErrorKind::TimedOut.into(),
        )
    })?;
    Ok((Stdio::from(out_w), Stdio::from(err_w)))
}

impl ProcessIo {
    /// Containerd's CloseIO: the process's stdin closes once what clients wrote to the fifo
    /// is forwarded and they closed it (cancelling the copy lost bytes still in the fifo).
    pub fn close_stdin(&mut self) {
        self.stdin_writer = None;
    }

    /// Waits (bounded) until stdout and stderr are drained, so exit events follow the output.
    pub async fn wait_outputs(&mut self, timeout: Duration) {
        let outputs = std::mem::take(&mut self.outputs);
        let all = futures_join(outputs);
        if tokio::time::timeout(timeout, all).await.is_err() {
            tracing::warn!("stdio copy still running {timeout:?} after exit");
        }
    }

    pub fn resize(&self, width: u32, height: u32) -> Result<()> {
        let Some(console) = &self.console else {
            return Err(Error::invalid("process has no terminal to resize"));
        };
        let ws = libc::winsize {
            ws_row: height as u16,
            ws_col: width as u16,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer on a pty fd we own.
        let rc = unsafe { libc::ioctl(console.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        if rc < 0 {
            return Err(Error::io("resizing pty", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Stops every copier (process deleted).
    pub fn shutdown(&mut self) {
        self.close_stdin();
        if let Some(h) = self.stdin.take() {
            h.abort();
        }
        for h in self.outputs.drain(..) {
            h.abort();
        }
        self.console = None;
    }
}

async fn futures_join(handles: Vec<JoinHandle<()>>) {
    for h in handles {
        let _ = h.await;
    }
}

/// The socket runc sends a new process's pty master to (`--console-socket`).
struct ConsoleSocket {
    dir: PathBuf,
    path: PathBuf,
    listener: UnixListener,
}

impl ConsoleSocket {
    fn new() -> Result<ConsoleSocket> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("gpucr-pty-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
        let path = dir.join("pty.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).ctx(|| format!("binding {}", path.display()))?;
        Ok(ConsoleSocket {
            dir,
            path,
            listener,
        })
    }

    /// Receives the pty master that runc sent; runc has already connected and written.
    fn receive(self) -> Result<File> {
        self.listener
            .set_nonblocking(true)
            .ctx(|| "console socket".into())?;
        let (conn, _) = self.listener.accept().ctx(|| {
            "runc did not send a pty master on the console socket (is terminal set in the spec?)"
                .into()
        })?;
        conn.set_nonblocking(false)
            .ctx(|| "console socket".into())?;
        let mut buf = [0u8; 4096];
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let mut cmsg = nix::cmsg_space!([RawFd; 1]);
        let msg = recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::empty(),
        )
        .map_err(|e| Error::io("receiving the pty master", e.into()))?;
        for c in msg.cmsgs().map_err(|e| Error::io("pty cmsg", e.into()))? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                if let Some(fd) = fds.first() {
                    // SAFETY: the kernel just installed this fd for us; we own it now.
                    return Ok(unsafe { File::from_raw_fd(*fd) });
                }
            }
        }
        Err(Error::io(
            "receiving the pty master",
            std::io::Error::other("no file descriptor in runc's message"),
        ))
    }
}

impl Drop for ConsoleSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll};

    /// A pty master as a short-lived terminal process leaves it: its output, then EIO.
    struct Pty(Vec<std::io::Result<Vec<u8>>>);

    impl AsyncRead for Pty {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            if self.0.is_empty() {
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(self.0.remove(0).map(|b| buf.put_slice(&b)))
        }
    }

    /// A fifo whose first write waits (its readiness not seen yet).
    struct Fifo {
        out: Arc<Mutex<Vec<u8>>>,
        waited: bool,
    }

    impl AsyncWrite for Fifo {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            if !self.waited {
                self.waited = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            self.out.lock().unwrap().extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// The flake of `ctr task exec -t … tty` (tests/io.rs): the process's only line was
    /// read, the fifo's write waited, the copier read ahead and met EIO — and dropped the
    /// line with tokio::io::copy. Every byte read is written.
    #[tokio::test]
    async fn a_terminal_that_closes_while_the_fifo_waits_loses_no_output() {
        let out = Arc::new(Mutex::new(Vec::new()));
        let pty = Pty(vec![
            Ok(b"/dev/pts/0\n".to_vec()),
            Err(std::io::Error::from_raw_os_error(libc::EIO)),
        ]);
        let fifo = Fifo {
            out: out.clone(),
            waited: false,
        };
        copy_task(pty, fifo, "test").await.unwrap();
        assert_eq!(&*out.lock().unwrap(), b"/dev/pts/0\n");
    }

    #[test]
    fn pipes_belong_to_io_uid_and_gid() {
        if !nix::unistd::Uid::effective().is_root() {
            return; // chown needs root
        }
        let owner = IoOwner {
            id: "c",
            namespace: "n",
            uid: 1234,
            gid: 4321,
        };
        let (r, w) = pipe(&owner).unwrap();
        for fd in [r, w] {
            let st = nix::sys::stat::fstat(&fd).unwrap();
            assert_eq!((st.st_uid, st.st_gid), (1234, 4321));
        }
    }

    #[test]
    fn parse_every_scheme() {
        assert_eq!(IoTarget::parse("").unwrap(), IoTarget::Null);
        assert_eq!(
            IoTarget::parse("/run/x/stdout").unwrap(),
            IoTarget::Fifo("/run/x/stdout".into())
        );
        assert_eq!(
            IoTarget::parse("fifo:///a/b").unwrap(),
            IoTarget::Fifo("/a/b".into())
        );
        assert_eq!(
            IoTarget::parse("file:///var/log/c%20d.log").unwrap(),
            IoTarget::File("/var/log/c d.log".into())
        );
        assert_eq!(
            IoTarget::parse("binary:///usr/bin/logger?tag=x&debug").unwrap(),
            IoTarget::Binary {
                path: "/usr/bin/logger".into(),
                args: vec!["tag".into(), "x".into(), "debug".into()]
            }
        );
        let e = IoTarget::parse("http://x").unwrap_err().to_string();
        assert!(e.contains("not supported"), "{e}");
        assert!(IoTarget::parse("relative/path").is_err());
    }
}
