//! What a fault may leave of a container, for the fault tests (faults.rs, gpu_fake.rs): the
//! shim's failpoints ([`Failpoints`]), and the checks that nothing is left.

use std::path::Path;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{poll_until, procfs, Containerd, Output};

/// What containerd may take to clean up after a dead shim (`shim delete`, 5 s at most).
pub const CLEANUP_WITHIN: Duration = Duration::from_secs(15);

impl Containerd {
    /// Runs `ctr <args>` in a thread (bounded to a minute), for a fault to strike meanwhile.
    pub fn ctr_in_background(&self, args: &[&str]) -> JoinHandle<crate::Result<Output>> {
        let cmd = self.ctr_cmd().args(args).timeout(Duration::from_secs(60));
        std::thread::spawn(move || cmd.output())
    }

    /// `ctr task rm -f` then `ctr container rm`, on whatever a fault left of `id` (a task
    /// containerd already dropped with its dead shim is not found): both work, within
    /// seconds, and nothing of `id` is left.
    pub fn remove_with_force(&self, id: &str) {
        let t0 = Instant::now();
        let rm = self.ctr(&["task", "rm", "-f", id]).unwrap();
        assert!(
            rm.success() || rm.stderr.contains("not found"),
            "ctr task rm -f {id}: {}",
            rm.stderr
        );
        self.ctr_ok(&["container", "rm", id]).unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "removing {id} took {:?}",
            t0.elapsed()
        );
        self.assert_nothing_left(id);
    }

    /// No shim, shim socket, bundle, rootfs mount, runc state, container process of `id`,
    /// or unpacked checkpoint copy of the daemon.
    pub fn assert_nothing_left(&self, id: &str) {
        let bundle = self.bundle(id);
        let socket = self.shim_socket(id);
        let runc_state = Path::new("/run/containerd/runc")
            .join(self.namespace())
            .join(id);
        let address = self.address().to_string_lossy().into_owned();
        poll_until(&format!("nothing of {id} left"), CLEANUP_WITHIN, || {
            let left: Vec<String> = [
                procfs::shim_pid(&address, id).map(|p| format!("shim {p}")),
                socket
                    .exists()
                    .then(|| format!("shim socket {}", socket.display())),
                bundle
                    .exists()
                    .then(|| format!("bundle {}", bundle.display())),
                Some(procfs::mounts_under(&bundle))
                    .filter(|m| !m.is_empty())
                    .map(|m| format!("mounts {m:?}")),
                runc_state
                    .exists()
                    .then(|| format!("runc state {}", runc_state.display())),
                Some(procfs::cgroup_members(self.namespace()))
                    .filter(|m| !m.is_empty())
                    .map(|m| format!("container processes {m:?}")),
                Some(self.unpacked_checkpoints())
                    .filter(|u| !u.is_empty())
                    .map(|u| format!("unpacked checkpoints {u:?}")),
            ]
            .into_iter()
            .flatten()
            .collect();
            Ok(if left.is_empty() { Ok(()) } else { Err(left) })
        })
        .unwrap();
    }
}

/// The shim's failpoints (shim-v2/src/failpoint.rs): a file `<dir>/<point>` in the directory
/// `GPUCR_FAILPOINTS` names fails the point once; `pause` in it holds the point while
/// `<point>.held` exists.
pub struct Failpoints {
    dir: tempfile::TempDir,
}

impl Default for Failpoints {
    fn default() -> Self {
        Self::new()
    }
}

impl Failpoints {
    pub fn new() -> Failpoints {
        Failpoints {
            dir: tempfile::Builder::new()
                .prefix("gpucr-failpoints-")
                .tempdir()
                .unwrap(),
        }
    }

    /// The directory to name in `GPUCR_FAILPOINTS`.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The next pass through `point` fails.
    pub fn fail(&self, point: &str) {
        std::fs::write(self.path().join(point), "").unwrap();
    }

    /// The next pass through `point` holds until [`Failpoints::release`].
    pub fn pause(&self, point: &str) {
        std::fs::write(self.path().join(point), "pause").unwrap();
    }

    pub fn wait_held(&self, point: &str) {
        let held = self.path().join(format!("{point}.held"));
        poll_until(
            &format!("the shim holds at {point}"),
            Duration::from_secs(30),
            || Ok(if held.exists() { Ok(()) } else { Err(()) }),
        )
        .unwrap();
    }

    pub fn release(&self, point: &str) {
        std::fs::remove_file(self.path().join(format!("{point}.held"))).unwrap();
    }

    /// The shim went through `point` (its file was taken).
    pub fn fired(&self, point: &str) -> bool {
        !self.path().join(point).exists()
    }
}
