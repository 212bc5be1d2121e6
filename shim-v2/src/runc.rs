//! Typed invocations of the runc binary (or crun: any runtime with runc's CLI).
//!
//! Each option struct renders its own argv. Errors carry runc's own last error line from its
//! JSON log (falling back to stderr), the way containerd's Go shim reports them.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use serde::Deserialize;

use crate::{
    error::{Error, Result},
    reaper::Spawner,
};

/// What [`Runc::last_error`] says when runc logged nothing and wrote nothing to stderr.
const NO_MESSAGE: &str = "runc failed without a message";
/// Where `runc restore` bind-mounts the rootfs for CRIU, in its state directory.
const CRIU_ROOT: &str = "criu-root";

/// What a `runc restore` killed mid-way left, that could not be removed.
#[derive(Debug, thiserror::Error)]
pub enum LeftoverError {
    #[error(
        "unmounting {path}, the rootfs a killed `runc restore` left mounted for CRIU: {source}"
    )]
    Unmount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "removing {path}, the state directory a killed `runc restore` left without a \
         state.json (runc delete does not know it): {source}"
    )]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Global flags for every runc call of one container.
#[derive(Clone)]
pub struct Runc {
    pub binary: String,
    pub root: PathBuf,
    pub systemd_cgroup: bool,
    /// runc's JSON log for this container (`<bundle>/log.json`, as containerd's Go shim).
    pub log: PathBuf,
    pub spawner: Spawner,
}

/// The container process's stdio, handed to runc (which hands it to the container).
pub struct ChildStdio {
    pub stdin: Stdio,
    pub stdout: Stdio,
    pub stderr: Stdio,
}

impl ChildStdio {
    pub fn null() -> Self {
        ChildStdio {
            stdin: Stdio::null(),
            stdout: Stdio::null(),
            stderr: Stdio::null(),
        }
    }
}

/// `runc checkpoint` options.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CheckpointOpts {
    pub image_path: PathBuf,
    pub work_path: Option<PathBuf>,
    pub parent_path: Option<PathBuf>,
    pub leave_running: bool,
    pub tcp_established: bool,
    pub ext_unix_sk: bool,
    pub shell_job: bool,
    pub file_locks: bool,
    pub empty_ns: Vec<String>,
    pub manage_cgroups_mode: Option<String>,
}

impl CheckpointOpts {
    fn args(&self) -> Vec<String> {
        let mut a = vec!["--image-path".to_string(), path_arg(&self.image_path)];
        if let Some(w) = &self.work_path {
            a.extend(["--work-path".into(), path_arg(w)]);
        }
        if let Some(p) = &self.parent_path {
            a.extend(["--parent-path".into(), path_arg(p)]);
        }
        if self.leave_running {
            a.push("--leave-running".into());
        }
        a.extend(self.shared_args());
        a
    }

    /// Flags that `runc checkpoint` and `runc restore` share.
    fn shared_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if self.tcp_established {
            a.push("--tcp-established".into());
        }
        if self.ext_unix_sk {
            a.push("--ext-unix-sk".into());
        }
        if self.shell_job {
            a.push("--shell-job".into());
        }
        if self.file_locks {
            a.push("--file-locks".into());
        }
        for ns in &self.empty_ns {
            a.extend(["--empty-ns".into(), ns.clone()]);
        }
        if let Some(m) = &self.manage_cgroups_mode {
            a.extend(["--manage-cgroups-mode".into(), m.clone()]);
        }
        a
    }
}

/// `runc restore` options: the checkpoint's options plus where the new process goes.
#[derive(Debug, Clone, Default)]
pub struct RestoreOpts {
    pub checkpoint: CheckpointOpts,
    pub bundle: PathBuf,
    pub pid_file: PathBuf,
    pub console_socket: Option<PathBuf>,
    pub no_pivot: bool,
    /// Environment for runc, and so for CRIU and its plugins (GPU pairs for a CUDA plugin).
    pub env: Vec<(String, String)>,
}

impl RestoreOpts {
    fn args(&self) -> Vec<String> {
        let c = &self.checkpoint;
        let mut a = vec!["--image-path".to_string(), path_arg(&c.image_path)];
        if let Some(w) = &c.work_path {
            a.extend(["--work-path".into(), path_arg(w)]);
        }
        a.extend(c.shared_args());
        a.extend([
            "--detach".into(),
            "--pid-file".into(),
            path_arg(&self.pid_file),
            "--bundle".into(),
            path_arg(&self.bundle),
            // The shim is the subreaper; the restored tree is reparented to it when runc exits.
            "--no-subreaper".into(),
        ]);
        if let Some(s) = &self.console_socket {
            a.extend(["--console-socket".into(), path_arg(s)]);
        }
        if self.no_pivot {
            a.push("--no-pivot".into());
        }
        a
    }
}

/// `runc create` options.
pub struct CreateOpts<'a> {
    pub bundle: &'a Path,
    pub pid_file: &'a Path,
    pub console_socket: Option<&'a Path>,
    pub no_pivot: bool,
}

/// `runc exec` options.
pub struct ExecOpts<'a> {
    pub process_json: &'a Path,
    pub pid_file: &'a Path,
    pub console_socket: Option<&'a Path>,
    /// A terminal: `--tty` with the console socket (runc 1.1 reads the tty from the process
    /// file, which the shim sets to match; runtimes that read the flag get it too).
    pub tty: bool,
}

#[derive(Debug, Deserialize)]
pub struct RuncState {
    pub status: String,
    pub pid: i32,
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl Runc {
    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--root")
            .arg(&self.root)
            .arg("--log")
            .arg(&self.log)
            .arg("--log-format")
            .arg("json");
        if self.systemd_cgroup {
            cmd.arg("--systemd-cgroup");
        }
        cmd
    }

    /// Runs a runc subcommand and returns its stdout.
    async fn run(&self, op: &'static str, args: &[String]) -> Result<Vec<u8>> {
        self.run_env(op, args, &[]).await
    }

    async fn run_env(
        &self,
        op: &'static str,
        args: &[String],
        env: &[(&str, &str)],
    ) -> Result<Vec<u8>> {
        self.run_within(op, args, env, None).await
    }

    /// [`Runc::run_env`] with a deadline: past it, runc and CRIU under it are killed.
    async fn run_within(
        &self,
        op: &'static str,
        args: &[String],
        env: &[(&str, &str)],
        within: Option<Duration>,
    ) -> Result<Vec<u8>> {
        let mut cmd = self.command();
        cmd.args(args).envs(env.iter().copied());
        tracing::debug!(binary = %self.binary, ?args, ?within, "runc");
        let out = self
            .spawner
            .output_within(cmd, within)
            .await
            .map_err(|e| self.spawn_error(op, e, within))?;
        if out.status != 0 {
            return Err(self.failed(op, out.status, &out.stderr));
        }
        Ok(out.stdout)
    }

    /// Runs a runc subcommand whose stdio is the container process's.
    async fn run_with_stdio(
        &self,
        op: &'static str,
        args: &[String],
        env: &[(String, String)],
        stdio: ChildStdio,
        within: Option<Duration>,
    ) -> Result<()> {
        let mut cmd = self.command();
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(stdio.stdin)
            .stdout(stdio.stdout)
            .stderr(stdio.stderr);
        tracing::debug!(binary = %self.binary, ?args, "runc");
        let status = self
            .spawner
            .status_within(cmd, within)
            .await
            .map_err(|e| self.spawn_error(op, e, within))?;
        if status != 0 {
            return Err(self.failed(op, status, b""));
        }
        Ok(())
    }

    /// The error of a runc that exited with `status`: its last logged error, or, when it
    /// logged none and died of a signal (status 128 + signal), that signal.
    fn failed(&self, op: &'static str, status: i32, stderr: &[u8]) -> Error {
        let msg = self.last_error(stderr);
        match status - 128 {
            signal @ 1..=64 if msg == NO_MESSAGE => Error::RuntimeKilled { op, signal },
            _ => Error::Runtime { op, msg },
        }
    }

    fn spawn_error(&self, op: &'static str, e: std::io::Error, within: Option<Duration>) -> Error {
        if let (std::io::ErrorKind::TimedOut, Some(after)) = (e.kind(), within) {
            return Error::TimedOut {
                op,
                after,
                msg: e.to_string(),
            };
        }
        Error::Runtime {
            op,
            msg: format!(
                "cannot run {:?}: {e} (set BinaryName in the runtime options, or put runc in PATH)",
                self.binary
            ),
        }
    }

    /// The last error runc logged, else its stderr.
    fn last_error(&self, stderr: &[u8]) -> String {
        #[derive(Deserialize)]
        struct Line {
            level: String,
            msg: String,
        }
        let logged = crate::criu_log::tail(&self.log, crate::criu_log::TAIL_BYTES).and_then(|s| {
            s.lines()
                .rev()
                .filter_map(|l| serde_json::from_str::<Line>(l).ok())
                .find(|l| l.level == "error" || l.level == "fatal")
                .map(|l| l.msg)
        });
        let stderr = String::from_utf8_lossy(stderr).trim().to_string();
        match logged {
            Some(m) if stderr.is_empty() || stderr.contains(&m) => m,
            Some(m) => format!("{m} ({stderr})"),
            None if stderr.is_empty() => NO_MESSAGE.to_string(),
            None => stderr,
        }
    }

    /// Clears the log so the next error read is this call's.
    pub fn reset_log(&self) {
        let _ = std::fs::write(&self.log, b"");
    }

    pub async fn create(&self, id: &str, o: CreateOpts<'_>, stdio: ChildStdio) -> Result<()> {
        self.reset_log();
        let mut a: Vec<String> = vec![
            "create".into(),
            "--bundle".into(),
            path_arg(o.bundle),
            "--pid-file".into(),
            path_arg(o.pid_file),
        ];
        if let Some(s) = o.console_socket {
            a.extend(["--console-socket".into(), path_arg(s)]);
        }
        if o.no_pivot {
            a.push("--no-pivot".into());
        }
        a.push(id.into());
        self.run_with_stdio("runc create", &a, &[], stdio, None)
            .await
    }

    pub async fn start(&self, id: &str) -> Result<()> {
        self.run("runc start", &["start".into(), id.into()])
            .await
            .map(drop)
    }

    pub async fn exec(&self, id: &str, o: ExecOpts<'_>, stdio: ChildStdio) -> Result<()> {
        self.reset_log();
        let mut a: Vec<String> = vec![
            "exec".into(),
            "--detach".into(),
            "--process".into(),
            path_arg(o.process_json),
            "--pid-file".into(),
            path_arg(o.pid_file),
        ];
        if o.tty {
            a.push("--tty".into());
        }
        if let Some(s) = o.console_socket {
            a.extend(["--console-socket".into(), path_arg(s)]);
        }
        a.push(id.into());
        self.run_with_stdio("runc exec", &a, &[], stdio, None).await
    }

    pub async fn kill(&self, id: &str, signal: u32, all: bool) -> Result<()> {
        let mut a: Vec<String> = vec!["kill".into()];
        if all {
            a.push("--all".into());
        }
        a.extend([id.into(), signal.to_string()]);
        self.run("runc kill", &a).await.map(drop)
    }

    pub async fn delete(&self, id: &str, force: bool) -> Result<()> {
        self.delete_within(id, force, None).await
    }

    /// `runc delete` killed past `within` (the shim's `delete` has 5 s in all).
    pub async fn delete_within(
        &self,
        id: &str,
        force: bool,
        within: Option<Duration>,
    ) -> Result<()> {
        let mut a: Vec<String> = vec!["delete".into()];
        if force {
            a.push("--force".into());
        }
        a.push(id.into());
        self.run_within("runc delete", &a, &[], within)
            .await
            .map(drop)
    }

    /// Pids of runc commands still running for this runc handle's container (started with
    /// its `--log`, which is in the bundle): a dead shim's `runc checkpoint` or `runc
    /// restore`, with CRIU under it.
    pub fn orphans(&self) -> Vec<i32> {
        let log = path_arg(&self.log);
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let pid: i32 = e.file_name().to_str()?.parse().ok()?;
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
                let ours = args
                    .windows(2)
                    .any(|w| w[0] == b"--log" && w[1] == log.as_bytes());
                let verb = args.iter().any(|a| *a == b"checkpoint" || *a == b"restore");
                (ours && verb && pid != std::process::id() as i32).then_some(pid)
            })
            .collect()
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        self.run("runc pause", &["pause".into(), id.into()])
            .await
            .map(drop)
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        self.run("runc resume", &["resume".into(), id.into()])
            .await
            .map(drop)
    }

    pub async fn update(&self, id: &str, resources_json: &Path) -> Result<()> {
        self.run(
            "runc update",
            &[
                "update".into(),
                "--resources".into(),
                path_arg(resources_json),
                id.into(),
            ],
        )
        .await
        .map(drop)
    }

    pub async fn ps(&self, id: &str) -> Result<Vec<i32>> {
        let out = self
            .run(
                "runc ps",
                &["ps".into(), "--format".into(), "json".into(), id.into()],
            )
            .await?;
        let pids: Option<Vec<i32>> = serde_json::from_slice(&out).map_err(|e| Error::Decode {
            what: "runc ps output",
            msg: e.to_string(),
        })?;
        Ok(pids.unwrap_or_default())
    }

    pub async fn state(&self, id: &str) -> Result<RuncState> {
        let out = self.run("runc state", &["state".into(), id.into()]).await?;
        serde_json::from_slice(&out).map_err(|e| Error::Decode {
            what: "runc state output",
            msg: e.to_string(),
        })
    }

    /// One `runc events --stats` sample.
    pub async fn stats(&self, id: &str) -> Result<serde_json::Value> {
        let out = self
            .run(
                "runc events",
                &["events".into(), "--stats".into(), id.into()],
            )
            .await?;
        let v: serde_json::Value = serde_json::from_slice(&out).map_err(|e| Error::Decode {
            what: "runc events --stats output",
            msg: e.to_string(),
        })?;
        Ok(v.get("data").cloned().unwrap_or(serde_json::Value::Null))
    }

    /// `runc checkpoint`; `env` reaches CRIU and its plugins; past `within` runc and CRIU
    /// are killed ([`Error::TimedOut`]).
    pub async fn checkpoint(
        &self,
        id: &str,
        o: &CheckpointOpts,
        env: &[(&str, &str)],
        within: Option<Duration>,
    ) -> Result<()> {
        self.reset_log();
        let mut a: Vec<String> = vec!["checkpoint".into()];
        a.extend(o.args());
        a.push(id.into());
        // gpucr's CRIU plugin reads this to know whether the dumped tasks live on (runc talks
        // to CRIU over RPC, where the plugin cannot see --leave-running).
        let leave = if o.leave_running { "1" } else { "0" };
        let mut env = env.to_vec();
        env.push(("GPUCR_CRIU_LEAVE_RUNNING", leave));
        self.run_within("runc checkpoint", &a, &env, within)
            .await
            .map(drop)
    }

    /// Removes what a `runc restore` killed mid-way leaves of `id` (#27): runc bind-mounts
    /// the rootfs at `<root>/<id>/criu-root` for CRIU and removes it when CRIU returns, and
    /// writes `state.json` only after the restore — so `runc delete` does not know such a
    /// container and the mount and directory would stay. Only a directory without
    /// `state.json` is touched. Returns whether there was anything to remove.
    pub fn remove_restore_leftovers(&self, id: &str) -> std::result::Result<bool, LeftoverError> {
        let dir = self.root.join(id);
        if !dir.is_dir() || dir.join("state.json").exists() {
            return Ok(false);
        }
        let criu_root = dir.join(CRIU_ROOT);
        match nix::mount::umount2(&criu_root, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {}
            Err(e) => {
                return Err(LeftoverError::Unmount {
                    path: criu_root,
                    source: e.into(),
                })
            }
        }
        std::fs::remove_dir_all(&dir).map_err(|source| LeftoverError::Remove {
            path: dir.clone(),
            source,
        })?;
        Ok(true)
    }

    /// `runc restore`; past `within` runc and CRIU (with what it restored so far) are
    /// killed ([`Error::TimedOut`]).
    pub async fn restore(
        &self,
        id: &str,
        o: &RestoreOpts,
        stdio: ChildStdio,
        within: Option<Duration>,
    ) -> Result<()> {
        self.reset_log();
        let mut a: Vec<String> = vec!["restore".into()];
        a.extend(o.args());
        a.push(id.into());
        self.run_with_stdio("runc restore", &a, &o.env, stdio, within)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_args_render_every_option() {
        let o = CheckpointOpts {
            image_path: "/img".into(),
            work_path: Some("/work".into()),
            parent_path: Some("/parent".into()),
            leave_running: true,
            tcp_established: true,
            ext_unix_sk: true,
            shell_job: true,
            file_locks: true,
            empty_ns: vec!["network".into()],
            manage_cgroups_mode: Some("soft".into()),
        };
        assert_eq!(
            o.args().join(" "),
            "--image-path /img --work-path /work --parent-path /parent --leave-running \
             --tcp-established --ext-unix-sk --shell-job --file-locks --empty-ns network \
             --manage-cgroups-mode soft"
        );
    }

    fn runc_at(root: &Path) -> Runc {
        Runc {
            binary: "runc".into(),
            root: root.to_path_buf(),
            systemd_cgroup: false,
            log: root.join("log.json"),
            spawner: Spawner::Plain,
        }
    }

    #[test]
    fn a_killed_restore_leaves_are_removed_a_registered_container_is_not() {
        let d = tempfile::tempdir().unwrap();
        let runc = runc_at(d.path());
        std::fs::create_dir_all(d.path().join("killed").join(CRIU_ROOT)).unwrap();
        std::fs::create_dir_all(d.path().join("live")).unwrap();
        std::fs::write(d.path().join("live").join("state.json"), "{}").unwrap();
        assert!(runc.remove_restore_leftovers("killed").unwrap());
        assert!(!d.path().join("killed").exists());
        assert!(!runc.remove_restore_leftovers("live").unwrap());
        assert!(d.path().join("live").join("state.json").exists());
        assert!(!runc.remove_restore_leftovers("never").unwrap());
    }

    #[test]
    fn a_runc_killed_without_a_message_is_named_so() {
        let d = tempfile::tempdir().unwrap();
        let runc = runc_at(d.path());
        let e = runc.failed("runc restore", 128 + libc::SIGKILL, b"");
        assert!(matches!(e, Error::RuntimeKilled { signal: 9, .. }), "{e}");
        assert!(e.to_string().contains("killed by signal 9"), "{e}");
        // A runc that said why keeps its message, whatever its status.
        let e = runc.failed("runc restore", 137, b"criu failed: type RESTORE errno 0");
        assert!(matches!(e, Error::Runtime { .. }), "{e}");
        let e = runc.failed("runc restore", 1, b"");
        assert!(matches!(e, Error::Runtime { .. }), "{e}");
    }

    #[test]
    fn restore_args_detach_into_the_bundle() {
        let o = RestoreOpts {
            checkpoint: CheckpointOpts {
                image_path: "/img".into(),
                ..Default::default()
            },
            bundle: "/b".into(),
            pid_file: "/b/init.pid".into(),
            console_socket: Some("/tmp/c.sock".into()),
            no_pivot: true,
            env: Vec::new(),
        };
        assert_eq!(
            o.args().join(" "),
            "--image-path /img --detach --pid-file /b/init.pid --bundle /b --no-subreaper \
             --console-socket /tmp/c.sock --no-pivot"
        );
    }
}
