//! A `criu` wrapper put first in containerd's PATH (runc runs `criu` from PATH), with
//! failpoints switched by files in its directory, so a test can make CRIU fail mid-way:
//!
//! - `hang`: sleep instead of running CRIU (a CRIU that never returns);
//! - `kill-at`: run CRIU and SIGKILL it once its dump or restore log holds the line the
//!   file names (CRIU dying mid-dump);
//! - `kill-runc-at`: the same, but SIGKILL the runc that runs CRIU (runc dying mid-dump or
//!   mid-restore; the shim then kills CRIU with runc's process group).
//!
//! Pids of the wrapped CRIUs that hung or were killed are appended to `hung.pids` and
//! `killed.pids`, those of the runcs killed to `killed-runc.pids` and of their CRIUs to
//! `criu-of-killed-runc.pids`. Without a failpoint file the installed CRIU runs as is.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{procfs, shim_dir};

/// A CRIU log line written once the dump has started on the task's memory.
pub const MID_DUMP: &str = "Dumping pages (type:";
/// A CRIU log line written as the restore forks the process tree.
pub const MID_RESTORE: &str = "Forking task with";

/// The wrapper's directory (removed on drop: drop the daemon first).
pub struct CriuWrapper {
    dir: tempfile::TempDir,
}

/// A failpoint of the wrapper.
#[derive(Debug, Clone, Copy)]
pub enum CriuFault<'a> {
    /// CRIU sleeps instead of running.
    Hang,
    /// CRIU is SIGKILLed once its log holds this text.
    KillAt(&'a str),
    /// The runc that runs CRIU is SIGKILLed once CRIU's log holds this text.
    KillRuncAt(&'a str),
}

impl CriuWrapper {
    pub fn install() -> CriuWrapper {
        let real = which("criu").expect("criu on PATH");
        let dir = tempfile::Builder::new()
            .prefix("gpucr-criu-wrap-")
            .tempdir()
            .unwrap();
        let d = dir.path().display();
        // `$$` in the watcher is the wrapper's pid, which `exec` hands to CRIU; `$PPID` is
        // the runc that started it. One watcher, two victims.
        let script = format!(
            "#!/bin/sh\n\
             if [ -e '{d}/hang' ]; then echo $$ >> '{d}/hung.pids'; exec sleep 600; fi\n\
             victim=; for fault in kill-at:$$:killed kill-runc-at:$PPID:killed-runc; do\n\
               f=${{fault%%:*}}; rest=${{fault#*:}}\n\
               if [ -e '{d}/'$f ]; then at=$(cat '{d}/'$f); victim=${{rest%%:*}}; record=${{rest#*:}}; fi\n\
             done\n\
             if [ -n \"$victim\" ]; then\n\
               ( i=0; while [ $i -lt 3000 ]; do i=$((i+1))\n\
                   for f in /proc/$$/fd/*; do\n\
                     l=$(readlink \"$f\" 2>/dev/null)\n\
                     case \"$l\" in *.log) if grep -qF \"$at\" \"$l\" 2>/dev/null; then\n\
                       echo $victim >> '{d}/'$record.pids; echo $$ >> '{d}/'criu-of-$record.pids\n\
                       kill -9 $victim; exit 0; fi;; esac\n\
                   done; sleep 0.01; done ) &\n\
             fi\n\
             exec '{}' \"$@\"\n",
            real.display()
        );
        let wrapper = dir.path().join("criu");
        std::fs::write(&wrapper, script).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        CriuWrapper { dir }
    }

    /// containerd's PATH with the wrapper first (then the shim, then this PATH).
    pub fn path_env(&self) -> std::ffi::OsString {
        let mut path = vec![self.dir.path().to_path_buf(), shim_dir().expect("shim dir")];
        path.extend(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        ));
        std::env::join_paths(path).unwrap()
    }

    /// Arms `fault` for the next CRIU runs.
    pub fn arm(&self, fault: CriuFault<'_>) {
        match fault {
            CriuFault::Hang => std::fs::write(self.dir.path().join("hang"), b"").unwrap(),
            CriuFault::KillAt(at) => std::fs::write(self.dir.path().join("kill-at"), at).unwrap(),
            CriuFault::KillRuncAt(at) => {
                std::fs::write(self.dir.path().join("kill-runc-at"), at).unwrap()
            }
        }
    }

    /// The next CRIU runs as installed.
    pub fn disarm(&self) {
        for f in ["hang", "kill-at", "kill-runc-at"] {
            let _ = std::fs::remove_file(self.dir.path().join(f));
        }
    }

    /// Pids recorded in `file` (`hung.pids`, `killed.pids`, `killed-runc.pids`,
    /// `criu-of-killed-runc.pids`).
    pub fn pids(&self, file: &str) -> Vec<i32> {
        std::fs::read_to_string(self.dir.path().join(file))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect()
    }

    /// The CRIUs recorded in `file`, none of which may be alive within `within`.
    pub fn assert_gone(&self, file: &str, within: Duration) {
        let pids = self.pids(file);
        assert!(
            !pids.is_empty(),
            "no CRIU in {file}: the failpoint never fired"
        );
        for p in pids {
            let gone = procfs::wait_gone(&format!("criu {p} of {file} gone"), p, within);
            assert!(gone.is_ok(), "the criu {p} of {file} is still alive");
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

pub fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
