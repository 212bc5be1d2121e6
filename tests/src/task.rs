//! Container and task helpers on top of `ctr`, and the counter workload.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::command::Output;
use crate::containerd::Containerd;
use crate::error::{HarnessError, Result};
use crate::poll::poll_until;

/// A busybox shell loop: increments an in-memory counter about every 0.2 s, writes it to
/// [`COUNTER_FILE`] and prints it. Only the shell's memory carries the count, so a restored
/// container continues from the checkpointed value, a restarted one from 1.
///
/// The file is rewritten in place (`1<>`: no truncation, no temporary name) at a fixed width,
/// and the test image already holds it at that width ([`COUNTER_FILE_INITIAL`]): a dump that
/// catches the shell with the file open then restores into a fresh rootfs too (CRIU reopens
/// the file by name and checks its size; a renamed-away temporary broke that now and then).
pub const COUNTER_SCRIPT: &str = "i=0; while true; do i=$((i+1)); \
     printf '%020d\\n' $i 1<> /tmp/counter; \
     echo \"count $i\"; sleep 0.2; done";
/// The counter file as the test image ships it: the width the workload writes.
pub const COUNTER_FILE_INITIAL: &[u8] = b"00000000000000000000\n";
/// Where the workload keeps its counter, inside the container.
pub const COUNTER_FILE: &str = "/tmp/counter";

/// The workload's argv.
pub fn counter_args() -> Vec<String> {
    vec!["sh".into(), "-c".into(), COUNTER_SCRIPT.into()]
}

/// The status column of `ctr task ls`, e.g. `RUNNING`, `PAUSED`, `STOPPED`.
pub type TaskStatus = String;

/// How long tests wait for a task to reach a state.
pub const STATE_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether the container gets the host's network namespace (`GPUCR_TEST_NET_HOST=1`).
pub fn net_host() -> bool {
    std::env::var("GPUCR_TEST_NET_HOST").is_ok_and(|v| v == "1" || v == "true")
}

impl Containerd {
    /// Standard flags of `ctr run` for a test container: runtime under test, and network.
    pub fn run_flags(&self) -> Vec<String> {
        let mut flags = vec!["--runtime".to_owned(), self.runtime().to_owned()];
        if net_host() {
            flags.push("--net-host".into());
        }
        flags
    }

    /// `ctr run -d`: starts `args` in a new container `id` from `image`; stdout and stderr go
    /// to a file in the daemon's directory (see [`Containerd::container_log`]).
    pub fn run_detached(&self, id: &str, image: &str, args: &[String]) -> Result<Output> {
        self.run_detached_with(id, image, &[], args)
    }

    /// [`Containerd::run_detached`] with extra `ctr run` flags (e.g. `--annotation k=v`).
    pub fn run_detached_with(
        &self,
        id: &str,
        image: &str,
        flags: &[&str],
        args: &[String],
    ) -> Result<Output> {
        let log = self.dir().join(format!("{id}.log"));
        let mut cmd = self.ctr_cmd().args(["run", "-d"]).args(self.run_flags());
        cmd = cmd.arg(format!("--log-uri=file://{}", log.display()));
        cmd.args(flags).arg(image).arg(id).args(args).run_ok()
    }

    /// Starts the counter workload in container `id` and waits until it has counted.
    pub fn run_counter(&self, id: &str, image: &str) -> Result<()> {
        self.run_detached(id, image, &counter_args())?;
        self.wait_status(id, "RUNNING")?;
        self.wait_counter_above(id, 0)?;
        Ok(())
    }

    /// The container's stdout/stderr as logged by [`Containerd::run_detached`].
    pub fn container_log(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir().join(format!("{id}.log"))).unwrap_or_default()
    }

    /// `ctr task ls` as (id, pid, status) rows.
    pub fn tasks(&self) -> Result<Vec<(String, u32, TaskStatus)>> {
        let out = self.ctr_ok(&["task", "ls"])?;
        Ok(out
            .stdout
            .lines()
            .skip(1)
            .filter_map(|line| {
                let mut cols = line.split_whitespace();
                let id = cols.next()?.to_owned();
                let pid = cols.next()?.parse().ok()?;
                let status = cols.next()?.to_owned();
                Some((id, pid, status))
            })
            .collect())
    }

    /// The task's status, `None` when there is no task.
    pub fn task_status(&self, id: &str) -> Result<Option<TaskStatus>> {
        Ok(self
            .tasks()?
            .into_iter()
            .find(|(task, _, _)| task == id)
            .map(|(_, _, status)| status))
    }

    /// The task's init pid as `ctr task ls` shows it.
    pub fn task_pid(&self, id: &str) -> Result<u32> {
        self.tasks()?
            .into_iter()
            .find(|(task, _, _)| task == id)
            .map(|(_, pid, _)| pid)
            .ok_or_else(|| HarnessError::Unexpected(format!("no task {id} in `ctr task ls`")))
    }

    /// Waits until the task's status is `status`.
    pub fn wait_status(&self, id: &str, status: &str) -> Result<()> {
        poll_until(&format!("task {id} {status}"), STATE_TIMEOUT, || {
            Ok(match self.task_status(id)? {
                Some(s) if s == status => Ok(()),
                other => Err(other),
            })
        })
    }

    /// `ctr task exec` with a fresh exec id; returns the output whatever the exit status.
    pub fn exec(&self, id: &str, args: &[&str]) -> Result<Output> {
        static SEQUENCE: AtomicU32 = AtomicU32::new(0);
        let exec_id = format!("exec-{}", SEQUENCE.fetch_add(1, Ordering::Relaxed));
        self.ctr_cmd()
            .args(["task", "exec", "--exec-id", &exec_id, id])
            .args(args)
            .output()
    }

    /// The workload's counter, read with `cat` through exec.
    pub fn read_counter(&self, id: &str) -> Result<u64> {
        let out = self.exec(id, &["cat", COUNTER_FILE])?.check()?;
        out.stdout
            .trim()
            .parse()
            .map_err(|_| HarnessError::Unexpected(format!("counter of {id} is {:?}", out.stdout)))
    }

    /// Waits until the counter is above `value` and returns it.
    pub fn wait_counter_above(&self, id: &str, value: u64) -> Result<u64> {
        poll_until(
            &format!("counter of {id} above {value}"),
            STATE_TIMEOUT,
            || {
                let counter = self.read_counter(id)?;
                Ok(if counter > value {
                    Ok(counter)
                } else {
                    Err(counter)
                })
            },
        )
    }

    /// Kills the task (SIGKILL), waits for it to stop, and deletes task and container.
    pub fn remove_container(&self, id: &str) -> Result<()> {
        if self.task_status(id)?.is_some() {
            let _ = self.ctr(&["task", "kill", "-s", "SIGKILL", id])?;
            let _ = poll_until(&format!("task {id} stopped"), STATE_TIMEOUT, || {
                Ok(match self.task_status(id)? {
                    Some(s) if s != "STOPPED" => Err(s),
                    _ => Ok(()),
                })
            });
            self.ctr_ok(&["task", "rm", id])?;
        }
        self.ctr_ok(&["container", "rm", id])?;
        Ok(())
    }

    /// Names of images whose reference starts with `prefix`.
    pub fn images_with_prefix(&self, prefix: &str) -> Result<Vec<String>> {
        Ok(self
            .ctr_ok(&["image", "ls", "-q"])?
            .stdout
            .lines()
            .filter(|name| name.starts_with(prefix))
            .map(str::to_owned)
            .collect())
    }
}
